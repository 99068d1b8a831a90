"""The JSON files of a checkpoint Orbax reads, checked before Orbax reads them.

Orbax stops on a damaged one with its own message naming no file
("Metadata dict must be a dictionary, but got list", "Object must be of
type <class 'dict'>, got <class 'list'>"), before the runner could fall
back to an older checkpoint. :func:`json_files_error` names the file and
the field instead, so the checkpoint is damage
(:func:`decentral_jax.runner.checkpoint_files.check_checkpoint`) and moved aside.
The run's own document (``meta/metadata``) is checked key by key
elsewhere (:func:`decentral_jax.runner.run_meta.meta_file_error`).
"""

from __future__ import annotations

import glob
import os

from decentral_jax import records

#: Files each holding a JSON object at the top level; globs relative to the
#: step directory.
JSON_FILES = ("_CHECKPOINT_METADATA", os.path.join("state", "_METADATA"),
              os.path.join("state", "_sharding"),
              os.path.join("state", "array_metadatas", "process_*"))
#: The fields of ``_CHECKPOINT_METADATA`` (Orbax's step metadata, written
#: after the checksums: not summed) Orbax reads, each absent, null or of
#: these JSON types.
STEP_FIELDS = {"item_handlers": (dict, str), "metrics": (dict,),
               "performance_metrics": (dict,), "custom_metadata": (dict,),
               "init_timestamp_nsecs": (int,),
               "commit_timestamp_nsecs": (int,)}
_JSON_NAMES = {dict: "object", str: "string", int: "integer",
               float: "number", list: "array", bool: "boolean"}


def _step_fields_error(doc: dict) -> str | None:
  """Why Orbax's step metadata ``doc`` breaks a rule Orbax reads it by."""
  for key, kinds in STEP_FIELDS.items():
    value = doc.get(key)
    if value is not None and not isinstance(value, kinds):
      want = " or ".join(("an " if _JSON_NAMES[k][0] in "aeiou" else "a ")
                         + _JSON_NAMES[k] for k in kinds)
      return (f"field {key!r} holds a JSON "
              f"{_JSON_NAMES.get(type(value), type(value).__name__)}, not "
              f"{want}")
  extra = sorted(set(doc) - set(STEP_FIELDS))
  if extra and doc.get("custom_metadata"):  # Orbax files it there
    return (f"unknown field {records.short(extra[0])} beside a non-empty "
            "custom_metadata")
  return None


def json_files_error(root: str) -> str | None:
  """Why a JSON file of the checkpoint in ``root`` is damaged (unreadable,
  not JSON, not an object at the top level, or, for ``_CHECKPOINT_METADATA``,
  a field of :data:`STEP_FIELDS` of another type), naming it, or None; a
  file left out is not (not every Orbax version writes each)."""
  for pattern in JSON_FILES:
    for path in sorted(glob.glob(os.path.join(glob.escape(root), pattern))):
      name = os.path.relpath(path, root)
      got = records.read_json(path)
      if isinstance(got, records.Damaged):
        if not got.missing:
          return f"{name} unreadable ({got.reason})"
      elif not isinstance(got, dict):
        return (f"{name} holds a JSON {type(got).__name__}, not an object "
                "(the file is damaged)")
      elif name == "_CHECKPOINT_METADATA" and _step_fields_error(got):
        return f"{name}: {_step_fields_error(got)} (the file is damaged)"
  return None
