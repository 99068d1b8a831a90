"""DiLoCo: inner steps; every ``H`` steps an outer step on the pseudo-gradient.

One transform composed of three injected pieces: the outer optax transform,
the reduction of the pseudo-gradient (:mod:`decentral_jax.optim.reductions`:
exact mean, low-precision mean, compressed mean with error feedback, top-k
gather, gossip round) and the outer-step timing
(:mod:`decentral_jax.optim.outer_timing`: plain, delayed, eager, trickled).
Its state composes one state per concern: the inner optimizer's, the outer
state (:class:`~decentral_jax.optim.local_steps.OuterState`), the
reduction's (error feedback) and the timing's (pseudo-gradients in flight).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import local_steps
from decentral_jax.optim import outer_timing
from decentral_jax.optim import reductions

PyTree = Any


class DiLoCoState(NamedTuple):
  """State of :func:`diloco` (worker-local; see the pieces' docstrings for
  which parts are equal on all workers)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  outer: local_steps.OuterState  # theta, outer optimizer state, k.
  reduction: Any  # the reduction's state: () or reductions.ErrorFeedback.
  timing: Any  # the timing's state: () or outer_timing.InFlight.

  @property
  def theta(self) -> PyTree:
    """The global parameters ``theta`` (float32, or float64)."""
    return self.outer.theta


def check_reduction(reduction) -> reductions.Reduction:
  """``reduction``, or :class:`~decentral_jax.optim.reductions.ExactMean`
  for None.

  Raises:
    ValueError: not a reduction of :mod:`decentral_jax.optim.reductions`.
  """
  if reduction is None:
    return reductions.ExactMean()
  if not isinstance(reduction, reductions.Reduction):
    raise ValueError(
        f"reduction must be a reduction of decentral_jax.optim.reductions "
        f"(ExactMean, LowPrecisionMean, CompressedMean, GossipRound), got "
        f"{reduction!r}.")
  return reduction


def resolve_timing(timing, reduction, period: int | None = None,
                   fragments: int = 1):
  """``timing`` resolved for ``reduction`` (None: ``Plain()``).

  With ``period`` (``H``) given, an overlapped timing is also checked by
  :func:`~decentral_jax.optim.outer_timing.check_in_flight`.

  Raises:
    ValueError: not a timing of :mod:`decentral_jax.optim.outer_timing`;
      an overlapped timing with a compressed reduction; ``trickle=True``
      with a time-varying gossip round; ``latency * period * fragments``
      above ``outer_timing.MAX_IN_FLIGHT_SLICES``.
  """
  if timing is None:
    return outer_timing.Plain()
  if not isinstance(timing, (outer_timing.Plain, outer_timing.Delayed)):
    raise ValueError(
        f"timing must be outer_timing.Plain(), Delayed(...) or Eager(...), "
        f"got {timing!r}.")
  if timing.mode != "none" and isinstance(reduction,
                                          reductions.CompressedMean):
    raise ValueError(
        f"timing={timing!r} (a {timing.mode!r} outer step) has no "
        "compressed form: an overlapped outer step needs the exact mean of "
        "the pseudo-gradients; pass timing=outer_timing.Plain() or an "
        "exact reduction instead of reductions.compressed(...) (runner: "
        "outer_overlap='none' or compression.format='none').")
  if period is not None:
    outer_timing.check_in_flight(timing, period, fragments)
  return timing.resolve(reduction)


def _refuse_complex(params) -> None:
  """Raises ``ValueError`` naming the first complex leaf of ``params``."""
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
      raise ValueError(
          f"diloco: parameter leaf {jax.tree_util.keystr(path)!r} has dtype "
          f"{jnp.result_type(x)}; DiLoCo's theta, pseudo-gradients and "
          "outer step are real floating point: store a complex parameter "
          "as two real leaves (its real and imaginary parts).")


def diloco(inner: optax.GradientTransformation, sync_every: int, *,
           outer: optax.GradientTransformation | None = None,
           reduction: reductions.Reduction | None = None,
           timing=None) -> optax.GradientTransformation:
  r"""DiLoCo: inner steps; every ``H`` steps an outer step on the pseudo-gradient.

  .. math::
    x_i &\leftarrow x_i + \mathrm{inner}(g_i; x_i) \\
    \text{if } t \bmod H = 0:&\ \Delta = \theta - \tfrac1n \textstyle\sum_j x_j,
      \ \theta \leftarrow \theta + \mathrm{outer}(\Delta; \theta),
      \ x_i \leftarrow \theta

  ``theta`` starts at the initial parameters. ``reduction`` forms
  ``Delta`` (the exact mean above by default; a narrow wire dtype, a
  compressor with error feedback, or decentralized DiLoCo's ``k``-th
  gossip round ``Delta_i = theta_i - sum_j W_k[i, j] x_j`` with per-worker
  ``theta_i``: see :mod:`decentral_jax.optim.reductions`). ``timing``
  says when the outer step takes it: :class:`~decentral_jax.optim.
  outer_timing.Plain` (at the sync), ``Delayed(d)`` (``Delta^(k-d)``) or
  ``Eager(d)`` (``Delta^(k-d) + w (Delta_i^(k) - Delta_i^(k-d))`` with
  per-worker ``theta_i``: the evaluated model is their mean), optionally
  trickling the reduction over the next round's inner steps (see
  :mod:`decentral_jax.optim.outer_timing`). With a gossip round the
  delayed and eager timings gossip the pseudo-gradients ``theta_i - x_i``.
  Compressed reductions have only the plain timing.

  Args:
    inner: worker-local optax transform (AdamW in the paper).
    sync_every: the sync period ``H >= 1`` in inner steps.
    outer: the outer optax transform applied to ``Delta`` as a gradient
      (default :func:`~decentral_jax.optim.local_steps.default_outer_optimizer`,
      Nesterov lr 0.7 momentum 0.9); ``optax.sgd(1.0)`` gives Local SGD.
    reduction: a reduction of :mod:`decentral_jax.optim.reductions` (None:
      ``ExactMean("workers")``); it names the worker axis.
    timing: ``outer_timing.Plain()`` (None), ``Delayed(...)`` or
      ``Eager(...)``.

  Returns:
    An ``optax.GradientTransformation`` with :class:`DiLoCoState`;
    ``update`` needs ``params`` and runs inside ``shard_map``. Updates have
    the params' shapes and dtypes.

  Raises:
    ValueError: ``inner`` or ``outer`` not an optax transform,
      ``sync_every`` not an integer >= 1, a bad ``reduction`` or ``timing``
      (:func:`check_reduction`, :func:`resolve_timing`; at construction); an
      integer or bool parameter leaf (in ``init`` and ``update``); a
      complex parameter leaf (in ``init``: theta and the outer step are
      real);
      ``params`` not passed to ``update``.

  References:
    Douillard et al., DiLoCo: Distributed Low-Communication Training of
    Language Models, arXiv 2311.08105 (Alg. 1); Kale, Douillard, Donchev,
    Eager Updates for Overlapped Communication and Computation in DiLoCo,
    arXiv 2502.12996; Sarfi et al., SparseLoCo, arXiv 2508.15706.
  """
  period = local_steps.check_common(inner, sync_every, outer)
  outer = local_steps.default_outer_optimizer() if outer is None else outer
  reduction = check_reduction(reduction)
  timing = resolve_timing(timing, reduction, period)
  loop = outer_timing.OuterLoop(period, outer, reduction)

  def init_fn(params):
    gossip.check_float_leaves(params, "diloco")
    _refuse_complex(params)
    outer_state = local_steps.init_outer(outer, params)
    theta = outer_state.theta
    return DiLoCoState(jnp.zeros([], jnp.int32), inner.init(params),
                       outer_state, reduction.init(theta),
                       timing.init(theta, loop))

  def update_fn(updates, state, params=None):
    x, inner_state = local_steps.inner_step(inner, updates, state.inner_state,
                                            params, "diloco")
    count = optax.safe_increment(state.count)
    x, outer_state, red_state, in_flight = timing.step(
        loop, count, x, state.outer, state.reduction, state.timing)
    return local_steps.param_delta(x, params), DiLoCoState(
        count, inner_state, outer_state, red_state, in_flight)

  return arguments.per_worker_state(init_fn, update_fn)
