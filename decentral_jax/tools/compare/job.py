"""Running the main job's arms: train, keep or resume each run.

Each run's subdirectory of ``--outdir`` records its outcome
(:data:`.record.RESULT_FILE`, :mod:`.record`); :func:`arm_status` decides whether
a run is kept (finished with the same config and data), resumed (a
checkpoint of the same config) or trained from step 0; :func:`run_arm`
does one run with its directory locked, :func:`train_all` every run under
one progress bar (every run directory checked first,
:func:`check_run_dirs`). Bad data or
directories end the job: :func:`fail` prints one ``error:`` line and
raises :class:`JobExit` with the exit code (2: bad input, 3: diverged runs,
128 + signum: stopped by SIGTERM/SIGINT after saving a checkpoint).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import sys
import time

import tqdm

from decentral_jax import records
from decentral_jax.runner import data_files
from decentral_jax.runner import experiment
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import train
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools import flag_types
from decentral_jax.tools.compare import kept
from decentral_jax.tools.compare import progress as progress_lib
from decentral_jax.tools.compare import record as record_lib
from decentral_jax.tools.compare import results as results_lib
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
  """Creates the output directory once the rule of every output directory
  (:func:`~decentral_jax.tools.flag_types.check_output_dir`: not empty,
  not a file, not a dangling symbolic link, writable) accepts it.

  Raises:
    ValueError: one line naming ``--outdir``, the path and the fix.
  """
  flag_types.check_output_dir(path, "--outdir")
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


def _warn(line: str) -> None:
  """A ``warning:`` line on stderr, on a line of its own under the job's
  progress bar."""
  tqdm.tqdm.write(line, file=sys.stderr)


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
    this very config (:data:`.record.RESULT_FILE`: its final metrics, or why it
    diverged; checked by :func:`.record.read_record`, a damaged one is named in a
    ``warning:`` line and the run is not kept) trained on this config's
    data files (:func:`.record.data_mismatch`), which is kept;
    ``("resume", None)`` if it holds a checkpoint of a run of this config
    (its ``config.json``), which
    ``train_and_evaluate`` resumes; ``("fresh", why)`` otherwise: a run
    there is moved aside (:func:`run_arm`) with one ``warning:`` saying
    ``why``, None where a line here named the damage; step 0 follows.
  """
  want = json.loads(config.to_json())
  record = record_lib.read_record(workdir, want)
  # Impossible values in metrics.jsonl would outlive a resume (it keeps the
  # records up to its checkpoint): such a run is trained again.
  # So would edited records (their checksums do not match).
  redo = (isinstance(record, records.Damaged)
          and (str(record.key).endswith(record_lib.OUT_OF_RANGE)
               or record.key == record_lib.UNSIGNED))
  if isinstance(record, records.Damaged):
    if not record.missing:
      _warn(record.warning("the run is not kept: it is " + (
          "trained again." if redo else
          "resumed from its checkpoint or trained again.")))
  elif record["config"] == want:
    other_data = record_lib.data_mismatch(record, config)
    if other_data is not None:  # as train's resume: another run's data
      return "fresh", other_data
    return (("finished", record) if _whole_curve(workdir, "kept")
            else ("fresh", None))
  got = _read_config(workdir) if not redo and _has_checkpoint(workdir) else {}
  if got == want:
    return ("resume" if _whole_curve(workdir, "resumed") else "fresh"), None
  if isinstance(record, dict):
    return "fresh", (f"{record_lib.RESULT_FILE} records a finished run of "
                     "another config")
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


def run_arm(run: runs_lib.Run, config, workdir: str, fresh: bool = False,
            checkpoints: bool = True, statuses: dict | None = None):
  """Trains one arm in ``workdir``, or takes what an earlier invocation left.

  See :func:`arm_status` (``fresh``: always start at step 0). A finished
  run keeps its recorded metrics, timings included; a resumed run's
  ms/step and tokens/s are those of the steps after its checkpoint.
  Without ``checkpoints`` the run's checkpoints are deleted once its
  outcome is recorded (:func:`drop_checkpoints`), the lock still held.
  ``statuses``: if given, ``statuses[run.name]`` is set to the status,
  ``"fresh"`` once a run is set aside at resume and trained from step 0.

  The work directory is locked (``run.lock``) before anything in it is
  read or removed, so two invocations on the same ``--outdir`` cannot
  clobber each other; a directory to be replaced must be a directory, not
  a symbolic link, holding only what a run writes (:data:`.record.RUN_ENTRIES`),
  anything else is refused (and keeps no ``run.lock`` of ours).

  Returns:
    ``(final metrics or None, why it diverged or None)``; the outcome is
    recorded in ``workdir/`` :data:`.record.RESULT_FILE`.

  Raises:
    ValueError: bad data or work directory (another run holds it, or it is
      not a run directory), or an unreadable checkpoint.
    train.Preempted: stopped by SIGTERM / SIGINT after saving a checkpoint.
  """
  with workdir_lib.hold(workdir, flag="--outdir"):
    status, record = (("fresh", "replace") if fresh
                      else arm_status(workdir, config))
    note = lambda s: None if statuses is None else statuses.update(
        {run.name: s})
    note(status)
    outcome = _run_arm_held(run, config, workdir, status, record, note)
    if not checkpoints:
      drop_checkpoints(workdir)
    return outcome


def _run_arm_held(run: runs_lib.Run, config, workdir: str, status: str,
                  record, note):
  """:func:`run_arm` with ``workdir``'s lock held; ``(status, record)``
  from :func:`arm_status`; ``note(status)`` records the status the run
  really had (:func:`_train`)."""
  if status == "finished":
    print(f"== {run.label}: finished by an earlier invocation, kept "
          f"({workdir})", flush=True)
    return record["final"], record["diverged"]
  aside = None
  if status == "fresh":  # refuses a directory this project did not write
    workdir_lib.check_run_directory(workdir, record_lib.RUN_ENTRIES)
    if record != "replace" and workdir_lib.holds_entries(workdir):
      aside = set_aside(workdir)  # nothing trained is lost
      if record:  # else a line of arm_status named the damage
        _warn(f"warning: {workdir}: {record}; the run was moved to {aside} "
              "and is trained again from step 0.")
    workdir_lib.clear(workdir, record_lib.RUN_ENTRIES)
  print(f"== {run.label} -> {workdir}" + (" (resuming from its checkpoint)"
        if status == "resume" else f" (the earlier run moved to {aside})"
        if aside else ""), flush=True)
  t0 = time.perf_counter()
  final = reason = exp = None
  try:
    exp = experiment.Experiment(config)
    final = _train(config, workdir, exp, status, note)
    final.update(sent_per_step(exp))
    print(f"   val loss {final['eval/loss']:.4f}, sends "
          f"{final['comm/ratio']:.3f} x params per step, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
  except FloatingPointError as e:  # this arm diverged; the others still run
    print(f"   diverged: {e}", flush=True)
    reason = str(e)
  record_lib.write(workdir, config, final, reason, exp.data_files
                   if exp is not None else data_files.fingerprint(config))
  return final, reason


def _train(config, workdir: str, exp, status: str, note) -> dict:
  """``train_and_evaluate`` in ``workdir``. A resume its checkpoint refuses
  (a ``ValueError`` naming ``workdir/checkpoints``: another config's,
  other data, past this run's end, none intact; ``arm_status`` read only
  ``config.json``) is not bad input: the run is set aside
  (:func:`set_aside`), named in one ``warning:`` line, and trained again
  from step 0, its status ``note("fresh")``: trained now."""
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
  note("fresh")
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
    JobExit: bad data or work directories (:func:`fail`, code 2; every
      run directory is checked before the first run, :func:`check_run_dirs`),
      or stopped by SIGTERM/SIGINT (code 128 + signum).
  """
  check_run_dirs(arms, outdir)
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


def check_data_files(arms: list[runs_lib.Arm], outdir: str) -> None:
  """Before ``outdir`` is held: no run's data file (``config.data.path``)
  lies at a path the job writes, moves aside or removes in ``outdir``: a
  run's subdirectory (or one set aside, ``<run>.not_resumed*``),
  ``results.md``, a plot or ``run.lock`` (:func:`check_not_written
  <decentral_jax.runner.data_files.check_not_written>`); other files in
  ``outdir`` are left alone and may be data.

  Raises:
    ValueError: one line naming ``--config.data.path`` and ``--outdir``.
  """
  written = [workdir_lib.LOCK_FILE, "results.md", "results.md.tmp",
             *results_lib.PLOT_NAMES]
  for arm in arms:
    written += [arm.run.name, arm.run.name + ".not_resumed*"]
  for arm in arms:
    data_files.check_not_written(arm.config, outdir, written, "--outdir")


def check_run_dirs(arms: list[runs_lib.Arm], outdir: str) -> None:
  """Before any run trains: every run's subdirectory of ``outdir`` that
  exists must be a run directory (:func:`check_run_directory
  <decentral_jax.runner.workdir.check_run_directory>` with
  :data:`.record.RUN_ENTRIES`): a directory, not a symbolic link (dangling or
  not), holding only what a run writes.

  Raises:
    JobExit: the first that is not, in one ``error:`` line (code 2).
  """
  for arm in arms:
    path = os.path.join(outdir, arm.run.name)
    try:
      if os.path.lexists(path):
        workdir_lib.check_run_directory(path, record_lib.RUN_ENTRIES)
    except (ValueError, OSError) as e:
      fail(f"run {arm.run.name!r} ({arm.run.label}): " + (
          str(e) if isinstance(e, ValueError) else
          f"cannot read {path}: {e.strerror or e}."))


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
