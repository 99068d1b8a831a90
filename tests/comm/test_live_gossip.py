"""Gossip over live workers (comm.faults) against a dense NumPy oracle.

The oracle builds W' from its definition: w'_ij = w_ij a_i a_j (i != j),
w'_ii = 1 - sum_{j != i} w'_ij for a live i, identity rows for dead workers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax import topology
from decentral_jax.comm import faults
from decentral_jax.comm import gossip
from helpers import local_size, valid

# Every topology at n = 8 in the fast tier, at n = 6 in the full suite.
CASES = [pytest.param(name, n, marks=() if n == 8 else pytest.mark.slow)
         for name in topology.NAMES for n in (6, 8) if valid(name, n)]


def oracle(w: np.ndarray, a: np.ndarray) -> np.ndarray:
  n = len(a)
  out = np.zeros((n, n))
  for i in range(n):
    if not a[i]:
      out[i, i] = 1.0
      continue
    for j in range(n):
      if j != i and a[j]:
        out[i, j] = w[i, j]
    out[i, i] = 1.0 - out[i].sum()
  return out


def _data(n, seed=0):
  rng = np.random.default_rng(seed)
  return {"a": rng.normal(size=(n, 3, 2)).astype(np.float32),
          "b": rng.normal(size=(n,)).astype(np.float32)}


def _fns(topo, mesh):
  axis = parallel.worker_axis(mesh)
  live = jax.jit(parallel.per_worker(
      lambda t, k, a: faults.live_mix(t, topo, k, a, axis), mesh,
      replicated_argnums=(1, 2)))
  plain = jax.jit(parallel.per_worker(
      lambda t, k: gossip.mix(t, topo, k, axis), mesh,
      replicated_argnums=(1,)))
  return live, plain


@pytest.mark.parametrize("name,n", CASES)
def test_live_mix_matches_oracle(name, n):
  require_devices(n)
  topo = topology.make(name, n, local_size(name, n))
  mesh = parallel.make_mesh(n)
  live, plain = _fns(topo, mesh)
  x = _data(n)
  xs = parallel.shard(x, mesh)
  alive = np.ones(n, bool)
  alive[[1, n - 2]] = False
  for step in range(topo.period):
    out = live(xs, jnp.int32(step), jnp.asarray(alive))
    wp = oracle(topo.mixing_matrix(step), alive)
    # Rows sum to 1; dead rows are the identity.
    np.testing.assert_allclose(wp.sum(1), 1.0, atol=1e-12)
    if topo.round(step).is_symmetric():
      # Doubly stochastic on the live set, nothing crosses to the dead.
      live_set = np.ix_(alive, alive)
      np.testing.assert_allclose(wp[live_set].sum(0), 1.0, atol=1e-12)
      np.testing.assert_allclose(wp[live_set].sum(1), 1.0, atol=1e-12)
      assert not wp[np.ix_(alive, ~alive)].any()
    for k in x:
      got = np.asarray(out[k])
      ref = np.einsum("ij,j...->i...", wp, x[k].astype(np.float64))
      np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
      np.testing.assert_array_equal(got[~alive], x[k][~alive])  # bit for bit
      if topo.round(step).is_symmetric():
        np.testing.assert_allclose(got[alive].mean(0), x[k][alive].mean(0),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,n", CASES)
def test_all_alive_is_bit_identical_to_mix(name, n):
  # On this data every kernel rounds alike; on other data a last bit may
  # differ (test_all_alive_within_the_sums_rounding states the bound).
  require_devices(n)
  topo = topology.make(name, n, local_size(name, n))
  mesh = parallel.make_mesh(n)
  live, plain = _fns(topo, mesh)
  xs = parallel.shard(_data(n, 1), mesh)
  everyone = jnp.ones(n, bool)
  for step in range(topo.period + 1):
    got = live(xs, jnp.int32(step), everyone)
    want = plain(xs, jnp.int32(step))
    for k in got:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


# Random data: static_ring and torus (where a last bit differs) in the fast
# tier, every other topology in the full suite.
RANDOM_CASES = [pytest.param(name, marks=() if name in ("static_ring", "torus")
                             else pytest.mark.slow)
                for name in topology.NAMES if valid(name, 8)]


def _random_tree(n, seed):
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(-3, 3)
  tree = {}
  for dtype in (np.float32, np.float64, jnp.bfloat16):
    for shape in ((7,), (3, 5), (1,), (33,)):
      v = rng.normal(size=(n,) + shape) * scale
      tree[f"{np.dtype(dtype).name}{shape}"] = v.astype(dtype)
  return tree


@pytest.mark.parametrize("name", RANDOM_CASES)
def test_all_alive_within_the_sums_rounding(name, x64):
  # With everyone alive live_mix sums gossip.mix's products in its order;
  # a kernel may contract one into an FMA where the other does not, so the
  # two agree within 2 k u sum_j |w_ij x_j| (k terms of the row, u the
  # unit roundoff of the sum's dtype), plus one leaf ulp for bfloat16.
  del x64
  n = 8
  require_devices(n)
  topo = topology.make(name, n, local_size(name, n))
  mesh = parallel.make_mesh(n)
  live, plain = _fns(topo, mesh)
  everyone = jnp.ones(n, bool)
  for seed in range(3):
    x = _random_tree(n, seed)
    xs = parallel.shard(x, mesh)
    for step in range(min(topo.period, 3) + 1):
      got, want = live(xs, jnp.int32(step), everyone), plain(xs, jnp.int32(step))
      w = topo.mixing_matrix(step)
      k = (w != 0).sum(1)
      for key, v in x.items():
        g = np.asarray(got[key]).astype(np.float64)
        m = np.asarray(want[key]).astype(np.float64)
        mag = np.einsum("ij,j...->i...", np.abs(w),
                        np.abs(v.astype(np.float64)))
        u = 2.0 ** -53 if v.dtype == np.float64 else 2.0 ** -24
        bound = 2 * k.reshape((n,) + (1,) * (v.ndim - 1)) * u * mag
        if v.dtype == jnp.bfloat16:
          bound = bound + np.abs(m) * 2.0 ** -7
        assert (np.abs(g - m) <= bound).all(), (name, seed, step, key)
        # And gossip.mix itself is W x within the same bound.
        exact = np.einsum("ij,j...->i...", w, v.astype(np.float64))
        assert (np.abs(m - exact) <= bound).all(), (name, seed, step, key)


def test_exponential_drifts_the_live_mean():
  # A directed round: with worker 1 dead the oracle's W' is row but not
  # column stochastic on the live set, so the live mean moves; live_mix
  # moves it by the oracle's amount.
  n = 8
  require_devices(n)
  topo = topology.make("exponential", n)
  w = topo.mixing_matrix(0)
  alive = np.ones(n, bool)
  alive[1] = False
  wp = oracle(w, alive)
  x = _data(n)["b"].astype(np.float64)
  drift = (wp @ x)[alive].mean() - x[alive].mean()
  assert abs(drift) > 1e-3
  mesh = parallel.make_mesh(n)
  live, _ = _fns(topo, mesh)
  out = np.asarray(live(parallel.shard({"b": x.astype(np.float32)}, mesh),
                        jnp.int32(0), jnp.asarray(alive))["b"])
  np.testing.assert_allclose(out[alive].mean() - x[alive].mean(), drift,
                             atol=1e-5)


@pytest.mark.parametrize("kind", ["node_aware", "virtual"])
def test_other_meshes(kind):
  # alternating_exp_ring on a (nodes, local) mesh and on 2 workers per
  # device: bit-identical to mix with everyone alive, the oracle otherwise.
  n = 8
  require_devices(n)
  topo = topology.make("alternating_exp_ring", n, 2)
  mesh = (parallel.make_mesh(n, 2, node_aware=True) if kind == "node_aware"
          else parallel.make_mesh(n, workers_per_device=2))
  live, plain = _fns(topo, mesh)
  x = _data(n, 2)
  xs = parallel.shard(x, mesh)
  alive = np.ones(n, bool)
  alive[[2, 5]] = False
  for step in range(topo.period):
    got = live(xs, jnp.int32(step), jnp.ones(n, bool))
    want = plain(xs, jnp.int32(step))
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(want["a"]))
    out = np.asarray(live(xs, jnp.int32(step), jnp.asarray(alive))["a"])
    ref = np.einsum("ij,j...->i...", oracle(topo.mixing_matrix(step), alive),
                    x["a"].astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(out[~alive], x["a"][~alive])


def test_dead_worker_with_nan_does_not_poison_neighbours():
  n = 6
  require_devices(n)
  topo = topology.make("static_ring", n)
  mesh = parallel.make_mesh(n)
  live, _ = _fns(topo, mesh)
  x = _data(n)
  x["b"][3] = np.nan
  alive = np.ones(n, bool)
  alive[3] = False
  out = np.asarray(live(parallel.shard(x, mesh), jnp.int32(0),
                        jnp.asarray(alive))["b"])
  assert np.isfinite(out[alive]).all() and np.isnan(out[3])


def test_freeze_and_mask_checks():
  n = 4
  require_devices(n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda new, old, a: faults.freeze(new, old, a, axis), mesh,
      replicated_argnums=(2,)))
  new = {"c": np.arange(n, dtype=np.int32), "x": np.ones((n, 2), np.float32)}
  old = {"c": -np.ones(n, np.int32), "x": np.zeros((n, 2), np.float32)}
  alive = np.array([True, False, True, False])
  out = fn(parallel.shard(new, mesh), parallel.shard(old, mesh),
           jnp.asarray(alive))
  np.testing.assert_array_equal(np.asarray(out["c"]), [0, -1, 2, -1])
  np.testing.assert_array_equal(np.asarray(out["x"])[:, 0], [1, 0, 1, 0])
  topo = topology.make("ring", n)
  with pytest.raises(ValueError, match=r"alive must be a bool array of shape \(4,\)"):
    jax.jit(parallel.per_worker(
        lambda t: faults.live_mix(t, topo, 0, jnp.ones(3, bool), axis),
        mesh))(parallel.shard(new["x"], mesh))


def test_neighbour_mean_rejoin():
  # Worker 2 rejoins on a static ring (W = (I + S + S^T) / 3): it takes the
  # mean of workers 1 and 3; with 3 dead too it takes worker 1 alone.
  n = 6
  require_devices(n)
  topo = topology.make("static_ring", n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda t, a, r: faults.neighbour_mean(t, topo, 0, a, r, axis), mesh,
      replicated_argnums=(1, 2)))
  x = np.arange(n, dtype=np.float32) * 10
  x[2] = 99.0  # stale
  rejoin = np.zeros(n, bool)
  rejoin[2] = True
  out = np.asarray(fn(parallel.shard(x, mesh), jnp.ones(n, bool),
                      jnp.asarray(rejoin)))
  np.testing.assert_allclose(out, [0, 10, 20, 30, 40, 50])
  alive = np.ones(n, bool)
  alive[3] = False
  out = np.asarray(fn(parallel.shard(x, mesh), jnp.asarray(alive),
                      jnp.asarray(rejoin)))
  np.testing.assert_allclose(out, [0, 10, 10, 30, 40, 50])
  # No rejoin: nothing changes.
  out = np.asarray(fn(parallel.shard(x, mesh), jnp.ones(n, bool),
                      jnp.zeros(n, bool)))
  np.testing.assert_array_equal(out, x)


def _decentralized_oracle(w_of, x0, b, alive, working, lr):
  """D-SGD over live workers, from the definitions, in float64."""
  x = x0.astype(np.float64).copy()
  last = np.ones(len(b), bool)
  out = []
  for k in range(len(alive)):
    a, rej = alive[k], alive[k] & ~last
    live = a & ~rej
    w = w_of(k)
    mixed = oracle(w, live) @ x
    step = working[k] & live
    target = np.where(step[:, None], mixed - lr * (x - b), mixed)
    for i in np.flatnonzero(rej):
      weights = np.array([w[i, j] if j != i and live[j] else 0.0
                          for j in range(len(b))])
      if weights.sum() > 0:
        target[i] = weights @ target / weights.sum()
    x, last = target, a
    out.append(x.copy())
  return out


def test_decentralized_over_live_workers(x64):
  # D-SGD (decentralized(sgd)) on a static ring of 6: worker 2 dead at
  # steps 1, 2 (rejoins at 3), worker 4 a straggler on even steps.
  del x64
  n, lr, steps = 6, 0.1, 6
  require_devices(n)
  topo = topology.make("static_ring", n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  tx = optim.decentralized(optax.sgd(lr), topo, axis)
  rng = np.random.default_rng(4)
  x0, b = rng.normal(size=(n, 3)), rng.normal(size=(n, 3))
  alive = np.ones((steps, n), bool)
  alive[1:3, 2] = False
  working = alive.copy()
  working[0::2, 4] = False
  rejoining = alive & ~np.vstack([np.ones((1, n), bool), alive[:-1]])

  def step(x, s, t, *masks):
    kw = dict(zip(("alive", "working", "rejoining"), masks))
    u, s = tx.update(x - t, s, x, **kw)
    return optax.apply_updates(x, u), s

  fns = {k: jax.jit(parallel.per_worker(step, mesh,
                                        replicated_argnums=tuple(range(3, 3 + k))))
         for k in (0, 3)}
  target = parallel.shard(b, mesh)

  def run(with_masks, a=alive, w=working, r=rejoining):
    x = parallel.shard(x0, mesh)
    s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
    out = []
    for k in range(steps):
      masks = (jnp.asarray(a[k]), jnp.asarray(w[k]),
               jnp.asarray(r[k])) if with_masks else ()
      x, s = fns[len(masks)](x, s, target, *masks)
      out.append(np.asarray(x))
    return out

  want = _decentralized_oracle(topo.mixing_matrix, x0, b, alive, working, lr)
  for g, w in zip(run(True), want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
  # Everyone alive: the masked program computes the same sums, but XLA
  # fuses it differently around live_mix's selects, so its FMA contractions
  # may round the last bit differently (the runner runs healthy steps
  # without masks, bit for bit; live_mix alone is within the rounding of
  # mix's sum: test_all_alive_within_the_sums_rounding).
  everyone = np.ones((steps, n), bool)
  plain = run(False)
  for g, w in zip(run(True, everyone, everyone, ~everyone), plain):
    np.testing.assert_array_max_ulp(g, w, maxulp=2)


def test_freeze_from_worker_neighbour_mean_refuse_bad_masks_and_workers():
  n = 4
  require_devices(n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  x = parallel.shard(np.arange(3 * n, dtype=np.float32).reshape(n, 3), mesh)

  def call(f):
    return jax.jit(parallel.per_worker(f, mesh))(x)

  shape = r"alive must be a bool array of shape \(4,\)"
  for mask, got in ((jnp.array([True, False]), r"got bool\[2\]"),
                    (np.array([1.0, 0.0, 1.0, 0.0]), r"got float32\[4\]"),
                    (np.array([1, 2, 0, 0]), r"got int32\[4\]"),
                    ([True, False, True, "x"], "got list"),
                    (None, "got NoneType")):
    with pytest.raises(ValueError, match=shape + r".*" + got):
      call(lambda t, m=mask: faults.freeze(t, t * 0, m, axis))
  with pytest.raises(ValueError, match="freeze: new and old must be pytrees "
                     "of one structure"):
    call(lambda t: faults.freeze({"a": t}, {"b": t}, jnp.ones(n, bool), axis))
  for worker, phrase in ((7, r"worker must be an int >= 0 and <= 3, got 7"),
                         (-1, r"worker must be an int >= 0 and <= 3, got -1"),
                         (1.5, r"worker must be an int >= 0 and <= 3, got 1.5"),
                         (True, r"got True"),
                         (np.float32(2), r"got np.float32\(2.0\)"),
                         (jnp.zeros(2, jnp.int32), r"got int32\[2\]"),
                         (jnp.float32(1), r"scalar array, got float32\[\]")):
    with pytest.raises(ValueError, match=phrase):
      call(lambda t, w=worker: faults.from_worker(t, w, axis))
  # A concrete integer array names worker 2 (every worker gets its row).
  got = np.asarray(call(lambda t: faults.from_worker(t, jnp.int32(2), axis)))
  np.testing.assert_array_equal(got, np.tile([6.0, 7.0, 8.0], (n, 1)))
  topo = topology.make("static_ring", n)
  dead1 = np.array([True, False, True, True])
  rejoin1 = np.array([False, True, False, False])
  with pytest.raises(ValueError, match="rejoining names worker 1, which is "
                     "not alive"):
    call(lambda t: faults.neighbour_mean(t, topo, 0, dead1, rejoin1, axis))
  with pytest.raises(ValueError, match=r"rejoining must be a bool array of "
                     r"shape \(4,\).*got str"):
    call(lambda t: faults.neighbour_mean(t, topo, 0, dead1, "all", axis))
  # Traced masks cannot be refused: a dead worker marked rejoining keeps its
  # parameters (it is not alive), it does not take its neighbours' mean.
  fn = jax.jit(parallel.per_worker(
      lambda t, a, r: faults.neighbour_mean(t, topo, 0, a, r, axis), mesh,
      replicated_argnums=(1, 2)))
  out = np.asarray(fn(x, jnp.asarray(dead1), jnp.asarray(rejoin1)))
  np.testing.assert_array_equal(out, np.asarray(x))
