"""Topologies: periodic schedules of mixing matrices for gossip averaging.

A topology is a periodic list of *rounds*; round ``t % period`` is used at
step ``t``. Each round is one ``n x n`` mixing matrix ``W_t`` (row ``i`` holds
the weights worker ``i`` gives to what it receives; rows = receiving worker)
that is non-negative and doubly stochastic. A round is stored as the plan
that realises it on devices with ``jax.lax.ppermute`` / ``jax.lax.pmean``
(:mod:`decentral_jax.comm.gossip` consumes it): self weights [n] plus
:class:`PermuteTerm` s, or a :class:`Partition` into group means
(:mod:`decentral_jax.topology.rounds`). Built-in topologies are constructed
in that form with vectorised NumPy (O(n log n) work and O(n * period)
memory, no [n, n] array); the dense matrix is formed only when asked
(``mixing_matrix``, ``Round.matrix``), and ``spectral_gap`` /
``has_finite_time_consensus`` apply the rounds as sparse operators.

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

With ``n_workers = 1`` every built-in constructor, as :func:`make`, gives
the identity (one round ``W = [[1]]``, no communication).

Custom schedules: :func:`from_matrices` and :func:`from_permutations`.
``from_matrices(..., column_stochastic=True)`` accepts matrices whose columns
alone sum to 1 (directed graphs, for push-sum in
:mod:`decentral_jax.optim.push_sum`); such a topology has ``doubly_stochastic ==
False`` and plain gossip (:func:`decentral_jax.comm.gossip.mix`) refuses it.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Sec. 3 and the ``decent-dp`` library, ``topo.py``).
  Ying et al., `Exponential Graph is Provably Efficient for Decentralized
  Deep Training <https://arxiv.org/abs/2110.13363>`_, NeurIPS 2021.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np

from decentral_jax import checks
from decentral_jax.topology.rounds import MAX_WORKERS
from decentral_jax.topology.rounds import TOL
from decentral_jax.topology.rounds import check_local_size
from decentral_jax.topology.rounds import check_n_workers
from decentral_jax.topology.rounds import log2_exact
from decentral_jax.topology.rounds import check_matrices_argument
from decentral_jax.topology.rounds import check_rounds_argument
from decentral_jax.topology.rounds import Round
from decentral_jax.topology.rounds import validate_matrix
from decentral_jax.topology.spectral import apply_period
from decentral_jax.topology.spectral import deviation_norm
from decentral_jax.topology.spectral import maps_to_mean
from decentral_jax.topology.terms import Partition

__all__ = ["NAMES", "Topology", "alternating_exp_ring", "canonical_name",
           "complete", "exponential", "from_matrices", "from_permutations",
           "make", "one_peer_exp", "ring", "static_ring", "torus"]



class Topology:
  """A periodic schedule of mixing rounds over ``n_workers`` workers.

  Round ``step % period`` is applied at step ``step``. Instances are
  immutable and hashable by identity, so they can be closed over by jitted
  functions without retracing.

  Attributes:
    name: topology name (``"custom"`` for :func:`from_matrices`).
    n_workers: number of workers ``n``.
    local_size: workers per node ``L`` (used by node-aware topologies and by
      the 2-D ``(nodes, local)`` realisation in :mod:`decentral_jax.comm.gossip`).
    rounds: tuple of :class:`Round`, length ``period``.
    doubly_stochastic: True if every round's rows sum to 1 too (all but
      ``from_matrices(..., column_stochastic=True)`` topologies).
    distinct_rounds: the rounds with distinct matrices, in order of first
      use; ``round_to_distinct[t]`` is the index of round ``t`` among them
      (the gossip module compiles one branch per distinct round).
  """

  def __init__(self, name: str, rounds: Sequence[Round], local_size: int = 1):
    if not rounds:
      raise ValueError("a topology needs at least one round.")
    self.name = name
    self.rounds = tuple(rounds)
    for k, r in enumerate(self.rounds):
      if not isinstance(r, Round):
        raise ValueError(f"rounds[{k}] must be a topology.Round, got "
                         f"{type(r).__name__}; build schedules from matrices "
                         "with topology.from_matrices.")
    self.n_workers = self.rounds[0].n_workers
    if any(r.n_workers != self.n_workers for r in self.rounds):
      raise ValueError(f"rounds have {sorted({r.n_workers for r in self.rounds})}"
                       " workers; all rounds need the same number.")
    self.local_size = checks.check_int("local_size", local_size, minimum=1)
    self.doubly_stochastic = all(
        np.all(np.abs(r.row_sums() - 1.0) <= TOL) and
        np.all(np.abs(r.column_sums() - 1.0) <= TOL) for r in self.rounds)
    distinct: list[Round] = []
    index = []
    for r in self.rounds:
      for k, d in enumerate(distinct):
        if r.same_matrix(d):
          index.append(k)
          break
      else:
        index.append(len(distinct))
        distinct.append(r)
    self.distinct_rounds = tuple(distinct)
    self.round_to_distinct = tuple(index)
    self._gap_formula: Callable[[], float] | None = None

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
    """The :class:`Round` used at integer ``step`` (``step % period``).

    Raises:
      ValueError: ``step`` not an integer (a float, bool or array).
    """
    return self.rounds[checks.check_int("step", step) % self.period]

  def mixing_matrix(self, step: int) -> np.ndarray:
    """``W_step`` as a float64 ``np.ndarray`` of shape [n, n] (a copy)."""
    return np.array(self.round(step).matrix)

  def period_product(self) -> np.ndarray:
    """``W_{p-1} ... W_1 W_0`` (float64 [n, n]), the map of one full period.

    Formed by applying the sparse rounds to the identity (O(n^2) memory).
    """
    return apply_period(self.rounds, np.eye(self.n_workers))

  def spectral_gap(self, method: str = "auto") -> float:
    """``1 - ||P - J||_2`` where ``P`` is the period product, ``J = 11^T/n``.

    For a static symmetric ``W`` this is the usual ``1 - max(|lambda_2|,
    |lambda_n|)``. 1.0 means exact averaging after one period; 0.0 means no
    contraction of the disagreement (e.g. a disconnected schedule). Results
    below 0 are clipped to 0; ``n = 1`` gives 1.0.

    Args:
      method: ``"auto"`` (default): the closed form of a built-in topology
        from :func:`make` (listed there), else ``"dense"`` for ``n <= 512``,
        else ``"sparse"``. ``"closed_form"``: only that. ``"dense"``: LAPACK
        SVD of the [n, n] product (O(n^3)). ``"sparse"``: ARPACK Lanczos on
        ``(P - J)^T (P - J)`` applied as an operator, no [n, n] array
        (:func:`decentral_jax.topology.spectral.deviation_norm`).

    Raises:
      ValueError: unknown method, or ``"closed_form"`` for a topology that
        has none (custom schedules).
      RuntimeError: ARPACK did not converge.
    """
    checks.check_choice("method", method,
                        ("auto", "closed_form", "dense", "sparse"))
    if self.n_workers == 1:
      return 1.0
    if method in ("auto", "closed_form") and self._gap_formula is not None:
      return float(min(1.0, max(0.0, self._gap_formula())))
    if method == "closed_form":
      raise ValueError(f"topology {self.name!r} has no closed-form spectral "
                       "gap; use method='auto', 'dense' or 'sparse'.")
    norm = deviation_norm(self.rounds, "auto" if method == "auto" else method)
    return float(max(0.0, 1.0 - norm))

  def has_finite_time_consensus(self, atol: float = 1e-12,
                                method: str = "auto") -> bool:
    """True if one period maps any input exactly to its average (``P = J``).

    Args:
      atol: absolute tolerance.
      method: ``"dense"``: ``max_ij |P_ij - 1/n| <= atol`` on the [n, n]
        product. ``"random"``: ``max_i |(P x)_i - mean(x)| <= atol`` for 4
        fixed standard normal vectors ``x`` (no [n, n] array; see
        :func:`decentral_jax.topology.spectral.maps_to_mean` for when it can
        differ). ``"auto"`` (default): dense for ``n <= 512``, else random.

    Raises:
      ValueError: unknown method.
    """
    atol = checks.check_float("atol", atol, minimum=0.0)
    return maps_to_mean(self.rounds, atol, method)

  def is_symmetric(self) -> bool:
    """True if every round's matrix is symmetric."""
    return all(r.is_symmetric() for r in self.rounds)

  def max_messages_per_step(self) -> int:
    """Largest number of ppermute messages any worker sends in one round."""
    return max(int(r.messages_sent().max(initial=0)) for r in self.rounds)


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
  when ``W = J``). The matrices are kept (dense) as given.

  Args:
    matrices: sequence of ``p`` arrays [n, n]; round ``t % p`` is used at step
      ``t``. Rows are receiving workers: ``x_new[i] = sum_j W[i, j] x[j]``.
    name: name reported by the topology.
    local_size: workers per node, for node-aware realisation on 2-D meshes.
    column_stochastic: only require every column to sum to 1 (a directed
      graph for push-sum, :mod:`decentral_jax.optim.push_sum`); doubly stochastic
      matrices pass too.

  Returns:
    A :class:`Topology` with ``period == len(matrices)``.

  Raises:
    ValueError: empty list, wrong shape, negative or non-finite entries, or a
      row/column not summing to 1 (the message names it and its sum).
  """
  checks.check_bool("column_stochastic", column_stochastic)
  matrices = check_matrices_argument(matrices, name)
  if not matrices:
    raise ValueError("from_matrices needs at least one [n, n] matrix.")
  n = None
  rounds = []
  for k, w in enumerate(matrices):
    w = validate_matrix(w, k, n, column_stochastic)
    n = w.shape[0]
    rounds.append(Round(matrix=w))
  check_local_size(n, local_size)
  return Topology(name, rounds, local_size)


def from_permutations(rounds: Sequence[Sequence[tuple[Sequence[int], float]]],
                      *, name: str = "custom") -> Topology:
  """Builds a topology whose round ``r`` is ``W_r = sum_s w_s P_s``.

  Args:
    rounds: for each round, a list of ``(perm, weight)`` where ``perm`` is a
      length-``n`` sequence of ints with ``perm[i]`` = the worker that ``i``
      receives from (the identity permutation is the self term) and
      ``weight`` a finite float.

  Returns:
    A :class:`Topology` (through :func:`from_matrices`).

  Raises:
    ValueError: ``rounds`` empty or not a list, a round without terms, an
      entry of a ``perm`` that is not an int in ``[0, n)`` (a
      float such as 1.5 or a bool; the message names ``rounds[r][s]``), a
      ``perm`` that is not a bijection of ``0..n-1`` (the message names the
      repeated or missing worker), a weight that is not a finite number, or
      a resulting matrix that is not doubly stochastic.
  """
  mats = []
  for r, terms in enumerate(check_rounds_argument(rounds)):
    n = len(_permutation_term(terms[0], f"rounds[{r}][0]")[0])
    w = np.zeros((n, n))
    for s, term in enumerate(terms):
      perm, weight = _permutation_term(term, f"rounds[{r}][{s}]")
      if len(perm) != n:
        raise ValueError(f"round {r}, term {s}: permutation has length "
                         f"{len(perm)}, expected {n}.")
      perm = [checks.check_int(f"rounds[{r}][{s}] perm[{i}]", p, minimum=0,
                               maximum=n - 1) for i, p in enumerate(perm)]
      if sorted(perm) != list(range(n)):
        missing = sorted(set(range(n)) - set(perm))
        repeated = sorted({p for p in perm if perm.count(p) > 1})
        raise ValueError(
            f"round {r}, term {s}: {perm} is not a bijection of 0..{n - 1} "
            f"(repeated: {repeated}, missing or out of range: {missing}); "
            "perm[i] must be the single worker that i receives from.")
      w[np.arange(n), perm] += weight
    mats.append(w)
  return from_matrices(mats, name=name)


def _permutation_term(term, where: str) -> tuple[list, float]:
  """``(list(perm), float(weight))`` of one ``(perm, weight)`` term."""
  try:
    perm, weight = term
    perm = list(perm)
  except (TypeError, ValueError):
    raise ValueError(f"{where} must be a (perm, weight) pair with perm a "
                     f"sequence of worker indices, got {term!r}.") from None
  return perm, checks.check_float(f"{where} weight", weight)


def _built(name: str, rounds: Sequence[Round], local_size: int,
           gap: Callable[[], float]) -> Topology:
  check_local_size(rounds[0].n_workers, local_size)
  topo = Topology(name, rounds, local_size)
  topo._gap_formula = gap
  return topo


def _one_worker_identity(build: Callable[..., Topology]
                         ) -> Callable[..., Topology]:
  """A built-in constructor's one rule for ``n_workers = 1``: the identity
  (one round, ``W = [[1]]``, no communication), as :func:`make` gives,
  after ``n_workers``, ``local_size`` and any other argument are checked.

  Raises:
    ValueError: as the constructor (``n_workers`` not an integer in ``[1,
      MAX_WORKERS]``, ``local_size`` not dividing it, a bad ``shape``).
  """
  @functools.wraps(build)
  def constructor(n_workers: int, local_size: int = 1, **kwargs) -> Topology:
    n = check_n_workers(n_workers)
    if n > 1:
      return build(n, local_size, **kwargs)
    check_local_size(1, local_size)
    if kwargs:
      build(1, local_size, **kwargs)  # its own checks of the other arguments
    return from_matrices([np.eye(1)], name=build.__name__, local_size=1)
  return constructor


def _group_rounds(labels: Sequence[np.ndarray]) -> list[Round]:
  """One group-mean round per label array (workers with equal labels)."""
  return [Round(groups=Partition.from_labels(l)) for l in labels]


def _exact_average() -> float:
  return 1.0


@_one_worker_identity
def complete(n_workers: int, local_size: int = 1) -> Topology:
  """Complete graph: one round, ``W = 11^T / n`` (realised by ``pmean``)."""
  n_workers = check_n_workers(n_workers)
  return _built("complete", _group_rounds([np.zeros(n_workers, np.int64)]),
                local_size, _exact_average)


@_one_worker_identity
def ring(n_workers: int, local_size: int = 1) -> Topology:
  """Alternating ring (period 2): pairs {2j, 2j+1}, then {2j, 2j-1 mod n}."""
  n = check_n_workers(n_workers)
  if n % 2:
    raise ValueError(f"topology 'ring' needs an even number of workers, got "
                     f"n_workers={n}; use an even n or 'static_ring'.")
  i = np.arange(n)
  m = n // 2
  gap = lambda: 1.0 if m == 1 else 1.0 - math.cos(math.pi / m)
  return _built("ring", _group_rounds([i // 2, (i + 1) // 2 % m]), local_size, gap)


@_one_worker_identity
def one_peer_exp(n_workers: int, local_size: int = 1) -> Topology:
  """One-peer exponential graph: round r pairs {j, j XOR 2^r}, r < log2 n."""
  n = check_n_workers(n_workers)
  big_r = log2_exact(n)
  if big_r is None:
    lo = 1 << (n.bit_length() - 1)
    raise ValueError(
        f"topology 'one_peer_exp' needs n_workers to be a power of two, got "
        f"{n}; the nearest valid values are {lo} and {lo * 2} (or use "
        "'exponential', which accepts any n).")
  i = np.arange(n)
  return _built("one_peer_exp", _group_rounds([i & ~(1 << r) for r in range(big_r)]),
                local_size, _exact_average)


@_one_worker_identity
def alternating_exp_ring(n_workers: int, local_size: int = 1) -> Topology:
  """Alternating exponential ring (AER), node-aware, as ``decent-dp`` builds it.

  ``n_workers = local_size * N`` with ``N = 2^R`` nodes; node ``v`` holds
  workers ``v*L .. v*L+L-1``. For ``i < R``, node pairs ``{v, v XOR 2^i}`` are
  enumerated in increasing ``v`` with one counter ``c`` running across all
  pairs: if ``c`` is even, round ``2i`` takes the two intra-node means and
  round ``2i+1`` the mean over both nodes; if odd, the reverse. Period ``2R``
  (one round, the intra-node mean, when ``N = 1``).
  """
  n, big_l = check_n_workers(n_workers), local_size
  check_local_size(n, big_l)
  n_nodes = n // big_l
  big_r = log2_exact(n_nodes)
  if big_r is None:
    raise ValueError(
        f"topology 'alternating_exp_ring' needs n_workers / local_size to be a "
        f"power of two (number of nodes), got {n} / {big_l} = {n_nodes}.")
  node_of = np.arange(n) // big_l
  if big_r == 0:
    return _built("alternating_exp_ring", _group_rounds([node_of * 0]), big_l,
                  _exact_average)
  nodes = np.arange(n_nodes)
  labels = []
  for i in range(big_r):
    v = nodes[(nodes >> i) & 1 == 0]  # pairs {v, v + 2^i}, increasing v
    odd = (i * (n_nodes // 2) + np.arange(v.size)) % 2 == 1  # counter c odd
    for joint in (odd, ~odd):  # round 2i joins the odd pairs, 2i+1 the even
      lead = nodes.copy()
      lead[v[joint] + (1 << i)] = v[joint]
      labels.append(lead[node_of])
  return _built("alternating_exp_ring", _group_rounds(labels), big_l,
                _exact_average)


@_one_worker_identity
def exponential(n_workers: int, local_size: int = 1) -> Topology:
  """Static exponential graph: ``i`` sends to ``i + 2^k mod n``, weights 1/(tau+1)."""
  n = check_n_workers(n_workers)
  tau = (n - 1).bit_length()  # ceil(log2 n) for n >= 1, integer arithmetic.
  i = np.arange(n)
  rows = np.concatenate([i] + [(i + (1 << k)) % n for k in range(tau)])
  rnd = Round.from_entries(n, rows, np.tile(i, tau + 1),
                           np.full(rows.size, 1.0 / (tau + 1)))

  def gap():  # circulant, hence normal: ||W - J|| = max_{j != 0} |lambda_j|
    j = np.arange(1, n)[:, None]
    lam = 1 + np.exp(2j * np.pi * j * (1 << np.arange(tau)) / n).sum(axis=1)
    return 1.0 - float(np.abs(lam).max(initial=0.0)) / (tau + 1)

  return _built("exponential", [rnd], local_size, gap)


def _infer_torus_shape(n: int) -> tuple[int, int]:
  rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  return rows, n // rows


@_one_worker_identity
def torus(n_workers: int, local_size: int = 1,
          shape: tuple[int, int] | None = None) -> Topology:
  """2-D torus: self and the 4 grid neighbours (wrap-around), 1/5 each.

  ``shape`` = (rows, cols) with ``rows * cols == n_workers``; inferred as the
  most square factorisation if omitted. Neighbours that coincide (a side of
  length 2, or 1) add their weights, so ``W`` stays doubly stochastic.

  Raises:
    ValueError: ``shape`` not two ints >= 1 whose product is ``n_workers``.
  """
  n = check_n_workers(n_workers)
  if shape is None:
    shape = _infer_torus_shape(n)
  try:
    rows, cols = shape
  except (TypeError, ValueError):
    raise ValueError(f"torus shape must be a pair (rows, cols), got "
                     f"{shape!r}.") from None
  rows = checks.check_int("shape[0]", rows, minimum=1)
  cols = checks.check_int("shape[1]", cols, minimum=1)
  if rows * cols != n:
    raise ValueError(f"torus shape {tuple(shape)} does not multiply to "
                     f"n_workers={n}; give (rows, cols) with rows*cols == {n}.")
  r, c = np.divmod(np.arange(n), cols)
  moves = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))
  src = [((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in moves]
  rnd = Round.from_entries(n, np.tile(np.arange(n), 5), np.concatenate(src),
                           np.full(5 * n, 0.2))

  def gap():  # W = (I + A_rows (+) A_cols) / 5 with ring adjacencies A
    ca = 2 * np.cos(2 * np.pi * np.arange(rows) / rows)[:, None]
    cb = 2 * np.cos(2 * np.pi * np.arange(cols) / cols)[None, :]
    lam = np.abs(1 + ca + cb).ravel()[1:] / 5
    return 1.0 - float(lam.max(initial=0.0))

  return _built("torus", [rnd], local_size, gap)


@_one_worker_identity
def static_ring(n_workers: int, local_size: int = 1) -> Topology:
  """Static ring: each worker averages itself and both neighbours, 1/3 each."""
  n = check_n_workers(n_workers)
  i = np.arange(n)
  rnd = Round.from_entries(n, np.tile(i, 3),
                           np.concatenate([(i + d) % n for d in (-1, 0, 1)]),
                           np.full(3 * n, 1.0 / 3.0))

  def gap():  # symmetric circulant: lambda_k = (1 + 2 cos(2 pi k / n)) / 3
    lam = np.abs(1 + 2 * np.cos(2 * np.pi * np.arange(1, n) / n)) / 3
    return 1.0 - float(lam.max(initial=0.0))

  return _built("static_ring", [rnd], local_size, gap)


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

  Rounds are built as sparse plans (O(n log n) time, O(n * period) memory,
  no [n, n] array). ``spectral_gap()`` then uses closed forms (``J =
  11^T/n``, ``m = n/2``, ``tau = ceil(log2 n)``):

  * ``complete``, ``one_peer_exp``, ``alternating_exp_ring``: 1 (``P = J``).
  * ``ring``: ``1 - cos(pi/m)`` (1 for ``n = 2``): ``P^T P = W_0 W_1 W_0``
    acts on pair means as the circulant ``(1/4, 1/2, 1/4)`` with
    eigenvalues ``cos^2(pi k/m)``.
  * ``static_ring``: ``1 - max_{k != 0} |1 + 2 cos(2 pi k/n)| / 3``.
  * ``torus`` (``R x C``): ``1 - max_{(a,b) != 0} |1 + 2 cos(2 pi a/R) +
    2 cos(2 pi b/C)| / 5``.
  * ``exponential``: ``1 - max_{j != 0} |1 + sum_{k<tau} exp(2 pi i j 2^k
    / n)| / (tau + 1)`` (circulant, hence normal).

  Args:
    name: one of :data:`NAMES` (hyphens allowed, ``'aer'`` is an alias).
    n_workers: number of workers ``n >= 1``. ``n = 1`` always gives the
      identity with no communication.
    local_size: workers per node ``L`` (must divide ``n``); node-aware
      topologies (``alternating_exp_ring``) group workers by node.
    **kwargs: extra constructor arguments (``shape`` for ``torus``).

  Returns:
    A :class:`Topology` whose rounds are doubly stochastic.

  Raises:
    ValueError: unknown name (lists the valid ones), ``n_workers`` not an
      integer >= 1, an argument in ``kwargs`` the topology does not take,
      ``local_size`` not dividing ``n``, or a constraint of the topology
      (even n for ``ring``, power of two for ``one_peer_exp``, power-of-two
      node count for ``alternating_exp_ring``).
  """
  key = canonical_name(name)
  n_workers = check_n_workers(n_workers)
  check_local_size(n_workers, local_size)
  extra = sorted(set(kwargs) - ({"shape"} if key == "torus" else set()))
  if extra:
    raise ValueError(f"topology {key!r} takes no argument {', '.join(extra)}"
                     " (only 'torus' takes shape=(rows, cols)).")
  return _REGISTRY[key](n_workers, local_size=int(local_size), **kwargs)
