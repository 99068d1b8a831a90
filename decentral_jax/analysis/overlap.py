"""Which collectives of a compiled step overlap the forward/backward pass.

Reads the optimized, *scheduled* HLO that XLA:GPU prints for a compiled
program (``compiled.as_text()``; the module header says
``is_scheduled=true``; also obtainable on a CPU-only machine by compiling
for a GPU target, see :mod:`decentral_jax.tools.gpu_compile`). In that text
the instructions of every computation are listed in the order they are
issued, and an asynchronous collective is a ``-start`` / ``-done`` pair
(``collective-permute-start``, ``all-reduce-start``, ``all-gather-start``,
or ``async-start`` wrapping a ``reduce-scatter`` / ``all-to-all``): the
transfer runs while the instructions scheduled between the two halves
execute. XLA marks a pair it chose to run synchronously (nothing useful
between the halves) with ``"is_sync":true`` in the start's backend config.

For every collective of the program :func:`overlap_report` gives

* its kind, bytes (operand bytes of one device) and ``op_name``;
* ``is_async``: a start/done pair that is not ``is_sync``;
* ``in_conditional``: it sits in a branch of a ``conditional`` (e.g. a
  ``lax.switch`` over gossip rounds, a ``lax.cond`` taken on logging
  steps); such a collective can only overlap work of its own branch, never
  the forward/backward pass outside the conditional;
* the compute instructions scheduled between start and done, split by
  their ``op_name`` metadata into *forward* (``jvp(`` in the name, not
  transposed), *backward* (``transpose(jvp(``) and *other* (optimizer,
  gossip arithmetic, diagnostics). Instructions of a ``while`` /
  ``conditional`` / ``call`` scheduled in between count with their callees'
  compute instructions (a loop body once);
* ``overlapped``: asynchronous, outside any conditional, with model compute
  in flight: matrix multiplies (when the program has any; a GPT's forward
  and backward are mostly GEMMs), else at least one forward or backward
  instruction; otherwise the collective is *exposed* (its transfer time
  adds to the step, unless other work of the same stream happens to hide
  it).

Compute instructions are all instructions except data movement and
bookkeeping (``parameter``, ``constant``, ``get-tuple-element``, ``tuple``,
``bitcast``, ``copy-start``/``-done``, collectives, ``async-*``, ``send``/
``recv``, ...). A count is an instruction count, not time: a large GEMM and
a small fusion count one each.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Sequence

from decentral_jax.analysis import hlo

#: Opcodes that are not compute (data movement, bookkeeping, communication).
NON_COMPUTE = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "copy-start", "copy-done", "async-start", "async-update", "async-done",
    "send", "send-done", "recv", "recv-done", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "domain", "iota",
    "get-dimension-size"))
#: Control flow whose callees' instructions count as scheduled in between.
_CONTROL = ("while", "conditional", "call")

_SYNC = re.compile(r'"is_sync"\s*:\s*true')


@dataclasses.dataclass(frozen=True)
class CollectiveOverlap:
  """One collective of a compiled program and what runs while it moves data.

  Attributes:
    kind: one of :data:`decentral_jax.analysis.hlo.KINDS`.
    name: name of the (start) instruction.
    computation: the HLO computation that holds it.
    op_name: its ``op_name`` metadata (``""`` if none), e.g.
      ``jit(step)/shard_map/ppermute``.
    bytes: operand bytes of one device (float, bytes).
    is_async: a start/done pair not marked ``is_sync``.
    in_conditional: inside a branch of a ``conditional`` (at any depth).
    in_loop: inside a ``while`` body or condition.
    forward, backward, other: compute instructions between start and done
      (0 for a synchronous collective).
    flops: matrix-multiply FLOPs (``2 m n k`` of every ``dot``, in fusions
      too, and cuBLAS GEMM custom calls) between start and done.
    overlapped: asynchronous, outside conditionals, with model compute in
      flight (``flops > 0`` if the program has matrix multiplies, else
      ``forward + backward > 0``); False means exposed.
  """

  kind: str
  name: str
  computation: str
  op_name: str
  bytes: float
  is_async: bool
  in_conditional: bool
  in_loop: bool
  forward: int
  backward: int
  other: int
  flops: float = 0.0
  overlapped: bool = False

  @property
  def between(self) -> int:
    """All compute instructions between start and done."""
    return self.forward + self.backward + self.other


@dataclasses.dataclass(frozen=True)
class OverlapReport:
  """Every collective of a compiled program with its overlap (see module).

  Attributes:
    collectives: one :class:`CollectiveOverlap` per collective, in text
      order.
    scheduled: the module header says ``is_scheduled=true`` (without it the
      instruction order is not the execution order and the counts mean
      nothing; XLA:CPU's text is not scheduled this way).
    total_flops: matrix-multiply FLOPs of the whole program (loop bodies
      and every branch of a conditional counted once).
    flops_in_flight: matrix-multiply FLOPs scheduled while at least one
      asynchronous collective outside conditionals is in flight (each
      instruction once, however many collectives it overlaps).
    forward_flops, backward_flops: the program's matmul FLOPs of the
      forward (``jvp(``) and backward (``transpose(jvp(``) pass.
    forward_flops_in_flight, backward_flops_in_flight: the part of each
      scheduled while a collective is in flight (as ``flops_in_flight``).
  """

  collectives: tuple[CollectiveOverlap, ...]
  scheduled: bool
  total_flops: float = 0.0
  flops_in_flight: float = 0.0
  forward_flops: float = 0.0
  backward_flops: float = 0.0
  forward_flops_in_flight: float = 0.0
  backward_flops_in_flight: float = 0.0

  def in_flight_fractions(self) -> tuple[float, float]:
    """``(forward, backward)``: the share (0..1) of the forward and of the
    backward pass's matmul FLOPs that run while a collective is in flight
    (0 for a pass without matmuls).

    This is the part of the step's compute that can hide communication in
    the compiled program; :mod:`decentral_jax.runtime_model` takes it as
    ``Workload.gossip_in_flight`` (``docs/gpu_overlap.md``).
    """
    fwd = (self.forward_flops_in_flight / self.forward_flops
           if self.forward_flops else 0.0)
    bwd = (self.backward_flops_in_flight / self.backward_flops
           if self.backward_flops else 0.0)
    return fwd, bwd

  def flops_fraction(self, c: CollectiveOverlap) -> float:
    """Share of the program's matmul FLOPs in flight during ``c`` (0..1)."""
    return c.flops / self.total_flops if self.total_flops else 0.0

  def select(self, min_bytes: float = 0.0) -> tuple[CollectiveOverlap, ...]:
    """The collectives of at least ``min_bytes`` bytes."""
    return tuple(c for c in self.collectives if c.bytes >= min_bytes)

  def exposed(self, min_bytes: float = 0.0) -> tuple[CollectiveOverlap, ...]:
    """The collectives of at least ``min_bytes`` bytes that do not overlap."""
    return tuple(c for c in self.select(min_bytes) if not c.overlapped)

  def summary(self, min_bytes: float = 0.0) -> str:
    """A table: one line per collective of at least ``min_bytes`` bytes."""
    rows = self.select(min_bytes)
    lines = [f"{len(rows)} collective(s)"
             + ("" if self.scheduled else " (module not scheduled)") + ":",
             f"  {'kind':<19} {'bytes':>12} {'async':>5} {'cond':>4} "
             f"{'fwd':>4} {'bwd':>4} {'other':>5} {'flops%':>6}  verdict"
             "     op_name"]
    for c in rows:
      lines.append(
          f"  {c.kind:<19} {c.bytes:>12,.0f} {'yes' if c.is_async else 'no':>5}"
          f" {'yes' if c.in_conditional else 'no':>4} {c.forward:>4} "
          f"{c.backward:>4} {c.other:>5} "
          f"{100 * self.flops_fraction(c):>6.1f}  "
          f"{'overlapped' if c.overlapped else 'EXPOSED':<10}  "
          f"{_short(c.op_name)}")
    return "\n".join(lines)

  def to_json(self) -> str:
    """The report as JSON (a list of collectives with their verdicts)."""
    fwd, bwd = self.in_flight_fractions()
    return json.dumps({"scheduled": self.scheduled,
                       "total_flops": self.total_flops,
                       "flops_in_flight": self.flops_in_flight,
                       "forward_flops": self.forward_flops,
                       "backward_flops": self.backward_flops,
                       "forward_flops_in_flight": self.forward_flops_in_flight,
                       "backward_flops_in_flight":
                           self.backward_flops_in_flight,
                       "in_flight_fractions": {"forward": fwd,
                                               "backward": bwd},
                       "collectives": [
        {**dataclasses.asdict(c), "between": c.between}
        for c in self.collectives]}, indent=1)


def _short(op_name: str) -> str:
  return op_name.split("shard_map/", 1)[-1] if op_name else "-"


def _contexts(comps, entry) -> dict[str, tuple[bool, bool]]:
  """``{computation: (in_conditional, in_loop)}`` for everything reachable.

  Reduction computations (``to_apply``) and the computations that an
  ``async-start`` wraps are left out: they hold no schedule of their own.
  """
  out: dict[str, tuple[bool, bool]] = {}
  todo = [(entry, (False, False))]
  while todo:
    comp, flags = todo.pop()
    old = out.get(comp, (False, False))
    new = (flags[0] or old[0], flags[1] or old[1])
    if (comp in out and new == old) or comp not in comps:
      continue
    out[comp] = new
    for ins in comps[comp]:
      if ins.opcode == "async-start":
        continue
      for key, subs in hlo.called_computations(ins).items():
        if key == "to_apply" and ins.opcode != "call":
          continue
        sub_flags = (new[0] or ins.opcode == "conditional",
                     new[1] or ins.opcode == "while")
        todo.extend((s, sub_flags) for s in subs)
  return out


def _phase(ins: hlo.Instruction) -> str:
  """``"backward"``, ``"forward"`` or ``"other"`` from ``op_name``."""
  name = hlo.op_name(ins)
  if "transpose(jvp(" in name:
    return "backward"
  if "jvp(" in name:
    return "forward"
  return "other"


_ZERO = {"forward": 0, "backward": 0, "other": 0, "flops": 0.0}
#: Matmul FLOPs by phase, counted next to ``_ZERO``'s keys.
_PHASE_FLOPS = {"flops_forward": 0.0, "flops_backward": 0.0,
                "flops_other": 0.0}


def _dims(shape: str) -> list[int]:
  m = hlo.ARRAY.search(shape)
  if not m:
    return []
  return [int(d.strip().lstrip("<=")) for d in m.group(2).split(",")
          if d.strip()]


def _dot_flops(ins: hlo.Instruction, shapes: dict[str, str]) -> float:
  """``2 x |output| x |contracted|`` of a ``dot`` or a cuBLAS GEMM call."""
  lhs = hlo.operand_names(ins.operands)[:1]
  if not lhs or lhs[0] not in shapes:
    return 0.0
  if ins.opcode == "dot":
    dims = hlo.attribute(ins.attrs, "lhs_contracting_dims") or "{}"
    contract = [int(x) for x in re.findall(r"\d+", dims)]
  else:
    m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]',
                  ins.attrs)
    contract = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []
  lhs_dims = _dims(shapes[lhs[0]])
  k = 1
  for d in contract:
    k *= lhs_dims[d] if d < len(lhs_dims) else 1
  out = 1
  for d in _dims(ins.shape):
    out *= d
  return 2.0 * out * k


class _Counter:
  """Compute instructions (and matmul FLOPs) of an instruction's work."""

  def __init__(self, comps):
    self.comps = comps
    self.cache: dict[str, dict] = {}
    self.flops_cache: dict[str, float] = {}

  def flops(self, comp: str) -> float:
    """Matmul FLOPs of a computation, its fusions and calls included."""
    if comp not in self.flops_cache:
      self.flops_cache[comp] = 0.0  # guards against recursion
      instrs = self.comps.get(comp, ())
      shapes = {i.name: i.shape for i in instrs}
      total = 0.0
      for ins in instrs:
        total += self.own_flops(ins, shapes)
      self.flops_cache[comp] = total
    return self.flops_cache[comp]

  def own_flops(self, ins: hlo.Instruction, shapes) -> float:
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and re.search(
        r'custom_call_target="__cublas', ins.attrs)):
      return _dot_flops(ins, shapes)
    if ins.opcode in ("fusion", "call"):
      return sum(self.flops(sub) for sub in
                 hlo.called_computations(ins).get("calls", []) +
                 hlo.called_computations(ins).get("to_apply", []))
    return 0.0

  def instruction(self, ins: hlo.Instruction, shapes) -> dict:
    if ins.opcode in _CONTROL:
      total = {**_ZERO, **_PHASE_FLOPS}
      for key, subs in hlo.called_computations(ins).items():
        if key == "to_apply" and ins.opcode != "call":
          continue
        for sub in subs:
          for k, v in self.computation(sub).items():
            total[k] += v
      return total
    if ins.opcode in NON_COMPUTE or hlo.collective_kind(ins.opcode) or \
        ins.opcode.endswith("-done"):
      return {}
    phase, flops = _phase(ins), self.own_flops(ins, shapes)
    return {phase: 1, "flops": flops, f"flops_{phase}": flops}

  def computation(self, comp: str) -> dict:
    if comp not in self.cache:
      self.cache[comp] = {**_ZERO, **_PHASE_FLOPS}  # guards recursion
      instrs = self.comps.get(comp, ())
      shapes = {i.name: i.shape for i in instrs}
      total = {**_ZERO, **_PHASE_FLOPS}
      for ins in instrs:
        for k, v in self.instruction(ins, shapes).items():
          total[k] += v
      self.cache[comp] = total
    return self.cache[comp]


def _operand_bytes(ins: hlo.Instruction, shapes: dict[str, str],
                   kind: str) -> float:
  names = hlo.operand_names(ins.operands)
  if kind == "collective-permute" and hlo.attribute(ins.attrs, "slice_sizes"):
    names = names[:1]  # in-place form: (input, output, offsets...)
  return float(sum(hlo.shape_bytes(hlo.strip_layout(shapes[n]))
                   for n in names if n in shapes))


def _scan(comp: str, instrs, comps, counter: _Counter, context, only=None):
  """The collectives of one computation with the work between their halves
  (the FLOPs in flight: while one of ``only``'s collectives is, if given)."""
  shapes = {i.name: i.shape for i in instrs}
  found, open_, in_flight = [], {}, dict(_PHASE_FLOPS)
  for ins in instrs:
    kind = hlo.collective_kind(ins.opcode)
    if ins.opcode == "async-start":
      kind = hlo.wrapped_collective_kind(ins, comps)
    if kind is not None:
      is_start = ins.opcode.endswith("-start")
      row = {"kind": kind, "name": ins.name, "computation": comp,
             "op_name": hlo.op_name(ins),
             "bytes": _operand_bytes(ins, shapes, kind),
             "is_async": is_start and not _SYNC.search(ins.attrs),
             "in_conditional": context[0], "in_loop": context[1],
             **_ZERO}
      found.append(row)
      if is_start:
        open_[ins.name] = row
      continue
    if ins.opcode.endswith("-done"):
      for nm in hlo.operand_names(ins.operands):
        open_.pop(nm, None)
      continue
    counts = counter.instruction(ins, shapes)
    for row in open_.values():
      for k in _ZERO:
        row[k] += counts.get(k, 0)
    if not context[0] and any(r["is_async"] and (only is None or only(
        r["name"])) for r in open_.values()):
      for k in in_flight:
        in_flight[k] += counts.get(k, 0.0)
  for row in found:
    if not row["is_async"]:
      row.update(_ZERO)
  return [CollectiveOverlap(**row) for row in found], in_flight


def overlap_report(compiled_or_text: Any,
                   only: Callable[[str], bool] | None = None
                   ) -> OverlapReport:
  """The overlap of every collective of a compiled program with its compute.

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` (e.g. from a deviceless GPU
      compile), a ``jax.stages.Lowered`` (compiled here) or the text of a
      scheduled HLO module (``compiled.as_text()``).
    only: None, or a predicate of a collective's (start) name: the
      report's FLOPs in flight (``flops_in_flight``, the forward and
      backward parts) then count only while one of those is in flight,
      e.g. the gossip and not fsdp's collectives inside a worker
      (:func:`crosses_workers`). The per-collective rows are unchanged.

  Returns:
    An :class:`OverlapReport`: per collective its kind, bytes, whether it
    is asynchronous (start/done pair not marked ``is_sync``), inside a
    conditional or loop, the forward / backward / other compute
    instructions and matmul FLOPs scheduled between its start and done,
    and the verdict ``overlapped`` (async, outside conditionals, model
    compute in flight) or exposed. ``report.summary()`` prints it as a
    table.

  Raises:
    ValueError: no HLO module in the object, or text that cannot be parsed
      (see :func:`decentral_jax.analysis.hlo.parse_module`).
  """
  text = hlo.hlo_text(compiled_or_text, "optimized")
  comps, entry, _ = hlo.parse_module(text)
  header = text.split("\n", 1)[0]
  contexts = _contexts(comps, entry)
  counter = _Counter(comps)
  rows, in_flight = [], dict(_PHASE_FLOPS)
  for comp, instrs in comps.items():
    if comp in contexts:
      found, flops = _scan(comp, instrs, comps, counter, contexts[comp],
                           only)
      rows.extend(found)
      for k, v in flops.items():
        in_flight[k] += v
  whole = counter.computation(entry)
  total = whole["flops"]
  rows = [dataclasses.replace(c, overlapped=overlaps(c, total > 0))
          for c in rows]
  return OverlapReport(
      tuple(rows), "is_scheduled=true" in header, total,
      sum(in_flight.values()), forward_flops=whole["flops_forward"],
      backward_flops=whole["flops_backward"],
      forward_flops_in_flight=in_flight["flops_forward"],
      backward_flops_in_flight=in_flight["flops_backward"])


def scheduled_computations(comps, entry) -> dict[str, tuple[bool, bool]]:
  """The computations of a parsed module that hold a schedule of their own.

  Args:
    comps, entry: :func:`decentral_jax.analysis.hlo.parse_module`'s first
      two results.

  Returns:
    ``{computation: (in_conditional, in_loop)}`` for the entry and every
    ``while`` body / condition, ``conditional`` branch and ``call`` callee
    reachable from it (fusion bodies, reductions and async wrappers are
    left out: their instructions run inside one kernel or one collective).
  """
  contexts = _contexts(comps, entry)
  keep, todo = {entry}, [entry]
  while todo:
    for ins in comps.get(todo.pop(), ()):
      if ins.opcode not in _CONTROL:
        continue
      for key, subs in hlo.called_computations(ins).items():
        if key == "to_apply" and ins.opcode != "call":
          continue
        for sub in subs:
          if sub not in keep:
            keep.add(sub)
            todo.append(sub)
  return {c: v for c, v in contexts.items() if c in keep}


def matmul_flops(comps) -> Callable[[hlo.Instruction, dict], float]:
  """A function giving the matrix-multiply FLOPs of one instruction.

  Args:
    comps: the parsed module's computations
      (:func:`decentral_jax.analysis.hlo.parse_module`).

  Returns:
    ``flops(ins, shapes)``: ``2 m n k`` of a ``dot`` or a cuBLAS GEMM
    custom call, the dots of a fusion or call (through its called
    computations, cached), 0 for anything else; ``shapes`` is ``{name:
    shape}`` of the instructions of ``ins``'s computation.
  """
  return _Counter(comps).own_flops


def overlaps(c, has_matmuls: bool) -> bool:
  """The verdict :attr:`CollectiveOverlap.overlapped` of a collective.

  Args:
    c: a :class:`CollectiveOverlap` (or any object with its fields
      ``is_async``, ``in_conditional``, ``flops``, ``forward``,
      ``backward``).
    has_matmuls: the program has matrix multiplies
      (``OverlapReport.total_flops > 0``).

  Returns:
    True if ``c`` is asynchronous, outside conditionals, and has matmul
    FLOPs in flight (``has_matmuls``) or else forward/backward
    instructions in flight.
  """
  if not c.is_async or c.in_conditional:
    return False
  return c.flops > 0 if has_matmuls else c.forward + c.backward > 0


def instruction_compute(comps) -> Any:
  """``counts(ins, shapes) -> dict`` for the instructions of ``comps``
  (:func:`decentral_jax.analysis.hlo.parse_module`'s computations).

  The dict an instruction's work adds to the counts of the collectives in
  flight: ``{phase: 1, "flops": f, "flops_<phase>": f}`` for one compute
  instruction (phase ``forward``, ``backward`` or ``other``), the sums over
  the callees for ``while`` / ``conditional`` / ``call`` (a loop body
  once), ``{}`` for data movement and collectives. ``shapes``: ``{name:
  shape}`` of the instruction's computation.
  """
  return _Counter(comps).instruction


def crosses_workers(collective, devices_per_worker: int) -> bool:
  """Whether a collective moves data between workers (the gossip) rather
  than among one worker's devices (fsdp's all-gathers and reduce-scatters).

  Devices ``w*D .. w*D+D-1`` (``D = devices_per_worker``) are worker
  ``w``'s, in the program's device order (the ids of
  ``source_target_pairs`` and ``replica_groups``). A permute crosses if a
  pair ``(s, t)`` has ``s // D != t // D``; a group collective if a group
  holds devices of two workers (``replica_groups`` empty: all devices,
  taken to cross).

  Args:
    collective: a :class:`decentral_jax.analysis.accounting.Collective`
      (its ``source_target_pairs`` or ``replica_groups``).
    devices_per_worker: ``D >= 1``.

  Raises:
    ValueError: ``devices_per_worker < 1``.
  """
  d = int(devices_per_worker)
  if d < 1:
    raise ValueError(f"devices_per_worker must be >= 1, got "
                     f"{devices_per_worker!r}.")
  if collective.source_target_pairs is not None:
    return any(s // d != t // d for s, t in collective.source_target_pairs)
  groups = collective.replica_groups
  if not groups:  # one group of all devices: every worker's
    return True
  return any(len({m // d for m in g}) > 1 for g in groups)


__all__: Sequence[str] = ("CollectiveOverlap", "OverlapReport",
                          "crosses_workers",
                          "instruction_compute", "matmul_flops",
                          "overlap_report", "overlaps",
                          "scheduled_computations")
