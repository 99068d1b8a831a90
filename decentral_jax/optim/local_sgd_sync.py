"""Local SGD: inner steps, and every ``H`` steps the average of the parameters.

Like the other local-update methods it runs per worker inside
``jax.shard_map`` over the worker axis and returns ``x_{k+1} - x_k`` as
its update; the sync is inside a ``lax.cond`` taken on sync steps only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import diloco_sync
from decentral_jax.optim import local_steps
from decentral_jax.optim import reductions


class LocalSGDState(NamedTuple):
  """State of :func:`local_sgd` (worker-local)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState


def local_sgd(inner: optax.GradientTransformation, sync_every: int, *,
              reduction: reductions.Reduction | None = None
              ) -> optax.GradientTransformation:
  """Local SGD: inner steps, parameter average every ``H`` steps.

  Recursion: ``x_i <- x_i + inner(g_i; x_i)``; if ``t % H == 0``,
  ``x_i <- (1/n) sum_j x_j`` (one all-reduce of the parameters). The inner
  state is never reset. Equals :func:`~decentral_jax.optim.diloco_sync.diloco`
  with outer ``optax.sgd(1.0)``.

  With :class:`~decentral_jax.optim.reductions.LowPrecisionMean` the
  parameters are sent in its ``comm_dtype`` and summed in float32 (float64
  for float64 parameters): ``x_i <- c(sum_j c(x_j) / n)`` with ``c`` the
  rounding to ``comm_dtype`` (the bytes of an all-reduce in
  ``comm_dtype``); every worker holds the same rounded mean afterwards.
  (DiLoCo sends pseudo-gradients instead, which lose less to a narrow
  dtype.) With :class:`~decentral_jax.optim.reductions.CompressedMean`
  Local SGD is run as DiLoCo with outer ``optax.sgd(1.0)`` and that
  reduction (``theta``, the last average, kept in float32, each worker
  sending ``Q(theta - x_i)``; state
  :class:`~decentral_jax.optim.diloco_sync.DiLoCoState`).

  Args:
    inner: worker-local optax transform.
    sync_every: the sync period ``H >= 1`` in steps.
    reduction: ``ExactMean`` (None: over ``"workers"``),
      ``LowPrecisionMean`` or ``CompressedMean``; it names the worker axis.

  Returns:
    An ``optax.GradientTransformation`` with :class:`LocalSGDState`;
    ``update`` needs ``params`` and runs inside ``shard_map``. Updates have
    the params' shapes and dtypes.

  Raises:
    ValueError: ``inner`` not an optax transform, ``sync_every`` not an
      integer >= 1, ``reduction`` not one of the above (at construction);
      an integer or bool parameter leaf (in ``init`` and ``update``: only
      floating leaves can be averaged); ``params`` not passed to
      ``update``.
  """
  period = local_steps.check_common(inner, sync_every)
  reduction = diloco_sync.check_reduction(reduction)
  if isinstance(reduction, reductions.GossipRound):
    raise ValueError("reduction=GossipRound(...): Local SGD averages "
                     "exactly; use diloco(..., reduction=GossipRound(...)).")
  if isinstance(reduction, reductions.CompressedMean):
    return diloco_sync.diloco(inner, period, outer=optax.sgd(1.0),
                             reduction=reduction)

  def init_fn(params):
    gossip.check_float_leaves(params, "local_sgd")
    return LocalSGDState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None):
    x, inner_state = local_steps.inner_step(inner, updates, state.inner_state,
                                            params, "local_sgd")
    count = optax.safe_increment(state.count)
    x = gossip.every(period, count % period == 0, reduction.mean,
                     lambda y: y, x)
    return local_steps.param_delta(x, params), LocalSGDState(count,
                                                             inner_state)

  return arguments.per_worker_state(init_fn, update_fn)
