"""The rules of ``metrics.jsonl`` that need the run's config.

:mod:`decentral_jax.runner.metrics` checks each record by itself (types and
ranges) and the file's order; these rules read the config too. ``compare``
checks a kept run's rows by :func:`schedule_error`; a resumed train run
checks every record's ``lr`` against the peak of the schedule that wrote
it (:func:`logged_lr_error`: its ``steps`` and schedule may have changed)
and warns of records lost before the checkpoint (:func:`lost_warning`).

A checkpoint's document records the history of the log schedule
(:data:`SCHEDULE_KEY`: segments ``[from_step, log_interval,
eval_interval, peak_lr]``, a closed one with the step its invocation
ended at, :func:`schedule_history`), since a resume may change the
intervals and the learning rate's peak; a resume then names
every step that history logs up to the checkpoint and the kept log lacks
(:func:`scheduled_steps`), and checks each record's ``lr`` against its
segment's ``schedule.peak_lr`` (:func:`peak_at`; a segment of three,
written before the peak was recorded, leaves ``lr`` unchecked). The kept
records must also agree with the checkpoint itself
(:func:`checkpoint_error`): the invocation that saved it wrote its step's
record, whose ``lr`` and ``train_time_s`` the document fixes, and no kept
record's cumulative ``train_time_s`` exceeds the document's (a log of
another run put in the work directory). A kept record holds the
evaluation's keys exactly at the steps the history evaluates
(:func:`eval_keys_error`).
"""

from __future__ import annotations

import os

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


#: The checkpoint document's key of the log schedule's history.
SCHEDULE_KEY = "log_schedule"


def schedule_history(history, start: int, log_interval: int,
                     eval_interval: int, peak_lr: float | None = None,
                     restored_steps: int | None = None) -> list[list]:
  """The log schedule's history that a run started at step ``start`` (0: a
  fresh run) records with its checkpoints.

  ``history`` is the restored document's (:data:`SCHEDULE_KEY`; None for
  a fresh run or a document of an older version, whose steps up to
  ``start`` are then not known): segments ``[from_step, log_interval,
  eval_interval, peak_lr]``, ``from_step`` increasing, the first logging
  the steps after its ``from_step`` (0: also step 0's evaluation, with
  ``eval_interval > 0``) up to the next segment's ``from_step``, each
  record's ``lr`` at most the segment's ``schedule.peak_lr`` (left out
  with ``peak_lr`` None: not known). A closed segment ``[from_step,
  log_interval, eval_interval, peak_lr or None, last_step]`` also logs
  ``last_step``, the step its invocation ended at (its ``config.steps``,
  logged on no interval too), which is the next segment's ``from_step``.
  Its segments from ``start`` on are dropped; with ``restored_steps``
  (the restored document's ``config.steps``) equal to ``start``, the
  invocation that saved it ran to its end, so the last kept segment is
  closed at ``start``; then ``[start, log_interval, eval_interval,
  peak_lr]`` is appended unless the last segment is open with those
  values."""
  values = [int(log_interval), int(eval_interval)]
  values += [] if peak_lr is None else [float(peak_lr)]
  kept = [list(seg) for seg in history or () if seg[0] < start]
  if kept and start > 0 and restored_steps == start:
    seg = kept[-1]
    kept[-1] = [*seg[:3], seg[3] if len(seg) > 3 else None, int(start)]
  if not kept or kept[-1][1:] != values:
    kept.append([int(start), *values])
  return kept


def peak_at(history, step: int) -> float | None:
  """The ``schedule.peak_lr`` under which the record of ``step`` was
  written, by the log schedule's ``history`` (:func:`schedule_history`):
  that of the last segment whose ``from_step`` is before ``step`` (or is
  0, for step 0); None when not known (no history, a step no segment
  covers, a segment without its peak)."""
  segs = [seg for seg in history or ()
          if seg[0] < step or seg[0] == step == 0]
  return segs[-1][3] if segs and len(segs[-1]) > 3 else None


def logged_lr_error(row: dict, history) -> str | None:
  """:func:`lr_error` of ``row`` against the peak of its segment of the
  log schedule's ``history`` (:func:`peak_at`); None if not known."""
  peak = peak_at(history, row.get("step"))
  return None if peak is None else lr_error(
      row, {"schedule": {"peak_lr": peak}})


def _segment_ok(seg) -> bool:
  """Whether ``seg`` is ``[from_step >= 0, log_interval >= 1,
  eval_interval >= 0]`` integers, then an optional finite ``peak_lr >=
  0`` (null too when closed), then an optional integer ``last_step >
  from_step``."""
  if not isinstance(seg, list) or len(seg) not in (3, 4, 5):
    return False
  ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
             for v in seg[:3])
  peak = len(seg) == 3 or (records.is_real(seg[3]) and seg[3] >= 0) or (
      len(seg) == 5 and seg[3] is None)
  end = len(seg) < 5 or (isinstance(seg[4], int) and not isinstance(
      seg[4], bool) and ints and seg[4] > seg[0])
  return ints and peak and end and seg[1] >= 1


def _ends_error(history) -> str | None:
  """Why a closed segment of ``history`` is not followed by one starting
  at its ``last_step`` (:func:`schedule_history` writes so), or None."""
  for seg, nxt in zip(history, history[1:] + [None]):
    if len(seg) == 5 and (nxt is None or nxt[0] != seg[4]):
      return (f"{SCHEDULE_KEY}'s closed segment {seg} must be followed by "
              f"one from its last_step {seg[4]}, got "
              f"{'none' if nxt is None else nxt}")
  return None


def log_schedule_error(history, step: int, config=None) -> str | None:
  """Why a document's :data:`SCHEDULE_KEY` (at checkpoint ``step``, with
  the stored ``config``, a dict or None) is not one
  :func:`schedule_history` writes, or None (None when absent: an older
  version). Its last segment holds the config's own intervals and, where
  it records one, its ``schedule.peak_lr``."""
  if history is None:
    return None
  good = isinstance(history, list) and history and all(
      _segment_ok(seg) for seg in history)
  starts = [seg[0] for seg in history] if good else []
  if not good or starts != sorted(set(starts)) or starts[-1] > step:
    return (f"{SCHEDULE_KEY} must be a list of [from_step, log_interval >= "
            f"1, eval_interval >= 0] integer segments (then peak_lr >= 0, "
            f"then last_step > from_step), from_step increasing and at most "
            f"the step {step}, got {records.short(history)}")
  why = _ends_error(history)
  if why:
    return why
  ints = [field(config, k) for k in ("log_interval", "eval_interval")]
  if all(isinstance(v, int) for v in ints) and history[-1][1:3] != ints:
    return (f"{SCHEDULE_KEY}'s last segment {history[-1]} disagrees with "
            f"config.log_interval={ints[0]}, eval_interval={ints[1]} (the "
            "writer records the config's intervals)")
  peak = field(config, "schedule.peak_lr")
  if len(history[-1]) > 3 and records.is_real(peak) and history[-1][3] != peak:
    return (f"{SCHEDULE_KEY}'s last segment {history[-1]} disagrees with "
            f"config.schedule.peak_lr={records.short(peak)} (the writer "
            "records the config's peak)")
  return None


def scheduled_steps(history: list, step: int) -> list[int]:
  """The steps up to ``step`` that the log schedule's ``history``
  (:func:`schedule_history`) logs, ascending: a multiple of a segment's
  ``log_interval`` or ``eval_interval`` after its ``from_step`` and up to
  the next segment's, a closed segment's ``last_step`` (its invocation's
  last), and 0 if the first segment starts there with ``eval_interval >
  0`` (the checkpoint's own invocation's last step, logged too, is
  :func:`last_logged`'s)."""
  out = [0] if history[0][0] == 0 and history[0][2] > 0 else []
  ends = [seg[0] for seg in history[1:]] + [step]
  for (lo, log, ev, *rest), hi in zip(history, ends):
    out += [t for t in range(lo + 1, min(hi, step) + 1)
            if t % log == 0 or (ev > 0 and t % ev == 0)]
    if len(rest) == 2 and rest[1] <= step and rest[1] not in out[-1:]:
      out.append(rest[1])
  return out


#: The keys every evaluation writes in its step's record
#: (:meth:`decentral_jax.runner.evaluation.Evaluator.evaluate`), and
#: ``eval/accuracy`` for a classifier; no other record holds an
#: ``eval/`` key.
EVAL_KEYS = ("eval/loss", "eval/worker_loss_mean", "eval/worker_loss_min",
             "eval/worker_loss_max", "eval/worker_loss_std",
             "eval/loss_subset", "eval/worker_excess_mean",
             "eval/worker_excess_max")


def one_history(config) -> list | None:
  """The log schedule's history of a run whose every invocation had the
  ``config`` (a dict) it finished with (``compare`` resumes only a run of
  the very same config): one segment from 0, closed at ``steps``; None
  without integer intervals and ``steps``."""
  ints = [field(config, k) for k in ("log_interval", "eval_interval",
                                     "steps")]
  if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or \
      ints[0] < 1 or ints[1] < 0 or ints[2] < 1:
    return None
  return [[0, ints[0], ints[1], None, ints[2]]]


def evaluated(history: list, step: int, upto: int,
              total: int | None = None) -> bool | None:
  """Whether the log schedule's ``history`` (:func:`schedule_history`) up
  to the checkpoint at ``upto`` evaluates at ``step`` (``<= upto``), or
  None where not known.

  A run evaluates at step 0 (a first segment from 0 with ``eval_interval
  > 0``), at every multiple of a segment's ``eval_interval > 0`` after
  its ``from_step``, and at the last step of each invocation that ran to
  its end (``config.steps``): a closed segment's ``last_step``, and
  ``upto`` itself when ``total`` (the checkpoint's ``config.steps``; None:
  not known) equals it. Not known: a step before the history's first
  segment, and an open segment's last step before the next segment (its
  invocation stopped there early, or an older document left it open).
  """
  if step == 0:
    return history[0][2] > 0 if history[0][0] == 0 else None
  segs = [seg for seg in history if seg[0] < step]
  if not segs:
    return None
  _, _, ev, *rest = segs[-1]
  if (ev > 0 and step % ev == 0) or (len(rest) == 2 and step == rest[1]):
    return True
  if len(segs) < len(history):
    return False if step < history[len(segs)][0] else None
  if step < upto:
    return False
  return None if total is None else total == upto


def eval_keys_error(record: dict, history, upto: int,
                    total: int | None = None) -> str | None:
  """Why a kept record (step ``<= upto``) breaks the evaluations of the
  log schedule's ``history`` (:func:`evaluated`; ``total`` as there), or
  None (None too without a history, or where not known): the record of
  an evaluated step holds every key of :data:`EVAL_KEYS`, any other
  record no ``eval/`` key.

  ``step_time_ms`` and the throughput are not required: the first step
  of an invocation is not timed
  (:class:`decentral_jax.runner.recorder.Recorder`), so its record
  (``log_interval=1``: the first after a start or a resume) lacks
  them."""
  step = record.get("step")
  if not history or not isinstance(step, int) or step > upto:
    return None
  when = evaluated(history, step, upto, total)
  if when is None:
    return None
  seg = ([s for s in history if s[0] < step] or history[:1])[-1]
  sched = f"its log schedule segment {seg} (from_step, log_interval, " \
          f"eval_interval, ...)"
  if when:
    gone = [k for k in EVAL_KEYS if k not in record]
    return (f"{', '.join(gone)} missing, but the runner writes "
            f"{'them' if len(gone) > 1 else 'it'} at step {step}, an "
            f"evaluation of {sched}") if gone else None
  extra = [k for k in record if k.startswith("eval/")]
  return (f"{', '.join(extra)} at step {step}, but the runner writes eval/ "
          f"keys only at an evaluation, and {sched} does not evaluate "
          "there") if extra else None


def _steps_text(steps: list[int]) -> str:
  shown = ", ".join(map(str, steps[:8]))
  return shown + (f", ... ({len(steps)} in all)" if len(steps) > 8 else "")


def lost_warning(path: str, kept: list[dict], step: int,
                 config, history=None) -> str | None:
  """The warning for a log whose last record before the checkpoint at
  ``step`` is of an earlier step than the checkpoint's ``config`` logs
  there (:func:`last_logged`): the records between are lost; with the
  document's log schedule ``history`` also a step it logs before the
  last kept record (a hole) names all the steps lost; or None."""
  want = last_logged(step, config)
  have = max((r.get("step", 0) for r in kept), default=None)
  if history and have is not None:
    got = {r.get("step", 0) for r in kept}
    first = min(got) if os.path.lexists(path + ".corrupt") else 0
    missing = [t for t in scheduled_steps(history, step)
               if t not in got and t >= first]  # a moved-aside log: its own
    missing += [want] if want is not None and want > max(
        [have, *missing]) else []
    if missing and missing[0] < have:
      sizes = {len(seg) for seg in history}
      fields = "from_step, log_interval, eval_interval" + (
          ", peak_lr" if max(sizes) > 3 else "") + (
          ", last_step when closed" if 5 in sizes else "")
      lost = (f"the record of step {missing[0]} is" if len(missing) == 1
              else f"the records of steps {_steps_text(missing)} are")
      return (f"{path} lacks records the checkpoint's log schedule "
              f"writes (segments [{fields}]: {history}): {lost} lost; "
              f"the resumed run logs from step {step + 1} on.")
  if want is None or (have is not None and have >= want):
    return None
  lost = (f"up to step {want}" if have is None
          else f"of steps {have + 1} to {want}")
  return (f"{path} {'holds no record' if have is None else f'ends at step {have}'}"
          f" although the checkpoint's config logs step {want} "
          f"(log_interval={field(config, 'log_interval')}, eval_interval="
          f"{field(config, 'eval_interval')}): the records {lost} are lost; "
          f"the resumed run logs from step {step + 1} on.")


def checkpoint_error(kept: list[dict], step: int, at_step: dict | None
                     ) -> str | None:
  """Why the kept records (steps <= ``step``) are not the log of the run
  whose checkpoint at ``step`` resumes, or None.

  ``at_step`` holds what the checkpoint fixes (None or a missing key:
  not known, unchecked): ``"lr"``, the learning rate its own config's
  schedule logs at ``step`` (that of the update of step ``step``), and
  ``"train_time_s"``, the document's cumulative training seconds. The
  invocation that saved the checkpoint wrote the record of ``step`` (if
  its schedule logs that step), so that record's ``lr`` and
  ``train_time_s`` equal these up to float32 rounding (:data:`REL_TOL`);
  timed seconds only grow, so no kept record's ``train_time_s`` is
  larger than the document's.
  """
  at_step = at_step or {}
  want_t, want_lr = at_step.get("train_time_s"), at_step.get("lr")
  for r in kept:
    t = r.get("train_time_s")
    if records.is_real(want_t) and records.is_real(t) and (
        t > want_t * (1 + REL_TOL) if r.get("step") != step
        else abs(t - want_t) > REL_TOL * max(abs(want_t), 1e-9)):
      rule = "at most" if r.get("step") != step else "equal to"
      return (f"train_time_s {records.short(t)} at step {r.get('step')} "
              f"must be {rule} the checkpoint's {records.short(want_t)} at "
              f"step {step} (a log of another run?)")
    lr = r.get("lr")
    if (r.get("step") == step and records.is_real(want_lr)
        and records.is_real(lr)
        and abs(lr - want_lr) > REL_TOL * max(abs(want_lr), 1e-12)):
      return (f"lr {records.short(lr)} at step {step} must be the "
              f"checkpoint's {records.short(want_lr)} (its config's "
              "schedule at that step; a log of another run?)")
  return None
