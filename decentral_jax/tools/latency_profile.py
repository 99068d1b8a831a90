"""Latency profiles for XLA:GPU's scheduler, priced by the runtime model.

XLA's latency-hiding scheduler starts a collective only as early as its own
estimate of the transfer needs; for GPUs of one host that estimate is the
NVLink time, so the gossip starts late in the backward pass. Given the time
a collective really takes (microseconds: a number, or a function of the
collective such as :func:`cluster_collective_us`, which prices each
collective with the runtime model's description of a cluster, Wang et al.,
ICLR 2025, Sec. 4), :func:`latency_profile` writes XLA's profile-guided
latency estimation input (``ProfiledInstructionsProto`` text) that prices
each asynchronous collective at that time, named through the module's
:func:`fingerprint`; :func:`scheduled_busy_us` reads the scheduler's own
estimate of the program's busy time from its dump, to rescale those times
to XLA's clock. :mod:`decentral_jax.tools.gpu_compile` compiles with them
(docs/gpu_overlap.md).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

import numpy as np

from decentral_jax import checks

from decentral_jax.analysis import overlap as overlap_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.costs import round_cost

#: The XLA option naming the profile of :func:`latency_profile` (a file
#: ending in ``.pbtxt``, or a directory of ``FINGERPRINT.pbtxt`` files).
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"

_FINGERPRINT = re.compile(r'fingerprint_before_lhs="([0-9a-f]+)"')

_STAT = r"\b{}:\s*([0-9.eE+-]+)"


def schedule_texts(dump_dir: str) -> list[str]:
  """The ``*.schedule.txt`` files of an XLA dump directory, in name order."""
  texts = []
  for name in sorted(os.listdir(dump_dir)):
    if name.endswith(".schedule.txt"):
      with open(os.path.join(dump_dir, name), encoding="utf-8") as f:
        texts.append(f.read())
  return texts


def _stat(block: str, field: str) -> float:
  """A numeric field of a text proto block; 0 when absent (proto3 omits
  zero-valued fields: no ``total_wasted_cycles`` when nothing waits)."""
  m = re.search(_STAT.format(field), block)
  return float(m.group(1)) if m else 0.0


def busy_us(texts: list[str]) -> float:
  """:func:`scheduled_busy_us` of the dumped schedule texts
  (:func:`schedule_texts`), in microseconds of XLA's clock.

  Raises:
    ValueError: no computation schedule in ``texts``, or one without busy
      cycles or without ``cycles_per_microsecond``.
  """
  best = None
  for text in texts:
    for block in text.split("computation_schedules {")[1:]:
      total = _stat(block, "total_cycles")
      if best is None or total > best[0]:
        best = (total, _stat(block, "total_wasted_cycles"),
                _stat(block, "cycles_per_microsecond"))
  if best is None:
    raise ValueError("XLA wrote no latency-hiding schedule (no "
                     "computation_schedules in a *.schedule.txt): did its "
                     "scheduler run?")
  total, wasted, per_us = best
  if not total > wasted or not per_us > 0:
    raise ValueError(
        f"XLA's latency-hiding schedule gives no busy time (total_cycles "
        f"{total:g}, total_wasted_cycles {wasted:g}, cycles_per_microsecond "
        f"{per_us:g}) to rescale the transfer times with.")
  return (total - wasted) / per_us


def scheduled_busy_us(dump_dir: str) -> float:
  """XLA's estimate of a program's busy time, from its scheduler's dump.

  Reads the ``*.schedule.txt`` that ``xla_dump_latency_hiding_schedule``
  writes into ``xla_dump_to`` (an ``xla.ScheduleProto`` in text form): for
  the computation with the longest schedule (the step's entry), its
  ``total_cycles`` minus ``total_wasted_cycles`` (time spent waiting on a
  collective), over ``cycles_per_microsecond``. The text form omits
  zero-valued fields (proto3): a missing field is 0, e.g. no
  ``total_wasted_cycles`` when no instruction waits.

  Returns:
    Microseconds on the latency-hiding scheduler's clock.

  Raises:
    ValueError: no schedule file or computation in ``dump_dir``, or a
      longest computation without busy cycles or without
      ``cycles_per_microsecond``.
  """
  try:
    return busy_us(schedule_texts(dump_dir))
  except ValueError as e:
    raise ValueError(f"{dump_dir!r}: {e}") from None


def collective_costs(report: overlap_lib.OverlapReport, collective_us,
                     distinct_round: int | None = None) -> dict[str, float]:
  """Microseconds for each asynchronous collective of a compiled program.

  Args:
    report: :func:`~decentral_jax.analysis.overlap.overlap_report` of the
      program.
    collective_us: a number of microseconds (every collective) or a
      function ``(collective, distinct_round) -> microseconds``.
    distinct_round: the program's distinct round, passed to the function.

  Returns:
    ``{start instruction name: microseconds}`` (synchronous collectives
    are left out: they cannot overlap anything).

  Raises:
    ValueError: a time that is not a finite number > 0.
  """
  out = {}
  for c in report.collectives:
    if c.is_async:
      us = (collective_us(c, distinct_round) if callable(collective_us)
            else collective_us)
      out[c.name] = checks.check_float(f"collective_us of {c.name}", us,
                                       minimum=0.0, open_min=True)
  return out


def fingerprint(compiled_or_text) -> str:
  """XLA's fingerprint of the module before scheduling (hex string).

  Read from the ``fingerprint_before_lhs`` attribute of the compiled text
  (``compiled.as_text()``, XLA:GPU only). A profile entry named
  ``FINGERPRINT::instruction`` applies to that module alone, so one file
  can hold the profiles of several programs.

  Raises:
    ValueError: the text has no such attribute (not an XLA:GPU program).
  """
  text = (compiled_or_text if isinstance(compiled_or_text, str)
          else compiled_or_text.as_text())
  m = _FINGERPRINT.search(text[:200_000])
  if m is None:
    raise ValueError("the compiled program has no fingerprint_before_lhs "
                     "attribute: latency profiles need an XLA:GPU program.")
  return m.group(1)


def latency_profile(costs_us: Mapping[str, float],
                    module_fingerprint: str = "") -> str:
  """A ``tensorflow.profiler.ProfiledInstructionsProto`` in text form.

  One ``costs { name: "..." cost_us: ... }`` entry per instruction: what
  XLA's profile-guided latency estimator reads from
  :data:`PROFILE_OPTION`. For an asynchronous collective the cost of its
  start is the latency between start and done that the scheduler tries to
  cover with other work.

  Args:
    costs_us: ``{instruction name: microseconds}``.
    module_fingerprint: if given (:func:`fingerprint`), names are written
      ``FINGERPRINT::name`` and apply to that module only.

  Raises:
    ValueError: a name with a quote, backslash or line break, or a cost
      that is not a finite number >= 0.
  """
  prefix = f"{module_fingerprint}::" if module_fingerprint else ""
  lines = []
  for name, us in costs_us.items():
    if not name or any(ch in name for ch in '"\\\n'):
      raise ValueError(f"latency_profile: instruction name {name!r} must be "
                       f"non-empty, without quotes, backslashes or newlines.")
    us = checks.check_float(f"cost of {name}", us, minimum=0.0)
    lines.append(f'costs {{ name: "{prefix}{name}" cost_us: {us:.3f} }}')
  return "\n".join(lines) + "\n"


def cluster_collective_us(exp: experiment_lib.Experiment,
                          cluster: Cluster
                          ) -> Callable[[Any, int | None], float]:
  """The runtime model's transfer time of each collective, in microseconds.

  For :func:`compile_programs`' ``collective_us``. A collective of a
  program that runs one distinct round of the gossip topology takes
  :func:`decentral_jax.runtime_model.round_cost` of that round for its
  bytes (group means for a partition, else the round's permutes; the
  slowest worker); the consensus distance's All-Reduce (``diagnostics`` in
  its ``op_name``), the collectives of programs with all rounds in one or
  without a topology (All-Reduce, DiLoCo syncs) take
  :func:`~decentral_jax.runtime_model.all_reduce_cost`.

  Args:
    exp: the experiment the programs belong to.
    cluster: a :class:`decentral_jax.runtime_model.costs.Cluster` of
      ``exp``'s workers, e.g. ``runtime_model.presets.cluster("A40", 8)``
      (4 A40s per node on PCIe 4.0, 25 Gbit/s Ethernet).

  Raises:
    ValueError: the cluster has another number of workers than ``exp``.
  """
  n = int(exp.config.n_workers)
  if cluster.n_workers != n:
    raise ValueError(f"cluster has n_workers={cluster.n_workers} but the "
                     f"experiment has {n} workers; build the cluster for "
                     f"{n}.")
  rounds = (exp.topology.distinct_rounds if exp.topology is not None
            else ())
  all_reduce = all_reduce_cost(cluster)

  def time_us(c, distinct_round):
    if ("diagnostics" in c.op_name or distinct_round is None
        or not 0 <= distinct_round < len(rounds)):
      cost = all_reduce
    else:
      cost = round_cost(cluster, rounds[distinct_round])
    return 1e6 * float(np.max(cost.time(c.bytes)))

  return time_us


__all__ = ("PROFILE_OPTION", "busy_us", "cluster_collective_us",
           "collective_costs", "fingerprint", "latency_profile",
           "schedule_texts", "scheduled_busy_us")
