"""A runtime-model workload read from a compiled train step.

Instead of typed numbers (``runtime_model.presets.WORKLOADS``), the
workload of :mod:`decentral_jax.runtime_model` can come from the program
that will run: :func:`workload_from_compiled` reads a compiled step (best a
scheduled GPU program, :mod:`decentral_jax.tools.gpu_compile`) and returns
a small JSON-ready dict that :func:`decentral_jax.runtime_model.
workload_file.read_workload` turns into a ``Workload`` (the runtime model
stays NumPy-only: it reads the file, never this module):

* ``matmul_flops``: the program's matrix-multiply FLOPs per worker and
  step, by phase (forward ``jvp(``, backward ``transpose(jvp(``, other),
  from :func:`decentral_jax.analysis.overlap.overlap_report`;
* ``param_count`` and ``param_bytes``: one worker's parameters (given by
  the caller, e.g. from ``Experiment.abstract_params()``), ``param_dtype``;
* ``activation_bytes``: the compiled program's temporary buffers per
  device (``memory_analysis().temp_size_in_bytes``: activations kept for
  the backward and scratch), None for HLO text;
* ``compute_s``: forward, backward and optimizer (the other phase) seconds
  of one step on the profile's clock of
  :func:`decentral_jax.analysis.timeline.step_timeline` (``costs`` from a
  profile, else its stated fallback; the ``clock`` field says which);
* ``gossip_in_flight``: the report's in-flight fractions of the forward
  and backward matmul FLOPs.

Units: FLOPs, bytes, seconds.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from decentral_jax.analysis import hlo
from decentral_jax.analysis import overlap
from decentral_jax.analysis import timeline

#: The ``format`` field of the JSON (``read_workload`` checks it).
FORMAT = "decentral_jax.compiled_workload.v1"


def workload_from_compiled(compiled_or_text: Any, *, param_count: float,
                           param_dtype: str = "float32",
                           costs: Mapping[str, float] | None = None,
                           flops_per_us: float =
                           timeline.DEFAULT_FLOPS_PER_US,
                           source: str = "") -> dict:
  """The workload dict of a compiled step (module docstring).

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` or scheduled HLO text.
    param_count: one worker's parameter count (> 0).
    param_dtype: the parameters' dtype name (what gossip sends).
    costs: optional ``{instruction name: us}`` for the clock.
    flops_per_us: the clock's fallback rate (see ``step_timeline``).
    source: what was compiled, in words (kept in the JSON).

  Returns:
    A dict with ``format``, ``source``, ``param_count``, ``param_bytes``,
    ``param_dtype``, ``matmul_flops``, ``activation_bytes``, ``compute_s``,
    ``clock`` and ``gossip_in_flight``.

  Raises:
    ValueError: ``param_count`` not > 0; errors of ``overlap_report`` and
      ``step_timeline`` (unparsable or unscheduled HLO).
  """
  if not float(param_count) > 0:
    raise ValueError(f"workload_from_compiled: param_count={param_count!r} "
                     "must be > 0 (one worker's parameters).")
  import numpy as np  # the dtype's size only
  text = hlo.hlo_text(compiled_or_text, "optimized")
  rep = overlap.overlap_report(text)
  tl = timeline.step_timeline(text, costs, flops_per_us=flops_per_us)
  phase = tl.phase_us()
  fwd, bwd = rep.in_flight_fractions()
  temp = None
  if hasattr(compiled_or_text, "memory_analysis"):
    mem = compiled_or_text.memory_analysis()
    temp = None if mem is None else float(mem.temp_size_in_bytes)
  return {
      "format": FORMAT, "source": source,
      "param_count": float(param_count),
      "param_bytes": float(param_count) * np.dtype(param_dtype).itemsize,
      "param_dtype": str(param_dtype),
      "matmul_flops": {"forward": rep.forward_flops,
                       "backward": rep.backward_flops,
                       "other": (rep.total_flops - rep.forward_flops
                                 - rep.backward_flops)},
      "activation_bytes": temp,
      "compute_s": {"forward": phase["forward"] / 1e6,
                    "backward": phase["backward"] / 1e6,
                    "optimizer": phase["other"] / 1e6},
      "clock": tl.clock,
      "gossip_in_flight": {"forward": fwd, "backward": bwd}}


def write_workload(path: str, workload: dict) -> None:
  """Writes :func:`workload_from_compiled`'s dict as indented JSON."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(workload, f, indent=1)
    f.write("\n")


__all__ = ("FORMAT", "workload_from_compiled", "write_workload")
