"""The JSON document a checkpoint stores about its run: its schema.

Which keys a checkpoint's document holds (:data:`RESUME_FIELDS`, the
values older versions lacked: :data:`RESUME_DEFAULTS`), which config
fields a resume may change (:data:`RESUME_FREE`), and the checks of a
document read back on resume (:func:`check_run_meta`,
:func:`meta_file_error`): a key its format always holds is required
(:data:`CONFIG_FORMAT_KEYS`, :data:`OLD_FORMAT_KEYS`), every value must be
of the kind a run writes and pass its config field's rule, and a float32
value the run computed is at most :data:`F32_MAX`; anything else is a
damaged document, never a changed config.
:mod:`decentral_jax.runner.run_meta` writes the document and compares it
with a run's own.
"""

from __future__ import annotations

import json
import os

import numpy as np

from decentral_jax import records
from decentral_jax.runner import checkpoint as checkpoint_lib
from decentral_jax.runner import config_groups
from decentral_jax.runner import data_files
from decentral_jax.runner import field_rules
from decentral_jax.runner import meta_derived
from decentral_jax.runner import methods
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import metrics_rules

#: checkpoint_meta key -> the config field a resumed run must keep.
RESUME_FIELDS = {"n_workers": "n_workers",
                 "workers_per_node": "workers_per_node",
                 "algorithm": "algorithm", "topology": "topology",
                 "optimizer": "optimizer.name",
                 "accum_steps": "optimizer.accum_steps",
                 "beta_convention": "optimizer.beta_convention",
                 "model": "model",
                 "seed": "seed", "global_batch": "global_batch",
                 "sync_every": "sync_every", "gossip_every": "gossip_every",
                 "num_fragments": "num_fragments",
                 "overlap_steps": "overlap_steps",
                 "merge_alpha": "merge_alpha",
                 "outer_overlap": "outer_overlap",
                 "outer_latency": "outer_latency",
                 "trickle_reduction": "trickle_reduction",
                 "outer_optimizer": "outer_optimizer",
                 "comm_dtype": "comm_dtype",
                 "compression": "compression",
                 "faults": "faults"}
# The worker layout (processes, devices per worker, workers per device,
# worker_layout) may change on resume: check_elastic_resume.
#: Values assumed for checkpoints written before these fields existed.
RESUME_DEFAULTS = {"beta_convention": "per_window", "faults": {},
                   "outer_overlap": "none", "outer_latency": 1,
                   "trickle_reduction": True,
                   "compression": json.loads(
                       config_groups.compression_group().to_json())}
#: Fields of the ``model`` group added after the first checkpoints, with the
#: value those were written with.
MODEL_DEFAULTS = {"param_dtype": "float32"}
#: Fields of the ``model`` group a resumed run may change: how much memory
#: the step takes, not what it computes (activation checkpointing).
MODEL_FREE = ("remat",)
#: Config fields (or groups) a resumed run may change: the run's length and
#: learning-rate schedule (an extension; the rate at the resumed step is
#: logged), what is recorded where and how often, and how the same step is
#: computed (memory controls, gossip buckets and program choice, process
#: set-up; the worker layout: elastic resume). Every other field of the
#: stored ``config`` must keep its value (:func:`check_resumable`).
RESUME_FREE = ("steps", "schedule", "eval_interval", "log_interval",
               "consensus_at", "checkpoint_interval", "keep_checkpoints",
               "tensorboard", "tracker", "workdir", "micro_batches",
               "model.remat", "bucket_bytes", "gossip_rounds", "distributed",
               "devices_per_worker", "workers_per_device", "worker_layout",
               # Where the data is (a moved file: the files' content is
               # compared, data_files; a registered source's own options
               # such as more batches) and what evaluation reads.
               "data.path", "data.options", "eval_batches")


def config_leaves(group: dict, prefix: str = "") -> dict:
  """``{"a.b": value}`` for the leaves of a nested config dict."""
  out = {}
  for k, v in group.items():
    if isinstance(v, dict):
      out.update(config_leaves(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out




# -- the document read back on resume ----------------------------------------
#: The groups every stored ``config`` holds (all versions that store it).
CONFIG_GROUPS = ("optimizer", "schedule", "model", "data", "compression",
                 "faults", "distributed")
#: The most training seconds a checkpoint may record (the metrics' bound).
MAX_TRAIN_TIME_S = metrics_rules.MAX_TRAIN_TIME_S
#: The largest float32: no loss, consensus distance or learning rate the run
#: computes in float32 exceeds it.
F32_MAX = float(np.finfo(np.float32).max)
#: The keys of the older format (``tests/fixtures/checkpoint_57b480f``, no
#: ``config``): every writer of it wrote them (:func:`check_run_meta`).
OLD_FORMAT_KEYS = (
    "step", "data_position", "seed", "n_workers", "workers_per_node",
    "algorithm", "topology", "topology_round", "optimizer", "accum_steps",
    "global_batch", "model", "sync_every", "gossip_every", "num_fragments",
    "overlap_steps", "merge_alpha", "outer_optimizer", "comm_dtype",
    "devices_per_worker", "workers_per_device", "worker_layout")
#: The keys of the current format (with ``config``): every writer of it
#: writes them; a method's declared fields (added with the method) default.
CONFIG_FORMAT_KEYS = (*OLD_FORMAT_KEYS, *RESUME_DEFAULTS, "lr", "layout",
                      "config")


def _float32_error(key: str, values: list) -> str | None:
  """Why a finite value of ``values`` (a float32 the run computed) is not
  one, or None: beyond :data:`F32_MAX` in size."""
  big = [v for v in values if abs(v) > F32_MAX]
  if big:
    return (f"{key} holds {big[0]:g}, beyond the largest float32 "
            f"{F32_MAX:.4g} (the run computes it in float32)")
  return None


def _window_error(window, step: int, signed_losses: bool = False
                  ) -> str | None:
  """Why a ``metrics_window`` entry is not one, or None: losses in [0,
  :data:`F32_MAX`] and accuracies in [0, 1] (any finite float32 for a model
  of your own), consensus distance in [0, :data:`F32_MAX`] (float32 values;
  the rules of ``metrics.jsonl``), at most one loss and one accuracy per
  step of the ``step`` the checkpoint has trained."""
  if window is None:
    return None
  if not isinstance(window, dict):
    return f"metrics_window must be an object or null, got {window!r:.60}"
  unknown = sorted(set(window) - {"losses", "accs", "consensus"})
  if unknown:
    return (f"metrics_window has unknown {records.short(unknown)} (the keys "
            "it may have: losses, accs, consensus)")
  for key, lo, hi in (("losses", None if signed_losses else 0, None),
                      ("accs", None, None) if signed_losses else
                      ("accs", 0, 1)):
    why = records.value_error(f"metrics_window.{key}", window.get(key, []),
                              "numbers", lo, hi)
    if why:
      return why
    why = _float32_error(f"metrics_window.{key}", window.get(key, []))
    if why:
      return why
    if len(window.get(key, [])) > step:
      return (f"metrics_window.{key} holds {len(window[key])} values, more "
              f"than the {step} steps trained")
  c = window.get("consensus")
  if c is not None:
    return (records.value_error("metrics_window.consensus", c, "number", 0)
            or _float32_error("metrics_window.consensus", [c]))
  return None


def _kind(v) -> str | None:
  if v is None:
    return None
  if isinstance(v, bool):
    return "true or false"
  if isinstance(v, (int, float)):
    return "a number"
  return {str: "a string", list: "a list", dict: "an object"}.get(
      type(v), type(v).__name__)


def _kind_error(theirs, like, key: str, free=()) -> str | None:
  """Why the stored ``theirs`` is not of the JSON kind this run writes for
  ``key`` (``like``; None matches any kind), or None. Objects recurse over
  their common keys, less the dotted ``key`` paths in ``free`` (fields a
  resume may change, kind included); a number must be finite where this
  run's is."""
  if key in free:
    return None
  a, b = _kind(theirs), _kind(like)
  if a is not None and b is not None and a != b:
    return f"{key} must be {b} (what a run writes), got {records.short(theirs)}"
  if b == "a number" and records.is_real(like) and not records.is_real(theirs):
    return f"{key} must be a finite number, got {records.short(theirs)}"
  if a == b == "an object":
    for k in sorted(set(theirs) & set(like)):
      why = _kind_error(theirs[k], like[k], f"{key}.{k}", free)
      if why:
        return why
  return None


def _keys_error(meta: dict) -> str | None:
  """Why ``meta`` lacks a key its format's writers all write, or None.

  Two formats are read: the current one (:data:`CONFIG_FORMAT_KEYS`,
  ``config`` included) and the older one of
  ``tests/fixtures/checkpoint_57b480f`` (:data:`OLD_FORMAT_KEYS`; neither
  ``config`` nor ``lr``, the fields of :data:`RESUME_DEFAULTS` at their
  defaults). A key missing from either is damage, never a field left
  uncompared; so is a document recording ``lr`` (a later writer) without
  ``config``.
  """
  if "config" not in meta and "lr" in meta:
    return ("the document misses config (a checkpoint that records lr "
            "holds its whole config)")
  need = CONFIG_FORMAT_KEYS if "config" in meta else OLD_FORMAT_KEYS
  missing = [k for k in need if k not in meta]
  if missing:
    return (f"the document misses {records.short(missing)} (every "
            "checkpoint of its format holds them)")
  return None


def _fields_error(meta: dict, like: dict) -> str | None:
  """Why the stored fields of ``meta`` are not of the kinds this run's own
  document ``like`` (:func:`checkpoint_meta`) has, or None: first the keys
  its format requires (:func:`_keys_error`); ``config``, absent from
  checkpoints of the older format, must otherwise be an object holding
  :data:`CONFIG_GROUPS`."""
  why = _keys_error(meta)
  if why:
    return why
  config = meta.get("config")
  if "config" in meta:
    if not isinstance(config, dict):
      return f"config must be an object, got {records.short(config)}"
    missing = [g for g in CONFIG_GROUPS if g not in config]
    if missing:
      return f"config misses the group(s) {missing}"
    missing = _missing_fields(config, like.get("config"))
    if missing:
      return (f"config misses {records.short(missing)} (a checkpoint with a "
              "config stores every field of it)")
  free = tuple(f"config.{f}" for f in RESUME_FREE)
  for key in sorted(set(meta) & set(like)):
    why = _kind_error(meta[key], like[key], key, free)
    if why:
      return why
  return None


def _dotted(tree: dict, prefix: str = "") -> set:
  """The dotted paths of the leaves of a JSON object (an empty object is
  a leaf)."""
  out = set()
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      out |= _dotted(v, f"{prefix}{k}.")
    else:
      out.add(prefix + k)
  return out


def _at(tree, path: str):
  """The value at dotted ``path`` in a nested dict, or :data:`_ABSENT`."""
  for part in path.split("."):
    tree = tree.get(part, _ABSENT) if isinstance(tree, dict) else _ABSENT
  return tree


def _topology_written(meta: dict, config: dict):
  """``topology`` as the writer stores it: the canonical name, or "" for an
  algorithm without a gossip topology (a stored "" for one with a topology
  contradicts ``config``: damage, not a changed config)."""
  from decentral_jax import topology as topology_lib  # pylint: disable=import-outside-toplevel
  algo = methods.ALGORITHMS.get(config.get("algorithm"))
  if algo is None or not isinstance(config.get("topology"), str):
    return _ABSENT
  if not algo.uses_topology:
    return ""
  try:
    return topology_lib.canonical_name(config["topology"])
  except (ValueError, KeyError):
    return _ABSENT


def _faults_written(meta: dict, config: dict):
  """``faults`` as the writer stores it: ``{}`` unless enabled, else the
  group plus the stored trace hash (not a config field)."""
  group = config.get("faults")
  if not isinstance(group, dict):
    return _ABSENT
  if not group.get("enabled"):
    return {}
  stored = meta.get("faults")
  extra = ({"trace_sha256": stored["trace_sha256"]}
           if isinstance(stored, dict) and "trace_sha256" in stored else {})
  return {**group, **extra}


def _beta_written(config: dict):
  """``beta_convention`` as written: the field for AccumAdamW with more
  than one step per window, else ``"per_window"`` (both are Adam then)."""
  opt = config.get("optimizer")
  if not isinstance(opt, dict) or not isinstance(
      opt.get("accum_steps"), int) or "beta_convention" not in opt:
    return _ABSENT
  return (opt["beta_convention"] if opt.get("name") == "accum_adamw"
          and opt["accum_steps"] > 1 else "per_window")


def _layout_written(config: dict):
  """``worker_layout`` as written: the field with several devices per
  worker, else ""."""
  dpw, mode = config.get("devices_per_worker"), config.get("worker_layout")
  if not isinstance(dpw, int) or not isinstance(mode, str):
    return _ABSENT
  return mode if dpw > 1 else ""


#: Top-level keys the writer stores transformed: key -> (the config field
#: named in a message, ``written(meta, config)``: the value it writes).
#: ``model`` is compared key by key (:data:`MODEL_FREE` and defaults left
#: out); every other top-level key that is also a config field or group
#: (a dotted path into ``config``) is a plain copy.
DERIVED_FIELDS = {
    "optimizer": ("optimizer.name", lambda m, c: _at(c, "optimizer.name")),
    "accum_steps": ("optimizer.accum_steps",
                    lambda m, c: _at(c, "optimizer.accum_steps")),
    "beta_convention": ("optimizer.beta_convention",
                        lambda m, c: _beta_written(c)),
    "topology": ("topology", _topology_written),
    "faults": ("faults", _faults_written),
    "worker_layout": ("worker_layout", lambda m, c: _layout_written(c)),
}


def _first_difference(a, b, path: str) -> str:
  """The dotted path of the first leaf where ``a`` and ``b`` differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b)):
      if a.get(k, _ABSENT) != b.get(k, _ABSENT):
        return _first_difference(a.get(k, _ABSENT), b.get(k, _ABSENT),
                                 f"{path}.{k}")
  return path


def _shown(tree, where: str) -> str:
  """The value at ``where`` (a ``_first_difference`` path) for a message."""
  value = _at(tree, where[1:]) if where else tree
  return "(absent)" if value is _ABSENT else records.short(value)


def _copies(meta: dict, config: dict):
  """``(key, config path, stored copy, the value written from config)``
  for every top-level key of ``meta`` that comes from a config field."""
  for key in sorted(meta):
    if key == "config":
      continue
    if key in DERIVED_FIELDS:
      path, written = DERIVED_FIELDS[key]
      yield key, path, meta[key], written(meta, config)
    elif key == "model" and isinstance(meta[key], dict):
      for k in sorted(meta[key]):
        yield f"model.{k}", f"model.{k}", meta[key][k], _at(config, f"model.{k}")
    else:
      yield key, key, meta[key], _at(config, key)


def _contradiction(meta: dict, config: dict) -> str | None:
  """Why a top-level copy of a config field disagrees with the stored
  ``config`` (a document that contradicts itself), or None (also without
  a ``config``: the older format). Every top-level key that is also a
  config field or group is compared (:data:`DERIVED_FIELDS` as written)."""
  if not isinstance(config, dict):
    return None
  for key, path, stored, node in _copies(meta, config):
    if node is _ABSENT or stored == node:
      continue
    where = _first_difference(stored, node, "")
    how = "derives" if key in DERIVED_FIELDS else "copies"
    return (f"{key}{where} {_shown(stored, where)} disagrees with config."
            f"{path}{where} {_shown(node, where)} (the writer {how} one "
            "from the other)")
  return None


_ABSENT = object()


def _missing_fields(stored: dict, config) -> list[str]:
  """The built-in config fields (those of the GPT and CNN base configs;
  none was added since checkpoints store the config) that this run's
  ``config`` has and ``stored`` lacks: a field deleted from the document
  would otherwise go uncompared (a resume with another value of it)."""
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  if not isinstance(config, dict):
    return []
  builtin = set().union(*(_dotted(json.loads(config_lib.base_config(m).to_json()))
                          for m in ("gpt", "cnn")))
  return sorted((_dotted(config) & builtin) - _dotted(stored))


#: Fields whose rule resolves a name against this process (a registered
#: optimizer, model or data source; an installed tracker): a stored value is
#: compared with the run's, not checked by the rule.
RESOLVED_FIELDS = ("optimizer.name", "model.name", "tracker")


def _stored_values(meta: dict) -> list:
  """``(key, field, value)`` for each stored value of a config field: the
  leaves of ``config`` (key ``config.<field>``) and the top-level keys
  that repeat a field (:data:`RESUME_FIELDS`, a method's declared fields;
  ``faults`` is ``config.faults`` or {}, plus ``trace_sha256``), less
  ``topology``: the built topology's name, "" for a method without one."""
  declared = methods.declared_fields()
  out = []
  for key, name in {**RESUME_FIELDS, **{n: n for n in declared}}.items():
    value = meta.get(key)
    if value is None or key == "topology":
      continue
    leaves = (config_leaves(value, f"{name}.") if isinstance(value, dict)
              else {name: value})
    out += [(key + f[len(name):], f, v) for f, v in leaves.items()]
  config = meta.get("config")
  if isinstance(config, dict):
    out += [(f"config.{f}", f, v) for f, v in config_leaves(config).items()]
  return out


def _rules_error(meta: dict) -> str | None:
  """Why a stored value breaks its field's rule (the per-field rules a run
  config passes: ``field_rules.RULES``, the model's ``MODEL_RULES``,
  ``FAULT_RULES`` and the methods' declared fields; not the relations
  between fields), naming the key, or None: a well-typed but impossible
  value (``n_workers`` 0, ``compression.format`` "banana") is damage, not
  a changed config."""
  model = meta.get("model")
  name = model.get("name", "gpt") if isinstance(model, dict) else "gpt"
  kind = name if name in field_rules.MODEL_RULES else "custom"
  rules = {**field_rules.RULES, **field_rules.MODEL_RULES[kind],
           **field_rules.FAULT_RULES,
           **{n: f.rule for n, f in methods.declared_fields().items()}}
  skip = RESOLVED_FIELDS + (("data.source",) if kind == "custom" else ())
  for key, field, value in _stored_values(meta):
    rule = rules.get(field)
    if rule is None or field in skip or (value == 1 and field in (
        *field_rules.UP_TO_ONE, *field_rules.FAULT_UP_TO_ONE)):
      continue
    try:
      rule(field, value)
    except ValueError as e:  # its fix (--config.<field>=) is not this one
      why = str(e).split("; ")[0]
      return why if key == f"config.{field}" else why.replace(
          f"config.{field}", key, 1)
  return None


# key -> (kind, value when absent, upper bound) of the numbers a resumed run
# reads.
_META_FIELDS = {"step": ("int", None, None),
                "data_position": ("int", None, None),
                "train_time_s": ("number", 0.0, MAX_TRAIN_TIME_S),
                "topology_round": ("int", 0, None), "n_workers": ("int", 1, None),
                "lr": ("number", 0.0, None)}


def meta_error(meta, step: int | None = None,
               like: dict | None = None) -> str | None:
  """Why ``meta`` is not the JSON document of checkpoint ``step`` (naming
  the key), or None; with ``like`` (this run's :func:`checkpoint_meta`)
  every stored field must also be of the kind this run writes
  (:func:`check_run_meta` states the rules)."""
  if not isinstance(meta, dict):
    return f"the document is a {type(meta).__name__}, not an object"
  for key, (kind, default, hi) in _META_FIELDS.items():
    why = records.value_error(key, meta.get(key, default), kind, 0, hi)
    if why:
      return why
  why = _float32_error("lr", [meta.get("lr", 0.0)])
  if why:
    return why
  if step is not None and meta["step"] != step:
    return f"its step {meta['step']} is not the checkpoint's number {step}"
  # The next batch is get_batch(data_position) and training resumes at it:
  # written as the step, any other value skips or repeats steps.
  if meta["data_position"] != meta["step"]:
    return (f"data_position must equal step {meta['step']} (the batches "
            f"consumed), got {records.short(meta['data_position'])}")
  config = meta.get("config")
  model = config.get("model") if isinstance(config, dict) else None
  signed = metrics_rules.losses_signed(
      model.get("name") if isinstance(model, dict) else None)
  return _window_error(meta.get("metrics_window"), meta["step"], signed) or (
      data_files.stored_error(meta["data_files"]) if "data_files" in meta
      else None) or (
      metrics_resume.log_schedule_error(
          meta.get(metrics_resume.SCHEDULE_KEY), meta["step"],
          meta.get("config"))) or (
      (_fields_error(meta, like) or _rules_error(meta)
       or _contradiction(meta, meta.get("config"))
       or meta_derived.window_steps_error(meta, meta.get("config"))
       or meta_derived.lr_error(meta, meta.get("config")))
      if like is not None else None)


def check_run_meta(meta, where: str, step: int | None = None,
                   like: dict | None = None) -> dict:
  """The JSON document of a training run's checkpoint, checked.

  What :func:`decentral_jax.runner.train.train_and_evaluate` reads back on
  resume: ``step`` and ``data_position`` (integers >= 0; ``step`` the
  checkpoint's number, ``data_position`` equal to it: the batches
  consumed, where training resumes), ``topology_round`` and ``n_workers``
  (integers >= 0), ``train_time_s`` (a finite number in [0,
  :data:`MAX_TRAIN_TIME_S`], optional), ``lr`` (a number in [0,
  :data:`F32_MAX`], optional) and ``metrics_window`` (null or
  ``{"losses": [numbers in [0, F32_MAX]], "accs": [numbers in [0, 1]],
  "consensus": a number in [0, F32_MAX] or null}``, at most ``step``
  values in a list: the run computes them in float32; empty at a step
  the stored config logs, else not, and ``lr`` the stored schedule's at
  ``step``: :mod:`~decentral_jax.runner.meta_derived`); ``log_schedule``
  (optional) as :func:`metrics_resume.log_schedule_error` states;
  ``data_files`` (optional) as :func:`data_files.stored_error` states. With ``like``
  the document must hold every key its format's writers write
  (:data:`CONFIG_FORMAT_KEYS`, or :data:`OLD_FORMAT_KEYS` without
  ``config``: a missing key is damage, never a field left uncompared);
  every other stored field must have the JSON kind this run writes for it
  (a string, a number, true or false, an object, recursively; null
  matches any); ``config`` must be an object holding
  :data:`CONFIG_GROUPS`; and every stored value of a config field (in
  ``config`` or repeated at the top level) must pass that field's rule
  (:func:`_rules_error`): a damaged document is never compared as a
  changed config. The values are then compared with the run's own by
  :func:`check_resumable`. A built-in config field missing inside
  ``config`` is damage too (:func:`_missing_fields`: none was added since
  checkpoints store the config).

  Args:
    meta: the document (``Checkpointer.restore_meta``).
    where: the checkpoint directory, for the message.
    step: the checkpoint's number: ``meta["step"]`` must equal it.
    like: this run's own document (:func:`checkpoint_meta`), or None.

  Returns:
    ``meta``.

  Raises:
    checkpoint.CheckpointError: one line naming the checkpoint and the key.
  """
  why = meta_error(meta, step, like)
  if why:
    raise checkpoint_lib.CheckpointError(
        f"checkpoint metadata in {where} is not valid: {why}; move that "
        "checkpoint directory away to resume from an older one, or use a "
        "fresh --workdir.")
  return meta


def meta_file(step_dir: str) -> str:
  """The file holding the JSON document of the checkpoint in ``step_dir``
  (Orbax's ``meta`` item)."""
  return os.path.join(step_dir, "meta", "metadata")


def meta_file_error(step_dir: str, step: int, like: dict) -> str | None:
  """Why the JSON document of the checkpoint in ``step_dir`` is damaged
  (:func:`meta_error`; unreadable, not JSON), naming the file and the key,
  or None: what :meth:`Checkpointer.select_restore_step
  <decentral_jax.runner.checkpoint.Checkpointer.select_restore_step>`
  treats as a corrupt checkpoint."""
  path = meta_file(step_dir)
  meta = records.read_json(path)
  if isinstance(meta, records.Damaged):
    return str(meta)
  why = meta_error(meta, step, like)
  return f"{path}: {why}" if why else None
