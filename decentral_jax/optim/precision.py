"""Precision rules shared by the optax transforms.

The decentralized transforms compute in float32, or wider when an input is
wider (:func:`compute_dtype`; float64 stays float64), take hyperparameters
into that arithmetic without changing its rounding (:func:`as_dtype`) and
keep optimizer moments in a chosen floating dtype (:func:`moment_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decentral_jax import checks


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


def moment_dtype(name: str, dtype):
  """Canonical ``dtype`` (float64 -> float32 without x64), or None."""
  checks.check_float_dtype(name, dtype)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
