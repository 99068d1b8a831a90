"""Outer-step timings of DiLoCo: plain, delayed and eager, trickled reduction.

A timing says when the outer step of a sync takes the reduced
pseudo-gradient: :class:`Plain` waits for the reduction at the sync step
(DiLoCo as published); :class:`Delayed` and :class:`Eager` take the
reduction of ``d`` rounds earlier, so that it can run behind the next
round's inner steps. The reduction itself is a strategy of
:mod:`decentral_jax.optim.reductions`.

Workers ``m = 1..M``; round ``k`` is ``H`` inner steps ending in sync ``k``;
``Delta_m^(k)`` = (worker ``m``'s start point of round ``k``) - (its
parameters after the round), ``Delta^(k)`` their reduction (the worker mean,
or with a gossip topology ``sum_l W[m, l] Delta_l^(k)``), ``Delta^(j) =
Delta_m^(j) = 0`` for ``j <= 0``, ``d >= 1`` the latency in rounds and
``OuterOpt`` the outer optax transform. At sync ``k``:

* ``"delayed"``: ``(theta, s) <- OuterOpt(theta, Delta^(k-d); s)``, masked
  (``jnp.where``) to no change while ``k <= d``; ``x_m <- theta``.
* ``"eager"`` (Kale, Douillard, Donchev 2025, arXiv 2502.12996): each worker
  keeps ``theta_m`` and ``s_m`` and steps on
  ``Delta~_m^(k) = w_m^(k) Delta_m^(k) + (Delta^(k-d) - w_m^(k-d) Delta_m^(k-d))``
  (its fresh own contribution and everyone else's ``d``-round-stale ones),
  with ``w_m^(j)`` the weight of a worker's own term in the reduction of
  sync ``j`` (``1/M`` for the mean: ``Delta~_m^(k) = Delta^(k-d) + (1/M)
  (Delta_m^(k) - Delta_m^(k-d))``; ``W_j[m, m]`` with a topology). Rounds
  ``k <= d`` step on ``w_m Delta_m^(k)`` alone (the paper's first-round
  convention). With ``M = 1`` it is plain DiLoCo bit for bit when each
  compiled program holds one step (one jitted step per call, as the runner
  does, or the steps in a ``lax`` loop); several steps unrolled by a Python
  loop in one jitted program may differ by an ulp (XLA fuses across steps).

Trickled reduction (``trickle=True``) makes the overlap real inside one
jitted SPMD step: the own pseudo-gradients of the last sync are held
flattened (one buffer per dtype), zero-padded to ``H`` slices of ``S =
ceil(L / H)`` elements; inner step ``t`` reduces slice ``(t - 1) % H`` with
one unconditional collective whose input is optimizer state only (no data
dependence on that step's forward/backward, so XLA may run it beside them)
and writes it into the newest reduced buffer; after ``H`` steps, at the next
sync, the whole reduction is there. Every step sends ``|B| / H`` elements;
no collective sits inside a conditional. Without it (``trickle=False``) the
reduction runs at once inside the sync step's conditional, as plain DiLoCo's
does; both give bit-identical results on XLA:CPU (each reduction is
elementwise, the same sums in the same order) with one step per compiled
program or a ``lax`` loop, and may differ by an ulp where a Python loop
unrolls several steps in one jitted program
(``tests/optim/test_outer_timing_program_shape.py``).

The buffers (:class:`InFlight`) live in the optax state and hence in
checkpoints: a run resumes bit-exactly mid-round and at a sync step.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import gossip
from decentral_jax.optim import local_steps

PyTree = Any
TIMINGS = ("none", "delayed", "eager")
# The most slices ``latency * H`` (times the fragments of Streaming DiLoCo)
# an overlapped timing may hold: each buffer is ``[d, H, S]`` with ``S >=
# 1``, so it holds at least ``d * H`` elements whatever the model's size
# (2**26 float32 elements: 256 MiB per buffer).
MAX_IN_FLIGHT_SLICES = 2**26


def check_timing(overlap, latency, trickle, *, one_round: bool = True
                 ) -> tuple[str, int, bool]:
  """Checks ``(overlap, latency, trickle)``; returns them with trickle resolved.

  Args:
    overlap: one of :data:`TIMINGS` (``"none"``: :class:`Plain`).
    latency: ``d``, an int >= 1 (rounds between a sync and the outer step
      that uses its reduction); must be 1 with ``overlap="none"``.
    trickle: None (True when ``overlap`` is not ``"none"`` and
      ``one_round``), True or False.
    one_round: whether the reduction has no conditional around its
      collectives (the exact mean, or a topology with one distinct round).

  Returns:
    ``(overlap, latency, trickle)`` with ``trickle`` a bool.

  Raises:
    ValueError: one line naming the argument: an unknown ``overlap``, a
      ``latency`` not an int >= 1 or not 1 without overlap, ``trickle`` not
      None or a bool, True without overlap or with a time-varying topology.
  """
  overlap = checks.check_choice("overlap", overlap, TIMINGS)
  latency = checks.check_int("latency", latency, minimum=1,
                             maximum=checks.INT32_MAX)
  if trickle is not None and not isinstance(trickle, (bool, np.bool_)):
    raise ValueError(f"trickle must be None, True or False, got {trickle!r}.")
  if overlap == "none":
    if latency != 1 or trickle:
      raise ValueError(
          f"latency={latency} and trickle={trickle} need overlap='delayed' or "
          "'eager' (plain DiLoCo waits for its reduction); leave them unset.")
    return overlap, 1, False
  if trickle and not one_round:
    raise ValueError(
        "trickle=True needs a topology with one distinct round (complete, "
        "exponential, torus, static_ring): a time-varying schedule "
        "selects its round with a conditional around the collectives, which "
        "XLA cannot overlap; pass trickle=False.")
  return overlap, latency, bool(one_round if trickle is None else trickle)


def check_in_flight(timing, period: int, fragments: int = 1) -> None:
  """Refuses an overlapped timing whose buffers cannot be held.

  The pseudo-gradients in flight are ``[d, H, S]`` buffers (``S >= 1``,
  one or two per dtype group and fragment), so ``d * H * fragments`` is
  bounded by :data:`MAX_IN_FLIGHT_SLICES` (``H = 100000`` allows ``d`` up
  to 671). :class:`Plain` holds none and is never refused.

  Raises:
    ValueError: ``latency * sync_every`` (times ``num_fragments``) above
      :data:`MAX_IN_FLIGHT_SLICES`, naming both and the limit.
  """
  if timing.mode == "none":
    return
  slices = timing.latency * period * fragments
  if slices > MAX_IN_FLIGHT_SLICES:
    times = f" x num_fragments={fragments}" if fragments > 1 else ""
    raise ValueError(
        f"timing={timing!r} with sync_every={period}{times}: the "
        f"pseudo-gradients in flight are held as latency x sync_every{times}"
        f" = {slices} slices of at least one element each, above the limit "
        f"{MAX_IN_FLIGHT_SLICES} (2**26); lower latency or sync_every.")


class FlatLayout(NamedTuple):
  """How a pytree is held as ``[H, S]`` buffers, one per dtype.

  Leaves of one dtype are flattened and concatenated in tree order
  (``L`` elements), zero-padded to ``H * S`` with ``S = ceil(L / H)`` and
  reshaped to ``[H, S]``: row ``j`` is slice ``j``.
  """
  treedef: Any
  shapes: tuple  # per leaf
  groups: tuple  # per dtype: (dtype, leaf indices)
  slices: int  # H

  @classmethod
  def of(cls, tree: PyTree, slices: int) -> "FlatLayout":
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = []
    for a in leaves:
      if jnp.result_type(a) not in dtypes:
        dtypes.append(jnp.result_type(a))
    groups = tuple((dt, tuple(i for i, a in enumerate(leaves)
                              if jnp.result_type(a) == dt)) for dt in dtypes)
    return cls(treedef, tuple(jnp.shape(a) for a in leaves), groups,
               int(slices))

  def width(self, group: int) -> int:
    """``S`` of dtype group ``group``."""
    size = sum(math.prod(self.shapes[i]) for i in self.groups[group][1])
    return max(-(-size // self.slices), 1)

  def zeros(self, depth: int) -> tuple:
    """Per group a zero ``[depth, H, S]`` buffer."""
    return tuple(jnp.zeros((depth, self.slices, self.width(g)), dt)
                 for g, (dt, _) in enumerate(self.groups))

  def flatten(self, tree: PyTree) -> tuple:
    """Per group the ``[H, S]`` buffer of ``tree``'s leaves."""
    leaves = self.treedef.flatten_up_to(tree)
    out = []
    for g, (dt, idx) in enumerate(self.groups):
      flat = jnp.concatenate([jnp.ravel(leaves[i]).astype(dt) for i in idx])
      pad = self.slices * self.width(g) - flat.size
      if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), dt)])
      out.append(flat.reshape(self.slices, -1))
    return tuple(out)

  def unflatten(self, buffers) -> PyTree:
    """The pytree whose :meth:`flatten` is ``buffers`` (padding dropped)."""
    leaves = [None] * len(self.shapes)
    for (_, idx), buf in zip(self.groups, buffers):
      flat, start = buf.reshape(-1), 0
      for i in idx:
        size = math.prod(self.shapes[i])
        leaves[i] = flat[start:start + size].reshape(self.shapes[i])
        start += size
    return self.treedef.unflatten(leaves)


class InFlight(NamedTuple):
  """Pseudo-gradients in flight, per dtype group, oldest first.

  ``means[g]``: float ``[d, H, S]``, the reductions ``Delta^(k-d+1..k)``
  after sync ``k`` (with trickle the newest is filled slice by slice during
  round ``k + 1``). ``sent[g]``: ``[e, H, S]``, this worker's own
  ``Delta_m^(k-e+1..k)``, with ``e = d`` for eager, 1 for delayed with
  trickle (the one being reduced) and no buffer (``sent = ()``) otherwise.
  """
  means: tuple
  sent: tuple


def _push(stack, new):
  """``stack[1:]`` then ``new`` (a FIFO of depth ``stack.shape[0]``)."""
  return jnp.concatenate([stack[1:], new[None]], axis=0)


class OuterLoop(NamedTuple):
  """What a timing acts with: bound by the method that uses it.

  Attributes:
    period: ``H``, inner steps per round.
    outer: the outer optax transform.
    reduction: a reduction of :mod:`decentral_jax.optim.reductions`.
    merge_alpha: after the outer step ``x <- alpha x + (1 - alpha) theta``
      (Streaming DiLoCo's merge); 0: ``x <- theta``.
  """
  period: int
  outer: optax.GradientTransformation
  reduction: Any
  merge_alpha: float = 0.0


def _merge(alpha, theta, x):
  """``x <- alpha x + (1 - alpha) theta`` in the dtypes of ``x``."""
  if alpha:
    return jax.tree.map(lambda t, a: (alpha * a.astype(t.dtype)
                                      + (1.0 - alpha) * t).astype(a.dtype),
                        theta, x)
  return local_steps.to_params(theta, x)


class Plain:
  """DiLoCo's outer step as published: at the sync, on the fresh reduction.

  At ``t % H == 0``: ``sent = reduction.send(theta, x)``, ``Delta =
  reduction.delta(theta, sent, k)``, ``theta <- theta + outer(Delta)``,
  ``x <- theta``; the communication sits inside the sync's conditional.
  No state (``init`` gives ``()``).
  """
  mode = "none"

  def __repr__(self):
    return "Plain()"

  def resolve(self, reduction) -> "Plain":
    del reduction
    return self

  def init(self, theta, loop: OuterLoop):
    del theta, loop
    return ()

  def step(self, loop: OuterLoop, count, x, outer: local_steps.OuterState,
           red_state, buffers):
    """Inner step ``count`` (1-based) taken: the sync if ``count % H == 0``.

    Returns ``(x, outer, red_state, buffers)``.
    """

    def sync(operand):
      x, outer, red_state = operand
      sent, red_state = loop.reduction.send(outer.theta, x, red_state)
      pseudo_grad = loop.reduction.delta(outer.theta, sent, outer.count)
      theta, opt_state = local_steps.outer_step(
          loop.outer, pseudo_grad, outer.opt_state, outer.theta)
      outer = local_steps.OuterState(theta, opt_state,
                                     optax.safe_increment(outer.count))
      return local_steps.to_params(theta, x), outer, red_state

    x, outer, red_state = gossip.every(
        loop.period, count % loop.period == 0, sync, lambda o: o,
        (x, outer, red_state))
    return x, outer, red_state, buffers


class Delayed:
  """The outer step on the reduction of ``d`` rounds earlier.

  ``(theta, s) <- OuterOpt(theta, Delta^(k-d); s)`` at sync ``k``, no
  change while ``k <= d``; ``x <- theta`` (module docstring). State:
  :class:`InFlight`.

  Args:
    latency: ``d >= 1``, rounds between a sync and the outer step that
      uses its reduction.
    trickle: spread the reduction over the next round's inner steps, one
      slice per step, outside any conditional (None: yes, unless a
      time-varying gossip round is picked by a conditional, where it is
      refused).

  Raises:
    ValueError: ``latency`` not an int >= 1, ``trickle`` not None or a
      bool (see :func:`check_timing`).
  """
  mode = "delayed"

  def __init__(self, latency: int = 1, trickle: bool | None = None):
    _, self.latency, _ = check_timing(self.mode, latency, trickle)
    self.trickle = trickle

  def __repr__(self):
    return (f"{type(self).__name__}(latency={self.latency}, "
            f"trickle={self.trickle})")

  def resolve(self, reduction):
    """This timing with ``trickle`` a bool for ``reduction``.

    Raises:
      ValueError: ``trickle=True`` with a time-varying gossip round.
    """
    _, _, trickle = check_timing(self.mode, self.latency, self.trickle,
                                 one_round=reduction.one_round)
    return type(self)(self.latency, trickle)

  def init(self, theta, loop: OuterLoop) -> InFlight:
    """Zero buffers (``Delta^(j) = Delta_m^(j) = 0`` for ``j <= 0``)."""
    layout = FlatLayout.of(theta, loop.period)
    depth = self.latency if self.mode == "eager" else int(self.trickle)
    return InFlight(layout.zeros(self.latency),
                    layout.zeros(depth) if depth else ())

  def trickle_step(self, loop: OuterLoop, count_before, k,
                   buffers: InFlight) -> InFlight:
    """Reduces slice ``count_before % H`` of the newest sent buffer.

    One collective of ``S`` elements per dtype group, reading the state
    only; the result goes into row ``count_before % H`` of the newest
    reduced buffer (``lax.dynamic_update_slice``).
    """
    j = collectives.uniform(jnp.asarray(count_before % loop.period,
                                        jnp.int32))
    last = jnp.asarray(self.latency - 1, jnp.int32)
    means = []
    for mean, sent in zip(buffers.means, buffers.sent):
      piece = lax.dynamic_index_in_dim(sent[-1], j, axis=0, keepdims=False)
      reduced = loop.reduction.reduce(
          piece, jnp.maximum(k - 1, 0)).astype(mean.dtype)
      means.append(lax.dynamic_update_slice(
          mean, reduced[None, None], (last, j, jnp.zeros([], jnp.int32))))
    return buffers._replace(means=tuple(means))

  def _direction(self, loop, fresh, stale, buffers, k):
    """The flat pseudo-gradient the outer step takes."""
    if self.mode != "eager":
      return stale
    weight = loop.reduction.own_weight
    return [f * weight(k, f.dtype)
            + (m - s[0] * weight(k - self.latency, f.dtype))
            for f, m, s in zip(fresh, stale, buffers.sent)]

  def sync(self, loop: OuterLoop, x, theta, opt_state, k, buffers: InFlight):
    """Sync ``k + 1`` (``k`` outer steps so far): the outer step, the merge.

    Returns ``(x, theta, opt_state, k + 1, buffers)``.
    """
    layout = FlatLayout.of(theta, loop.period)
    fresh = layout.flatten(
        jax.tree.map(lambda t, a: t - a.astype(t.dtype), theta, x))
    stale = [m[0] for m in buffers.means]
    if self.trickle:  # the newest slot is refilled during the next round
      means = [_push(m, jnp.zeros_like(m[0])) for m in buffers.means]
    else:
      means = [_push(m, loop.reduction.reduce(f, k).astype(m.dtype))
               for m, f in zip(buffers.means, fresh)]
    sent = [_push(s, f) for s, f in zip(buffers.sent, fresh)]
    direction = self._direction(loop, fresh, stale, buffers, k)
    new_theta, new_state = local_steps.outer_step(
        loop.outer, layout.unflatten(direction), opt_state, theta)
    if self.mode == "delayed":  # no outer step before round d + 1
      active = k >= self.latency
      new_theta, new_state = jax.tree.map(
          lambda new, old: jnp.where(active, new, old),
          (new_theta, new_state), (theta, opt_state))
    x = _merge(loop.merge_alpha, new_theta, x)
    return (x, new_theta, new_state, optax.safe_increment(k),
            InFlight(tuple(means), tuple(sent)))

  def advance(self, loop: OuterLoop, count, x, theta, opt_state, k,
              buffers: InFlight):
    """Inner step ``count`` (1-based, taken): the trickle slice, then the sync.

    The sync (no collective inside with trickle) runs in a
    :func:`decentral_jax.comm.gossip.every` conditional on ``count % H ==
    0``. Returns ``(x, theta, opt_state, k, buffers)``.
    """
    if self.trickle:
      buffers = self.trickle_step(loop, count - 1, k, buffers)
    return gossip.every(loop.period, count % loop.period == 0,
                        lambda o: self.sync(loop, *o), lambda o: o,
                        (x, theta, opt_state, k, buffers))

  def step(self, loop: OuterLoop, count, x, outer: local_steps.OuterState,
           red_state, buffers: InFlight):
    """:meth:`advance` on an outer state (``theta``, optax state, ``k``).

    Returns ``(x, outer, red_state, buffers)``.
    """
    x, theta, opt_state, k, buffers = self.advance(
        loop, count, x, outer.theta, outer.opt_state, outer.count, buffers)
    return x, local_steps.OuterState(theta, opt_state, k), red_state, buffers


class Eager(Delayed):
  """Eager updates (Kale, Douillard, Donchev 2025, arXiv 2502.12996).

  Each worker keeps ``theta_m`` and steps on ``Delta~_m^(k) = w_m^(k)
  Delta_m^(k) + (Delta^(k-d) - w_m^(k-d) Delta_m^(k-d))``: its fresh own
  contribution and everyone else's ``d``-round-stale ones (module
  docstring). Arguments and errors as :class:`Delayed`; state
  :class:`InFlight`.
  """
  mode = "eager"


def named(overlap: str = "none", latency: int = 1,
          trickle: bool | None = None):
  """The timing named by ``overlap``: :class:`Plain`, :class:`Delayed` or
  :class:`Eager` with ``latency`` and ``trickle``.

  Raises:
    ValueError: see :func:`check_timing` (e.g. ``latency`` other than 1 or
      ``trickle`` set with ``overlap="none"``).
  """
  overlap, latency, _ = check_timing(overlap, latency, trickle)
  if overlap == "none":
    return Plain()
  return (Delayed if overlap == "delayed" else Eager)(latency, trickle)
