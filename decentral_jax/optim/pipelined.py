"""Pipelined gossip: the round sent in step k is mixed in step k+1.

In :func:`decentral_jax.optim.transforms.decentralized` the round of step
``k`` (``W x_k``) must arrive before step ``k``'s update. Here its result
is needed only by step ``k+1``: the collective has the whole of step
``k``'s forward, backward and optimizer update to hide behind, and the
update never waits for it (in a jitted step the round must still arrive
before the step's program ends: docs/pipelined_gossip.md). The price is
one step of staleness in the mixing and one parameter-sized buffer in the
optimizer state.

Recursion (worker ``i``'s local update ``u_k = inner(g(x_k); s_k)``, e.g.
``-lr d_k``; ``W_r`` round ``r % period`` of the mixing schedule)::

  x_{k+1} = s_k + u_k                     (the step: needs no message)
  s_{k+1} = W_{r(k)} x_k + u_k            (the round of x_k, sent in step k)
  s_0 = x_0,   r(k) = floor(k / 2)

so ``x_{k+1} = W_{r(k-1)} x_{k-1} + u_{k-1} + u_k`` for ``k >= 1``: each
step's update is applied to the point the previous step's round mixed,
plus that step's own update. ``s_{k+1}`` is what plain DAdam's ``x_{k+1}``
would have been had step ``k`` waited for its round, and parameter-
dependent parts of ``inner`` (decoupled weight decay) act on ``s_k``.

The worker mean (``W`` doubly stochastic): by induction ``mean(s_k) =
mean(x_k)``, hence ``mean(x_{k+1}) = mean(x_k) + mean(u_k)``, the same
evolution as plain gossip's (and as All-Reduce's with the updates
``u_k``); only the points where the gradients are taken differ. The
disagreement obeys ``x_{k+1} - mean = W (x_{k-1} - mean) + noise``: the
even and the odd steps form two interleaved sequences, each mixed by every
other step's round. The round index ``floor(k / 2)`` walks each sequence
through the whole schedule in order, so the one-peer exponential graph's
exact average after ``log2(n)`` rounds holds for each (after
``2 log2(n)`` steps); with round ``k % period`` an even period would give
each sequence only half the rounds (for ``n = 4`` or 16 one of them would
never reach consensus). The form ``x_{k+1} = x_k + u_k + (W - I) x_{k-1}``
keeps the mean too, but its disagreement ``z_{k+1} = z_k + (w - 1)
z_{k-1}`` does not contract for an exactly averaging round (``w = 0``) and
grows for a negative eigenvalue ``w``.

This is one-step-stale (delayed) gossip in the spirit of overlapped SGP
(Assran et al., `Stochastic Gradient Push for Distributed Deep Learning
<https://arxiv.org/abs/1811.10792>`_, ICML 2019, its overlap variant:
messages mixed one or more iterations after they are sent) and of delayed averaging
(Zhou et al., `DaSGD <https://arxiv.org/abs/2006.00441>`_, 2020: the average
of step ``k - d`` plus the local updates since); overlapped SGP re-weights
stale messages with push-sum weights, DaSGD uses an exact average; the
recursion above is this library's form for doubly stochastic gossip.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms
from decentral_jax.topology import schedules as topology_lib

__all__ = ["PipelinedState", "pipelined_adamw", "pipelined_gossip",
           "round_of_step"]


class PipelinedState(NamedTuple):
  """State of :func:`pipelined_gossip`."""
  count: jax.Array  # shape=(), dtype=int32: step k.
  inner_state: optax.OptState  # the local optimizer's state.
  in_flight: optax.Params  # s_k = W_{r(k-1)} x_{k-1} + u_{k-1} (s_0 = x_0).


def round_of_step(step):
  """``floor(step / 2)``: the schedule's round sent in ``step`` (an int or
  an int32 array; :func:`decentral_jax.comm.gossip.mix` takes it modulo
  the period)."""
  return step // 2


def pipelined_gossip(inner: optax.GradientTransformation,
                     topology: topology_lib.Topology,
                     axis_name: gossip.AxisName = "workers", *,
                     comm_dtype=None, bucket_bytes: int | None = None
                     ) -> optax.GradientTransformation:
  r"""Wraps a local optimizer in pipelined gossip (module docstring).

  ``x_{k+1} = s_k + inner(g(x_k); params=s_k)`` and
  ``s_{k+1} = W_{floor(k/2)} x_k + inner(...)``: D-SGD with
  ``inner = optax.sgd(lr)``, DAdam/AccumAdamW with :func:`pipelined_adamw`.
  The collective reads only ``x_k`` and its result only ``s_{k+1}``.
  Extra argument ``round_index=r`` (a Python int, static): the step
  modulo ``2 x period`` (the round ``floor(r / 2)`` is compiled alone,
  outside any conditional); default: chosen in-graph from the step count.

  Args:
    inner: worker-local optax transform producing the local update.
    topology: mixing schedule; round ``floor(k / 2) % period`` sent at step k.
    axis_name: worker mesh axis (or ``(nodes, local)``).
    comm_dtype: optional floating dtype in which parameters are sent.
    bucket_bytes: largest gossip bucket in bytes (None: the default; 0: one
      collective per leaf); bit-identical results either way.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with
    :class:`PipelinedState` (``in_flight`` has the parameters' shapes and
    dtypes); ``update`` runs inside ``jax.shard_map`` over ``axis_name``
    and returns ``x_{k+1} - x_k`` in the parameter dtype.

  Raises:
    ValueError: ``inner`` not an optax transform, ``topology`` not a
      Topology, ``comm_dtype`` not a floating dtype or ``bucket_bytes``
      invalid (at construction); ``params`` not passed, or the fault masks
      ``alive``/``working``/``rejoining`` given (pipelined gossip does not
      run with faults); errors of :func:`decentral_jax.comm.gossip.mix`.
  """
  collectives.check_axis_name(axis_name)
  arguments.check_transform("inner", inner)
  gossip.check_topology(topology)
  checks.check_comm_dtype(comm_dtype)
  bucket_bytes = gossip.check_bucket_bytes(bucket_bytes)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return PipelinedState(jnp.zeros([], jnp.int32), inner.init(params),
                          jax.tree.map(jnp.array, params))

  def update_fn(updates, state, params=None, *, round_index=None,
                alive=None, working=None, rejoining=None, **extra):
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format("pipelined_gossip"))
    if any(m is not None for m in (alive, working, rejoining)):
      raise ValueError("pipelined_gossip does not run with fault masks "
                       "(alive/working/rejoining); use decentralized.")
    step = transforms.round_step(state, round_index)
    mixed = gossip.mix(params, topology, round_of_step(step), axis_name,
                       comm_dtype=comm_dtype, bucket_bytes=bucket_bytes)
    local, inner_state = inner.update(updates, state.inner_state,
                                      state.in_flight, **extra)
    target = optax.apply_updates(state.in_flight, local)
    in_flight = optax.apply_updates(mixed, local)
    delta = jax.tree.map(lambda t, p: (t - p).astype(p.dtype), target, params)
    return delta, PipelinedState(optax.safe_increment(state.count),
                                 inner_state, in_flight)

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)


def pipelined_adamw(learning_rate: optax.ScalarOrSchedule,
                    topology: topology_lib.Topology, *,
                    axis_name: gossip.AxisName = "workers", comm_dtype=None,
                    bucket_bytes: int | None = None, **adamw
                    ) -> optax.GradientTransformation:
  """DAdam (``accum_steps=1``) / AccumAdamW with pipelined gossip.

  :func:`pipelined_gossip` around :func:`decentral_jax.optim.transforms.
  local_adamw` (the local step of :func:`~decentral_jax.optim.transforms.
  decentralized_adamw`; ``**adamw``: its ``b1, b2, eps, weight_decay,
  mask, accum_steps, mu_dtype, nu_dtype, beta_convention``), so that
  ``x_{k+1} = (1 - lr lambda mask) s_k - lr d_k`` and ``s_{k+1} =
  W_{floor(k/2)} x_k - lr (d_k + lambda mask s_k)``.

  Raises:
    ValueError: those of :func:`~decentral_jax.optim.transforms.
      local_adamw` and :func:`pipelined_gossip`.
  """
  collectives.check_axis_name(axis_name)
  return pipelined_gossip(transforms.local_adamw(learning_rate, **adamw),
                          topology, axis_name, comm_dtype=comm_dtype,
                          bucket_bytes=bucket_bytes)
