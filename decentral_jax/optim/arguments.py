"""Argument checks shared by the optax transforms.

The decentralized transforms (:mod:`decentral_jax.optim`,
:mod:`decentral_jax.optim.accum_adam`, :mod:`decentral_jax.optim.push_sum`,
:mod:`decentral_jax.optim.local_updates`) validate their hyperparameters at
construction (their compute dtypes are in
:mod:`decentral_jax.optim.precision`). Integers, dtypes and choices are
checked with :mod:`decentral_jax.checks`, whose messages name
``static_args`` when ``optax.inject_hyperparams`` turned a static argument
into an array; hyperparameters that may be traced (learning rates, betas,
eps) are checked here, when their values are known, and so is a weight
decay's ``mask`` (:func:`weight_decay_mask`: bools only, in the parameters'
structure).

:func:`per_worker_state` builds every transform of :mod:`decentral_jax.optim`
that keeps per-worker state, and gives that state one type inside
``jax.shard_map``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decentral_jax import checks
from decentral_jax.comm import collectives

NO_PARAMS = ("{} needs the current parameters: call tx.update(grads, state, "
             "params) with params.")


def concrete_float(x) -> float | None:
  """``float(x)``, or None if ``x`` is traced (checked when it is known).

  An int beyond float64's range (``10**400``) is ``inf`` with its sign, so
  a range check refuses it as not finite.
  """
  try:
    return float(x)
  except OverflowError:
    return math.inf if x > 0 else -math.inf
  except TypeError:  # includes jax.errors.ConcretizationTypeError
    return None


def check_hyperparameter(name: str, value, *, below_one: bool,
                         wide: bool = True, schedule: bool = False) -> None:
  """Raises ValueError unless ``value`` is finite, >= 0 (and < 1 if asked).

  ``value`` is a Python int or float, or a NumPy or JAX scalar or array
  (possibly traced, e.g. from ``optax.inject_hyperparams``) of a floating
  or signed integer dtype; a bool, a string, a complex or unsigned dtype
  (optax negates a learning rate) or anything else is refused, and so is
  a concrete array that is not a scalar (its values would skip the range
  check and broadcast against the parameters; ``schedule`` says a
  schedule is the way to vary it). Traced values are only checked for
  their dtype: with ``wide``
  a floating array with fewer than 32 bits is rejected, since ``b2 =
  0.999`` rounds to 1.0 in bfloat16 (a zero bias correction) and ``eps =
  1e-8`` to 0 in float16.
  """
  interval = "a number in [0, 1)" if below_one else "a finite number >= 0"
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, float, np.number, np.ndarray, jax.Array)):
    raise ValueError(f"{name} must be {interval}, got {value!r}.")
  dtype = getattr(value, "dtype", None)
  if dtype is not None and not (jnp.issubdtype(dtype, jnp.floating) or
                                jnp.issubdtype(dtype, jnp.signedinteger)):
    raise ValueError(
        f"{name} must be {interval} of a floating or signed integer dtype, "
        f"got a {jnp.dtype(dtype).name} value; pass a Python float.")
  if (wide and dtype is not None and jnp.issubdtype(dtype, jnp.floating) and
      jnp.finfo(dtype).bits < 32):
    raise ValueError(
        f"{name} is a {jnp.dtype(dtype).name} array; hyperparameters must be "
        "Python floats or float32/float64 arrays (under "
        "optax.inject_hyperparams with low-precision params pass "
        "hyperparam_dtype=jnp.float32).")
  if np.ndim(value) and not isinstance(value, jax.core.Tracer):
    expected = "a scalar or a schedule" if schedule else "a scalar"
    raise ValueError(f"{name} must be {expected}, got an array of shape "
                     f"{tuple(np.shape(value))}.")
  v = concrete_float(value)
  if v is None:
    return
  if not math.isfinite(v) or v < 0 or (below_one and v >= 1):
    raise ValueError(f"{name} must be {interval}, got {checks.shown(value)}.")


def check_period(name: str, value):
  """A period in steps (``accum_steps``, ``gossip_every``): an int in
  ``[1, checks.INT32_MAX]`` (the step counter it divides is int32).

  Under ``optax.inject_hyperparams`` the value arrives as a JAX integer
  scalar (possibly traced); it is accepted and checked when known.

  Returns:
    ``int(value)``, or ``value`` itself if it is a ``jax.Array``.

  Raises:
    ValueError: a float, a bool, a NumPy array, a non-integer or non-scalar
      JAX array, or a value < 1 or above ``checks.INT32_MAX``.
  """
  if not isinstance(value, jax.Array):
    return checks.check_int(name, value, minimum=1, maximum=checks.INT32_MAX)
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
                         wide=False, schedule=True)


def check_transform(name: str, tx) -> None:
  """Raises ValueError unless ``tx`` is an optax ``GradientTransformation``."""
  if not (callable(getattr(tx, "init", None))
          and callable(getattr(tx, "update", None))):
    raise ValueError(f"{name} must be an optax.GradientTransformation (e.g. "
                     f"optax.adamw(1e-3)), got {type(tx).__name__}.")


def per_worker_state(init_fn, update_fn, *, extra_args: bool = False):
  """An optax transform whose state has one type inside ``jax.shard_map``.

  Inside ``shard_map`` an array's type names the mesh axes it varies over;
  a ``lax.fori_loop`` carry and the branches of a ``lax.cond`` must agree
  on it. State built from constants (a zero step count) is invariant,
  state mixed with per-worker values is varying, and the same state
  leaves ``shard_map`` and comes back in (a separately jitted ``init``)
  varying over the worker axes. The rule, a type-level cast
  (:func:`decentral_jax.comm.collectives.vary_over`; values unchanged, no
  collective):

  - ``init(params)``: every state leaf varies over every mesh axis a leaf
    of ``params`` varies over (the worker axes under
    :func:`decentral_jax.parallel.per_worker`);
  - ``update(updates, state, params)``: every leaf of the new state varies
    over at least the axes its leaf in ``state`` varies over.

  So ``init`` and ``update`` in one trace, state carried through
  ``lax.fori_loop``, and state from a separate ``jax.jit`` all see the
  types the last of these sees. Outside ``shard_map`` and under the
  ``vmap`` over a device's workers no axis varies and nothing changes.

  Args:
    init_fn, update_fn: the transform's ``init(params)`` and
      ``update(updates, state, params=None, **extra_args)``.
    extra_args: build an ``optax.GradientTransformationExtraArgs`` (the
      update takes keyword arguments, e.g. ``round_index``).

  Returns:
    ``optax.GradientTransformation`` (or ``...ExtraArgs``).
  """

  def init(params):
    return collectives.vary_over(init_fn(params),
                                 collectives.tree_varying_axes(params))

  def update(updates, state, params=None, **extra):
    updates, new_state = update_fn(updates, state, params, **extra)
    old, old_def = jax.tree.flatten(state)
    new, new_def = jax.tree.flatten(new_state)
    if old_def == new_def:
      new_state = new_def.unflatten([
          collectives.vary_over(y, collectives.tree_varying_axes(x))
          for y, x in zip(new, old)])
    return updates, new_state

  if extra_args:
    return optax.GradientTransformationExtraArgs(init, update)
  return optax.GradientTransformation(init, update)


MASK_RULE = ("pass None (decay all), 'ndim>=2', a pytree of bools with the "
             "parameters' structure (or a prefix of it) or a callable params "
             "-> such a pytree")


def weight_decay_mask(mask):
  """The weight-decay ``mask`` (not its string form), checked.

  ``mask`` is None (every leaf decays), a callable ``params -> bools`` or a
  pytree (dict, list, tuple, ...) whose leaves are Python or NumPy bools or
  0-d bool arrays, with the structure of the parameters or a prefix of it
  (as ``optax.masked``). Numbers, NaN and arrays are not read as
  true/false.

  Returns:
    None, or a callable ``params -> pytree of Python bools`` that checks
    the mask (a callable's result) against ``params`` when called (at
    ``init`` and ``update``).

  Raises:
    ValueError: one line naming ``mask``: a bare leaf (a bool, number or
      array: a JAX array is what ``optax.inject_hyperparams`` passes for a
      callable mask without ``static_args``), a leaf that is not a bool;
      from the returned callable, a structure that differs from the
      parameters' (naming the first differing path).
  """
  if mask is None:
    return None
  if callable(mask):
    return lambda params: _mask_of(mask(params), params, " (its result)")
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(mask)):
    # A bool or JAX array is what optax.inject_hyperparams passes for a
    # callable mask it took for a schedule.
    hint = ("; " + checks.INJECT_HINT.format("mask") if isinstance(
        mask, (bool, np.bool_, jax.Array)) else "")
    raise ValueError(f"mask={_shown(mask)}: {MASK_RULE} (not a bare bool, "
                     f"number or array){hint}.")
  _mask_bools(mask, "")
  return lambda params: _mask_of(mask, params, "")


def _shown(value) -> str:
  """``repr(value)`` on one line, at most 60 characters."""
  return " ".join(repr(value).split())[:60]


def _mask_bools(mask, said: str):
  """``mask`` with each leaf a Python bool; refuses any other leaf."""
  def leaf(path, x):
    if (isinstance(x, (bool, np.bool_)) or isinstance(
        x, (np.ndarray, jax.Array)) and x.dtype == bool and x.ndim == 0):
      try:
        return bool(x)
      except TypeError:  # a traced bool
        pass
    raise ValueError(
        f"mask{said} has {_shown(x)} ({type(x).__name__}) at "
        f"{jax.tree_util.keystr(path) or 'its root'}, not True or False; "
        f"{MASK_RULE}.")
  return jax.tree_util.tree_map_with_path(leaf, mask)


def _mask_of(mask, params, said: str):
  """``mask`` as Python bools, checked against the structure of ``params``."""
  mask = _mask_bools(mask, said)
  try:
    jax.tree.structure(mask).flatten_up_to(params)
    return mask
  except (ValueError, TypeError):
    pass
  mask_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(mask)[0]]
  param_paths = [p for p, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
  keystr = jax.tree_util.keystr
  why = next((f"has {keystr(m)}, which the parameters lack"
              for m in mask_paths
              if not any(p[:len(m)] == m for p in param_paths)), None)
  why = why or next((f"has no entry for the parameter {keystr(p)}"
                     for p in param_paths
                     if not any(p[:len(m)] == m for m in mask_paths)), None)
  why = why or "has other containers than the parameters (a list for a tuple?)"
  raise ValueError(f"mask{said} {why}; {MASK_RULE}.")
