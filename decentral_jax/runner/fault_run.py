"""The fault schedule of a run (``config.faults``) and its metrics records.

:func:`make` builds a :class:`FaultRun` from a validated config when
``config.faults.enabled``: the :class:`~decentral_jax.comm.fault_schedule.FaultSchedule`
(from the rates over ``config.steps`` steps, or the trace file), the
masks handed to each train step and the fields of the metrics records:

* ``faults/alive``: the live mask of the last step, one character per
  worker (``"1"`` alive, ``"0"`` dead), e.g. ``"11011111"``;
* ``faults/live_workers``: how many are alive at that step;
* ``faults/work_done``: worker-steps that completed an inner step so far,
  over ``n_workers * steps`` (what the schedule lets the workers do);
* ``faults/goodput``: useful worker-steps, those that entered a committed
  outer step (:mod:`decentral_jax.optim.elastic`), over ``n_workers *
  steps`` (written by the loop from the step's ``faults/useful_steps``;
  work of the current round counts once it is committed).

A checkpoint records the fault settings with the SHA-256 of the trace's
content (:func:`resume_meta`); a resumed run must have the same settings
and a trace of the same content, wherever the file now lies
(:func:`resume_mismatch` names the first difference).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from ml_collections import config_dict

from decentral_jax.comm import fault_schedule

_CHUNK = 4096  # steps per block when counting the work done


class FaultRun:
  """The schedule of one run and the per-step masks and record fields.

  Attributes:
    schedule: the :class:`FaultSchedule`.
    stragglers: ``config.faults.stragglers``.
    n_workers: ``n``.
    trace_sha256: hex SHA-256 of the trace file's bytes, or None without a
      trace.
  """

  def __init__(self, schedule: fault_schedule.FaultSchedule, steps: int,
               stragglers: str, trace_sha256: str | None = None):
    self.schedule = schedule
    self.stragglers = stragglers
    self.n_workers = schedule.n_workers
    self.trace_sha256 = trace_sha256
    chunk = max(1, min(_CHUNK,
                       fault_schedule.MAX_MASK_CELLS // self.n_workers))
    counts = [schedule.masks(a, min(a + chunk, steps), stragglers)[1].sum(1)
              for a in range(0, steps, chunk)]
    # Worker-steps completed before step k, k = 0 .. steps.
    self._work = np.concatenate([[0], np.cumsum(np.concatenate(counts))])

  def masks(self, step: int) -> tuple:
    """``(alive, working, rejoining)``, bool [n], of ``step`` (0-based),
    or ``()`` if every worker is alive and working at that step and was
    alive at the step before (the run then takes its plain step).

    ``rejoining``: alive at ``step`` and dead at ``step - 1``.
    """
    alive, working = self.schedule.masks(max(step - 1, 0), step + 1,
                                         self.stragglers)
    before = alive[0] if step > 0 else np.ones(self.n_workers, bool)
    if alive[-1].all() and working[-1].all() and before.all():
      return ()
    return alive[-1], working[-1], alive[-1] & ~before

  def record(self, done: int) -> dict:
    """The record fields after ``done`` steps (module docstring)."""
    if done <= 0:
      return {}
    alive = self.schedule.alive(done - 1)
    k = min(done, self._work.size - 1)
    return {"faults/alive": "".join("1" if a else "0" for a in alive),
            "faults/live_workers": int(alive.sum()),
            "faults/work_done": float(self._work[k] / (self.n_workers * k))}


def make(config: config_dict.ConfigDict) -> FaultRun | None:
  """The run's :class:`FaultRun`, or None without ``config.faults.enabled``.

  Raises:
    ValueError: an invalid trace file, or a trace event that starts at or
      after ``config.steps`` (it would never happen); one line naming file
      and key.
  """
  f = config.get("faults")
  if f is None or not f.enabled:
    return None
  n, steps = int(config.n_workers), int(config.steps)
  if not f.trace:
    schedule = fault_schedule.FaultSchedule.from_rates(
        n, steps, failure_rate=float(f.failure_rate),
        mean_downtime=float(f.mean_downtime),
        slow_fraction=float(f.slow_fraction), slow_speed=float(f.slow_speed),
        seed=int(f.seed))
    return FaultRun(schedule, steps, str(f.stragglers))
  try:
    with open(f.trace, "rb") as fh:
      digest = hashlib.sha256(fh.read()).hexdigest()
  except OSError as e:
    raise ValueError(f"fault trace {f.trace}: cannot be read: "
                     f"{e.strerror or e}") from None
  schedule = fault_schedule.FaultSchedule.from_trace(f.trace, n)
  for i, (_, start, _, _) in enumerate(schedule.events):  # in file order
    if start >= steps:
      raise ValueError(
          f"fault trace {f.trace}: events[{i}].start={start} is not before "
          f"config.steps={steps}, so the event never happens; remove it or "
          f"set --config.steps above {start}.")
  return FaultRun(schedule, steps, str(f.stragglers), digest)


def resume_meta(config: config_dict.ConfigDict,
                run: FaultRun | None) -> dict:
  """What a checkpoint records of the faults: ``{}`` without them, else
  ``config.faults`` as JSON plus ``trace_sha256`` with a trace."""
  if run is None:
    return {}
  meta = json.loads(config.faults.to_json())
  if run.trace_sha256 is not None:
    meta["trace_sha256"] = run.trace_sha256
  return meta


def resume_mismatch(theirs, mine: dict,
                    unread: tuple[str, ...] = ()) -> str | None:
  """The first fault setting in which a checkpoint's :func:`resume_meta`
  ``theirs`` differs from this run's ``mine``, for a message
  (``"config.faults.<key>=<theirs> but this run has <mine>"``), or None.

  The trace is compared by content (``trace_sha256``), not by path; a
  checkpoint written before the hash was recorded is compared by path.
  A key of ``unread`` (settings this run's schedule does not read, e.g.
  ``rejoin`` without failures) is not compared.
  """
  if not isinstance(theirs, dict):
    return f"config.faults={theirs!r:.80} (not a settings object)"
  if bool(theirs) != bool(mine):  # {} is faults.enabled=False
    return (f"config.faults.enabled={bool(theirs)} but this run has "
            f"{bool(mine)}")
  skip = ("trace_sha256", *unread)  # hash: not in an older checkpoint
  if "trace_sha256" in theirs:
    a, b = theirs["trace_sha256"], mine.get("trace_sha256")
    if a != b:
      return (f"config.faults.trace={theirs.get('trace')!r} (content SHA-256 "
              f"{str(a)[:12]}) but this run's config.faults.trace="
              f"{mine.get('trace')!r} has content SHA-256 {str(b)[:12]}")
    skip = ("trace", "trace_sha256", *unread)  # the same content, moved
  for key in sorted(set(theirs) | set(mine)):
    if key not in skip and theirs.get(key) != mine.get(key):
      return (f"config.faults.{key}={theirs.get(key)!r} but this run has "
              f"{mine.get(key)!r}")
  return None
