"""DiLoCo and Local SGD over slow and failing workers (optim.elastic).

Worker ``i`` minimises ``||x - b_i||^2 / 2`` with inner SGD; the oracle
re-implements the quorum, rollback, straggler and rejoin rules in float64
NumPy from their definitions, one worker at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import parallel
from decentral_jax.optim import elastic
from decentral_jax import optim

LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9
N, H, STEPS = 4, 3, 12


def _masks():
  """Worker 3 dead for t = 2..4 (back at t = 5, mid-round); worker 2 works
  on even t only (half speed); worker 1 dead at t = 8 only."""
  alive = np.ones((STEPS, N), bool)
  alive[1:4, 3] = False
  alive[7, 1] = False
  working = alive.copy()
  working[0::2, 2] = False  # index 0 is t = 1
  return alive, working


def _run(tx, x0, b, alive=None, working=None, steps=STEPS, per_device=1):
  n = b.shape[0]
  mesh = parallel.make_mesh(n, workers_per_device=per_device)

  def step(params, state, target, a, w):
    grads = params - target
    kw = {} if a is None else {"alive": a, "working": w}
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  if alive is None:
    fn = jax.jit(parallel.per_worker(
        lambda p, s, t: step(p, s, t, None, None), mesh))
  else:
    fn = jax.jit(parallel.per_worker(step, mesh, replicated_argnums=(3, 4)))
  params = parallel.shard(x0, mesh)
  target = parallel.shard(b, mesh)
  state = jax.jit(parallel.per_worker(tx.init, mesh))(params)
  out, states = [], []
  for k in range(steps):
    args = () if alive is None else (jnp.asarray(alive[k]),
                                     jnp.asarray(working[k]))
    params, state = fn(params, state, target, *args)
    out.append(np.asarray(params))
    states.append(jax.device_get(state))
  return out, states


def _problem(n=N, seed=0, dtype=np.float64):
  rng = np.random.default_rng(seed)
  x0 = np.repeat(rng.normal(size=(1, 3)), n, 0).astype(dtype)
  return x0, rng.normal(size=(n, 3)).astype(dtype)


def _oracle(x0, b, alive, working, *, quorum=1, on_failure="proceed",
            rejoin="copy_theta", local_sgd=False):
  n = len(b)
  x = x0.astype(np.float64).copy()
  theta, trace = x[0].copy(), np.zeros_like(x[0])
  done, last, lost = np.zeros(n, int), np.ones(n, bool), np.zeros(n, bool)
  out, skipped = [], 0
  for t in range(1, len(alive) + 1):
    a, w = alive[t - 1], working[t - 1] & alive[t - 1]
    rej = a & ~last
    for m in range(n):
      if w[m] and not rej[m]:
        x[m] = x[m] - LR * (x[m] - b[m])
        done[m] += 1
    donors = a & ~rej
    # copy_mean without a donor (whole group back at once) takes theta.
    fresh = x[donors].mean(0) if donors.any() else theta
    for m in np.flatnonzero(rej):
      if rejoin == "copy_theta":  # theta is group state: no donor needed
        x[m], done[m] = theta, 0  # a copy holds none of its own steps
      elif rejoin == "copy_mean":
        x[m], done[m] = fresh, 0
    lost |= last & ~a
    if t % H == 0:
      c = a & (done > 0)
      ok = c.sum() >= quorum and not (on_failure == "rollback" and lost.any())
      if ok:
        x_bar = (done[c, None] * x[c]).sum(0) / done[c].sum()
        if local_sgd:
          theta = x_bar
        else:
          g = theta - x_bar
          trace = g + MOMENTUM * trace
          theta = theta - OUTER_LR * (g + MOMENTUM * trace)
      else:
        skipped += 1
      if ok or on_failure == "rollback":
        x[a] = theta
        done[a] = 0  # dead workers keep theirs (frozen)
      lost[:] = False
    last = a
    out.append(x.copy())
  return out, skipped


def _make(method, **kw):
  if method == "diloco":
    return elastic.elastic_diloco(optax.sgd(LR), H, **kw)
  return elastic.elastic_local_sgd(optax.sgd(LR), H, **kw)


# Three cases in the fast tier (each method, failure mode and rejoin rule at
# least once), the other nine in the full suite.
_FAST = {("diloco", "proceed", "copy_theta"), ("diloco", "rollback", "copy_mean"),
         ("local_sgd", "rollback", "keep")}
ORACLE_CASES = [
    pytest.param(m, f, r, marks=() if (m, f, r) in _FAST else pytest.mark.slow)
    for m in ("diloco", "local_sgd") for f in ("proceed", "rollback")
    for r in ("copy_theta", "copy_mean", "keep")]


@pytest.mark.parametrize("method,on_failure,rejoin", ORACLE_CASES)
def test_matches_oracle(method, on_failure, rejoin, x64):
  del x64
  require_devices(N)
  x0, b = _problem()
  alive, working = _masks()
  got, states = _run(_make(method, on_failure=on_failure, rejoin=rejoin),
                     x0, b, alive, working)
  want, skipped = _oracle(x0, b, alive, working, on_failure=on_failure,
                          rejoin=rejoin, local_sgd=method == "local_sgd")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
  assert int(states[-1].skipped[0]) == skipped
  # Rollback loses the rounds with a failure (t = 2..4 and t = 8).
  assert skipped == (2 if on_failure == "rollback" else 0)


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_below_quorum_skips_the_outer_step(method, x64):
  del x64
  require_devices(N)
  x0, b = _problem(seed=1)
  alive, working = _masks()
  tx = _make(method, min_quorum=N)
  got, states = _run(tx, x0, b, alive, working)
  want, skipped = _oracle(x0, b, alive, working, quorum=N,
                          local_sgd=method == "local_sgd")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
  # The sync at t = 3 lacks a quorum (worker 3 is dead); at t = 6 it
  # contributes its one step since its rejoin. At t = 9 worker 1, back with
  # theta copied, has no step since the copy (its count restarts at 0, its
  # step at t = 7 was overwritten): 3 contributors, skipped again.
  assert skipped == 2 and int(states[-1].skipped[0]) == 2
  # theta and the outer state are those before the skipped sync.
  before, after = states[1], states[2]  # t = 2, t = 3 (skipped sync)
  if method == "diloco":
    np.testing.assert_array_equal(after.base.theta, before.base.theta)
    for o_b, o_a in zip(jax.tree.leaves(before.base.outer.opt_state),
                        jax.tree.leaves(after.base.outer.opt_state)):
      np.testing.assert_array_equal(o_a, o_b)
    assert int(after.base.outer.count[0]) == 0
  else:
    np.testing.assert_array_equal(after.anchor, before.anchor)


def test_several_workers_per_device(x64):
  # Two workers per device: the same trajectory as the oracle.
  del x64
  require_devices(N)
  x0, b = _problem(seed=3)
  alive, working = _masks()
  axis = parallel.worker_axis(parallel.make_mesh(N, workers_per_device=2))
  tx = elastic.elastic_diloco(optax.sgd(LR), H, rejoin="copy_mean",
                              on_failure="rollback", axis_name=axis)
  got, _ = _run(tx, x0, b, alive, working, per_device=2)
  want, _ = _oracle(x0, b, alive, working, rejoin="copy_mean",
                    on_failure="rollback")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_no_faults_is_bit_identical():
  require_devices(N)
  x0, b = _problem(dtype=np.float32)
  inner = optax.adamw(optax.linear_schedule(0.1, 0.01, 10))
  cases = [(optim.diloco(inner, H), elastic.elastic_diloco(inner, H)),
           (optim.local_sgd(inner, H), elastic.elastic_local_sgd(inner, H))]
  everyone = np.ones((STEPS, N), bool)
  for plain, tx in cases:
    want, _ = _run(plain, x0, b)
    for masks in ((None, None), (everyone, everyone)):
      got, _ = _run(tx, x0, b, *masks)
      for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_rejoining_counters_come_from_the_group():
  # Adam's step count (and the schedule's) of worker 3 after its rejoin is
  # the count of the first live worker, not its own stale one.
  require_devices(N)
  x0, b = _problem(dtype=np.float32)
  alive, working = _masks()
  working[:] = alive  # no straggler: every live worker steps
  for rejoin in elastic.REJOIN:
    tx = elastic.elastic_diloco(
        optax.adam(optax.linear_schedule(0.1, 0.0, 20)), 100, rejoin=rejoin)
    _, states = _run(tx, x0, b, alive, working, steps=6)
    counts = [np.asarray(c) for c in jax.tree.leaves(states[-1].base.inner_state)
              if np.asarray(c).dtype.kind == "i"]
    assert counts
    for c in counts:
      # Worker 3 was dead for t = 2..4; at t = 5 it took no step and
      # copied worker 0's count after its step (5); at t = 6 it stepped.
      assert c[0] == 6 and c[3] == 6, (rejoin, c)


@pytest.mark.slow
def test_rejoin_by_copying_leaves_a_smaller_consensus_distance(x64):
  del x64
  require_devices(N)
  x0, b = _problem(seed=2)
  alive = np.ones((8, N), bool)
  alive[1:3, 3] = False  # dead t = 2, 3; rejoins at t = 4 (mid-round)
  distance = {}
  for rejoin in elastic.REJOIN:
    got, _ = _run(_make("local_sgd", rejoin=rejoin), x0, b, alive, alive,
                  steps=4)
    want, _ = _oracle(x0, b, alive[:4], alive[:4], rejoin=rejoin,
                      local_sgd=True)
    np.testing.assert_allclose(got[-1], want[-1], rtol=1e-12, atol=1e-12)
    x = got[-1]
    distance[rejoin] = float(((x - x.mean(0)) ** 2).sum(1).mean())
  assert distance["copy_mean"] < distance["keep"]
  assert distance["copy_theta"] < distance["keep"]


def test_bad_arguments():
  with pytest.raises(ValueError, match="on_failure must be one of"):
    elastic.elastic_diloco(optax.sgd(0.1), 2, on_failure="retry")
  with pytest.raises(ValueError, match="rejoin must be one of"):
    elastic.elastic_local_sgd(optax.sgd(0.1), 2, rejoin="copy")
  with pytest.raises(ValueError, match="min_quorum must be an int >= 1"):
    elastic.elastic_diloco(optax.sgd(0.1), 2, min_quorum=0)
  with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
    elastic.elastic_diloco(optax.sgd(0.1), 2.0)
  with pytest.raises(ValueError, match="inner must be an optax"):
    elastic.elastic_local_sgd("sgd", 2)
  with pytest.raises(ValueError, match="outer must be an optax"):
    elastic.elastic_diloco(optax.sgd(0.1), 2, outer=0.7)
  require_devices(2)
  x0, b = _problem(n=2, dtype=np.float32)
  with pytest.raises(ValueError, match=r"alive must be a bool array of shape \(2,\)"):
    _run(elastic.elastic_diloco(optax.sgd(0.1), 2), x0, b,
         np.ones((1, 3), bool), np.ones((1, 3), bool), steps=1)
  with pytest.raises(ValueError, match="elastic_diloco: leaf .* has dtype int32"):
    _run(elastic.elastic_diloco(optax.sgd(0.1), 2), x0.astype(np.int32), b,
         steps=1)


@pytest.mark.parametrize("rejoin, x_bar", [
    ("copy_theta", 64 / 5), ("copy_mean", 71 / 5), ("keep", 72 / 6)])
def test_rejoin_restarts_the_step_count_by_hand(rejoin, x_bar):
  # Local SGD, 2 workers, H = 4, inner SGD at lr 0.5 on (x - b)^2 / 2, so a
  # step is x <- (x + b) / 2; theta = 0, b = (16, 8). Worker 1 steps at
  # t = 1 (x = 4), is dead at t = 2, rejoins at t = 3 (no step), steps at
  # t = 4. Worker 0: 8, 12, 14, 15 (H_0 = 4).
  # copy_theta: x_1 = 0 at t = 3, 4 at t = 4, H_1 = 1 (its stale step is
  #   overwritten): x_bar = (4 * 15 + 1 * 4) / 5 = 12.8 (a stale H_1 = 2
  #   would give 68 / 6).
  # copy_mean: x_1 = 14 (worker 0 after its step at t = 3), then 11, H_1 =
  #   1: x_bar = (60 + 11) / 5 = 14.2.
  # keep: x_1 = 4 (stale), then 6, H_1 = 2: x_bar = (60 + 12) / 6 = 12.
  require_devices(2)
  x0 = np.zeros((2, 1), np.float32)
  b = np.array([[16.0], [8.0]], np.float32)
  alive = np.ones((4, 2), bool)
  alive[1, 1] = False
  tx = elastic.elastic_local_sgd(optax.sgd(0.5), 4, rejoin=rejoin)
  got, states = _run(tx, x0, b, alive, alive, steps=4)
  np.testing.assert_allclose(got[-1], [[x_bar], [x_bar]], rtol=1e-6)
  # Goodput: the committed worker steps, 4 + 1 (4 + 2 with keep).
  useful = 6 if rejoin == "keep" else 5
  assert int(states[-1].useful[0]) == useful


def test_quorum_above_the_worker_count_is_refused():
  require_devices(2)
  x0, b = _problem(n=2, dtype=np.float32)
  for make in (elastic.elastic_diloco, elastic.elastic_local_sgd):
    with pytest.raises(ValueError, match=r"min_quorum=3 is more than the 2 "
                       r"workers of axis .*; use min_quorum <= 2\."):
      _run(make(optax.sgd(0.1), 2, min_quorum=3), x0, b, steps=1)



@pytest.mark.parametrize("rejoin, x_end, useful", [
    ("copy_theta", 0.0, 0), ("copy_mean", 0.0, 0), ("keep", 6.0, 2)])
def test_whole_group_back_at_once_by_hand(rejoin, x_end, useful):
  # Local SGD, 2 workers, H = 3, inner SGD at lr 0.5 (x <- (x + b) / 2),
  # theta = 0, b = (16, 8). t = 1: x = (8, 4), H_m = 1. t = 2: both dead.
  # t = 3: both rejoin (no donor, no step). copy_theta / copy_mean: x <-
  # theta = 0, H_m <- 0, so the outer step has no contributor (skipped):
  # x = 0, nothing useful. keep: x = (8, 4), H_m = 1: x_bar = 6, 2 steps.
  require_devices(2)
  x0 = np.zeros((2, 1), np.float32)
  b = np.array([[16.0], [8.0]], np.float32)
  alive = np.ones((3, 2), bool)
  alive[1] = False
  tx = elastic.elastic_local_sgd(optax.sgd(0.5), 3, rejoin=rejoin)
  got, states = _run(tx, x0, b, alive, alive, steps=3)
  np.testing.assert_allclose(got[-1], np.full((2, 1), x_end), rtol=1e-6)
  assert int(states[-1].useful[0]) == useful
  assert int(states[-1].skipped[0]) == 1 - (useful > 0)


@pytest.mark.parametrize("method,rejoin", [
    ("diloco", "copy_theta"), ("local_sgd", "copy_mean"),
    pytest.param("diloco", "copy_mean", marks=pytest.mark.slow),
    pytest.param("local_sgd", "copy_theta", marks=pytest.mark.slow),
    pytest.param("diloco", "keep", marks=pytest.mark.slow)])
def test_whole_group_outage_matches_oracle(method, rejoin, x64):
  # Every worker dead at t = 5 and back at t = 6 (no donor), on top of the
  # usual faults: theta is group state, so the copies need no donor.
  del x64
  require_devices(N)
  x0, b = _problem(seed=3)
  alive, working = _masks()
  alive[4] = False
  working &= alive
  got, _ = _run(_make(method, rejoin=rejoin), x0, b, alive, working)
  want, _ = _oracle(x0, b, alive, working, rejoin=rejoin,
                    local_sgd=method == "local_sgd")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)



def test_dead_worker_keeps_its_step_count_through_a_sync():
  # DiLoCo, 4 workers, H = 2, inner SGD at lr 0.1 (x <- 0.9 x + 0.1 b),
  # outer SGD at lr 1 (theta <- x_bar), rejoin="keep"; x = 0, b = (10, 0,
  # 0, 0). t = 1: all step, x_0 = 1, H_m = 1. t = 2: worker 0 dead (x_0 = 1,
  # H_0 = 1 frozen), workers 1-3 step (H = 2); sync over workers 1-3:
  # theta = 0, 6 steps committed; the live workers restart at 0, worker 0
  # keeps H_0 = 1. t = 3: worker 0 rejoins (no step, keeps x_0 = 1 and
  # H_0 = 1), the others step (H = 1). t = 4: all step, x_0 = 1.9, H_0 = 2,
  # H_1..3 = 2; sync: x_bar = (2 * 1.9 + 0) / 8 = 0.475, 8 steps committed:
  # 14 in all. (Resetting the dead worker's count at t = 2 would give
  # x_bar = 1.9 / 7 and 13 steps.)
  require_devices(4)
  x0 = np.zeros((4, 1), np.float32)
  b = np.array([[10.0], [0.0], [0.0], [0.0]], np.float32)
  alive = np.ones((4, 4), bool)
  alive[1, 0] = False
  tx = elastic.elastic_diloco(optax.sgd(0.1), 2, outer=optax.sgd(1.0),
                              rejoin="keep")
  got, states = _run(tx, x0, b, alive, alive, steps=4)
  assert list(states[1].done) == [1, 0, 0, 0]  # after the sync at t = 2
  assert list(states[2].done) == [1, 1, 1, 1]
  np.testing.assert_allclose(got[1], [[1.0], [0.0], [0.0], [0.0]], rtol=1e-6)
  np.testing.assert_allclose(got[-1], np.full((4, 1), 0.475), rtol=1e-6)
  assert int(states[1].useful[0]) == 6
  assert int(states[-1].useful[0]) == 14


# Without masks the elastic methods take the plain methods' operations, but
# XLA may fuse the inner step differently around the masks' selects (an
# FMA contracted in one program and not the other): the parameters agree
# to float32 rounding carried by later steps, not bit for bit (docs/faults.md
# states the bound: 2e-6 over 30 steps of parameters of size ~3).
NO_MASK_ATOL = 2e-6


def _no_mask_pair(method, inner, h, axis):
  outer = optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)
  if method == "diloco":
    return (optim.diloco(inner, h, outer=outer,
                         reduction=optim.reductions.ExactMean(axis)),
            elastic.elastic_diloco(inner, h, outer=outer, axis_name=axis))
  return (optim.local_sgd(inner, h, reduction=optim.reductions.ExactMean(axis)),
          elastic.elastic_local_sgd(inner, h, axis_name=axis))


def _no_mask_run(tx, mesh, x0, b, steps):
  def step(x, s, t):
    u, s = tx.update(jax.tree.map(lambda a, c: a - c, x, t), s, x)
    return optax.apply_updates(x, u), s
  fn = jax.jit(parallel.per_worker(step, mesh))
  x, t = parallel.shard(x0, mesh), parallel.shard(b, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  out = []
  for _ in range(steps):
    x, s = fn(x, s, t)
    out.append(np.concatenate([np.asarray(v).ravel()
                               for v in jax.tree.leaves(x)]))
  return out


def _no_mask_gap(method, inner, h, seeds, steps):
  """Largest |elastic - plain| over ``seeds`` x ``steps`` of 8 workers
  pulled to random targets (scale 3) from a random start (leaves (7, 5)
  and (1,))."""
  n = 8
  require_devices(n)
  mesh = parallel.make_mesh(n)
  plain, tx = _no_mask_pair(method, inner, h, parallel.worker_axis(mesh))
  gap = 0.0
  for seed in seeds:
    rng = np.random.default_rng(seed)
    x0 = {k: np.repeat(rng.normal(size=(1, *shape)), n, 0).astype(np.float32)
          for k, shape in (("a", (7, 5)), ("b", (1,)))}
    b = {k: (3 * rng.normal(size=v.shape)).astype(np.float32)
         for k, v in x0.items()}
    want = _no_mask_run(plain, mesh, x0, b, steps)
    got = _no_mask_run(tx, mesh, x0, b, steps)
    gap = max(gap, max(float(np.abs(g - w).max()) for g, w in zip(got, want)))
  return gap


def test_no_masks_agree_with_the_plain_method_to_rounding():
  # AdamW inner, H = 2, 7 steps: a case where the two differ in the last
  # bits, within the stated bound.
  assert _no_mask_gap("diloco", optax.adamw(0.01), 2, (0,), 7) <= \
      NO_MASK_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_no_masks_agree_with_the_plain_method_over_random_problems(
    method, inner):
  tx = (optax.adamw(0.01) if inner == "adamw"
        else optax.sgd(0.05, momentum=0.9))
  for h in (1, 2, 3, 5):
    assert _no_mask_gap(method, tx, h, range(4), 6 * h) <= NO_MASK_ATOL
