"""Mixing rounds stored as sparse permutation plans, and their validation.

A round ``W`` (float64 [n, n], row ``i`` = what worker ``i`` receives) is
kept as the plan that realises it with collectives
(:mod:`decentral_jax.comm.gossip` consumes it)::

  W = diag(self_weights) + sum_s diag(w_s) P_s

where ``P_s`` is the partial permutation of :class:`PermuteTerm` ``s``, or as
a :class:`Partition` of the workers into groups (``W_ij = 1/|G|`` for ``i, j``
in one group ``G``; realised with ``pmean`` or ``max|G| - 1`` ppermutes).
The dense matrix is formed only when asked for (:attr:`Round.matrix`).
Applying a round costs O(nnz) (O(n) for a partition) in vectorised NumPy /
``scipy.sparse``, which is what the schedule-level quantities use
(:func:`~decentral_jax.topology.spectral.deviation_norm`,
:func:`~decentral_jax.topology.spectral.maps_to_mean`).

Layout: the plan pieces and the decomposition of a CSR matrix into them are
in :mod:`decentral_jax.topology.terms`, the linear algebra of a period in
:mod:`decentral_jax.topology.spectral`. :mod:`decentral_jax.topology` builds
schedules from these rounds.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse

from decentral_jax import checks
from decentral_jax.topology.terms import Partition
from decentral_jax.topology.terms import PermuteTerm
from decentral_jax.topology.terms import accumulate
from decentral_jax.topology.terms import plan_from_csr
from decentral_jax.topology.terms import readonly

__all__ = ["Round", "TOL", "check_column_sums", "first_bad_sum",
           "validate_matrix"]

TOL = 1e-9  # row / column sums must be 1 within this


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
           else readonly(matrix, np.float64))
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
    self._self = readonly(self_weights, np.float64)
    if self._self.shape != (n,):
      raise ValueError(f"self_weights has shape {self._self.shape}, expected ({n},).")
    self._terms = None if terms is None else _checked_terms(terms, n)
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


# --------------------------------------------------------------------------
# Validation of mixing matrices and rounds.
# --------------------------------------------------------------------------


def _checked_terms(terms, n: int) -> tuple[PermuteTerm, ...]:
  """``terms`` as a tuple, each a :class:`PermuteTerm` on workers ``0..n-1``."""
  terms = tuple(terms)
  for s, t in enumerate(terms):
    if not isinstance(t, PermuteTerm):
      raise ValueError(f"terms[{s}] must be a PermuteTerm, got "
                       f"{type(t).__name__}.")
    ends = np.concatenate([t.sources, t.destinations])
    bad = ends[(ends < 0) | (ends >= n)]
    if bad.size:
      raise ValueError(f"terms[{s}] has worker index {int(bad[0])} outside "
                       f"0..{n - 1}; its (source, destination) pairs must "
                       "name workers of the round.")
    if t.weights.shape != (n,):
      raise ValueError(f"terms[{s}] has weights of shape {t.weights.shape},"
                       f" expected ({n},).")
  return terms


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


def sum_text(total: float) -> str:
  """``total`` for a message: its shortest exact repr, ``|total - 1|`` and
  :data:`TOL` (``.6g`` printed 1 + 1e-9 as 1)."""
  return (f"{float(total)!r} (|sum - 1| = {abs(total - 1.0):.9g} > "
          f"tolerance {TOL:g})")


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
        f"{sum_text(total)}, expected 1 (column j holds what worker j keeps and "
        "sends; together it must be all of its mass).")


def check_rounds_argument(rounds) -> list:
  """``from_permutations``' ``rounds`` as a list: a non-empty iterable of
  rounds, each a non-empty list of ``(perm, weight)`` terms.

  Raises:
    ValueError: naming ``from_permutations``, the argument and the fix.
  """
  rounds = checks.check_sequence(
      "from_permutations: rounds", rounds,
      "a list of rounds, each a list of (perm, weight) terms",
      allow_array=False)
  if not rounds:
    raise ValueError("from_permutations: rounds is empty; give at least one "
                     "permutation (rounds=[[(perm, 1.0)]] for one round).")
  for r, terms in enumerate(rounds):
    rounds[r] = checks.check_sequence(
        f"from_permutations: rounds[{r}]", terms,
        "a list of at least one (perm, weight) term", allow_array=False)
    if not rounds[r]:
      raise ValueError(f"from_permutations: rounds[{r}] is {terms!r}; give "
                       "a list of at least one (perm, weight) term.")
  return rounds


def check_matrices_argument(matrices, name) -> list:
  """``from_matrices``' arguments: a string ``name`` and an iterable of
  matrices, not one bare matrix (its rows would be read as 1-worker
  rounds), None or a 0-d array. Returns the matrices as a list.

  Raises:
    ValueError: naming the argument and what was given.
  """
  if not isinstance(name, str):
    raise ValueError(f"name must be a string, got {name!r}.")
  bare = (isinstance(matrices, np.ndarray) and matrices.ndim == 2) or (
      isinstance(matrices, (list, tuple)) and len(matrices) > 0
      and _ndim(matrices[0]) == 1)  # a matrix's rows, not matrices
  rule = ("a list of [n, n] mixing matrices (one per round; [W] for one "
          "round)")
  if bare:
    raise ValueError(f"matrices must be {rule}, got {type(matrices).__name__}"
                     f" of shape {np.shape(matrices)}.")
  return checks.check_sequence("matrices", matrices, rule)


def _ndim(x) -> int | None:
  """``np.ndim(x)``, or None for a ragged nested list (no array shape)."""
  try:
    return np.ndim(x)
  except ValueError:
    return None


def _row_lengths(w) -> list[int]:
  """The distinct lengths of the rows of a nested list ([] if not one)."""
  try:
    return sorted({len(row) for row in w})
  except TypeError:
    return []


def validate_matrix(w, index: int, n: int | None,
                    column_stochastic: bool = False) -> np.ndarray:
  """Checks a dense mixing matrix; returns it as float64 [n, n].

  Raises:
    ValueError: not numeric, ragged (rows of different lengths, naming
      ``matrices[index]``), not square, a size other than ``n``,
      non-finite or negative entries, or a row / column sum other than 1
      (within :data:`TOL`; rows only checked unless ``column_stochastic``).
  """
  where = f"mixing matrix {index}"
  lengths = _row_lengths(w) if isinstance(w, (list, tuple)) else []
  if len(lengths) > 1:
    raise ValueError(
        f"matrices[{index}] ({where}) is ragged: its rows have "
        f"{', '.join(map(str, lengths))} entries; a mixing matrix is a "
        "square [n, n] array.")
  try:
    is_complex = np.iscomplexobj(w)  # float64() would drop imaginary parts
    w = w if is_complex else np.array(w, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where} is not a numeric array: {e}") from None
  if is_complex:
    raise ValueError(f"{where} is complex; mixing weights are real.")
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
          f"{sum_text(total)}, expected 1 (every row and column of W must sum to "
          "1).")
  return w


# The most workers a topology is built for (check_n_workers).
MAX_WORKERS = 2**16


def check_n_workers(n_workers) -> int:
  """Returns ``int(n_workers)`` if it is an integer in ``[1, MAX_WORKERS]``.

  :data:`MAX_WORKERS` (65536) bounds what a schedule is built for: its
  rounds hold per-worker arrays and building them grows with ``n`` (65536:
  about a second for ``exponential``; 2**24 took minutes, 2**40 ran out of
  memory).

  Raises:
    ValueError: a float (2.5, 4.0), a bool, an array, a value < 1 or above
      :data:`MAX_WORKERS`.
  """
  n = checks.check_int("n_workers", n_workers, minimum=1)
  if n > MAX_WORKERS:
    raise ValueError(
        f"n_workers={n} is above MAX_WORKERS={MAX_WORKERS}, the most "
        "workers a topology is built for (building its rounds grows with "
        f"n); use n_workers <= {MAX_WORKERS}.")
  return n


def check_local_size(n: int, local_size: int) -> None:
  """Refuses a ``local_size`` (workers per node) that is not an int >= 1
  dividing ``n`` (ValueError, one line with the divisors)."""
  local_size = checks.check_int("local_size", local_size, minimum=1)
  if n % local_size:
    raise ValueError(
        f"n_workers={n} is not divisible by local_size={local_size} (workers "
        f"per node); use a local_size that divides {n}, e.g. "
        f"{[d for d in range(1, n + 1) if n % d == 0]}.")


def log2_exact(n: int) -> int | None:
  """``log2(n)`` if ``n`` is a power of two (integer arithmetic), else None."""
  if n >= 1 and n & (n - 1) == 0:
    return n.bit_length() - 1
  return None
