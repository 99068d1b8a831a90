"""Mixing rounds stored as sparse permutation plans, and their linear algebra.

A round ``W`` (float64 [n, n], row ``i`` = what worker ``i`` receives) is
kept as the plan that realises it with collectives
(:mod:`decentral_jax.gossip` consumes it)::

  W = diag(self_weights) + sum_s diag(w_s) P_s

where ``P_s`` is the partial permutation of :class:`PermuteTerm` ``s``, or as
a :class:`Partition` of the workers into groups (``W_ij = 1/|G|`` for ``i, j``
in one group ``G``; realised with ``pmean`` or ``max|G| - 1`` ppermutes).
The dense matrix is formed only when asked for (:attr:`Round.matrix`).
Applying a round costs O(nnz) (O(n) for a partition) in vectorised NumPy /
``scipy.sparse``, which is what the schedule-level quantities use
(:func:`deviation_norm`, :func:`maps_to_mean`).

:mod:`decentral_jax.topology` builds schedules from these rounds and
re-exports :class:`PermuteTerm`, :class:`Round`, :class:`Partition` and
:func:`check_column_sums`. This module imports nothing from the package.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import sparse
from scipy.sparse import linalg as sparse_linalg

TOL = 1e-9  # row / column sums must be 1 within this
PARTITION_ATOL = 1e-15  # entries of a group mean: 1/|G| within this
DENSE_MAX = 512  # "auto" methods form [n, n] products up to this n


def _readonly(a, dtype) -> np.ndarray:
  a = np.array(a, dtype=dtype)
  a.setflags(write=False)
  return a


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """Concatenation of ``arange(lo[k], hi[k])`` over ``k``, vectorised."""
  lengths = hi - lo
  total = int(lengths.sum())
  if not total:
    return np.zeros(0, np.int64)
  shift = np.repeat(lo - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
  return np.arange(total, dtype=np.int64) + shift


class PermuteTerm:
  """One ``jax.lax.ppermute`` of a round, with per-receiver weights.

  Args:
    perm: ``(source, destination)`` pairs (a sequence of pairs or an int
      array [k, 2]); sources are distinct and destinations are distinct.
    weights: length-``n`` sequence of floats; ``weights[i]`` multiplies what
      worker ``i`` receives through this term (0 where ``i`` receives
      nothing).

  Attributes:
    perm: the pairs as a tuple of ``(int, int)``, exactly as ``lax.ppermute``
      takes them (built from ``sources`` / ``destinations`` on each access).
    sources, destinations: int64 [k] read-only arrays of the pairs.
    weights: float64 [n] read-only array.
  """

  __slots__ = ("_src", "_dst", "_weights")

  def __init__(self, perm, weights):
    pairs = np.asarray(perm, np.int64).reshape(-1, 2)
    self._src = _readonly(pairs[:, 0], np.int64)
    self._dst = _readonly(pairs[:, 1], np.int64)
    self._weights = _readonly(weights, np.float64)

  @classmethod
  def from_arrays(cls, sources, destinations, weights) -> "PermuteTerm":
    """The term with pairs ``(sources[k], destinations[k])``; no copy of [k, 2]."""
    term = cls.__new__(cls)
    term._src = _readonly(sources, np.int64)
    term._dst = _readonly(destinations, np.int64)
    term._weights = _readonly(weights, np.float64)
    return term

  sources = property(lambda self: self._src)
  destinations = property(lambda self: self._dst)
  weights = property(lambda self: self._weights)

  @property
  def perm(self) -> tuple[tuple[int, int], ...]:
    return tuple(zip(self._src.tolist(), self._dst.tolist()))

  def __eq__(self, other):
    if not isinstance(other, PermuteTerm):
      return NotImplemented
    return (np.array_equal(self._src, other._src) and
            np.array_equal(self._dst, other._dst) and
            np.array_equal(self._weights, other._weights))

  def __hash__(self):
    return hash((self._src.tobytes(), self._dst.tobytes()))

  def __repr__(self):
    return f"PermuteTerm(pairs={self._src.size}, n={self._weights.size})"


class Partition:
  """A partition of workers ``0..n-1`` into groups, stored as two arrays.

  Groups are sorted ascending and ordered by their smallest member.

  Attributes:
    order: int64 [n] read-only, the workers listed group by group.
    starts: int64 [G + 1] read-only; group ``g`` is
      ``order[starts[g]:starts[g + 1]]``.
  """

  __slots__ = ("order", "starts", "_tuples")

  def __init__(self, order, starts):
    self.order = _readonly(order, np.int64)
    self.starts = _readonly(starts, np.int64)
    self._tuples = None

  @classmethod
  def from_labels(cls, labels) -> "Partition":
    """Workers with equal ``labels[i]`` (int [n], any values) form one group."""
    labels = np.asarray(labels, np.int64)
    n = labels.size
    _, inv = np.unique(labels, return_inverse=True)
    first = np.full(inv.max() + 1 if n else 0, n, np.int64)
    np.minimum.at(first, inv, np.arange(n))
    key = first[inv]
    order = np.lexsort((np.arange(n), key))
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    return cls(order, np.concatenate([[0], cuts, [n]]))

  @classmethod
  def from_groups(cls, groups: Sequence[Sequence[int]]) -> "Partition":
    """From a sequence of groups of worker indices covering ``0..n-1`` once.

    Raises:
      ValueError: the groups are not a partition of ``0..n-1``.
    """
    members = [int(w) for g in groups for w in g]
    n = len(members)
    if sorted(members) != list(range(n)) or any(len(g) == 0 for g in groups):
      raise ValueError(f"groups {groups!r} are not a partition of 0..{n - 1}.")
    labels = np.empty(n, np.int64)
    for k, g in enumerate(groups):
      labels[list(g)] = k
    return cls.from_labels(labels)

  @property
  def n_workers(self) -> int:
    return self.order.size

  @property
  def sizes(self) -> np.ndarray:
    """int64 [G], the group sizes."""
    return np.diff(self.starts)

  def labels(self) -> np.ndarray:
    """int64 [n]: the index of each worker's group."""
    out = np.empty(self.n_workers, np.int64)
    out[self.order] = np.repeat(np.arange(self.sizes.size), self.sizes)
    return out

  def as_tuples(self) -> tuple[tuple[int, ...], ...]:
    if self._tuples is None:
      flat = self.order.tolist()
      s = self.starts.tolist()
      self._tuples = tuple(tuple(flat[a:b]) for a, b in zip(s[:-1], s[1:]))
    return self._tuples

  def __eq__(self, other):
    if not isinstance(other, Partition):
      return NotImplemented
    return (np.array_equal(self.order, other.order) and
            np.array_equal(self.starts, other.starts))

  __hash__ = None

  def mean(self, x: np.ndarray) -> np.ndarray:
    """Each row of ``x`` [n, ...] replaced by the mean over its group."""
    sums = np.add.reduceat(x[self.order], self.starts[:-1], axis=0)
    sizes = self.sizes.reshape((-1,) + (1,) * (x.ndim - 1))
    out = np.empty_like(sums, shape=x.shape)
    out[self.order] = np.repeat(sums / sizes, self.sizes, axis=0)
    return out

  def entries(self):
    """``(rows, cols, vals)`` of the group-mean matrix (``sum |G|^2`` entries)."""
    sizes = self.sizes
    gid = np.repeat(np.arange(sizes.size), sizes)
    m = sizes[gid]
    rows = np.repeat(self.order, m)
    cols = self.order[_ranges(self.starts[gid], self.starts[gid + 1])]
    return rows, cols, np.repeat(1.0 / m, m)

  def terms(self) -> tuple[PermuteTerm, ...]:
    """``max|G| - 1`` ppermutes: in term ``s``, member ``a`` receives from
    member ``a + s`` (mod ``|G|``) of its group, with weight ``1/|G|``;
    pairs sorted by source."""
    n, sizes = self.n_workers, self.sizes
    gid = np.repeat(np.arange(sizes.size), sizes)
    start, m = self.starts[gid], sizes[gid]
    a = np.arange(n) - start
    weight = 1.0 / m
    terms = []
    for s in range(1, int(sizes.max()) if n else 0):
      on = m > s
      src = self.order[start[on] + (a[on] + s) % m[on]]
      dst = self.order[on]
      k = np.argsort(src, kind="stable")
      w = np.zeros(n)
      w[dst] = weight[on]
      terms.append(PermuteTerm.from_arrays(src[k], dst[k], w))
    return tuple(terms)


def find_partition(n: int, indptr, indices, data) -> Partition | None:
  """The groups if the CSR matrix is a set of uniform group means, else None.

  Worker ``i`` (ascending, not yet grouped) opens group ``g`` = the support
  of row ``i``, which must contain ``i``; every row ``j`` in ``g`` must be
  ungrouped and equal ``1_g / |g|`` within :data:`PARTITION_ATOL`
  (entries outside ``g`` of at most that size are tolerated).
  ``indices`` must be sorted within each row.
  """
  seen = np.zeros(n, bool)
  inside = np.zeros(n, bool)
  groups = []
  for i in range(n):
    if seen[i]:
      continue
    g = indices[indptr[i]:indptr[i + 1]]
    m = g.size
    k = int(np.searchsorted(g, i))
    if k == m or g[k] != i or seen[g].any():
      return None
    idx = _ranges(indptr[g], indptr[g + 1])
    cols, vals = indices[idx], data[idx]
    inside[g] = True
    on = inside[cols]
    bad = np.where(on, np.abs(vals - 1.0 / m) > PARTITION_ATOL,
                   np.abs(vals) > PARTITION_ATOL)
    inside[g] = False
    if bad.any() or int(on.sum()) != m * m:
      return None
    seen[g] = True
    groups.append(g)
  return Partition(np.concatenate(groups), np.cumsum([0] + [g.size for g in groups]))


def offset_terms(n: int, dst, src, vals) -> tuple[PermuteTerm, ...]:
  """Cover off-diagonal entries ``W[dst, src] = vals`` with few ppermutes.

  Edges are grouped by cyclic offset ``(src - dst) mod n`` (each class is a
  partial permutation), then classes whose sources and destinations are
  disjoint are merged greedily, largest first (ties: smaller offset first).
  Pairs in each term are sorted by source.
  """
  if not dst.size:
    return ()
  off = (src - dst) % n
  by_off = np.argsort(off, kind="stable")
  offsets, first, counts = np.unique(off[by_off], return_index=True,
                                     return_counts=True)
  buckets: list[tuple[np.ndarray, np.ndarray, list]] = []
  for c in np.lexsort((offsets, -counts)):
    idx = by_off[first[c]:first[c] + counts[c]]
    for used_src, used_dst, parts in buckets:
      if not (used_src[src[idx]].any() or used_dst[dst[idx]].any()):
        break
    else:
      used_src, used_dst, parts = np.zeros(n, bool), np.zeros(n, bool), []
      buckets.append((used_src, used_dst, parts))
    used_src[src[idx]] = used_dst[dst[idx]] = True
    parts.append(idx)
  terms = []
  for _, _, parts in buckets:
    idx = np.concatenate(parts)
    idx = idx[np.argsort(src[idx], kind="stable")]
    w = np.zeros(n)
    w[dst[idx]] = vals[idx]
    terms.append(PermuteTerm.from_arrays(src[idx], dst[idx], w))
  return tuple(terms)


def accumulate(n: int, rows, cols, vals):
  """Sums duplicate ``(row, col)`` entries in input order; drops zeros.

  Returns ``(rows, cols, vals)`` sorted row-major, as a dense ``w[r, c] +=
  v`` loop over the input would leave them (same order of additions).
  """
  rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
  key, inv = np.unique(rows * n + cols, return_inverse=True)
  acc = np.zeros(key.size)
  np.add.at(acc, inv, np.asarray(vals, np.float64))
  keep = acc != 0
  return key[keep] // n, key[keep] % n, acc[keep]


class Round:
  """One mixing round ``W`` (float64 [n, n], rows = receivers) and its plan.

  Give either ``matrix`` (its entries are decomposed into a plan unless
  ``terms`` or ``groups`` are given too) or the plan (``groups``, or
  ``self_weights`` and ``terms``). Rounds hash and compare by identity;
  :meth:`same_matrix` compares their matrices.

  Args:
    matrix: optional explicit matrix (array [n, n], or a ``scipy.sparse``
      matrix); when given it is what :attr:`matrix` returns.
    self_weights: float [n], the diagonal; default ``diag(matrix)``, or
      ``1/|G|`` for ``groups``.
    terms: sequence of :class:`PermuteTerm`; default: decomposed from
      ``matrix``, or ``max|G| - 1`` terms built from ``groups`` when first
      used (``Partition.terms``; ``n - 1`` terms of ``n`` pairs for the
      global mean, which gossip realises with ``pmean`` instead), or none.
    groups: ``None``, a :class:`Partition`, or a sequence of groups of worker
      indices, if the round is the set of group means.

  Attributes:
    self_weights: float64 [n] read-only.
    terms: tuple of :class:`PermuteTerm`; ``W = diag(self_weights) + sum_s
      diag(w_s) P_s``.
    groups: tuple of tuples of ints (sorted, ordered by smallest member) if
      the round is a set of group means, else ``None``.
    partition: the same as a :class:`Partition`, or ``None``.
  """

  def __init__(self, matrix=None, self_weights=None, terms=None, groups=None):
    self._given = self._dense = self._csr = None  # explicit matrix, caches
    part = groups if isinstance(groups, Partition) or groups is None \
        else Partition.from_groups(groups)
    if matrix is not None:
      m = (sparse.csr_array(matrix, dtype=np.float64) if sparse.issparse(matrix)
           else _readonly(matrix, np.float64))
      if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"a round's matrix must be square, got {m.shape}.")
      self._given = m
      n = m.shape[0]
      if terms is None and part is None:
        csr = self.sparse_matrix()
        _, part, terms = plan_from_csr(n, csr.indptr, csr.indices, csr.data)
      if self_weights is None:
        self_weights = m.diagonal()
    elif part is not None:
      n = part.n_workers
      if self_weights is None:
        self_weights = 1.0 / part.sizes[part.labels()]
    elif self_weights is not None:
      n = len(self_weights)
    else:
      raise ValueError("a Round needs a matrix, groups, or self_weights.")
    self._n = n
    self._partition = part
    self._self = _readonly(self_weights, np.float64)
    if self._self.shape != (n,):
      raise ValueError(f"self_weights has shape {self._self.shape}, expected ({n},).")
    self._terms = None if terms is None else tuple(terms)
    if self._terms is None and part is None:
      self._terms = ()

  @classmethod
  def from_entries(cls, n: int, rows, cols, vals) -> "Round":
    """The round with ``W[rows[k], cols[k]] += vals[k]`` (in order) from zero.

    Equivalent to ``Round(matrix=w)`` for the dense ``w`` so accumulated,
    without forming it (O(nnz log nnz)).
    """
    rows, cols, vals = accumulate(n, rows, cols, vals)
    indptr = np.searchsorted(rows, np.arange(n + 1))
    self_w, part, terms = plan_from_csr(n, indptr, cols, vals)
    exact = part is None or np.array_equal(
        vals, 1.0 / part.sizes[part.labels()[rows]])
    matrix = None if exact else sparse.csr_array((vals, cols, indptr), (n, n))
    return cls(matrix=matrix, self_weights=self_w, terms=terms, groups=part)

  @property
  def n_workers(self) -> int:
    return self._n

  self_weights = property(lambda self: self._self)
  partition = property(lambda self: self._partition)

  @property
  def terms(self) -> tuple[PermuteTerm, ...]:
    if self._terms is None:
      self._terms = self._partition.terms()
    return self._terms

  @property
  def groups(self) -> tuple[tuple[int, ...], ...] | None:
    return None if self._partition is None else self._partition.as_tuples()

  @property
  def _pure_partition(self) -> bool:
    """True if the matrix is exactly the group means of the partition."""
    return self._partition is not None and self._given is None

  @property
  def _given_dense(self) -> bool:
    return isinstance(self._given, np.ndarray)

  @property
  def matrix(self) -> np.ndarray:
    """The dense ``np.ndarray`` [n, n] float64 (read-only); unless given,
    formed on first access and cached (``8 n^2`` bytes)."""
    if self._given_dense:
      return self._given
    if self._dense is None:
      w = self.sparse_matrix().toarray()
      w.setflags(write=False)
      self._dense = w
    return self._dense

  def sparse_matrix(self) -> sparse.csr_array:
    """``W`` as a ``scipy.sparse.csr_array`` [n, n] float64 (cached;
    ``sum |G|^2`` entries for a partition)."""
    if self._csr is None:
      if self._given is not None:
        self._csr = sparse.csr_array(self._given)
      else:
        if self._pure_partition:
          rows, cols, vals = self._partition.entries()
        else:
          t = self.terms
          rows = np.concatenate([np.arange(self._n)] + [x.destinations for x in t])
          cols = np.concatenate([np.arange(self._n)] + [x.sources for x in t])
          vals = np.concatenate([self._self] + [x.weights[x.destinations] for x in t])
        keep = vals != 0
        self._csr = sparse.csr_array((vals[keep], (rows[keep], cols[keep])),
                                     shape=(self._n, self._n))
      self._csr.sum_duplicates()
    return self._csr

  @property
  def is_identity(self) -> bool:
    """True if the round communicates nothing."""
    if self._terms is None:
      return int(self._partition.sizes.max()) <= 1
    return not self._terms

  @property
  def is_global_mean(self) -> bool:
    """True if the round is the exact average of all workers (``W = J``)."""
    return (self._partition is not None and self._partition.sizes.size == 1
            and self._n > 1)

  def node_partners(self, local_size: int) -> tuple[int, ...] | None:
    """Node-level plan for a 2-D ``(nodes, local)`` mesh, if one exists.

    Returns a tuple with one entry per node: ``-1`` if the round is the mean
    within that node, or the index of the partner node if it is the mean over
    the two nodes. ``None`` if the round is not of that form (then it is
    realised with flat ppermutes).
    """
    part = self._partition
    if part is None or local_size < 1 or self._n % local_size:
      return None
    node = part.order // local_size
    heads = part.starts[:-1]
    lo = np.minimum.reduceat(node, heads)
    hi = np.maximum.reduceat(node, heads)
    gid = np.repeat(np.arange(heads.size), part.sizes)
    if not np.all((node == lo[gid]) | (node == hi[gid])):
      return None  # a group spans more than two nodes
    if not np.array_equal(part.sizes, local_size * (1 + (hi > lo))):
      return None  # a group is not made of whole nodes
    partners = np.full(self._n // local_size, -1, np.int64)
    two = hi > lo
    partners[lo[two]], partners[hi[two]] = hi[two], lo[two]
    return tuple(partners.tolist())

  def apply(self, x: np.ndarray, transpose: bool = False) -> np.ndarray:
    """``W x`` (or ``W^T x``) for float64 ``x`` of shape [n] or [n, k]."""
    if self._pure_partition:
      return self._partition.mean(x)
    m = self.sparse_matrix()
    return (m.T if transpose else m) @ x

  def row_sums(self) -> np.ndarray:
    """float64 [n]; for group means computed as ``|G| * (1/|G|)``."""
    return self._sums(1)

  def column_sums(self) -> np.ndarray:
    """float64 [n], ``sum_i W[i, j]``."""
    return self._sums(0)

  def _sums(self, axis: int) -> np.ndarray:
    if self._given_dense:
      return self._given.sum(axis=axis)
    if self._pure_partition:
      m = self._partition.sizes[self._partition.labels()].astype(np.float64)
      return m * (1.0 / m)
    return np.asarray(self.sparse_matrix().sum(axis=axis)).ravel()

  def is_nonnegative_finite(self) -> bool:
    """True if every entry of ``W`` is finite and >= 0.

    O(nnz) over the stored entries; O(1) for group means (``1/|G|``), so
    no ``[n, n]`` array or ``sum |G|^2`` entries are formed.
    """
    if self._given_dense:
      w = self._given
    elif self._pure_partition:
      return True
    else:
      w = self.sparse_matrix().data
    return bool(np.all(np.isfinite(w)) and np.all(w >= 0))

  def messages_sent(self) -> np.ndarray:
    """int64 [n]: ppermute messages each worker sends in this round."""
    if self._terms is None:
      return self._partition.sizes[self._partition.labels()] - 1
    src = [t.sources for t in self._terms]
    return np.bincount(np.concatenate([np.zeros(0, np.int64)] + src),
                       minlength=self._n)

  def is_symmetric(self) -> bool:
    """True if ``W == W^T`` exactly."""
    if self._given_dense:
      return bool(np.array_equal(self._given, self._given.T))
    if self._pure_partition:
      return True
    m = self.sparse_matrix()
    return (m != m.T).nnz == 0

  def same_matrix(self, other: "Round") -> bool:
    """True if both rounds have exactly the same matrix."""
    if self is other:
      return True
    if self._n != other._n:
      return False
    if self._pure_partition and other._pure_partition:
      return self._partition == other._partition
    if self._given_dense and other._given_dense:
      return bool(np.array_equal(self._given, other._given))
    return (self.sparse_matrix() != other.sparse_matrix()).nnz == 0

  def __repr__(self):
    kind = (f"groups={self._partition.sizes.size}" if self._partition is not None
            else f"terms={len(self.terms)}")
    return f"Round(n_workers={self._n}, {kind})"


def plan_from_csr(n: int, indptr, indices, data):
  """``(self_weights, partition, terms)`` of the CSR matrix (sorted indices).

  A set of group means (:func:`find_partition`) gets ``terms=None`` (built
  from the partition when used; none if all groups are singletons), any
  other matrix :func:`offset_terms` over its off-diagonal entries.
  """
  indptr = np.asarray(indptr, np.int64)
  indices = np.asarray(indices, np.int64)
  data = np.asarray(data, np.float64)
  rows = np.repeat(np.arange(n), np.diff(indptr))
  diag = rows == indices
  self_w = np.zeros(n)
  self_w[rows[diag]] = data[diag]
  keep = data > 0
  part = find_partition(n, indptr, indices, data) if keep.all() else None
  if part is not None:
    return self_w, part, (() if int(part.sizes.max()) <= 1 else None)
  off = ~diag & keep
  return self_w, None, offset_terms(n, rows[off], indices[off], data[off])


# --------------------------------------------------------------------------
# Validation of dense input.
# --------------------------------------------------------------------------


def first_bad_sum(w, axis: int) -> tuple[int | None, float]:
  """The first row (axis 1) or column (axis 0) not summing to 1, and its sum.

  ``w`` is an array [n, n], a ``scipy.sparse`` matrix or a :class:`Round`
  (its :meth:`Round.column_sums` / :meth:`Round.row_sums`, O(nnz)).
  """
  if isinstance(w, Round):
    sums = w.column_sums() if axis == 0 else w.row_sums()
  elif sparse.issparse(w):
    sums = np.asarray(w.sum(axis=axis), np.float64).ravel()
  else:
    sums = np.asarray(w, np.float64).sum(axis=axis)
  bad = np.flatnonzero(np.abs(sums - 1.0) > TOL)
  return (int(bad[0]), float(sums[bad[0]])) if bad.size else (None, 1.0)


def check_column_sums(w, where: str) -> None:
  """Raises ``ValueError`` unless every column of ``w`` sums to 1.

  Column ``j`` holds what worker ``j`` keeps and sends; a column-stochastic
  matrix moves all of every worker's mass (push-sum, Assran et al. 2019).

  Args:
    w: float64 [n, n] mixing matrix (dense, ``scipy.sparse``, or a
      :class:`Round`, whose sums are taken without forming ``W``).
    where: what ``w`` is, for the message (e.g. ``"mixing matrix 2"``).
  """
  k, total = first_bad_sum(w, axis=0)
  if k is not None:
    raise ValueError(
        f"{where} is not column stochastic: column {k} sums to "
        f"{total:.6g}, expected 1 (column j holds what worker j keeps and "
        "sends; together it must be all of its mass).")


def validate_matrix(w, index: int, n: int | None,
                    column_stochastic: bool = False) -> np.ndarray:
  """Checks a dense mixing matrix; returns it as float64 [n, n].

  Raises:
    ValueError: not numeric, not square, a size other than ``n``,
      non-finite or negative entries, or a row / column sum other than 1
      (within :data:`TOL`; rows only checked unless ``column_stochastic``).
  """
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
    k, total = first_bad_sum(w, axis)
    if k is not None:
      raise ValueError(
          f"{where} is not doubly stochastic: {label} {k} sums to "
          f"{total:.6g}, expected 1 (every row and column of W must sum to "
          "1).")
  return w


# --------------------------------------------------------------------------
# Linear algebra of a period P = W_{p-1} ... W_1 W_0.
# --------------------------------------------------------------------------


def apply_period(rounds: Sequence[Round], x, transpose: bool = False):
  """``P x`` (or ``P^T x = W_0^T ... W_{p-1}^T x``), ``x`` float [n] or [n, k]."""
  x = np.asarray(x, np.float64)
  for r in (reversed(rounds) if transpose else rounds):
    x = r.apply(x, transpose)
  return x


def _check_method(method: str, allowed: Sequence[str]) -> None:
  if method not in allowed:
    raise ValueError(f"method must be one of {', '.join(map(repr, allowed))}, "
                     f"got {method!r}.")


def deviation_norm(rounds: Sequence[Round], method: str = "auto") -> float:
  """``||P - J||_2``, ``P`` the period product and ``J = 11^T / n``.

  Methods:
    ``"dense"``: ``P`` formed as [n, n] (by applying the rounds to the
      identity), then ``np.linalg.norm(P - J, 2)`` (LAPACK SVD, O(n^3)).
    ``"sparse"``: the largest eigenvalue of ``(P - J)^T (P - J)``, applied
      as a ``LinearOperator`` (no [n, n] array), by ARPACK Lanczos
      (``scipy.sparse.linalg.eigsh``, tolerance: machine precision, start
      vector from ``default_rng(0)``); the square root is returned, so the
      result is accurate to about 1e-15 relative once converged. If ARPACK
      breaks down because ``P - J`` is zero up to rounding (``||(P - J)
      v0|| < 1e-10 ||v0||``), that ratio is returned. Each
      iteration costs two passes over the period (O(p * nnz)); clustered
      top singular values (gaps ~1/n^2) need many iterations. ``n < 3``
      is always dense.
    ``"auto"``: dense for ``n <= DENSE_MAX`` (512), else sparse.

  Raises:
    ValueError: unknown method.
    RuntimeError: ARPACK did not converge or broke down otherwise.
  """
  _check_method(method, ("auto", "dense", "sparse"))
  n = rounds[0].n_workers
  if method == "auto":
    method = "dense" if n <= DENSE_MAX else "sparse"
  if method == "dense" or n < 3:
    dev = apply_period(rounds, np.eye(n)) - 1.0 / n
    return float(np.linalg.norm(dev, 2))

  def a(x):
    return apply_period(rounds, x) - x.mean(axis=0, keepdims=True)

  def a_t(y):
    return apply_period(rounds, y, True) - y.mean(axis=0, keepdims=True)

  v0 = np.random.default_rng(0).standard_normal(n)
  ratio = float(np.linalg.norm(a(v0)) / np.linalg.norm(v0))
  op = sparse_linalg.LinearOperator(
      (n, n), matvec=lambda x: a_t(a(x)), matmat=lambda x: a_t(a(x)),
      dtype=np.float64)
  try:
    lam = sparse_linalg.eigsh(op, k=1, which="LA", v0=v0, ncv=min(n, 64),
                              maxiter=100 * n, return_eigenvectors=False)
  except sparse_linalg.ArpackNoConvergence as e:
    raise RuntimeError(f"||P - J||_2 (ARPACK) did not converge for n={n}: "
                       f"{e}; use method='dense'.") from None
  except sparse_linalg.ArpackError as e:
    if ratio < 1e-10:  # P - J is rounding noise: no Krylov space to build
      return ratio
    raise RuntimeError(f"||P - J||_2 (ARPACK) failed for n={n}: {e}; use "
                       "method='dense'.") from None
  return float(np.sqrt(max(float(lam[0]), 0.0)))


def maps_to_mean(rounds: Sequence[Round], atol: float = 1e-12,
                 method: str = "auto") -> bool:
  """True if the period product ``P`` equals ``J = 11^T / n`` within ``atol``.

  Methods:
    ``"dense"``: ``P`` formed as [n, n]; ``max_ij |P_ij - 1/n| <= atol``
      (O(n^2) memory).
    ``"random"``: ``max_i |(P x)_i - mean(x)| <= atol`` for 4 standard normal
      vectors ``x`` (``default_rng(0)``), O(p * nnz). Exact averaging passes
      (rounding leaves ~1e-16 * |x|); ``(P x)_i - mean(x)`` is normal with
      standard deviation ``r_i``, the norm of row ``i`` of ``P - J``, so a
      wrong ``True`` has probability at most about ``(0.8 atol / max_i
      r_i)^4``.
    ``"auto"``: dense for ``n <= DENSE_MAX`` (512), else random.

  Raises:
    ValueError: unknown method.
  """
  _check_method(method, ("auto", "dense", "random"))
  n = rounds[0].n_workers
  if method == "auto":
    method = "dense" if n <= DENSE_MAX else "random"
  if method == "dense":
    return bool(np.allclose(apply_period(rounds, np.eye(n)), 1.0 / n,
                            rtol=0, atol=atol))
  x = np.random.default_rng(0).standard_normal((n, 4))
  y = apply_period(rounds, x)
  return bool(np.max(np.abs(y - x.mean(axis=0))) <= atol)
