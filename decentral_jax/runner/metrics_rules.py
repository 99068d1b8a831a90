"""The rules of ``metrics.jsonl``'s records, one record and row to row.

One rule set, read by every reader of the file: a resumed train run
(:func:`decentral_jax.runner.metrics.truncate_after`), ``compare``'s check
of a kept run (:mod:`decentral_jax.tools.compare.kept`) and the learners'
reader. The writer (:class:`decentral_jax.runner.metrics.MetricsWriter`,
fed by :mod:`decentral_jax.runner.recorder`) computes every loss and metric
in float32 (means of float32 values in float64), so a number beyond the
largest float32 is damage; it writes null only for a non-finite value,
and a non-finite loss stops the run before its record is written, while
``lr`` is always finite: a null there is damage too (:func:`null_error`).
Row to row, the steps increase and the cumulative ``train_time_s`` never
decreases (:func:`order_error`); with the run's config the throughput is
the step's tokens (samples) over its step time (:func:`throughput_error`).
The rules that read the config's schedule are
:mod:`decentral_jax.runner.metrics_resume`'s.
"""

from __future__ import annotations

import math
import os

import numpy as np

from decentral_jax import records as records_lib
from decentral_jax.runner import metrics_resume

# Relative slack of values one computation gives twice.
REL_TOL = metrics_resume.REL_TOL
#: The largest float32: no value the run computes is larger in magnitude.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _last(key: str) -> str:
  return key.rsplit("/", 1)[-1]


#: The most training seconds a record may hold (about 31.7 years): a larger
#: ``train_time_s`` is damage, never a run's time.
MAX_TRAIN_TIME_S = 1e9


#: The models whose losses are >= 0 (cross-entropies) and accuracies in
#: [0, 1]; a model of your own may return any finite loss and any finite
#: "accuracy" aux value (docs/extending.md).
BUILT_IN_MODELS = ("gpt", "cnn")


def losses_signed(model_name) -> bool:
  """Whether a run of ``model_name`` may log any finite loss and accuracy
  (a model of your own, whose "accuracy" aux value the runner logs as it
  is; None, unknown, counts as built in)."""
  return model_name is not None and model_name not in BUILT_IN_MODELS


def workdir_losses_signed(workdir: str) -> bool:
  """:func:`losses_signed` for the run whose ``config.json`` is in
  ``workdir`` (False without a readable one)."""
  got = records_lib.read_json(os.path.join(workdir, "config.json"))
  model = got.get("model", {}) if isinstance(got, dict) else {}
  return losses_signed(model.get("name") if isinstance(model, dict)
                       else None)


def value_range(key: str, signed_losses: bool = False
                ) -> tuple[float | None, float | None]:
  """``(lo, hi)`` of a metric ``key`` (None: unbounded); a loss and an
  accuracy are any number for a model of your own (``signed_losses``)."""
  last = _last(key)
  if last == "train_time_s":
    return 0.0, MAX_TRAIN_TIME_S
  if "excess" in last:  # a worker's loss minus x_bar's: signed
    return None, None
  if ("loss" in last or "accuracy" in last) and signed_losses:
    return None, None
  if "loss" in last or last == "lr":
    return 0.0, None
  if "accuracy" in last:
    return 0.0, 1.0
  if (key.startswith("comm/") or last in (
      "consensus_distance", "step_time_ms", "train_time_s", "param_count",
      "tokens_per_sec", "samples_per_sec")):
    return 0.0, None
  return None, None


#: The keys the writers write a string under: ``faults/alive``, the last
#: step's live mask (one ``"0"``/``"1"`` per worker). Every other value they
#: write is a number (null for a non-finite one).
STRING_KEYS = ("faults/alive",)


def value_error(key: str, v, signed_losses: bool = False) -> str | None:
  """Why a value ``v`` of ``key`` is impossible (None for a null value,
  which the metrics files write for a non-finite one): not a number (a
  bool, a string, a list; a key of :data:`STRING_KEYS` not a string of 0s
  and 1s), outside :func:`value_range`, or for a
  value the run computes in float32 (a loss, an accuracy, the consensus
  distance, ``lr``) beyond :data:`FLOAT32_MAX` in magnitude."""
  why = _range_error(key, v, signed_losses)
  if why is None and _in_float32(key) and records_lib.is_real(v) \
      and abs(v) > FLOAT32_MAX:
    why = (f"{key} is {records_lib.short(v)}, beyond the largest float32 "
           f"{FLOAT32_MAX:.6g} (the run computes it in float32)")
  return why


def _in_float32(key: str) -> bool:
  """Whether the run computes ``key`` in float32: a loss, an accuracy, a
  worker's excess loss, the consensus distance or the learning rate (not
  a count, a byte figure or a time, taken in float64)."""
  last = _last(key)
  return (any(w in last for w in ("loss", "accuracy", "excess"))
          or last in ("consensus_distance", "lr"))


def _range_error(key: str, v, signed_losses: bool) -> str | None:
  """:func:`value_error` but for the float32 bound: a value of
  :data:`STRING_KEYS` a live mask, any other a number in its range (a
  non-finite float, ``compare_result.json``'s form of a null, counts as
  null where a key has no range and names no loss or accuracy)."""
  if v is None:
    return None
  if key in STRING_KEYS:
    return (None if isinstance(v, str) and v and set(v) <= {"0", "1"}
            else f"{key} must be a string of 0s and 1s (one per worker), "
            f"got {records_lib.short(v)}")
  lo, hi = value_range(key, signed_losses)
  if isinstance(v, float) and not math.isfinite(v) and (lo, hi) == (
      None, None) and not any(w in _last(key) for w in ("loss", "accuracy")):
    return None  # compare_result.json's form of the writer's null
  if not records_lib.is_real(v):
    return f"{key} must be a number, got {records_lib.short(v)}"
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    rule = (f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}")
    return f"{key} must be {rule}, got {records_lib.short(v)}"
  return None


def row_error(row: dict, signed_losses: bool = False) -> str | None:
  """Why one row of metrics (or the final metrics) is impossible: a value
  outside its range (:func:`value_error`), ``eval/worker_loss_min <= _mean
  <= _max`` broken, a standard deviation beyond its bound
  (:func:`std_error`) or an excess column not its difference
  (:func:`excess_error`); None when it is possible."""
  for key, v in row.items():
    why = value_error(key, v, signed_losses)
    if why:
      return why
  lo, mean, hi = (row.get(f"eval/worker_loss_{k}") for k in
                  ("min", "mean", "max"))
  got = [x for x in (lo, mean, hi) if records_lib.is_real(x)]
  slack = REL_TOL * max([abs(x) for x in got] + [1.0])
  if len(got) == 3 and not lo - slack <= mean <= hi + slack:
    return (f"eval/worker_loss_min <= eval/worker_loss_mean <= "
            f"eval/worker_loss_max must hold, got {records_lib.short(lo)}, "
            f"{records_lib.short(mean)}, {records_lib.short(hi)}")
  if len(got) == 2 and lo is not None and hi is not None and lo > hi + slack:
    return (f"eval/worker_loss_min {records_lib.short(lo)} must be <= "
            f"eval/worker_loss_max {records_lib.short(hi)}")
  return std_error(row) or excess_error(row)


def std_error(row: dict) -> str | None:
  """Why a row's ``eval/worker_loss_std`` is impossible, or None (None too
  where it is missing or null).

  The evaluation writes the workers' population standard deviation (NumPy's
  ``std``, ``ddof=0``), so ``0 <= std``, and where ``eval/worker_loss_min``
  and ``_max`` are numbers, ``std <= (max - min) / 2`` (Popoviciu's
  inequality), each to :data:`REL_TOL` relative slack.
  """
  std, lo, hi = (row.get(f"eval/worker_loss_{k}") for k in
                 ("std", "min", "max"))
  if not records_lib.is_real(std):
    return None
  if std < 0:
    return f"eval/worker_loss_std must be >= 0, got {records_lib.short(std)}"
  if not (records_lib.is_real(lo) and records_lib.is_real(hi)):
    return None
  bound = (float(hi) - float(lo)) / 2
  slack = REL_TOL * max(abs(lo), abs(hi), abs(std), 1.0)
  if std > bound + slack:
    return (f"eval/worker_loss_std {records_lib.short(std)} must be <= "
            f"(eval/worker_loss_max - eval/worker_loss_min) / 2 = "
            f"{bound:.9g} (the workers' population standard deviation)")
  return None


def excess_error(row: dict) -> str | None:
  """Why a row's ``eval/worker_excess_mean`` (``_max``) is not its
  ``eval/worker_loss_mean`` (``_max``) minus its ``eval/loss_subset``, as
  the evaluation computes them (in float64, so to 1e-9 relative), or
  None (None too where a value is missing or null)."""
  subset = row.get("eval/loss_subset")
  for k in ("mean", "max"):
    own, excess = (row.get(f"eval/worker_{w}_{k}") for w in ("loss", "excess"))
    if not all(records_lib.is_real(x) for x in (own, excess, subset)):
      continue
    want = float(own) - float(subset)
    if not math.isclose(float(excess), want, rel_tol=1e-9,
                        abs_tol=1e-9 * max(abs(own), abs(subset), 1.0)):
      return (f"eval/worker_excess_{k} is {records_lib.short(excess)}, but "
              f"eval/worker_loss_{k} {records_lib.short(own)} - "
              f"eval/loss_subset {records_lib.short(subset)} = {want:.9g}")
  return None


def record_error(record: dict) -> str | None:
  """Why ``record`` is not a metrics record, or None.

  A record has an integer ``"step" >= 0``; every value is a JSON scalar
  (the shape of a record; which key holds a number and which the string
  of :data:`STRING_KEYS` is :func:`value_error`'s rule).
  """
  step = record.get("step")
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    return f"\"step\" must be an integer >= 0, got {step!r:.40}"
  for key, value in record.items():
    if not (value is None or isinstance(value, (int, float, str, bool))):
      return (f"{key!r:.60} must be a number, a string or null, got "
              f"{type(value).__name__}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and not records_lib.is_real(value):
      return (f"{key!r:.60} must be a finite number or null (the writer "
              f"writes null for a non-finite value), got "
              f"{records_lib.short(value)}")
  return None


def order_error(rows: list[dict]) -> str | None:
  """Why the rows of a metrics file are out of order: each ``step`` must
  be larger than the one before (one record per logged step, in the order
  logged), and ``train_time_s`` never smaller (:func:`train_time_error`),
  or None."""
  for a, b in zip(rows, rows[1:]):
    sa, sb = a.get("step"), b.get("step")
    if records_lib.is_real(sa) and records_lib.is_real(sb) and sb <= sa:
      return (f"step must increase from row to row, got {records_lib.short(sb)}"
              f" after {records_lib.short(sa)} (rows repeated or out of order)")
  return train_time_error(rows)


def train_time_error(rows: list[dict]) -> str | None:
  """Why the cumulative ``train_time_s`` of ``rows`` (in file order)
  decreases somewhere (the timed seconds of a run only grow; a resume
  continues from its checkpoint's), or None."""
  last = None
  for row in rows:
    t = row.get("train_time_s")
    if not records_lib.is_real(t):
      continue
    if last is not None and t < last[1]:
      return (f"train_time_s must not decrease (cumulative seconds), got "
              f"{records_lib.short(t)} at step {records_lib.short(row.get('step'))}"
              f" after {records_lib.short(last[1])} at step "
              f"{records_lib.short(last[0])}")
    last = (row.get("step"), t)
  return None


def null_error(record: dict, runner: bool = True) -> str | None:
  """Why ``record`` holds null where its writer always writes a finite
  number, or None: ``lr`` (every writer: the learning rate is always
  finite), and with ``runner`` (a train run's log, not the learners') any
  key naming a loss (a record whose loss is not finite stops the run
  unwritten: :func:`decentral_jax.runner.recorder.non_finite_record_error`),
  and a key it always writes missing (:func:`missing_error`)."""
  for key, value in record.items():
    if value is None and (key == "lr" or (runner and "loss" in _last(key))):
      return (f"{key} is null, but the writer always writes a finite number "
              "there (a non-finite loss stops the run unrecorded; lr is "
              "always finite)")
  return missing_error(record) if runner else None


#: Keys the runner writes in every record (``train/loss`` after step 0:
#: the mean training loss since the record before).
RUNNER_KEYS = ("lr", "train_time_s")


def missing_error(record: dict) -> str | None:
  """Why a train run's record lacks a key the runner always writes
  (:data:`RUNNER_KEYS`, and ``train/loss`` at a step > 0), or None."""
  need = RUNNER_KEYS + (("train/loss",) if record.get("step") else ())
  gone = [k for k in need if k not in record]
  if gone:
    return (f"{', '.join(gone)} missing, but the runner writes "
            f"{'them' if len(gone) > 1 else 'it'} in every record"
            f"{' after step 0' if gone == ['train/loss'] else ''}")
  return None


def units_per_step(config: dict) -> tuple[str, float] | None:
  """``(throughput key, units per step)`` of a run's ``config``: a gpt
  model trains ``global_batch x model.block_size`` tokens per step
  (``tokens_per_sec``), the cnn ``global_batch`` samples
  (``samples_per_sec``); None for a model of your own or a config without
  these numbers."""
  field = metrics_resume.field
  model, batch = field(config, "model.name"), field(config, "global_batch")
  if model == "gpt":
    t = field(config, "model.block_size")
    if records_lib.is_real(batch) and records_lib.is_real(t):
      return "tokens_per_sec", float(batch) * float(t)
  if model == "cnn" and records_lib.is_real(batch):
    return "samples_per_sec", float(batch)
  return None


def throughput_error(row: dict, config: dict) -> str | None:
  """Why a row's throughput contradicts its step time: the recorder writes
  ``tokens_per_sec = units per step / (step_time_ms / 1000)``
  (:func:`units_per_step`), so both are there or neither, and they agree
  to 1e-9 relative."""
  got = units_per_step(config)
  if got is None:
    return None
  key, units = got
  ms, rate = row.get("step_time_ms"), row.get(key)
  if not (records_lib.is_real(ms) and records_lib.is_real(rate)):
    return None
  want = units / (float(ms) / 1e3) if ms > 0 else math.inf
  if not math.isclose(float(rate), want, rel_tol=1e-9):
    return (f"{key} is {records_lib.short(rate)}, but {units:g} "
            f"{key.split('_')[0]} per step (the run's config) / step_time_ms "
            f"{records_lib.short(ms)} ms = {want:.6g}")
  return None
