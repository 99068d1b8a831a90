"""Extension points of the runner: your own model, data and inner optimizer.

A run config names each of them by a string, resolved here:

* ``config.model.name``: ``"gpt"``, ``"cnn"`` (the built-in tasks), a name
  given to :func:`register_model`, or ``"package.module:attribute"``;
* ``config.data.source`` (with such a model): a name given to
  :func:`register_data`, or ``"package.module:attribute"``;
* ``config.optimizer.name``: ``"adamw"``, ``"accum_adamw"``, a name given to
  :func:`register_optimizer`, or ``"package.module:attribute"``
  (``"optax.contrib:muon"``).

A ``module:attribute`` reference is imported when the config is checked
(:func:`resolve`), so a typo is one line naming it before anything is
built or compiled. The attribute (or registered builder) is a callable:

* model: ``build(**config.model.options) -> Model``;
* data: ``build(**config.data.options) -> Data``;
* optimizer: ``build(learning_rate=schedule) -> optax.GradientTransformation``
  (the inner transform of one worker; the method adds the clip, the gossip
  or the sync around it).

:func:`linen_model` and :func:`nnx_model` wrap a Flax Linen or NNX module
and a loss into a :class:`Model`. This module imports no JAX (the adapters
import Flax when called); :mod:`decentral_jax.runner.custom_task` builds the
runner's task from a model and a data source (docs/extending.md).
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any, Callable, NamedTuple

BUILT_IN_MODELS = ("gpt", "cnn")
BUILT_IN_OPTIMIZERS = ("adamw", "accum_adamw")
KINDS = ("model", "data", "optimizer")
# The config field that names each kind (for messages).
_FIELDS = {"model": "model.name", "data": "data.source",
           "optimizer": "optimizer.name"}
_REGISTRY: dict[str, dict[str, Callable]] = {k: {} for k in KINDS}


class Model(NamedTuple):
  """A model and its loss, as the runner trains it.

  Attributes:
    init: ``init(key, batch) -> params``: one worker's parameters (a pytree
      of float arrays) from a PRNG key and one worker's batch (a tuple of
      arrays ``[local_batch, ...]``, to give the input shapes).
    loss: ``loss(params, batch, key) -> loss`` or ``(loss, aux)``: the mean
      loss over the batch, a float32 (or float64) scalar; ``aux`` a dict of
      float scalars (``{"accuracy": ...}`` is reported as accuracy). ``key``
      is a fresh PRNG key per worker and step when training with
      ``config.model.needs_key`` (dropout), else None (evaluation).
  """
  init: Callable[..., Any]
  loss: Callable[..., Any]


class Data(NamedTuple):
  """Training and evaluation examples for the runner.

  Attributes:
    train: either a random-access source (``len(train)`` and
      ``train[i] -> example``, a tuple of NumPy-convertible arrays of the
      same shapes and dtypes for every ``i``: a ``grain.MapDataset``, a
      Grain data source, a Hugging Face dataset mapped to tuples, a list),
      dealt to the workers by the runner's deterministic per-epoch sharding
      (:mod:`decentral_jax.data.sharding`); or a callable ``start_step ->
      iterator`` whose items are whole steps, a tuple of arrays
      ``[n_workers, local_batch, ...]``, from ``start_step`` on (a resumed
      run calls it with the step it resumes at, so it must be deterministic
      in ``start_step``).
    eval: a random-access source as above; its first ``eval_batches *
      global_batch`` examples are the validation set.
    unit: what one example is, for throughput (``"samples"`` or
      ``"tokens"``).
    units_per_example: units in one example (tokens per sequence; 1 for
      samples).
  """
  train: Any
  eval: Any
  unit: str = "samples"
  units_per_example: int = 1


def check_data(data: Data, what: str) -> None:
  """Refuses a :class:`Data` whose ``unit`` is not ``"samples"`` or
  ``"tokens"`` or whose ``units_per_example`` is not a whole number >= 1
  (an int, or a float such as 2.0; not a bool, a string or 1.5).

  Raises:
    ValueError: one line naming ``what`` and the field.
  """
  if data.unit not in ("samples", "tokens"):
    raise ValueError(f"{what}: Data.unit={data.unit!r} must be 'samples' "
                     "or 'tokens'.")
  n = data.units_per_example
  whole = (isinstance(n, numbers.Real) and not isinstance(n, bool)
           and math.isfinite(float(n)) and float(n).is_integer())
  if not whole or n < 1:
    raise ValueError(
        f"{what}: Data.units_per_example={n!r} must be a whole number >= 1 "
        "(units in one example: tokens per sequence, 1 for samples); pass "
        "e.g. units_per_example=1.")


def register_model(name: str, build: Callable[..., Model]) -> None:
  """Registers ``build(**config.model.options) -> Model`` as ``name``.

  Raises:
    ValueError: a name that is built in, holds ``":"``, or is taken.
  """
  _register("model", name, build)


def register_data(name: str, build: Callable[..., Data]) -> None:
  """Registers ``build(**config.data.options) -> Data`` as ``name``.

  Raises:
    ValueError: a name that holds ``":"`` or is taken.
  """
  _register("data", name, build)


def register_optimizer(name: str, build: Callable[..., Any]) -> None:
  """Registers ``build(learning_rate=schedule) -> optax transform`` as ``name``.

  Raises:
    ValueError: a name that is built in, holds ``":"``, or is taken.
  """
  _register("optimizer", name, build)


def _register(kind: str, name: str, build: Callable) -> None:
  built_in = {"model": BUILT_IN_MODELS, "optimizer": BUILT_IN_OPTIMIZERS,
              "data": ()}[kind]
  if not isinstance(name, str) or not name or ":" in name or \
      name in built_in:
    raise ValueError(
        f"register_{kind}({name!r}, ...): the name must be a non-empty "
        f"string without ':' and not one of the built-in {built_in}.")
  if not callable(build):
    raise ValueError(f"register_{kind}({name!r}, {build!r}): the builder "
                     "must be callable.")
  if not _same_builder(_REGISTRY[kind].get(name, build), build):
    raise ValueError(f"register_{kind}({name!r}, ...): the name is already "
                     f"registered to {_REGISTRY[kind][name]!r}; pick another "
                     "name.")
  _REGISTRY[kind][name] = build


def _same_builder(old: Callable, new: Callable) -> bool:
  """The same object, or the same function of a module imported again
  (e.g. a script run as ``__main__`` and then imported by name)."""
  if old is new:
    return True
  name = getattr(old, "__qualname__", None)
  if name is None or name != getattr(new, "__qualname__", None):
    return False
  modules = {getattr(old, "__module__", None), getattr(new, "__module__", None)}
  return len(modules) == 1 or "__main__" in modules


def registered(kind: str) -> tuple[str, ...]:
  """The names registered for ``kind`` (``"model"``, ``"data"``,
  ``"optimizer"``), sorted."""
  return tuple(sorted(_REGISTRY[kind]))


def is_reference(name) -> bool:
  """True if ``name`` has the form ``"package.module:attribute"``."""
  return isinstance(name, str) and name.count(":") == 1 and \
      all(part.strip() for part in name.split(":"))


def resolve(kind: str, name: str) -> Callable:
  """The builder named ``name``: registered, or ``module:attribute``.

  Raises:
    ValueError: one line naming the config field and ``name``: not
      registered and not of the form ``module:attribute``; a module that
      does not import (with its error); a missing or non-callable
      attribute.
  """
  field = _FIELDS[kind]
  if name in _REGISTRY[kind]:
    return _REGISTRY[kind][name]
  if not is_reference(name):
    known = registered(kind)
    raise ValueError(
        f"config.{field}={name!r} is neither registered (register_{kind}; "
        f"registered: {list(known)}) nor of the form "
        "'package.module:attribute'.")
  module_name, attribute = (p.strip() for p in name.split(":"))
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"config.{field}={name!r}: module {module_name!r} does not import "
        f"({type(e).__name__}: {' '.join(str(e).split())}); check the name "
        "and that its directory is on PYTHONPATH.") from None
  build = module
  for part in attribute.split("."):
    build = getattr(build, part, None)
    if build is None:
      raise ValueError(f"config.{field}={name!r}: module {module_name!r} "
                       f"has no attribute {attribute!r}.")
  if not callable(build):
    raise ValueError(f"config.{field}={name!r}: {attribute!r} is a "
                     f"{type(build).__name__}, not a callable builder.")
  return build


def _inputs_of(batch):
  return batch[0]


def linen_model(module, loss_fn: Callable, *,
                inputs: Callable = _inputs_of) -> Model:
  """A :class:`Model` of a Flax Linen module and a loss on its outputs.

  ``init(key, batch) = module.init(key, inputs(batch))["params"]``;
  ``loss(params, batch, key) = loss_fn(module.apply({"params": params},
  inputs(batch), **rngs), batch)`` with ``rngs={"dropout": key}`` when a
  key is given.

  Args:
    module: a ``flax.linen.Module``.
    loss_fn: ``loss_fn(outputs, batch) -> loss`` or ``(loss, aux)``.
    inputs: ``batch -> module input`` (default: the batch's first array).
  """
  def init(key, batch):
    return module.init(key, inputs(batch))["params"]

  def loss(params, batch, key=None):
    rngs = {"rngs": {"dropout": key}} if key is not None else {}
    return loss_fn(module.apply({"params": params}, inputs(batch), **rngs),
                   batch)

  return Model(init, loss)


def nnx_model(make_module: Callable, loss_fn: Callable, *,
              inputs: Callable = _inputs_of) -> Model:
  """A :class:`Model` of a Flax NNX module and a loss on its outputs.

  The parameters are the module's ``nnx.Param`` state as a pure dict
  (``nnx.to_pure_dict``); the loss merges them back into the module
  (``nnx.merge``) and calls it on ``inputs(batch)``. NNX modules with
  dropout or other mutable state are not supported (deterministic models).

  Args:
    make_module: ``rngs -> module`` (``lambda rngs: MyMLP(..., rngs=rngs)``).
    loss_fn: ``loss_fn(outputs, batch) -> loss`` or ``(loss, aux)``.
    inputs: ``batch -> module input`` (default: the batch's first array).
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, abstract = None, None

  def init(key, batch):
    nonlocal graphdef, abstract
    del batch  # NNX modules know their shapes when built
    graphdef, state = nnx.split(make_module(nnx.Rngs(key)), nnx.Param)
    abstract = state
    return nnx.to_pure_dict(state)

  def loss(params, batch, key=None):
    del key
    if graphdef is None:
      raise ValueError("nnx_model: the loss was called before init.")
    state = nnx.State(abstract)
    nnx.replace_by_pure_dict(state, params)
    return loss_fn(nnx.merge(graphdef, state)(inputs(batch)), batch)

  return Model(init, loss)
