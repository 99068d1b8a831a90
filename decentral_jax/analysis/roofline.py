"""Roofline prices of every instruction of a scheduled GPU program.

XLA:GPU's latency-hiding scheduler needs a time for each instruction to
decide how early a collective must start. Compiled without a GPU it has no
measured kernel times: a deviceless compile skips autotuning, and its cost
model prices some GEMMs far off (GPT-2 small's ``attn/c_attn`` weight
gradient at 9.19 ms for H200, about 0.1 ms at the GPU's peak), so the
scheduler believes the late backward alone hides the gossip.
:func:`instruction_costs` prices each compute instruction of the scheduled
computations (entry, loop bodies, conditional branches) by a roofline::

    t = max(F / (e_f * P), B / (e_b * W))

with ``F`` its matmul FLOPs (``2 m n k`` per ``dot``, fused or cuBLAS),
``B`` the bytes it reads and writes (operands plus result), ``P`` the
target's dense peak FLOP/s, ``W`` its HBM bandwidth (bytes/s), ``e_f`` the
GEMM efficiency and ``e_b`` the memory efficiency (:class:`Roofline`;
Williams, Waterman and Patterson, "Roofline", CACM 2009). Every operand is
counted whole: a fusion that reads a slice of a large buffer, or updates
one in place, is priced at the whole buffer (an upper bound).

:func:`xla_instruction_us` reads XLA's own estimate of each instruction from
its scheduler's dump (``xla_dump_latency_hiding_schedule``), and
:func:`class_table` sums both by class (GEMM, other fusion, other), the
comparison docs/gpu_overlap.md shows.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from decentral_jax import checks
from decentral_jax.analysis import hlo
from decentral_jax.analysis import overlap as overlap_lib

#: Instruction classes of :class:`InstructionCost`, in table order.
CLASSES = ("gemm", "fusion", "other")
_CONTROL = ("while", "conditional", "call")


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A GPU's roofline with the efficiencies a real kernel reaches.

  Attributes:
    peak_flops: dense matmul peak of the compute dtype, FLOP/s (H100 SXM /
      H200 bfloat16: 989.4e12).
    memory_bandwidth: HBM bandwidth, bytes/s (H100 SXM: 3.35e12).
    gemm_efficiency: share of ``peak_flops`` a GEMM reaches (0 < e <= 1;
      default 0.5).
    memory_efficiency: share of ``memory_bandwidth`` a memory-bound kernel
      reaches (0 < e <= 1; default 0.7).

  Raises:
    ValueError: a field that is not a finite number in its range.
  """

  peak_flops: float
  memory_bandwidth: float
  gemm_efficiency: float = 0.5
  memory_efficiency: float = 0.7

  def __post_init__(self):
    for field in ("peak_flops", "memory_bandwidth"):
      checks.check_float(f"Roofline.{field}", getattr(self, field),
                         minimum=0.0, open_min=True)
    for field in ("gemm_efficiency", "memory_efficiency"):
      checks.check_float(f"Roofline.{field}", getattr(self, field),
                         minimum=0.0, maximum=1.0, open_min=True)

  def time_us(self, flops: float, nbytes: float) -> float:
    """``max(flops / (e_f P), bytes / (e_b W))`` in microseconds."""
    return 1e6 * max(flops / (self.gemm_efficiency * self.peak_flops),
                     nbytes / (self.memory_efficiency
                               * self.memory_bandwidth))


@dataclasses.dataclass(frozen=True)
class InstructionCost:
  """One compute instruction and its roofline time.

  Attributes:
    name: instruction name (unique in the module; the key of a latency
      profile).
    computation: the computation that schedules it.
    kind: ``"gemm"`` (matmul FLOPs > 0), ``"fusion"`` (another fusion) or
      ``"other"`` (copy, transpose, custom call, ...).
    flops: matmul FLOPs.
    bytes: operand plus result bytes.
    us: :meth:`Roofline.time_us` of both, microseconds.
  """

  name: str
  computation: str
  kind: str
  flops: float
  bytes: float
  us: float


def _is_compute(ins: hlo.Instruction) -> bool:
  op = ins.opcode
  return not (op in overlap_lib.NON_COMPUTE or op in _CONTROL
              or hlo.collective_kind(op) or op.endswith("-done")
              or op.endswith("-start") or op.endswith("-update"))


def _bytes(ins: hlo.Instruction, shapes: Mapping[str, str]) -> float:
  names = dict.fromkeys(hlo.operand_names(ins.operands))
  total = hlo.shape_bytes(hlo.strip_layout(ins.shape))
  for n in names:
    if n in shapes:
      total += hlo.shape_bytes(hlo.strip_layout(shapes[n]))
  return total


def instruction_costs(compiled_or_text: Any,
                      roofline: Roofline) -> tuple[InstructionCost, ...]:
  """The roofline time of every compute instruction of a scheduled program.

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` or the text of a scheduled
      HLO module (``compiled.as_text()``).
    roofline: the target's :class:`Roofline`.

  Returns:
    One :class:`InstructionCost` per compute instruction of the entry and
    of every loop body, condition, conditional branch and call it reaches
    (data movement, bookkeeping, control flow and collectives left out),
    in text order.

  Raises:
    ValueError: text that cannot be parsed
      (:func:`decentral_jax.analysis.hlo.parse_module`).
  """
  text = hlo.hlo_text(compiled_or_text, "optimized")
  comps, entry, _ = hlo.parse_module(text)
  flops_of = overlap_lib.matmul_flops(comps)
  out = []
  for comp in overlap_lib.scheduled_computations(comps, entry):
    instrs = comps.get(comp, ())
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      if not _is_compute(ins):
        continue
      flops, nbytes = flops_of(ins, shapes), _bytes(ins, shapes)
      kind = ("gemm" if flops > 0 else
              "fusion" if ins.opcode == "fusion" else "other")
      out.append(InstructionCost(ins.name, comp, kind, flops, nbytes,
                                 roofline.time_us(flops, nbytes)))
  return tuple(out)


_NAME_LINE = re.compile(r'^      name: "([^"]+)"$')
_ID_LINE = re.compile(r"^      id: (\d+)$")
_FIELD = re.compile(r"^    (id|start_timestamp_cycles|end_timestamp_cycles):"
                    r" ([0-9.eE+-]+)$")
_PER_US = re.compile(r"^  cycles_per_microsecond: ([0-9.eE+-]+)$", re.M)


def _names_by_id(text: str) -> dict[int, str]:
  names, last = {}, None
  for line in text[:text.find("\ncomputation_schedules {")].splitlines():
    m = _NAME_LINE.match(line)
    if m:
      last = m.group(1)
      continue
    m = _ID_LINE.match(line)
    if m and last is not None:
      names[int(m.group(1))] = last
      last = None
  return names


def xla_instruction_us(schedule_texts: Iterable[str]) -> dict[str, float]:
  """XLA's estimate of each scheduled instruction, in microseconds.

  Args:
    schedule_texts: the ``*.schedule.txt`` files (``xla.ScheduleProto`` in
      text form) that ``xla_dump_latency_hiding_schedule`` writes into
      ``xla_dump_to``.

  Returns:
    ``{instruction name: end minus start timestamp over the computation's
    cycles_per_microsecond}`` for every instruction of every computation
    schedule (a missing timestamp is 0: proto3 omits zeros).
  """
  out: dict[str, float] = {}
  for text in schedule_texts:
    names = _names_by_id(text)
    for block in text.split("\ncomputation_schedules {")[1:]:
      rows, row = [], None
      for line in block.splitlines():
        m = _FIELD.match(line)
        if not m:
          continue
        if m.group(1) == "id":
          row = {"id": int(m.group(2))}
          rows.append(row)
        elif row is not None:
          row[m.group(1)] = float(m.group(2))
      m = _PER_US.search(block)
      scale = float(m.group(1)) if m and float(m.group(1)) > 0 else 1.0
      for r in rows:
        if r["id"] in names:
          out[names[r["id"]]] = (r.get("end_timestamp_cycles", 0.0)
                                 - r.get("start_timestamp_cycles", 0.0)
                                 ) / scale
  return out


def class_table(costs: Iterable[InstructionCost],
                xla_us: Mapping[str, float] | None = None
                ) -> dict[str, dict[str, float]]:
  """Roofline and XLA times summed by instruction class.

  Args:
    costs: :func:`instruction_costs` of a program.
    xla_us: :func:`xla_instruction_us` of the same program (optional).

  Returns:
    ``{class: {"count", "flops", "bytes", "roofline_us", "xla_us",
    "xla_found"}}`` for each of :data:`CLASSES` and ``"total"``;
    ``xla_us`` sums the instructions XLA's dump names (``xla_found`` of
    them).
  """
  keys = ("count", "flops", "bytes", "roofline_us", "xla_us", "xla_found")
  table = {k: dict.fromkeys(keys, 0.0) for k in CLASSES + ("total",)}
  for c in costs:
    for k in (c.kind, "total"):
      row = table[k]
      row["count"] += 1
      row["flops"] += c.flops
      row["bytes"] += c.bytes
      row["roofline_us"] += c.us
      if xla_us and c.name in xla_us:
        row["xla_us"] += xla_us[c.name]
        row["xla_found"] += 1
  return table


def in_flight_us(compiled_or_text: Any, costs_us: Mapping[str, float]
                 ) -> tuple[dict[str, float], float]:
  """Priced compute scheduled while each asynchronous collective moves data.

  Walks every scheduled computation in its issue order: between a
  ``-start`` and its ``-done``, each instruction adds its price
  (``costs_us``, e.g. ``{c.name: c.us for c in instruction_costs(...)}``;
  a ``while`` / ``conditional`` / ``call`` adds its callees' prices, a
  loop body once) to the window of every collective then open.

  Args:
    compiled_or_text: a scheduled program or its text.
    costs_us: ``{instruction name: microseconds}``; unnamed ones cost 0.

  Returns:
    ``({start name: microseconds}, union)``: each asynchronous (not
    ``is_sync``) collective's window, and the microseconds of compute
    while at least one collective outside a conditional is open.
  """
  text = hlo.hlo_text(compiled_or_text, "optimized")
  comps, entry, _ = hlo.parse_module(text)
  contexts = overlap_lib.scheduled_computations(comps, entry)
  totals: dict[str, float] = {}

  def cost(ins) -> float:
    if ins.opcode not in _CONTROL:
      return costs_us.get(ins.name, 0.0)
    return sum(total(sub) for key, subs in hlo.called_computations(
        ins).items() if key != "to_apply" or ins.opcode == "call"
               for sub in subs)

  def total(comp) -> float:
    if comp not in totals:
      totals[comp] = 0.0
      totals[comp] = sum(cost(i) for i in comps.get(comp, ()))
    return totals[comp]

  windows, union = {}, 0.0
  for comp, (in_cond, _) in contexts.items():
    open_: set[str] = set()
    for ins in comps[comp]:
      starts = ins.opcode == "async-start" or (
          ins.opcode.endswith("-start") and hlo.collective_kind(ins.opcode))
      if starts and not re.search(
          r'"is_sync"\s*:\s*true', ins.attrs):
        windows[ins.name] = 0.0
        open_.add(ins.name)
      elif ins.opcode.endswith("-done"):
        open_.difference_update(hlo.operand_names(ins.operands))
      elif open_:
        t = cost(ins)
        for name in open_:
          windows[name] += t
        union += 0.0 if in_cond else t
  return windows, union


def format_class_table(table: Mapping[str, Mapping[str, float]]) -> str:
  """:func:`class_table` as a text table (milliseconds)."""
  lines = [f"  {'class':<8} {'count':>6} {'TFLOP':>8} {'GB':>8} "
           f"{'XLA ms':>9} {'roofline ms':>11}"]
  for k in CLASSES + ("total",):
    r = table[k]
    lines.append(f"  {k:<8} {r['count']:>6.0f} {r['flops'] / 1e12:>8.3f} "
                 f"{r['bytes'] / 1e9:>8.2f} {r['xla_us'] / 1e3:>9.2f} "
                 f"{r['roofline_us'] / 1e3:>11.2f}")
  return "\n".join(lines)


__all__ = ("CLASSES", "InstructionCost", "Roofline", "class_table",
           "format_class_table", "in_flight_us", "instruction_costs",
           "xla_instruction_us")
