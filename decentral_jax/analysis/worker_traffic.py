"""Bytes per *worker* from the per-device HLO reports of a run's train steps.

:func:`~decentral_jax.analysis.accounting.communication` counts what each
device of a program sends. A run's workers need not be devices:

* a worker of ``D`` devices (``devices_per_worker = D > 1``; worker ``w``
  owns device ids ``w*D .. w*D+D-1``): :func:`traffic` adds its devices'
  bytes up and separates what leaves the worker (gossip, All-Reduce) from
  what its devices send each other;
* ``K`` workers on one device (``workers_per_device = K > 1``): what they
  send each other is a copy, not counted; a worker sends ``1 / K`` of its
  device's cross-device bytes (averaged over the busiest device's workers).

A run may also compile one step per distinct gossip round (``gossip_rounds
= "static"``): :func:`step_bytes` weighs each compiled step by how often its
round occurs in a period of the topology's schedule, and reports the
consensus-distance diagnostics of logging steps apart from the method's
bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from decentral_jax import checks
from decentral_jax.analysis import accounting
from decentral_jax.analysis import hlo


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes sent per step by multi-device workers, from an HLO report.

  Every tuple has one float (bytes) per scenario of the report; the
  ``mean_*`` properties weigh them as
  :attr:`~decentral_jax.analysis.CommunicationReport.mean_bytes_per_step`.

  Attributes:
    devices_per_worker: ``D``.
    weights: the scenarios' weights.
    device: busiest device, everything it sends (the report's figure).
    device_out: busiest device, bytes to devices of *other* workers.
    worker: busiest worker, everything its ``D`` devices send.
    worker_out: busiest worker, bytes its devices send to other workers.
  """
  devices_per_worker: int
  weights: tuple[float, ...]
  device: tuple[float, ...]
  device_out: tuple[float, ...]
  worker: tuple[float, ...]
  worker_out: tuple[float, ...]

  def _mean(self, xs):
    return float(sum(w * x for w, x in zip(self.weights, xs)))

  @property
  def mean_device_out(self) -> float:
    return self._mean(self.device_out)

  @property
  def mean_worker_out(self) -> float:
    return self._mean(self.worker_out)

  @property
  def mean_worker(self) -> float:
    return self._mean(self.worker)


def traffic(report: accounting.CommunicationReport,
            devices_per_worker: int) -> Traffic:
  """Per-device and per-worker bytes of a :class:`~decentral_jax.analysis.CommunicationReport`.

  Device ids of the HLO are positions in the mesh, so worker ``w`` owns ids
  ``w*D .. w*D+D-1``. Bytes "out" of a worker follow
  :meth:`~decentral_jax.analysis.Collective.sent_bytes` with
  ``local_size=D`` (a permute's pair crosses iff its ends lie in different
  workers; group collectives as a ring in the listed order). With ``D =
  1``, ``device == device_out == worker == worker_out``.

  Raises:
    ValueError: ``devices_per_worker`` not an integer >= 1, or the
      report's device count not divisible by it.
  """
  d = checks.check_int("devices_per_worker", devices_per_worker, minimum=1)
  n = report.n_devices
  if n % d:
    raise ValueError(f"devices_per_worker={d} must divide the report's "
                     f"{n} devices.")
  out = {"device": [], "device_out": [], "worker": [], "worker_out": []}
  for s in report.scenarios:
    total = np.zeros(n)
    leaving = np.zeros(n)
    for k, times in s.counts:
      c = report.collectives[k]
      total += times * c.sent_bytes(n)
      leaving += times * c.sent_bytes(n, d)
    for key, per_dev in (("device", total), ("device_out", leaving)):
      out[key].append(float(per_dev.max()) if n else 0.0)
    for key, per_dev in (("worker", total), ("worker_out", leaving)):
      per_worker = per_dev.reshape(-1, d).sum(axis=1)
      out[key].append(float(per_worker.max()) if n else 0.0)
  return Traffic(d, tuple(s.weight for s in report.scenarios),
                 **{k: tuple(v) for k, v in out.items()})


def _worker_means(report: accounting.CommunicationReport, dpw: int,
                  wpd: int) -> tuple[float, float, float]:
  """(busiest worker's mean bytes to other workers, busiest device's mean
  bytes to other workers' devices, busiest worker's mean bytes inside it)."""
  if wpd > 1:
    return (report.mean_bytes_per_step / wpd, report.mean_bytes_per_step,
            0.0)
  if dpw == 1:
    return report.mean_bytes_per_step, 0.0, 0.0
  t = traffic(report, dpw)
  return (t.mean_worker_out, t.mean_device_out,
          t.mean_worker - t.mean_worker_out)


def step_bytes(steps: Sequence[tuple[Any, int]], *, n_workers: int,
               param_bytes: int, diagnostics_scope: str,
               stage: str = "unoptimized", devices_per_worker: int = 1,
               workers_per_device: int = 1) -> dict[str, Any]:
  """Bytes the busiest worker sends per step of a run, read from its HLO.

  Each compiled step is read twice
  (:func:`~decentral_jax.analysis.accounting.communication`): with the
  instructions traced under ``diagnostics_scope`` left out (the method's
  bytes) and whole. A step's bytes are its report's mean over a period (a
  sync every ``H`` steps counts ``1 / H``), per worker (module docstring);
  the run's figure is the mean over the compiled steps weighed by their
  counts, ``sum_r k_r b_r / sum_r k_r``.

  Args:
    steps: ``(step, k)`` pairs: a compiled step (``jax.stages.Lowered``,
      ``Compiled`` or HLO text) and how many rounds of a period run it (one
      pair ``(step, 1)`` for a step that picks its round in the graph).
    n_workers: workers ``n``; the program has ``n * D / K`` devices.
    param_bytes: bytes of one worker's parameters (> 0), for ``"ratio"``.
    diagnostics_scope: the name scope of the logging steps' diagnostics
      (e.g. ``runner.step.DIAGNOSTICS_SCOPE``).
    stage: ``"unoptimized"`` or ``"optimized"`` (see
      :func:`~decentral_jax.analysis.hlo.hlo_text`).
    devices_per_worker: ``D >= 1``.
    workers_per_device: ``K >= 1`` (``D`` or ``K`` is 1).

  Returns:
    ``{"bytes_per_step": float (the method's bytes, diagnostics left
    out), "diagnostics_bytes_per_step": float (what the diagnostics add),
    "param_bytes": int, "ratio": bytes_per_step / param_bytes, "stage":
    str}``; with ``K > 1`` also ``"workers_per_device"`` and
    ``"device_bytes_per_step"`` (the busiest device's bytes to other
    devices); with ``D > 1`` also ``"devices_per_worker"``,
    ``"device_bytes_per_step"`` (busiest device, to other workers) and
    ``"intra_worker_bytes_per_step"`` (busiest worker, between its own
    devices); these per-device figures leave the diagnostics out.

  Raises:
    ValueError: no steps, a count, ``n_workers``, ``D`` or ``K`` below 1,
      an empty ``diagnostics_scope``,
      ``D > 1`` together with ``K > 1``, ``K`` not dividing ``n_workers``,
      a non-positive ``param_bytes``, an unknown ``stage``, or HLO that
      cannot be read.

  References:
    Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
    High-performance Decentralized Training
    <https://arxiv.org/abs/2410.11998>`_, ICLR 2025 (only parameters are
    communicated: the ratio to ``param_bytes`` is the method's cost).
  """
  n = checks.check_int("n_workers", n_workers, minimum=1)
  dpw = checks.check_int("devices_per_worker", devices_per_worker, minimum=1)
  wpd = checks.check_int("workers_per_device", workers_per_device, minimum=1)
  checks.check_float("param_bytes", param_bytes, minimum=0, open_min=True)
  checks.check_choice("stage", stage, ("unoptimized", "optimized"))
  if not isinstance(diagnostics_scope, str) or not diagnostics_scope:
    raise ValueError(f"diagnostics_scope must be a non-empty name scope, got "
                     f"{diagnostics_scope!r}.")
  if dpw > 1 and wpd > 1:
    raise ValueError(f"devices_per_worker={dpw} and workers_per_device="
                     f"{wpd}: one of them must be 1.")
  if n % wpd:
    raise ValueError(f"workers_per_device={wpd} must divide n_workers={n}.")
  if not steps:
    raise ValueError("steps is empty; pass at least one (step, count) pair.")
  for _, k in steps:
    checks.check_int("a step's count", k, minimum=1)
  n_devices = n * dpw // wpd
  total = everything = device = intra = 0.0
  for step, k in steps:
    # One lowering (and compile) as text serves both reports.
    text = hlo.hlo_text(step, stage)
    method = accounting.communication(text, n_devices=n_devices,
                                      exclude_scope=diagnostics_scope)
    whole = accounting.communication(text, n_devices=n_devices)
    mean, to_others, inside = _worker_means(method, dpw, wpd)
    total += k * mean
    device += k * to_others
    intra += k * inside
    everything += k * _worker_means(whole, dpw, wpd)[0]
  runs = sum(k for _, k in steps)
  per_step = total / runs
  out = {"bytes_per_step": per_step,
         "diagnostics_bytes_per_step": everything / runs - per_step,
         "param_bytes": param_bytes, "ratio": per_step / param_bytes,
         "stage": stage}
  if wpd > 1:
    out.update(workers_per_device=wpd, device_bytes_per_step=device / runs)
  if dpw > 1:
    out.update(devices_per_worker=dpw, device_bytes_per_step=device / runs,
               intra_worker_bytes_per_step=intra / runs)
  return out


__all__: Sequence[str] = ("Traffic", "step_bytes", "traffic")
