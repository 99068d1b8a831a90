"""The training loop: ``train_and_evaluate(config, workdir)``.

Drives an :class:`~decentral_jax.runner.experiment.Experiment` in a work directory:
``metrics.jsonl`` (one record per log or eval point), ``config.json``,
Orbax checkpoints with bit-exact resumption, a progress bar and a
non-finite-loss guard (the bookkeeping: :mod:`decentral_jax.runner.recorder`;
the checkpoint's run facts: :mod:`decentral_jax.runner.run_meta`). At most
two steps are in flight: the host reads step
``t-1``'s metrics after dispatching step ``t``, and prepares the next batch
while the device trains.

Multi-host: every process calls :func:`train_and_evaluate` with the same
config and work directory; all processes train, evaluate and write their
shards of each checkpoint, while metrics, logging and the progress bar come
from process 0 only.

Faults: the work directory is locked for the run
(:mod:`decentral_jax.runner.workdir`); the newest checkpoint is verified before it
is restored (:mod:`decentral_jax.runner.checkpoint`; a corrupt one falls back to
the previous one); a failed background save stops the run at the next step
with one line naming the checkpoint step, the directory and the OS error.
SIGTERM or SIGINT stops the run after the current step with a checkpoint
(:class:`Preempted`; the signals: :mod:`decentral_jax.runner.preemption`);
in a multi-process job JAX's preemption service (which receives SIGTERM
there) picks one step at which every process saves.
"""

from __future__ import annotations

import logging
import os
import signal

import jax
from ml_collections import config_dict

from decentral_jax import parallel
from decentral_jax.parallel import multiprocess
from decentral_jax.runner import builders
from decentral_jax.runner import checkpoint as checkpoint_lib
from decentral_jax.runner import data_files
from decentral_jax.runner import earlier_run
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import preemption
from decentral_jax.runner import recorder as recorder_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.runner.experiment import Experiment

#: What a run writes in its work directory, besides ``run.lock`` (names or
#: shell patterns: the damaged logs set aside are numbered).
RUN_FILES = ("config.json", metrics_lib.METRICS_FILE,
             metrics_lib.METRICS_FILE + ".tmp",
             metrics_lib.CORRUPT_FILE + "*",
             metrics_lib.METRICS_FILE + earlier_run.SUFFIX + "*",
             earlier_run.CONFIG_FILE + earlier_run.SUFFIX + "*",
             "checkpoints", "tensorboard",
             *metrics_lib.TRACKER_FILES)


class Preempted(Exception):
  """The run stopped on a signal after saving a checkpoint.

  Attributes:
    step: completed steps; the checkpoint of this step is committed.
    signum: the signal (``signal.SIGTERM`` in a multi-process job, where
      JAX's preemption service receives it).
    directory: the checkpoint directory.
    exit_code: ``128 + signum`` (143 for SIGTERM, 130 for SIGINT), the
      status a shell reports for a process killed by that signal.
  """

  def __init__(self, step: int, signum: int, directory: str):
    self.step, self.signum, self.directory = step, signum, directory
    self.exit_code = 128 + int(signum)
    super().__init__(
        f"stopped by {signal.Signals(signum).name} after step {step}; "
        f"checkpoint {step} is saved in {directory}: run the same command "
        "again to resume.")


def _resume(exp: Experiment, ckpt: checkpoint_lib.Checkpointer, main: bool):
  """(state, start step, earlier training seconds, the checkpoint's
  document or None)."""
  like = run_meta.checkpoint_meta(exp, 0)  # the kinds of each field
  step = ckpt.select_restore_step(lambda s: run_meta.meta_file_error(
      ckpt.step_dir(s), s, like))
  if step is None:
    return exp.init_state(), 0, 0.0, None
  steps = int(exp.config.steps)
  if step > steps:  # a longer run's checkpoint: nothing of it is this run
    raise ValueError(
        f"checkpoint {step} in {ckpt.directory} is past the end of this run "
        f"(config.steps={steps}); set --config.steps={step} or more to "
        "resume it, or use a fresh --workdir.")
  where = ckpt.step_dir(step)
  state = exp.init_state()
  run_meta.check_resumable(
      exp, run_meta.check_run_meta(ckpt.restore_meta(step), where, step, like),
      ckpt.directory)
  try:
    state, meta = ckpt.restore(step, state)  # the document checked above
  except checkpoint_lib.CheckpointError:
    raise
  except ValueError as e:  # e.g. a different optimizer-state structure
    raise ValueError(
        f"cannot resume from {ckpt.directory} (step {step}): its state does "
        f"not match this config (a changed grad_clip, optimizer, "
        f"outer_optimizer, num_fragments or model field?); resume with the "
        f"original config or use a fresh --workdir. Orbax: "
        f"{str(e).splitlines()[0].rstrip(': ')}") from None
  if main and step == steps:
    logging.info("checkpoint %d in %s is the last step (config.steps=%d): "
                 "the run already finished; evaluating it, nothing to "
                 "train.", step, ckpt.directory, steps)
  elif main:
    logging.info("resumed from %s at step %d", ckpt.step_dir(step), step)
  return (state, int(meta["data_position"]),
          float(meta.get("train_time_s", 0.0)), meta)


def _write_config(workdir: str, c: config_dict.ConfigDict) -> None:
  path = os.path.join(workdir, "config.json")
  why = workdir_lib.not_regular_error(path)  # a FIFO blocks the open
  if why:
    raise ValueError(f"{path} {why}; move it away (the run writes its "
                     "own) and run again.")
  try:
    with open(path, "w", encoding="utf-8") as f:
      f.write(c.to_json(indent=2))
  except OSError as e:
    raise workdir_lib.path_error("write", path, e) from None


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str, *,
                       experiment: Experiment | None = None) -> dict:
  """Trains ``config`` in ``workdir``, resuming from its last checkpoint.

  Writes ``metrics.jsonl`` (one record per log or eval point), ``config.json``
  and ``checkpoints/<step>/`` (every worker's parameters and optimizer state,
  the step, the data position, RNG keys and the losses since the last log
  record; every ``checkpoint_interval`` steps, at the end, on SIGTERM and
  before a batch that cannot be read).
  A resumed run continues bit-exactly: same batches, same dropout keys, same
  gossip round, same logged losses. A fresh start (no checkpoint) moves an
  earlier run's ``metrics.jsonl`` and ``config.json`` aside as
  ``<name>.earlier`` with one ``warning:`` line
  (:mod:`decentral_jax.runner.earlier_run`; a log of exactly this config
  is redone from step 0).

  The work directory is locked for the duration (``run.lock``, see
  :mod:`decentral_jax.runner.workdir`); the newest checkpoint is verified before it
  is restored and a corrupt one falls back to the previous one (see
  :mod:`decentral_jax.runner.checkpoint`). A batch that cannot be read (a
  data source that raises, or gives other shapes than step 0's) stops the
  run before that step, after a checkpoint of the steps trained so far (one
  process; a ValueError naming the source, the step and the checkpoint).
  On SIGTERM or SIGINT the run finishes
  the current step, saves a checkpoint of it, waits until it is committed,
  releases the lock and raises :class:`Preempted`. In a multi-process job
  SIGTERM reaches JAX's preemption service, and every process stops after
  the same step (the first step after the fastest process's current one).

  In a multi-process job
  (:func:`decentral_jax.runner.launch.initialize_from_config`) every process
  calls this with the same config and work directory (shared by all hosts):
  all processes train, evaluate and write their shards of each checkpoint
  (Orbax), while ``metrics.jsonl``, ``config.json``, logging and the
  progress bar come from process 0 only. A checkpoint is restored by a job
  with the same number of processes and devices per process.

  Args:
    config: a run config (``configs/*.py``).
    workdir: output directory (created if missing).
    experiment: an :class:`~decentral_jax.runner.experiment.Experiment` built
      from ``config`` to
      reuse (its compiled steps); built here if None.

  Returns:
    Final metrics (floats): ``step``, ``train/loss``, ``eval/loss``,
    ``eval/worker_loss_*``, ``consensus_distance``, ``step_time_ms`` (mean
    over the timed steps of this invocation; the first step, which compiles,
    is not timed, and evaluation and checkpoint time is excluded),
    ``tokens_per_sec`` (or ``samples_per_sec``), ``train_time_s`` and
    ``param_count``.

  Raises:
    ValueError: bad config or data, a data file at a path the run writes
      in ``workdir`` (:func:`~decentral_jax.runner.data_files.check_not_written`
      with :data:`RUN_FILES` and ``run.lock``; refused before anything is
      written), a batch that cannot be read (the
      steps before it are checkpointed first; see
      :class:`~decentral_jax.runner.experiment.Experiment`), or a
      checkpoint in ``workdir`` from an incompatible config or past
      ``config.steps`` (a checkpoint of step ``config.steps`` is a finished
      run: it is evaluated, nothing is trained).
    workdir.WorkdirInUse: another run holds ``workdir`` (names it).
    workdir.PathError: ``workdir`` or a file in it cannot be written (a
      read-only file system, a full disk); names the path.
    checkpoint.CheckpointError: no intact checkpoint, or one that cannot
      be read; :class:`~decentral_jax.runner.checkpoint.CheckpointWriteError`: a
      save failed (names the step, directory and OS error). Both are
      ``ValueError`` subclasses.
    FloatingPointError: a non-finite loss or parameter; names the step and
      workers; the last good checkpoint stays in place.
    Preempted: stopped by SIGTERM / SIGINT; the checkpoint of
      ``Preempted.step`` is committed.
  """
  c = config
  if experiment is not None and experiment.config is not c and \
      experiment.config.to_dict() != c.to_dict():
    raise ValueError("train_and_evaluate: `experiment` was built from a "
                     "different config; pass experiment=None.")
  # Before the lock: run.lock too would replace a data file at its path.
  data_files.check_not_written(c, workdir, (*RUN_FILES,
                                            workdir_lib.LOCK_FILE))
  with workdir_lib.hold(workdir), preemption.StopRequest() as stop:
    exp = experiment if experiment is not None else Experiment(c)
    # Leaving the block waits for the last save (and raises if it failed).
    with checkpoint_lib.Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=int(c.keep_checkpoints)) as ckpt:
      return _loop(c, workdir, exp, ckpt, stop)


def _start_records(c, workdir: str, exp: Experiment, start: int,
                   meta: dict | None) -> None:
  """Process 0, before the first step: config.json, metrics, a log line."""
  if meta is None:  # a fresh start keeps an earlier run's records aside
    earlier_run.keep_earlier_records(c, workdir)
  # Written only once the run is known to be valid (a rejected resume must
  # not overwrite the record of the original run).
  _write_config(workdir, c)
  # Records logged after the restored checkpoint are about to be redone.
  meta = meta or {}
  resume_metrics(workdir, start, meta.get("config"),
                 meta.get(metrics_resume.SCHEDULE_KEY),
                 run_meta.logged_at_checkpoint(meta))
  logging.info("%s: %d workers on %d process(es), %s params/worker, %d "
               "%s/step, mesh %s", _method_words(c), exp.n_workers,
               jax.process_count(), f"{exp.param_count:,}",
               exp.tokens_per_step, exp.unit, parallel.mesh_shape(exp.mesh))


def resume_metrics(workdir: str, start: int, written=None,
                   schedule=None, at_step: dict | None = None) -> None:
  """``metrics.truncate_after`` by the rules of ``written`` (the
  checkpoint's stored config, or None), its log ``schedule`` (the
  document's history, or None) and what it fixes of its step's record
  (``at_step``: :func:`run_meta.logged_at_checkpoint`, or None); a damaged
  metrics.jsonl (a log, not the state the run resumes from; also the log
  of another run, or no regular file) is moved aside
  (``metrics.jsonl.corrupt``), and the run writes a fresh file from
  ``start`` on: at ``start`` == 0 (a fresh run) with one ``warning:`` line
  on stderr saying so, after a resume with one logged warning naming the
  records kept in the moved file."""
  try:
    metrics_lib.truncate_after(workdir, start, written, schedule, at_step)
  except metrics_lib.MetricsError as e:
    moved = metrics_lib.set_aside(workdir)
    # "PATH is a directory", "PATH, line 3: ..."
    what = e.path + (" " if e.reason.startswith("is ") else ", ") + e.reason
    if start == 0:
      earlier_run.warn(
          f"{what}; this fresh run (no checkpoint to resume) moved it to "
          f"{moved} and writes its own {metrics_lib.METRICS_FILE}.")
    else:  # logged, as the resume's other warnings about its log
      logging.warning(
          "%s; moved it to %s, and the resumed run writes a fresh %s from "
          "step %d on (the records up to step %d stay in the moved file).",
          what, moved, metrics_lib.METRICS_FILE, start + 1, start)


def _method_words(c) -> str:
  """``config.algorithm`` and its runtime-model spec (topology, messages,
  compression, pipelining), e.g. ``decentralized (dadam:topology=...,
  compress=int8,block=256,pipelined=1)``; the algorithm alone if the
  method has no spec."""
  try:
    return f"{c.algorithm} ({builders.spec_for_config(c)[0]})"
  except (ValueError, AttributeError, TypeError):
    return str(c.algorithm)


def _preempted(done: int, stop: preemption.StopRequest,
               ckpt: checkpoint_lib.Checkpointer, main: bool) -> Preempted:
  """Waits for checkpoint ``done`` to be committed; the exception to raise."""
  if main:
    logging.warning("%s received: waiting for checkpoint %d to be "
                    "committed, then stopping.",
                    signal.Signals(stop.signum).name, done)
  ckpt.wait()
  return Preempted(done, stop.signum, ckpt.directory)


def _next_batch(exp: Experiment, step: int):
  """``(batch of step, None)``, or ``(None, message)`` where reading it
  failed (a ValueError of the task: the loop saves the state of ``step``
  first). In a multi-process job the error is raised here: a save on the
  one failing process would wait for the others."""
  try:
    return exp.get_batch(step), None
  except ValueError as e:
    if jax.process_count() > 1:
      raise
    return None, str(e).rstrip(".")


def _read_failure(failed: str, done: int,
                  ckpt: checkpoint_lib.Checkpointer) -> ValueError:
  """Waits for checkpoint ``done`` to be committed; the error to raise."""
  ckpt.wait()
  return ValueError(f"{failed}; checkpoint {done} is saved in "
                    f"{ckpt.directory}: fix the data source and run the "
                    "same command again to resume.")


def _loop(c, workdir: str, exp: Experiment, ckpt: checkpoint_lib.Checkpointer,
          stop: preemption.StopRequest) -> dict:
  """The body of :func:`train_and_evaluate` (lock held, ``ckpt`` open).

  At most two steps are in flight: step ``s - 1``'s metrics are read while
  step ``s`` runs, except before an evaluation or a checkpoint.
  """
  total = int(c.steps)
  main = multiprocess.is_main_process()
  state, start, time_offset, meta = _resume(exp, ckpt, main)
  window_state = (meta or {}).get("metrics_window")
  restored = (meta or {}).get(metrics_resume.SCHEDULE_KEY)
  if main:
    _start_records(c, workdir, exp, start, meta)
  eval_every, ckpt_every = int(c.eval_interval), int(c.checkpoint_interval)
  log_every = int(c.log_interval)
  history = metrics_resume.schedule_history(
      restored, start, log_every, eval_every, float(c.schedule.peak_lr),
      metrics_resume.field((meta or {}).get("config"), "steps"))
  with recorder_lib.Recorder(exp, ckpt, c, workdir, start, time_offset,
                             window_state, main, history) as recorder:
    if start == 0 and eval_every:  # the common starting point of all runs
      recorder.record(0, exp.evaluate(state))
    pending = None
    batch = exp.get_batch(start) if start < total else None
    stop.begin(start)
    for s in range(start, total):
      ckpt.poll()  # a failed background save stops the run here
      state, device_metrics = exp.train_step(state, batch, s)
      done = s + 1
      if pending is not None:  # read step s-1 while step s runs
        recorder.read(*pending)
        if pending[0] % log_every == 0:
          recorder.record_log_step(pending[0])
      pending = (done, device_metrics)
      stopping = done < total and stop.requested(done)
      failed = None
      if done < total and not stopping:  # host prepares the next batch
        batch, failed = _next_batch(exp, done)
      do_eval = done == total or (eval_every and done % eval_every == 0)
      do_ckpt = stopping or failed or done == total or (
          ckpt_every and done % ckpt_every == 0)
      if do_eval or do_ckpt:
        recorder.read(*pending)
        pending = None
        if do_eval:
          recorder.record(done, exp.evaluate(state))
        elif done % log_every == 0:
          recorder.record_drained(done, state)
        if do_ckpt:
          ckpt.save(done, state, recorder.checkpoint_meta(done))
        recorder.restart_clock()
      if stopping:
        raise _preempted(done, stop, ckpt, main)
      if failed:
        raise _read_failure(failed, done, ckpt)
    if start >= total:  # nothing left to train: report the final evaluation
      recorder.last.update(exp.evaluate(state))
  return recorder.final()
