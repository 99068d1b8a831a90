"""SGP / push-sum: worked example, float64 oracle, invariants, errors."""

from __future__ import annotations

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import sparse

from conftest import require_devices
from decentral_jax import optim
from decentral_jax import parallel
from decentral_jax.optim import push_sum
from decentral_jax import topology

# The 3-worker example: column j is what worker j keeps and sends.
P3 = np.array([[1 / 3, 0.0, 0.5],
               [1 / 3, 0.5, 0.0],
               [1 / 3, 0.5, 0.5]])


def _loss(p, c, b):
  """``sum_leaves 0.5 * sum(c * (p - b)^2)``; gradient ``c * (p - b)``."""
  return sum(0.5 * jnp.sum(c[k] * (p[k] - b[k]) ** 2) for k in p)


def _step_fn(tx, mesh, **extra):
  def step(x, s, c, b):
    grads = jax.grad(_loss)(push_sum.debiased(x, s), c, b)
    u, s = tx.update(grads, s, x, **extra)
    return optax.apply_updates(x, u), s

  return jax.jit(parallel.per_worker(step, mesh))


def _problem(n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"a": (3, 2), "b": (4,)}
  x0 = {k: rng.normal(size=s) for k, s in shapes.items()}
  c = {k: rng.uniform(0.5, 2.0, size=(n,) + s) for k, s in shapes.items()}
  b = {k: rng.normal(size=(n,) + s) for k, s in shapes.items()}
  cast = lambda t: jax.tree.map(lambda v: np.asarray(v, dtype), t)
  return cast(x0), cast(c), cast(b)


def _oracle(mats, x0, c, b, lr, momentum, steps):
  """NumPy float64 SGP (Assran et al. Alg. 1) with heavy-ball SGD."""
  n = c["a"].shape[0]
  x = {k: np.broadcast_to(v, (n,) + v.shape).astype(np.float64)
       for k, v in x0.items()}
  m = {k: np.zeros_like(v) for k, v in x.items()}
  w = np.ones(n)
  out = []
  for k in range(steps):
    p = mats[k % len(mats)]
    for key in x:
      z = x[key] / w.reshape((n,) + (1,) * (x[key].ndim - 1))
      m[key] = c[key] * (z - b[key]) + momentum * m[key]
      half = x[key] - lr * m[key]
      x[key] = np.einsum("ij,j...->i...", p, half)
    w = p @ w
    out.append(({kk: v.copy() for kk, v in x.items()}, w.copy()))
  return out


def _random_schedule(n, period, seed):
  """Sparse random column-stochastic matrices (rows do not sum to 1)."""
  rng = np.random.default_rng(seed)
  mats = []
  for _ in range(period):
    a = rng.uniform(size=(n, n)) * (rng.uniform(size=(n, n)) < 0.4)
    a += np.eye(n) * rng.uniform(0.2, 1.0, size=n)
    mats.append(a / a.sum(axis=0, keepdims=True))
  return mats


def test_worked_example():
  require_devices(3)
  topo = topology.from_matrices([P3], column_stochastic=True)
  assert not topo.doubly_stochastic
  mesh = parallel.make_mesh(3)
  tx = push_sum.push_sum(optax.sgd(0.1), topo, parallel.worker_axis(mesh))
  x = parallel.replicate({"v": jnp.float32(1.0)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  c = parallel.shard({"v": np.ones(3, np.float32)}, mesh)
  b = parallel.shard({"v": np.array([3.0, 0.0, -3.0], np.float32)}, mesh)
  x, s = _step_fn(tx, mesh)(x, s, c, b)
  np.testing.assert_allclose(np.asarray(x["v"]), [0.7, 0.85, 1.15], atol=1e-6)
  np.testing.assert_allclose(np.asarray(s.weight), [5 / 6, 5 / 6, 4 / 3],
                             atol=1e-6)
  z = push_sum.debiased(x, s)  # stacked: divides row by row
  np.testing.assert_allclose(np.asarray(z["v"]), [0.84, 1.02, 0.8625],
                             atol=1e-6)


@pytest.mark.parametrize("case", ["random", *(
    pytest.param(c, marks=pytest.mark.slow)
    for c in ("directed_exp", "exponential"))])
def test_matches_float64_oracle(case, x64):
  del x64
  n = 6 if case == "random" else 8
  require_devices(n)
  if case == "random":
    topo = topology.from_matrices(_random_schedule(n, 3, seed=1),
                                  column_stochastic=True)
  elif case == "directed_exp":
    topo = push_sum.one_peer_directed_exp(n)
    assert topo.period == 3
  else:
    topo = topology.make("exponential", n)
  mats = [topo.mixing_matrix(r) for r in range(topo.period)]
  mesh = parallel.make_mesh(n)
  tx = push_sum.sgp(0.05, topo, momentum=0.5, axis_name=parallel.worker_axis(mesh))
  x0, c, b = _problem(n, np.float64)
  x = parallel.replicate(x0, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  cs, bs = parallel.shard(c, mesh), parallel.shard(b, mesh)
  step = _step_fn(tx, mesh)
  for k, (x_ref, w_ref) in enumerate(_oracle(mats, x0, c, b, 0.05, 0.5, 10)):
    x, s = step(x, s, cs, bs)
    assert s.weight.dtype == jnp.float64 and x["a"].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(s.weight), w_ref, rtol=0, atol=1e-12)
    for key in x:
      np.testing.assert_allclose(np.asarray(x[key]), x_ref[key], rtol=0,
                                 atol=1e-12, err_msg=f"step {k} leaf {key}")
  if case == "random":  # the weights really move away from 1
    assert np.abs(np.asarray(s.weight) - 1).max() > 0.05


def test_mass_invariants(x64):
  """sum_i w_i = n, and sum_i x_i changes only by the local SGD steps."""
  del x64
  n, lr = 6, 0.1
  require_devices(n)
  topo = topology.from_matrices(_random_schedule(n, 4, seed=2),
                                column_stochastic=True)
  mesh = parallel.make_mesh(n)
  tx = push_sum.sgp(lr, topo, axis_name=parallel.worker_axis(mesh))
  x0, c, b = _problem(n, np.float64, seed=3)
  x = parallel.replicate(x0, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  step = _step_fn(tx, mesh)
  for _ in range(10):
    z = jax.tree.map(np.asarray, push_sum.debiased(x, s))
    before = jax.tree.map(np.asarray, x)
    x, s = step(x, s, parallel.shard(c, mesh), parallel.shard(b, mesh))
    np.testing.assert_allclose(np.asarray(s.weight).sum(), n, rtol=0,
                               atol=1e-12)
    for key in x:
      local = -lr * c[key] * (z[key] - b[key])
      np.testing.assert_allclose(np.asarray(x[key]).sum(0),
                                 (before[key] + local).sum(0), rtol=0,
                                 atol=1e-12)


def test_doubly_stochastic_equals_dpsgd_adapt_then_combine(x64):
  """w stays 1; SGP = decentralized(sgd, mix_after_update=True), not chain."""
  del x64
  n, lr = 8, 0.1
  require_devices(n)
  topo = topology.make("ring", n)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  sgp = push_sum.sgp(lr, topo, axis_name=axis)
  atc = optim.decentralized(optax.sgd(lr), topo, axis, mix_after_update=True)
  cwa = optax.chain(optax.sgd(lr), optim.gossip_mixing(topo, axis))
  x0, c, b = _problem(n, np.float64, seed=4)
  cs, bs = parallel.shard(c, mesh), parallel.shard(b, mesh)

  def plain_step(tx):
    def step(x, s, c, b):
      u, s = tx.update(jax.grad(_loss)(x, c, b), s, x)
      return optax.apply_updates(x, u), s
    return jax.jit(parallel.per_worker(step, mesh))

  runs = {}
  for name, tx, fn in (("sgp", sgp, _step_fn(sgp, mesh)),
                       ("atc", atc, plain_step(atc)),
                       ("cwa", cwa, plain_step(cwa))):
    x = parallel.replicate(x0, mesh)
    s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
    for _ in range(6):
      x, s = fn(x, s, cs, bs)
    runs[name] = (jax.tree.map(np.asarray, x), s)
  np.testing.assert_allclose(np.asarray(runs["sgp"][1].weight), 1.0, rtol=0,
                             atol=1e-14)
  for key in x0:
    np.testing.assert_allclose(runs["sgp"][0][key], runs["atc"][0][key],
                               rtol=0, atol=1e-12)
    assert np.abs(runs["sgp"][0][key] - runs["cwa"][0][key]).max() > 1e-3


@pytest.mark.slow  # programs of its own
def test_jit_no_retrace_dtypes_and_static_rounds():
  n = 8
  require_devices(n)
  topo = push_sum.one_peer_directed_exp(n)
  mesh = parallel.make_mesh(n)
  tx = push_sum.push_sum(optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.sgd(0.1, momentum=0.9)),
                         topo, parallel.worker_axis(mesh))
  traces = []

  def step(x, s, c, b):
    traces.append(1)
    grads = jax.grad(_loss)(push_sum.debiased(x, s), c, b)
    u, s = tx.update(grads, s, x)
    return optax.apply_updates(x, u), s

  fn = jax.jit(parallel.per_worker(step, mesh), donate_argnums=(0, 1))
  x0, c, b = _problem(n, np.float32, seed=5)
  cs, bs = parallel.shard(c, mesh), parallel.shard(b, mesh)
  x = parallel.replicate(x0, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  dtypes = jax.tree.map(lambda v: v.dtype, (x, s))
  assert s.weight.dtype == jnp.float32 and s.count.dtype == jnp.int32
  static = {r: _step_fn(tx, mesh, round_index=r) for r in range(topo.period)}
  xs = parallel.replicate(x0, mesh)
  ss = jax.jit(parallel.per_worker(tx.init, mesh))(xs)
  for k in range(5):
    x, s = fn(x, s, cs, bs)
    xs, ss = static[k % topo.period](xs, ss, cs, bs)
    assert jax.tree.map(lambda v: v.dtype, (x, s)) == dtypes
  assert len(traces) == 1
  assert np.asarray(s.count).tolist() == [5] * n
  for key in x:
    np.testing.assert_allclose(np.asarray(xs[key]), np.asarray(x[key]),
                               rtol=1e-6, atol=1e-6)


def test_comm_dtype_keeps_mass_and_global_average():
  n = 6
  require_devices(n)
  topo = topology.from_matrices(_random_schedule(n, 2, seed=6),
                                column_stochastic=True)
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  tx = push_sum.sgp(0.1, topo, axis_name=axis, comm_dtype=jnp.bfloat16)
  x0, c, b = _problem(n, np.float32, seed=7)
  x = parallel.replicate(x0, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  step = _step_fn(tx, mesh)
  for _ in range(4):
    x, s = step(x, s, parallel.shard(c, mesh), parallel.shard(b, mesh))
  assert s.weight.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(s.weight).sum(), n, rtol=2e-6)
  sums = {k: np.asarray(v).sum(0) for k, v in x.items()}
  avg = jax.jit(parallel.per_worker(
      lambda x, s: push_sum.global_average(x, s, axis), mesh))
  xa, sa = avg(x, s)
  np.testing.assert_allclose(np.asarray(sa.weight), 1.0, atol=2e-6)
  za = push_sum.debiased(xa, sa)
  for k in x:
    np.testing.assert_allclose(np.asarray(xa[k]).sum(0), sums[k], atol=1e-5)
    np.testing.assert_allclose(np.asarray(za[k]),
                               np.broadcast_to(sums[k] / n, za[k].shape),
                               atol=1e-5)


def test_errors():
  with pytest.raises(ValueError, match=r"not column stochastic: column 1 sums "
                     r"to 0\.9"):
    topology.from_matrices([[[0.5, 0.5], [0.5, 0.4]]], column_stochastic=True)
  with pytest.raises(ValueError, match=r"row 0 sums to 0\.833"):
    topology.from_matrices([P3])  # the default still asks for rows too
  # A Topology assembled by hand from a row- but not column-stochastic round.
  good = topology.from_matrices([[[0.5, 0.5], [0.5, 0.5]]])
  bad = topology.Round(matrix=np.array([[0.5, 0.5], [0.2, 0.8]]),
                       self_weights=np.array([0.5, 0.8]),
                       terms=good.rounds[0].terms, groups=None)
  with pytest.raises(ValueError, match=r"round 0 .* not column stochastic: "
                     r"column 0 sums to 0\.7"):
    push_sum.push_sum(optax.sgd(0.1), topology.Topology("hand", [bad]))
  with pytest.raises(ValueError, match=r"comm_dtype"):
    push_sum.sgp(0.1, good, comm_dtype=jnp.int32)
  tx = push_sum.sgp(0.1, good)
  state = tx.init({"v": jnp.zeros(2)})
  with pytest.raises(ValueError, match=r"needs the numerators x_i \(the "
                     r"parameters\)"):
    tx.update({"v": jnp.zeros(2)}, state)
  with pytest.raises(ValueError, match=r"holds no PushSumState"):
    push_sum.debiased({"v": jnp.zeros(2)}, optax.sgd(0.1).init({"v": jnp.zeros(2)}))


def test_plain_gossip_refuses_column_stochastic_topology():
  require_devices(3)
  topo = topology.from_matrices([P3], column_stochastic=True)
  mesh = parallel.make_mesh(3)
  tx = optax.chain(optax.sgd(0.1), optim.gossip_mixing(topo, "workers"))
  x = parallel.replicate({"v": jnp.float32(1.0)}, mesh)
  s = jax.jit(parallel.per_worker(tx.init, mesh))(x)
  step = parallel.per_worker(lambda x, s: tx.update(x, s, x), mesh)
  with pytest.raises(ValueError, match=r"not doubly stochastic.*push_sum"):
    jax.jit(step)(x, s)
  # A doubly stochastic topology stays one: the flag is only for new ones.
  assert all(topology.make(name, 8).doubly_stochastic
             for name in topology.NAMES)
  assert push_sum.one_peer_directed_exp(8).doubly_stochastic


@pytest.mark.slow
def test_validation_at_16384_never_forms_dense_rounds():
  """push_sum validates every round on its sparse plan: a dense float64
  round at n = 16384 is 2 GiB, the built-ins here together stay < 200 MB."""
  n = 16384
  rng = np.random.default_rng(0)
  keep = rng.uniform(0.2, 0.8, size=n)  # worker i keeps keep[i], sends the rest
  i = np.arange(n)
  directed = topology.Round.from_entries(
      n, np.concatenate([i, (i + 1) % n]), np.concatenate([i, i]),
      np.concatenate([keep, 1 - keep]))
  leaky = topology.Round.from_entries(n, i, i, np.where(i == 7, 0.5, 1.0))
  tracemalloc.start()
  try:
    built = [topology.make(name, n, 8 if name == "alternating_exp_ring" else 1)
             for name in topology.NAMES]
    built.append(topology.Topology("directed", [directed]))
    for topo in built:
      push_sum.push_sum(optax.sgd(0.1), topo)
    with pytest.raises(ValueError, match=r"round 1 .* column 7 sums to 0\.5"):
      push_sum.check_column_stochastic(topology.Topology("leaky", [directed, leaky]))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 200 * 2**20, peak / 2**20
  assert not built[-1].doubly_stochastic
  assert built[0].rounds[0].is_global_mean  # complete: n^2 sparse entries


@pytest.mark.parametrize("as_sparse", [False, True])
@pytest.mark.parametrize("bad", [-0.5, np.nan, np.inf])
def test_negative_or_non_finite_weights(as_sparse, bad):
  w = np.array([[1.0 - bad if np.isfinite(bad) else 0.5, 0.0], [bad, 1.0]])
  rnd = topology.Round(matrix=sparse.csr_array(w) if as_sparse else w)
  assert not rnd.is_nonnegative_finite()
  with pytest.raises(ValueError, match=r"round 0 of topology 'hand' has "
                     r"negative or non-finite weights"):
    push_sum.push_sum(optax.sgd(0.1), topology.Topology("hand", [rnd]))
