"""The rules a run kept from an earlier invocation must satisfy.

A kept run's record (``compare_result.json``'s ``final`` and every row of
its ``metrics.jsonl``) is checked by one rule set, whatever field was
damaged:

* :func:`metrics_rules.value_error`: every loss-like value (a key whose
  last part names a loss, e.g. ``train/loss``, ``eval/worker_loss_mean``;
  the signed ``eval/worker_excess_*`` apart) is >= 0, every accuracy in [0, 1],
  every count or time (consensus distance, communication, timings) >= 0,
  every learning rate ``lr`` >= 0, every value a number (or null, but not
  a loss or ``lr``, which the writer always writes finite) but
  ``faults/alive``, a string of 0s and 1s
  (:data:`~decentral_jax.runner.metrics_rules.STRING_KEYS`), none beyond
  the largest float32 (:mod:`decentral_jax.runner.metrics_rules`);
* :func:`metrics_rules.row_error`: those values of one row, and
  ``eval/worker_loss_min <= eval/worker_loss_mean <= eval/worker_loss_max``;
  with the run's config (:func:`metrics_resume.schedule_error`), ``step`` in
  ``[0, steps]`` and ``lr <= schedule.peak_lr`` (no schedule exceeds it);
* :func:`final_error`: the final row, ``step`` there and equal to the
  config's ``steps``, ``param_count`` a whole number >= 1, and the
  communication figures consistent (:func:`comm_error`);
* :func:`metrics_rules.throughput_error`: with the run's config,
  ``tokens_per_sec`` (or ``samples_per_sec``) equal to the tokens
  (samples) of one step over ``step_time_ms``, in every row and in the
  final metrics;
* :func:`metrics_resume.eval_keys_error`: with the run's config (every
  invocation of a kept run had it), the evaluation's keys in exactly the
  rows of step 0 (``eval_interval > 0``), of each multiple of
  ``eval_interval`` and of ``steps``;
* :func:`final_rows_error`: every final value that ``metrics.jsonl`` also
  records equal to that of its last row holding the key (the final metrics
  are the last record; the run's mean timings apart);
* :func:`diverged_error`: the step a diverged run's reason names is one
  of the run's steps, and its ``metrics.jsonl`` neither goes past it nor
  holds a finite evaluation at or after it (training stops there);
* :func:`disagreeing`: across the runs of one job, the values every run
  must share (:data:`SHARED`): the step-0 evaluation loss of the runs of
  one seed (same initial parameters, same evaluation batches), the
  parameter count of every run (one model), and the communication figures
  of the runs of one method (one train step).

Each returns one line naming the key and the rule, or None.
"""

from __future__ import annotations

import math
import re

from decentral_jax import records
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import metrics_rules

# Bytes per parameter of the models whose parameter dtype the config sets
# (a model of your own may hold several dtypes: its ratio is not checked
# against its parameter count).
_ITEMSIZE = {"float32": 4, "bfloat16": 2}
# No method sends more than this many parameter-sized messages to each of
# the n workers per step (a gossip round of the complete topology sends
# n - 1, an all-reduce 2 (n - 1) / n).
MAX_MESSAGES_PER_WORKER = 4
# Relative slack of values one computation gives twice (float32 rounding
# of a mean of per-worker losses, or of the same evaluation under another
# sharding).
REL_TOL = metrics_lib.REL_TOL


def _signed(config) -> bool:
  """Whether the run's losses may be negative (a model of your own)."""
  return isinstance(config, dict) and metrics_rules.losses_signed(
      metrics_resume.field(config, "model.name"))


def comm_error(final: dict, config: dict) -> str | None:
  """Why ``comm/bytes_per_step`` and ``comm/ratio`` contradict each other
  or the job: ``ratio == bytes_per_step / (param_count * bytes per
  parameter)`` (to 1e-9 relative; the bytes per parameter of
  ``model.param_dtype``, for the gpt and cnn models), and ``ratio <=``
  :data:`MAX_MESSAGES_PER_WORKER` ``* n_workers``. Both figures, and
  ``param_count``, are required once either is there."""
  keys = ("comm/bytes_per_step", "comm/ratio", "param_count")
  if not any(k in final for k in keys[:2]):
    return None
  missing = [k for k in keys if not records.is_real(final.get(k))]
  if missing:
    return (f"{missing[0]} is {records.short(final.get(missing[0]))}, but a "
            "run records it with its communication figures")
  sent, ratio, count = (float(final[k]) for k in keys)
  n = metrics_resume.field(config, "n_workers")
  if records.is_real(n) and ratio > MAX_MESSAGES_PER_WORKER * n:
    return (f"comm/ratio must be <= {MAX_MESSAGES_PER_WORKER} x n_workers "
            f"= {MAX_MESSAGES_PER_WORKER * n:g} (parameter-sized messages "
            f"to each worker per step), got {records.short(ratio)}")
  model = metrics_resume.field(config, "model.name")
  dtype = metrics_resume.field(config, "model.param_dtype") if model == "gpt" else "float32"
  itemsize = _ITEMSIZE.get(dtype) if model in ("gpt", "cnn") else None
  if itemsize is not None:
    want = sent / (count * itemsize)
    if not math.isclose(ratio, want, rel_tol=1e-9, abs_tol=1e-12):
      return (f"comm/ratio is {records.short(ratio)}, but comm/bytes_per_step"
              f" / (param_count x {itemsize} bytes) = "
              f"{records.short(sent)} / ({count:g} x {itemsize}) = {want:.6g}")
  return None


def final_error(final: dict, config: dict) -> tuple[str, str] | None:
  """``(key, why)`` if a finished run's final metrics are impossible for
  its ``config`` (a dict, as ``compare_result.json`` holds it), else
  None."""
  why = metrics_rules.row_error(final, _signed(config))
  if why:
    return why.split(" ", 1)[0], why
  steps = metrics_resume.field(config, "steps")
  if "step" not in final and steps is not None:
    return "step", ("step is missing, but a finished run records its last "
                    f"step (the config's steps {records.short(steps)})")
  if "step" in final and final["step"] != steps:
    return "step", (f"step is {records.short(final['step'])}, but the run's "
                    f"config has steps {records.short(steps)}")
  count = final.get("param_count")
  if count is not None and not (records.is_real(count) and count >= 1
                                and float(count).is_integer()):
    return "param_count", ("param_count must be a whole number >= 1, got "
                           f"{records.short(count)}")
  why = metrics_resume.schedule_error(final, config)
  if why:
    return why.split(" ", 1)[0], why
  why = comm_error(final, config)
  if why:
    return "comm/ratio", why
  why = metrics_rules.throughput_error(final, config)
  return (why.split(" ", 1)[0], why) if why else None


# The final values that are the run's totals, not its last record's: the
# mean step time and throughput of the invocation, the training time.
RUN_TOTALS = ("step_time_ms", "tokens_per_sec", "samples_per_sec",
              "train_time_s")


def final_rows_error(final: dict, rows: list[dict]) -> tuple[str, str] | None:
  """``(key, why)`` if a final value other than :data:`RUN_TOTALS`
  differs from that of the last row of ``metrics.jsonl`` (``rows``)
  holding its key: the final metrics are the run's last record, so the
  two are one value (1e-9 relative for numbers; a null row value is the
  non-finite float the final holds)."""
  last = {}
  for row in rows:
    last.update(row)
  for key, v in final.items():
    if key in RUN_TOTALS or key not in last:
      continue
    w = last[key]
    if records.is_real(v) and records.is_real(w):
      same = math.isclose(float(v), float(w), rel_tol=1e-9, abs_tol=1e-12)
    else:  # metrics.jsonl writes a non-finite float as null
      same = v == w or (w is None and isinstance(v, float)
                        and not math.isfinite(v))
    if not same:
      step = [r.get("step") for r in rows if key in r][-1]
      return key, (f"{key} is {records.short(v)}, but the last row of "
                   f"metrics.jsonl that records it (step "
                   f"{records.short(step)}) has {records.short(w)}")
  return None


_AT_STEP = re.compile(r"\bat step (\d+)\b")


def diverged_error(reason: str, rows: list[dict],
                   config: dict | None = None) -> str | None:
  """Why a diverged run's ``reason`` contradicts its ``metrics.jsonl``
  (``rows``) or its ``config``: training stops at the step ``N`` whose
  loss or parameters are non-finite (the reason's ``at step N``), before
  recording it, so ``N`` is a step of the run (``1 <= N <= config.steps``),
  no row is past step ``N``, and no row at or after ``N`` holds a finite
  ``eval/loss`` (a run evaluated there did not stop there). A reason
  naming no step is not checked."""
  m = _AT_STEP.search(reason or "")
  if m is None:
    return None
  named = int(m.group(1))
  steps = metrics_resume.field(config or {}, "steps")
  if named < 1 or (records.is_real(steps) and named > steps):
    return (f"diverged says training stopped at step {named}, not a step "
            f"of the run (1 to config.steps = {records.short(steps)})")
  past = [r.get("step") for r in rows if records.is_real(r.get("step"))
          and r["step"] > named]
  if past:
    return (f"diverged says training stopped at step {named}, but "
            f"metrics.jsonl has rows up to step {records.short(max(past))}")
  evals = [r["step"] for r in rows if records.is_real(r.get("step"))
           and r["step"] >= named and records.is_real(r.get("eval/loss"))]
  if evals:
    return (f"diverged says training stopped at step {named}, but "
            f"metrics.jsonl holds a finite eval/loss at step "
            f"{records.short(evals[-1])}")
  return None


def metrics_error(rows: list[dict], config: dict | None = None
                  ) -> str | None:
  """Why a row of ``metrics.jsonl`` is impossible (names its step):
  :func:`metrics_rules.row_error`, a null where the writer writes a number
  (:func:`decentral_jax.runner.metrics_rules.null_error`), and
  :func:`metrics_resume.schedule_error`,
  :func:`metrics_rules.throughput_error` and the ``eval/`` keys at exactly
  the steps its schedule evaluates (:func:`metrics_resume.eval_keys_error`)
  given the run's ``config``; or
  why the rows are
  out of order or ``train_time_s`` decreases
  (:func:`decentral_jax.runner.metrics_rules.order_error`)."""
  for row in rows:
    why = (metrics_rules.row_error(row, _signed(config))
           or metrics_rules.null_error(row)
           or (config is not None
               and (metrics_resume.schedule_error(row, config)
                    or metrics_rules.throughput_error(row, config)
                    or _eval_keys_error(row, config)))
           or None)
    if why:
      return f"at step {records.short(row.get('step'))}: {why}"
  return metrics_rules.order_error(rows)


def _eval_keys_error(row: dict, config: dict) -> str | None:
  """:func:`metrics_resume.eval_keys_error` of a row of a run trained
  under ``config`` alone (:func:`metrics_resume.one_history`)."""
  history = metrics_resume.one_history(config)
  steps = metrics_resume.field(config, "steps")
  return None if history is None else metrics_resume.eval_keys_error(
      row, history, steps, steps)


# The values every run of a group must share:
# (name, what the runs of a group share, rel tolerance, why they agree).
_ONE_STEP = "the runs of one method compile the same train step"
SHARED = (("step-0 eval/loss", "seed", REL_TOL,
           "the runs of one seed start from the same parameters and "
           "evaluate the same batches"),
          ("param_count", "job", 0.0, "every run trains the same model"),
          ("comm/bytes_per_step", "method", 1e-9, _ONE_STEP),
          ("comm/ratio", "method", 1e-9, _ONE_STEP))


def _reference(values: dict, trusted: set, tol: float):
  """The value a group must have: a trusted run's, else that of a strict
  majority of the group, else None."""
  same = lambda a, b: math.isclose(a, b, rel_tol=tol, abs_tol=1e-12)
  for name in values:
    if name in trusted:
      return values[name]
  for v in values.values():
    if sum(same(v, w) for w in values.values()) * 2 > len(values):
      return v
  return None


def disagreeing(facts: dict[str, dict], trusted: set) -> dict[str, str]:
  """The runs whose shared values (:data:`SHARED`) disagree with their
  group's, with one line why.

  Args:
    facts: ``{run name: {"seed": .., "method": .., name of SHARED: value
      or None}}``.
    trusted: the runs trained from step 0 by this invocation; a group's
      value is a trusted run's, else that of a strict majority of the
      group; without either every untrusted run of the group is named.

  Returns:
    ``{run name: why}`` of untrusted runs only.
  """
  out = {}
  for key, by, tol, why in SHARED:
    groups = {}
    for name, f in facts.items():
      if records.is_real(f.get(key)):
        groups.setdefault(f.get(by), {})[name] = float(f[key])
    for values in groups.values():
      ref = _reference(values, trusted, tol)
      for name, v in values.items():
        if name in trusted or name in out or (ref is not None and math.isclose(
            v, ref, rel_tol=tol, abs_tol=1e-12)):
          continue
        others = ", ".join(sorted(set(values) - {name}))
        out[name] = (f"its {key} {v!r} differs from " + (
            f"{ref!r} of {others}" if ref is not None else
            f"that of {others}, and no run settles which is right")
                     + f" ({why})")
  return out
