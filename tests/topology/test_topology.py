"""Topology schedules: matrices, reference rounds, invariants and errors."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from conftest import FIXTURES
from decentral_jax import topology
from decentral_jax.topology import schedules
from helpers import all_valid, local_size


def _complete(n, local):
  del local
  return [np.full((n, n), 1.0 / n)]


def _ring(n, local):
  """Period 2: pairs {2j, 2j+1}, then {2j, 2j-1 mod n}, weight 1/2."""
  del local
  out = []
  for r in range(2):
    w = np.zeros((n, n))
    for j in range(n // 2):
      a, b = (2 * j, 2 * j + 1) if r == 0 else (2 * j, (2 * j - 1) % n)
      w[a, a] = w[a, b] = w[b, a] = w[b, b] = 0.5
    out.append(w)
  return out


def _one_peer_exp(n, local):
  """Period log2 n: round r pairs {j, j XOR 2^r}, weight 1/2."""
  del local
  out = []
  for r in range(n.bit_length() - 1):
    w = np.zeros((n, n))
    for j in range(n):
      w[j, j] += 0.5
      w[j, j ^ (1 << r)] += 0.5
    out.append(w)
  return out


def _group_means(n, groups):
  w = np.zeros((n, n))
  for g in groups:
    w[np.ix_(g, g)] = 1.0 / len(g)
  return w


def _alternating_exp_ring(n, local):
  """PAPER.md Sec. 3, "AER construction", with N = n / L = 2^R nodes.

  Node v holds workers vL .. vL+L-1. For i < R the node pairs {v, v XOR 2^i}
  (v the smaller) are taken in increasing v, and one counter c runs over
  all pairs of all i. Pair number c: if c is even, round 2i has each node's
  own mean (weight 1/L) and round 2i+1 the mean over both nodes (1/(2L));
  if c is odd, the other way round. One node: one round, its own mean.
  """
  nodes = n // local
  block = lambda v: list(range(v * local, (v + 1) * local))
  if nodes == 1:
    return [_group_means(n, [block(0)])]
  out, c = [], 0
  for i in range(nodes.bit_length() - 1):
    first, second = [], []
    for v in range(nodes):
      u = v ^ (1 << i)
      if u < v:
        continue
      apart, joint = [block(v), block(u)], [block(v) + block(u)]
      first += apart if c % 2 == 0 else joint
      second += joint if c % 2 == 0 else apart
      c += 1
    out += [_group_means(n, first), _group_means(n, second)]
  return out


def _exponential(n, local):
  """Worker i sends to i + 2^k mod n, k < ceil(log2 n); all weights equal."""
  del local
  tau = int(np.ceil(np.log2(n)))
  w = np.zeros((n, n))
  for i in range(n):
    w[i, i] += 1 / (tau + 1)
    for k in range(tau):
      w[(i + 2**k) % n, i] += 1 / (tau + 1)  # row = receiver
  return [w]


def _torus(n, local):
  """rows x cols grid, rows the largest divisor of n not above sqrt(n);
  worker i at (i // cols, i % cols); self and the 4 wrap-around neighbours,
  1/5 each (coinciding neighbours add up)."""
  del local
  rows = max(d for d in range(1, n + 1) if n % d == 0 and d * d <= n)
  cols = n // rows
  w = np.zeros((n, n))
  for i in range(n):
    r, c = i // cols, i % cols
    for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
      w[i, (r + dr) % rows * cols + (c + dc) % cols] += 0.2
  return [w]


def _static_ring(n, local):
  del local
  w = np.zeros((n, n))
  for i in range(n):
    for d in (-1, 0, 1):
      w[i, (i + d) % n] += 1 / 3
  return [w]


# Dense mixing matrices of one period, written from the definitions (module
# docstring of decentral_jax.topology.schedules, PAPER.md Sec. 3), not from
# the code. Every built-in topology has one (test_every_topology_has_an_oracle).
ORACLES = {"complete": _complete, "ring": _ring,
           "one_peer_exp": _one_peer_exp,
           "alternating_exp_ring": _alternating_exp_ring,
           "exponential": _exponential, "torus": _torus,
           "static_ring": _static_ring}


def test_every_topology_has_an_oracle():
  assert sorted(ORACLES) == sorted(topology.NAMES)


@pytest.mark.parametrize("name,n", list(all_valid()))
def test_rounds_doubly_stochastic_and_match_definition(name, n):
  topo = topology.make(name, n, local_size(name, n))
  assert topo.n_workers == n
  oracle = ORACLES[name](n, local_size(name, n))
  assert topo.period == len(oracle)
  for r in range(topo.period):
    w = topo.mixing_matrix(r)
    assert w.shape == (n, n) and w.dtype == np.float64
    assert np.all(w >= 0)
    np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
    if name != "exponential":
      np.testing.assert_array_equal(w, w.T)
    np.testing.assert_allclose(w, oracle[r], atol=1e-15)
    # The ppermute plan reproduces the matrix exactly.
    rebuilt = np.diag(topo.rounds[r].self_weights)
    for term in topo.rounds[r].terms:
      srcs = [s for s, _ in term.perm]
      dsts = [d for _, d in term.perm]
      assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
      for s, d in term.perm:
        assert s != d
        rebuilt[d, s] += term.weights[d]
    np.testing.assert_allclose(rebuilt, w, atol=1e-15)
  # Step t uses round t % period.
  np.testing.assert_array_equal(topo.mixing_matrix(topo.period + 1),
                                topo.mixing_matrix(1))


def test_periods():
  assert topology.make("complete", 8).period == 1
  assert topology.make("ring", 8).period == 2
  assert topology.make("one_peer_exp", 16).period == 4
  assert topology.make("alternating_exp_ring", 16, 4).period == 4  # 2 * log2(4)
  assert topology.make("alternating_exp_ring", 8, 2).period == 4
  assert topology.make("exponential", 12).period == 1


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(FIXTURES, "*.npz"))))
def test_builtin_rounds_equal_reference(path):
  ref = np.load(path)
  local = 2 if "lws2" in os.path.basename(path) else 1
  topo = topology.make(str(ref["topology"]), int(ref["n_workers"]), local)
  assert topo.period == ref["rounds"].shape[0]
  for r in range(topo.period):
    np.testing.assert_array_equal(topo.mixing_matrix(r), ref["rounds"][r])


def test_aer_16_workers_4_per_node_matches_paper_example():
  # PAPER.md, Sec. 3: N = 4, L = 4.
  topo = topology.make("aer", 16, 4)
  blocks = lambda *nodes: [w for v in nodes for w in range(4 * v, 4 * v + 4)]
  expected = [
      [blocks(0), blocks(1), blocks(2, 3)],
      [blocks(0, 1), blocks(2), blocks(3)],
      [blocks(0), blocks(2), blocks(1, 3)],
      [blocks(0, 2), blocks(1), blocks(3)],
  ]
  oracle = _alternating_exp_ring(16, 4)  # the oracle agrees with it too
  assert topo.period == len(oracle) == len(expected)
  for r, groups in enumerate(expected):
    w = _group_means(16, groups)
    np.testing.assert_array_equal(topo.mixing_matrix(r), w)
    np.testing.assert_array_equal(oracle[r], w)


@pytest.mark.parametrize("name,n,local,expected", [
    ("one_peer_exp", 8, 1, True), ("one_peer_exp", 16, 1, True),
    ("alternating_exp_ring", 8, 2, True), ("alternating_exp_ring", 16, 4, True),
    ("complete", 6, 1, True), ("ring", 8, 1, False), ("torus", 16, 1, False),
    ("static_ring", 8, 1, False), ("exponential", 8, 1, False),
])
def test_finite_time_consensus(name, n, local, expected):
  topo = topology.make(name, n, local)
  assert topo.has_finite_time_consensus() is expected
  prod = np.eye(n)
  for r in range(topo.period):
    prod = topo.mixing_matrix(r) @ prod
  assert np.allclose(prod, 1.0 / n, atol=1e-12) is expected


def test_spectral_gap_against_eigenvalues():
  for name, n in [("static_ring", 8), ("torus", 12), ("exponential", 8)]:
    topo = topology.make(name, n)
    w = topo.mixing_matrix(0)
    if name != "exponential":
      lam = np.sort(np.abs(np.linalg.eigvalsh(w)))[::-1]
      assert topo.spectral_gap() == pytest.approx(1 - lam[1], abs=1e-12)
    else:  # non-symmetric: 1 - second singular value of W
      sv = np.linalg.svd(w, compute_uv=False)
      assert topo.spectral_gap() == pytest.approx(1 - sv[1], abs=1e-12)
  assert topology.make("one_peer_exp", 8).spectral_gap() == pytest.approx(1.0)
  # Ring over 8: ||W1 W0 - J|| = 1/sqrt(2) (PAPER.md Sec. 3).
  assert topology.make("ring", 8).spectral_gap() == pytest.approx(
      1 - np.sqrt(0.5), abs=1e-12)


def test_torus_side_two_is_doubly_stochastic():
  for shape in [(2, 2), (2, 3), (2, 4), (1, 2), (4, 4)]:
    n = shape[0] * shape[1]
    w = topology.torus(n, shape=shape).mixing_matrix(0)
    np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)
    np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
    np.testing.assert_array_equal(w, w.T)
  w = topology.torus(4, shape=(2, 2)).mixing_matrix(0)
  # self 1/5; the right=left neighbour 2/5; the up=down neighbour 2/5.
  np.testing.assert_allclose(w[0], [0.2, 0.4, 0.4, 0.0], atol=1e-15)


def test_single_worker_is_identity_without_communication():
  for name in topology.NAMES:
    topo = topology.make(name, 1)
    assert topo.period == 1
    np.testing.assert_array_equal(topo.mixing_matrix(0), np.eye(1))
    assert all(r.is_identity for r in topo.rounds)



@pytest.mark.parametrize("name", topology.NAMES)
def test_each_constructor_gives_the_identity_for_one_worker(name):
  # Every exported constructor agrees with make for n = 1: W = [[1]].
  topo = getattr(topology, name)(1)
  assert (topo.name, topo.period, topo.n_workers) == (name, 1, 1)
  np.testing.assert_array_equal(topo.mixing_matrix(0), [[1.0]])
  assert all(r.is_identity for r in topo.rounds)
  with pytest.raises(ValueError, match="not divisible by local_size=2"):
    getattr(topology, name)(1, local_size=2)


def test_torus_of_one_worker_still_checks_its_shape():
  with pytest.raises(ValueError, match=r"shape \(2, 1\) does not multiply"):
    topology.torus(1, shape=(2, 1))


@pytest.mark.parametrize("args,match", [
    (("nope", 8), r"unknown topology 'nope'.*one_peer_exp"),
    (("one_peer_exp", 6), r"power of two.*4 and 8"),
    (("one_peer_exp", 12), r"power of two"),
    (("ring", 5), r"even number of workers"),
    (("complete", 8, 3), r"not divisible by local_size=3"),
    (("alternating_exp_ring", 12, 2), r"power of two"),
    (("complete", 0), r"n_workers must be an int >= 1"),
])
def test_make_errors(args, match):
  with pytest.raises(ValueError, match=match):
    topology.make(*args)


def test_power_of_two_check_uses_integers():
  # 2**40 + 2 is not a power of two, but float log2 rounds it to 40.0.
  assert float(np.log2(2**53 + 2)).is_integer()
  assert schedules.log2_exact(2**53 + 2) is None
  assert schedules.log2_exact(2**53) == 53


def test_names_normalised():
  assert topology.make("one-peer-exp", 4).name == "one_peer_exp"
  assert topology.make("AER", 8, 2).name == "alternating_exp_ring"


def test_from_matrices_custom_weights():
  # Non-uniform, non-group-mean doubly stochastic matrix with given support.
  w = np.array([[0.5, 0.3, 0.2, 0.0],
                [0.2, 0.5, 0.0, 0.3],
                [0.3, 0.0, 0.5, 0.2],
                [0.0, 0.2, 0.3, 0.5]])
  topo = topology.from_matrices([w, np.eye(4)])
  assert topo.period == 2
  np.testing.assert_array_equal(topo.mixing_matrix(0), w)
  rnd = topo.rounds[0]
  assert rnd.groups is None
  # Every off-diagonal non-zero covered exactly once.
  covered = np.zeros((4, 4))
  for term in rnd.terms:
    for s, d in term.perm:
      covered[d, s] += 1
  np.testing.assert_array_equal(covered, (w > 0) & ~np.eye(4, dtype=bool))
  assert topo.rounds[1].is_identity


def test_from_matrices_errors():
  with pytest.raises(ValueError, match=r"row 0 sums to 0.9"):
    topology.from_matrices([[[0.5, 0.4], [0.5, 0.6]]])
  with pytest.raises(ValueError, match=r"column 0 sums to 0.7"):
    topology.from_matrices([[[0.5, 0.5], [0.2, 0.8]]])
  with pytest.raises(ValueError, match=r"negative entry W\[0, 1\]"):
    topology.from_matrices([[[1.5, -0.5], [-0.5, 1.5]]])
  with pytest.raises(ValueError, match=r"square"):
    topology.from_matrices([np.ones((2, 3)) / 3])
  with pytest.raises(ValueError, match=r"same number of workers"):
    topology.from_matrices([np.eye(2), np.eye(3)])
  with pytest.raises(ValueError, match=r"at least one"):
    topology.from_matrices([])
  # A bare matrix, None, a complex matrix (float64() dropped the imaginary
  # parts with a warning only) and a non-string name.
  with pytest.raises(ValueError, match=r"a list of \[n, n\] mixing matrices"
                     r".*got ndarray of shape \(2, 2\)"):
    topology.from_matrices(np.eye(2))
  with pytest.raises(ValueError, match=r"got None\."):
    topology.from_matrices(None)
  with pytest.raises(ValueError, match=r"mixing matrix 0 is complex"):
    topology.from_matrices([[[0.5 + 1j, 0.5], [0.5, 0.5]]])
  with pytest.raises(ValueError, match=r"name must be a string, got 5"):
    topology.from_matrices([np.eye(2)], name=5)
  assert topology.from_matrices(w for w in [np.eye(2)]).period == 1
  # A ragged matrix, first or later: named by its index (NumPy's
  # "inhomogeneous shape" named neither the argument nor the matrix).
  for matrices, k in (([[[1.0, 0.0], [1.0]]], 0),
                      ([np.eye(2), [[1.0, 0.0], [1.0]]], 1)):
    with pytest.raises(ValueError, match=(
        rf"^matrices\[{k}\] \(mixing matrix {k}\) is ragged: its rows have "
        r"1, 2 entries; a mixing matrix is a square \[n, n\] array\.$")):
      topology.from_matrices(matrices)


@pytest.mark.parametrize("column_stochastic", [False, True])
def test_bad_sum_printed_exactly_with_the_tolerance(column_stochastic):
  # Row/column 0 sums to 1 + 1e-9 (just outside the 1e-9 tolerance): the
  # message showed "sums to 1, expected 1".
  w = np.array([[0.5 + 1e-9, 0.5], [0.5, 0.5 - 1e-9]])
  with pytest.raises(ValueError) as info:
    topology.from_matrices([w], column_stochastic=column_stochastic)
  message = str(info.value)
  assert "0 sums to 1.000000001 (|sum - 1| = 1.0000000" in message, message
  assert "tolerance 1e-09" in message, message


def test_from_permutations():
  topo = topology.from_permutations([[([0, 1, 2], 0.5), ([1, 2, 0], 0.5)]])
  np.testing.assert_allclose(topo.mixing_matrix(0),
                             [[0.5, 0.5, 0], [0, 0.5, 0.5], [0.5, 0, 0.5]])
  with pytest.raises(ValueError, match=r"not a bijection.*repeated: \[1\]"):
    topology.from_permutations([[([0, 1, 1], 1.0)]])
  with pytest.raises(ValueError, match=r"rounds\[0\]\[0\] perm\[2\] must be "
                     r"an int >= 0 and <= 2, got 3"):  # out of range
    topology.from_permutations([[([0, 1, 3], 1.0)]])


@pytest.mark.parametrize("rounds, message", [
    ([], "from_permutations: rounds is empty; give at least one permutation"),
    (3, "from_permutations: rounds must be a list of rounds"),
    ([[([0, 1], 1.0)], []], "from_permutations: rounds[1] is []; give a "
     "list of at least one (perm, weight) term"),
])
def test_from_permutations_names_itself_and_the_argument(rounds, message):
  with pytest.raises(ValueError) as info:
    topology.from_permutations(rounds)
  assert str(info.value).startswith(message), str(info.value)
