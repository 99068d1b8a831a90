"""A seeded schedule of slow and failing workers: each worker's speed per step.

A :class:`FaultSchedule` gives, for every step ``k`` and worker ``i``, a
speed ``s_i(k)``: 1 for a healthy worker, ``0 < s < 1`` for a slow one (it
computes ``s`` steps' worth of work per step), 0 for a dead one. From it:

* the live mask ``alive_i(k) = s_i(k) > 0`` (who takes part in gossip and in
  a synchronisation; :func:`decentral_jax.comm.faults.live_mix`);
* the working mask: whether worker ``i`` completes an inner step at step
  ``k``. With ``stragglers="deadline"`` a worker completes a step when its
  accumulated progress ``P_i(k) = sum_{t<k} s_i(t)`` crosses an integer,
  ``floor(P_i(k + 1)) > floor(P_i(k))`` (a worker at half speed completes
  every other step; over a DiLoCo round of ``H`` steps it completes
  ``H_m = floor(s H)`` or ``ceil(s H)`` of them: dynamic local updates,
  ``H_m`` proportional to speed). With ``stragglers="wait"`` every live
  worker completes every step (the others wait for it: the cost is wall
  time, not quality).

Everything is NumPy from the seed, so every process of a job builds the
same schedule. Two sources:

* :meth:`FaultSchedule.from_rates`: each worker is a two-state Markov chain
  over steps; a live worker fails at each step with probability
  ``failure_rate`` ``p`` and a dead one comes back at each step with
  probability ``1 / mean_downtime`` ``D`` (downtimes are geometric with mean
  ``D`` steps). Up times are geometric with mean ``1/p``, so the long-run
  fraction of dead worker-steps is ``D / (1/p + D) = pD / (1 + pD)``
  (renewal-reward). Every worker starts alive at step 0. A fraction
  ``slow_fraction`` of the workers (``round(fraction * n)`` of them, chosen
  by the seed) runs at ``slow_speed`` for the whole run.
* :meth:`FaultSchedule.from_trace`: intervals from a JSON file::

    {"n_workers": 8,
     "events": [{"worker": 3, "start": 100, "end": 150, "state": "dead"},
                {"worker": 5, "start": 0, "state": "slow", "speed": 0.5}]}

  ``start`` (int >= 0) and ``end`` (int > start; absent or null: to the end
  of the run) are steps, ``[start, end)``; ``state`` is ``"dead"`` or
  ``"slow"`` (with ``speed`` in ``(0, 1)``); ``n_workers`` is optional and
  must match the run. Where intervals overlap the lowest speed holds. Any
  other key, a wrong type or a value out of range is a ``ValueError`` of
  one line naming the file and the key.

References:
  Liu et al., Asynchronous Local-SGD Training for Language Modeling,
  arXiv 2401.09135 (dynamic local updates: steps proportional to speed).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from decentral_jax import checks
from decentral_jax import records
from decentral_jax.topology import schedules as topology_lib

#: How stragglers are treated: ``"deadline"`` (a slow worker completes only
#: the steps its speed allows) or ``"wait"`` (the others wait for it).
STRAGGLER_MODES = ("deadline", "wait")
#: Keys of a trace file and of one of its events.
TRACE_KEYS = ("n_workers", "events")
EVENT_KEYS = ("worker", "start", "end", "state", "speed")
_STEP_MAX = 2 ** 40  # steps are below this; worker w's keys are w * _STEP_MAX + t
#: Most (step, worker) entries one :meth:`FaultSchedule.masks` call builds
#: (its int64 temporaries take 8 bytes each: 512 MiB); ask in chunks.
MAX_MASK_CELLS = 2 ** 26
#: Largest fault trace file read (bytes).
MAX_TRACE_BYTES = 64 * 2 ** 20


class FaultSchedule:
  """Piecewise-constant speed of each worker over steps ``0 .. steps - 1``.

  Build it with :meth:`healthy`, :meth:`from_rates`, :meth:`from_trace` or
  :meth:`from_events`. Queries take a step ``k`` (``0 <= k``; beyond the
  last event a worker keeps its last speed) and return NumPy arrays over
  the ``n_workers`` workers.

  Attributes:
    n_workers: number of workers ``n``, in ``[1, topology.MAX_WORKERS]``
      (65,536, the largest schedule the topologies build).
    events: tuple of ``(worker, start, end, speed)``, ``end`` None for open.
  """

  def __init__(self, n_workers: int, events: Sequence[tuple] = ()):
    self.n_workers = checks.check_int("n_workers", n_workers, minimum=1,
                                    maximum=topology_lib.MAX_WORKERS)
    events = checks.check_sequence(
        "events", events, "a sequence of (worker, start, end, speed) tuples")
    self.events = tuple(_normalise_event(e, self.n_workers, f"events[{i}]")
                        for i, e in enumerate(events))
    self._build()

  # ---- constructors ----------------------------------------------------

  @classmethod
  def healthy(cls, n_workers: int) -> "FaultSchedule":
    """Every worker alive at full speed at every step."""
    return cls(n_workers)

  @classmethod
  def from_events(cls, n_workers: int, events) -> "FaultSchedule":
    """From ``(worker, start, end, speed)`` tuples (``end`` None: open).

    Raises:
      ValueError: ``events`` not a sequence (a number, None, a string, a
        0-d array), a worker outside ``0..n-1``, ``start < 0``, ``end <=
        start``, or a speed outside ``[0, 1)``.
    """
    return cls(n_workers, events)

  @classmethod
  def from_rates(cls, n_workers: int, steps: int, *,
                 failure_rate: float = 0.0, mean_downtime: float = 1.0,
                 slow_fraction: float = 0.0, slow_speed: float = 1.0,
                 seed: int = 0) -> "FaultSchedule":
    """Random failures and slow workers over ``steps`` steps (see the module).

    Args:
      n_workers: ``n >= 1``.
      steps: horizon in steps (>= 1); failures are drawn for ``0..steps-1``.
      failure_rate: ``p`` in ``[0, 1]``, failure probability per live
        worker and step.
      mean_downtime: ``D >= 1``, mean steps a failed worker stays dead.
      slow_fraction: in ``[0, 1]``, fraction of workers that are slow.
      slow_speed: in ``(0, 1]``, their speed.
      seed: int >= 0; worker ``i``'s failures come from NumPy's
        ``default_rng([seed, 0, i])``, the slow workers from
        ``default_rng([seed, 1])``.

    Raises:
      ValueError: an argument outside the ranges above.
    """
    n = checks.check_int("n_workers", n_workers, minimum=1,
                         maximum=topology_lib.MAX_WORKERS)
    steps = checks.check_int("steps", steps, minimum=1, maximum=_STEP_MAX - 1)
    p = checks.check_probability("failure_rate", failure_rate)
    downtime = checks.check_float("mean_downtime", mean_downtime, minimum=1.0)
    frac = checks.check_probability("slow_fraction", slow_fraction)
    speed = checks.check_float("slow_speed", slow_speed, minimum=0.0,
                               maximum=1.0, open_min=True)
    seed = checks.check_int("seed", seed, minimum=0)
    events = []
    if p > 0:
      for w in range(n):
        rng = np.random.default_rng([seed, 0, w])
        events += [(w, int(a), int(b), 0.0)
                   for a, b in _down_intervals(rng, p, 1.0 / downtime, steps)]
    n_slow = int(round(frac * n))
    if n_slow and speed < 1.0:
      slow = np.random.default_rng([seed, 1]).permutation(n)[:n_slow]
      events += [(int(w), 0, None, speed) for w in np.sort(slow)]
    return cls(n, events)

  @classmethod
  def from_trace(cls, path: str, n_workers: int) -> "FaultSchedule":
    """Reads a JSON trace (format in the module docstring).

    Args:
      path: a ``str`` or ``os.PathLike`` naming a regular file of at most
        :data:`MAX_TRACE_BYTES` bytes.
      n_workers: the run's worker count.

    Raises:
      ValueError: ``path`` not a path; one line naming ``path`` and the
        key: unreadable file, not a regular file (a FIFO, a device), too
        large, not JSON, an unknown or missing key, a wrong type or range,
        or ``n_workers`` other than the run's.
    """
    n = checks.check_int("n_workers", n_workers, minimum=1,
                         maximum=topology_lib.MAX_WORKERS)
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
      raise ValueError(f"path must be the path of a JSON fault trace (a str "
                       f"or os.PathLike), got {path!r}.")
    return cls(n, _read_trace(os.fspath(path), n))

  # ---- queries -----------------------------------------------------------

  @property
  def is_healthy(self) -> bool:
    """True if no worker is ever slow or dead."""
    return not self.events

  def speed(self, step: int) -> np.ndarray:
    """float64 [n]: each worker's speed at ``step`` (0 dead, 1 healthy)."""
    return self._speed[self._segment(_check_step(step))]

  def alive(self, step: int) -> np.ndarray:
    """bool [n]: the live mask at ``step`` (speed > 0)."""
    return self.speed(step) > 0

  def progress(self, step: int) -> np.ndarray:
    """float64 [n]: work done before ``step``, ``sum_{t < step} s_i(t)``."""
    return self._progress_at(np.int64(_check_step(step)))

  def working(self, step: int, stragglers: str = "deadline") -> np.ndarray:
    """bool [n]: who completes an inner step at ``step`` (module docstring)."""
    step = checks.check_int("step", step, minimum=0, maximum=_STEP_MAX - 2)
    return self.masks(step, step + 1, stragglers)[1][0]

  def masks(self, start: int, stop: int, stragglers: str = "deadline"):
    """``(alive, working)``, bool [stop - start, n], for steps ``start..stop-1``.

    At most ``max(1, MAX_MASK_CELLS // n)`` steps per call
    (:data:`MAX_MASK_CELLS`); a longer span is asked for in chunks.

    Raises:
      ValueError: ``stragglers`` not one of :data:`STRAGGLER_MODES`, a
        negative step, ``stop < start``, or a span of more steps than one
        call builds (naming ``stop``).
    """
    checks.check_choice("stragglers", stragglers, STRAGGLER_MODES)
    start = _check_step(start)
    stop = checks.check_int("stop", stop, minimum=start, maximum=_STEP_MAX - 1)
    span = max(1, MAX_MASK_CELLS // self.n_workers)
    if stop - start > span:
      raise ValueError(
          f"stop={stop} asks for {stop - start} steps from start={start}; "
          f"one masks() call builds at most {span} steps of {self.n_workers} "
          f"workers (MAX_MASK_CELLS={MAX_MASK_CELLS}); use stop <= "
          f"{start + span} and ask for the rest in chunks.")
    steps = np.arange(start, stop, dtype=np.int64)[:, None]
    alive = self._speed[self._segment(steps)] > 0
    if stragglers == "wait":
      return alive, alive.copy()
    done = _whole_steps(self._progress_at(steps + 1)) > _whole_steps(
        self._progress_at(steps))
    return alive, done & alive

  # ---- internals -----------------------------------------------------------

  def _build(self) -> None:
    """Per-worker breakpoints, speeds and progress as flat sorted arrays."""
    starts, speeds, progress = [], [], []
    by_worker: dict[int, list] = {}
    for e in self.events:
      by_worker.setdefault(e[0], []).append(e)
    for w in range(self.n_workers):
      mine = by_worker.get(w, [])
      cuts = sorted({0} | {e[1] for e in mine} |
                    {e[2] for e in mine if e[2] is not None})
      cut = np.asarray(cuts, np.int64)
      s = np.ones(cut.size)
      for _, a, b, v in mine:
        on = (cut >= a) & (cut < (_STEP_MAX if b is None else b))
        s[on] = np.minimum(s[on], v)
      starts.append(w * _STEP_MAX + cut)
      speeds.append(s)
      progress.append(np.concatenate([[0.0], np.cumsum(s[:-1] * np.diff(cut))]))
    self._key = np.concatenate(starts)
    self._start = self._key % _STEP_MAX
    self._speed = np.concatenate(speeds)
    self._progress = np.concatenate(progress)
    self._base = np.arange(self.n_workers, dtype=np.int64) * _STEP_MAX

  def _segment(self, steps) -> np.ndarray:
    """Segment index of each worker at ``steps`` (int or int64 [T, 1])."""
    return np.searchsorted(self._key, self._base + steps, side="right") - 1

  def _progress_at(self, steps) -> np.ndarray:
    seg = self._segment(steps)
    return self._progress[seg] + self._speed[seg] * (steps - self._start[seg])

  def __repr__(self) -> str:
    return f"FaultSchedule(n_workers={self.n_workers}, events={len(self.events)})"


def _whole_steps(progress: np.ndarray) -> np.ndarray:
  """``floor`` of the work done, a value within 8 ulps of a whole number
  counting as that number: ``0.7 * 90`` is 62.99999999999999 in float64
  and completes 63 steps, as the decimal speed says."""
  nearest = np.round(progress)
  close = np.abs(progress - nearest) <= 8 * np.finfo(np.float64).eps * (
      np.maximum(np.abs(progress), 1.0))
  return np.where(close, nearest, np.floor(progress))


def _check_step(step) -> int:
  return checks.check_int("step", step, minimum=0, maximum=_STEP_MAX - 1)


def _down_intervals(rng: np.random.Generator, p: float, q: float,
                    steps: int) -> list[tuple[int, int]]:
  """Dead intervals ``[a, b)`` of one worker: up ~ Geom(p), down ~ Geom(q).

  Draws (up, down) pairs in batches of a fixed size until the horizon is
  passed, so the intervals before a step do not depend on the horizon (a
  longer run, or a resumed one with more steps, sees the same failures).
  Draws are clipped at ``_STEP_MAX`` (beyond any horizon, so no interval
  changes): for a tiny ``p`` or ``q`` NumPy returns up to ``2^63 - 1`` and
  the running sum would overflow int64.
  """
  batch = 256
  out, t = [], 0
  while t < steps:
    up = np.minimum(rng.geometric(p, batch), _STEP_MAX).astype(np.int64)
    down = np.minimum(rng.geometric(q, batch), _STEP_MAX).astype(np.int64)
    ends = t + np.cumsum(up + down)
    fail = ends - down
    out += [(int(a), int(min(b, steps))) for a, b in zip(fail, ends)
            if a < steps]
    t = int(ends[-1])
  return out


def _normalise_event(e, n: int, where: str) -> tuple:
  try:
    w, a, b, v = e
  except (TypeError, ValueError):
    raise ValueError(f"{where} must be (worker, start, end, speed), got "
                     f"{e!r}.") from None
  w = checks.check_int(f"{where} worker", w, minimum=0, maximum=n - 1)
  a = checks.check_int(f"{where} start", a, minimum=0, maximum=_STEP_MAX - 2)
  if b is not None:
    b = checks.check_int(f"{where} end", b, minimum=a + 1,
                         maximum=_STEP_MAX - 1)
  v = checks.check_float(f"{where} speed", v, minimum=0.0, maximum=1.0,
                         open_max=True)
  return (w, a, b, v)


def _read_trace(path: str, n: int) -> list[tuple]:
  """The events of a trace file, each checked; errors name ``path`` and key."""
  where = f"fault trace {path}"
  raw = records.read_bytes(path, MAX_TRACE_BYTES)
  if isinstance(raw, records.Damaged):
    why = raw.reason.removeprefix("is ")
    if why.startswith("larger"):
      raise ValueError(f"{where}: {why}; a trace lists intervals, not "
                       "steps.")
    if raw.missing:
      why = "No such file or directory"
    raise ValueError(f"{where}: cannot be read: "
                     f"{why.removeprefix('cannot be read: ')}; give a JSON "
                     "file.")
  data = records.parse_json(raw, path)
  if isinstance(data, records.Damaged):
    if data.key is not None:  # a key given twice
      raise ValueError(f"{where}: {data.reason}.")
    why = data.reason.removeprefix("is not JSON: ").removeprefix("is ")
    raise ValueError(f"{where}: not a JSON file: {why[:120]}")
  if not isinstance(data, dict):
    raise ValueError(f"{where}: must hold a JSON object with keys "
                     f"{', '.join(TRACE_KEYS)}, got {type(data).__name__}.")
  _unknown(data, TRACE_KEYS, where, "")
  if "n_workers" in data:
    got = _field(data, "n_workers", where, "n_workers", int, 1)
    if got != n:
      raise ValueError(f"{where}: n_workers is {got} but the run has {n} "
                       "workers; write the trace for this run's workers.")
  events = data.get("events")
  if not isinstance(events, list):
    raise ValueError(f"{where}: events must be a list of objects, got "
                     f"{type(events).__name__}.")
  return [_trace_event(e, n, where, f"events[{i}]")
          for i, e in enumerate(events)]


def _trace_event(e: Any, n: int, where: str, key: str) -> tuple:
  if not isinstance(e, dict):
    raise ValueError(f"{where}: {key} must be an object, got "
                     f"{type(e).__name__}.")
  _unknown(e, EVENT_KEYS, where, key + ".")
  worker = _field(e, "worker", where, f"{key}.worker", int, 0, n - 1)
  start = _field(e, "start", where, f"{key}.start", int, 0, _STEP_MAX - 2)
  end = None
  if e.get("end") is not None:
    end = _field(e, "end", where, f"{key}.end", int, start + 1, _STEP_MAX - 1)
  state = e.get("state")
  if state not in ("dead", "slow"):
    raise ValueError(f"{where}: {key}.state must be 'dead' or 'slow', got "
                     f"{state!r}.")
  if state == "dead":
    if "speed" in e:
      raise ValueError(f"{where}: {key}.speed is only for state 'slow' "
                       "(a dead worker has speed 0); remove it.")
    return (worker, start, end, 0.0)
  speed = _field(e, "speed", where, f"{key}.speed", float)
  if not 0.0 < speed < 1.0:
    raise ValueError(f"{where}: {key}.speed must be > 0 and < 1 (0 is "
                     f"'dead', 1 healthy), got {speed!r}.")
  return (worker, start, end, speed)


def _unknown(obj: dict, allowed, where: str, prefix: str) -> None:
  extra = sorted(set(obj) - set(allowed), key=str)
  if extra:
    raise ValueError(f"{where}: unknown key {prefix}{extra[0]} (allowed: "
                     f"{', '.join(allowed)}).")


def _field(obj: dict, name: str, where: str, key: str, kind, lo=None,
           hi=None):
  """``obj[name]`` as ``kind`` (int or float) within ``[lo, hi]``."""
  if name not in obj:
    raise ValueError(f"{where}: {key} is missing.")
  v = obj[name]
  if not (checks.is_int(v) if kind is int else checks.is_number(v)):
    raise ValueError(f"{where}: {key} must be "
                     f"{'an int' if kind is int else 'a number'}, got {v!r}.")
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise ValueError(f"{where}: {key} must be in [{lo}, {hi}], got {v!r}.")
  return kind(v)


def check_trace_path(path: str) -> str:
  """Raises ``ValueError`` unless ``path`` names an existing file."""
  if not isinstance(path, str) or not os.path.isfile(path):
    raise ValueError(f"fault trace {path!r} is not a file; give the path of "
                     "a JSON trace (docs/faults.md).")
  return path
