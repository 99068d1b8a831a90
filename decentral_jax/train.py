"""The training loop: ``train_and_evaluate(config, workdir)``.

Drives an :class:`~decentral_jax.experiment.Experiment` in a work directory:
``metrics.jsonl`` (one record per log or eval point), ``config.json``,
Orbax checkpoints with bit-exact resumption, a progress bar and a
non-finite-loss guard. At most two steps are in flight: the host reads step
``t-1``'s metrics after dispatching step ``t``, and prepares the next batch
while the device trains.

Multi-host: every process calls :func:`train_and_evaluate` with the same
config and work directory; all processes train, evaluate and write their
shards of each checkpoint, while metrics, logging and the progress bar come
from process 0 only.
"""

from __future__ import annotations

import logging
import os
import time

import jax
import numpy as np
from ml_collections import config_dict

from decentral_jax import checkpoint as checkpoint_lib
from decentral_jax import distributed as distributed_lib
from decentral_jax import metrics as metrics_lib
from decentral_jax.experiment import Experiment


class _Window:
  """Accumulates host-side training metrics between two log records."""

  def __init__(self):
    self.losses, self.times, self.accs = [], [], []
    self.consensus = None

  def add(self, metrics: dict, seconds: float | None) -> None:
    self.losses.append(float(np.mean(metrics["loss"])))
    if "accuracy" in metrics:
      self.accs.append(float(np.mean(metrics["accuracy"])))
    if seconds is not None:
      self.times.append(seconds)
    cd = float(np.asarray(metrics["consensus_distance"]).reshape(-1)[0])
    if np.isfinite(cd):
      self.consensus = cd

  def summary(self, units_per_step: int, unit: str) -> dict:
    out = {}
    if self.losses:
      out["train/loss"] = float(np.mean(self.losses))
    if self.accs:
      out["train/accuracy"] = float(np.mean(self.accs))
    if self.consensus is not None:
      out["consensus_distance"] = self.consensus
    if self.times:
      sec = float(np.mean(self.times))
      out["step_time_ms"] = 1e3 * sec
      out[f"{unit}_per_sec"] = units_per_step / sec
    return out


def _non_finite_error(step: int, metrics: dict, last_good: int | None,
                      directory: str) -> FloatingPointError:
  loss = np.asarray(metrics["loss"], np.float64)
  bad = np.flatnonzero(~np.asarray(metrics["finite"]) | ~np.isfinite(loss))
  where = (f"the last good checkpoint (step {last_good}) is kept in "
           f"{directory}" if last_good is not None else
           "no checkpoint had been written yet")
  return FloatingPointError(
      f"non-finite training loss or parameters at step {step} on worker(s) "
      f"{bad.tolist()} (losses {np.round(loss[bad], 4).tolist()}); stopping, "
      f"{where}. Lower config.schedule.peak_lr or enable config.grad_clip.")


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str, *,
                       experiment: Experiment | None = None) -> dict:
  """Trains ``config`` in ``workdir``, resuming from its last checkpoint.

  Writes ``metrics.jsonl`` (one record per log or eval point), ``config.json``
  and ``checkpoints/<step>/`` (every worker's parameters and optimizer state,
  the step, the data position and RNG keys; every ``checkpoint_interval``
  steps and at the end). A resumed run continues bit-exactly: same batches,
  same dropout keys, same gossip round.

  In a multi-process job
  (:func:`decentral_jax.distributed.initialize_from_config`) every process
  calls this with the same config and work directory (shared by all hosts):
  all processes train, evaluate and write their shards of each checkpoint
  (Orbax), while ``metrics.jsonl``, ``config.json``, logging and the
  progress bar come from process 0 only. A checkpoint is restored by a job
  with the same number of processes and devices per process.

  Args:
    config: a run config (``configs/*.py``).
    workdir: output directory (created if missing).
    experiment: an :class:`~decentral_jax.experiment.Experiment` built
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
    ValueError: bad config or data (see
      :class:`~decentral_jax.experiment.Experiment`), or a
      checkpoint in ``workdir`` from an incompatible config.
    FloatingPointError: a non-finite loss or parameter; names the step and
      workers; the last good checkpoint stays in place.
  """
  c = config
  exp = experiment if experiment is not None else Experiment(c)
  if exp.config is not c and exp.config.to_dict() != c.to_dict():
    raise ValueError("train_and_evaluate: `experiment` was built from a "
                     "different config; pass experiment=None.")
  total = int(c.steps)
  main = distributed_lib.is_main_process()
  os.makedirs(workdir, exist_ok=True)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  ckpt = checkpoint_lib.Checkpointer(ckpt_dir,
                                     max_to_keep=int(c.keep_checkpoints))
  state = exp.init_state()
  start = last_saved = ckpt.latest_step()
  time_offset = 0.0  # training seconds of earlier invocations
  if start is not None:
    exp.check_resumable(ckpt.restore_meta(start), ckpt_dir)
    try:
      state, meta = ckpt.restore(start, state)
    except ValueError as e:  # e.g. a different optimizer-state structure
      raise ValueError(
          f"cannot resume from {ckpt_dir} (step {start}): its state does not "
          f"match this config (a changed grad_clip, optimizer or model "
          f"field?); resume with the original config or use a fresh "
          f"--workdir. Orbax: {str(e).splitlines()[0]}") from None
    start = int(meta["data_position"])
    time_offset = float(meta.get("train_time_s", 0.0))
    if main:
      logging.info("resumed from %s at step %d", ckpt_dir, start)
  else:
    start = 0
  if main:
    # Written only once the run is known to be valid (a rejected resume must
    # not overwrite the record of the original run).
    with open(os.path.join(workdir, "config.json"), "w",
              encoding="utf-8") as f:
      f.write(c.to_json(indent=2))
    # Records logged after the restored checkpoint are about to be redone.
    metrics_lib.truncate_after(workdir, start)
  writer = (metrics_lib.MetricsWriter(workdir, tensorboard=bool(c.tensorboard))
            if main else None)
  if main:
    logging.info("%s: %d workers on %d process(es), %s params/worker, %d "
                 "%s/step, mesh %s", c.algorithm, exp.n_workers,
                 jax.process_count(), f"{exp.param_count:,}",
                 exp.tokens_per_step, exp.unit, dict(exp.mesh.shape))

  unit_key = f"{exp.unit}_per_sec"
  eval_every, ckpt_every = int(c.eval_interval), int(c.checkpoint_interval)
  log_every = int(c.log_interval)
  window, timed = _Window(), []
  last = {"step": start}
  t_prev = None
  bar = metrics_lib.progress_bar(total, initial=start,
                                 disable=None if main else True)

  def handle(done: int, device_metrics: dict) -> None:
    nonlocal t_prev
    m = distributed_lib.to_host(device_metrics)  # waits for step `done`
    now = time.perf_counter()
    seconds = None if t_prev is None else now - t_prev
    t_prev = now
    if not np.all(m["finite"]) or not np.all(np.isfinite(m["loss"])):
      raise _non_finite_error(done, m, last_saved, ckpt_dir)
    if seconds is not None:
      timed.append(seconds)
    window.add(m, seconds)
    bar.update(1)

  def record(done: int, extra: dict | None = None) -> None:
    nonlocal window
    rec = {"step": done, "lr": exp.learning_rate(max(done, 1)),
           **window.summary(exp.tokens_per_step, exp.unit), **(extra or {})}
    rec["train_time_s"] = time_offset + float(np.sum(timed))
    last.update(rec)
    window = _Window()
    if not main:
      return
    writer.write(rec)
    bar.set_postfix({k: f"{rec[k]:.4g}" for k in
                     ("train/loss", "eval/loss", "consensus_distance")
                     if k in rec})
    logging.info("step %d: %s", done, ", ".join(
        f"{k}={v:.5g}" for k, v in rec.items()
        if k != "step" and isinstance(v, float)))

  try:
    if start == 0 and eval_every:  # the common starting point of all runs
      record(0, exp.evaluate(state))
    pending = None
    batch = exp.get_batch(start) if start < total else None
    for s in range(start, total):
      state, device_metrics = exp.train_step(state, batch, s)
      done = s + 1
      if pending is not None:  # read step s-1 while step s runs
        handle(*pending)
        if pending[0] % log_every == 0:
          record(pending[0])
      pending = (done, device_metrics)
      if done < total:
        batch = exp.get_batch(done)  # host prepares the next batch
      do_eval = done == total or (eval_every and done % eval_every == 0)
      do_ckpt = done == total or (ckpt_every and done % ckpt_every == 0)
      if do_eval or do_ckpt:
        handle(*pending)
        pending = None
        if do_eval:
          record(done, exp.evaluate(state))
        elif done % log_every == 0:
          record(done)
        if do_ckpt:
          meta = exp.checkpoint_meta(done)
          meta["train_time_s"] = time_offset + float(np.sum(timed))
          ckpt.save(done, state, meta)
          last_saved = done
        t_prev = time.perf_counter()
    if start >= total:  # nothing left to train: report the final evaluation
      last.update(exp.evaluate(state))
  finally:
    bar.close()
    if writer is not None:
      writer.close()
    ckpt.close()
  if timed:
    sec = float(np.mean(timed))
    last["step_time_ms"] = 1e3 * sec
    last[unit_key] = exp.tokens_per_step / sec
  last["train_time_s"] = time_offset + float(np.sum(timed))
  last["param_count"] = exp.param_count
  return last
