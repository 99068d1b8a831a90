"""Linear algebra of a period ``P = W_{p-1} ... W_1 W_0`` of mixing rounds.

The rounds are applied as sparse operators (``Round.apply``, O(nnz) per
round, O(n) for group means); a dense [n, n] array is formed only by the
``"dense"`` methods (the ``"auto"`` default up to :data:`DENSE_MAX`
workers). :func:`deviation_norm` gives ``||P - J||_2`` (``J = 11^T / n``),
which ``Topology.spectral_gap`` turns into ``1 - ||P - J||_2``;
:func:`maps_to_mean` tests finite-time consensus (``P = J``).

:mod:`decentral_jax.topology.rounds` re-exports these names. Rounds are
used only through ``n_workers`` and ``apply(x, transpose)``, so this module
imports only :mod:`decentral_jax.checks` from the package
(:class:`RoundLike`).

References:
  Lehoucq, Sorensen, Yang, ARPACK Users' Guide, SIAM 1998 (Lanczos,
  ``scipy.sparse.linalg.eigsh``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
from scipy.sparse import linalg as sparse_linalg

from decentral_jax import checks

DENSE_MAX = 512  # "auto" methods form [n, n] products up to this n


class RoundLike(Protocol):
  """What a round must offer here (:class:`decentral_jax.topology.rounds.Round`)."""
  n_workers: int

  def apply(self, x: np.ndarray, transpose: bool = False) -> np.ndarray:
    """``W x`` (or ``W^T x``) for float64 ``x`` [n] or [n, k]."""


def apply_period(rounds: Sequence[RoundLike], x, transpose: bool = False):
  """``P x`` (or ``P^T x = W_0^T ... W_{p-1}^T x``), ``x`` float [n] or [n, k]."""
  x = np.asarray(x, np.float64)
  for r in (reversed(rounds) if transpose else rounds):
    x = r.apply(x, transpose)
  return x


def _check_method(method: str, allowed: Sequence[str]) -> None:
  checks.check_choice("method", method, allowed)


def deviation_norm(rounds: Sequence[RoundLike], method: str = "auto") -> float:
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


def maps_to_mean(rounds: Sequence[RoundLike], atol: float = 1e-12,
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
