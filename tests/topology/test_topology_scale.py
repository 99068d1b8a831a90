"""Sparse topology plans: independent dense oracles, spectral gap and
finite-time consensus against NumPy, memory at n = 16384, HLO size vs n."""

from __future__ import annotations

import re
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import sparse

from conftest import require_devices
from decentral_jax.comm import gossip
from decentral_jax import parallel
from decentral_jax import topology

# --------------------------------------------------------------------------
# Dense oracles written from the definitions (module docstring, decent-dp).
# --------------------------------------------------------------------------


def _group_mean(n, groups):
  w = np.zeros((n, n))
  for g in groups:
    for i in g:
      for j in g:
        w[i, j] = 1.0 / len(g)
  return w


def _oracle(name, n, local=1, shape=None):
  """List of dense rounds, built with plain Python loops."""
  if name == "complete":
    return [np.full((n, n), 1.0 / n)]
  if name == "ring":
    return [_group_mean(n, [(2 * j, 2 * j + 1) for j in range(n // 2)]),
            _group_mean(n, [(2 * j, (2 * j - 1) % n) for j in range(n // 2)])]
  if name == "one_peer_exp":
    r_max = n.bit_length() - 1
    return [_group_mean(n, [(j, j + 2**r) for j in range(n) if not j & 2**r])
            for r in range(r_max)]
  if name == "alternating_exp_ring":
    nodes = n // local
    node = lambda v: list(range(v * local, (v + 1) * local))
    r_max = nodes.bit_length() - 1
    if r_max == 0:
      return [_group_mean(n, [node(0)])]
    rounds = [[] for _ in range(2 * r_max)]
    c = 0
    for i in range(r_max):
      for v in range(nodes):
        mu = v ^ 2**i
        if mu > v:
          # c even: the two node means in round 2i, their joint mean in
          # round 2i+1; c odd: the reverse.
          apart, joint = (2 * i, 2 * i + 1) if c % 2 == 0 else (2 * i + 1, 2 * i)
          rounds[apart] += [node(v), node(mu)]
          rounds[joint].append(node(v) + node(mu))
          c += 1
    return [_group_mean(n, g) for g in rounds]
  w = np.zeros((n, n))
  if name == "exponential":
    tau = int(np.ceil(np.log2(n)))
    for i in range(n):
      w[i, i] += 1 / (tau + 1)
      for k in range(tau):
        w[(i + 2**k) % n, i] += 1 / (tau + 1)
    return [w]
  if name == "static_ring":
    for i in range(n):
      for d in (-1, 0, 1):
        w[i, (i + d) % n] += 1 / 3
    return [w]
  if name == "torus":
    rows, cols = shape
    for r in range(rows):
      for c in range(cols):
        for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
          w[r * cols + c, ((r + dr) % rows) * cols + (c + dc) % cols] += 0.2
    return [w]
  raise AssertionError(name)


def _torus_shape(n):
  rows = max(d for d in range(1, int(np.sqrt(n)) + 1) if n % d == 0)
  return rows, n // rows


def _cases():
  for n in (2, 3, 4, 6, 8, 12, 16, 18, 32, 64):
    yield "complete", n, 1
    yield "exponential", n, 1
    yield "static_ring", n, 1
    yield "torus", n, 1
    if n % 2 == 0:
      yield "ring", n, 1
    if n & (n - 1) == 0:
      yield "one_peer_exp", n, 1
      for local in (1, 2, 4):
        if n % local == 0:
          yield "alternating_exp_ring", n, local
  yield "alternating_exp_ring", 12, 3
  yield "alternating_exp_ring", 24, 3


CASES = list(_cases())


def _make(name, n, local):
  topo = topology.make(name, n, local)
  refs = _oracle(name, n, local, _torus_shape(n) if name == "torus" else None)
  return topo, refs


def _period_oracle(refs):
  p = np.eye(refs[0].shape[0])
  for w in refs:
    p = w @ p
  return p


def _gap_oracle(p):
  """1 - ||P - J||_2 from the eigenvalues of (P - J)^T (P - J)."""
  n = p.shape[0]
  d = p - 1.0 / n
  return max(0.0, 1.0 - float(np.sqrt(max(np.linalg.eigvalsh(d.T @ d)[-1], 0))))


# n <= 16 in the fast tier; larger n only in the full suite.
SMALL = [c if c[1] <= 16 else pytest.param(*c, marks=pytest.mark.slow)
         for c in CASES]


@pytest.mark.parametrize("name,n,local", SMALL)
def test_plan_reproduces_oracle(name, n, local):
  topo, refs = _make(name, n, local)
  assert topo.period == len(refs)
  x = np.random.default_rng(n).normal(size=(n, 3))
  for r, ref in enumerate(refs):
    rnd = topo.rounds[r]
    np.testing.assert_allclose(topo.mixing_matrix(r), ref, rtol=0, atol=1e-15)
    rebuilt = np.diag(np.asarray(rnd.self_weights, np.float64))
    for term in rnd.terms:  # what gossip sends: self + sum_s diag(w_s) P_s
      pairs = list(term.perm)
      assert len({s for s, _ in pairs}) == len(pairs) == len({d for _, d in pairs})
      for s, d in pairs:
        rebuilt[d, s] += term.weights[d]
    np.testing.assert_allclose(rebuilt, ref, rtol=0, atol=1e-15)
    if rnd.groups is not None:  # the pmean plan is the same matrix
      np.testing.assert_allclose(_group_mean(n, rnd.groups), ref, rtol=0, atol=1e-15)
      assert sorted(w for g in rnd.groups for w in g) == list(range(n))
    np.testing.assert_allclose(rnd.apply(x), ref @ x, rtol=0, atol=1e-14)
    np.testing.assert_allclose(rnd.apply(x, transpose=True), ref.T @ x,
                               rtol=0, atol=1e-14)
  np.testing.assert_allclose(topo.period_product(), _period_oracle(refs),
                             rtol=0, atol=1e-14)


@pytest.mark.parametrize("name,n,local", [
    c for c, plain in zip(SMALL, CASES) if plain[1] >= 4])
def test_spectral_gap_matches_numpy_oracle(name, n, local):
  topo, refs = _make(name, n, local)
  want = _gap_oracle(_period_oracle(refs))
  for method in ("auto", "closed_form", "dense"):
    assert topo.spectral_gap(method) == pytest.approx(want, abs=1e-12), method
  assert topo.spectral_gap("sparse") == pytest.approx(want, abs=1e-9)


def _random_schedule(rng, n, period, column_only=False):
  """Birkhoff mixtures of random permutations (doubly stochastic), or
  random non-negative matrices with unit columns."""
  mats = []
  for _ in range(period):
    if column_only:
      w = rng.random((n, n)) * (rng.random((n, n)) < 0.4) + np.eye(n)
      mats.append(w / w.sum(axis=0))
      continue
    w = np.zeros((n, n))
    for c in rng.dirichlet(np.ones(3)):
      w[np.arange(n), rng.permutation(n)] += c
    mats.append(w)
  return mats


@pytest.mark.parametrize("seed", range(6))
def test_spectral_gap_custom_schedules(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(4, 40))
  mats = _random_schedule(rng, n, 1 + seed % 3, column_only=seed >= 4)
  topo = topology.from_matrices(mats, column_stochastic=seed >= 4)
  want = _gap_oracle(_period_oracle(mats))
  assert topo.spectral_gap() == pytest.approx(want, abs=1e-12)
  assert topo.spectral_gap("dense") == pytest.approx(want, abs=1e-12)
  assert topo.spectral_gap("sparse") == pytest.approx(want, abs=1e-9)
  with pytest.raises(ValueError, match="no closed-form"):
    topo.spectral_gap("closed_form")
  with pytest.raises(ValueError, match="method must be"):
    topo.spectral_gap("svd")


def test_spectral_gap_symmetric_static_matches_eigvals():
  # 1 - max(|lambda_2|, |lambda_n|) from np.linalg.eigvals, incl. a custom W.
  w = _random_schedule(np.random.default_rng(7), 10, 1)[0]
  w = (w + w.T) / 2
  for topo, ref in [(topology.from_matrices([w]), w),
                    (topology.make("torus", 20), _oracle("torus", 20, 1, (4, 5))[0]),
                    (topology.make("static_ring", 11), _oracle("static_ring", 11)[0])]:
    lam = np.sort(np.abs(np.linalg.eigvals(ref)))[::-1]
    for method in ("auto", "dense", "sparse"):
      assert topo.spectral_gap(method) == pytest.approx(1 - lam[1], abs=1e-9)


def _hypercube_schedule(n, perturb=0.0):
  """log2 n rounds of pair means {j, j ^ 2^r}: exact average (by hand)."""
  rounds = []
  for r in range(n.bit_length() - 1):
    partner = [j ^ (1 << r) for j in range(n)]
    rounds.append([(list(range(n)), 0.5 + perturb), (partner, 0.5 - perturb)])
  return topology.from_permutations(rounds)


@pytest.mark.parametrize("topo,expected", [
    (topology.make("complete", 6), True),
    (topology.make("one_peer_exp", 32), True),
    (topology.make("aer", 24, 3), True),
    (topology.make("ring", 4), True),       # W1 W0 = J for four workers
    (topology.make("static_ring", 3), True),  # 1/3 everywhere
    (topology.make("ring", 6), False),
    (topology.make("static_ring", 8), False),
    (topology.make("exponential", 16), False),
    (topology.make("torus", 9), False),
    (_hypercube_schedule(16), True),
    (_hypercube_schedule(16, perturb=0.1), False),
    (_hypercube_schedule(16, perturb=1e-9), False),
])
def test_finite_time_consensus(topo, expected):
  n = topo.n_workers
  p = np.eye(n)
  for r in range(topo.period):
    p = topo.mixing_matrix(r) @ p
  assert np.allclose(p, 1.0 / n, rtol=0, atol=1e-12) is expected  # oracle
  for method in ("auto", "dense", "random"):
    assert topo.has_finite_time_consensus(method=method) is expected, method
  with pytest.raises(ValueError, match="method must be"):
    topo.has_finite_time_consensus(method="exact")


@pytest.mark.slow
def test_finite_time_consensus_large_n_without_dense():
  assert topology.make("aer", 4096, 8).has_finite_time_consensus()
  assert topology.make("one_peer_exp", 4096).has_finite_time_consensus()
  assert not topology.make("ring", 4096).has_finite_time_consensus()
  assert not topology.make("exponential", 4096).has_finite_time_consensus()


# --------------------------------------------------------------------------
# n = 16384: memory, and each round against a NumPy formula on a vector.
# --------------------------------------------------------------------------

N_BIG = 16384


def _formula(name, r, x):
  """W_r x at n = N_BIG by closed formulas (rolls and reshapes)."""
  n = x.shape[0]
  if name == "complete":
    return np.broadcast_to(x.mean(0), x.shape)
  if name == "ring":
    y = np.roll(x, -r, axis=0).reshape(n // 2, 2, -1).mean(1, keepdims=True)
    return np.roll(np.broadcast_to(y, (n // 2, 2, x.shape[1])).reshape(x.shape),
                   r, axis=0)
  if name == "one_peer_exp":
    return (x + x[np.arange(n) ^ (1 << r)]) / 2
  if name == "exponential":
    tau = (n - 1).bit_length()
    return (x + sum(np.roll(x, 1 << k, axis=0) for k in range(tau))) / (tau + 1)
  if name == "static_ring":
    return (np.roll(x, 1, axis=0) + x + np.roll(x, -1, axis=0)) / 3
  if name == "torus":
    g = x.reshape(128, 128, -1)
    return ((g + np.roll(g, 1, 0) + np.roll(g, -1, 0) + np.roll(g, 1, 1) +
             np.roll(g, -1, 1)) / 5).reshape(x.shape)
  raise AssertionError(name)


@pytest.mark.slow
def test_every_builtin_at_16384_is_sparse():
  tracemalloc.start()
  try:
    built = {name: topology.make(name, N_BIG, 8 if name == "alternating_exp_ring" else 1)
             for name in topology.NAMES}
    gaps = {name: t.spectral_gap() for name, t in built.items()}
    ftc = {name: t.has_finite_time_consensus() for name, t in built.items()}
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # One dense float64 round would be 2 GiB; the whole set stays under 100 MB.
  assert peak < 100 * 2**20, peak / 2**20
  assert ftc == {"complete": True, "ring": False, "one_peer_exp": True,
                 "alternating_exp_ring": True, "exponential": False,
                 "torus": False, "static_ring": False}
  assert gaps["ring"] == pytest.approx(1 - np.cos(np.pi / (N_BIG // 2)), abs=1e-15)
  assert gaps["static_ring"] == pytest.approx(
      (2 - 2 * np.cos(2 * np.pi / N_BIG)) / 3, abs=1e-15)
  x = np.random.default_rng(0).normal(size=(N_BIG, 2))
  for name, topo in built.items():
    if name == "alternating_exp_ring":
      continue  # its rounds are checked through P = J above
    for r in sorted({0, 1, topo.period - 1}):
      np.testing.assert_allclose(topo.round(r).apply(x), _formula(name, r, x),
                                 rtol=0, atol=1e-12, err_msg=f"{name} round {r}")
  assert built["complete"].rounds[0].is_global_mean
  assert built["alternating_exp_ring"].rounds[1].node_partners(8) is not None


# --------------------------------------------------------------------------
# Traced gossip: the program does not grow with n.
# --------------------------------------------------------------------------


def _op_count(topo, n):
  mesh = parallel.make_mesh(n)
  axis = parallel.worker_axis(mesh)
  fn = jax.jit(parallel.per_worker(
      lambda t, s: gossip.mix(t, topo, s, axis), mesh, replicated_argnums=(1,)))
  x = parallel.shard({"a": np.zeros((n, 5), np.float32)}, mesh)
  text = fn.lower(x, jnp.int32(0)).as_text()
  return len(re.findall(r"\bstablehlo\.[a-z_]+", text))


@pytest.mark.slow
@pytest.mark.parametrize("name,small,large", [
    ("ring", 8, 16), ("static_ring", 8, 16), ("complete", 8, 16),
    ("exponential", 9, 16), ("torus", 9, 15),
])
def test_traced_gossip_size_does_not_grow_with_n(name, small, large):
  require_devices(large)
  a, b = topology.make(name, small), topology.make(name, large)
  shape = lambda t: [("pmean" if r.is_global_mean else len(r.terms))
                     for r in t.distinct_rounds]
  assert shape(a) == shape(b)  # the same collectives, on more workers
  assert _op_count(a, small) == _op_count(b, large)


# --------------------------------------------------------------------------
# The plan objects keep the old API semantics.
# --------------------------------------------------------------------------


def test_round_and_term_api():
  w = np.array([[0.5, 0.3, 0.2, 0.0],
                [0.2, 0.5, 0.0, 0.3],
                [0.3, 0.0, 0.5, 0.2],
                [0.0, 0.2, 0.3, 0.5]])
  topo = topology.from_matrices([w, np.eye(4), w.copy()])
  assert topo.round_to_distinct == (0, 1, 0)
  a, c = topo.rounds[0], topo.rounds[2]
  assert a != c and a.same_matrix(c) and len({a, c}) == 2  # identity hashing
  assert not a.matrix.flags.writeable
  m = topo.mixing_matrix(0)
  m[0, 0] = 9.0  # a copy
  assert topo.mixing_matrix(0)[0, 0] == 0.5
  for t_a, t_c in zip(a.terms, c.terms):  # terms compare by value
    assert t_a == t_c and hash(t_a) == hash(t_c)
    pairs = list(t_a.perm)
    assert all(type(s) is int and type(d) is int for s, d in pairs)
    assert [t_a.weights[d] for _, d in pairs] == [w[d, s] for s, d in pairs]
  # A round built from its plan alone equals the one decomposed from W.
  b = topology.Round(self_weights=a.self_weights, terms=a.terms)
  assert b.same_matrix(a) and b.groups is None
  np.testing.assert_array_equal(b.matrix, w)
  # Two rounds of the ring on two workers are the same pair mean.
  ring2 = topology.make("ring", 2)
  assert ring2.round_to_distinct == (0, 0)
  assert ring2.rounds[0].is_global_mean and ring2.rounds[0].groups == ((0, 1),)
  with pytest.raises(ValueError, match="not a partition"):
    topology.Round(groups=[(0, 1), (1, 2)])
  bad = sparse.csr_array(np.array([[1.0, 0.5], [0.0, 0.4]]))
  with pytest.raises(ValueError, match=r"W is not column stochastic: column 1 "
                     r"sums to 0\.9"):
    topology.check_column_sums(bad, "W")


def test_dense_access_changes_nothing():
  topo = topology.make("aer", 16, 4)
  rnd = topo.rounds[1]
  before = (rnd.is_global_mean, rnd.groups, rnd.node_partners(4),
            [t.perm for t in rnd.terms])
  dense = rnd.matrix
  assert (rnd.is_global_mean, rnd.groups, rnd.node_partners(4),
          [t.perm for t in rnd.terms]) == before
  x = np.random.default_rng(0).normal(size=(16, 2))
  np.testing.assert_allclose(rnd.apply(x), dense @ x, rtol=0, atol=1e-15)
  assert rnd.is_symmetric() and topo.is_symmetric()
  assert topology.make("complete", 64).max_messages_per_step() == 63
  assert topology.make("exponential", 64).max_messages_per_step() == 6


@pytest.mark.parametrize("name, n", [("ring", 2**40), ("static_ring", 2**24),
                                     ("exponential", 2**16 + 1)])
def test_n_workers_above_max_workers_refused_at_once(name, n):
  """65536 workers at most (2**40 ran out of memory, 2**24 took minutes)."""
  with pytest.raises(ValueError) as info:
    topology.make(name, n)
  message = str(info.value)
  assert "\n" not in message
  assert f"n_workers={n}" in message and "65536" in message, message
  assert topology.MAX_WORKERS == 65536
  assert topology.make("ring", 65536).n_workers == 65536
