"""A run's signed record in its subdirectory of ``--outdir``.

:data:`RESULT_FILE` holds ``{"config": its config, "final": its final
metrics or null, "diverged": why it diverged or null, "data_files": the
fingerprint of the data files it read}``; :func:`write` writes and signs
it, :func:`read_record` reads it back checked (its values, its
``metrics.jsonl`` and its ``SHA256SUMS``), and :func:`data_mismatch` says
whether it was trained on this invocation's data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from decentral_jax import checks
from decentral_jax import records
from decentral_jax.runner import data_files as data_files_lib
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import metrics_rules
from decentral_jax.runner import tmpfile
from decentral_jax.runner import train
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools.compare import kept

# A run's outcome in its subdirectory (module docstring).
RESULT_FILE = "compare_result.json"
_NUMBER = ("number", None, None, False)
_COUNT = ("number", 0.0, None, False)
# A kept run's evaluation values, each in metrics_rules.value_range (a
# cross-entropy loss >= 0 and an accuracy a fraction; any finite number for
# a model of your own).
EVAL_KEYS = ("eval/loss", "eval/accuracy", "eval/worker_excess_mean",
             "eval/worker_excess_max")
# The final metrics a kept run's results use (others are kept unchecked);
# the final eval/* values must equal the last evaluation (_eval_error).
FINAL_SCHEMA = {"eval/loss": _NUMBER, "eval/worker_excess_mean": _NUMBER,
                "eval/worker_excess_max": _NUMBER,
                "consensus_distance": _COUNT, "comm/ratio": _COUNT,
                "comm/bytes_per_step": _COUNT, "step_time_ms": _COUNT,
                "tokens_per_sec": _COUNT, "samples_per_sec": _COUNT,
                "eval/accuracy": _NUMBER}
RESULT_SCHEMA = {
    "config": ("object", None, None, False),
    "final": (records.Obj(FINAL_SCHEMA, tuple(FINAL_SCHEMA)[:4], extra=True),
              None, None, True),
    "diverged": ("str", None, None, True),
    "data_files": ("object", None, None, False)}
# Everything a run's subdirectory may hold (besides run.lock).
RUN_ENTRIES = (*train.RUN_FILES, RESULT_FILE, RESULT_FILE + ".tmp",
               workdir_lib.SUMS_FILE, workdir_lib.SUMS_FILE + ".tmp")
# The records of a run that its SHA256SUMS covers (:func:`sign`).
SIGNED = (RESULT_FILE, metrics_lib.METRICS_FILE)
UNSIGNED = "SHA256SUMS"  # the key of a record its SHA256SUMS does not match


def _outcome_error(record: dict):
  """A record is either finished (``final``) or diverged, not both."""
  if (record["final"] is None) == (record["diverged"] is None):
    return "final", ("exactly one of \"final\" and \"diverged\" must be "
                     f"null, got {records.short(record['final'])} and "
                     f"{records.short(record['diverged'])}")
  return None


def read_record(workdir: str, want: dict | None = None
                ) -> dict | records.Damaged:
  """A run's :data:`RESULT_FILE`, checked: ``config`` an object, ``final``
  null or an object with finite :data:`FINAL_SCHEMA` numbers (the first
  four required), ``diverged`` null or a string, exactly one of the two
  null, ``data_files`` an object if there (:func:`data_mismatch` checks
  it); and, for a finished run of the config ``want`` (any config if
  None), a ``metrics.jsonl`` with a finite ``eval/loss`` curve ending at
  the run's last step, every evaluation value of :data:`EVAL_KEYS` in its
  range, the final ``eval/*`` values those of its last evaluation, and
  the final metrics and every row of ``metrics.jsonl`` possible
  (:func:`.kept.final_error`, :func:`.kept.metrics_error`), every other
  final value that ``metrics.jsonl`` records its last row's
  (:func:`.kept.final_rows_error`), and a diverged run's reason naming a
  step of the run that its rows neither pass nor evaluate finitely at or
  after (:func:`.kept.diverged_error`). Otherwise
  :class:`~decentral_jax.records.Damaged` naming the file and the key
  (``.missing`` if :data:`RESULT_FILE` does not exist). A record of the
  config ``want`` whose values pass is then checked against the
  ``SHA256SUMS`` the run wrote when it finished (:func:`sign`): a missing
  manifest, or a record edited, truncated or damaged since, is damage too
  (key ``"SHA256SUMS"``)."""
  record = _read_values(workdir, want)
  if (isinstance(record, records.Damaged)
      or want is not None and record["config"] != want):
    return record
  state, why = workdir_lib.check_sums(workdir, required=SIGNED)
  return record if state == "ok" else records.Damaged(
      os.path.join(workdir, workdir_lib.SUMS_FILE),
      why + " (the record was changed since the run finished)"
      if state == "corrupt" else why, key=UNSIGNED)


def _read_values(workdir: str, want: dict | None
                 ) -> dict | records.Damaged:
  """:func:`read_record` but the checksums."""
  path = os.path.join(workdir, RESULT_FILE)
  record = records.read_json(path, RESULT_SCHEMA,
                             tuple(RESULT_SCHEMA)[:3], check=_outcome_error)
  if (isinstance(record, records.Damaged)
      or want is not None and record["config"] != want):
    return record
  curve = metrics_lib.read_curve(os.path.join(workdir,
                                              metrics_lib.METRICS_FILE))
  if record["final"] is None:  # diverged: what it evaluated must be possible
    return (record if isinstance(curve, records.Damaged)
            else _eval_error(workdir, {}, curve)
            or _rows_error(workdir, record["config"])
            or _against_rows(workdir, record) or record)
  if isinstance(curve, records.Damaged):  # a missing one is damage here
    return dataclasses.replace(curve, missing=False)
  steps = record["config"].get("steps")
  if checks.is_number(steps) and curve[0][-1] != steps:
    how = "cut short" if curve[0][-1] < steps else "longer than the run"
    return records.Damaged(
        os.path.join(workdir, metrics_lib.METRICS_FILE),
        f"its 'eval/loss' curve ends at step {float(curve[0][-1]):g}, "
        f"not at the run's last step {records.short(steps)} ({how})",
        key="eval/loss")
  return (_eval_error(workdir, record["final"], curve)
          or _final_error(workdir, record)
          or _rows_error(workdir, record["config"])
          or _against_rows(workdir, record) or record)


def _final_error(workdir: str, record: dict) -> records.Damaged | None:
  """:func:`.kept.final_error` of a finished run's record, as damage."""
  got = kept.final_error(record["final"], record["config"])
  return None if got is None else records.Damaged(
      os.path.join(workdir, RESULT_FILE), f"final.{got[1]}",
      key=f"final.{got[0]}")


def _rows_error(workdir: str, config: dict) -> records.Damaged | None:
  """:func:`.kept.metrics_error` of a run's metrics.jsonl (read whole by
  ``read_curve`` already), as damage that a resume would keep."""
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  got = records.read_jsonl(path)
  why = None if isinstance(got, records.Damaged) else kept.metrics_error(
      got.records, config)
  return None if why is None else records.Damaged(
      path, why, key="row" + OUT_OF_RANGE)


def _against_rows(workdir: str, record: dict) -> records.Damaged | None:
  """A record that contradicts its run's metrics.jsonl, as damage: a final
  value other than the last row's (:func:`.kept.final_rows_error`), or a
  divergence at a step the rows go past (:func:`.kept.diverged_error`)."""
  got = records.read_jsonl(os.path.join(workdir, metrics_lib.METRICS_FILE))
  if isinstance(got, records.Damaged):
    return None
  path = os.path.join(workdir, RESULT_FILE)
  if record["final"] is None:
    why = kept.diverged_error(record["diverged"], got.records,
                               record["config"])
    return None if why is None else records.Damaged(path, why,
                                                    key="diverged")
  bad = kept.final_rows_error(record["final"], got.records)
  return None if bad is None else records.Damaged(
      path, f"final.{bad[1]}", key=f"final.{bad[0]}")


OUT_OF_RANGE = " out of range"  # the key of a value out of its range


def _eval_error(workdir: str, final: dict, loss_curve
                ) -> records.Damaged | None:
  """Why a finished run's evaluations are not to be kept: a value of
  ``metrics.jsonl`` outside :func:`metrics_rules.value_range` (signed for
  a model of your own), or a final ``eval/*``
  value of :data:`RESULT_FILE` other than the last evaluation's."""
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  last = loss_curve[0][-1]
  signed = metrics_rules.workdir_losses_signed(workdir)
  for key in EVAL_KEYS:
    lo, hi = metrics_rules.value_range(key, signed)
    curve = (loss_curve if key == "eval/loss" else
             metrics_lib.read_curve(path, key))
    if isinstance(curve, records.Damaged):  # not evaluated
      if final.get(key) is not None and "excess" not in key:
        return records.Damaged(
            os.path.join(workdir, RESULT_FILE),
            f"final.{key} is {records.short(final[key])}, but {path} has no "
            f"{key} evaluation", key=f"final.{key}")
      continue
    why = records.series_range_error(*curve, key, lo, hi)
    if why:
      return records.Damaged(path, why, key=key + OUT_OF_RANGE)
    got = final.get(key)
    if got is not None and (curve[0][-1] != last or not math.isclose(
        got, curve[1][-1], rel_tol=1e-9, abs_tol=1e-12)):
      return records.Damaged(
          os.path.join(workdir, RESULT_FILE),
          f"final.{key} is {records.short(got)}, but the last evaluation in "
          f"{path} (step {float(last):g}) has {key} "
          + (f"{float(curve[1][-1])!r}" if curve[0][-1] == last else "none"),
          key=f"final.{key}")
  return None


def write(workdir: str, config, final, reason, data: dict) -> None:
  """Writes the run's :data:`RESULT_FILE` (``data``: the fingerprint of
  its data files, :func:`decentral_jax.runner.data_files.fingerprint`,
  stored as ``data_files``) through its ``.tmp`` name
  (:func:`decentral_jax.runner.tmpfile.replace`: a link or FIFO left there
  is removed, never followed nor opened), then signs it (:func:`sign`)."""
  path = os.path.join(workdir, RESULT_FILE)
  try:
    os.makedirs(workdir, exist_ok=True)
    tmpfile.replace(path, json.dumps(
        {"config": json.loads(config.to_json()), "final": final,
         "diverged": reason, "data_files": data}, indent=1))
    sign(workdir)
  except OSError as e:
    raise ValueError(f"cannot write {path}: {e.strerror or e}.") from None


def sign(workdir: str) -> None:
  """Writes ``workdir/SHA256SUMS`` over the run's :data:`SIGNED` records
  that exist (``sha256sum -c SHA256SUMS`` checks it), so that a kept
  run's record is tamper-evident like a checkpoint."""
  rels = [os.path.relpath(os.path.join(here, name), workdir)
          for here, _, names in os.walk(workdir) for name in names]
  workdir_lib.write_sums(workdir, skip=[r for r in rels if r not in SIGNED])


def data_mismatch(record: dict, config) -> str | None:
  """Why a finished run's ``record`` (:func:`read_record`) was not trained
  on the data files of ``config`` (``config.data.path``), as train's
  resume decides (:func:`decentral_jax.runner.data_files.resume_mismatch`:
  size and SHA-256 of the first and last MiB of each file), or None. A
  record without ``data_files`` (written before it was stored) is not
  trusted either: its run is trained again once.

  Raises:
    ValueError: a data file of ``config`` cannot be read (named).
  """
  theirs = record.get("data_files")
  if theirs is None:
    return (f"{RESULT_FILE} records no fingerprint of the data the run "
            "read (written before it was stored)")
  why = data_files_lib.stored_error(theirs)
  if why is None:
    why = data_files_lib.resume_mismatch(theirs, data_files_lib.fingerprint(
        config), where="the recorded run")
  return None if why is None else (
      f"{RESULT_FILE} records a run trained on other data than this run's "
      f"config.data.path={config.data.get('path')!r} ({why})")
