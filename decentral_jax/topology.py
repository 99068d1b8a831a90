"""Topologies: periodic schedules of mixing matrices for gossip averaging.

A topology is a periodic list of *rounds*; round ``t % period`` is used at
step ``t``. Each round is one ``n x n`` mixing matrix ``W_t`` (row ``i`` holds
the weights worker ``i`` gives to what it receives; rows = receiving worker)
that is non-negative and doubly stochastic. The same object carries both the
maths (``mixing_matrix``, ``spectral_gap``) and the plan that realises the
round on devices with ``jax.lax.ppermute`` / ``jax.lax.pmean``
(:mod:`decentral_jax.gossip` consumes it).

Built-in topologies (``make(name, n_workers, local_size)``):

* ``complete``: one round, ``W = J = 11^T / n``.
* ``ring``: period 2, pairs ``{2j, 2j+1}`` then ``{2j, 2j-1 mod n}``,
  weight 1/2 (n even). Matches ``decent-dp``'s ``ring``.
* ``one_peer_exp``: one-peer exponential graph, period ``log2 n``, round
  ``r`` pairs ``{j, j XOR 2^r}`` with weight 1/2 (n a power of two). Exact
  average after one period (Ying et al. 2021; ``decent-dp``'s
  ``one-peer-exp``).
* ``alternating_exp_ring`` (``aer``): node-aware, ``n = local_size x 2^R``;
  alternates intra-node group means with two-node group means exactly as
  ``decent-dp``'s ``alternating-exp-ring`` (Wang et al. 2025, Fig. 12).
* ``exponential``: static exponential graph (Ying et al. 2021); worker ``i``
  sends to ``i + 2^k mod n``, ``k = 0..ceil(log2 n)-1``, uniform weights
  ``1/(ceil(log2 n)+1)``. Not symmetric.
* ``torus``: 2-D torus, self + 4 neighbours, weight 1/5 each (coinciding
  neighbours on a side of length <= 2 add up their weights).
* ``static_ring``: self + both ring neighbours, 1/3 each.

Custom schedules: :func:`from_matrices` and :func:`from_permutations`.
``from_matrices(..., column_stochastic=True)`` accepts matrices whose columns
alone sum to 1 (directed graphs, for push-sum in
:mod:`decentral_jax.push_sum`); such a topology has ``doubly_stochastic ==
False`` and plain gossip (:func:`decentral_jax.gossip.mix`) refuses it.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Sec. 3 and the ``decent-dp`` library, ``topo.py``).
  Ying et al., `Exponential Graph is Provably Efficient for Decentralized
  Deep Training <https://arxiv.org/abs/2110.13363>`_, NeurIPS 2021.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

_TOL = 1e-9


@dataclasses.dataclass(frozen=True)
class PermuteTerm:
  """One ``jax.lax.ppermute`` of a round, with per-receiver weights.

  Attributes:
    perm: ``(source, destination)`` pairs, exactly as ``lax.ppermute`` takes
      them; sources are distinct and destinations are distinct.
    weights: length-``n`` tuple of floats; ``weights[i]`` multiplies what
      worker ``i`` receives through this term (0 where ``i`` receives nothing).
  """

  perm: tuple[tuple[int, int], ...]
  weights: tuple[float, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Round:
  """One mixing round: its matrix and how it is realised with collectives.

  Attributes:
    matrix: ``np.ndarray`` [n, n] float64, doubly stochastic (only column
      stochastic in push-sum topologies), rows = receiver.
    self_weights: ``np.ndarray`` [n] float64, the diagonal of ``matrix``.
    terms: ppermute terms; ``matrix = diag(self_weights) + sum_s diag(w_s)
      P_s`` where ``P_s`` is the (partial) permutation of term ``s``.
    groups: the partition of workers if the round is a set of group means
      (``W_ij = 1/|G|`` for ``i, j`` in the same group ``G``), else ``None``.
  """

  matrix: np.ndarray
  self_weights: np.ndarray
  terms: tuple[PermuteTerm, ...]
  groups: tuple[tuple[int, ...], ...] | None

  @property
  def n_workers(self) -> int:
    return self.matrix.shape[0]

  @property
  def is_identity(self) -> bool:
    """True if the round communicates nothing."""
    return not self.terms

  @property
  def is_global_mean(self) -> bool:
    """True if the round is the exact average of all workers (``W = J``)."""
    return self.groups is not None and len(self.groups) == 1 and self.n_workers > 1

  def node_partners(self, local_size: int) -> tuple[int, ...] | None:
    """Node-level plan for a 2-D ``(nodes, local)`` mesh, if one exists.

    Returns a tuple with one entry per node: ``-1`` if the round is the mean
    within that node, or the index of the partner node if it is the mean over
    the two nodes. ``None`` if the round is not of that form (then it is
    realised with flat ppermutes).
    """
    if self.groups is None or local_size < 1 or self.n_workers % local_size:
      return None
    n_nodes = self.n_workers // local_size
    partners = [-2] * n_nodes
    for g in self.groups:
      nodes = sorted({w // local_size for w in g})
      if len(g) != len(nodes) * local_size or len(nodes) > 2:
        return None
      if len(nodes) == 1:
        partners[nodes[0]] = -1
      else:
        partners[nodes[0]], partners[nodes[1]] = nodes[1], nodes[0]
    return tuple(partners)


def _partition_of(w: np.ndarray) -> tuple[tuple[int, ...], ...] | None:
  """Return the groups if ``w`` is a block of uniform group means."""
  n = w.shape[0]
  seen = [False] * n
  groups = []
  for i in range(n):
    if seen[i]:
      continue
    g = tuple(int(j) for j in np.flatnonzero(w[i] > 0))
    if i not in g:
      return None
    for j in g:
      if seen[j] or not np.allclose(w[j], _indicator(n, g) / len(g),
                                    atol=1e-15, rtol=0):
        return None
    for j in g:
      seen[j] = True
    groups.append(g)
  return tuple(groups)


def _indicator(n: int, g: Sequence[int]) -> np.ndarray:
  v = np.zeros(n)
  v[list(g)] = 1.0
  return v


def _group_terms(groups, n) -> tuple[PermuteTerm, ...]:
  """``max|G| - 1`` ppermutes: in term s, member a receives from a+s (mod |G|)."""
  terms = []
  for s in range(1, max(len(g) for g in groups)):
    perm, weights = [], [0.0] * n
    for g in groups:
      m = len(g)
      if m <= s:
        continue
      for a, dst in enumerate(g):
        perm.append((g[(a + s) % m], dst))
        weights[dst] = 1.0 / m
    terms.append(PermuteTerm(tuple(sorted(perm)), tuple(weights)))
  return tuple(terms)


def _general_terms(w: np.ndarray) -> tuple[PermuteTerm, ...]:
  """Cover the off-diagonal support of ``w`` with few partial permutations.

  Edges are grouped by cyclic offset ``(src - dst) mod n`` (each class is a
  partial permutation), then classes whose sources and destinations are
  disjoint are merged greedily (largest first).
  """
  n = w.shape[0]
  classes = {}
  for dst in range(n):
    for src in range(n):
      if src != dst and w[dst, src] > 0:
        classes.setdefault((src - dst) % n, []).append((src, dst))
  merged: list[list[tuple[int, int]]] = []
  for _, edges in sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    for bucket in merged:
      srcs = {s for s, _ in bucket}
      dsts = {d for _, d in bucket}
      if not any(s in srcs or d in dsts for s, d in edges):
        bucket.extend(edges)
        break
    else:
      merged.append(list(edges))
  terms = []
  for bucket in merged:
    weights = [0.0] * n
    for s, d in bucket:
      weights[d] = float(w[d, s])
    terms.append(PermuteTerm(tuple(sorted(bucket)), tuple(weights)))
  return tuple(terms)


def check_column_sums(w: np.ndarray, where: str) -> None:
  """Raises ``ValueError`` unless every column of ``w`` sums to 1.

  Column ``j`` holds what worker ``j`` keeps and sends; a column-stochastic
  matrix moves all of every worker's mass (push-sum, Assran et al. 2019).

  Args:
    w: float64 [n, n] mixing matrix.
    where: what ``w`` is, for the message (e.g. ``"mixing matrix 2"``).
  """
  k, total = _first_bad_sum(w, axis=0)
  if k is not None:
    raise ValueError(
        f"{where} is not column stochastic: column {k} sums to "
        f"{total:.6g}, expected 1 (column j holds what worker j keeps and "
        "sends; together it must be all of its mass).")


def _first_bad_sum(w, axis: int) -> tuple[int | None, float]:
  """The first row (axis 1) or column (axis 0) not summing to 1, and its sum."""
  sums = np.asarray(w, np.float64).sum(axis=axis)
  bad = np.flatnonzero(np.abs(sums - 1.0) > _TOL)
  return (int(bad[0]), float(sums[bad[0]])) if bad.size else (None, 1.0)


def _validate_matrix(w, index: int, n: int | None,
                     column_stochastic: bool = False) -> np.ndarray:
  where = f"mixing matrix {index}"
  try:
    w = np.array(w, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where} is not a numeric array: {e}") from None
  if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
    raise ValueError(f"{where} must be a square [n, n] array, got shape "
                     f"{w.shape}.")
  if n is not None and w.shape[0] != n:
    raise ValueError(f"{where} has shape {w.shape} but the first matrix is "
                     f"{n} x {n}; all rounds need the same number of workers.")
  if not np.all(np.isfinite(w)):
    raise ValueError(f"{where} has non-finite entries.")
  if np.any(w < 0):
    i, j = np.argwhere(w < 0)[0]
    raise ValueError(f"{where} has a negative entry W[{i}, {j}] = {float(w[i, j]):.6g}; "
                     "mixing weights must be >= 0.")
  if column_stochastic:
    check_column_sums(w, where)
    return w
  for axis, label in ((1, "row"), (0, "column")):
    k, total = _first_bad_sum(w, axis)
    if k is not None:
      raise ValueError(
          f"{where} is not doubly stochastic: {label} {k} sums to "
          f"{total:.6g}, expected 1 (every row and column of W must sum to "
          "1).")
  return w


def _round_from_matrix(w: np.ndarray) -> Round:
  w = w.copy()
  w.setflags(write=False)
  groups = _partition_of(w)
  if groups is not None and all(len(g) == 1 for g in groups):
    terms = ()
  elif groups is not None:
    terms = _group_terms(groups, w.shape[0])
  else:
    terms = _general_terms(w)
  self_w = np.diag(w).copy()
  self_w.setflags(write=False)
  return Round(matrix=w, self_weights=self_w, terms=terms, groups=groups)


def _rounds_equal(a: Round, b: Round) -> bool:
  return np.array_equal(a.matrix, b.matrix)


class Topology:
  """A periodic schedule of mixing rounds over ``n_workers`` workers.

  Round ``step % period`` is applied at step ``step``. Instances are
  immutable and hashable by identity, so they can be closed over by jitted
  functions without retracing.

  Attributes:
    name: topology name (``"custom"`` for :func:`from_matrices`).
    n_workers: number of workers ``n``.
    local_size: workers per node ``L`` (used by node-aware topologies and by
      the 2-D ``(nodes, local)`` realisation in :mod:`decentral_jax.gossip`).
    rounds: tuple of :class:`Round`, length ``period``.
    doubly_stochastic: True if every round's rows sum to 1 too (all but
      ``from_matrices(..., column_stochastic=True)`` topologies).
  """

  def __init__(self, name: str, rounds: Sequence[Round], local_size: int = 1):
    if not rounds:
      raise ValueError("a topology needs at least one round.")
    self.name = name
    self.rounds = tuple(rounds)
    self.n_workers = self.rounds[0].n_workers
    self.local_size = int(local_size)
    self.doubly_stochastic = all(
        np.all(np.abs(r.matrix.sum(axis=1) - 1.0) <= _TOL) and
        np.all(np.abs(r.matrix.sum(axis=0) - 1.0) <= _TOL) for r in self.rounds)
    # Distinct rounds, and the map round index -> distinct index; the gossip
    # module compiles one branch per distinct round.
    distinct: list[Round] = []
    index = []
    for r in self.rounds:
      for k, d in enumerate(distinct):
        if _rounds_equal(r, d):
          index.append(k)
          break
      else:
        index.append(len(distinct))
        distinct.append(r)
    self.distinct_rounds = tuple(distinct)
    self.round_to_distinct = tuple(index)

  def __repr__(self) -> str:
    return (f"Topology(name={self.name!r}, n_workers={self.n_workers}, "
            f"period={self.period}, local_size={self.local_size})")

  @property
  def period(self) -> int:
    """Number of rounds before the schedule repeats."""
    return len(self.rounds)

  @property
  def n_nodes(self) -> int:
    """Number of nodes ``n_workers // local_size``."""
    return self.n_workers // self.local_size

  def round(self, step: int) -> Round:
    """The :class:`Round` used at integer ``step`` (``step % period``)."""
    return self.rounds[int(step) % self.period]

  def mixing_matrix(self, step: int) -> np.ndarray:
    """``W_step`` as a float64 ``np.ndarray`` of shape [n, n] (a copy)."""
    return np.array(self.round(step).matrix)

  def period_product(self) -> np.ndarray:
    """``W_{p-1} ... W_1 W_0`` (float64 [n, n]), the map of one full period."""
    prod = np.eye(self.n_workers)
    for r in self.rounds:
      prod = r.matrix @ prod
    return prod

  def spectral_gap(self) -> float:
    """``1 - ||P - J||_2`` where ``P`` is the period product, ``J = 11^T/n``.

    For a static symmetric ``W`` this is the usual ``1 - max(|lambda_2|,
    |lambda_n|)``. 1.0 means exact averaging after one period; 0.0 means no
    contraction of the disagreement (e.g. a disconnected schedule).
    """
    n = self.n_workers
    if n == 1:
      return 1.0
    dev = self.period_product() - np.full((n, n), 1.0 / n)
    return float(max(0.0, 1.0 - np.linalg.norm(dev, 2)))

  def has_finite_time_consensus(self, atol: float = 1e-12) -> bool:
    """True if one period maps any input exactly to its average (``P = J``)."""
    n = self.n_workers
    return bool(np.allclose(self.period_product(), np.full((n, n), 1.0 / n),
                            rtol=0, atol=atol))

  def is_symmetric(self) -> bool:
    """True if every round's matrix is symmetric."""
    return all(np.array_equal(r.matrix, r.matrix.T) for r in self.rounds)

  def max_messages_per_step(self) -> int:
    """Largest number of ppermute messages any worker sends in one round."""
    best = 0
    for r in self.rounds:
      for i in range(self.n_workers):
        best = max(best, sum(1 for t in r.terms for s, _ in t.perm if s == i))
    return best


# --------------------------------------------------------------------------
# Constructors.
# --------------------------------------------------------------------------


def from_matrices(matrices: Sequence, *, name: str = "custom",
                  local_size: int = 1,
                  column_stochastic: bool = False) -> Topology:
  """Builds a periodic topology from explicit mixing matrices.

  Each matrix is validated (square, same size, finite, non-negative, every
  row and column summing to 1 within 1e-9) and decomposed into ppermute
  terms with per-receiver weights covering its support. Rounds that are
  group means are realised with ``max|G|-1`` ppermutes (or one ``pmean``
  when ``W = J``).

  Args:
    matrices: sequence of ``p`` arrays [n, n]; round ``t % p`` is used at step
      ``t``. Rows are receiving workers: ``x_new[i] = sum_j W[i, j] x[j]``.
    name: name reported by the topology.
    local_size: workers per node, for node-aware realisation on 2-D meshes.
    column_stochastic: only require every column to sum to 1 (a directed
      graph for push-sum, :mod:`decentral_jax.push_sum`); doubly stochastic
      matrices pass too.

  Returns:
    A :class:`Topology` with ``period == len(matrices)``.

  Raises:
    ValueError: empty list, wrong shape, negative or non-finite entries, or a
      row/column not summing to 1 (the message names it and its sum).
  """
  matrices = list(matrices)
  if not matrices:
    raise ValueError("from_matrices needs at least one [n, n] matrix.")
  n = None
  rounds = []
  for k, w in enumerate(matrices):
    w = _validate_matrix(w, k, n, column_stochastic)
    n = w.shape[0]
    rounds.append(_round_from_matrix(w))
  _check_local_size(n, local_size)
  return Topology(name, rounds, local_size)


def from_permutations(rounds: Sequence[Sequence[tuple[Sequence[int], float]]],
                      *, name: str = "custom") -> Topology:
  """Builds a topology whose round ``r`` is ``W_r = sum_s w_s P_s``.

  Args:
    rounds: for each round, a list of ``(perm, weight)`` where ``perm`` is a
      length-``n`` sequence with ``perm[i]`` = the worker that ``i`` receives
      from (the identity permutation is the self term) and ``weight`` a float.

  Returns:
    A :class:`Topology`.

  Raises:
    ValueError: a ``perm`` that is not a bijection of ``0..n-1`` (the message
      names the repeated or missing worker), or a resulting matrix that is not
      doubly stochastic.
  """
  mats = []
  for r, terms in enumerate(rounds):
    if not terms:
      raise ValueError(f"round {r} has no (perm, weight) terms.")
    n = len(terms[0][0])
    w = np.zeros((n, n))
    for s, (perm, weight) in enumerate(terms):
      perm = [int(p) for p in perm]
      if len(perm) != n:
        raise ValueError(f"round {r}, term {s}: permutation has length "
                         f"{len(perm)}, expected {n}.")
      if sorted(perm) != list(range(n)):
        missing = sorted(set(range(n)) - set(perm))
        repeated = sorted({p for p in perm if perm.count(p) > 1})
        raise ValueError(
            f"round {r}, term {s}: {perm} is not a bijection of 0..{n - 1} "
            f"(repeated: {repeated}, missing or out of range: {missing}); "
            "perm[i] must be the single worker that i receives from.")
      for i, j in enumerate(perm):
        w[i, j] += float(weight)
    mats.append(w)
  return from_matrices(mats, name=name)


def _check_local_size(n: int, local_size: int) -> None:
  if not isinstance(local_size, (int, np.integer)) or local_size < 1:
    raise ValueError(f"local_size must be a positive integer, got {local_size!r}.")
  if n % local_size:
    raise ValueError(
        f"n_workers={n} is not divisible by local_size={local_size} (workers "
        f"per node); use a local_size that divides {n}, e.g. "
        f"{[d for d in range(1, n + 1) if n % d == 0]}.")


def _log2_exact(n: int) -> int | None:
  """``log2(n)`` if ``n`` is a power of two (integer arithmetic), else None."""
  if n >= 1 and n & (n - 1) == 0:
    return n.bit_length() - 1
  return None


def _group_matrix(n: int, groups: Sequence[Sequence[int]]) -> np.ndarray:
  w = np.zeros((n, n))
  for g in groups:
    for i in g:
      w[i, list(g)] = 1.0 / len(g)
  return w


def complete(n_workers: int, local_size: int = 1) -> Topology:
  """Complete graph: one round, ``W = 11^T / n`` (realised by ``pmean``)."""
  return from_matrices([np.full((n_workers, n_workers), 1.0 / n_workers)],
                       name="complete", local_size=local_size)


def ring(n_workers: int, local_size: int = 1) -> Topology:
  """Alternating ring (period 2): pairs {2j, 2j+1}, then {2j, 2j-1 mod n}."""
  n = n_workers
  if n % 2:
    raise ValueError(f"topology 'ring' needs an even number of workers, got "
                     f"n_workers={n}; use an even n or 'static_ring'.")
  r0 = [(2 * j, 2 * j + 1) for j in range(n // 2)]
  r1 = [tuple(sorted((2 * j, (2 * j - 1) % n))) for j in range(n // 2)]
  return from_matrices([_group_matrix(n, r0), _group_matrix(n, r1)],
                       name="ring", local_size=local_size)


def one_peer_exp(n_workers: int, local_size: int = 1) -> Topology:
  """One-peer exponential graph: round r pairs {j, j XOR 2^r}, r < log2 n."""
  n = n_workers
  big_r = _log2_exact(n)
  if big_r is None:
    lo = 1 << (n.bit_length() - 1)
    raise ValueError(
        f"topology 'one_peer_exp' needs n_workers to be a power of two, got "
        f"{n}; the nearest valid values are {lo} and {lo * 2} (or use "
        "'exponential', which accepts any n).")
  mats = [_group_matrix(n, [(j, j ^ (1 << r)) for j in range(n) if j < j ^ (1 << r)])
          for r in range(big_r)]
  return from_matrices(mats, name="one_peer_exp", local_size=local_size)


def alternating_exp_ring(n_workers: int, local_size: int = 1) -> Topology:
  """Alternating exponential ring (AER), node-aware, as ``decent-dp`` builds it.

  ``n_workers = local_size * N`` with ``N = 2^R`` nodes; node ``v`` holds
  workers ``v*L .. v*L+L-1``. For ``i < R``, node pairs ``{v, v XOR 2^i}`` are
  enumerated in increasing ``v`` with one counter ``c`` running across all
  pairs: if ``c`` is even, round ``2i`` takes the two intra-node means and
  round ``2i+1`` the mean over both nodes; if odd, the reverse. Period ``2R``
  (one round, the intra-node mean, when ``N = 1``).
  """
  n, big_l = n_workers, local_size
  _check_local_size(n, big_l)
  n_nodes = n // big_l
  big_r = _log2_exact(n_nodes)
  if big_r is None:
    raise ValueError(
        f"topology 'alternating_exp_ring' needs n_workers / local_size to be a "
        f"power of two (number of nodes), got {n} / {big_l} = {n_nodes}.")
  node = lambda v: tuple(range(v * big_l, (v + 1) * big_l))
  if big_r == 0:
    return from_matrices([_group_matrix(n, [node(0)])],
                         name="alternating_exp_ring", local_size=big_l)
  groups = [[] for _ in range(2 * big_r)]
  c = 0
  for i in range(big_r):
    for v in range(n_nodes):
      mu = v ^ (1 << i)
      if mu < v:
        continue
      sep, joint = (2 * i, 2 * i + 1) if c % 2 == 0 else (2 * i + 1, 2 * i)
      groups[sep] += [node(v), node(mu)]
      groups[joint].append(node(v) + node(mu))
      c += 1
  mats = [_group_matrix(n, g) for g in groups]
  return from_matrices(mats, name="alternating_exp_ring", local_size=big_l)


def exponential(n_workers: int, local_size: int = 1) -> Topology:
  """Static exponential graph: ``i`` sends to ``i + 2^k mod n``, weights 1/(tau+1)."""
  n = n_workers
  tau = (n - 1).bit_length()  # ceil(log2 n) for n >= 1, integer arithmetic.
  w = np.eye(n) / (tau + 1)
  for k in range(tau):
    for i in range(n):
      w[(i + (1 << k)) % n, i] += 1.0 / (tau + 1)
  return from_matrices([w], name="exponential", local_size=local_size)


def _infer_torus_shape(n: int) -> tuple[int, int]:
  rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  return rows, n // rows


def torus(n_workers: int, local_size: int = 1,
          shape: tuple[int, int] | None = None) -> Topology:
  """2-D torus: self and the 4 grid neighbours (wrap-around), 1/5 each.

  ``shape`` = (rows, cols) with ``rows * cols == n_workers``; inferred as the
  most square factorisation if omitted. Neighbours that coincide (a side of
  length 2, or 1) add their weights, so ``W`` stays doubly stochastic.
  """
  n = n_workers
  if shape is None:
    shape = _infer_torus_shape(n)
  rows, cols = (int(s) for s in shape)
  if rows < 1 or cols < 1 or rows * cols != n:
    raise ValueError(f"torus shape {tuple(shape)} does not multiply to "
                     f"n_workers={n}; give (rows, cols) with rows*cols == {n}.")
  w = np.zeros((n, n))
  for r in range(rows):
    for c in range(cols):
      i = r * cols + c
      for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
        w[i, ((r + dr) % rows) * cols + (c + dc) % cols] += 0.2
  return from_matrices([w], name="torus", local_size=local_size)


def static_ring(n_workers: int, local_size: int = 1) -> Topology:
  """Static ring: each worker averages itself and both neighbours, 1/3 each."""
  n = n_workers
  w = np.zeros((n, n))
  for i in range(n):
    for d in (-1, 0, 1):
      w[i, (i + d) % n] += 1.0 / 3.0
  return from_matrices([w], name="static_ring", local_size=local_size)


_REGISTRY: dict[str, Callable[..., Topology]] = {
    "complete": complete,
    "ring": ring,
    "one_peer_exp": one_peer_exp,
    "alternating_exp_ring": alternating_exp_ring,
    "exponential": exponential,
    "torus": torus,
    "static_ring": static_ring,
}
_ALIASES = {"aer": "alternating_exp_ring", "exp": "one_peer_exp",
            "one_peer_exponential": "one_peer_exp"}

NAMES = tuple(_REGISTRY)


def canonical_name(name: str) -> str:
  """Normalises ``name`` (``'one-peer-exp'`` -> ``'one_peer_exp'``, aliases).

  Raises:
    ValueError: unknown name; the message lists the known names.
  """
  if not isinstance(name, str):
    raise ValueError(f"topology name must be a string, got {name!r}.")
  key = name.strip().lower().replace("-", "_")
  key = _ALIASES.get(key, key)
  if key not in _REGISTRY:
    raise ValueError(f"unknown topology {name!r}; known topologies: "
                     f"{', '.join(NAMES)} (aliases: {', '.join(_ALIASES)}).")
  return key


def make(name: str, n_workers: int, local_size: int = 1, **kwargs) -> Topology:
  """Builds a built-in topology by name.

  Args:
    name: one of :data:`NAMES` (hyphens allowed, ``'aer'`` is an alias).
    n_workers: number of workers ``n >= 1``. ``n = 1`` always gives the
      identity with no communication.
    local_size: workers per node ``L`` (must divide ``n``); node-aware
      topologies (``alternating_exp_ring``) group workers by node.
    **kwargs: extra constructor arguments (``shape`` for ``torus``).

  Returns:
    A :class:`Topology` whose rounds are validated doubly stochastic matrices.

  Raises:
    ValueError: unknown name (lists the valid ones), ``n_workers < 1``,
      ``local_size`` not dividing ``n``, or a constraint of the topology
      (even n for ``ring``, power of two for ``one_peer_exp``, power-of-two
      node count for ``alternating_exp_ring``).
  """
  key = canonical_name(name)
  if isinstance(n_workers, bool) or not isinstance(n_workers, (int, np.integer)) \
      or n_workers < 1:
    raise ValueError(f"n_workers must be a positive integer, got {n_workers!r}.")
  n_workers = int(n_workers)
  _check_local_size(n_workers, local_size)
  if n_workers == 1:
    return from_matrices([np.eye(1)], name=key, local_size=1)
  return _REGISTRY[key](n_workers, local_size=int(local_size), **kwargs)
