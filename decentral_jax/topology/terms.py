"""The pieces of a round's plan, and a CSR matrix decomposed into them.

A mixing round ``W`` (float64 [n, n], rows = receivers) is realised with
collectives as ``W = diag(self_weights) + sum_s diag(w_s) P_s``, one
:class:`PermuteTerm` (a ``lax.ppermute``) per partial permutation ``P_s``,
or as a :class:`Partition` into group means (``pmean`` or ``max|G| - 1``
ppermutes). :func:`plan_from_csr` finds that plan for a CSR matrix: the
groups if it is a set of uniform group means (:func:`find_partition`),
else few ppermutes covering its off-diagonal entries
(:func:`offset_terms`). All of it is vectorised NumPy, O(nnz log nnz).

:class:`decentral_jax.topology.rounds.Round` holds these plans (and
re-exports every name here). This module imports only
:mod:`decentral_jax.checks` from the package.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from decentral_jax import checks

PARTITION_ATOL = 1e-15  # entries of a group mean: 1/|G| within this


def readonly(a, dtype) -> np.ndarray:
  """A read-only copy of ``a`` as an ``np.ndarray`` of ``dtype``."""
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
    pairs = np.asarray(perm)
    if pairs.size and (pairs.dtype == bool
                       or not np.issubdtype(pairs.dtype, np.integer)):
      raise ValueError(f"perm must be (source, destination) pairs of ints, "
                       f"got an array of {pairs.dtype}.")
    pairs = pairs.astype(np.int64).reshape(-1, 2)
    self._src = readonly(pairs[:, 0], np.int64)
    self._dst = readonly(pairs[:, 1], np.int64)
    self._weights = readonly(weights, np.float64)

  @classmethod
  def from_arrays(cls, sources, destinations, weights) -> "PermuteTerm":
    """The term with pairs ``(sources[k], destinations[k])``; no copy of [k, 2]."""
    term = cls.__new__(cls)
    term._src = readonly(sources, np.int64)
    term._dst = readonly(destinations, np.int64)
    term._weights = readonly(weights, np.float64)
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
    self.order = readonly(order, np.int64)
    self.starts = readonly(starts, np.int64)
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
      ValueError: a member that is not an int >= 0 (the message names
        ``groups[k][j]``), or groups that are not a partition of ``0..n-1``.
    """
    members = [checks.check_int(f"groups[{k}][{j}]", w, minimum=0)
               for k, g in enumerate(groups) for j, w in enumerate(g)]
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
