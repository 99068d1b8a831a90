"""The scheduled step as a timeline: compute phases and collectives on a clock.

Walks the entry computation of a scheduled HLO module (the order XLA:GPU
issues its instructions, see :mod:`decentral_jax.analysis.overlap`) on one
compute stream: each compute instruction takes its cost, one after the
other; an asynchronous collective starts when its ``-start`` is issued and
its ``-done`` waits until the transfer has taken its cost (the compute
stream stalls there if the transfer is not finished). The result is a
:class:`Timeline`: the forward / backward / other phases of the compute
stream (consecutive instructions of one phase merged into one bar, with
their matmul FLOPs) and every collective of the entry computation from
start to done.

The clock (microseconds) is the profile's where it prices an instruction
(``costs``: ``{instruction name: us}``, e.g. from :func:`read_profile`, the
``ProfiledInstructionsProto`` text a latency profile or a measured XLA
profile holds), else a stated fallback: ``flops / flops_per_us +
instructions x us_per_instruction`` (defaults: 50% of an H100/H200's dense
bfloat16 peak, 989 TFLOP/s, and 2 us per kernel), and 0 for a collective's
transfer without a cost (it then ends at its ``-done``'s issue). A
``while`` / ``conditional`` / ``call`` is one instruction whose work is its
callees' (a loop body once, as the overlap report counts it); collectives
inside such callees are not drawn.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from decentral_jax.analysis import hlo
from decentral_jax.analysis import overlap

#: Fallback compute rate: half of the H100/H200 SXM dense bfloat16 peak
#: (989 TFLOP/s, NVIDIA data sheet), in FLOPs per microsecond.
DEFAULT_FLOPS_PER_US = 0.5 * 989e12 / 1e6
#: Fallback cost of one compute instruction (a kernel launch and its
#: memory traffic), microseconds.
DEFAULT_US_PER_INSTRUCTION = 2.0
PHASES = ("forward", "backward", "other")


@dataclasses.dataclass(frozen=True)
class PhaseBar:
  """Consecutive compute instructions of one phase on the compute stream."""
  phase: str  # "forward", "backward" or "other"
  start_us: float
  end_us: float
  flops: float  # their matmul FLOPs
  instructions: int


@dataclasses.dataclass(frozen=True)
class CollectiveBar:
  """One collective of the entry computation from its start to its done."""
  name: str  # the (start) instruction
  kind: str
  bytes: float  # operand bytes of one device
  op_name: str
  is_async: bool
  start_us: float  # issued
  done_us: float  # its done issued (after the transfer's end)
  transfer_us: float | None  # the transfer's cost (None: not priced)
  flops_in_flight: float  # matmul FLOPs of the compute between the two


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The step's compute phases and collectives on one clock (us)."""
  phases: tuple[PhaseBar, ...]
  collectives: tuple[CollectiveBar, ...]
  total_us: float
  clock: str  # how the durations were obtained (for a plot's axis)

  def phase_us(self) -> dict[str, float]:
    """Microseconds of the compute stream in each phase."""
    out = dict.fromkeys(PHASES, 0.0)
    for p in self.phases:
      out[p.phase] += p.end_us - p.start_us
    return out


# A protobuf text-format double: a decimal number, or nan/inf (refused).
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
                     r"|[-+]?(?:nan|inf|infinity)", re.IGNORECASE)


def read_profile(text: str) -> dict[str, float]:
  """``{instruction name: us}`` from ``ProfiledInstructionsProto`` text
  (``costs { name: "..." cost_us: ... }`` blocks; latencies are ignored).

  Every ``costs`` block must name its instruction and give ``cost_us`` as
  a finite number of microseconds ``>= 0`` (proto3: a block without
  ``cost_us`` costs 0); nothing is dropped.

  Raises:
    ValueError: text with no ``costs`` block; a block (named by its line
      and instruction) without a name, with a cost that is not a number
      (``1e``), not finite (``nan``, ``inf``) or negative, or naming an
      instruction another block named.
  """
  blocks = list(re.finditer(r"\bcosts\s*\{([^}]*)\}", text))
  if not blocks:
    raise ValueError("no 'costs { name: \"..\" cost_us: .. }' block in the "
                     "profile text.")
  costs = {}
  for block in blocks:
    line = text.count("\n", 0, block.start()) + 1
    name = re.search(r'\bname\s*:\s*"([^"]*)"', block.group(1))
    if name is None or not name.group(1):
      raise ValueError(f"line {line}: a costs block without an instruction "
                       "name; give name: \"INSTRUCTION\".")
    where = f"line {line} (instruction {name.group(1)!r})"
    raw = re.search(r"\bcost_us\s*:\s*([^\s}]*)", block.group(1))
    token = raw.group(1) if raw else "0"
    if not _NUMBER.fullmatch(token):
      raise ValueError(f"{where}: cost_us {token!r} is not a number; give "
                       "microseconds such as 12.5.")
    us = float(token)
    if not (math.isfinite(us) and us >= 0):
      raise ValueError(f"{where}: cost_us {token} is not a finite number of "
                       "microseconds >= 0; give the instruction's time.")
    if name.group(1) in costs:
      raise ValueError(f"{where}: the instruction has a cost already; give "
                       "each instruction once.")
    costs[name.group(1)] = us
  return costs


def _phase_of(counts: dict) -> str:
  """The phase with the most FLOPs (else instructions) of an instruction."""
  by_flops = {p: counts.get(f"flops_{p}", 0.0) for p in PHASES}
  if any(by_flops.values()):
    return max(PHASES, key=lambda p: by_flops[p])
  return max(PHASES, key=lambda p: counts.get(p, 0))


class _Clock:
  """The compute stream's clock and its merged phase bars."""

  def __init__(self, costs, flops_per_us, us_per_instruction):
    self.costs, self.rate, self.per = costs, flops_per_us, us_per_instruction
    self.now, self.bars = 0.0, []

  def run(self, name: str, counts: dict) -> float:
    n = sum(counts.get(p, 0) for p in PHASES)
    flops = counts.get("flops", 0.0)
    us = self.costs.get(name)
    if us is None:
      us = flops / self.rate + n * self.per
    phase, start = _phase_of(counts), self.now
    self.now += float(us)
    last = self.bars[-1] if self.bars else None
    if last is not None and last["phase"] == phase and last["end"] == start:
      last["end"], last["flops"] = self.now, last["flops"] + flops
      last["n"] += n
    else:
      self.bars.append({"phase": phase, "start": start, "end": self.now,
                        "flops": flops, "n": n})
    return flops


def step_timeline(compiled_or_text: Any,
                  costs: Mapping[str, float] | None = None, *,
                  flops_per_us: float = DEFAULT_FLOPS_PER_US,
                  us_per_instruction: float = DEFAULT_US_PER_INSTRUCTION
                  ) -> Timeline:
  """The timeline of a scheduled program (module docstring).

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` or the text of a scheduled
      HLO module.
    costs: optional ``{instruction name: us}`` (compute instructions and
      collectives' ``-start`` instructions); others take the fallback.
    flops_per_us, us_per_instruction: the fallback's rates (> 0, >= 0).

  Returns:
    A :class:`Timeline`.

  Raises:
    ValueError: unparsable text, a module that is not scheduled
      (``is_scheduled=true`` missing: its order is not the issue order), or
      a rate out of range.
  """
  if not flops_per_us > 0 or not us_per_instruction >= 0:
    raise ValueError(f"step_timeline: flops_per_us={flops_per_us} must be "
                     f"> 0 and us_per_instruction={us_per_instruction} >= 0.")
  text = hlo.hlo_text(compiled_or_text, "optimized")
  if "is_scheduled=true" not in text.split("\n", 1)[0]:
    raise ValueError("step_timeline: the HLO module is not scheduled "
                     "(compile for a GPU target: tools/gpu_compile).")
  comps, entry, _ = hlo.parse_module(text)
  counts_of = overlap.instruction_compute(comps)
  costs = dict(costs or {})
  clock = _Clock(costs, flops_per_us, us_per_instruction)
  instrs = comps[entry]
  shapes = {i.name: i.shape for i in instrs}
  open_, done = {}, []
  for ins in instrs:
    kind = hlo.collective_kind(ins.opcode)
    if ins.opcode == "async-start":
      kind = hlo.wrapped_collective_kind(ins, comps)
    if kind is not None:
      open_[ins.name] = _collective(ins, kind, shapes, costs, clock.now)
      if not ins.opcode.endswith("-start"):  # synchronous: runs in place
        clock.now += open_[ins.name]["transfer"] or 0.0
        done.append(_close(open_.pop(ins.name), clock.now))
      continue
    if ins.opcode.endswith("-done"):
      for nm in hlo.operand_names(ins.operands):
        if nm in open_:
          row = open_.pop(nm)
          clock.now = max(clock.now, row["start"] + (row["transfer"] or 0.0))
          done.append(_close(row, clock.now))
      continue
    counts = counts_of(ins, shapes)
    if counts:
      flops = clock.run(ins.name, counts)
      for row in open_.values():
        row["flops"] += flops
  return Timeline(
      tuple(PhaseBar(b["phase"], b["start"], b["end"], b["flops"], b["n"])
            for b in clock.bars),
      tuple(sorted(done, key=lambda c: (c.start_us, c.name))), clock.now,
      (f"profile for {len(costs)} instructions, else " if costs else "")
      + f"fallback: {flops_per_us * 1e6 / 1e12:g} TFLOP/s, "
      f"{us_per_instruction:g} us per instruction")


def _collective(ins, kind, shapes, costs, now) -> dict:
  names = hlo.operand_names(ins.operands)
  if kind == "collective-permute" and hlo.attribute(ins.attrs, "slice_sizes"):
    names = names[:1]
  size = float(sum(hlo.shape_bytes(hlo.strip_layout(shapes[n]))
                   for n in names if n in shapes))
  return {"name": ins.name, "kind": kind, "bytes": size,
          "op_name": hlo.op_name(ins),
          "is_async": (ins.opcode.endswith("-start")
                       and '"is_sync":true' not in ins.attrs.replace(" ", "")),
          "start": now, "transfer": costs.get(ins.name), "flops": 0.0}


def _close(row: dict, now: float) -> CollectiveBar:
  return CollectiveBar(row["name"], row["kind"], row["bytes"],
                       row["op_name"], row["is_async"], row["start"], now,
                       row["transfer"], row["flops"])


__all__ = ("CollectiveBar", "PhaseBar", "Timeline", "read_profile",
           "step_timeline")
