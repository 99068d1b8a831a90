"""Bytes per step of a whole run, from the HLO of its compiled train steps.

A run may compile several train steps: one per distinct gossip round (each
running a known number of steps of a period), and, when the consensus
distance of a log step is measured at the top of the next step, a variant
of each that measures it, run once every ``log_interval`` steps.
:func:`run_bytes` weighs them into the run's figure with
:func:`~decentral_jax.analysis.worker_traffic.step_bytes`, the method's bytes apart
from those of the diagnostics.
"""

from __future__ import annotations

from typing import Any, Sequence

from decentral_jax import checks
from decentral_jax.analysis import worker_traffic


def run_bytes(steps: Sequence[tuple[Any, int]], *,
              measuring_steps: Sequence[tuple[Any, int]] | None = None,
              measure_every: int = 1, n_workers: int, param_bytes: int,
              diagnostics_scope: str, stage: str | None = None,
              devices_per_worker: int = 1,
              workers_per_device: int = 1) -> dict[str, Any]:
  """Bytes the busiest worker sends per step of a run, read from its HLO.

  The method's bytes are the mean over a period of ``steps`` (a sync every
  ``H`` steps counts ``1 / H``; the programs weighed by how many steps of
  the period run them: :func:`~decentral_jax.analysis.worker_traffic.step_bytes`).
  The diagnostics (the consensus distance of logging steps, traced under
  ``diagnostics_scope``: ``2 (n - 1) / n / log_interval`` x the parameter
  bytes) are those of ``steps`` themselves, or, given ``measuring_steps``
  (the same programs that also measure them, run once every
  ``measure_every`` steps instead of the plain ones), what those add:
  ``(b_measuring + d_measuring - b) / measure_every``.

  ``stage`` None is ``"unoptimized"`` with one device per worker: what the
  program asks for, e.g. ``comm_dtype`` bytes, which an accelerator sends
  as asked (XLA:CPU widens bfloat16 collectives); and ``"optimized"`` with
  ``devices_per_worker > 1``: a worker's arrays are split over its devices
  by the SPMD partitioner, so only the compiled HLO shows what each device
  sends (the unoptimized one counts whole per-worker arrays on every
  device). With ``K = workers_per_device > 1`` the HLO counts what each
  device sends to other devices (what its ``K`` workers send each other is
  a copy); ``bytes_per_step`` is that divided by ``K``.

  Args:
    steps: ``(program, k)`` pairs: a compiled step (``jax.stages.Lowered``,
      ``Compiled`` or HLO text) and how many steps of a period run it.
    measuring_steps: the measuring variants of ``steps``, or None when the
      diagnostics run inside ``steps``.
    measure_every: steps per measuring step (``log_interval``), >= 1.
    n_workers, param_bytes, diagnostics_scope, devices_per_worker,
      workers_per_device: as for
      :func:`~decentral_jax.analysis.worker_traffic.step_bytes`.
    stage: ``"unoptimized"``, ``"optimized"`` or None (above).

  Returns:
    ``{"bytes_per_step": float (the method's bytes, diagnostics left out),
    "diagnostics_bytes_per_step": float, "param_bytes": int (one worker's
    parameters), "ratio": bytes_per_step / param_bytes, "stage": the HLO
    stage read}``; with ``D > 1`` also ``"devices_per_worker"``,
    ``"device_bytes_per_step"`` (busiest device, to other workers) and
    ``"intra_worker_bytes_per_step"`` (busiest worker, between its own
    devices); with ``K > 1`` ``"workers_per_device"`` and
    ``"device_bytes_per_step"``; diagnostics left out of these.

  Raises:
    ValueError: ``measure_every`` below 1, or any error of
      :func:`~decentral_jax.analysis.worker_traffic.step_bytes`.

  References:
    Those of :func:`~decentral_jax.analysis.worker_traffic.step_bytes`
    (Wang, Zhang, Wu, Johansson, ICLR 2025, arXiv 2410.11998).
  """
  every = checks.check_int("measure_every", measure_every, minimum=1)
  if stage is None:
    stage = "unoptimized" if devices_per_worker == 1 else "optimized"

  def read(programs):
    return worker_traffic.step_bytes(
        programs, n_workers=n_workers, param_bytes=param_bytes,
        diagnostics_scope=diagnostics_scope, stage=stage,
        devices_per_worker=devices_per_worker,
        workers_per_device=workers_per_device)

  out = read(steps)
  if measuring_steps is None:
    return out
  measured = read(measuring_steps)
  extra = (measured["bytes_per_step"] + measured["diagnostics_bytes_per_step"]
           - out["bytes_per_step"])
  out["diagnostics_bytes_per_step"] = extra / every
  return out


__all__: Sequence[str] = ("run_bytes",)
