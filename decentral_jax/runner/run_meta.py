"""What a checkpoint records about its run, and whether a run may resume it.

A checkpoint's JSON document (:func:`checkpoint_meta`) holds the step and
data position, the training time and the metrics since the last log record
(written by :func:`decentral_jax.runner.train.train_and_evaluate`), the
config fields a resumed run must keep and the worker layout it ran on. On
resume :func:`check_run_meta` checks the document's types and ranges
against one schema (:mod:`decentral_jax.runner.meta_schema`;
:func:`meta_file_error` makes a damaged one a corrupt
checkpoint, so an older one is used),
:func:`check_elastic_resume` the number of workers (the layout may change:
elastic resume) and :func:`check_resumable` every other field.
Checkpoints of older versions lack some fields (``RESUME_DEFAULTS``) and
the layout (:func:`saved_layout` reads their top-level keys), and still
resume (``tests/runner/test_checkpoint_compat.py``).
"""

from __future__ import annotations

import json
import logging
import math

import jax
from ml_collections import config_dict

from decentral_jax import parallel
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import data_files
from decentral_jax.runner import fault_run
from decentral_jax.runner import field_rules
from decentral_jax.runner import methods
from decentral_jax.runner import validation
# The document's schema and checks, read by the runner through this module.
from decentral_jax.runner.meta_schema import MODEL_DEFAULTS
from decentral_jax.runner.meta_schema import MODEL_FREE
from decentral_jax.runner.meta_schema import RESUME_DEFAULTS
from decentral_jax.runner.meta_schema import RESUME_FIELDS
from decentral_jax.runner.meta_schema import RESUME_FREE
from decentral_jax.runner.meta_schema import check_run_meta
from decentral_jax.runner.meta_schema import config_leaves
from decentral_jax.runner.meta_schema import meta_error
from decentral_jax.runner.meta_schema import meta_file
from decentral_jax.runner.meta_schema import meta_file_error



def model_meta(model: dict) -> dict:
  """The fields of a ``model`` group (a dict) a resumed run must keep: less
  :data:`MODEL_FREE` and less the fields of :data:`MODEL_DEFAULTS` at their
  default, so that a run with the defaults stores what older versions
  stored."""
  return {k: v for k, v in model.items()
          if k not in MODEL_FREE and MODEL_DEFAULTS.get(k, ()) != v}


def checkpoint_meta(exp, step: int) -> dict:
  """JSON facts stored with a checkpoint of ``exp`` taken after ``step`` steps.

  Args:
    exp: the run's :class:`~decentral_jax.runner.experiment.Experiment`.
    step: completed training steps (int >= 0).

  Returns:
    A JSON-serialisable dict: the step and data position, the config
    fields a resume must keep (:func:`check_resumable`), the worker layout
    the state was written on, under ``"layout"`` where the workers ran
    (:func:`worker_layout_meta`) and under ``"config"`` the whole config.
  """
  c = exp.config
  return {
      "step": int(step),
      "data_position": int(step),  # the next batch is get_batch(step)
      "seed": int(c.seed),
      "n_workers": exp.n_workers,
      "workers_per_node": int(c.workers_per_node),
      "algorithm": c.algorithm,
      "topology": exp.topology.name if exp.topology else "",
      "topology_round": (int(step) % exp.topology.period
                         if exp.topology else 0),
      "optimizer": c.optimizer.name,
      "accum_steps": int(c.optimizer.accum_steps),
      # With one step per window both conventions are Adam.
      "beta_convention": (c.optimizer.beta_convention
                          if c.optimizer.name == "accum_adamw"
                          and int(c.optimizer.accum_steps) > 1
                          else "per_window"),
      "global_batch": int(c.global_batch),
      # The schedule's learning rate at this step (a resume compares it).
      "lr": float(builders.make_schedule(c)(int(step))),
      "model": model_meta(json.loads(c.model.to_json())),
      # The sync schedule of the local-update methods (a change mid-run
      # would silently move the sync steps).
      "sync_every": int(c.sync_every),
      "gossip_every": int(c.gossip_every),
      "num_fragments": int(c.num_fragments),
      "overlap_steps": int(c.overlap_steps),
      "merge_alpha": float(c.merge_alpha),
      "outer_overlap": c.outer_overlap,
      "outer_latency": int(c.outer_latency),
      "trickle_reduction": bool(c.trickle_reduction),
      "outer_optimizer": json.loads(c.outer_optimizer.to_json()),
      "comm_dtype": c.comm_dtype,
      # What is sent and how (format, block, error feedback, CHOCO's step).
      "compression": json.loads(c.compression.to_json()),
      # How a worker lies on its devices (the restored state's layout).
      "devices_per_worker": exp.layout.devices_per_worker,
      "workers_per_device": exp.workers_per_device,
      "worker_layout": (exp.layout.mode
                        if exp.layout.devices_per_worker > 1 else ""),
      # The fault schedule and rules ({} without config.faults.enabled).
      "faults": fault_run.resume_meta(c, exp.faults),
      # Size and SHA-256 of the ends of each data file (data_files).
      "data_files": exp.data_files,
      # Where the workers ran (informative: a resume may change it).
      "layout": worker_layout_meta(exp),
      # The registered methods' own fields (Method.config_fields).
      **{name: field_rules.field(c, name)
         for name in methods.declared_fields()},
      # Every field: those not above, less RESUME_FREE, must keep their value.
      "config": json.loads(c.to_json()),
  }


def logged_at_checkpoint(meta: dict | None) -> dict | None:
  """What the checkpoint document ``meta`` fixes of its step's metrics
  record (the invocation that saved it wrote that record):
  ``{"lr": its stored config's schedule at the update of that step,
  "train_time_s": the document's}``, a value None where the document does
  not say (an older one, a stored config without a schedule); None for no
  document. Learning rate as the recorder logs it (float32 schedule value
  in a float), seconds cumulative."""
  if not meta:
    return None
  step, lr = int(meta.get("step", 0)), None
  try:
    config = config_dict.ConfigDict(meta["config"])
    lr = float(builders.make_schedule(config)(max(step, 1) - 1))
  except (KeyError, TypeError, ValueError, AttributeError):
    pass  # an older document: lr not known
  return {"lr": lr, "train_time_s": meta.get("train_time_s")}


def worker_layout_meta(exp) -> dict:
  """Where the workers of ``exp`` run, as :func:`describe_layout` reads it:
  ``processes``, ``devices`` (all processes'), ``devices_per_worker``,
  ``workers_per_device`` and ``worker_layout`` ("" with one device per
  worker)."""
  return {"processes": jax.process_count(),
          "devices": int(parallel.device_mesh(exp.mesh).devices.size),
          "devices_per_worker": exp.layout.devices_per_worker,
          "workers_per_device": exp.workers_per_device,
          "worker_layout": (exp.layout.mode
                            if exp.layout.devices_per_worker > 1 else "")}


def check_resumable(exp, meta: dict, directory: str) -> None:
  """Raises ValueError if a checkpoint was written by a run incompatible with
  ``exp`` (an :class:`~decentral_jax.runner.experiment.Experiment`).

  The worker layout may differ (elastic resume: another process count,
  ``devices_per_worker``, ``workers_per_device`` or ``worker_layout``
  with the same ``n_workers``); a different ``n_workers`` is refused
  first, saying why (:func:`check_elastic_resume`). The memory controls
  ``micro_batches`` and ``model.remat`` may change too (the same step up
  to float32 rounding), and so may the fields of :data:`RESUME_FREE`;
  any other field of the stored ``config`` that differs is refused, and so
  are data files other than the checkpoint's (``data_files``: size and
  SHA-256 of the first and last MiB of each,
  :mod:`~decentral_jax.runner.data_files`; a checkpoint without it is not
  compared).
  Fields the run does not read are not compared. A top-level key an older
  format lacks counts as its value in ``RESUME_DEFAULTS`` (a method's own
  declared field: its ``ConfigField.default``); a key its format requires
  was checked present (:func:`check_run_meta`), as was every built-in
  field of the stored ``config``; a field beyond those (a config file's
  own) missing there counts as its
  :func:`~decentral_jax.runner.config.base_config` default, never as
  uncompared.

  Args:
    exp: this run.
    meta: the checkpoint's JSON document (:func:`check_run_meta`).
    directory: the checkpoint directory, for the messages.

  Raises:
    ValueError: the first field that differs, named with both values;
      other data, naming ``config.data.path`` and the first file that
      differs.
  """
  mine = checkpoint_meta(exp, meta.get("step", 0))
  check_elastic_resume(meta, mine, directory)
  declared = methods.declared_fields()
  defaults = {**RESUME_DEFAULTS, **{n: f.default for n, f in declared.items()}}
  for key, field in {**RESUME_FIELDS, **{n: n for n in declared}}.items():
    if validation.unread_reason(exp.config, field) is not None:
      continue  # ignored by this run (its algorithm is compared)
    theirs = meta[key] if key in meta else defaults.get(key)
    if key == "model" and isinstance(theirs, dict):
      theirs = model_meta(theirs)
    if key == "faults":  # the trace by content; names the setting
      why = fault_run.resume_mismatch(
          theirs, mine[key], validation.unread_fault_keys(exp.config))
      if why is not None:
        raise ValueError(
            f"the checkpoint in {directory} was written with {why}; resume "
            "with the same settings and trace or use a fresh --workdir.")
      continue
    if theirs != mine[key]:
      field, theirs, ours = _first_difference(field, theirs, mine[key])
      raise ValueError(
          f"the checkpoint in {directory} was written with config.{field}="
          f"{_shown(field, theirs)} but this run has {_shown(field, ours)}; "
          "resume with the same value or use a fresh --workdir.")
  _check_other_fields(exp.config, meta.get("config"), mine["config"],
                      directory)
  why = data_files.resume_mismatch(meta.get("data_files"), mine["data_files"])
  if why is not None:
    raise ValueError(
        f"the checkpoint in {directory} was trained on other data than this "
        f"run's config.data.path={exp.config.data.get('path')!r} ({why}); "
        "resume with the original data (a moved copy of it resumes) or use "
        "a fresh --workdir.")
  _warn_changed_lr(meta, mine, directory)


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _covered(field: str, groups) -> bool:
  return any(field == g or field.startswith(g + ".") for g in groups)


def _check_other_fields(config, theirs, mine: dict, directory: str) -> None:
  """Refuses a changed config field that :data:`RESUME_FIELDS` does not
  name and :data:`RESUME_FREE` does not free (e.g. ``optimizer.b1``,
  ``grad_clip``, ``data.val_fraction``: each changes what the restored
  state trains on or how). A checkpoint without ``config`` (the older
  format) is not compared; a field its ``config`` lacks (added since)
  counts as its ``base_config`` default, never as uncompared; a field this
  run does not read is not compared (it keeps its default)."""
  if not isinstance(theirs, dict):
    return
  checked = (*RESUME_FREE, *RESUME_FIELDS.values(),
             *methods.declared_fields())
  changed = _changed_leaf(config, theirs, mine, checked)
  if changed is not None:
    raise ValueError(
        f"the checkpoint in {directory} was written with config.{changed[0]}"
        f"={changed[1]!r} but this run has {changed[2]!r}; resume with the "
        "same value or use a fresh --workdir.")


def _changed_leaf(config, theirs: dict, mine: dict, free) -> tuple | None:
  """``(field, stored value, this run's)`` of the first leaf of ``mine``
  that differs in ``theirs`` (a missing one counts as its ``base_config``
  default), less the fields under ``free`` and those ``config`` does not
  read; None if there is none."""
  base = config_lib.base_config(config.model.get("name", "gpt"))
  old = {**config_leaves(json.loads(base.to_json())),
         **config_leaves(theirs)}
  for field, ours in config_leaves(mine).items():
    if field not in old or old[field] == ours or _covered(field, free) \
        or validation.unread_reason(config, field) is not None:
      continue
    return field, old[field], ours
  return None


def config_change(config, stored: dict) -> tuple | None:
  """The first field by which the stored config ``stored`` (a run's
  ``config.json``, a dict) is another config than ``config`` by the
  resume rule (:func:`check_resumable`): every field but those of
  :data:`RESUME_FREE` must keep its value (a field ``stored`` lacks
  counts as its ``base_config`` default; one ``config`` does not read is
  not compared).

  Returns:
    ``(dotted field, stored value, this config's value)``, or None when a
    run of ``stored`` may resume as ``config``.
  """
  if not isinstance(stored, dict):
    raise TypeError(f"config_change: stored must be a dict, got "
                    f"{type(stored).__name__}")
  return _changed_leaf(config, stored, json.loads(config.to_json()),
                       RESUME_FREE)


def _warn_changed_lr(meta: dict, mine: dict, directory: str) -> None:
  """Logs one line when this config's schedule gives another learning rate
  at the checkpoint's step than the run that wrote it (``config.steps`` or
  ``config.schedule`` changed: allowed, e.g. to extend a run)."""
  theirs = meta.get("lr")
  if not _number(theirs) or math.isclose(theirs, mine["lr"], rel_tol=1e-5,
                                         abs_tol=1e-12):
    return
  logging.warning(
      "the learning rate at step %d was %.4g in the run that wrote the "
      "checkpoint in %s and is %.4g with this config (config.steps or "
      "config.schedule changed); training continues on this config's "
      "schedule.", int(meta.get("step", 0)), theirs, directory, mine["lr"])


def _shown(field: str, value) -> str:
  """``value`` for a message; a ``model`` field :func:`model_meta` left out
  at its default (:data:`MODEL_DEFAULTS`) is shown as that default."""
  name = field[len("model."):] if field.startswith("model.") else None
  if value is None and name in MODEL_DEFAULTS:
    return f"{MODEL_DEFAULTS[name]} (the default)"
  return repr(value)


def _first_difference(field: str, theirs, ours) -> tuple:
  """For a group (a dict), its first member that differs, by name."""
  if isinstance(theirs, dict) and isinstance(ours, dict):
    for k in sorted(set(theirs) | set(ours)):
      if theirs.get(k) != ours.get(k):
        return _first_difference(f"{field}.{k}", theirs.get(k), ours.get(k))
  return field, theirs, ours


# -- elastic resume ------------------------------------------------------------

_LAYOUT_KEYS = ("devices_per_worker", "workers_per_device", "worker_layout")


def _count(v) -> int | None:
  return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 \
      else None


def saved_layout(meta: dict) -> dict:
  """The worker layout a checkpoint was written on, from its JSON document.

  Reads ``meta["layout"]`` (``processes``, ``devices``,
  ``devices_per_worker``, ``workers_per_device``, ``worker_layout``);
  checkpoints written before it existed give what their top-level keys
  say (``devices_per_worker`` 1 and ``workers_per_device`` 1 if absent;
  the process and device counts are then unknown, None). A value of the
  wrong type (a hand-edited file) counts as unknown: the layout is only
  reported, never used to read the state.
  """
  layout = meta.get("layout")
  layout = layout if isinstance(layout, dict) else {}
  out = {}
  for key in ("processes", "devices") + _LAYOUT_KEYS[:2]:
    out[key] = _count(layout.get(key, meta.get(key)))
  for key in _LAYOUT_KEYS[:2]:
    if key not in layout and key not in meta:
      out[key] = 1
  mode = layout.get("worker_layout", meta.get("worker_layout", ""))
  out["worker_layout"] = mode if isinstance(mode, str) else None
  return out


def _plural(k, word: str) -> str:
  return f"{k} {word}" + ("" if k == 1 else "es" if word.endswith("s")
                          else "s")


def describe_layout(layout: dict) -> str:
  """One phrase for a layout (:func:`saved_layout`), e.g. ``"2 processes x
  4 devices, 1 worker per device"`` or ``"1 process x 2 devices x 4
  workers per device"``; ``devices`` counts the devices of all processes."""
  procs, devices = layout.get("processes"), layout.get("devices")
  d, k = layout.get("devices_per_worker"), layout.get("workers_per_device")
  if procs and devices:
    head = f"{_plural(procs, 'process')} x {_plural(devices // procs, 'device')}"
  else:
    head = "an unrecorded number of processes and devices"
  if k is None or d is None:
    return f"{head}, unrecorded workers per device"
  if k > 1:
    return f"{head} x {k} workers per device"
  if d > 1:
    mode = f" ({layout['worker_layout']})" if layout.get("worker_layout") \
        else ""
    return f"{head}, {d} devices per worker{mode}"
  return f"{head}, 1 worker per device"


def _same_layout(a: dict, b: dict) -> bool:
  keys = ("processes", "devices") + _LAYOUT_KEYS
  return all(a.get(k) is None or b.get(k) is None or a[k] == b[k]
             for k in keys)


def check_elastic_resume(saved: dict, mine: dict, where: str) -> bool:
  """Checks that a checkpoint can be resumed on this run's worker layout.

  Elastic resume: every leaf of the checkpointed state is a global
  ``[n_workers, ...]`` array (worker ``i``'s row is worker ``i``'s
  parameters, optimizer state, step and dropout key wherever it ran), so
  the same ``n_workers`` may resume on any layout (process count, devices
  per process, ``devices_per_worker``, ``workers_per_device``,
  ``worker_layout``): Orbax reads each row onto the device that now holds
  that worker. The state continues bit for bit; the new layout's steps
  may round differently from the old one's (another reduction order).

  Args:
    saved: the checkpoint's JSON document (``n_workers``, ``layout``).
    mine: this run's (:func:`checkpoint_meta`).
    where: the checkpoint directory, for the messages.

  Returns:
    True if the layout changes (logged on process 0), False if not.

  Raises:
    ValueError: another number of workers, in one line saying why it
      cannot change and what to run instead.
  """
  n, n_mine = saved.get("n_workers"), mine["n_workers"]
  if n is not None and n != n_mine:
    hint, devices = "", saved_layout(mine)["devices"]
    if isinstance(n, int) and n > 0 and devices and n % devices == 0:
      hint = (f", e.g. on this run's {devices} device(s) with "
              f"--config.workers_per_device={n // devices}")
    raise ValueError(
        f"the checkpoint in {where} holds {n} workers (each its own "
        f"parameters, optimizer state, data shard and place in the "
        f"topology, stacked [{n}, ...]) but this run has config.n_workers="
        f"{n_mine}; a resume may change the layout (processes, "
        "devices_per_worker, workers_per_device) but not the number of "
        "workers, since there is no exact way to merge or split their "
        f"states: resume with --config.n_workers={n}{hint}, or use a fresh "
        "--workdir.")
  old, new = saved_layout(saved), saved_layout(mine)
  if _same_layout(old, new):
    return False
  if jax.process_index() == 0:
    logging.info("elastic resume: the checkpoint in %s was written on %s; "
                 "resuming its %d workers on %s.", where,
                 describe_layout(old), n_mine, describe_layout(new))
  return True
