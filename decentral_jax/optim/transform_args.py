"""Argument checks and precision rules shared by the optax transforms.

The decentralized transforms (:mod:`decentral_jax.optim`,
:mod:`decentral_jax.optim.accum_adam`, :mod:`decentral_jax.optim.push_sum`,
:mod:`decentral_jax.optim.local_updates`) validate their hyperparameters at
construction and compute in float32, or wider when an input is wider
(:func:`compute_dtype`; float64 stays float64). Values that
``optax.inject_hyperparams`` turned into arrays are recognised and the
message names ``static_args`` (:data:`INJECT_HINT`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from decentral_jax.comm import gossip

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


def check_hyperparameter(name: str, value, *, below_one: bool) -> None:
  """Raises ValueError unless ``value`` is finite, >= 0 (and < 1 if asked).

  Traced values are only checked for their dtype: a floating array with
  fewer than 32 bits is rejected, since ``b2 = 0.999`` rounds to 1.0 in
  bfloat16 (a zero bias correction) and ``eps = 1e-8`` to 0 in float16.
  """
  dtype = getattr(value, "dtype", None)
  if (dtype is not None and jnp.issubdtype(dtype, jnp.floating) and
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
    interval = "[0, 1)" if below_one else "finite and >= 0"
    raise ValueError(f"{name} must be {interval}, got {value!r}.")


INJECT_HINT = ("under optax.inject_hyperparams list {!r} in static_args "
                "(optax takes callables, dtype classes included, for "
                "schedules)")


def check_float_dtype(name: str, dtype) -> None:
  """Raises ValueError unless ``dtype`` is None or a floating dtype.

  An array here is what ``optax.inject_hyperparams`` makes of a dtype class
  or callable it took for a schedule.
  """
  if dtype is None:
    return
  if isinstance(dtype, (jax.Array, np.ndarray)):
    raise ValueError(f"{name} must be a floating dtype or None, got an "
                     f"array; {INJECT_HINT.format(name)}.")
  try:
    ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{name} must be a floating dtype or None, got "
                     f"{dtype!r}.")


def check_bucket_bytes(bucket_bytes) -> int:
  """The gossip bucket size of a transform: None -> the library default.

  Gossip sends same-dtype parameter leaves in buckets of at most this many
  bytes, one collective per bucket and permute term
  (:func:`decentral_jax.comm.gossip.mix`, after PyTorch DDP's gradient buckets,
  Li et al., VLDB 2020); 0 sends one collective per leaf. The default is
  None rather than the number so that ``optax.inject_hyperparams`` does not
  turn it into a traced hyperparameter (pass an explicit value in
  ``static_args``).

  Returns:
    ``bucket_bytes`` as an int (``gossip.DEFAULT_BUCKET_BYTES`` for None).

  Raises:
    ValueError: not None or an integer >= 0 (an array: what
      ``optax.inject_hyperparams`` makes of an int not in ``static_args``).
  """
  if bucket_bytes is None:
    return gossip.DEFAULT_BUCKET_BYTES
  if isinstance(bucket_bytes, (jax.Array, np.ndarray)):
    raise ValueError("bucket_bytes must be an integer >= 0 or None, got an "
                     f"array; {INJECT_HINT.format('bucket_bytes')}.")
  gossip.check_bucket_bytes(bucket_bytes)
  return int(bucket_bytes)


def moment_dtype(name: str, dtype):
  """Canonical ``dtype`` (float64 -> float32 without x64), or None."""
  check_float_dtype(name, dtype)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)




def round_step(state, round_index):
  """The step that picks a gossip round: static ``round_index`` or ``state.count``.

  Raises:
    ValueError: ``round_index`` given but not a Python int.
  """
  if round_index is None:
    return state.count
  if isinstance(round_index, bool) or not isinstance(round_index, int):
    raise ValueError(
        f"round_index must be a Python int (static; jit it with "
        f"static_argnames), got {type(round_index).__name__}.")
  return round_index
