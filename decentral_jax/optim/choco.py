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

Pipelined CHOCO-gossip (``pipelined=True``): the message that the step
``k - 1`` leaves, ``q_k = Q(x_k - \hat x)``, is sent at the top of step ``k``
and the local step is taken beside it, from ``x_k``:

.. math::

  q_i &= Q(x_i^t - \hat x_i) \qquad \text{(reads only the step's inputs)} \\
  \hat x_i &\leftarrow \hat x_i + q_i, \qquad
  s_i \leftarrow s_i + \textstyle\sum_j w_{ij} q_j \\
  x_i^{t+1} &= x_i^t + u_i^t + \gamma (s_i - \hat x_i)

The permutes carry a function of the parameters and the state the step
receives, never of its gradient, so XLA can run them while the forward
and backward compute (``Q(x_{k+1/2} - x_hat)`` above needs the step's
update: nothing can be in flight with it). What is one step stale: the
consensus term sees the public copies of ``x^t``, not of ``x^t + u^t``
(the local step of step ``t`` is gossiped in step ``t + 1``), as DAdam's
``W x_t + u_t`` is to Koloskova et al.'s ``W (x_t + u_t)``. With the
identity compressor and ``gamma = 1`` it is plain gossip in DAdam's
order, ``x^{t+1} = W x^t + u^t`` (the local step taken at ``x^t``), bit
for bit (below). Forming ``q`` at the top
of step ``t`` gives the values that forming it at the end of step ``t - 1``
and holding it would: no pending message is kept (0 bytes of extra state;
holding it compressed would cost its payload, for int8 ``N (1 + 4 / B)``
bytes per worker for ``N`` values, blocks of ``B``). The state is the
same :class:`ChocoState`.

The worker mean, for doubly stochastic ``W`` and any compressor ``Q``
(both variants): ``x_hat = s = 0`` at the start and every round adds
``q`` to ``x_hat`` and ``W q`` to ``s``, so ``s = W x_hat`` throughout
(in exact arithmetic) and
``mean_i(s_i) = mean_i(x_hat_i)`` (columns of ``W`` sum to 1). The
consensus term ``gamma (s_i - x_hat_i)`` therefore has worker mean 0 and
``mean(x^{t+1}) = mean(x^t) + mean(u^t)``: the mean moves only by the mean
local step, whatever ``Q`` dropped (in floating point, to rounding: the
tests hold it to 1e-10 over 1000 float64 rounds and 300 random steps).

The identity compressor with ``gamma = 1``: then ``x_hat = x`` (the point
sent) and ``x^{t+1} = s``, and the step is computed as plain gossip,
:func:`decentral_jax.comm.gossip.mix` of ``x^t + u^t`` (``W x^t + u^t``
pipelined), with ``x_hat`` and ``s`` set to the point sent and its mix:
the same bits as :func:`decentral_jax.optim.transforms.decentralized`
with ``mix_after_update=True`` (``False`` pipelined) around the same
local step, for float32 and float64 parameters (tested; 16-bit ones are
not checked: the returned difference is rounded in another order). Through the general recursion ``x_hat + (x - x_hat)`` rounds
and the result differs from plain gossip in the last bits (up to
6.7e-16 in float64).

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
  """State of :func:`choco_gossip` (both variants)."""
  count: jax.Array  # shape=(), dtype=int32: steps taken (the round index)
  public: PyTree  # x_hat_i, shapes and dtypes of params
  neighbour_sum: PyTree  # s_i = sum_j w_ij x_hat_j, as params


def _send(x, x_hat, s, rnd, axis_name, compressor):
  """``(x_hat + q, s + W q)`` for ``q = deQ(Q(x - x_hat))``, one leaf, in
  the accumulation dtype (float32 for 16-bit leaves)."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  diff = (x.astype(acc) - x_hat.astype(acc)).astype(x.dtype)
  payload = compressor.encode(diff)
  q = compressor.decode(payload, diff).astype(acc)
  mixed_q = compress.mix_payload(q, payload, diff, rnd, axis_name,
                                 collectives.index(axis_name), compressor)
  return x_hat.astype(acc) + q, s.astype(acc) + mixed_q


def _choco_leaf(x_half, x_hat, s, rnd, axis_name, compressor, gamma):
  """One leaf: (x^{t+1}, x_hat, s) after one CHOCO round."""
  x_hat, s = _send(x_half, x_hat, s, rnd, axis_name, compressor)
  acc = x_hat.dtype
  x_new = x_half.astype(acc) + gamma * (s - x_hat)
  dt = x_half.dtype
  return x_new.astype(dt), x_hat.astype(dt), s.astype(dt)


def _pipelined_leaf(x, u, x_hat, s, rnd, axis_name, compressor, gamma):
  """One leaf of pipelined CHOCO: the round of ``x^t``, then
  ``x^{t+1} = x^t + u^t + gamma (s - x_hat)``."""
  x_hat, s = _send(x, x_hat, s, rnd, axis_name, compressor)
  acc = x_hat.dtype
  x_new = (x.astype(acc) + u.astype(acc)) + gamma * (s - x_hat)
  dt = x.dtype
  return x_new.astype(dt), x_hat.astype(dt), s.astype(dt)


def _check_topology(topology) -> None:
  """A static, doubly stochastic :class:`Topology` (else ``ValueError``)."""
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


def _split(out, parts: int):
  """A tree of ``parts``-tuples as ``parts`` trees."""
  return tuple(jax.tree.map(lambda t, i=i: t[i], out,
                            is_leaf=lambda t: isinstance(t, tuple))
               for i in range(parts))


def _general_round(topology, axis_name, compressor, gamma, pipelined):
  """``(updates, state, params) -> (x^{t+1}, x_hat, s)``: the recursion of
  the module docstring, every leaf through :func:`_send`."""

  def round_fn(rnd, x, u, public, nsum):
    if pipelined:
      out = jax.tree.map(lambda a, b, c, d: _pipelined_leaf(
          a, b, c, d, rnd, axis_name, compressor, gamma), x, u, public, nsum)
    else:
      out = jax.tree.map(lambda a, c, d: _choco_leaf(
          a, c, d, rnd, axis_name, compressor, gamma), x, public, nsum)
    return _split(out, 3)

  def step(updates, state, params):
    x = params if pipelined else jax.tree.map(
        lambda p, u: (p.astype(jnp.promote_types(p.dtype, jnp.float32))
                      + u).astype(p.dtype), params, updates)
    return gossip.map_round(round_fn, topology, state.count, x, updates,
                            state.public, state.neighbour_sum)

  return step


def _exact_round(topology, axis_name, pipelined):
  """The identity compressor with ``gamma = 1``: plain gossip's arithmetic
  (``x_hat`` the point sent, ``s`` its mix; module docstring)."""

  def step(updates, state, params):
    if pipelined:
      mixed = gossip.mix(params, topology, state.count, axis_name)
      return optax.apply_updates(mixed, updates), params, mixed
    sent = optax.apply_updates(params, updates)
    mixed = gossip.mix(sent, topology, state.count, axis_name)
    return mixed, sent, mixed

  return step


def choco_gossip(topology: topology_lib.Topology,
                 compressor: compress.Compressor,
                 consensus_step: float,
                 axis_name: collectives.AxisName = "workers", *,
                 pipelined: bool = False
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
    pipelined: send the round of the step's input ``x^t`` (the message the
      previous step left), so that it can be in flight during the forward
      and backward, and step ``x^{t+1} = x^t + u^t + gamma (s - x_hat)``
      (module docstring); default False, Koloskova et al.'s order.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with :class:`ChocoState`
    (two parameter-sized buffers, either variant); ``update(u, state,
    params)`` returns ``x^{t+1} - x^t`` in the dtypes of ``u`` and must run
    inside ``jax.shard_map`` over ``axis_name``. Floating leaves only.

  Raises:
    ValueError: ``consensus_step`` outside (0, 1], ``topology`` not a
      :class:`~decentral_jax.topology.Topology` (a name such as
      ``"static_ring"`` included), a topology that is not doubly
      stochastic or not static, a compressor of the wrong type,
      ``pipelined`` not a bool (at construction); an integer or bool
      parameter leaf (``init`` and ``update``); ``params`` not given to
      ``update``, or a worker axis whose size is not ``topology.n_workers``
      (``update``).
  """
  collectives.check_axis_name(axis_name)
  gamma = checks.check_float("consensus_step", consensus_step, minimum=0.0,
                             maximum=1.0, open_min=True)
  compress.check_compressor(compressor)
  checks.check_bool("pipelined", pipelined)
  _check_topology(topology)
  if compressor.is_identity and gamma == 1.0:
    step = _exact_round(topology, axis_name, pipelined)
  else:
    step = _general_round(topology, axis_name, compressor, gamma, pipelined)

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
    x_new, public, nsum = step(updates, state, params)
    new_updates = jax.tree.map(
        lambda n, p, u: (n.astype(jnp.promote_types(n.dtype, jnp.float32))
                         - p).astype(u.dtype), x_new, params, updates)
    return new_updates, ChocoState(optax.safe_increment(state.count), public,
                                   nsum)

  return arguments.per_worker_state(init_fn, update_fn, extra_args=True)
