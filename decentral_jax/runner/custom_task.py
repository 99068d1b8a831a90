"""The runner's task of a model and a data source named in the config.

:func:`custom_task` builds a :class:`~decentral_jax.runner.tasks.Task` from
``config.model.name`` and ``config.data.source`` when they name your own
builders (:mod:`decentral_jax.runner.extensions`: registered names or
``module:attribute``). A random-access training source is dealt to the
workers by the runner's per-epoch sharding
(:class:`decentral_jax.data.sharding.EpochSharder`: a pure function of
``(seed, step, worker)``, so a resumed run reads the same batches); an
iterator source is restarted at the step a run starts or resumes at.

Everything is checked before any compile, each failure one line naming the
model or the source and what was expected: a batch of step 0 that is not a
tuple of numeric arrays ``[n_workers, local_batch, ...]`` of a dtype JAX
holds (:func:`device_dtype`; an example of no arrays included), evaluation
examples of other shapes or dtypes than the training ones, fewer examples
than one step (or the evaluation set) needs, an ``init``
that fails, a parameter leaf of it that is not a float16, bfloat16,
float32 or float64 array or has no elements, and a loss that is not a float
scalar or an aux dict whose keys are not strings, whose values are not
float scalars or that uses a name of the runner's own per-step metrics
(traced with ``jax.eval_shape``, nothing compiled). Later batches are
compared with step 0's shapes and dtypes as they are read, every batch's
``int64``/``uint64`` values with the 32-bit range the device narrows them
to (:data:`INT_RANGES`) and finite ``float64`` values (and both parts of
``complex128`` ones) with float32's range (the example named), and an
exception the source raises while reading (``__getitem__``, the iterator
or the call that starts it) becomes one line naming the source, the example
and the step (the training loop then saves the steps trained so far,
:func:`decentral_jax.runner.train.train_and_evaluate`); the initial
parameters' values are checked finite (:func:`check_finite_params`) when
the run first builds its state, before the first step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from decentral_jax.data import sharding
from decentral_jax.runner import extensions
from decentral_jax.runner import step as step_lib


def _options(group: config_dict.ConfigDict) -> dict:
  options = group.get("options")
  return options.to_dict() if options is not None else {}


def build_model(config: config_dict.ConfigDict) -> extensions.Model:
  """``config.model.name``'s builder called with ``config.model.options``.

  Raises:
    ValueError: the name does not resolve, or the builder fails or returns
      something other than a :class:`~extensions.Model`.
  """
  name = config.model.name
  build = extensions.resolve("model", name)
  model = _call(build, _options(config.model), f"config.model.name={name!r}")
  if not isinstance(model, extensions.Model):
    raise ValueError(
        f"config.model.name={name!r} returned a {type(model).__name__}, not "
        "a decentral_jax.runner.extensions.Model(init, loss); wrap a Flax "
        "module with extensions.linen_model or extensions.nnx_model.")
  return model


def build_data(config: config_dict.ConfigDict) -> extensions.Data:
  """``config.data.source``'s builder called with ``config.data.options``.

  Raises:
    ValueError: as :func:`build_model`, for the data source.
  """
  name = config.data.source
  build = extensions.resolve("data", name)
  data = _call(build, _options(config.data), f"config.data.source={name!r}")
  if not isinstance(data, extensions.Data):
    raise ValueError(
        f"config.data.source={name!r} returned a {type(data).__name__}, not "
        "a decentral_jax.runner.extensions.Data(train, eval).")
  extensions.check_data(data, f"config.data.source={name!r}")
  return data


def _call(build: Callable, options: dict, what: str):
  try:
    return build(**options)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what} failed with options {options}: "
                     f"{type(e).__name__}: {' '.join(str(e).split())}"
                     ) from None


def _said(error: Exception) -> str:
  """``Type: message`` of ``error`` on one line (at most 200 characters)."""
  return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _example(source, i: int, what: str,
             step: int | None = None) -> tuple[np.ndarray, ...]:
  try:
    example = source[int(i)]
  except Exception as e:  # pylint: disable=broad-except
    at = "" if step is None else f" (step {step})"
    raise ValueError(f"{what}: reading example {i}{at} failed: {_said(e)}"
                     ) from None
  if isinstance(example, np.ndarray) or not isinstance(example,
                                                       (tuple, list)):
    example = (example,)
  if not example:
    raise ValueError(f"{what}: example {i} holds no arrays (an empty "
                     f"{type(example).__name__}); return a tuple of arrays.")
  try:
    return tuple(np.asarray(x) for x in example)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what}: example {i} is not a tuple of arrays "
                     f"({type(e).__name__}: {e}).") from None


#: The values a 64-bit integer array may hold: JAX (without x64) narrows
#: int64 to int32 and uint64 to uint32 by wrapping modulo 2**32.
INT_RANGES = {"int64": (-2**31, 2**31 - 1), "uint64": (0, 2**32 - 1)}


_FLUSHED: set[str] = set()  # sources warned about float64 values that flush


def _check_narrowing(arrays, what: str, where: Callable[[tuple], str]):
  """Refuses a value the device would narrow wrongly: a 64-bit integer
  outside :data:`INT_RANGES` (wrapped) or a finite ``float64`` value, or
  real or imaginary part of a ``complex128`` one, beyond float32's range
  (becomes inf); ``where(index)`` names the example of an index into the
  arrays. A non-zero such value (or part) that becomes 0 in float32 (below
  its smallest subnormal, about 1.4e-45) is only warned about, once.
  """
  for k, x in enumerate(arrays):
    name = np.dtype(x.dtype).name
    if x.size == 0 or name not in (*INT_RANGES, *_NARROWED_FLOATS):
      continue
    if name in _NARROWED_FLOATS:
      bad, flushed = _float32_narrowing(x)
      rule = (f"beyond float32's range (the device narrows {name} to "
              f"{_NARROWED_FLOATS[name]}, where it becomes inf); give "
              f"values of magnitude <= {np.finfo(np.float32).max}"
              f"{' in each part' if name == 'complex128' else ''}.")
      if what not in _FLUSHED and np.any(flushed):
        _FLUSHED.add(what)
        logging.warning("%s: array %d holds non-zero %s values below "
                        "float32's smallest subnormal (1.4e-45), which become "
                        "0 on the device.", what, k, name)
    else:
      lo, hi = INT_RANGES[name]
      bad = (x < lo) | (x > hi)
      rule = (f"outside [{lo}, {hi}] (the device narrows it to 32 bits by "
              "wrapping); give values in that range.")
    if np.any(bad):
      at = np.unravel_index(np.argmax(bad), x.shape)
      raise ValueError(f"{what}: array {k} of {where(at)} holds the "
                       f"{x.dtype} value {x[at]}, {rule}")


#: The 64-bit float types the device (without x64) narrows, and to what.
_NARROWED_FLOATS = {"float64": "float32", "complex128": "complex64"}


def _float32_narrowing(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(beyond, flushed)`` masks of a float64 or complex128 array ``x``:
  a finite value (real or imaginary part) that becomes inf in float32, a
  non-zero one that becomes 0."""
  parts = (x.real, x.imag) if np.iscomplexobj(x) else (x,)
  beyond, flushed = np.zeros(x.shape, bool), np.zeros(x.shape, bool)
  for part in parts:
    with np.errstate(over="ignore", under="ignore"):
      y = part.astype(np.float32)
    beyond |= np.isinf(y) & np.isfinite(part)
    flushed |= (y == 0) & (part != 0)
  return beyond, flushed


def _stack(source, ids: np.ndarray, what: str,
           step: int | None = None) -> tuple[np.ndarray, ...]:
  """The examples ``ids [W, B]`` of ``source`` (read for ``step``, None for
  the evaluation set) as arrays ``[W, B, ...]``."""
  rows = [_example(source, i, what, step) for i in ids.reshape(-1)]
  spec = _spec(rows[0])
  for i, row in zip(ids.reshape(-1), rows):
    if _spec(row) != spec:
      raise ValueError(f"{what}: example {i} has arrays {_show(_spec(row))}"
                       f", expected {_show(spec)} as the others.")
  arrays = tuple(np.stack([r[k] for r in rows]).reshape(ids.shape + x.shape)
                 for k, x in enumerate(rows[0]))
  at = "" if step is None else f" (step {step})"
  _check_narrowing(arrays, what,
                   lambda j: f"example {ids[j[:ids.ndim]]}{at}")
  return arrays


def _spec(arrays) -> tuple:
  return tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in arrays)


def _show(spec) -> str:
  return ", ".join(f"{d}{list(s)}" for s, d in spec)


#: The most examples a random-access source may have (the per-epoch
#: permutation holds one int64 per example: 16 GiB at this size).
MAX_EXAMPLES = 2**31 - 1


def _length(source, what: str, role: str) -> int:
  """``len(source)`` of ``Data.<role>``, checked: in [1, MAX_EXAMPLES].

  Raises:
    TypeError: ``source`` has no ``__len__`` (the caller names what it
      needs).
    ValueError: ``len`` raises (any exception: named with its message),
      ``__len__`` returns a non-integer (its type named), or the length is
      out of range; names the source.
  """
  if not hasattr(type(source), "__len__"):
    raise TypeError(f"Data.{role} has no __len__")
  try:
    size = len(source)
    got = f"is {size}"
  except Exception as e:  # pylint: disable=broad-except
    size, got = None, _len_failure(source, e)
  if size is not None and 1 <= size <= MAX_EXAMPLES:
    return size
  raise ValueError(
      f"{what}: len(Data.{role}) {got}, expected a whole number of "
      f"examples in [1, {MAX_EXAMPLES}]; fix the source's __len__.")


def _len_failure(source, error: Exception) -> str:
  """What went wrong with ``len(source)`` that raised ``error``: the
  type ``__len__`` returned where it is not an integer, else the
  exception and its message."""
  if isinstance(error, TypeError):
    try:
      raw = type(source).__len__(source)
    except Exception:  # pylint: disable=broad-except
      raw = None  # __len__ itself raised: named below
    if raw is not None and not hasattr(type(raw), "__index__"):
      return f"returns a {type(raw).__name__} ({str(raw)[:40]}), not an int"
  return f"fails ({_said(error)})"


def _random_access(train, what: str, n: int, b: int, seed: int):
  """``host_batch`` of a random-access source (the per-epoch sharding)."""
  try:
    size = _length(train, what, "train")
  except TypeError:
    raise ValueError(f"{what}: Data.train is neither a random-access source "
                     "(len and [i]) nor a callable start_step -> iterator."
                     ) from None
  if size < n * b:
    raise ValueError(
        f"{what} has {size} training examples, fewer than one step needs "
        f"({n} workers x {b} = {n * b}); lower --config.global_batch or give "
        "more examples.")
  sharder = sharding.EpochSharder(size, n, b, seed, what=f"{what} size",
                                  fix="lower --config.global_batch.")

  def host_batch(step, workers=None):
    return _stack(train, sharder.ids(step, workers), what, int(step))

  return host_batch


def _streamed(make_iter: Callable, what: str, n: int):
  """``host_batch`` of a ``start_step -> iterator`` source: read in order,
  restarted at ``step`` when asked for another step than the next."""
  state = {"next": None, "it": None}

  def host_batch(step, workers=None):
    try:
      if state["next"] != step:
        state["it"], state["next"] = iter(make_iter(int(step))), int(step)
      item = next(state["it"])
    except StopIteration:
      raise ValueError(
          f"{what} ran out of batches at step {step}: the iterator must "
          "yield one batch per step up to config.steps.") from None
    except Exception as e:  # pylint: disable=broad-except
      state["next"] = None  # restart the iterator on the next call
      raise ValueError(f"{what}: reading the batch of step {step} failed: "
                       f"{_said(e)}") from None
    state["next"] = int(step) + 1
    arrays = tuple(np.asarray(x) for x in (
        item if isinstance(item, (tuple, list)) else (item,)))
    if not arrays or any(x.ndim < 2 or x.shape[0] != n for x in arrays):
      raise ValueError(
          f"{what} yielded arrays {_show(_spec(arrays)) or 'none'} at step "
          f"{step}, expected [n_workers={n}, local_batch, ...] each.")
    _check_narrowing(arrays, what, lambda j: f"the batch of step {step} "
                     f"(worker {j[0]}, row {j[1]})")
    if workers is None:
      return arrays
    rows = np.asarray(list(workers), np.int64)
    return tuple(x[rows] for x in arrays)

  return host_batch


def _checked(host_batch, what: str, spec: tuple):
  """``host_batch`` that compares every batch with step 0's spec."""
  def checked(step, workers=None):
    arrays = host_batch(step, workers)
    got = tuple((s[1:], d) for s, d in _spec(arrays))
    if got != spec:
      raise ValueError(
          f"{what} gave arrays {_show(got)} per worker at step {step}, "
          f"expected {_show(spec)} as at step 0.")
    return arrays
  return checked


def _first_batch(host_batch, what: str, n: int, b: int):
  """Step 0's batch, checked: numeric arrays ``[n, b, ...]`` of a dtype
  JAX holds (:func:`device_dtype`)."""
  arrays = host_batch(0, None)
  for x in arrays:
    if x.ndim < 2 or x.shape[:2] != (n, b) or not device_dtype(x.dtype):
      raise ValueError(
          f"{what} gave arrays {_show(_spec(arrays))} at step 0, expected "
          f"numeric arrays [n_workers={n}, local_batch={b}, ...] (bool, "
          "integer, float up to float64 or complex up to complex128).")
  return arrays


def device_dtype(dtype) -> bool:
  """Whether JAX holds arrays of ``dtype``: bool, integer, floating of at
  most 64 bits (bfloat16 included) or complex of at most 128; not long
  double (float128, complex256), timedelta64, datetime64, strings or
  objects."""
  d = np.dtype(dtype)
  if d.kind == "V":  # ml_dtypes' bfloat16, float8, int4
    return bool(jnp.issubdtype(d, jnp.floating) or
                jnp.issubdtype(d, jnp.integer))
  return d.kind in "biu" or (d.kind == "f" and d.itemsize <= 8) or (
      d.kind == "c" and d.itemsize <= 16)


def _eval_set(source, what: str, batches: int, global_batch: int,
              train_spec: tuple):
  """The first ``batches * global_batch`` examples as ``[E, G, ...]``."""
  need = batches * global_batch
  try:
    size = _length(source, what, "eval")
  except TypeError:
    raise ValueError(f"{what}: Data.eval must be a random-access source "
                     "(len and [i]).") from None
  if size < need:
    raise ValueError(
        f"{what} has {size} evaluation examples, fewer than "
        f"config.eval_batches * config.global_batch = {need}; lower "
        "--config.eval_batches or give more examples.")
  ids = np.arange(need, dtype=np.int64).reshape(batches, global_batch)
  arrays = _stack(source, ids, f"{what} (evaluation)")
  got = tuple((s[2:], d) for s, d in _spec(arrays))
  if got != tuple((s[1:], d) for s, d in train_spec):
    raise ValueError(
        f"{what}: evaluation examples are {_show(got)}, expected "
        f"{_show(tuple((s[1:], d) for s, d in train_spec))} as the "
        "training examples.")
  return arrays


def _check_loss(model, params, batch, what: str, key) -> bool:
  """Traces the loss (``jax.eval_shape``): a float scalar and a dict;
  returns whether the dict holds ``"accuracy"``."""
  try:
    out = jax.eval_shape(model.loss, params, batch, key)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what}: the loss fails on one worker's batch "
                     f"{_show(_spec(batch))}: {type(e).__name__}: "
                     f"{' '.join(str(e).split())[:300]}") from None
  value, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
  if not hasattr(value, "shape") or value.shape != () or \
      not jnp.issubdtype(value.dtype, jnp.floating):  # bfloat16 too
    got = (f"{np.dtype(value.dtype).name}{list(value.shape)}"
           if hasattr(value, "shape") else type(value).__name__)
    raise ValueError(f"{what}: the loss returned {got}, expected a float "
                     "scalar (the mean loss over the batch), or (loss, aux "
                     "dict).")
  _check_aux_keys(aux, what)
  if not isinstance(aux, dict) or any(
      getattr(v, "shape", None) != () for v in aux.values()):
    raise ValueError(f"{what}: the loss's aux must be a dict of scalars, "
                     f"got {jax.tree.map(lambda v: v.shape, aux)}.")
  _check_aux_values(aux, what)
  taken = [k for k in aux if k in step_lib.STEP_METRICS or
           str(k).startswith(step_lib.COUNTER_PREFIX)]
  if taken:
    raise ValueError(
        f"{what}: the loss's aux uses {taken[0]!r}, a name of the runner's "
        f"own per-step metrics ({', '.join(step_lib.STEP_METRICS)}, "
        f"{step_lib.COUNTER_PREFIX}*); rename that aux key.")
  return "accuracy" in aux


def _check_aux_keys(aux, what: str) -> None:
  """Aux keys are strings (metric names; JAX cannot sort mixed keys)."""
  for k in aux if isinstance(aux, dict) else ():
    if not isinstance(k, str):
      raise ValueError(
          f"{what}: the loss's aux has the key {k!r} ({type(k).__name__}); "
          f"aux keys are metric names: use strings, e.g. {str(k)!r}.")


def _check_aux_values(aux: dict, what: str) -> None:
  """Aux values are float scalars (averaged over micro-batches, workers
  and steps: an integer or bool mean would be cast back, truncated or
  rounded)."""
  for k, v in aux.items():
    if not jnp.issubdtype(v.dtype, jnp.floating):
      raise ValueError(
          f"{what}: the loss's aux {k!r} is {np.dtype(v.dtype).name}; aux "
          "values are averaged over micro-batches, workers and steps, so "
          f"they must be float scalars: return {k!r}: "
          "value.astype(jnp.float32).")


def _init_shapes(init_params, what: str, model, one):
  """``jax.eval_shape`` of ``init`` (nothing compiled); its failures as
  one line naming the model."""
  if not callable(model.init):
    raise ValueError(
        f"{what}: Model.init is a {type(model.init).__name__}, not a "
        "callable init(key, example) -> parameters.")
  def keyed(key):  # the keys checked before JAX sorts them
    params = init_params(key)
    _check_param_keys(params, what)
    return params
  try:
    return jax.eval_shape(keyed, jax.random.key(0))
  except _ParamKeyError as e:
    raise ValueError(str(e)) from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{what}: init fails on one worker's example "
                     f"{_show(_spec(one))}: {type(e).__name__}: "
                     f"{' '.join(str(e).split())[:300]}") from None


#: Parameter dtypes: those an optax update promotes with float32.
PARAM_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _ParamKeyError(ValueError):
  """A dict key of ``init``'s parameters that is not a string."""


def _check_param_keys(node, what: str, at: str = "") -> None:
  """Every dict key of ``init``'s parameters a string (JAX cannot sort
  mixed keys; a checkpoint names leaves by them)."""
  if isinstance(node, dict):
    for key, value in node.items():
      if not isinstance(key, str):
        raise _ParamKeyError(
            f"{what}: init's parameters have the key {key!r} "
            f"({type(key).__name__}) at {at or 'the top'}; parameter dict "
            "keys must be strings: use str(key).")
      _check_param_keys(value, what, f"{at}[{key!r}]")
  elif isinstance(node, (list, tuple)):
    for i, value in enumerate(node):
      _check_param_keys(value, what, f"{at}[{i}]")


def _check_params(params, what: str) -> None:
  """Each parameter leaf (from ``jax.eval_shape`` of ``init``) must be a
  float array of at least one element: gradients are taken of every leaf,
  and a zero-size array cannot be checkpointed."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    where = f"{what}: init's parameter leaf {jax.tree_util.keystr(path)}"
    dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jnp.floating):
      got = (f"{dtype}{list(shape)}" if dtype is not None  # key<fry> too
             else type(leaf).__name__)
      raise ValueError(
          f"{where} is {got}; every leaf must be a float array (gradients "
          "are taken of all of them): cast it (.astype(jnp.float32)) or "
          "keep integer values out of the parameters.")
    if np.dtype(dtype).name not in PARAM_DTYPES:
      raise ValueError(
          f"{where} is {np.dtype(dtype).name}{list(shape)}; parameters must "
          f"be {', '.join(PARAM_DTYPES)} (the optimizers' float32 updates "
          f"do not promote with {np.dtype(dtype).name}): keep the parameter "
          "in float32 or bfloat16 and cast it to "
          f"{np.dtype(dtype).name} inside the loss.")
    if math.prod(shape) == 0:
      raise ValueError(
          f"{where} has shape {list(shape)} (no elements), which can be "
          "neither trained nor checkpointed; leave it out of the "
          "parameters.")


def check_finite_params(params, what: str) -> None:
  """Every value of the initial parameters (``init``'s output, one
  worker's tree) finite: a NaN or inf there makes the first step's update
  non-finite whatever the learning rate (a leaf the loss does not read
  too). Checked on the device, one count per leaf.

  Raises:
    ValueError: the first leaf holding NaN/inf, by its path, with the
      count.
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  counts = jax.device_get([jnp.sum(~jnp.isfinite(jnp.asarray(leaf)))
                           for _, leaf in flat])
  for (path, leaf), bad in zip(flat, counts):
    if int(bad):
      raise ValueError(
          f"{what}: init's parameter leaf {jax.tree_util.keystr(path)} "
          f"holds {int(bad)} NaN/inf value(s) of {math.prod(leaf.shape)}; "
          "the initial parameters must be finite: fix the model's init "
          "(or its options).")


def _normalised_loss(loss: Callable) -> Callable:
  def task_loss(params, batch, key):
    out = loss(params, batch, key)
    if isinstance(out, tuple) and len(out) == 2:
      return out[0], dict(out[1])
    return out, {}
  return task_loss


def custom_task(config: config_dict.ConfigDict, n_workers: int,
                local_batch: int, task_type: Any):
  """The task of your own model and data (see the module docstring).

  Args:
    config: a validated run config whose ``model.name`` and
      ``data.source`` name builders (:mod:`~decentral_jax.runner.extensions`).
    n_workers, local_batch: workers and examples per worker per step.
    task_type: the :class:`~decentral_jax.runner.tasks.Task` class.

  Returns:
    A ``Task``; its ``host_batch`` checks each batch against step 0's.

  Raises:
    ValueError: one line naming the model or the source (see the module
      docstring); raised before anything is compiled.
  """
  model, data = build_model(config), build_data(config)
  what = f"data source {config.data.source!r}"
  name = f"model {config.model.name!r}"
  n, b = n_workers, local_batch
  if callable(data.train) and not hasattr(data.train, "__getitem__"):
    raw = _streamed(data.train, what, n)
  else:
    raw = _random_access(data.train, what, n, b, int(config.seed))
  first = _first_batch(raw, what, n, b)
  spec = tuple((s[1:], d) for s, d in _spec(first))
  eval_set = _eval_set(data.eval, what, int(config.eval_batches),
                       int(config.global_batch), spec)
  one = tuple(x[0] for x in first)

  def init_params(key):
    return model.init(key, one)

  params = _init_shapes(init_params, name, model, one)
  _check_params(params, name)
  key = jax.random.key(1) if bool(config.model.needs_key) else None
  accuracy = _check_loss(model, params, one, name, key)
  return task_type(init_params, _normalised_loss(model.loss),
                   _checked(raw, what, spec), eval_set, data.unit,
                   int(config.global_batch) * int(data.units_per_example),
                   accuracy)
