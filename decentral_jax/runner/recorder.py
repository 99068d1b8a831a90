"""The training loop's bookkeeping: step metrics, timing, records, progress.

:class:`Recorder` reads each step's metrics to the host (stopping a run
whose loss or parameters are not finite: :func:`non_finite_error`), keeps
the losses since the last log record in a :class:`Window`, writes the log
and eval records (``metrics.jsonl`` on process 0,
:class:`~decentral_jax.runner.metrics.MetricsWriter`), draws the progress
bar and times the steps; what a checkpoint keeps of it lets a resumed run
log the same losses.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from ml_collections import config_dict

from decentral_jax.parallel import multiprocess
from decentral_jax.runner import checkpoint as checkpoint_lib
from decentral_jax.runner import methods
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import run_meta


class Window:
  """Accumulates host-side training metrics between two log records."""

  def __init__(self):
    self.losses, self.times, self.accs = [], [], []
    self.consensus = None
    self.counters = {}

  def add(self, metrics: dict, seconds: float | None) -> None:
    # Means over the workers in float64: finite float32 losses near the
    # float32 limit keep a finite mean.
    self.losses.append(float(np.mean(np.asarray(metrics["loss"],
                                                np.float64))))
    if "accuracy" in metrics:
      self.accs.append(float(np.mean(np.asarray(metrics["accuracy"],
                                                np.float64))))
    if seconds is not None:
      self.times.append(seconds)
    if "consensus_distance" in metrics:
      cd = float(np.asarray(metrics["consensus_distance"]).reshape(-1)[0])
      if np.isfinite(cd):
        self.consensus = cd
    # Counters equal on all workers (optim.elastic): the latest value.
    self.counters = {k: int(np.asarray(v).reshape(-1)[0])
                     for k, v in metrics.items() if k.startswith("faults/")}

  def state(self) -> dict:
    """What a checkpoint keeps, so a resumed run logs the same losses."""
    return {"losses": self.losses, "accs": self.accs,
            "consensus": self.consensus}

  @classmethod
  def from_state(cls, state: dict | None) -> "Window":
    window = cls()
    if state:
      window.losses = [float(x) for x in state.get("losses", [])]
      window.accs = [float(x) for x in state.get("accs", [])]
      window.consensus = state.get("consensus")
    return window

  def summary(self, units_per_step: int, unit: str) -> dict:
    out = {}
    if self.losses:
      out["train/loss"] = float(np.mean(self.losses))
    if self.accs:
      out["train/accuracy"] = float(np.mean(self.accs))
    if self.consensus is not None:
      out["consensus_distance"] = self.consensus
    out.update(self.counters)
    if self.times:
      sec = float(np.mean(self.times))
      out["step_time_ms"] = 1e3 * sec
      out[f"{unit}_per_sec"] = units_per_step / sec
    return out


#: The cause of a non-finite loss taken before any parameter update.
BEFORE_ANY_UPDATE = (
    "No parameter update had been applied yet (the loss is taken at the "
    "initial parameters), so the learning rate and the gradient clip play "
    "no part: the model's init overflows or gives NaN/inf parameters, or "
    "the data holds NaN/inf (or values that overflow the loss); check them.")


def _fields_at_fault(c, initial: bool = False) -> str:
  """The fields most likely at fault for a non-finite loss, with their
  values: the peak learning rate, the outer learning rate (a method with
  an outer optimizer), the factors of the inner learning rate (Muon's,
  with MuLoCo) and the gradient clip; :data:`BEFORE_ANY_UPDATE` where
  the loss was taken before any update (``initial``)."""
  if initial:
    return BEFORE_ANY_UPDATE
  if c is None:
    return "Lower config.schedule.peak_lr or enable config.grad_clip."
  peak, clip = float(c.schedule.peak_lr), float(c.grad_clip)
  read = methods.lookup(c.algorithm).fields
  outer = "".join(
      f", config.{f} (now {float(c[f.split('.')[0]][f.split('.')[1]]):g})"
      for f in ("muon.consistent_rms", "muon.adam_lr_ratio",
                "outer_optimizer.lr") if f in read)
  outer = f"{outer}, " if outer else " "
  return (f"Lower config.schedule.peak_lr (now {peak:g}){outer}or "
          + ("enable config.grad_clip (now 0: off)." if clip == 0 else
             f"lower config.grad_clip (now {clip:g})."))


def non_finite_error(step: int, metrics: dict,
                     ckpt: checkpoint_lib.Checkpointer,
                     c=None, bad_data=None, resumed_at: int | None = None
                     ) -> FloatingPointError:
  """The error of a step whose loss, gradient norm or parameters are not
  finite: the step, the workers, the checkpoint kept, and the cause. A
  step's training batch holding NaN/inf (``bad_data``: the workers whose
  float arrays do, from :func:`non_finite_rows`) names the data; a finite
  loss whose gradient norm is not (``metrics["grad_norm"]``) names the
  gradient overflow; otherwise the fields most likely at fault with their
  values (of the run's config ``c``, if given). Step 1's loss is taken at
  the initial parameters: a non-finite one there is blamed on the init or
  the data, not on the learning rate; so is the first loss of an
  invocation resumed from checkpoint ``resumed_at``, taken at the restored
  state: blamed on that checkpoint (:func:`_restored_at_fault`), which
  its first step's non-finite parameters (a finite loss: the restored
  optimizer state may be damaged) name first too, the learning rate only
  as the alternative. The gradient-norm stop is conservative: with
  ``grad_clip=0`` it may fire while Adam's update is still finite (the
  logged norm's sum of squares overflows float32 first, for gradient
  elements between ~1.8e19/sqrt(N) and ~1.8e19, N parameters)."""
  loss = np.asarray(metrics["loss"], np.float64)
  bad = np.flatnonzero(~np.asarray(metrics["finite"]) | ~np.isfinite(loss))
  at_loaded = not np.all(np.isfinite(loss))
  kept = _kept(ckpt)
  if bad_data:
    return FloatingPointError(
        f"the training batch of step {step} holds NaN/inf on worker(s) "
        f"{list(bad_data)} (losses {np.round(loss[bad], 4).tolist()}); "
        f"stopping, {kept}. The data is at fault, not the learning rate: "
        "fix the data source (config.data.source).")
  norm = np.asarray(metrics.get("grad_norm", np.zeros_like(loss)),
                    np.float64)
  if np.all(np.isfinite(loss)) and not np.all(np.isfinite(norm[bad])):
    return FloatingPointError(
        f"gradient norm overflow at step {step} on worker(s) {bad.tolist()} "
        f"(losses {np.round(loss[bad], 4).tolist()}, gradient norms "
        f"{norm[bad].tolist()}): gradients beyond ~1.8e19 overflow float32 "
        "when squared, so Adam's second moment and the global norm (and the "
        f"gradient clip) are inf and every update is 0; stopping, {kept}. "
        "Scale the loss down (divide it by a constant) so that its "
        "gradients stay well below 1e19, or, if the loss grew during the "
        "run, lower config.schedule.peak_lr.")
  fault = (_restored_at_fault(ckpt, resumed_at, at_loaded, c)
           if resumed_at and int(step) == resumed_at + 1 else
           _fields_at_fault(c, int(step) <= 1 and at_loaded))
  return FloatingPointError(
      f"non-finite training loss or parameters at step {step} on worker(s) "
      f"{bad.tolist()} (losses {np.round(loss[bad], 4).tolist()}); stopping, "
      f"{kept}. {fault}")


def non_finite_rows(exp, step: int) -> list | None:
  """The workers whose training batch of ``step`` (0-based) holds NaN/inf
  in a float array (this process's workers, read again from the task's
  data), ``[]`` if none does, None if the batch cannot be read again."""
  try:
    workers = np.asarray(exp.local_workers)
    rows = exp.task.host_batch(int(step), workers)
    bad = np.zeros(len(workers), bool)
    for x in rows:
      x = np.asarray(x)
      if np.issubdtype(x.dtype, np.inexact):
        bad |= ~np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1)
    return workers[bad].tolist()
  except Exception:  # pylint: disable=broad-except
    return None  # a stopped run's message does not need it


def _restored_at_fault(ckpt: checkpoint_lib.Checkpointer, step: int,
                       at_loaded: bool = True, c=None) -> str:
  """Why a non-finite first result of an invocation resumed from
  checkpoint ``step`` is likely that checkpoint's (restored unverified
  when it has no checksums): a non-finite loss (``at_loaded``) is taken
  at the restored state, so the learning rate plays no part; non-finite
  parameters after a finite loss come from the first update, applied
  with the restored optimizer state: the checkpoint first, the fields of
  the config ``c`` (:func:`_fields_at_fault`) if it is intact."""
  status, _ = ckpt.verify(step)
  how = (" unverified (it has no SHA256SUMS)" if status == "unverified"
         else "")
  if not at_loaded:
    fields = _fields_at_fault(c)
    return (f"This is the first update of this invocation, applied with "
            f"the state restored{how} from checkpoint {step} "
            f"({ckpt.step_dir(step)}): its arrays (the optimizer state) are "
            "likely damaged; move it away to resume from an older "
            "checkpoint, or use a fresh --workdir. If that checkpoint is "
            f"intact: {fields[0].lower()}{fields[1:]}")
  return (f"No update of this invocation had been applied yet (the loss is "
          f"taken at the state restored{how} from checkpoint {step}, "
          f"{ckpt.step_dir(step)}), so the learning rate and the gradient "
          "clip play no part: that checkpoint's arrays are likely damaged "
          "(or the data holds NaN/inf); move it away to resume from an "
          "older checkpoint, or use a fresh --workdir.")


def _kept(ckpt: checkpoint_lib.Checkpointer) -> str:
  """Which checkpoint a stopped run keeps, for its error message."""
  good, verified = ckpt.last_good_step()
  if good is None:
    return "no intact checkpoint had been written yet"
  if verified:
    return (f"the last good checkpoint (step {good}) is kept in "
            f"{ckpt.directory}")
  return (f"checkpoint {good} (unverified: no checksums) is kept in "
          f"{ckpt.directory}")


def non_finite_record_error(step: int, record: dict,
                            ckpt: checkpoint_lib.Checkpointer,
                            c=None) -> FloatingPointError | None:
  """The error of a log or eval record whose loss (a mean over workers,
  batches or steps, taken in float64) is not finite, or None: such a
  record is never written (a null loss in ``metrics.jsonl`` of a run that
  finished). Step 0's evaluation and step 1's training loss are taken at
  the initial parameters: blamed on the init or the data."""
  bad = [k for k, v in record.items() if "loss" in k and
         isinstance(v, float) and not np.isfinite(v)]
  if not bad:
    return None
  initial = int(step) == 0 or (int(step) == 1 and bad[0] == "train/loss")
  return FloatingPointError(
      f"non-finite {bad[0]} at step {step} ({record[bad[0]]}); stopping, "
      f"{_kept(ckpt)}. {_fields_at_fault(c, initial)}")


class Recorder:
  """The loop's bookkeeping: step metrics, timing, log records, progress.

  :meth:`read` takes a finished step's metrics to the host (and stops a
  non-finite run), :meth:`record` writes a log or eval record from the
  metrics read since the last one (process 0 writes ``metrics.jsonl``,
  logs and draws the progress bar), :meth:`checkpoint_meta` is what a
  checkpoint keeps of it, and :meth:`final` the run's summary. Step times
  are host wall-clock seconds between two reads; the first step of an
  invocation and the time spent in evaluation and checkpoints are not
  timed (:meth:`restart_clock`).
  """

  def __init__(self, exp, ckpt: checkpoint_lib.Checkpointer,
               c: config_dict.ConfigDict, workdir: str, start: int,
               time_offset: float, window_state: dict | None, main: bool,
               log_schedule: list | None = None):
    self._exp, self._ckpt, self._main = exp, ckpt, main
    self._log_schedule = log_schedule  # metrics_resume.schedule_history
    self._config = c
    self._window = Window.from_state(window_state)
    self._timed = []
    self._time_offset = time_offset
    self._t_prev = None
    self.last = {"step": start}
    self._start = start  # > 0: the invocation resumed from a checkpoint
    self._writer = (metrics_lib.MetricsWriter(
        workdir, tensorboard=bool(c.tensorboard), tracker=str(c.tracker),
        run_config=c.to_dict()) if main else None)
    self._bar = metrics_lib.progress_bar(int(c.steps), initial=start,
                                         disable=None if main else True)
    # consensus_at="next_step": the step after a log step measures the
    # consensus distance of its input, so the log step is recorded when
    # that step's metrics are read (before that step joins the window).
    self._next_step = exp.programs.consensus_at == "next_step"
    self._deferred = None  # the log step waiting for its consensus distance

  def __enter__(self) -> "Recorder":
    return self

  def __exit__(self, *exc) -> None:
    self._bar.close()
    if self._writer is not None:
      self._writer.close()

  def train_time(self) -> float:
    """Seconds of timed training, earlier invocations included."""
    return self._time_offset + float(np.sum(self._timed))

  def restart_clock(self) -> None:
    """The next step is timed from now (after an evaluation or a save)."""
    self._t_prev = time.perf_counter()

  def read(self, done: int, device_metrics: dict) -> None:
    """Takes step ``done``'s metrics to the host (waits for the step).

    Raises:
      FloatingPointError: a non-finite loss or parameter.
    """
    m = multiprocess.to_host(device_metrics)  # waits for step `done`
    if self._next_step:
      cd = float(np.asarray(m.pop("consensus_distance")).reshape(-1)[0])
      if self._deferred is not None:
        self.record(self._deferred, {"consensus_distance": cd})
        self._deferred = None
    now = time.perf_counter()
    seconds = None if self._t_prev is None else now - self._t_prev
    self._t_prev = now
    if not np.all(m["finite"]) or not np.all(np.isfinite(m["loss"])):
      raise non_finite_error(done, m, self._ckpt, self._config,
                             non_finite_rows(self._exp, done - 1),
                             resumed_at=self._start)
    if seconds is not None:
      self._timed.append(seconds)
    self._window.add(m, seconds)
    self._bar.update(1)

  def record_log_step(self, done: int) -> None:
    """Records log step ``done`` now, or (``consensus_at="next_step"``)
    when the next step's metrics, which hold its consensus distance, are
    read."""
    if self._next_step:
      self._deferred = done
    else:
      self.record(done)

  def record_drained(self, done: int, state) -> None:
    """Records log step ``done`` when no next step is in flight (before a
    checkpoint): ``"next_step"`` measures the consensus distance apart."""
    extra = None
    if self._next_step:
      extra = {"consensus_distance": self._exp.consensus_distance(state)}
    self.record(done, extra)

  def record(self, done: int, extra: dict | None = None) -> None:
    """Writes the record of step ``done`` and starts a new window.

    Raises:
      FloatingPointError: a loss of the record is not finite
        (:func:`non_finite_record_error`); nothing is written.
    """
    exp = self._exp
    rec = {"step": done, "lr": exp.learning_rate(max(done, 1)),
           **self._window.summary(exp.tokens_per_step, exp.unit),
           **exp.fault_record(done), **(extra or {})}
    if "faults/useful_steps" in rec and done:
      rec["faults/goodput"] = rec["faults/useful_steps"] / (exp.n_workers *
                                                            done)
    rec["train_time_s"] = self.train_time()
    error = non_finite_record_error(done, rec, self._ckpt, self._config)
    if error is not None:
      raise error
    self.last.update(rec)
    self._window = Window()
    if not self._main:
      return
    self._writer.write(rec)
    self._bar.set_postfix({k: f"{rec[k]:.4g}" for k in
                           ("train/loss", "eval/loss", "consensus_distance")
                           if k in rec})
    logging.info("step %d: %s", done, ", ".join(
        f"{k}={v:.5g}" for k, v in rec.items()
        if k != "step" and isinstance(v, float)))

  def checkpoint_meta(self, done: int) -> dict:
    """The run's checkpoint facts (:func:`run_meta.checkpoint_meta`), the
    training time, the window and the log schedule's history."""
    meta = run_meta.checkpoint_meta(self._exp, done)
    meta["train_time_s"] = self.train_time()
    meta["metrics_window"] = self._window.state()
    if self._log_schedule is not None:
      meta[metrics_resume.SCHEDULE_KEY] = self._log_schedule
    return meta

  def final(self) -> dict:
    """The last record plus this invocation's step time and the totals."""
    last = self.last
    if self._timed:
      sec = float(np.mean(self._timed))
      last["step_time_ms"] = 1e3 * sec
      last[f"{self._exp.unit}_per_sec"] = self._exp.tokens_per_step / sec
    last["train_time_s"] = self.train_time()
    last["param_count"] = self._exp.param_count
    return last
