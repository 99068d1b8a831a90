"""AccumAdam: Adam whose moments are refreshed once per accumulation window.

:func:`scale_by_accum_adam` is the local direction of AccumAdam(W)
(:func:`decentral_jax.optim.decentralized_adamw` with ``accum_steps > 1``);
with ``accum_steps=1`` it equals ``optax.scale_by_adam``. Worker-local: it
communicates nothing and works under ``jax.shard_map`` or outside it.
:mod:`decentral_jax.optim` re-exports both names.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (Alg. 4, App. C; ``decent-dp`` 0.2.3 ``AccumAdamW``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from decentral_jax import checks
from decentral_jax.optim import arguments
from decentral_jax.optim.arguments import check_hyperparameter
from decentral_jax.optim.arguments import check_period
from decentral_jax.optim.precision import as_dtype
from decentral_jax.optim.precision import compute_dtype
from decentral_jax.optim.precision import moment_dtype

__all__ = ["BETA_CONVENTIONS", "ScaleByAccumAdamState", "horizon_matched_betas",
           "scale_by_accum_adam"]

# How b1 and b2 of AccumAdam are read: "per_window" (the paper's and
# decent-dp's: each completed window decays the moments by b), "per_step"
# (the moments decay by b**T per window of T steps, Adam's horizon in steps).
BETA_CONVENTIONS = ("per_window", "per_step")


def horizon_matched_betas(b1: float, b2: float, accum_steps: int
                          ) -> tuple[float, float]:
  """``(b1**T, b2**T)``: per-window decays with Adam's horizon in steps.

  AccumAdam refreshes its moments once per window of ``T = accum_steps``
  steps, so per-window decays ``b`` average over about ``T / (1 - b)``
  steps, ``T`` times Adam's ``1 / (1 - b)``. Decaying by ``b**T`` per window
  keeps Adam's horizon, e.g. ``T = 4``: ``(0.9, 0.95) -> (0.6561,
  0.81450625)``. ``beta_convention="per_step"`` of
  :func:`scale_by_accum_adam` applies this.

  Raises:
    ValueError: ``accum_steps`` not an integer >= 1, ``b1`` or ``b2`` not
      a number in [0, 1).
  """
  t = checks.check_int("accum_steps", accum_steps, minimum=1,
                       maximum=checks.INT32_MAX)
  b1 = checks.check_float("b1", b1, minimum=0.0, maximum=1.0, open_max=True)
  b2 = checks.check_float("b2", b2, minimum=0.0, maximum=1.0, open_max=True)
  return b1 ** t, b2 ** t


class ScaleByAccumAdamState(NamedTuple):
  """State of :func:`scale_by_accum_adam` (all worker-local)."""
  count: jax.Array  # shape=(), dtype=int32: steps taken t.
  mu: optax.Updates  # first moment M of completed windows, like params.
  nu: optax.Updates  # second moment V of completed windows, like params.
  acc: optax.Updates  # running window mean A = sum g / T, like params.


def scale_by_accum_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        accum_steps: int = 1, *,
                        mu_dtype=None, nu_dtype=None,
                        beta_convention: str = "per_window"
                        ) -> optax.GradientTransformation:
  r"""Rescales updates by the AccumAdam direction (paper Alg. 4, App. C).

  With ``t`` the 1-based step, ``T = accum_steps``, ``c = ceil(t / T)``:

  .. math::
    A &\leftarrow A + g / T \\
    \hat m &= (\beta_1 M + (1-\beta_1) g) / (1 - \beta_1^c) \\
    \hat v &= (\beta_2 V + (1-\beta_2) g^2) / (1 - \beta_2^c) \\
    d &= \hat m / (\sqrt{\hat v} + \epsilon) \\
    \text{if } t \bmod T = 0:&\ M \leftarrow \beta_1 M + (1-\beta_1) A,\;
      V \leftarrow \beta_2 V + (1-\beta_2) A^2,\; A \leftarrow 0

  The parameters move every step (the returned update is ``d``); only the
  stored moments are refreshed once per window, from the window's mean
  gradient. This is not ``optax.MultiSteps``, which freezes parameters for
  ``T - 1`` steps. With ``accum_steps=1`` it equals ``optax.scale_by_adam``.

  With ``beta_convention="per_step"``, :math:`\beta_1, \beta_2` above are
  ``b1**T, b2**T`` (:func:`horizon_matched_betas`): ``b1``/``b2`` then mean
  what they mean for Adam, a decay per step, and the moments keep Adam's
  horizon in steps instead of ``T`` times it. The default ``"per_window"``
  is the paper's and ``decent-dp``'s convention.

  Precision: per leaf, all of the above is computed in float32, or in the
  widest of the gradient/moment dtypes when that is wider (float64 stays
  float64), including the bias corrections (in bfloat16 ``0.999`` rounds to
  1 and ``1 - b2**c`` to 0). ``M``, ``V`` and ``A`` are then stored in their
  own dtypes and ``d`` is returned in the gradient dtype.

  Args:
    b1: first-moment decay, in [0, 1).
    b2: second-moment decay, in [0, 1).
    eps: added to the denominator outside the square root; finite, >= 0.
    accum_steps: window length ``T``, an int in ``[1, 2**31 - 1]``
      (``accum_iter`` in ``decent-dp``; the whole range holds, the window
      index is computed without wrapping the int32 step counter); may be a
      traced integer (``optax.inject_hyperparams``).
    mu_dtype: optional floating dtype of ``M`` and ``A`` (default: the param
      dtype).
    nu_dtype: optional floating dtype of ``V`` (default: the param dtype).
      With float16 parameters pass ``jnp.float32``: ``(1 - b2) g^2`` of
      small gradients underflows float16's range (about 6e-8), and the
      direction drifts from float32's without any non-finite value.
    beta_convention: ``"per_window"`` (default) or ``"per_step"``, see
      above; with ``accum_steps=1`` both are Adam.

  Returns:
    An ``optax.GradientTransformation`` with state
    :class:`ScaleByAccumAdamState` (leaves shaped like params, dtypes fixed
    at ``init``). Applied leaf-wise over any pytree; updates have the grads'
    shapes and dtypes.

  Raises:
    ValueError: ``accum_steps`` not a positive integer; ``b1``/``b2`` not in
      [0, 1) or ``eps`` negative, NaN or infinite (checked when the values
      are known); ``b1``/``b2``/``eps`` given as arrays of fewer than 32
      bits; ``mu_dtype``/``nu_dtype`` not floating; ``beta_convention``
      not one of :data:`BETA_CONVENTIONS`.

  References:
    Wang et al. 2025 (arXiv 2410.11998), App. C; ``decent-dp`` 0.2.3
    ``AccumAdamW`` (beta2 in the second moment, eps outside the sqrt).
  """
  # A traced accum_steps (e.g. under optax.inject_hyperparams) is allowed.
  accum_steps = check_period("accum_steps", accum_steps)
  static_t = not isinstance(accum_steps, jax.Array)
  checks.check_choice("beta_convention", beta_convention, BETA_CONVENTIONS)
  check_hyperparameter("b1", b1, below_one=True)
  check_hyperparameter("b2", b2, below_one=True)
  check_hyperparameter("eps", eps, below_one=False)
  mu_dtype = moment_dtype("mu_dtype", mu_dtype)
  nu_dtype = moment_dtype("nu_dtype", nu_dtype)
  plain_adam = static_t and accum_steps == 1
  # b**T per window; T = 1 is Adam.
  per_step = beta_convention == "per_step" and not plain_adam

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = optax.tree.zeros_like(params, dtype=nu_dtype)
    acc = optax.tree.zeros_like(params, dtype=mu_dtype)
    return ScaleByAccumAdamState(jnp.zeros([], jnp.int32), mu, nu, acc)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    big_t = (accum_steps if static_t
             else jnp.asarray(accum_steps).astype(jnp.int32))
    # c = ceil(t / T) as (t - 1) // T + 1: no intermediate exceeds t, so
    # T up to INT32_MAX does not wrap the int32 counter (t + T - 1 would).
    window = (count - 1) // big_t + 1
    commit = count % big_t == 0

    def leaf(g, m, v, a):
      return _leaf_update(g, m, v, a, (b1, b2, eps), big_t, window, commit,
                          per_step=per_step, plain_adam=plain_adam)

    out = jax.tree.map(leaf, updates, state.mu, state.nu, state.acc)
    treedef = jax.tree.structure(updates)
    flat = treedef.flatten_up_to(out)
    d, m, v, a = (treedef.unflatten([f[i] for f in flat]) for i in range(4))
    return d, ScaleByAccumAdamState(count, m, v, a)

  return arguments.per_worker_state(init_fn, update_fn)


def _leaf_update(g, m, v, a, hyper, big_t, window, commit, *, per_step,
                 plain_adam):
  """One leaf of :func:`scale_by_accum_adam`: ``(d, M, V, A)`` after step t.

  ``hyper`` is ``(b1, b2, eps)``, ``window`` is ``c = ceil(t / T)`` and
  ``commit`` is ``t % T == 0`` (both int32/bool scalars).
  """
  # One compute dtype per leaf; in float32/float64 the operations below
  # are exactly the plain-dtype ones (the casts are no-ops).
  dt = compute_dtype(g.dtype, m.dtype, v.dtype)
  beta1, beta2, epsilon = (as_dtype(h, dt) for h in hyper)
  if per_step:
    beta1 = beta1 ** jnp.asarray(big_t, dt)
    beta2 = beta2 ** jnp.asarray(big_t, dt)
  gc, mc, vc = g.astype(dt), m.astype(dt), v.astype(dt)
  bc1 = 1 - jnp.asarray(beta1, dt) ** window.astype(dt)
  bc2 = 1 - jnp.asarray(beta2, dt) ** window.astype(dt)
  m_num = beta1 * mc + (1 - beta1) * gc
  v_num = beta2 * vc + (1 - beta2) * jnp.square(gc)
  direction = ((m_num / bc1) / (jnp.sqrt(v_num / bc2) + epsilon)
               ).astype(g.dtype)
  if plain_adam:
    # A == g: identical to Adam, no accumulator arithmetic.
    return direction, m_num.astype(m.dtype), v_num.astype(v.dtype), a
  ac = a.astype(dt) + gc / jnp.asarray(big_t, dt)
  new_m = jnp.where(commit, (beta1 * mc + (1 - beta1) * ac).astype(m.dtype),
                    m)
  new_v = jnp.where(commit,
                    (beta2 * vc + (1 - beta2) * jnp.square(ac)
                     ).astype(v.dtype), v)
  new_a = jnp.where(commit, jnp.zeros_like(a), ac.astype(a.dtype))
  return direction, new_m, new_v, new_a
