r"""CHOCO-gossip: compressed gossip that keeps the worker average exact.

Placed last in an ``optax.chain`` whose earlier elements produce a local
step ``u_i`` (D-SGD, DAdam, AccumAdam), each worker ``i`` keeps a public copy
``x_hat_i`` of its parameters and ``s_i = sum_j w_ij x_hat_j``, and per step

.. math::

  x_i^{t+1/2} &= x_i^t + u_i^t \\
  q_i &= Q(x_i^{t+1/2} - \hat x_i) \qquad \text{(the only message sent)} \\
  \hat x_i &\leftarrow \hat x_i + q_i, \qquad
  s_i \leftarrow s_i + \textstyle\sum_j w_{ij} q_j \\
  x_i^{t+1} &= x_i^{t+1/2} + \gamma (s_i - \hat x_i)

(``Q`` a :class:`~decentral_jax.comm.compress.Compressor`, ``W = W_t`` the
round of step ``t``, ``gamma`` the consensus step size). With a doubly
stochastic ``W`` the worker mean of ``s`` equals that of ``x_hat``, so the
worker mean of ``x`` moves only by the mean local step, for any
compressor. ``x_hat = s = 0`` at the start (so the first message is
``Q(x^{1/2})``).

Worked example (Koloskova et al.'s update, checked in the tests): a 4-worker
ring with weights 1/3, ``Q`` keeping the largest-magnitude entry, ``gamma =
0.5``, no local step, ``X0 = [[3,0,1],[0,2,0],[-1,0,4],[2,-2,0]]``: after one
round ``x_0 = (2.333333, 0.333333, 1)``; the mean stays ``(1, 0, 1.25)``.

References:
  Koloskova, Stich, Jaggi, `Decentralized Stochastic Optimization and Gossip
  Algorithms with Compressed Communication
  <https://arxiv.org/abs/1902.00340>`_, ICML 2019, Algorithm 2 (CHOCO-SGD).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import compress
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.topology import schedules as topology_lib

PyTree = Any


class ChocoState(NamedTuple):
  """State of :func:`choco_gossip`."""
  count: jax.Array  # shape=(), dtype=int32: steps taken (the round index)
  public: PyTree  # x_hat_i, shapes and dtypes of params
  neighbour_sum: PyTree  # s_i = sum_j w_ij x_hat_j, as params


def _choco_leaf(x_half, x_hat, s, rnd, axis_name, compressor, gamma):
  """One leaf: (x^{t+1}, x_hat, s) after one CHOCO round."""
  acc = jnp.promote_types(x_half.dtype, jnp.float32)
  diff = (x_half.astype(acc) - x_hat.astype(acc)).astype(x_half.dtype)
  payload = compressor.encode(diff)
  q = compressor.decode(payload, diff).astype(acc)
  mixed_q = compress.mix_payload(q, payload, diff, rnd, axis_name,
                                 collectives.index(axis_name), compressor)
  x_hat = x_hat.astype(acc) + q
  s = s.astype(acc) + mixed_q
  x_new = x_half.astype(acc) + gamma * (s - x_hat)
  dt = x_half.dtype
  return x_new.astype(dt), x_hat.astype(dt), s.astype(dt)


def choco_gossip(topology: topology_lib.Topology,
                 compressor: compress.Compressor,
                 consensus_step: float,
                 axis_name: collectives.AxisName = "workers"
                 ) -> optax.GradientTransformationExtraArgs:
  r"""Chain element: CHOCO-gossip of ``x + u`` (see the module docstring).

  Args:
    topology: a static (period 1), doubly stochastic topology. A
      time-varying schedule (one-peer exponential graph, AER) is refused:
      the increments of ``s`` would mix rounds, and in a NumPy check the
      workers then never reach consensus.
    compressor: what is sent (:class:`~decentral_jax.comm.compress.Compressor`).
    consensus_step: ``gamma`` in (0, 1]; smaller for coarser compressors
      (Koloskova et al. tune it per compressor).
    axis_name: worker mesh axis.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with :class:`ChocoState`
    (two parameter-sized buffers); ``update(u, state, params)`` returns
    ``x^{t+1} - x^t`` in the dtypes of ``u`` and must run inside
    ``jax.shard_map`` over ``axis_name``. Floating leaves only.

  Raises:
    ValueError: ``consensus_step`` outside (0, 1], ``topology`` not a
      :class:`~decentral_jax.topology.Topology` (a name such as
      ``"static_ring"`` included), a topology that is not doubly stochastic or not static, a compressor of the wrong type (at
      construction); an integer or bool parameter leaf (``init`` and
      ``update``); ``params`` not given to ``update``, or a worker axis
      whose size is not ``topology.n_workers`` (``update``).
  """
  gamma = checks.check_float("consensus_step", consensus_step, minimum=0.0,
                             maximum=1.0, open_min=True)
  compress.check_compressor(compressor)
  if not isinstance(topology, topology_lib.Topology):
    named = isinstance(topology, str)
    got = f"str {topology!r}" if named else type(topology).__name__
    raise ValueError(
        f"choco_gossip: topology must be a decentral_jax.topology.Topology, "
        f"got {got}; build one with decentral_jax.topology.make("
        f"{topology if named else 'static_ring'!r}, n_workers) (or "
        f"decentral_jax.topology.static_ring(n_workers), torus, ...).")
  if not topology.doubly_stochastic:
    raise ValueError(f"choco_gossip needs a doubly stochastic topology, got "
                     f"{topology.name!r}.")
  if topology.period != 1:
    raise ValueError(
        f"choco_gossip needs a static mixing matrix (period 1), but topology "
        f"{topology.name!r} changes every round (period {topology.period}): "
        "s_i = sum_j w_ij x_hat_j cannot be kept by increments when W "
        "changes, and the workers would not reach consensus; use a static "
        "topology (static_ring, torus, exponential, complete).")

  def init_fn(params):
    gossip.check_float_leaves(params, "choco_gossip")
    zeros = jax.tree.map(jnp.zeros_like, params)
    return ChocoState(jnp.zeros([], jnp.int32), zeros, zeros)

  def update_fn(updates, state, params=None, **unused):
    del unused
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format("choco_gossip"))
    gossip.check_float_leaves(params, "choco_gossip")
    gossip.check_axis(topology, axis_name)
    x_half = jax.tree.map(lambda p, u: (p.astype(jnp.promote_types(
        p.dtype, jnp.float32)) + u).astype(p.dtype), params, updates)

    def round_fn(rnd, x_half, public, nsum):
      out = jax.tree.map(
          lambda a, b, c: _choco_leaf(a, b, c, rnd, axis_name, compressor,
                                      gamma), x_half, public, nsum)
      parts = [jax.tree.map(lambda t, i=i: t[i], out,
                            is_leaf=lambda t: isinstance(t, tuple))
               for i in range(3)]
      return tuple(parts)

    x_new, public, nsum = gossip.map_round(
        round_fn, topology, state.count, x_half, state.public,
        state.neighbour_sum)
    new_updates = jax.tree.map(
        lambda n, p, u: (n.astype(jnp.promote_types(n.dtype, jnp.float32))
                         - p).astype(u.dtype), x_new, params, updates)
    return new_updates, ChocoState(optax.safe_increment(state.count), public,
                                   nsum)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
