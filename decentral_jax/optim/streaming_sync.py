"""Streaming DiLoCo: fragments synchronised in turn, overlapped, merged.

Douillard et al. 2025 (arXiv 2501.18512): the parameter leaves are split
into ``P`` fragments; fragment ``p`` synchronises when ``t % H == (p H //
P) % H``, with its own outer state; with overlap ``tau >= 1`` the outer
result is merged ``tau`` inner steps later, ``x_p <- alpha x_p + (1 -
alpha) theta_p``, from what was sent at the sync step (held in the state;
its reduction depends only on the state, so XLA can run it during the merge
step's forward/backward). With ``P = 1, tau = 0, alpha = 0`` it is DiLoCo.
The reduction (:mod:`decentral_jax.optim.reductions`) and the outer-step
timing (:mod:`decentral_jax.optim.outer_timing`) are injected as in
:func:`decentral_jax.optim.diloco_sync.diloco`, per fragment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from decentral_jax import checks
from decentral_jax.comm import gossip
from decentral_jax.optim import arguments
from decentral_jax.optim import diloco_sync
from decentral_jax.optim import local_steps
from decentral_jax.optim import outer_timing
from decentral_jax.optim import reductions

PyTree = Any


def default_fragments(params: PyTree, num_fragments: int) -> PyTree:
  """Fragment id of every leaf: consecutive leaves, balanced by size.

  Leaves are taken in ``jax.tree.leaves`` order (for Flax models: by module
  name, so roughly by layer) and cut into ``num_fragments`` contiguous runs
  of about equal parameter count; each run has at least one leaf.

  Returns:
    A pytree of Python ints in ``[0, num_fragments)`` like ``params``.

  Raises:
    ValueError: ``num_fragments`` not an int, or more fragments than leaves.
  """
  leaves, treedef = jax.tree.flatten(params)
  p = checks.check_int("num_fragments", num_fragments, minimum=1)
  if p > len(leaves):
    raise ValueError(f"num_fragments={num_fragments} must be in [1, "
                     f"{len(leaves)}] (the number of parameter leaves).")
  sizes = np.array([max(int(np.prod(np.shape(x))), 1) for x in leaves], float)
  cum = np.cumsum(sizes)
  ids, start = [], 0
  for frag in range(p):
    if frag == p - 1:
      end = len(leaves)
    else:  # up to the leaf that reaches (frag + 1) / P of the parameters
      end = int(np.searchsorted(cum, (frag + 1) * cum[-1] / p)) + 1
      end = min(max(end, start + 1), len(leaves) - (p - 1 - frag))
    ids += [frag] * (end - start)
    start = end
  return jax.tree.unflatten(treedef, ids)


def check_fragments(fragments: PyTree, params: PyTree,
                    num_fragments: int) -> list[int]:
  """Validates a fragment assignment; returns the flat list of ids.

  Raises:
    ValueError: the structure differs from ``params``, an id is not an int
      in ``[0, num_fragments)`` (the message names its leaf), or a fragment
      has no leaf.
  """
  num_fragments = checks.check_int("num_fragments", num_fragments, minimum=1)
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  try:
    ids = treedef.flatten_up_to(fragments)
  except (ValueError, TypeError) as e:
    raise ValueError(f"fragments must have the structure of the parameters "
                     f"(one int per leaf): {e}") from None
  ids = [checks.check_int(f"fragments{jax.tree_util.keystr(path)}", i,
                          minimum=0, maximum=num_fragments - 1)
         for (path, _), i in zip(paths, ids)]
  empty = sorted(set(range(num_fragments)) - set(ids))
  if empty:
    raise ValueError(f"fragments {empty} have no parameter leaf; every "
                     "fragment needs at least one (lower num_fragments).")
  return ids


#: The most fragments: each holds at least one parameter leaf, and the
#: schedule is built as a list (2**30 fragments never finished).
MAX_FRAGMENTS = 2**16


def fragment_offsets(sync_every: int, num_fragments: int) -> list[int]:
  """The send offset ``o_p = (p H // P) % H`` of each fragment ``p``:
  fragment ``p`` is sent at the inner steps ``t >= max(o_p, 1)`` with ``t %
  H == o_p``; distinct offsets in ``[0, H)``, e.g. ``(4, 2) -> [0, 2]``.

  Raises:
    ValueError: ``sync_every`` (``H``) not an int in ``[1, 2**31 - 1]`` or
      ``num_fragments`` (``P``) not an int in ``[1, min(H,``
      :data:`MAX_FRAGMENTS` ``)]`` (``P > H`` would give two fragments the
      same offset).
  """
  period = checks.check_int("sync_every", sync_every, minimum=1,
                           maximum=checks.INT32_MAX)
  p_count = checks.check_int("num_fragments", num_fragments, minimum=1,
                             maximum=MAX_FRAGMENTS)
  if p_count > period:
    raise ValueError(f"num_fragments={num_fragments!r} must be in [1, "
                     f"sync_every={period}].")
  return [(p * period // p_count) % period for p in range(p_count)]


class Pending(NamedTuple):
  """The plain timing's state of :func:`streaming_diloco`: per fragment,
  what was sent and awaits its merge (the parameters ``x``, or the
  pseudo-gradients ``theta - x`` for a reduction that sends those), like
  ``theta``."""
  sent: optax.Params


class FragmentRounds(NamedTuple):
  """One fragment's state under a delayed or eager timing."""
  outer_count: jax.Array  # int32 []: this fragment's outer steps taken.
  in_flight: outer_timing.InFlight


class StreamingDiLoCoState(NamedTuple):
  """State of :func:`streaming_diloco` (equal on every worker except
  ``inner_state``, the reduction's residuals and, with eager timing,
  ``theta``)."""
  count: jax.Array  # int32 []: inner steps taken t.
  inner_state: optax.OptState
  theta: optax.Params  # global parameters (float32), every fragment.
  outer_states: tuple  # one outer state per fragment (over its leaves).
  reduction: Any  # () or reductions.ErrorFeedback (like theta).
  timing: Any  # Pending (plain timing) or a FragmentRounds per fragment.


def _check_streaming(period: int, num_fragments, overlap_steps,
                     merge_alpha) -> tuple[int, int, float]:
  """``(P, tau, alpha)`` of :func:`streaming_diloco`, checked against ``H``."""
  p_count = len(fragment_offsets(period, num_fragments))
  tau = checks.check_int("overlap_steps", overlap_steps, minimum=0)
  if tau * p_count >= period:
    raise ValueError(
        f"overlap_steps={overlap_steps!r} must be an integer with 0 <= tau "
        f"and tau * num_fragments < sync_every ({p_count} * tau < {period}), "
        "so a fragment is merged before the next one is sent.")
  return p_count, tau, checks.check_probability("merge_alpha", merge_alpha)


def _select(pred, new, old):
  return lax.cond(pred, lambda new, old: new, lambda new, old: old, new, old)


class _FragmentSync(NamedTuple):
  """Send and merge of one fragment under the plain timing."""
  loop: outer_timing.OuterLoop
  tau: int

  def step(self, count, offset, xs, ts, ss, o_state, red_state):
    """One inner step's send (at ``t % H == o_p``) and merge (``tau`` later).

    Returns the fragment's ``(x, theta, sent, outer state, reduction
    state)`` leaves (the reduction's residuals updated at the send).
    """
    period, tau, alpha = self.loop.period, self.tau, self.loop.merge_alpha
    reduction = self.loop.reduction
    sent = (count % period == offset) & (count >= max(offset, 1))
    merged = (count % period == (offset + tau) % period) & (
        count >= max(offset, 1) + tau)
    kept, new_red = reduction.send(ts, xs, red_state)
    if isinstance(red_state, reductions.ErrorFeedback):
      red_state = _select(sent, new_red, red_state)
    # Send: keep what this worker sends (no communication yet).
    ss = _select(sent, kept, ss)

    def merge(operand):
      xs, ts, ss, o_state = operand
      ts, o_state = local_steps.outer_step(
          self.loop.outer, reduction.delta(ts, ss, 0), o_state, ts)
      xs = [(alpha * a.astype(t.dtype) + (1.0 - alpha) * t).astype(a.dtype)
            for a, t in zip(xs, ts)]
      return xs, ts, ss, o_state

    return (*gossip.every(period, merged, merge, lambda o: o,
                          (xs, ts, ss, o_state)), red_state)


def _parts(flat, ids, p_count):
  """Per fragment the leaves of ``flat`` it holds."""
  return [[flat[j] for j, i in enumerate(ids) if i == p]
          for p in range(p_count)]


def _put(flat, ids, p, values):
  """Writes fragment ``p``'s ``values`` back into the list ``flat``."""
  for j, v in zip([j for j, i in enumerate(ids) if i == p], values):
    flat[j] = v


def streaming_diloco(inner: optax.GradientTransformation, sync_every: int, *,
                     num_fragments: int = 1, fragments: PyTree = None,
                     overlap_steps: int = 0, merge_alpha: float = 0.0,
                     outer: optax.GradientTransformation | None = None,
                     reduction: reductions.Reduction | None = None,
                     timing=None) -> optax.GradientTransformation:
  r"""Streaming DiLoCo: fragments synchronised in turn, overlapped, merged.

  Fragment ``p`` (offset ``o_p = p H // P``) is sent at the steps with
  ``t % H == o_p % H`` (``t >= 1``) and merged ``tau`` steps later:

  .. math::
    \text{send } (t):&\ s_{i,p} = x_{i,p} \quad (\text{kept in the state}) \\
    \text{merge } (t + \tau):&\ \Delta_p = \theta_p - \tfrac1n \textstyle\sum_j s_{j,p},
      \ \theta_p \leftarrow \theta_p + \mathrm{outer}_p(\Delta_p),
      \ x_{i,p} \leftarrow \alpha x_{i,p} + (1-\alpha)\theta_p

  where ``x_{i,p}`` at the merge already includes the ``tau`` inner steps
  since the send. The reduction's ``send`` gives ``s`` and its ``delta``
  forms ``Delta_p`` at the merge: with the exact mean one all-reduce per
  merge; with :class:`~decentral_jax.optim.reductions.LowPrecisionMean` the
  state holds the pseudo-gradient ``theta_p - x_{i,p}`` (small values,
  better suited to a narrow dtype), sent in ``comm_dtype`` and summed in
  float32; with :class:`~decentral_jax.optim.reductions.CompressedMean` it
  holds ``beta e + theta_p - x_{i,p}`` (the residual updated at the send),
  averaged compressed at the merge.

  A ``Delayed`` or ``Eager`` timing (with ``tau = 0``) gives each fragment
  the outer step of :func:`~decentral_jax.optim.diloco_sync.diloco` with that
  timing, on its own rounds (sync ``k`` of fragment ``p`` at ``t = o_p + k
  H``, or ``k H`` for ``o_p = 0``), merged with ``alpha``; with trickle
  every inner step reduces one ``1/H`` slice of every fragment's pending
  pseudo-gradients (see :mod:`decentral_jax.optim.outer_timing`).

  Args:
    inner: worker-local optax transform.
    sync_every: ``H >= 1``, the sync period of every fragment.
    num_fragments: ``P``, with ``1 <= P <= H`` and at most the number of
      leaves.
    fragments: optional pytree of ints (fragment id per leaf); default
      :func:`default_fragments`.
    overlap_steps: ``tau``, with ``0 <= tau`` and ``tau * P < H``.
    merge_alpha: ``alpha`` in ``[0, 1]`` (0: take the outer result).
    outer: outer optax transform per fragment (default Nesterov, lr 0.7,
      momentum 0.9).
    reduction: ``ExactMean`` (None: over ``"workers"``),
      ``LowPrecisionMean`` or ``CompressedMean`` (a single axis name).
    timing: ``outer_timing.Plain()`` (None), ``Delayed(...)`` or
      ``Eager(...)``, per fragment.

  Returns:
    An ``optax.GradientTransformation`` with :class:`StreamingDiLoCoState`.

  Raises:
    ValueError: at construction, any argument outside the ranges above
      (``num_fragments`` or ``overlap_steps`` not an int, e.g. 2.5;
      ``merge_alpha`` an array: under ``optax.inject_hyperparams`` it must
      be listed in ``static_args``), ``inner`` or ``outer`` not an optax
      transform, a gossip reduction, ``overlap_steps > 0`` with an
      overlapped timing, a bad ``reduction`` or ``timing`` (see
      :func:`~decentral_jax.optim.diloco_sync.resolve_timing`); in ``init`` and
      ``update``, a fragment assignment that misses a fragment or a leaf,
      an integer or bool parameter leaf, ``params`` not passed.

  References:
    Douillard et al., Streaming DiLoCo with overlapping communication,
    arXiv 2501.18512 (Alg. 1, 2).
  """
  period = local_steps.check_common(inner, sync_every, outer)
  p_count, tau, alpha = _check_streaming(period, num_fragments, overlap_steps,
                                         merge_alpha)
  reduction = diloco_sync.check_reduction(reduction)
  if isinstance(reduction, reductions.GossipRound):
    raise ValueError("reduction=GossipRound(...): Streaming DiLoCo reduces "
                     "over all workers; use ExactMean or LowPrecisionMean.")
  timing = diloco_sync.resolve_timing(timing, reduction, period, p_count)
  outer = local_steps.default_outer_optimizer() if outer is None else outer
  loop = outer_timing.OuterLoop(period, outer, reduction, alpha)
  offsets = fragment_offsets(period, p_count)

  def ids_of(params):
    frag = (default_fragments(params, p_count) if fragments is None
            else fragments)
    return check_fragments(frag, params, p_count)

  if timing.mode != "none" and tau:
    raise ValueError(
        f"overlap_steps={tau} and overlap={timing.mode!r} both hide the "
        "reduction behind inner steps; use one (overlap_steps=0).")

  def init_fn(params):
    gossip.check_float_leaves(params, "streaming_diloco")
    ids = ids_of(params)
    theta = local_steps.global_copy(params)
    frags = _parts(jax.tree.leaves(theta), ids, p_count)
    zero = jnp.zeros([], jnp.int32)
    if timing.mode == "none":
      timing_state = Pending(optax.tree.zeros_like(theta))
    else:
      timing_state = tuple(FragmentRounds(zero, timing.init(t, loop))
                           for t in frags)
    return StreamingDiLoCoState(zero, inner.init(params), theta,
                                tuple(outer.init(t) for t in frags),
                                reduction.init(theta), timing_state)

  step = _plain_step if timing.mode == "none" else _overlapped_step

  def update_fn(updates, state, params=None):
    x, inner_state = local_steps.inner_step(inner, updates, state.inner_state,
                                            params, "streaming_diloco")
    count = optax.safe_increment(state.count)
    x_flat, treedef = jax.tree.flatten(x)
    theta, outer_states, red_state, timing_state = step(
        loop, timing, tau, offsets, ids_of(params), count, x_flat,
        jax.tree.leaves(state.theta), state)
    new_state = StreamingDiLoCoState(
        count, inner_state, treedef.unflatten(theta), outer_states,
        red_state, timing_state)
    return local_steps.param_delta(treedef.unflatten(x_flat),
                                   params), new_state

  return arguments.per_worker_state(init_fn, update_fn)


def _plain_step(loop, timing, tau, offsets, ids, count, x_flat, theta,
                state):
  """Every fragment's send and merge under the plain timing (updates
  ``x_flat`` in place); returns the new theta leaves and state parts."""
  del timing
  p_count = len(offsets)
  fragment = _FragmentSync(loop, tau)
  sent = jax.tree.leaves(state.timing.sent)
  feedback = isinstance(state.reduction, reductions.ErrorFeedback)
  err = jax.tree.leaves(state.reduction.error) if feedback else None
  outer_states = list(state.outer_states)
  for p in range(p_count):
    part = lambda flat: _parts(flat, ids, p_count)[p]  # noqa: E731
    red = reductions.ErrorFeedback(part(err)) if feedback else ()
    xs, ts, ss, outer_states[p], red = fragment.step(
        count, offsets[p], part(x_flat), part(theta), part(sent),
        outer_states[p], red)
    for flat, values in ((x_flat, xs), (theta, ts), (sent, ss)):
      _put(flat, ids, p, values)
    if feedback:
      _put(err, ids, p, red.error)
  treedef = jax.tree.structure(state.theta)
  red_state = (reductions.ErrorFeedback(treedef.unflatten(err)) if feedback
               else state.reduction)
  return (theta, tuple(outer_states), red_state,
          Pending(treedef.unflatten(sent)))


def _overlapped_step(loop, timing, tau, offsets, ids, count, x_flat, theta,
                     state):
  """Every fragment's delayed or eager outer step (updates ``x_flat`` in
  place); fragment ``p`` runs the timing with its own step count ``t -
  o_p`` (``+ H`` for ``o_p > 0``), so that its syncs fall at ``t % H ==
  o_p`` from ``t = o_p`` on, as with the plain timing."""
  del tau
  period, p_count = loop.period, len(offsets)
  outer_states, rounds = list(state.outer_states), list(state.timing)
  for p in range(p_count):
    local = count - offsets[p] + (period if offsets[p] else 0)
    xs, ts, outer_states[p], k, in_flight = timing.advance(
        loop, local, _parts(x_flat, ids, p_count)[p],
        _parts(theta, ids, p_count)[p], outer_states[p],
        rounds[p].outer_count, rounds[p].in_flight)
    rounds[p] = FragmentRounds(k, in_flight)
    _put(x_flat, ids, p, xs)
    _put(theta, ids, p, ts)
  return theta, tuple(outer_states), state.reduction, tuple(rounds)


def global_params(opt_state: optax.OptState) -> PyTree | None:
  """``theta`` of the first DiLoCo-family state found in ``opt_state``,
  else None.

  The parameters to evaluate as "the averaged model" of a DiLoCo run (with
  eager timing, this worker's ``theta_i``: the model is their mean).
  Finds :class:`~decentral_jax.optim.diloco_sync.DiLoCoState` (also inside an
  elastic state) and :class:`StreamingDiLoCoState`.
  """
  return local_steps.find_theta(opt_state, (diloco_sync.DiLoCoState,
                                            StreamingDiLoCoState))
