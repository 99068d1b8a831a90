"""Analysis of compiled programs: which collectives a step runs, their bytes,
and whether they overlap the forward/backward pass.

- :mod:`~decentral_jax.analysis.hlo`: the HLO text parser.
- :mod:`~decentral_jax.analysis.accounting`: collectives and bytes per
  step (per branch, averaged over a sync period).
- :mod:`~decentral_jax.analysis.worker_traffic`: bytes per worker of a run
  (workers of several devices, several workers per device, one compiled
  step per gossip round).
- :mod:`~decentral_jax.analysis.run_communication`: a run's bytes per step
  over its compiled programs (the gossip rounds of a period, the measuring
  steps once every log interval).
- :mod:`~decentral_jax.analysis.overlap`: for each collective of a
  scheduled (GPU) program, asynchronous or not, inside a conditional or
  not, and the forward / backward work scheduled while it moves data.
- :mod:`~decentral_jax.analysis.roofline`: every instruction of a
  scheduled GPU program priced at its roofline (FLOPs and bytes at a
  target's peak), against XLA's own estimates.
"""

from decentral_jax.analysis.accounting import (
    Collective, CommunicationReport, Scenario, communication, report_to_json,
    tree_bytes)
from decentral_jax.analysis.hlo import DTYPE_BYTES, KINDS, hlo_text
from decentral_jax.analysis.overlap import (
    CollectiveOverlap, OverlapReport, overlap_report, overlaps)
from decentral_jax.analysis.run_communication import run_bytes
from decentral_jax.analysis.worker_traffic import Traffic, step_bytes, traffic

__all__ = ["DTYPE_BYTES", "KINDS", "Collective", "CollectiveOverlap",
           "CommunicationReport", "OverlapReport", "Scenario", "Traffic",
           "communication", "hlo_text", "overlap_report", "overlaps",
           "report_to_json", "run_bytes", "step_bytes", "traffic", "tree_bytes"]
