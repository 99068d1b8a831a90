"""DiLoCo with a delayed or eager outer step, and trickled reduction.

Fast tier: one representative case per property; the other cases of each
sweep are marked ``slow``.

Worker ``m`` minimises ``f_m(x) = ||x - b_m||^2 / 2`` with inner SGD. The
expected values come from the hand-worked example of the issue and from a
float64 NumPy re-implementation of the recursions (arXiv 2502.12996), written
here from the definitions, independently of ``decentral_jax.optim``.
"""

from __future__ import annotations

import gzip
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import FIXTURES
from helpers import quadratic_problem as _problem
from helpers import sync_args
from conftest import require_devices
from decentral_jax import analysis
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.analysis import hlo
from decentral_jax.analysis import overlap
from decentral_jax import optim

LR, OUTER_LR, MOMENTUM = 0.1, 0.7, 0.9


def _step_fns(tx, n, mesh=None):
  mesh = mesh or parallel.make_mesh(n)

  def step(params, state, b):
    grads = jax.tree.map(lambda x, t: x - t, params, b)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return (jax.jit(parallel.per_worker(step, mesh)),
          jax.jit(parallel.per_worker(tx.init, mesh)), mesh)


def _run(tx, x0, targets, steps):
  """Trains stacked params ``x0`` [n, ...] (a dict); per-step params, states."""
  n = targets["a"].shape[0]
  step, init, mesh = _step_fns(tx, n)
  params = parallel.shard(x0, mesh)
  b = parallel.shard(targets, mesh)
  state = init(params)
  params_out, states = [], []
  for _ in range(steps):
    params, state = step(params, state, b)
    params_out.append(jax.tree.map(np.asarray, jax.device_get(params)))
    states.append(jax.device_get(state))
  return params_out, states


def _sgd(lr):
  def update(g, trace):
    return -lr * g, trace
  return update


def _nesterov(g, trace):
  """optax.sgd(OUTER_LR, momentum, nesterov=True) as in its documentation."""
  trace = g + MOMENTUM * trace
  return -OUTER_LR * (g + MOMENTUM * trace), trace


def _oracle(x0, b, h, rounds, mode, d=1, outer=_nesterov, w=None):
  """Per-worker theta after each round: [rounds] of dicts of [n, ...].

  ``mode``: "plain", "delayed" or "eager"; ``w(j)``: the mixing matrix of
  sync ``j`` (0-based), None for the exact mean.
  """
  n = b["a"].shape[0]
  mix = (lambda j: np.full((n, n), 1.0 / n)) if w is None else w
  theta = {k: np.array(v, np.float64) for k, v in x0.items()}
  trace = {k: np.zeros_like(v) for k, v in theta.items()}
  own_hist, mean_hist, out = [], [], []
  for r in range(1, rounds + 1):
    x = {k: v.copy() for k, v in theta.items()}
    for _ in range(h):
      x = {k: x[k] - LR * (x[k] - b[k]) for k in x}
    own = {k: theta[k] - x[k] for k in x}
    wr = mix(r - 1)
    own_hist.append(own)
    mean_hist.append({k: np.einsum("ij,j...->i...", wr, v)
                      for k, v in own.items()})
    old = r - 1 - d  # index of round r - d
    for k in theta:
      shape = (n,) + (1,) * (theta[k].ndim - 1)
      if mode == "plain":
        g = mean_hist[-1][k]
      elif mode == "delayed":
        if r <= d:
          continue
        g = mean_hist[old][k]
      else:
        g = np.diag(wr).reshape(shape) * own[k]
        if r > d:
          g = g + (mean_hist[old][k]
                   - np.diag(mix(old)).reshape(shape) * own_hist[old][k])
      step, trace[k] = outer(g, trace[k])
      theta[k] = theta[k] + step
    out.append({k: v.copy() for k, v in theta.items()})
  return out


def _thetas(params, h):
  """Worker parameters after each sync step (= their theta)."""
  return params[h - 1::h]


# --------------------------------------------------------------------------
# The worked example of the issue.
# --------------------------------------------------------------------------

WORKED = {
    "none": [[0.38, 0.38], [0.6878, 0.6878], [0.937118, 0.937118]],
    "delayed": [[0.0, 0.0], [0.38, 0.38], [0.76, 0.76]],
    "eager": [[0.095, 0.285], [0.465975, 0.637925], [0.774632, 0.948297]],
}


@pytest.mark.parametrize("overlap,trickle", [
    ("none", None), ("delayed", True), ("eager", True),
    pytest.param("delayed", False, marks=pytest.mark.slow),
    pytest.param("eager", False, marks=pytest.mark.slow)])
def test_worked_example(overlap, trickle, x64):
  """M = 2, c = (1, 3), inner lr 0.1, H = 2, theta_0 = 0, outer SGD lr 1."""
  del x64
  require_devices(2)
  x0, b = {"a": np.zeros((2, 1))}, {"a": np.array([[1.0], [3.0]])}
  tx = optim.diloco(optax.sgd(LR), 2, outer=optax.sgd(1.0),
                    **sync_args(overlap=overlap, trickle=trickle))
  params, states = _run(tx, x0, b, 6)
  got = [p["a"][:, 0] for p in _thetas(params, 2)]
  np.testing.assert_allclose(got, WORKED[overlap], atol=5e-7)
  mode = "plain" if overlap == "none" else overlap
  want = _oracle(x0, b, 2, 3, mode, outer=_sgd(1.0))
  np.testing.assert_allclose(got, [w["a"][:, 0] for w in want], rtol=1e-12)
  theta = np.asarray(optim.global_params(states[-1])["a"])[:, 0]
  np.testing.assert_array_equal(theta, got[-1])


# --------------------------------------------------------------------------
# NumPy oracle, identities.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap,d,h", [
    ("eager", 1, 3)] + [pytest.param(*c, marks=pytest.mark.slow) for c in (
        ("delayed", 1, 3), ("delayed", 2, 3), ("eager", 3, 3), ("eager", 2, 1),
        ("delayed", 1, 1))])
def test_matches_numpy_oracle(overlap, d, h, x64):
  """4 workers, H = 3 (or 1: a sync every step), Nesterov outer step, d
  rounds of latency."""
  del x64
  require_devices(4)
  x0, b = _problem(4)
  tx = optim.diloco(optax.sgd(LR), h, **sync_args(overlap=overlap, latency=d))
  params, states = _run(tx, x0, b, 6 * h)
  want = _oracle(x0, b, h, 6, overlap, d)
  for got, w in zip(_thetas(params, h), want):
    for k in w:
      np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-12)
  assert int(np.asarray(states[-1].outer.count)[0]) == 6
  if overlap == "eager":  # per-worker theta
    assert not np.allclose(params[-1]["a"][0], params[-1]["a"][1])


@pytest.mark.parametrize("overlap,name,trickle", [
    ("eager", "static_ring", True)] + [
        pytest.param(*c, marks=pytest.mark.slow) for c in (
            ("delayed", "static_ring", True), ("delayed", "ring", False),
            ("eager", "ring", False), ("delayed", "one_peer_exp", False),
            ("eager", "one_peer_exp", False))])
def test_decentralized_matches_dense_oracle(name, trickle, overlap, x64):
  """Gossiped pseudo-gradients; eager's own weight is W[m, m]."""
  del x64
  require_devices(8)
  topo = topology.make(name, 8)
  x0, b = _problem(8, seed=1)
  tx = optim.diloco(optax.sgd(LR), 2, **sync_args(topology=topo,
      overlap=overlap, latency=2, trickle=trickle))
  params, _ = _run(tx, x0, b, 12)
  want = _oracle(x0, b, 2, 6, overlap, 2, w=topo.mixing_matrix)
  for got, w in zip(_thetas(params, 2), want):
    for k in w:
      np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # two compiled runs (the default run: ~3 min)
def test_one_worker_eager_is_plain_bit_for_bit():
  """M = 1: Delta~ = Delta^(k) + (Delta^(k-d) - Delta^(k-d)) exactly."""
  x0, b = _problem(1, seed=3)
  plain, _ = _run(optim.diloco(optax.sgd(LR), 3), x0, b, 12)
  for d, trickle in [(1, True), (2, False), (3, True)]:
    eager, _ = _run(optim.diloco(optax.sgd(LR), 3, **sync_args(overlap="eager",
        latency=d, trickle=trickle)), x0, b, 12)
    for p, e in zip(plain, eager):
      for k in p:
        np.testing.assert_array_equal(e[k], p[k])


def _round_deltas(params, b, h, x0):
  """Delta_m^(r) = theta_m^(r-1) - x_m after round r, from the trajectory.

  The last inner step of round r is ``x - LR (x - b)`` from the parameters
  one step before the sync (the sync replaces its result by theta).
  """
  starts = [x0] + _thetas(params, h)
  out = []
  for r in range(1, len(params) // h + 1):
    before = params[r * h - 2] if h > 1 else starts[r - 1]
    out.append({k: starts[r - 1][k] - (before[k] - LR * (before[k] - b[k]))
                for k in b})
  return out


@pytest.mark.parametrize("d", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_eager_telescopes_with_outer_sgd(d, x64):
  """theta_m^(t) = theta^(0) - lr [sum_{s<=t-d} Delta^(s) + (1/M) sum_{t-d<s<=t} Delta_m^(s)]."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=4)
  lr = 0.5
  tx = optim.diloco(optax.sgd(LR), 3, outer=optax.sgd(lr),
                    **sync_args(overlap="eager", latency=d))
  params, _ = _run(tx, x0, b, 15)
  deltas = _round_deltas(params, b, 3, x0)
  for t, got in enumerate(_thetas(params, 3), start=1):
    for k in b:
      total = sum((deltas[s - 1][k].mean(0, keepdims=True)
                   for s in range(1, t - d + 1)), np.zeros_like(b[k][:1]))
      own = sum((deltas[s - 1][k] for s in range(max(t - d + 1, 1), t + 1)),
                np.zeros_like(b[k]))
      np.testing.assert_allclose(got[k], x0[k] - lr * (total + own / 4),
                                 rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_eager_worker_mean_of_direction(d, x64):
  """mean_m Delta~_m^(t) = Delta^(t-d) + (Delta^(t) - Delta^(t-d)) / M."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=5)
  lr = 0.5  # outer SGD: Delta~_m = (theta_m^(t-1) - theta_m^(t)) / lr
  tx = optim.diloco(optax.sgd(LR), 2, outer=optax.sgd(lr),
                    **sync_args(overlap="eager", latency=d))
  params, _ = _run(tx, x0, b, 12)
  deltas = _round_deltas(params, b, 2, x0)
  starts = [x0] + _thetas(params, 2)
  for t in range(1, 7):
    for k in b:
      direction = (starts[t - 1][k] - starts[t][k]) / lr
      fresh = deltas[t - 1][k].mean(0)
      stale = deltas[t - 1 - d][k].mean(0) if t > d else 0.0
      np.testing.assert_allclose(direction.mean(0),
                                 stale + (fresh - stale) / 4,
                                 rtol=1e-11, atol=1e-12)


@pytest.mark.slow
def test_delayed_waits_d_rounds_then_steps_on_stale_means(x64):
  """Delayed: theta unchanged (outer state too) for d rounds, equal on all
  workers; the outer step of round r uses the mean pseudo-gradient of round
  r - d, which the plain method would have used d rounds earlier."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=6)
  for d in (1, 2, 3):
    tx = optim.diloco(optax.sgd(LR), 2, **sync_args(overlap="delayed",
        latency=d))
    params, states = _run(tx, x0, b, 2 * (d + 2))
    thetas = _thetas(params, 2)
    for r in range(d):
      for k in b:
        np.testing.assert_array_equal(thetas[r][k], x0[k])
      for leaf in jax.tree.leaves(states[2 * r + 1].outer.opt_state):
        assert not np.any(np.asarray(leaf))
    for k in b:
      assert not np.allclose(thetas[d][k], x0[k])
      np.testing.assert_array_equal(thetas[-1][k],
                                    np.broadcast_to(thetas[-1][k][0],
                                                    thetas[-1][k].shape))


def test_overlap_none_keeps_the_plain_state_and_trajectory():
  """overlap="none" is today's DiLoCo: DiLoCoState, same values."""
  x0, b = _problem(2, seed=7)
  plain, s1 = _run(optim.diloco(optax.sgd(LR), 2), x0, b, 6)
  none, s2 = _run(optim.diloco(optax.sgd(LR), 2, **sync_args(overlap="none",
      latency=1)),
                  x0, b, 6)
  assert type(s2[-1]) is optim.DiLoCoState
  assert jax.tree.structure(s1[-1]) == jax.tree.structure(s2[-1])
  for p, q in zip(plain, none):
    for k in p:
      np.testing.assert_array_equal(p[k], q[k])


# --------------------------------------------------------------------------
# Trickled reduction: bits, bytes, no collective inside a conditional.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap,d,name", [
    ("eager", 1, None)] + [pytest.param(*c, marks=pytest.mark.slow) for c in (
        ("delayed", 1, None), ("eager", 2, None),
        ("delayed", 2, "static_ring"), ("eager", 1, "static_ring"))])
def test_trickled_equals_one_shot_bit_for_bit(overlap, d, name):
  """float32, 8 elements in H = 3 slices (one padded), Nesterov outer step."""
  require_devices(4)
  x0, b = _problem(4, seed=8)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  topo = None if name is None else topology.make(name, 4)
  runs = [_run(optim.diloco(optax.sgd(LR), 3, **sync_args(topology=topo,
      overlap=overlap, latency=d, trickle=t)), x0, b, 15)
          for t in (True, False)]
  (trickled, s1), (one_shot, s2) = runs
  for p, q in zip(trickled, one_shot):
    for k in p:
      np.testing.assert_array_equal(p[k], q[k])
  for u, v in zip(jax.tree.leaves(s1[-1].theta),
                  jax.tree.leaves(s2[-1].theta)):
    np.testing.assert_array_equal(u, v)
  assert not np.array_equal(trickled[-1]["a"], trickled[-4]["a"])


def _compiled_step(tx, n, x0, b):
  step, init, mesh = _step_fns(tx, n)
  params = parallel.shard(x0, mesh)
  targets = parallel.shard(b, mesh)
  return step.lower(params, init(params), targets).compile()


def _conditional_bodies(text):
  """Names of the computations called (transitively) by a conditional."""
  comps, _, _ = hlo.parse_module(text)
  inside, todo = set(), []
  for instrs in comps.values():
    for ins in instrs:
      if ins.opcode == "conditional":
        for names in hlo.called_computations(ins).values():
          todo += names
  while todo:
    name = todo.pop()
    if name in inside:
      continue
    inside.add(name)
    for ins in comps.get(name, ()):
      for names in hlo.called_computations(ins).values():
        todo += names
  return inside


@pytest.mark.parametrize("h", [3] + [pytest.param(h, marks=pytest.mark.slow)
                                     for h in (1, 4)])
def test_trickled_bytes_per_step_from_the_hlo(h):
  """Every step: one all-reduce of |B| / H float32, outside any conditional.

  |B| = 12 elements on n = 4 workers: 2 (n - 1) / n x |B| / H x 4 bytes in
  every scenario; the one-shot reduction sends H times that on the sync
  step and nothing otherwise (the same mean over a period).
  """
  require_devices(4)
  n, size = 4, 12
  rng = np.random.default_rng(9)
  x0 = {"a": np.repeat(rng.normal(size=(1, 4, 2)), n, 0).astype(np.float32),
        "b": np.repeat(rng.normal(size=(1, 4)), n, 0).astype(np.float32)}
  b = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in x0.items()}
  per_step = 2 * (n - 1) / n * size / h * 4
  for overlap in ("delayed", "eager"):
    tx = optim.diloco(optax.sgd(LR), h, **sync_args(overlap=overlap,
        trickle=True))
    compiled = _compiled_step(tx, n, x0, b)
    report = analysis.communication(compiled)
    assert report.bytes_per_step == pytest.approx(
        (per_step,) * len(report.scenarios)), report.summary()
    (coll,) = report.collectives
    assert coll.kind == "all-reduce"
    assert coll.operand_shapes == (f"f32[{size // h}]",)
    text = hlo.hlo_text(compiled)
    assert coll.computation not in _conditional_bodies(text)
  compiled = _compiled_step(
      optim.diloco(optax.sgd(LR), h, **sync_args(overlap="eager",
          trickle=False)), n, x0, b)
  one_shot = analysis.communication(compiled)
  assert one_shot.max_bytes_per_step == pytest.approx(per_step * h)
  assert one_shot.mean_bytes_per_step == pytest.approx(per_step)
  if h > 1:  # the control: there the all-reduce sits in the sync's branch
    (coll,) = one_shot.collectives
    assert coll.computation in _conditional_bodies(hlo.hlo_text(compiled))


# --------------------------------------------------------------------------
# Arguments, state.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(overlap="eagre"), "overlap must be one of none, delayed, eager"),
    (dict(overlap="delayed", latency=0), "latency must be an int >= 1"),
    (dict(overlap="eager", latency=1.0), "latency must be an int"),
    (dict(latency=2), "latency=2 and trickle=None need overlap"),
    (dict(trickle=True), "need overlap"),
    (dict(overlap="eager", trickle="yes"), "trickle must be None, True or"),
    (dict(overlap="eager", trickle=True,
          topology=topology.make("one_peer_exp", 4)), "trickle=True needs a "
     "topology with one distinct round"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optim.diloco(optax.sgd(LR), 2, **sync_args(**kwargs))


def test_trickle_default_and_buffers():
  """trickle=None trickles unless the topology varies; buffer shapes."""
  params = {"a": jnp.zeros((5,)), "b": jnp.zeros((2,), jnp.float32)}
  state = optim.diloco(optax.sgd(LR), 3, **sync_args(overlap="delayed",
      latency=2)).init(
      params)
  assert type(state) is optim.DiLoCoState
  assert type(state.timing) is optim.InFlight
  (means,), (sent,) = state.timing
  assert means.shape == (2, 3, 3) and sent.shape == (1, 3, 3)
  state = optim.diloco(optax.sgd(LR), 3, **sync_args(overlap="delayed",
      latency=2, topology=topology.make("one_peer_exp", 4))).init(params)
  assert state.timing.sent == ()  # one-shot: nothing awaits reduction
  state = optim.diloco(optax.sgd(LR), 3, **sync_args(overlap="eager",
      latency=2, trickle=False)).init(params)
  assert state.timing.sent[0].shape == (2, 3, 3)


def test_flat_layout_round_trip_by_dtype():
  tree = {"a": jnp.arange(5.0), "b": jnp.arange(4, dtype=jnp.bfloat16),
          "c": jnp.ones((2, 2))}
  layout = optim.FlatLayout.of(tree, 3)
  bufs = layout.flatten(tree)
  assert [(b.shape, b.dtype) for b in bufs] == [((3, 3), jnp.float32),
                                                ((3, 2), jnp.bfloat16)]
  np.testing.assert_array_equal(bufs[0].reshape(-1),
                                [0, 1, 2, 3, 4, 1, 1, 1, 1])
  np.testing.assert_array_equal(bufs[1].reshape(-1), [0, 1, 2, 3, 0, 0])
  back = layout.unflatten(bufs)
  for k in tree:
    np.testing.assert_array_equal(back[k], tree[k])
    assert back[k].dtype == tree[k].dtype


# --------------------------------------------------------------------------
# Streaming DiLoCo, per fragment.
# --------------------------------------------------------------------------


def _streaming_oracle(x0, b, h, steps, frags, mode, d, alpha,
                      outer=_nesterov):
  """Per-step parameters of Streaming DiLoCo with an overlapped outer step.

  Fragment ``p`` (offset ``o_p = p H // P``) ends a round at ``t % H ==
  o_p``, ``t >= max(o_p, 1)``; there its leaves take the delayed or eager
  outer step on its own history, then ``x <- alpha x + (1 - alpha) theta``.
  """
  n = b["a"].shape[0]
  p_count = max(frags.values()) + 1
  offsets = [p * h // p_count % h for p in range(p_count)]
  x = {k: np.array(v, np.float64) for k, v in x0.items()}
  theta = {k: v.copy() for k, v in x.items()}
  trace = {k: np.zeros_like(v) for k, v in x.items()}
  own_hist = [[] for _ in range(p_count)]
  out = []
  for t in range(1, steps + 1):
    x = {k: x[k] - LR * (x[k] - b[k]) for k in x}
    for p, o in enumerate(offsets):
      if t % h != o or t < max(o, 1):
        continue
      own_hist[p].append({k: theta[k] - x[k] for k in x if frags[k] == p})
      r, old = len(own_hist[p]), len(own_hist[p]) - 1 - d
      for k in own_hist[p][-1]:
        fresh = own_hist[p][-1][k]
        stale = own_hist[p][old][k] if r > d else np.zeros_like(fresh)
        if mode == "eager":
          g = fresh / n + (stale.mean(0, keepdims=True) - stale / n)
        else:
          g = np.broadcast_to(stale.mean(0, keepdims=True), stale.shape)
        if mode == "eager" or r > d:
          step, trace[k] = outer(g, trace[k])
          theta[k] = theta[k] + step
        x[k] = alpha * x[k] + (1 - alpha) * theta[k]
    out.append({k: v.copy() for k, v in x.items()})
  return out


@pytest.mark.parametrize("frags,mode,d,alpha,trickle", [
    ({"a": 0, "b": 1, "c": 1}, "delayed", 1, 0.0, True),
    pytest.param({"a": 0, "b": 1, "c": 2}, "eager", 2, 0.5, True,
                 marks=pytest.mark.slow),
    pytest.param({"a": 0, "b": 1, "c": 1}, "eager", 1, 0.25, False,
                 marks=pytest.mark.slow),
])
def test_streaming_fragments_match_numpy_oracle(frags, mode, d, alpha,
                                                trickle, x64):
  """4 workers, H = 6: each fragment its own rounds, history and outer state."""
  del x64
  require_devices(4)
  x0, b = _problem(4, seed=10)
  tx = optim.streaming_diloco(optax.sgd(LR), 6,
                              num_fragments=max(frags.values()) + 1,
                              fragments=frags, merge_alpha=alpha,
                              **sync_args(overlap=mode, latency=d,
                                  trickle=trickle))
  params, states = _run(tx, x0, b, 26)
  want = _streaming_oracle(x0, b, 6, 26, frags, mode, d, alpha)
  for got, w in zip(params, want):
    for k in w:
      np.testing.assert_allclose(got[k], w[k], rtol=1e-12, atol=1e-12)
  assert type(states[-1]) is optim.StreamingDiLoCoState
  assert type(states[-1].timing[0]) is optim.FragmentRounds


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_streaming_one_fragment_is_diloco_bit_for_bit(overlap):
  require_devices(4)
  x0, b = _problem(4, seed=11)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  plain, _ = _run(optim.diloco(optax.sgd(LR), 3, **sync_args(overlap=overlap,
      latency=2)),
                  x0, b, 12)
  stream, _ = _run(optim.streaming_diloco(optax.sgd(LR), 3,
                                          **sync_args(overlap=overlap,
                                              latency=2)), x0, b, 12)
  for p, q in zip(plain, stream):
    for k in p:
      np.testing.assert_array_equal(p[k], q[k])


@pytest.mark.slow
@pytest.mark.parametrize("comm_dtype", [None, jnp.bfloat16])
def test_streaming_trickled_equals_one_shot_bit_for_bit(comm_dtype):
  """Also with pseudo-gradients sent in bfloat16 (float32 sums)."""
  require_devices(4)
  x0, b = _problem(4, seed=12)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  runs = [_run(optim.streaming_diloco(
      optax.sgd(LR), 4, num_fragments=2, merge_alpha=0.5,
      **sync_args(comm_dtype=comm_dtype, overlap="eager", trickle=t)),
               x0, b, 14)[0]
          for t in (True, False)]
  for p, q in zip(*runs):
    for k in p:
      np.testing.assert_array_equal(p[k], q[k])


@pytest.mark.slow
def test_streaming_trickled_bytes_per_step():
  """Two fragments of 8 and 4 float32, H = 4: every step reduces 2 + 1."""
  require_devices(4)
  n, h = 4, 4
  rng = np.random.default_rng(13)
  x0 = {"a": np.repeat(rng.normal(size=(1, 8)), n, 0).astype(np.float32),
        "b": np.repeat(rng.normal(size=(1, 4)), n, 0).astype(np.float32)}
  b = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in x0.items()}
  tx = optim.streaming_diloco(optax.sgd(LR), h, num_fragments=2,
                              fragments={"a": 0, "b": 1},
                              **sync_args(overlap="delayed"))
  compiled = _compiled_step(tx, n, x0, b)
  report = analysis.communication(compiled)
  per_step = 2 * (n - 1) / n * (8 + 4) / h * 4
  assert report.bytes_per_step == pytest.approx(
      (per_step,) * len(report.scenarios)), report.summary()
  inside = _conditional_bodies(hlo.hlo_text(compiled))
  assert all(c.computation not in inside for c in report.collectives)


def test_streaming_refuses_two_overlaps():
  with pytest.raises(ValueError, match="overlap_steps=1 and overlap='eager'"):
    optim.streaming_diloco(optax.sgd(LR), 4, num_fragments=2, overlap_steps=1,
                           **sync_args(overlap="eager"))


@pytest.mark.slow
@pytest.mark.parametrize("overlap,trickle,name", [
    ("eager", True, None), ("delayed", True, None), ("eager", False, None),
    ("eager", True, "static_ring")])
def test_virtual_workers_follow_one_worker_per_device(overlap, trickle, name,
                                                      x64):
  """8 workers as 2 devices of 4 (vmapped) = 8 devices, float64."""
  del x64
  devices = require_devices(8)
  x0, b = _problem(8, seed=14)
  topo = None if name is None else topology.make(name, 8)
  tx = optim.diloco(optax.sgd(LR), 3, **sync_args(overlap=overlap, latency=2,
      trickle=trickle, topology=topo))
  want, _ = _run(tx, x0, b, 12)
  mesh = parallel.make_mesh(8, devices=devices[:2], workers_per_device=4)
  assert parallel.worker_axis(mesh).per_device == 4
  tx = optim.diloco(optax.sgd(LR), 3, **sync_args(overlap=overlap, latency=2,
      trickle=trickle, topology=topo, axis_name=parallel.worker_axis(mesh)))
  step, init, _ = _step_fns(tx, 8, mesh)
  params = parallel.shard(x0, mesh)
  targets = parallel.shard(b, mesh)
  state = init(params)
  for t in range(12):
    params, state = step(params, state, targets)
    for k, v in jax.device_get(params).items():
      np.testing.assert_allclose(v, want[t][k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [None, pytest.param("static_ring",
                                                     marks=pytest.mark.slow)])
def test_comm_dtype_trickled_equals_one_shot_bit_for_bit(name):
  """Pseudo-gradients sent in bfloat16 (summed in float32 for the mean;
  gossiped with the own term exact): trickled = one-shot bit for bit, and
  within bfloat16 rounding of the float32 run."""
  require_devices(4)
  x0, b = _problem(4, seed=15)
  x0 = {k: v.astype(np.float32) for k, v in x0.items()}
  b = {k: v.astype(np.float32) for k, v in b.items()}
  topo = None if name is None else topology.make(name, 4)
  runs = [_run(optim.diloco(optax.sgd(LR), 3, **sync_args(topology=topo,
      overlap="eager", comm_dtype=dtype, trickle=t)), x0, b, 12)[0]
          for dtype, t in ((jnp.bfloat16, True), (jnp.bfloat16, False),
                           (None, True))]
  for p, q, r in zip(*runs):
    for k in p:
      np.testing.assert_array_equal(p[k], q[k])
      np.testing.assert_allclose(p[k], r[k], rtol=2e-2, atol=2e-2)
  assert any(not np.array_equal(runs[0][-1][k], runs[2][-1][k]) for k in b)


# --------------------------------------------------------------------------
# The runner's steps scheduled for GPUs (committed fixtures, written on a
# CPU-only machine by benchmarks/bench_gpu_overlap.py: tests/fixtures/README).
# --------------------------------------------------------------------------

_GPU = os.path.join(FIXTURES, "gpu_overlap", "outer")
# gpt_tiny: 434,816 float32 parameters (tests/tools/test_overlap.py); the
# trickled slice is ceil(434,816 / 10) = 43,482 of them (H = 10).
_PARAMS = 434_816
_SLICE_BYTES = 4 * -(-_PARAMS // 10)


def _gpu_report(name):
  with gzip.open(os.path.join(_GPU, f"{name}.hlo.gz"), "rt") as f:
    return overlap.overlap_report(f.read())


@pytest.mark.parametrize("name", ["diloco_eager_after_h200_rNone_none",
                                  "diloco_eager_after_a100_sxm_80_rNone_none"])
def test_gpu_trickled_slice_is_async_with_backward_in_flight(name):
  """Every step all-reduces |B|/H, asynchronously, outside any conditional,
  with backward GEMMs scheduled between its start and done."""
  rep = _gpu_report(name)
  assert rep.scheduled
  (c,) = rep.collectives
  assert (c.kind, c.bytes) == ("all-reduce", _SLICE_BYTES)
  assert c.is_async and not c.in_conditional and c.overlapped
  assert c.backward > 0 and c.flops > 0.2 * rep.total_flops


def test_gpu_trickled_slice_shares_the_consensus_all_reduce():
  """In the step that measures the consensus distance XLA combines the
  slice with that mean of the parameters: one all-reduce, still async,
  outside conditionals, with the backward pass in flight."""
  big = _gpu_report("diloco_eager_after_h200_rNone_input").select(
      min_bytes=4 * _PARAMS)
  assert [(c.kind, c.bytes) for c in big] == [("all-reduce",
                                                4 * _PARAMS + _SLICE_BYTES)]
  assert big[0].overlapped and big[0].backward > 0


def test_gpu_one_shot_and_plain_reductions_sit_in_the_sync_conditional():
  """The controls: plain DiLoCo and the one-shot reduction all-reduce the
  whole pseudo-gradient (padded to 10 slices for one-shot) inside the sync
  step's conditional, with no forward or backward work in flight."""
  for name, size in (("diloco_after_h200_rNone_none", 4 * _PARAMS),
                     ("diloco_eager_one_shot_after_h200_rNone_none",
                      10 * _SLICE_BYTES)):
    (c,) = _gpu_report(name).collectives
    assert (c.kind, c.bytes) == ("all-reduce", size), name
    assert c.in_conditional and not c.overlapped, name
    assert c.forward + c.backward == 0, name


def test_gpu_streaming_fragments_trickle_outside_conditionals():
  """Two fragments, each |B_p|/H per step (XLA may combine them)."""
  rep = _gpu_report("streaming_eager_after_h200_rNone_none")
  assert rep.collectives
  total = sum(c.bytes for c in rep.collectives)
  assert _SLICE_BYTES <= total <= _SLICE_BYTES + 4  # one padding each
  assert all(c.is_async and not c.in_conditional and c.backward > 0
             for c in rep.collectives)


@pytest.mark.integration
def test_deviceless_compile_of_the_trickled_step():
  """Compiled here (requirements-gpu-compile.txt): as the fixture says."""
  from decentral_jax.runner import config as config_lib
  from decentral_jax.tools import gpu_compile
  config = config_lib.load_config(
      os.path.join(os.path.dirname(FIXTURES), "..", "configs", "gpt_tiny.py"),
      ("algorithm=diloco", "outer_overlap=eager"))
  _, steps = gpu_compile.compile_steps(config, target="h200",
                                      topology="1x1x8",
                                      programs=[(None, "none")])
  (c,) = steps[0].report.collectives
  assert (c.kind, c.bytes) == ("all-reduce", _SLICE_BYTES)
  assert c.overlapped and c.backward > 0, steps[0].report.summary()


def test_an_overlapped_outer_step_with_a_compressed_reduction_is_refused():
  """The library refusal names the library's arguments (and the runner's
  fields after them)."""
  from decentral_jax.comm.compress import Compressor  # pylint: disable=import-outside-toplevel
  from decentral_jax.optim import outer_timing, reductions  # pylint: disable=import-outside-toplevel
  for timing in (outer_timing.Delayed(1), outer_timing.Eager(1)):
    with pytest.raises(ValueError, match=r"^timing=.*has no compressed form.*"
                       r"pass timing=outer_timing.Plain\(\) or an exact "
                       r"reduction instead of reductions.compressed"):
      optim.diloco(optax.sgd(LR), 2, timing=timing,
                   reduction=reductions.compressed(Compressor("int8")))
