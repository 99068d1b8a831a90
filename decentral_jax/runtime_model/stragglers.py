"""What slow and failing workers cost each method: step time and useful work.

The faults are those of :class:`decentral_jax.comm.fault_schedule.FaultSchedule`
(``docs/faults.md``): ``k = round(f n)`` of the ``n`` workers run at speed
``s`` (a step takes them ``T / s``); every worker fails with probability
``p`` per step and stays down a geometric number of steps with mean ``D``,
so it is up a fraction ``u = 1 / (1 + p D)`` of the time. Three ways to
handle them, one per kind of method:

* ``"wait"`` (All-Reduce, and any synchronous step): every step waits for
  the slowest worker, and the job stops while any worker is down (it cannot
  take a step without it). Step time ``t + E[max_i T_i / v_i] - E[max_i
  T_i]``, with ``t`` the healthy step time, ``T_i ~ N(T, sigma^2)`` the
  compute times and ``v_i`` the speeds (``T (1/s - 1)`` more with ``sigma
  = 0`` and ``k >= 1``); with independent workers all are up a fraction
  ``u^n`` of the time, so each step costs ``1 / u^n = (1 + p D)^n`` times
  that. Every worker completes every step: the work done is 1.
* ``"deadline"`` (gossip that does not wait: the runner's
  ``stragglers="deadline"``): the step takes the healthy time ``t``; a
  slow worker completes a fraction ``s`` of the steps and a dead one none,
  the live workers go on without it. Work done ``u ((n - k) + k s) / n``.
* ``"quorum"`` (DiLoCo / Local SGD with a quorum, ``H`` inner steps per
  round): rounds take ``H t`` like the healthy ones, the work done is the
  deadline's. ``on_failure="proceed"`` (Decoupled DiLoCo) keeps all of it;
  ``"rollback"`` (torchft) loses a round in which a live worker failed,
  which happens with probability ``1 - (1 - p)^(H u n)`` (``u n``: the
  expected live workers), so the useful work is the work done times
  ``(1 - p)^(H u n)``.

The useful work ``g`` (goodput: worker-steps that count over ``n`` per
step) prices quality only through the steps lost; ``time_per_useful_step``
``= step_s / g`` is the wall-clock of one step's worth of all workers'
work. NumPy (and SciPy's normal CDF) only.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import special

from decentral_jax import checks

MODES = ("wait", "deadline", "quorum")
ON_FAILURE = ("proceed", "rollback")


@dataclasses.dataclass(frozen=True)
class Faults:
  """Slow and failing workers, as in ``config.faults``.

  Attributes:
    slow_fraction: ``f``, share of workers that are slow (``round(f n)``).
    slow_speed: ``s`` in ``(0, 1]``, their speed.
    failure_rate: ``p`` in ``[0, 1)``, failure probability of a live worker
      per step.
    mean_downtime: ``D >= 1``, mean steps a failed worker stays down.

  Raises:
    ValueError: (at construction) a value out of range, naming it.
  """
  slow_fraction: float = 0.0
  slow_speed: float = 0.5
  failure_rate: float = 0.0
  mean_downtime: float = 10.0

  def __post_init__(self):
    checks.check_probability("slow_fraction", self.slow_fraction)
    checks.check_float("slow_speed", self.slow_speed, minimum=0.0,
                       maximum=1.0, open_min=True)
    checks.check_float("failure_rate", self.failure_rate, minimum=0.0,
                       maximum=1.0, open_max=True)
    checks.check_float("mean_downtime", self.mean_downtime, minimum=1.0)

  @property
  def up_fraction(self) -> float:
    """``u = 1 / (1 + p D)``: the long-run share of time a worker is up."""
    return 1.0 / (1.0 + self.failure_rate * self.mean_downtime)

  def slow_workers(self, n: int) -> int:
    """``k = round(f n)`` (the schedule's count)."""
    return int(round(self.slow_fraction * n))

  @property
  def none(self) -> bool:
    return self.failure_rate == 0.0 and (self.slow_fraction == 0.0
                                         or self.slow_speed == 1.0)


@dataclasses.dataclass(frozen=True)
class StragglerCost:
  """One method's expected cost under :class:`Faults`.

  Attributes:
    step_s: expected wall-clock seconds per step (stalls included).
    work_done: worker-steps completed over ``n`` per step, in ``[0, 1]``.
    useful: worker-steps that count (goodput), ``<= work_done``.
  """
  step_s: float
  work_done: float
  useful: float

  @property
  def time_per_useful_step(self) -> float:
    """``step_s / useful``: seconds per step's worth of useful work."""
    return self.step_s / self.useful if self.useful > 0 else math.inf


def expected_max(means, stds) -> float:
  """``E[max_i X_i]`` of independent ``X_i ~ N(means[i], stds[i]^2)``.

  A zero std is a point mass. Evaluated as ``lo + int_lo^hi (1 - prod_i
  F_i(x)) dx`` (trapezoid rule, 4001 points) from ``lo``, the largest point
  mass or 9 standard deviations below the lowest mean, whichever is
  higher, to 9 standard deviations above the highest mean (below ``lo``
  the product is 0 up to ``1e-19``).

  Raises:
    ValueError: empty or mismatched inputs, a negative std.
  """
  means = np.asarray(means, np.float64).reshape(-1)
  stds = np.asarray(stds, np.float64).reshape(-1)
  if means.size == 0 or means.shape != stds.shape or np.any(stds < 0):
    raise ValueError("expected_max needs as many means as stds (>= 1, stds "
                     f">= 0), got {means.size} and {stds.size}.")
  normal = stds > 0
  if not normal.any():
    return float(means.max())
  wide = 9.0 * stds.max()
  lo = means.min() - wide
  if not normal.all():
    lo = max(lo, means[~normal].max())
  hi = means[normal].max() + wide
  if lo >= hi:
    return float(lo)
  x = np.linspace(lo, hi, 4001)
  z = (x[None, :] - means[normal, None]) / stds[normal, None]
  return float(lo + np.trapezoid(1.0 - special.ndtr(z).prod(axis=0), x))


def slowdown_excess(n: int, compute_s: float, compute_std_s: float,
                    faults: Faults) -> float:
  """``E[max_i T_i / v_i] - E[max_i T_i]``: extra seconds per synchronous
  step from the slow workers (``T_i ~ N(compute_s, compute_std_s^2)``)."""
  k = faults.slow_workers(n)
  if k == 0 or faults.slow_speed == 1.0:
    return 0.0
  s = faults.slow_speed
  healthy = expected_max([compute_s] * n, [compute_std_s] * n)
  slow = expected_max([compute_s] * (n - k) + [compute_s / s] * k,
                      [compute_std_s] * (n - k) + [compute_std_s / s] * k)
  return slow - healthy


def straggler_cost(mode: str, n: int, step_s: float, faults: Faults, *,
                   compute_s: float = 0.0, compute_std_s: float = 0.0,
                   period: int = 1, on_failure: str = "proceed"
                   ) -> StragglerCost:
  """Expected step time and useful work of one method (module docstring).

  Args:
    mode: ``"wait"``, ``"deadline"`` or ``"quorum"``.
    n: workers, ``>= 1``.
    step_s: the healthy mean seconds per step (e.g. ``predict``'s).
    faults: the :class:`Faults`.
    compute_s, compute_std_s: mean and std of one step's compute (seconds);
      used by ``"wait"`` only.
    period: ``H``, inner steps per round (``"quorum"``).
    on_failure: ``"proceed"`` or ``"rollback"`` (``"quorum"``).

  Returns:
    A :class:`StragglerCost`.

  Raises:
    ValueError: an unknown ``mode`` or ``on_failure``, or a value out of
      range, naming the argument.
  """
  checks.check_choice("mode", mode, MODES)
  checks.check_choice("on_failure", on_failure, ON_FAILURE)
  n = checks.check_int("n", n, minimum=1)
  period = checks.check_int("period", period, minimum=1)
  for name, v in (("step_s", step_s), ("compute_s", compute_s),
                  ("compute_std_s", compute_std_s)):
    checks.check_float(name, v, minimum=0.0)
  u = faults.up_fraction
  if mode == "wait":
    t = step_s + slowdown_excess(n, compute_s, compute_std_s, faults)
    return StragglerCost(t / u**n, 1.0, 1.0)
  k = faults.slow_workers(n)
  work = u * ((n - k) + k * faults.slow_speed) / n
  useful = work
  if mode == "quorum" and on_failure == "rollback":
    useful = work * (1.0 - faults.failure_rate) ** (period * u * n)
  return StragglerCost(step_s, work, useful)
