"""The method registry: one :class:`Method` record per ``config.algorithm``.

Each method family's home (:mod:`~decentral_jax.runner.methods.all_reduce`,
:mod:`~decentral_jax.runner.methods.decentralized`,
:mod:`~decentral_jax.runner.methods.local_updates`,
:mod:`~decentral_jax.runner.methods.sgp`,
:mod:`~decentral_jax.runner.methods.desloc`) states how a method is built
from the run config, which of the :data:`METHOD_FIELDS` it reads, its checks
and the runtime-model spec that prices it, and calls :func:`register` once
per method. Everything else is derived from :data:`ALGORITHMS`: the config's
allowed ``algorithm`` values and the refusal of fields a method does not
read (:mod:`decentral_jax.runner.validation`), the optimizer
(:func:`decentral_jax.runner.builders.make_optimizer`), the runtime-model
spec (:func:`decentral_jax.runner.builders.spec_for_config`) and the
display name (:func:`display_name`, from the table of
:mod:`decentral_jax.method_names`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, NamedTuple

import optax
from ml_collections import config_dict

from decentral_jax import method_names as names

PyTree = Any

#: Config fields that only some methods read. Each :class:`Method` lists
#: those it reads (``Method.fields``); ``validation.check_config`` refuses
#: a value other than the ``base_config`` default of one that
#: ``config.algorithm`` does not read.
METHOD_FIELDS = ("topology", "comm_dtype", "bucket_bytes", "gossip_rounds",
                 "global_avg_interval", "gossip_every", "sync_every",
                 "outer_optimizer.name", "outer_optimizer.lr",
                 "outer_optimizer.momentum", "outer_optimizer.nesterov",
                 "num_fragments", "overlap_steps", "merge_alpha",
                 "outer_overlap", "outer_latency", "trickle_reduction",
                 "compression.format", "compression.block",
                 "compression.fraction", "compression.error_feedback",
                 "compression.error_decay", "compression.consensus_step")


class ConfigField(NamedTuple):
  """A config field a method home declares (``Method.config_fields``).

  Added to :func:`decentral_jax.runner.config.base_config` with
  ``default``, checked by ``rule``, read only by the method that declares
  it (another ``config.algorithm`` refuses a value other than
  ``default``), recorded in checkpoints and kept across a resume
  (a checkpoint written before the field existed counts as ``default``).
  """
  # The base_config value (a bool, int, float or str).
  default: Any
  # rule(name, value): raises a one-line ValueError naming config.<name>
  # (decentral_jax.runner.field_checks builds them).
  rule: Callable[[str, Any], None]
  # What it sets, with its unit (a comment of base_config).
  doc: str = ""


class Arm(NamedTuple):
  """One arm of the main job (``decentral-jax compare``) for a method.

  ``name`` is its ``--methods`` name; ``fields`` the further config
  fields it sets, ``((dotted field, value), ...)``; ``peak_lr`` its tuned
  peak learning rate for the job's setting (gpt_tiny, 8 workers, 300
  steps; None: the config's own).
  """
  name: str
  optimizer: str = "adamw"
  topology: str = "complete"
  fields: tuple = ()
  peak_lr: float | None = None
  workers_per_node: int = 1


class Method(NamedTuple):
  """A ``config.algorithm`` value: how it is built, read, checked, priced."""
  # The config.algorithm value.
  name: str
  # build(config, schedule, topology or None, axis_name) -> the optax
  # transform of one worker (updated inside shard_map over the worker axis).
  build: Callable[..., optax.GradientTransformation]
  # The METHOD_FIELDS it reads (the others must keep their defaults).
  fields: tuple[str, ...]
  # runtime_spec(config) -> the runtime-model spec that prices the run
  # (decentral_jax.runtime_model.specs, local_methods), message settings
  # (comm_dtype, compress, bucket_MiB) included.
  runtime_spec: Callable[..., str]
  # The key of its display name (decentral_jax.method_names).
  label: str
  # True if it communicates over config.topology (the runner builds it).
  uses_topology: bool = False
  # True if its gossip round may be picked on the host (gossip_rounds
  # "static": one compiled program per distinct round).
  static_rounds: bool = False
  # gossip_every(config) -> steps between two gossip rounds (the runner
  # compiles a separate local step if > 1); None: 1.
  gossip_every: Callable[..., int] | None = None
  # round_stride(config) -> steps per round of the gossip schedule (2 for
  # pipelined gossip, which sends round floor(k / 2) at step k); None: 1.
  round_stride: Callable[..., int] | None = None
  # checks(config): cross-field checks of the fields it reads, run before
  # the refusal of fields it does not read; raise a one-line ValueError.
  checks: Callable[..., None] | None = None
  # compression_checks(config, fmt): config.compression against the method
  # (fmt: "config.compression.format='int8'" for messages).
  compression_checks: Callable[..., None] | None = None
  # unread(config, field) -> why a field it lists is not read with this
  # config (for a message), or None.
  unread: Callable[..., str | None] | None = None
  # faults(config): checks of an enabled config.faults against the method;
  # None: it does not run with faults.
  faults: Callable[..., None] | None = None
  # Fault settings it never reads -> why (for a message).
  unread_faults: Mapping[str, str] = {}
  # warnings(config) -> lines on accepted but suspicious settings.
  warnings: Callable[..., list[str]] | None = None
  # eval_params(params, opt_state) -> this worker's parameters of "the
  # averaged model" (the evaluation averages them over the workers); None:
  # the worker's model (below).
  eval_params: Callable[..., PyTree] | None = None
  # model_params(params, opt_state) -> the worker's own model, where its
  # gradient is taken and its consensus distance measured (None: params).
  model_params: Callable[..., PyTree] | None = None
  # global_average(params, opt_state, axis_name) -> (params, opt_state) for
  # config.global_avg_interval (None: the exact mean of the parameters).
  global_average: Callable[..., tuple] | None = None
  # Config fields of its own, {dotted name: ConfigField} (added to
  # base_config and to ``fields`` by register).
  config_fields: Mapping[str, ConfigField] = {}
  # Its arms in the main job's method table (decentral_jax.tools.compare).
  arms: tuple[Arm, ...] = ()


#: The registered methods by ``config.algorithm``, in registration order.
ALGORITHMS: dict[str, Method] = {}


def register(method: Method) -> Method:
  """Adds ``method`` to :data:`ALGORITHMS` (its ``config.algorithm`` value).

  Returns:
    ``method``.

  Raises:
    ValueError: a name already registered or not an identifier, a field
      outside :data:`METHOD_FIELDS` (add the field to the config and to
      ``METHOD_FIELDS`` first), a ``build``/``runtime_spec``/hook that is
      not callable, ``fields`` not a tuple of names, or an empty ``label``.
  """
  if not isinstance(method, Method):
    raise ValueError(f"register takes a Method, got {type(method).__name__}.")
  if not str(method.name).isidentifier():
    raise ValueError(f"Method.name={method.name!r} must be an identifier "
                     "(it is a config.algorithm value).")
  if method.name in ALGORITHMS:
    raise ValueError(f"Method.name={method.name!r} is already registered; "
                     "pick another name or unregister it first.")
  _check_record(method)
  _check_config_fields(method)
  own = tuple(method.config_fields)
  unknown = [f for f in method.fields
             if f not in METHOD_FIELDS and f not in own]
  if unknown:
    raise ValueError(f"Method.fields of {method.name!r} names "
                     f"{', '.join(unknown)}, not in METHOD_FIELDS; list only "
                     "method fields of the run config, or declare the field "
                     "in Method.config_fields.")
  method = method._replace(
      fields=method.fields + tuple(f for f in own if f not in method.fields))
  ALGORITHMS[method.name] = method
  try:
    _check_against_base_config(method)
  except ValueError:
    del ALGORITHMS[method.name]
    raise
  return method


def _check_against_base_config(method: Method) -> None:
  """Its declared fields join ``base_config()`` without a collision (once
  the config module is loaded; the library's own homes register before)."""
  config = sys.modules.get("decentral_jax.runner.config")
  base_config = getattr(config, "base_config", None)
  if base_config is None or not method.config_fields:
    return
  base_config()  # raises the collision, naming the method and the field


def _check_config_fields(method: Method) -> None:
  """``method.config_fields`` and ``method.arms`` well formed (one line)."""
  name, fields = method.name, method.config_fields
  if not isinstance(fields, Mapping):
    raise ValueError(f"Method.config_fields of {name!r} must be a mapping "
                     f"{{dotted name: ConfigField}}, got {fields!r:.60}.")
  taken = declared_fields()
  for field, spec in fields.items():
    if not (isinstance(field, str) and field and
            all(p.isidentifier() for p in field.split("."))):
      raise ValueError(f"Method.config_fields of {name!r}: {field!r} is not "
                       "a dotted field name such as 'noloco.alpha'.")
    if not isinstance(spec, ConfigField) or not callable(spec.rule):
      raise ValueError(f"Method.config_fields[{field!r}] of {name!r} must be "
                       "a ConfigField(default, rule, doc) with a callable "
                       "rule.")
    if field in METHOD_FIELDS or (field in taken and taken[field] != spec):
      raise ValueError(f"Method.config_fields of {name!r}: config.{field} "
                       "is already a field; pick another name.")
    spec.rule(field, spec.default)  # the default must pass its own rule
  if not (isinstance(method.arms, tuple) and
          all(isinstance(a, Arm) for a in method.arms)):
    raise ValueError(f"Method.arms of {name!r} must be a tuple of Arm, got "
                     f"{method.arms!r:.60}.")
  taken_arms = {a.name for m in ALGORITHMS.values() for a in m.arms}
  for arm in method.arms:
    if arm.name in taken_arms or not str(arm.name).isidentifier():
      raise ValueError(f"Method.arms of {name!r}: arm name {arm.name!r} is "
                       "taken by another method's arm or not an identifier; "
                       "pick another.")
    taken_arms.add(arm.name)


def declared_fields() -> dict[str, ConfigField]:
  """The fields the registered methods declare, ``{dotted name:
  ConfigField}``, in registration order."""
  out = {}
  for method in ALGORITHMS.values():
    out.update(method.config_fields)
  return out


def method_fields() -> tuple[str, ...]:
  """Every field only some methods read: :data:`METHOD_FIELDS` and the
  registered methods' own (:func:`declared_fields`)."""
  return METHOD_FIELDS + tuple(declared_fields())


def add_declared_fields(config) -> None:
  """Adds each registered method's own fields to ``config`` (a
  ``ConfigDict``) with their defaults; a dotted name's groups are created
  (or joined, if the config already has that group).

  Raises:
    ValueError: a declared field that ``config`` already has, or one below
      a field that is not a group (names the method and the field).
  """
  for method in ALGORITHMS.values():
    for field, spec in method.config_fields.items():
      *groups, leaf = field.split(".")
      node, path = config, []
      for group in groups:
        path.append(group)
        if group not in node:
          node[group] = config_dict.ConfigDict()
        elif not isinstance(node[group], config_dict.ConfigDict):
          raise ValueError(
              f"method {method.name!r} declares config.{field}, but "
              f"config.{'.'.join(path)} is a field, not a group; rename the "
              "declared field.")
        node = node[group]
      if leaf in node:
        raise ValueError(f"method {method.name!r} declares config.{field}, "
                         "which the base config already has; rename the "
                         "declared field.")
      node[leaf] = spec.default


_HOOKS = ("gossip_every", "round_stride", "checks", "compression_checks",
          "unread", "faults",
          "warnings", "eval_params", "model_params", "global_average")


def _check_record(method: Method) -> None:
  """Each field of ``method`` has the type its comment states (one line)."""
  name = method.name
  for field in ("build", "runtime_spec"):
    if not callable(getattr(method, field)):
      raise ValueError(f"Method.{field} of {name!r} must be callable, got "
                       f"{getattr(method, field)!r}.")
  for field in _HOOKS:
    hook = getattr(method, field)
    if hook is not None and not callable(hook):
      raise ValueError(f"Method.{field} of {name!r} must be callable or "
                       f"None, got {hook!r}.")
  if not (isinstance(method.fields, tuple)
          and all(isinstance(f, str) for f in method.fields)):
    raise ValueError(f"Method.fields of {name!r} must be a tuple of config "
                     f"field names, got {method.fields!r}.")
  if not (isinstance(method.label, str) and method.label):
    raise ValueError(f"Method.label of {name!r} must be a non-empty "
                     f"string (its display name or a key of "
                     f"decentral_jax.method_names), got {method.label!r}.")


def unregister(name: str) -> Method:
  """Removes and returns the method registered as ``name``.

  Raises:
    ValueError: ``name`` not registered.
  """
  return ALGORITHMS.pop(lookup(name).name)


def lookup(name: str) -> Method:
  """The method of ``config.algorithm = name``.

  Raises:
    ValueError: an unknown ``name`` (listing the registered ones).
  """
  method = ALGORITHMS.get(name) if isinstance(name, str) else None
  if method is None:
    raise ValueError(f"unknown config.algorithm={name!r}; use one of "
                     f"{', '.join(ALGORITHMS)}.")
  return method


def display_name(config) -> str:
  """The run's method name in tables and charts (one naming scheme).

  ``config.algorithm``'s :attr:`Method.label` in the table of
  :mod:`decentral_jax.method_names`, with ``config.topology`` for a
  method that gossips; ``decentralized`` with ``optimizer.name =
  "accum_adamw"`` is AccumAdamW. E.g. ``"DAdam (Exp)"``.

  Raises:
    ValueError: an unknown ``config.algorithm``.
  """
  method = lookup(config.algorithm)
  key = method.label
  if key == "dadam" and config.optimizer.name == "accum_adamw":
    key = "accum_adamw"
  return names.display_name(
      key, config.topology if method.uses_topology else None)
