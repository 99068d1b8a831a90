"""Communication accounting read from a compiled train step's HLO.

:func:`communication` lists every collective in the HLO that XLA will run
(``collective-permute``, ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all`` and their ``-start`` async forms) with its operand shapes,
dtypes, ``source_target_pairs`` / ``replica_groups``, and converts them into
*bytes sent per worker per step*. The report answers the question "does the
step send what the algorithm needs and nothing more?", e.g. for a one-peer
topology the busiest worker sends exactly the parameter bytes once per step
(ratio 1.00 to the parameter bytes), no optimizer state or step counter.

Byte conventions (bytes *sent* by one device, in bytes):

* ``collective-permute``: ``operand bytes`` for every ``(source, target)``
  pair whose source is that device (``source == target`` is a local copy and
  counts 0).
* ``all-reduce`` over a group of ``p`` devices: ``2 (p - 1) / p x operand
  bytes`` for every member, the figure of the bandwidth-optimal ring
  algorithm (reduce-scatter then all-gather), whatever XLA's runtime uses.
* ``all-gather``: ``(p - 1) x operand bytes`` (the operand is one shard).
* ``reduce-scatter`` and ``all-to-all``: ``(p - 1) / p x operand bytes``.

Control flow: a ``conditional`` (e.g. the ``lax.switch`` over a topology's
rounds in :func:`decentral_jax.comm.gossip.mix`) runs one branch per step, so the
per-step bytes are reported *per branch* ("scenario"), together with the max
and the mean over a period. Each scenario has a weight, its frequency over
a period: a conditional traced by :func:`decentral_jax.comm.gossip.every` (a sync
every ``H`` steps, gossip every ``tau`` steps, a logging-step diagnostic)
has the scope ``comm_every_H`` in its ``op_name`` and weighs its taken
branch (index 1) ``1 / H`` and the other ``1 - 1 / H``; any other
conditional (the ``lax.switch`` over a topology's rounds) weighs its
branches equally, which is the mean over the schedule when every distinct
round occurs once per period, as for ``ring``, ``one_peer_exp`` and
``alternating_exp_ring``. So DiLoCo with ``n = 8`` and ``H = 10`` reports
``2 (n - 1) / n / H = 0.175`` x the parameter bytes per step. Several
conditionals in one step give one scenario per combination of branches (a
train loop's ``lax.cond`` for a logging-step diagnostic doubles the
scenarios); with ``align_conditionals=True``, conditionals with the same
number of branches and the same weights are instead taken to share their
selector (as two ``gossip.mix`` calls of one topology do) and are zipped
branch by branch. Beyond 4096 combinations (e.g. Streaming DiLoCo with many
fragments, each its own periodic conditional) the report keeps a single
scenario ``"mean"`` holding the expected counts per step: the mean over a
period stays exact, the per-branch maximum is then not available. A
``while``
body counts ``known_trip_count`` times (once, flagged, if XLA does not know
the trip count).

Stages: ``stage="optimized"`` (default) reads the HLO after the backend's
passes, i.e. what really runs. Backends may change what is sent: the CPU
backend has no bfloat16 collectives and upcasts a bfloat16
``collective-permute`` to float32 (pass ``float-normalization-bf16``), so on
CPU ``comm_dtype=bfloat16`` gossip still moves float32 bytes.
``stage="unoptimized"`` reads the HLO handed to XLA (``Lowered.as_text(
dialect="hlo")``), i.e. what the program asks for.

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025 (only parameters are communicated).
  Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters
  of workstations", JPDC 2009 (the ``2 (p - 1) / p`` ring figure).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from typing import Any, Sequence

import jax
import numpy as np

from decentral_jax.analysis import hlo
from decentral_jax.analysis.hlo import hlo_text
from decentral_jax.scopes import PERIOD_SCOPE

PyTree = Any



@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the HLO.

  Attributes:
    kind: one of :data:`~decentral_jax.analysis.hlo.KINDS` (async ``-start`` forms are mapped to it).
    opcode: the HLO opcode as printed (e.g. ``collective-permute-start``).
    name: the instruction name.
    computation: the HLO computation that holds it.
    operand_shapes: operand shapes as printed, e.g. ``("f32[16,32]",)``.
    operand_bytes: bytes of all data operands of one device (int).
    source_target_pairs: ``((src, dst), ...)`` for permutes, else None.
    replica_groups: device groups for the other kinds (``()`` means one group
      of all devices), else None.
  """

  kind: str
  opcode: str
  name: str
  computation: str
  operand_shapes: tuple[str, ...]
  operand_bytes: float
  source_target_pairs: tuple[tuple[int, int], ...] | None
  replica_groups: tuple[tuple[int, ...], ...] | None

  @property
  def is_async(self) -> bool:
    return self.opcode.endswith("-start") or "async" in self.computation

  @property
  def dtypes(self) -> tuple[str, ...]:
    return tuple(sorted({m.group(1) for s in self.operand_shapes
                         for m in hlo.ARRAY.finditer(s)}))

  def sent_bytes(self, n_devices: int,
                 local_size: int | None = None) -> np.ndarray:
    """Bytes each device sends when this collective runs once.

    Args:
      n_devices: number of devices of the program (ids ``0..n-1``).
      local_size: if given, count only bytes that leave the sender's node,
        with devices ``v*L .. v*L+L-1`` forming node ``v`` (``L =
        local_size``). Group collectives are taken to run as a ring over
        the group in its listed order, each device sending to the next one,
        so a device's bytes cross nodes iff its ring successor is on
        another node.

    Returns:
      ``np.ndarray`` [n_devices] float64, bytes (conventions in the module
      docstring).

    Raises:
      ValueError: ``local_size`` not a positive divisor of ``n_devices``.
    """
    if local_size is not None and (local_size < 1 or n_devices % local_size):
      raise ValueError(f"local_size={local_size} must divide n_devices="
                       f"{n_devices}.")

    def crosses(a, b):
      return local_size is None or a // local_size != b // local_size

    sent = np.zeros(n_devices)
    if self.kind == "collective-permute":
      for src, dst in self.source_target_pairs or ():
        if src != dst and crosses(src, dst):
          sent[src] += self.operand_bytes
      return sent
    groups = self.replica_groups or (tuple(range(n_devices)),)
    for group in groups:
      p = len(group)
      if p <= 1:
        continue
      factor = {"all-reduce": 2 * (p - 1) / p, "all-gather": p - 1,
                "reduce-scatter": (p - 1) / p,
                "all-to-all": (p - 1) / p}[self.kind]
      for k, d in enumerate(group):
        if crosses(d, group[(k + 1) % p]):
          sent[d] += factor * self.operand_bytes
    return sent


def _bytes_by_dtype(shapes) -> dict[str, float]:
  """``{element type: bytes}`` of HLO operand shapes."""
  out: dict[str, float] = {}
  for shape in shapes:
    for m in hlo.ARRAY.finditer(shape):
      out[m.group(1)] = out.get(m.group(1), 0.0) + hlo.shape_bytes(m.group(0))
  return out


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One possible step: a choice of branch in every conditional.

  Attributes:
    label: e.g. ``"conditional.1=2"`` (branch 2), ``""`` without branches.
    counts: ``((index into CommunicationReport.collectives, times), ...)``.
    sent_bytes: ``np.ndarray`` [n_devices] float64, bytes each device sends.
    weight: the scenario's frequency over a period (weights of a report sum
      to 1; see the module docstring).
  """

  label: str
  counts: tuple[tuple[int, float], ...]
  sent_bytes: np.ndarray
  weight: float = 1.0

  @property
  def busiest_bytes(self) -> float:
    """Bytes sent by the device that sends most in this scenario."""
    return float(self.sent_bytes.max()) if self.sent_bytes.size else 0.0


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
  """Collectives of one compiled step and the bytes each worker sends.

  Attributes:
    n_devices: devices of the program (``num_partitions`` x
      ``replica_count``).
    collectives: every collective instruction found (each once).
    scenarios: one per possible step (branch of the schedule); a step
      without conditionals has one scenario.
    unknown_trip_count: True if a ``while`` loop without a known trip count
      contains collectives (counted once per step).
  """

  n_devices: int
  collectives: tuple[Collective, ...]
  scenarios: tuple[Scenario, ...]
  unknown_trip_count: bool = False

  @property
  def bytes_per_step(self) -> tuple[float, ...]:
    """Busiest-worker bytes sent per step, one entry per scenario."""
    return tuple(s.busiest_bytes for s in self.scenarios)

  @property
  def max_bytes_per_step(self) -> float:
    """Busiest-worker bytes of the busiest scenario (the largest step)."""
    return max(self.bytes_per_step)

  @property
  def mean_bytes_per_step(self) -> float:
    """Busiest-worker bytes per step averaged over a period (bytes).

    ``sum_s weight_s * busiest_s``: a sync every ``H`` steps counts ``1 /
    H`` of its bytes, rounds of a schedule count equally.
    """
    return float(sum(s.weight * s.busiest_bytes for s in self.scenarios))

  def inter_node_bytes_per_step(self, local_size: int) -> tuple[float, ...]:
    """Busiest worker's bytes per step that leave its node, per scenario.

    Args:
      local_size: devices per node ``L`` (node ``v`` = devices ``v*L ..
        v*L+L-1``); see :meth:`Collective.sent_bytes` for the ring
        convention of group collectives.

    Returns:
      One float (bytes) per scenario.
    """
    out = []
    for s in self.scenarios:
      sent = np.zeros(self.n_devices)
      for k, times in s.counts:
        sent += times * self.collectives[k].sent_bytes(self.n_devices,
                                                       local_size)
      out.append(float(sent.max()) if sent.size else 0.0)
    return tuple(out)

  def mean_bytes_by_dtype(self) -> dict[str, float]:
    """:attr:`mean_bytes_per_step` split by the element type sent (bytes).

    Per scenario, the busiest device's bytes (the device of
    :attr:`Scenario.busiest_bytes`) by the HLO element type of the data it
    sends (a collective with operands of several types split by their
    bytes), weighted as in :attr:`mean_bytes_per_step`; the values sum to
    it. Compressed messages show their parts: e.g. int8 codes (``s8``),
    4-bit and fp8 codes (``u8``), float32 scales or top-k values
    (``f32``), top-k indices (``s16``).

    Returns:
      ``{HLO element type, e.g. "s8": bytes per step}`` (types sent only).
    """
    out: dict[str, float] = {}
    for s in self.scenarios:
      if not s.sent_bytes.size or not s.busiest_bytes:
        continue
      busiest = int(np.argmax(s.sent_bytes))
      for k, times in s.counts:
        c = self.collectives[k]
        sent = times * c.sent_bytes(self.n_devices)[busiest]
        if not sent:
          continue
        parts = _bytes_by_dtype(c.operand_shapes)
        total = sum(parts.values())
        for dtype, b in parts.items():
          out[dtype] = out.get(dtype, 0.0) + s.weight * sent * b / total
    return out

  def ratios(self, param_bytes: float) -> tuple[float, ...]:
    """Bytes per step / ``param_bytes`` for every scenario.

    Args:
      param_bytes: bytes of one worker's parameters (see
        :func:`tree_bytes`), > 0.

    Raises:
      ValueError: ``param_bytes`` not positive.
    """
    if not param_bytes or param_bytes <= 0:
      raise ValueError(f"param_bytes must be > 0, got {param_bytes!r}; pass "
                       "analysis.tree_bytes(one_worker_params).")
    return tuple(b / param_bytes for b in self.bytes_per_step)

  def summary(self, param_bytes: float | None = None) -> str:
    """A human-readable table of collectives and per-scenario bytes."""
    lines = [f"{len(self.collectives)} collective(s) on {self.n_devices} "
             "device(s):"]
    for c in self.collectives:
      where = (f"pairs={list(c.source_target_pairs)}"
               if c.source_target_pairs is not None
               else f"groups={[list(g) for g in c.replica_groups or ()]}")
      lines.append(f"  {c.opcode:<26} {','.join(c.operand_shapes):<30} "
                   f"{c.operand_bytes:>12,.0f} B  {where}  [{c.computation}]")
    for s in self.scenarios:
      extra = ""
      if param_bytes:
        extra = f"  ratio={s.busiest_bytes / param_bytes:.4f}"
      lines.append(f"  step {s.label or '(no branch)'} (weight "
                   f"{s.weight:.4g}): busiest worker sends "
                   f"{s.busiest_bytes:,.0f} B{extra}")
    mean = self.mean_bytes_per_step
    extra = f" (ratio {mean / param_bytes:.4f})" if param_bytes else ""
    lines.append(f"  mean over a period: {mean:,.0f} B per step{extra}")
    by_type = self.mean_bytes_by_dtype()
    if len(by_type) > 1:
      lines.append("  by element type: " + ", ".join(
          f"{t} {b:,.0f} B" for t, b in sorted(by_type.items())))
    if self.unknown_trip_count:
      lines.append("  note: a while loop with unknown trip count was counted "
                   "once.")
    return "\n".join(lines)


class _Walker:
  """Evaluates computations into scenarios of collective counts."""

  def __init__(self, comps, align: bool, exclude_scope: str | None = None):
    self.comps = comps
    self.align = align
    # A transform wraps the innermost scope: "vmap(diagnostics)/...".
    self.exclude = (re.compile(r'op_name="(?:[^"]*[/(])?' + re.escape(
        exclude_scope) + r'\)?(?:/|")') if exclude_scope else None)
    self.collectives: list[Collective] = []
    self.index: dict[tuple[str, str], int] = {}
    self.unknown_trip = False
    self.cache: dict[str, list[tuple[str, dict[int, float]]]] = {}

  def collective(self, comp: str, ins: hlo.Instruction,
                 shapes: dict[str, str]) -> int:
    key = (comp, ins.name)
    if key in self.index:
      return self.index[key]
    kind = hlo.collective_kind(ins.opcode)
    names = hlo.operand_names(ins.operands)
    if kind == "collective-permute" and hlo.attribute(ins.attrs, "slice_sizes"):
      names = names[:1]  # in-place form: (input, output, offsets...)
    op_shapes = []
    for nm in names:
      if nm not in shapes:
        raise ValueError(f"operand {nm!r} of {ins.name!r} not found in "
                         f"computation {comp!r}.")
      op_shapes.append(hlo.strip_layout(shapes[nm]))
    pairs = groups = None
    if kind == "collective-permute":
      pairs = tuple((a, b) for a, b in hlo.int_lists(
          hlo.attribute(ins.attrs, "source_target_pairs") or "{}"))
    else:
      groups = hlo.replica_groups(hlo.attribute(ins.attrs, "replica_groups"))
    c = Collective(kind=kind, opcode=ins.opcode, name=ins.name,
                   computation=comp, operand_shapes=tuple(op_shapes),
                   operand_bytes=sum(hlo.shape_bytes(s) for s in op_shapes),
                   source_target_pairs=pairs, replica_groups=groups)
    self.collectives.append(c)
    self.index[key] = len(self.collectives) - 1
    return self.index[key]

  def evaluate(self, comp: str, stack=()) -> list[tuple[str, dict[int, float]]]:
    if comp in self.cache:
      return self.cache[comp]
    if comp in stack:
      raise ValueError(f"recursive HLO computation {comp!r}.")
    if comp not in self.comps:  # e.g. a fusion body stripped from the text
      return [("", {}, 1.0)]
    stack = stack + (comp,)
    shapes = {i.name: i.shape for i in self.comps[comp]}
    scen: list[tuple[str, dict[int, float], float]] = [("", {}, 1.0)]
    for ins in self.comps[comp]:
      if self.exclude is not None and self.exclude.search(ins.attrs):
        continue
      if hlo.collective_kind(ins.opcode):
        k = self.collective(comp, ins, shapes)
        for _, counts, _ in scen:
          counts[k] = counts.get(k, 0) + 1
        continue
      called = hlo.called_computations(ins)
      if ins.opcode == "conditional":
        branches = called.get("branch_computations") or (
            called.get("true_computation", []) +
            called.get("false_computation", []))
        alts = []
        weights = _branch_weights(ins, len(branches))
        if not called.get("branch_computations"):
          weights = weights[::-1]  # pred form lists the true branch first
        for b, bname in enumerate(branches):
          for label, counts, w in self.evaluate(bname, stack):
            sub = f"{ins.name}={b}" + (f"/{label}" if label else "")
            alts.append((sub, counts, weights[b] * w))
        if any(c for _, c, _ in alts):
          scen = _combine(scen, alts, self.align)
      elif ins.opcode == "while":
        body = self.evaluate(called["body"][0], stack)
        cond = self.evaluate(called["condition"][0], stack)
        trips = hlo.trip_count(ins)
        has_comm = any(c for _, c, _ in body) or any(c for _, c, _ in cond)
        if trips is None:
          trips = 1
          self.unknown_trip = self.unknown_trip or has_comm
        if has_comm:
          inner = _combine(
              [(lab, _scale(c, trips), w) for lab, c, w in body],
              [(lab, _scale(c, trips + 1), w) for lab, c, w in cond], False)
          scen = _combine(scen, inner, self.align)
      elif ins.opcode in ("call", "fusion", "async-start", "custom-call"):
        for key in ("calls", "to_apply"):
          for sub in called.get(key, []):
            inner = self.evaluate(sub, stack)
            if any(c for _, c, _ in inner):
              scen = _combine(scen, inner, self.align)
    scen = [(lab, dict(c), w) for lab, c, w in scen]
    self.cache[comp] = scen
    return scen


def _scale(counts: dict[int, float], k: float) -> dict[int, float]:
  return {i: v * k for i, v in counts.items()}


def _merge(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
  out = dict(a)
  for i, v in b.items():
    out[i] = out.get(i, 0) + v
  return out


def _join(a: str, b: str) -> str:
  return "/".join(x for x in (a, b) if x)


def _expected(scen):
  """One scenario holding the weighted mean counts of ``scen``."""
  counts: dict[int, float] = {}
  for _, c, w in scen:
    counts = _merge(counts, _scale(c, w))
  return [("mean", counts, 1.0)]


def _combine(first, second, align: bool, cap: int = 4096):
  """Sequential composition of two scenario lists (see module docstring)."""
  if (align and len(first) == len(second) and len(first) > 1 and
      all(math.isclose(wa, wb) for (_, _, wa), (_, _, wb) in
          zip(first, second))):
    return [(_join(la, lb), _merge(ca, cb), wa)
            for (la, ca, wa), (lb, cb, _) in zip(first, second)]
  if len(first) * len(second) > cap:
    # Too many combinations (e.g. many streamed fragments): keep only the
    # expectation, which is all the mean over a period needs.
    first, second = _expected(first), _expected(second)
  return [(_join(la, lb), _merge(ca, cb), wa * wb)
          for (la, ca, wa), (lb, cb, wb) in itertools.product(first, second)]


def _branch_weights(ins: hlo.Instruction, n_branches: int) -> list[float]:
  """Frequency of each branch of a conditional (module docstring)."""
  name = hlo.op_name(ins)
  if name and n_branches == 2:
    period = re.search(re.escape(PERIOD_SCOPE) + r"(\d+)\)?/cond$",
                       name)
    if period and int(period.group(1)) >= 1:
      h = int(period.group(1))
      return [1.0 - 1.0 / h, 1.0 / h]
  return [1.0 / n_branches] * n_branches


def communication(compiled_or_lowered: Any, *, stage: str = "optimized",
                  n_devices: int | None = None,
                  align_conditionals: bool = False,
                  exclude_scope: str | None = None) -> CommunicationReport:
  """Lists the collectives of a compiled step and the bytes each worker sends.

  Args:
    compiled_or_lowered: a ``jax.stages.Compiled`` (``jax.jit(step).lower(
      *args).compile()``), a ``jax.stages.Lowered`` (compiled here, compile
      time included), or HLO module text.
    stage: ``"optimized"`` (default, the HLO that runs) or ``"unoptimized"``
      (the HLO handed to XLA; see the module docstring).
    n_devices: number of devices; default read from the module header
      (``num_partitions x replica_count``) or the largest device id + 1.
    align_conditionals: zip conditionals with equal branch counts instead
      of combining every branch of one with every branch of the other.
    exclude_scope: leave out every instruction (collective or control flow)
      traced under this name scope, e.g. ``step.DIAGNOSTICS_SCOPE`` for the
      consensus distance of logging steps; matched against ``op_name``
      metadata, which the optimized HLO and ``stage="unoptimized"`` keep.

  Returns:
    A :class:`CommunicationReport`. ``report.bytes_per_step`` holds the
    busiest worker's bytes sent per step (bytes) for every branch of the
    schedule; ``report.mean_bytes_per_step`` averages them over a period
    with the scenarios' weights; ``report.ratios(tree_bytes(params))``
    divides by the parameter bytes of one worker.

  Raises:
    ValueError: the object holds no HLO module, or the HLO cannot be parsed
      (unknown element type, unbalanced brackets, unknown operand).
  """
  text = hlo_text(compiled_or_lowered, stage)
  comps, entry, header_n = hlo.parse_module(text)
  walker = _Walker(comps, align_conditionals, exclude_scope)
  scen = walker.evaluate(entry)
  n = n_devices or header_n or 1
  ids = [d for c in walker.collectives
         for d in itertools.chain.from_iterable(
             c.source_target_pairs or c.replica_groups or ())]
  if ids:
    n = max(n, max(ids) + 1) if n_devices is None else n
    if max(ids) >= n:
      raise ValueError(f"n_devices={n} but the HLO uses device id "
                       f"{max(ids)}; pass n_devices > {max(ids)}.")
  scenarios = []
  for label, counts, weight in scen:
    sent = np.zeros(n)
    for k, times in sorted(counts.items()):
      sent += times * walker.collectives[k].sent_bytes(n)
    scenarios.append(Scenario(label, tuple(sorted(counts.items())), sent,
                              weight))
  return CommunicationReport(n, tuple(walker.collectives), tuple(scenarios),
                             walker.unknown_trip)


def tree_bytes(tree: PyTree, *, stacked: bool = False) -> int:
  """Total bytes of the array leaves of ``tree`` (one worker's share).

  Args:
    tree: pytree of arrays (or ``jax.ShapeDtypeStruct``).
    stacked: if True, leaves carry a leading worker axis ``[n, ...]`` and the
      result is the bytes of one worker (total / n).

  Returns:
    Bytes (int).

  Raises:
    ValueError: ``stacked`` leaves with differing leading sizes.
  """
  leaves = jax.tree.leaves(tree)
  total = 0
  lead = set()
  for x in leaves:
    shape = tuple(x.shape)
    size = math.prod(shape)
    if stacked:
      lead.add(shape[0] if shape else None)
    total += size * np.dtype(x.dtype).itemsize
  if stacked:
    if len(lead) != 1 or None in lead:
      raise ValueError(f"stacked=True needs every leaf to have the same "
                       f"leading worker axis, got sizes {sorted(map(str, lead))}.")
    total //= lead.pop()
  return int(total)


def _json_default(o):  # pragma: no cover - used by scripts
  if isinstance(o, np.ndarray):
    return o.tolist()
  raise TypeError(type(o))


def report_to_json(report: CommunicationReport,
                   param_bytes: float | None = None) -> str:
  """Serialises a report (collectives, per-scenario bytes, ratios) to JSON."""
  d = {
      "n_devices": report.n_devices,
      "collectives": [dataclasses.asdict(c) for c in report.collectives],
      "bytes_per_step": list(report.bytes_per_step),
      "mean_bytes_per_step": report.mean_bytes_per_step,
      "scenarios": [s.label for s in report.scenarios],
      "weights": [s.weight for s in report.scenarios],
      "unknown_trip_count": report.unknown_trip_count,
  }
  if param_bytes:
    d["param_bytes"] = param_bytes
    d["ratios"] = list(report.ratios(param_bytes))
  return json.dumps(d, default=_json_default, indent=1)


__all__: Sequence[str] = (
    "Collective", "CommunicationReport", "Scenario", "communication",
    "report_to_json", "tree_bytes")
