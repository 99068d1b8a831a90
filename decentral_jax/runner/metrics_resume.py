"""The rules of ``metrics.jsonl`` that need the run's config.

:mod:`decentral_jax.runner.metrics` checks each record by itself (types and
ranges) and the file's order; these rules read the config too. ``compare``
checks a kept run's rows by :func:`schedule_error`; a resumed train run
applies :func:`lr_error` to every record (its ``steps`` may have changed,
its schedule may not) and warns of records lost before the checkpoint
(:func:`lost_warning`), so that both read the log by the same rules.
"""

from __future__ import annotations

from decentral_jax import records

# Relative slack of values one computation gives twice (float32 rounding
# of a mean of per-worker losses); :data:`metrics.REL_TOL` is this one.
REL_TOL = 1e-5


def field(config, name: str):
  """``config``'s dotted field ``name`` (a nested dict), or None."""
  node = config
  for part in name.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node


def lr_error(row: dict, config) -> str | None:
  """Why a row's ``lr`` is above ``schedule.peak_lr`` of ``config`` (a dict)
  by more than float32 rounding (:data:`REL_TOL`; no schedule
  exceeds its peak), or None."""
  peak, lr = field(config, "schedule.peak_lr"), row.get("lr")
  if (records.is_real(peak) and records.is_real(lr)
      and lr > peak * (1 + REL_TOL)):
    return (f"lr must be <= schedule.peak_lr {records.short(peak)} (no "
            f"schedule exceeds it), got {records.short(lr)}")
  return None


def schedule_error(row: dict, config) -> str | None:
  """Why a row's ``step`` or ``lr`` is impossible for the run's ``config``
  (a dict): ``step`` outside ``[0, steps]``, or :func:`lr_error`."""
  steps, step = field(config, "steps"), row.get("step")
  if (records.is_real(steps) and records.is_real(step)
      and not 0 <= step <= steps):
    return (f"step must be in [0, steps] = [0, {records.short(steps)}] (the "
            f"run's config), got {records.short(step)}")
  return lr_error(row, config)


def last_logged(step: int, config) -> int | None:
  """The last step ``<= step`` a run of ``config`` (the checkpoint's own)
  logs: a multiple of ``log_interval`` or ``eval_interval`` (0 counts when
  ``eval_interval`` > 0: the starting evaluation), or ``steps``; None when
  the intervals are unknown or none is logged."""
  ints = [field(config, k) for k in ("log_interval", "eval_interval",
                                     "steps")]
  if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
    return None
  log, ev, total = ints
  found = [s - s % k for k, s in ((log, step), (ev, step)) if k > 0]
  found = [s for s in found if s > 0 or ev > 0]
  if total <= step:
    found.append(total)
  return max(found, default=None)


def lost_warning(path: str, kept: list[dict], step: int,
                 config) -> str | None:
  """The warning for a log whose last record before the checkpoint at
  ``step`` is of an earlier step than the checkpoint's ``config`` logs
  there (:func:`last_logged`): the records between are lost; or None."""
  want = last_logged(step, config)
  have = max((r.get("step", 0) for r in kept), default=None)
  if want is None or (have is not None and have >= want):
    return None
  lost = (f"up to step {want}" if have is None
          else f"of steps {have + 1} to {want}")
  return (f"{path} {'holds no record' if have is None else f'ends at step {have}'}"
          f" although the checkpoint's config logs step {want} "
          f"(log_interval={field(config, 'log_interval')}, eval_interval="
          f"{field(config, 'eval_interval')}): the records {lost} are lost; "
          f"the resumed run logs from step {step + 1} on.")
