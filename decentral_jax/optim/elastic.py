"""DiLoCo and Local SGD with slow and failing workers: quorum, rollback, rejoin.

:func:`elastic_diloco` and :func:`elastic_local_sgd` are
:func:`~decentral_jax.optim.diloco_sync.diloco` and
:func:`~decentral_jax.optim.local_sgd_sync.local_sgd` driven by a live mask
``alive`` and a working mask ``working`` (bool [n], equal on all workers,
from a :class:`decentral_jax.comm.fault_schedule.FaultSchedule`), passed to
``update`` as extra arguments. With ``t`` the group's step count:

* Inner step: worker ``m`` takes it only if ``working_m`` (a straggler
  completes ``H_m <= H`` of a round's ``H`` steps; a skipped step leaves
  its parameters and inner optimizer state untouched) and it is not
  rejoining this step. ``H_m`` counts its steps since the last outer step.
* Outer step (``t % H == 0``): the contributors ``C`` are the live workers
  with ``H_m > 0``. If ``|C| >= min_quorum`` (and, with ``on_failure=
  "rollback"``, no worker failed during the round),
  ``x_bar = sum_{m in C} H_m x_m / sum_{m in C} H_m``, then DiLoCo:
  ``theta <- theta + outer(theta - x_bar)``; Local SGD: ``theta <- x_bar``;
  live workers take ``x_m <- theta`` and restart ``H_m`` at 0 (a dead
  worker's pending steps are not part of the outer step; it keeps them,
  below). Otherwise the outer step is skipped
  (``theta`` and the outer state unchanged) and:

  - ``on_failure="rollback"`` (torchft: a round in which a replica failed,
    or without a quorum, is not committed; the survivors restore the last
    committed parameters and redo the work): live workers take ``x_m <-
    theta`` and the round's inner steps are lost (their inner optimizer
    states are kept);
  - ``on_failure="proceed"`` (Decoupled DiLoCo: learners do not wait for
    each other; what was computed counts): the outer step is still taken
    over the quorum whenever there is one, even if a worker failed during
    the round; below it workers keep their parameters and ``H_m`` and
    contribute at the next outer step.

* Dead workers: parameters, inner state and ``H_m`` frozen. The group's
  state (step count, ``theta``, outer state, Local SGD's last average) is
  advanced on every worker, as if fetched from the group.
* Rejoin (alive now, dead at the previous step): the rejoining worker
  takes no inner step (its gradient was taken at stale parameters); after
  the others' inner steps, ``rejoin="copy_theta"`` sets ``x_m <- theta`` (DiLoCo's global
  parameters, Local SGD's last average), ``"copy_mean"`` the mean of the
  live workers that are not rejoining, ``"keep"`` keeps its stale
  parameters. Its inner optimizer state comes from the first live worker
  that is not rejoining (torchft heals a replica from a healthy one's
  state), or with ``"keep"`` only its integer leaves (step counters, hence
  the learning-rate schedule): never from its own stale counters. When
  every live worker is rejoining (the whole group was dead at the previous
  step) there is no such donor: ``"copy_theta"`` still sets ``x_m <-
  theta`` (group state, held by every worker), ``"copy_mean"`` falls back
  to ``x_m <- theta`` (there is no live mean to copy), and each worker
  keeps its own inner optimizer state. Likewise its ``H_m``: a
  copy holds none of its own inner steps, so ``"copy_theta"`` and
  ``"copy_mean"`` restart it at 0 (the stale steps, whose parameters were
  overwritten, neither weigh in the next outer average nor count as
  useful); ``"keep"`` keeps it with the parameters it counts.

With every worker alive and working at every step each step computes the
operations of ``diloco`` / ``local_sgd`` (the weights ``H_m / H`` are
exactly 1 and the weighted mean is ``mean(x) * 1.0``), but XLA may fuse
the inner step differently around the masks' selects (a product contracted
into an FMA in one program and not the other): the trajectories agree to
float32 rounding carried on by later steps, not bit for bit (measured: at
most 6e-7 over 30 AdamW steps of parameters of size ~3; docs/faults.md).

References:
  Douillard et al., DiLoCo, arXiv 2311.08105; Liu et al., Asynchronous
  Local-SGD Training for Language Modeling, arXiv 2401.09135 (steps in
  proportion to speed); torchft (pytorch/torchft), LocalSGD and DiLoCo
  with quorum and ``should_commit``; Decoupled DiLoCo, arXiv 2604.21428.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives
from decentral_jax.comm import faults
from decentral_jax.comm import gossip
from decentral_jax.optim import diloco_sync
from decentral_jax.optim import local_sgd_sync
from decentral_jax.optim import local_steps
from decentral_jax.optim import arguments
from decentral_jax.optim import transforms

PyTree = Any
ON_FAILURE = ("rollback", "proceed")
REJOIN = ("copy_theta", "copy_mean", "keep")


class ElasticState(NamedTuple):
  """State of :func:`elastic_diloco` / :func:`elastic_local_sgd`.

  ``base`` is the method's own state (a ``DiLoCoState`` holds ``theta``, so
  :func:`~decentral_jax.optim.streaming_sync.global_params` finds it).
  """
  base: Any  # DiLoCoState or LocalSGDState.
  anchor: PyTree  # Local SGD: parameters of the last outer step; DiLoCo: ().
  done: jax.Array  # int32 []: inner steps H_m since the last outer step.
  last_alive: jax.Array  # bool [n]: the previous step's live mask.
  lost: jax.Array  # bool [n]: alive earlier in this round, dead since.
  skipped: jax.Array  # int32 []: outer steps skipped (no quorum, rollback).
  useful: jax.Array  # int32 []: worker inner steps committed by outer steps.


def _check_quorum(quorum: int, n: int, axis_name) -> None:
  if quorum > n:
    raise ValueError(
        f"min_quorum={quorum} is more than the {n} workers of axis "
        f"{axis_name!r}: the outer step would never be taken; use "
        f"min_quorum <= {n}.")


def _check(inner, outer, sync_every, min_quorum, on_failure, rejoin):
  period = local_steps.check_common(inner, sync_every, outer)
  quorum = checks.check_int("min_quorum", min_quorum, minimum=1)
  checks.check_choice("on_failure", on_failure, ON_FAILURE)
  checks.check_choice("rejoin", rejoin, REJOIN)
  return period, quorum


def _masks(alive, working, n: int):
  def one(m, name):
    return jnp.ones(n, bool) if m is None else faults.check_mask(m, n, name)
  a = one(alive, "alive")
  return a, one(working, "working") & a


def _select(pred, new, old):
  return jax.tree.map(lambda y, x: jnp.where(pred, y, x), new, old)


def _rejoin(x, inner_state, done, theta, alive, rejoining, policy, axis_name):
  """Rejoining workers' parameters, inner state and ``H_m`` from the group."""
  me = collectives.index(axis_name)
  donors = alive & ~rejoining
  has_donor = jnp.any(donors)
  take = rejoining[me]  # theta is group state: no donor needed
  take_state = take & has_donor

  def run(operand):
    x, inner_state, done = operand
    first = jnp.argmax(donors)
    state = faults.from_worker(inner_state, first, axis_name,
                               only_int=policy == "keep")
    src = jax.tree.map(lambda t, a: t.astype(a.dtype), theta, x)
    if policy == "copy_mean":  # no donor: theta (module docstring)
      count = jnp.maximum(jnp.sum(donors), 1)
      sums = collectives.psum(jax.tree.map(
          lambda a: jnp.where(donors[me], a, jnp.zeros_like(a)), x), axis_name)
      mean = jax.tree.map(lambda s, a: gossip.match_varying(
          (s / count).astype(a.dtype), a), sums, x)
      src = _select(has_donor, mean, src)
    elif policy == "keep":
      src = x
    if policy != "keep":  # the copy holds none of this worker's steps
      done = jnp.where(take, jnp.zeros_like(done), done)
    return _select(take, src, x), _select(take_state, state, inner_state), done

  return gossip.every(None, jnp.any(rejoining), run, lambda o: o,
                      (x, inner_state, done))


def _weighted_mean(xs, weight, contrib, total, n: int, axis_name):
  """``sum_m w_m x_m / sum_m w_m`` over contributors, as ``mean(w x) * (n /
  sum w)``: with every weight 1 it is ``mean(x) * 1.0``, bit for bit."""
  masked = jax.tree.map(
      lambda a: jnp.where(contrib, weight.astype(a.dtype) * a,
                          jnp.zeros_like(a)), xs)
  scale = jnp.where(total > 0, n / jnp.where(total > 0, total, 1.0),
                    jnp.zeros_like(total))
  return jax.tree.map(lambda m: m * scale.astype(m.dtype),
                      gossip.mean(masked, axis_name))


class _Spec(NamedTuple):
  """The static settings of one elastic transform."""
  inner: Any
  outer: Any  # None: Local SGD.
  period: int
  quorum: int
  rollback: bool
  rejoin: str
  axis_name: Any
  name: str


def _sync(spec: _Spec, a, lost, n: int, operand):
  """The outer step over the contributors (module docstring), or its skip."""
  x, theta, o_state, k, done, skipped, useful = operand
  me = collectives.index(spec.axis_name)
  contrib = a[me] & (done > 0)
  wdtype = jnp.result_type(jnp.float32, *jax.tree.leaves(theta))
  weight = done.astype(wdtype) / spec.period
  total = collectives.psum(jnp.where(contrib, weight, jnp.zeros_like(weight)),
                           spec.axis_name)
  members = collectives.psum(contrib.astype(jnp.int32), spec.axis_name)
  ok = members >= spec.quorum
  if spec.rollback:
    ok = ok & ~jnp.any(lost)
  xs = jax.tree.map(lambda v, t: v.astype(t.dtype), x, theta)
  x_bar = _weighted_mean(xs, weight, contrib, total, n, spec.axis_name)
  if spec.outer is not None:
    pseudo_grad = jax.tree.map(lambda t, m: t - m, theta, x_bar)
    t_new, o_new = local_steps.outer_step(spec.outer, pseudo_grad, o_state,
                                          theta)
  else:
    t_new, o_new = x_bar, o_state
  theta = _select(ok, t_new, theta)
  o_state = _select(ok, o_new, o_state)
  reset = a[me] & (ok | spec.rollback)
  x = _select(reset, jax.tree.map(lambda t, v: t.astype(v.dtype), theta, x),
              x)
  committed = collectives.psum(jnp.where(contrib, done, 0), spec.axis_name)
  useful = useful + jnp.where(ok, committed, 0)
  # Dead workers keep H_m: their pending steps were not committed (with
  # rejoin="keep" their kept parameters still hold them).
  done = jnp.where(reset, jnp.zeros_like(done), done)
  k = jnp.where(ok, optax.safe_increment(k), k)
  skipped = skipped + jnp.where(ok, 0, 1).astype(skipped.dtype)
  return x, theta, o_state, k, done, skipped, useful


def _init(spec: _Spec, params) -> ElasticState:
  gossip.check_float_leaves(params, spec.name)
  n = collectives.size(spec.axis_name)
  _check_quorum(spec.quorum, n, spec.axis_name)
  zero = jnp.zeros([], jnp.int32)
  if spec.outer is not None:
    base = diloco_sync.DiLoCoState(zero, spec.inner.init(params),
                                  local_steps.init_outer(spec.outer, params),
                                  (), ())
    anchor = ()
  else:
    base = local_sgd_sync.LocalSGDState(zero, spec.inner.init(params))
    anchor = jax.tree.map(jnp.asarray, params)
  return ElasticState(base, anchor, zero, jnp.ones(n, bool),
                      jnp.zeros(n, bool), zero, zero)


def _elastic(inner, period: int, quorum: int, on_failure: str, rejoin: str,
             axis_name, outer, name: str) -> optax.GradientTransformationExtraArgs:
  """The transform of both methods (``outer`` None: Local SGD)."""
  diloco = outer is not None
  spec = _Spec(inner, outer, period, quorum, on_failure == "rollback", rejoin,
               axis_name, name)

  def update_fn(updates, state, params=None, *, alive=None, working=None,
                **extra_args):
    del extra_args
    if params is None:
      raise ValueError(arguments.NO_PARAMS.format(name))
    gossip.check_float_leaves(params, name)
    n = collectives.size(axis_name)
    _check_quorum(quorum, n, axis_name)
    a, wk = _masks(alive, working, n)
    me = collectives.index(axis_name)
    base = state.base
    theta = base.theta if diloco else state.anchor
    rejoining = a & ~state.last_alive
    local, s1 = inner.update(updates, base.inner_state, params)
    x1 = optax.apply_updates(params, local)
    stepped = wk[me] & ~rejoining[me]
    x, inner_state = _select(stepped, (x1, s1), (params, base.inner_state))
    done = state.done + stepped.astype(state.done.dtype)
    x, inner_state, done = _rejoin(x, inner_state, done, theta, a, rejoining,
                                   rejoin, axis_name)
    count = optax.safe_increment(base.count)
    lost = state.lost | (state.last_alive & ~a)
    o_state = base.outer.opt_state if diloco else ()
    k = base.outer.count if diloco else jnp.zeros([], jnp.int32)
    taken = count % period == 0
    operand = jax.tree.map(  # both branches: per-worker (varying) types
        lambda v: gossip.match_varying(v, me),
        (x, theta, o_state, k, done, state.skipped, state.useful))
    x, theta, o_state, k, done, skipped, useful = gossip.every(
        period, taken, lambda o: _sync(spec, a, lost, n, o), lambda o: o,
        operand)
    lost = lost & ~taken
    if diloco:
      new_base = diloco_sync.DiLoCoState(
          count, inner_state, local_steps.OuterState(theta, o_state, k),
          (), ())
      anchor = ()
    else:
      new_base = local_sgd_sync.LocalSGDState(count, inner_state)
      anchor = theta
    new = ElasticState(new_base, anchor, done, a, lost, skipped, useful)
    return local_steps.param_delta(x, params), new

  return arguments.per_worker_state(
      lambda params: _init(spec, params), update_fn, extra_args=True)


def elastic_diloco(inner: optax.GradientTransformation, sync_every: int, *,
                   outer: optax.GradientTransformation | None = None,
                   min_quorum: int = 1, on_failure: str = "proceed",
                   rejoin: str = "copy_theta",
                   axis_name: gossip.AxisName = "workers"
                   ) -> optax.GradientTransformationExtraArgs:
  """DiLoCo over the live workers, with a quorum (module docstring).

  Args:
    inner: worker-local optax transform (AdamW in the paper).
    sync_every: the sync period ``H >= 1`` in steps.
    outer: outer optax transform (default Nesterov SGD, lr 0.7, momentum
      0.9, as :func:`~decentral_jax.optim.diloco_sync.diloco`).
    min_quorum: least number of contributors (live workers with ``H_m >
      0``) for an outer step, ``1 <= min_quorum <= n`` (``n`` checked in
      ``init`` and ``update``).
    on_failure: ``"rollback"`` or ``"proceed"``.
    rejoin: ``"copy_theta"``, ``"copy_mean"`` or ``"keep"``.
    axis_name: the worker axis (any: one mesh axis, ``("nodes", "local")``,
      several workers per device).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with :class:`ElasticState`;
    ``update(grads, state, params, alive=a, working=w)`` with ``a``, ``w``
    bool [n] equal on all workers (default: all True), inside
    ``shard_map``.

  Raises:
    ValueError: ``inner`` or ``outer`` not an optax transform, an argument
      outside the ranges above (at construction); an integer or bool
      parameter leaf or ``min_quorum > n`` (in ``init`` and ``update``);
      ``params`` not passed; a mask not bool of shape ``(n,)``.
  """
  collectives.check_axis_name(axis_name)
  period, quorum = _check(inner, outer, sync_every, min_quorum, on_failure,
                          rejoin)
  outer = local_steps.default_outer_optimizer() if outer is None else outer
  return _elastic(inner, period, quorum, on_failure, rejoin, axis_name,
                  outer, "elastic_diloco")


def elastic_local_sgd(inner: optax.GradientTransformation, sync_every: int, *,
                      min_quorum: int = 1, on_failure: str = "proceed",
                      rejoin: str = "copy_theta",
                      axis_name: gossip.AxisName = "workers"
                      ) -> optax.GradientTransformationExtraArgs:
  """Local SGD over the live workers, with a quorum (module docstring).

  ``theta`` is the last committed average (held in the state as
  ``anchor``, in the parameters' dtype: one more copy of the parameters
  than :func:`~decentral_jax.optim.local_sgd_sync.local_sgd`).
  Arguments, returns and errors as :func:`elastic_diloco`.
  """
  collectives.check_axis_name(axis_name)
  period, quorum = _check(inner, None, sync_every, min_quorum, on_failure,
                          rejoin)
  return _elastic(inner, period, quorum, on_failure, rejoin, axis_name, None,
                  "elastic_local_sgd")


def counters(opt_state: optax.OptState) -> dict:
  """``{"faults/useful_steps", "faults/skipped_syncs"}`` (int32 scalars) of
  the first :class:`ElasticState` in ``opt_state``; ``{}`` without one."""
  found = transforms.find_states(opt_state, (ElasticState,))
  if not found:
    return {}
  return {"faults/useful_steps": found[0].useful,
          "faults/skipped_syncs": found[0].skipped}
