"""Running the main job's arms: train, keep or resume each run.

Each run's subdirectory of ``--outdir`` records its outcome
(:data:`RESULT_FILE`); :func:`arm_status` decides whether a run is kept
(finished with the same config), resumed (a checkpoint of the same config)
or trained from step 0; :func:`run_arm` does one run with its directory
locked, :func:`train_all` every run under one progress bar. Bad data or
directories end the job: :func:`fail` prints one ``error:`` line and
raises :class:`JobExit` with the exit code (2: bad input, 3: diverged runs,
128 + signum: stopped by SIGTERM/SIGINT after saving a checkpoint).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import signal
import sys
import time

import tqdm

from decentral_jax import checks
from decentral_jax import records
from decentral_jax.runner import experiment
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import tmpfile
from decentral_jax.runner import metrics_rules
from decentral_jax.runner import train
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools.compare import kept
from decentral_jax.tools.compare import progress as progress_lib
from decentral_jax.tools.compare import runs as runs_lib


class JobExit(Exception):
  """The job ends with exit code ``code`` (its message already printed)."""

  def __init__(self, code: int):
    super().__init__(code)
    self.code = int(code)


def fail(message, code: int = 2) -> None:
  """One ``error:`` line on stderr, then :class:`JobExit` (2: bad input,
  3: diverged)."""
  print(f"error: {message}", file=sys.stderr)
  raise JobExit(code)


def make_outdir(path: str) -> str:
  """Creates the output directory; ValueError naming it if that fails."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"--outdir {path!r} is a file, not a directory; pass a "
                     "directory (it is created if missing).")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--outdir {path!r} cannot be created: "
                     f"{e.strerror or e}.") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"--outdir {path!r} is not writable.")
  return path


def sent_per_step(exp: experiment.Experiment) -> dict[str, float]:
  """``comm/bytes_per_step`` and ``comm/ratio`` of ``exp``'s train step."""
  comm = exp.communication(exp.init_state(), exp.get_batch(0))
  return {"comm/bytes_per_step": comm["bytes_per_step"],
          "comm/ratio": comm["ratio"]}


# A run's outcome in its subdirectory: {"config": its config, "final": its
# final metrics or null, "diverged": why it diverged or null}.
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
    "diverged": ("str", None, None, True)}
# Everything a run's subdirectory may hold (besides run.lock).
RUN_ENTRIES = (*train.RUN_FILES, RESULT_FILE, RESULT_FILE + ".tmp",
               workdir_lib.SUMS_FILE, workdir_lib.SUMS_FILE + ".tmp")
# The records of a run that its SHA256SUMS covers (:func:`sign`).
SIGNED = (RESULT_FILE, metrics_lib.METRICS_FILE)
_UNSIGNED = "SHA256SUMS"  # the key of a record its SHA256SUMS does not match


def _warn(line: str) -> None:
  """A ``warning:`` line on stderr, on a line of its own under the job's
  progress bar."""
  tqdm.tqdm.write(line, file=sys.stderr)


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
  null; and, for a finished run of the config ``want`` (any config if
  None), a ``metrics.jsonl`` with a finite ``eval/loss`` curve ending at
  the run's last step, every evaluation value of :data:`EVAL_KEYS` in its range, the
  final ``eval/*`` values those of its last evaluation, and the final
  metrics and every row of ``metrics.jsonl`` possible
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
      if state == "corrupt" else why, key=_UNSIGNED)


def _read_values(workdir: str, want: dict | None
                 ) -> dict | records.Damaged:
  """:func:`read_record` but the checksums."""
  path = os.path.join(workdir, RESULT_FILE)
  record = records.read_json(path, RESULT_SCHEMA, tuple(RESULT_SCHEMA),
                             check=_outcome_error)
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
      path, why, key="row" + _OUT_OF_RANGE)


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


_OUT_OF_RANGE = " out of range"  # the key of a value out of its range


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
      return records.Damaged(path, why, key=key + _OUT_OF_RANGE)
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


def _read_config(workdir: str):
  """A run's ``config.json`` (an object), or a
  :class:`decentral_jax.records.Damaged` (missing or damaged)."""
  return records.read_json(os.path.join(workdir, "config.json"), {},
                           extra=True)


def _has_checkpoint(workdir: str) -> bool:
  ckpts = os.path.join(workdir, "checkpoints")
  return os.path.isdir(ckpts) and any(x.isdigit() for x in os.listdir(ckpts))


def arm_status(workdir: str, config) -> tuple[str, dict | str | None]:
  """What an invocation does with a run's subdirectory ``workdir``.

  Returns:
    ``("finished", record)`` if ``workdir`` holds the outcome of a run of
    this very config (:data:`RESULT_FILE`: its final metrics, or why it
    diverged; checked by :func:`read_record`, a damaged one is named in a
    ``warning:`` line and the run is not kept), which is kept;
    ``("resume", None)`` if it holds a checkpoint of a run of this config
    (its ``config.json``), which
    ``train_and_evaluate`` resumes; ``("fresh", why)`` otherwise: a run
    there is moved aside (:func:`run_arm`) with one ``warning:`` saying
    ``why``, None where a line here named the damage; step 0 follows.
  """
  want = json.loads(config.to_json())
  record = read_record(workdir, want)
  # Impossible values in metrics.jsonl would outlive a resume (it keeps the
  # records up to its checkpoint): such a run is trained again.
  # So would edited records (their checksums do not match).
  redo = (isinstance(record, records.Damaged)
          and (str(record.key).endswith(_OUT_OF_RANGE)
               or record.key == _UNSIGNED))
  if isinstance(record, records.Damaged):
    if not record.missing:
      _warn(record.warning("the run is not kept: it is " + (
          "trained again." if redo else
          "resumed from its checkpoint or trained again.")))
  elif record["config"] == want:
    return (("finished", record) if _whole_curve(workdir, "kept")
            else ("fresh", None))
  got = _read_config(workdir) if not redo and _has_checkpoint(workdir) else {}
  if got == want:
    return ("resume" if _whole_curve(workdir, "resumed") else "fresh"), None
  if isinstance(record, dict):
    return "fresh", f"{RESULT_FILE} records a finished run of another config"
  if isinstance(got, records.Damaged) and not got.missing:
    return "fresh", f"its checkpoint is not resumed ({got})"
  held = record.missing and workdir_lib.holds_entries(workdir)
  return "fresh", "it holds no checkpoint of this config" if held else None


def _whole_curve(workdir: str, use: str) -> bool:
  """Whether the run's curve is whole (:func:`curve_error`); else one
  ``warning:`` line saying the run is not ``use`` (kept, resumed) but
  trained again from step 0."""
  why = curve_error(workdir)
  if why is not None:
    _warn(f"warning: {workdir}: {why}; the run is not {use}: it is trained "
          "again from step 0.")
  return why is None


def curve_error(workdir: str) -> str | None:
  """Why a run's ``metrics.jsonl`` cannot give its whole curve (the
  results' targets and times read it), or None: a damaged file
  (:class:`decentral_jax.runner.metrics.MetricsError`), which a resume
  would set aside, or a log set aside before
  (:data:`decentral_jax.runner.metrics.CORRUPT_FILE`: the records
  before the resume are not in ``metrics.jsonl``)."""
  if glob.glob(glob.escape(os.path.join(workdir, metrics_lib.CORRUPT_FILE))
               + "*"):
    return (f"a damaged log was set aside as {metrics_lib.CORRUPT_FILE}, so "
            f"{metrics_lib.METRICS_FILE} lacks the records before its resume")
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  if not os.path.exists(path):
    return None
  try:
    metrics_lib.read_jsonl(path)
  except metrics_lib.MetricsError as e:
    return f"{metrics_lib.METRICS_FILE} is damaged ({e.reason})"
  return None


def _record(workdir: str, config, final, reason) -> None:
  """Writes the run's :data:`RESULT_FILE` through its ``.tmp`` name
  (:func:`decentral_jax.runner.tmpfile.replace`: a link or FIFO left there
  is removed, never followed nor opened), then signs it (:func:`sign`)."""
  path = os.path.join(workdir, RESULT_FILE)
  try:
    os.makedirs(workdir, exist_ok=True)
    tmpfile.replace(path, json.dumps(
        {"config": json.loads(config.to_json()), "final": final,
         "diverged": reason}, indent=1))
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


def run_arm(run: runs_lib.Run, config, workdir: str, fresh: bool = False,
            checkpoints: bool = True, statuses: dict | None = None):
  """Trains one arm in ``workdir``, or takes what an earlier invocation left.

  See :func:`arm_status` (``fresh``: always start at step 0). A finished
  run keeps its recorded metrics, timings included; a resumed run's
  ms/step and tokens/s are those of the steps after its checkpoint.
  Without ``checkpoints`` the run's checkpoints are deleted once its
  outcome is recorded (:func:`drop_checkpoints`), the lock still held.
  ``statuses``: if given, ``statuses[run.name]`` is set to the status.

  The work directory is locked (``run.lock``) before anything in it is
  read or removed, so two invocations on the same ``--outdir`` cannot
  clobber each other; a directory to be replaced must be a directory, not
  a symbolic link, holding only what a run writes (:data:`RUN_ENTRIES`),
  anything else is refused (and keeps no ``run.lock`` of ours).

  Returns:
    ``(final metrics or None, why it diverged or None)``; the outcome is
    recorded in ``workdir/`` :data:`RESULT_FILE`.

  Raises:
    ValueError: bad data or work directory (another run holds it, or it is
      not a run directory), or an unreadable checkpoint.
    train.Preempted: stopped by SIGTERM / SIGINT after saving a checkpoint.
  """
  with workdir_lib.hold(workdir, flag="--outdir"):
    status, record = (("fresh", "replace") if fresh
                      else arm_status(workdir, config))
    if statuses is not None:
      statuses[run.name] = status
    outcome = _run_arm_held(run, config, workdir, status, record)
    if not checkpoints:
      drop_checkpoints(workdir)
    return outcome


def _run_arm_held(run: runs_lib.Run, config, workdir: str, status: str,
                  record):
  """:func:`run_arm` with ``workdir``'s lock held; ``(status, record)``
  from :func:`arm_status`."""
  if status == "finished":
    print(f"== {run.label}: finished by an earlier invocation, kept "
          f"({workdir})", flush=True)
    return record["final"], record["diverged"]
  aside = None
  if status == "fresh":  # refuses a directory this project did not write
    workdir_lib.check_run_directory(workdir, RUN_ENTRIES)
    if record != "replace" and workdir_lib.holds_entries(workdir):
      aside = set_aside(workdir)  # nothing trained is lost
      if record:  # else a line of arm_status named the damage
        _warn(f"warning: {workdir}: {record}; the run was moved to {aside} "
              "and is trained again from step 0.")
    workdir_lib.clear(workdir, RUN_ENTRIES)
  print(f"== {run.label} -> {workdir}" + (" (resuming from its checkpoint)"
        if status == "resume" else f" (the earlier run moved to {aside})"
        if aside else ""), flush=True)
  t0 = time.perf_counter()
  final = reason = None
  try:
    exp = experiment.Experiment(config)
    final = _train(config, workdir, exp, status)
    final.update(sent_per_step(exp))
    print(f"   val loss {final['eval/loss']:.4f}, sends "
          f"{final['comm/ratio']:.3f} x params per step, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  except FloatingPointError as e:  # this arm diverged; the others still run
    print(f"   diverged: {e}", flush=True)
    reason = str(e)
  _record(workdir, config, final, reason)
  return final, reason


def _train(config, workdir: str, exp, status: str) -> dict:
  """``train_and_evaluate`` in ``workdir``. A resume its checkpoint refuses
  (a ``ValueError`` naming ``workdir/checkpoints``: another config's, past
  this run's end, none intact; ``arm_status`` read only ``config.json``)
  is not bad input: the run is set aside (:func:`set_aside`), named in one
  ``warning:`` line, and trained again from step 0."""
  try:
    return train.train_and_evaluate(config, workdir, experiment=exp)
  except ValueError as e:
    ckpts = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if status != "resume" or ckpts not in str(e):
      raise
    why = str(e).split("; ")[0].rstrip(".")
    aside = set_aside(workdir)
    _warn(f"warning: {workdir}: its checkpoint is not resumed ({why}); the "
          f"run was moved to {aside} and is trained again from step 0.")
  return train.train_and_evaluate(config, workdir, experiment=exp)


def set_aside(workdir: str) -> str:
  """Moves every entry of the run directory ``workdir`` but its (held)
  lock into a new sibling ``<workdir>.not_resumed`` (``.not_resumed.2``,
  ... if taken) and returns its path: nothing a run trained is deleted.
  Raises ValueError: the directory cannot be made or an entry moved."""
  aside, k = workdir + ".not_resumed", 1
  while os.path.lexists(aside):
    k += 1
    aside = f"{workdir}.not_resumed.{k}"
  try:
    os.makedirs(aside)
    for name in sorted(os.listdir(workdir)):
      if name != workdir_lib.LOCK_FILE:
        os.replace(os.path.join(workdir, name), os.path.join(aside, name))
  except OSError as e:
    raise ValueError(f"cannot move {workdir} aside to {aside}: "
                     f"{e.strerror or e}; move it away yourself and run "
                     "again.") from None
  return aside


def preempted_message(e: train.Preempted, run: runs_lib.Run, done, rest,
                      fresh: bool = False) -> str:
  """What was saved when ``run`` stopped, and what the same command does
  next (``done``: the runs before it, ``rest``: those after it)."""
  names = lambda runs: ", ".join(r.name for r in runs)
  again = ("the same command without --fresh" if fresh else
           "the same command")
  return (f"run {run.name!r} stopped by {signal.Signals(e.signum).name} "
          f"after step {e.step}; checkpoint {e.step} is saved in "
          f"{e.directory}. Run {again} again to go on: it keeps the finished "
          f"runs ({names(done) or 'none'}), resumes {run.name!r} from step "
          f"{e.step}" + (f" and then trains {names(rest)}" if rest else "")
          + ".")


def drop_checkpoints(workdir: str) -> None:
  """Deletes a finished run's checkpoints (its outcome is recorded)."""
  shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)


def train_all(arms: list[runs_lib.Arm], outdir: str, checkpoints: bool,
              fresh: bool = False):
  """Trains (or keeps, or resumes) every arm under one progress bar, then
  trains again every kept or resumed run whose values disagree with those
  the other runs of its group must share (:func:`.kept.disagreeing`: the
  step-0 evaluation loss of one seed, the parameter count, the
  communication figures of one method), each named in a ``warning:``
  line.

  Returns:
    ``(finals, diverged)``: final metrics or None per arm, and
    ``[(run, reason)]``.

  Raises:
    JobExit: bad data or work directories (:func:`fail`, code 2), or
      stopped by SIGTERM/SIGINT (code 128 + signum).
  """
  outcomes, statuses = [], {}
  progress = progress_lib.JobProgress(arms)
  for k, arm in enumerate(arms):
    progress.start(k + 1, arm)
    outcomes.append(_train_one(arms, k, outdir, checkpoints, fresh, progress,
                               statuses))
    progress.finish(k + 1)
  for _ in range(2):  # a run trained again is trusted: one more pass settles
    again = kept.disagreeing(
        _shared_facts(arms, outcomes, outdir),
        {a.run.name for a in arms if statuses.get(a.run.name) == "fresh"})
    for k, arm in enumerate(arms):
      if arm.run.name in again:
        _warn(f"warning: {os.path.join(outdir, arm.run.name)}: "
              f"{again[arm.run.name]}; the run is not kept: it is trained "
              "again.")
        progress.bar.total += int(arm.config.steps)
        progress.start(k + 1, arm)
        outcomes[k] = _train_one(arms, k, outdir, checkpoints, fresh,
                                 progress, statuses, again=True)
  progress.close()
  finals = [final for final, _ in outcomes]
  diverged = [(a.run, reason) for a, (_, reason) in zip(arms, outcomes)
              if reason is not None]
  return finals, diverged


def _train_one(arms, k: int, outdir: str, checkpoints: bool, fresh: bool,
               progress, statuses: dict, again: bool = False):
  """:func:`run_arm` of ``arms[k]`` under the job's progress bar (``again``:
  from step 0, whatever ``fresh``); its status (``arm_status``'s first
  value) goes to ``statuses[run name]``."""
  arm = arms[k]
  runs = [a.run for a in arms]
  try:
    with progress.attach():
      return run_arm(arm.run, arm.config, os.path.join(outdir, arm.run.name),
                     fresh or again, checkpoints, statuses)
  except ValueError as e:  # bad data or work directory: all runs share it
    progress.close()
    fail(f"run {arm.run.name!r} ({arm.run.label}): {e}")
  except train.Preempted as e:  # SIGTERM/SIGINT: stop, 128 + signum
    progress.close()
    print("preempted: " + preempted_message(
        e, arm.run, runs[:k], runs[k + 1:], fresh), file=sys.stderr)
    raise JobExit(e.exit_code) from None


def _shared_facts(arms, outcomes, outdir: str) -> dict[str, dict]:
  """Each run's values of :data:`.kept.SHARED`, for
  :func:`.kept.disagreeing`: the step-0 ``eval/loss`` of its
  metrics.jsonl (if it evaluated at step 0) and its final metrics'."""
  facts = {}
  for arm, (final, _) in zip(arms, outcomes):
    curve = metrics_lib.read_curve(os.path.join(
        outdir, arm.run.name, metrics_lib.METRICS_FILE))
    step0 = (None if isinstance(curve, records.Damaged) or curve[0][0] != 0
             else float(curve[1][0]))
    facts[arm.run.name] = {
        "seed": arm.seed, "method": arm.method.name, "job": 0,
        "step-0 eval/loss": step0,
        **{k: (final or {}).get(k) for k, *_ in kept.SHARED[1:]}}
  return facts


def diverged_message(diverged, n_runs: int, results: str) -> str:
  """The exit-3 line: which runs diverged (``[(run, reason)]`` of
  ``n_runs``) and where the results are (``results``: results.md)."""
  why = "; ".join(f"{run.name!r} ({run.label}): {str(reason).rstrip('.')}"
                  for run, reason in diverged)
  if len(diverged) < n_runs:
    return (f"{len(diverged)} of {n_runs} runs diverged: {why}; the other "
            f"runs' results are in {results}.")
  return (f"all {n_runs} runs diverged: {why}; no run finished, so there is "
          f"no answer ({results} lists the divergences).")
