"""Argument checks and precision rules shared by the optax transforms.

The decentralized transforms (:mod:`decentral_jax.optim`,
:mod:`decentral_jax.optim.accum_adam`, :mod:`decentral_jax.optim.push_sum`,
:mod:`decentral_jax.optim.local_updates`) validate their hyperparameters at
construction and compute in float32, or wider when an input is wider
(:func:`compute_dtype`; float64 stays float64). Integers, dtypes and
choices are checked with :mod:`decentral_jax.checks`, whose messages name
``static_args`` when ``optax.inject_hyperparams`` turned a static argument
into an array; hyperparameters that may be traced (learning rates, betas,
eps) are checked here, when their values are known.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from decentral_jax import checks

NO_PARAMS = ("{} needs the current parameters: call tx.update(grads, state, "
             "params) with params.")


def compute_dtype(*dtypes) -> jnp.dtype:
  """float32, or the widest of ``dtypes`` when wider (float64 stays float64)."""
  return jnp.result_type(jnp.float32, *dtypes)


def as_dtype(x, dtype):
  """A hyperparameter for arithmetic in ``dtype``.

  Python numbers stay weakly typed (rounded to the dtype they meet, with
  ``1 - b`` formed exactly in Python first), so float32 arithmetic is the
  same as with a literal; arrays (e.g. from ``optax.inject_hyperparams``) are
  cast to ``dtype``.
  """
  if isinstance(x, (int, float)) and not isinstance(x, bool):
    return x
  return jnp.asarray(x, dtype)


def concrete_float(x) -> float | None:
  """``float(x)``, or None if ``x`` is traced (checked when it is known)."""
  try:
    return float(x)
  except TypeError:  # includes jax.errors.ConcretizationTypeError
    return None


def check_hyperparameter(name: str, value, *, below_one: bool,
                         wide: bool = True) -> None:
  """Raises ValueError unless ``value`` is finite, >= 0 (and < 1 if asked).

  ``value`` is a Python or NumPy number or an array (possibly traced, e.g.
  from ``optax.inject_hyperparams``); a bool, a string or anything else is
  refused. Traced values are only checked for their dtype: with ``wide``
  a floating array with fewer than 32 bits is rejected, since ``b2 =
  0.999`` rounds to 1.0 in bfloat16 (a zero bias correction) and ``eps =
  1e-8`` to 0 in float16.
  """
  interval = "a number in [0, 1)" if below_one else "a finite number >= 0"
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.number, np.ndarray, jax.Array)):
    raise ValueError(f"{name} must be {interval}, got {value!r}.")
  dtype = getattr(value, "dtype", None)
  if (wide and dtype is not None and jnp.issubdtype(dtype, jnp.floating) and
      jnp.finfo(dtype).bits < 32):
    raise ValueError(
        f"{name} is a {jnp.dtype(dtype).name} array; hyperparameters must be "
        "Python floats or float32/float64 arrays (under "
        "optax.inject_hyperparams with low-precision params pass "
        "hyperparam_dtype=jnp.float32).")
  v = concrete_float(value)
  if v is None:
    return
  if not math.isfinite(v) or v < 0 or (below_one and v >= 1):
    raise ValueError(f"{name} must be {interval}, got {value!r}.")


def check_period(name: str, value):
  """A period in steps (``accum_steps``, ``gossip_every``): an int >= 1.

  Under ``optax.inject_hyperparams`` the value arrives as a JAX integer
  scalar (possibly traced); it is accepted and checked when known.

  Returns:
    ``int(value)``, or ``value`` itself if it is a ``jax.Array``.

  Raises:
    ValueError: a float, a bool, a NumPy array, a non-integer or non-scalar
      JAX array, or a value < 1.
  """
  if not isinstance(value, jax.Array):
    return checks.check_int(name, value, minimum=1)
  known = concrete_float(value) if not value.ndim else None
  if (not jnp.issubdtype(value.dtype, jnp.integer) or value.ndim
      or (known is not None and known < 1)):
    raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
  return value


def check_learning_rate(learning_rate) -> None:
  """Raises ValueError unless ``learning_rate`` is a schedule or a number >= 0.

  A callable is an optax schedule (not called here); a number or array must
  be finite and >= 0 when its value is known (any floating dtype).
  """
  if not callable(learning_rate):
    check_hyperparameter("learning_rate", learning_rate, below_one=False,
                         wide=False)


def check_transform(name: str, tx) -> None:
  """Raises ValueError unless ``tx`` is an optax ``GradientTransformation``."""
  if not (callable(getattr(tx, "init", None))
          and callable(getattr(tx, "update", None))):
    raise ValueError(f"{name} must be an optax.GradientTransformation (e.g. "
                     f"optax.adamw(1e-3)), got {type(tx).__name__}.")


def moment_dtype(name: str, dtype):
  """Canonical ``dtype`` (float64 -> float32 without x64), or None."""
  checks.check_float_dtype(name, dtype)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)




def round_step(state, round_index):
  """The step that picks a gossip round: static ``round_index`` or ``state.count``.

  Raises:
    ValueError: ``round_index`` given but not an int (a float, a bool, or
      a traced array: it must be static).
  """
  if round_index is None:
    return state.count
  if isinstance(round_index, (jax.Array, np.ndarray)):
    raise ValueError(
        f"round_index must be a Python int (static; jit it with "
        f"static_argnames), got {type(round_index).__name__}.")
  return checks.check_int("round_index", round_index)
