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
rounds in :func:`decentral_jax.gossip.mix`) runs one branch per step, so the
per-step bytes are reported *per branch* ("scenario"), together with the max
and the mean over a period. Each scenario has a weight, its frequency over
a period: a conditional traced by :func:`decentral_jax.gossip.every` (a sync
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
number of branches are instead taken to share their selector (as two
``gossip.mix`` calls of one topology do) and are zipped branch by branch. A
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

from decentral_jax import gossip

PyTree = Any

#: Bytes per element of HLO primitive types (sub-byte types are fractional).
DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e5m2": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
    "token": 0,
}

#: Collective opcodes counted (async ``-start`` forms map to the base kind;
#: ``-done`` halves carry no new data and are skipped).
KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter",
         "all-to-all")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLED = ("calls", "to_apply", "branch_computations", "true_computation",
           "false_computation", "body", "condition")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the HLO.

  Attributes:
    kind: one of :data:`KINDS` (async ``-start`` forms are mapped to it).
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
                         for m in _ARRAY.finditer(s)}))

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
    return max(self.bytes_per_step)

  @property
  def mean_bytes_per_step(self) -> float:
    """Busiest-worker bytes per step averaged over a period (bytes).

    ``sum_s weight_s * busiest_s``: a sync every ``H`` steps counts ``1 /
    H`` of its bytes, rounds of a schedule count equally.
    """
    return float(sum(s.weight * s.busiest_bytes for s in self.scenarios))

  def mean_inter_node_bytes_per_step(self, local_size: int) -> float:
    """Like :attr:`mean_bytes_per_step`, bytes leaving the node only."""
    return float(sum(s.weight * b for s, b in zip(
        self.scenarios, self.inter_node_bytes_per_step(local_size))))

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
    if self.unknown_trip_count:
      lines.append("  note: a while loop with unknown trip count was counted "
                   "once.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# HLO text parsing.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: str
  attrs: str


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
  """Index just after the bracket closing the one at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    ch = text[i]
    if ch == open_c:
      depth += 1
    elif ch == close_c:
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced {open_c}{close_c} in HLO line: {text[:200]}")


def _parse_instr(line: str) -> _Instr | None:
  line = _COMMENT.sub("", line)  # e.g. "/*index=5*/" inside long tuples
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2).strip()
  if rest.startswith("("):
    end = _matching(rest, 0, "(", ")")
    shape = rest[:end]
  else:
    end = rest.find(" ")
    if end < 0:
      return None
    shape = rest[:end]
  rest = rest[end:].lstrip()
  m2 = re.match(r"([\w\-]+)\(", rest)
  if not m2:
    return None
  opcode = m2.group(1)
  close = _matching(rest, m2.end() - 1, "(", ")")
  return _Instr(name, shape, opcode, rest[m2.end():close - 1], rest[close:])


def _parse_module(text: str):
  """Returns ``({computation: [instr]}, entry_name, n_devices or None)``."""
  comps: dict[str, list[_Instr]] = {}
  entry = None
  current = None
  n_devices = None
  for line in text.splitlines():
    if line.startswith("HloModule"):
      parts = re.findall(r"(num_partitions|replica_count)=(\d+)", line)
      if parts:
        n_devices = math.prod(int(v) for _, v in parts)
      mesh = re.search(r"#sdy\.mesh<\[([^\]]*)\]", line)
      if n_devices is None and mesh:
        n_devices = math.prod(int(v) for v in re.findall(r"=(\d+)",
                                                         mesh.group(1)))
      continue
    stripped = line.strip()
    if not stripped or stripped.startswith("//"):
      continue
    if not line[0].isspace() and stripped.endswith("{"):
      head = stripped
      is_entry = head.startswith("ENTRY")
      if is_entry:
        head = head[len("ENTRY"):].strip()
      m = _NAME.match(head)
      if not m:
        continue
      current = m.group(1)
      comps[current] = []
      if is_entry:
        entry = current
      continue
    if stripped == "}":
      current = None
      continue
    if current is not None:
      ins = _parse_instr(line)
      if ins is not None:
        comps[current].append(ins)
  if entry is None:
    raise ValueError("no ENTRY computation found: pass a jax Compiled or "
                     "Lowered object, or the text of an HLO module.")
  return comps, entry, n_devices


def _attr(attrs: str, key: str) -> str | None:
  """The raw value of ``key=...`` in an attribute list (braces balanced)."""
  m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", attrs)
  if not m:
    return None
  i = m.end()
  if i < len(attrs) and attrs[i] == "{":
    return attrs[i:_matching(attrs, i, "{", "}")]
  j = i
  depth = 0
  while j < len(attrs):
    ch = attrs[j]
    if ch in "([":
      depth += 1
    elif ch in ")]":
      depth -= 1
    elif ch == "," and depth == 0:
      break
    j += 1
  return attrs[i:j].strip()


def _int_lists(value: str) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(x) for x in re.findall(r"-?\d+", g))
               for g in re.findall(r"\{([^{}]*)\}", value))


def _replica_groups(value: str | None) -> tuple[tuple[int, ...], ...]:
  """Parses ``{{0,1},{2,3}}``, ``{}`` or the iota form ``[2,4]<=[8]``."""
  if value is None:
    return ()
  value = value.strip()
  if value.startswith("{"):
    inner = value[1:-1].strip()
    if not inner:
      return ()
    return _int_lists(value[1:-1] if inner.startswith("{") else value)
  m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", value)
  if not m:
    raise ValueError(f"cannot parse replica_groups={value!r}.")
  out_shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  ids = ids.reshape(out_shape)
  if ids.ndim == 1:
    ids = ids[None]
  return tuple(tuple(int(x) for x in row) for row in ids)


def _shape_bytes(shape: str) -> float:
  total = 0.0
  for m in _ARRAY.finditer(shape):
    dtype, dims = m.group(1), m.group(2)
    if dtype not in DTYPE_BYTES:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}.")
    size = 1
    for d in dims.split(","):
      d = d.strip().lstrip("<=")
      if d:
        size *= int(d)
    total += size * DTYPE_BYTES[dtype]
  return total


def _strip_layout(shape: str) -> str:
  return re.sub(r"\{[^{}]*\}", "", shape).replace(" ", "")


def _operand_names(operands: str) -> list[str]:
  names = []
  for part in _split_top(operands):
    part = part.strip()
    if not part:
      continue
    tok = part.split()[-1]
    m = _NAME.fullmatch(tok)
    if m:
      names.append(m.group(1))
  return names


def _split_top(text: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  parts.append("".join(cur))
  return parts


def _called(ins: _Instr) -> dict[str, list[str]]:
  out = {}
  for key in _CALLED:
    v = _attr(ins.attrs, key)
    if v is not None:
      out[key] = [m.group(1) for m in re.finditer(r"%?([A-Za-z_][\w.\-]*)",
                                                  v.strip("{}"))]
  return out


def _trip_count(ins: _Instr) -> int | None:
  m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
  return int(m.group(1)) if m else None


def _kind(opcode: str) -> str | None:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


class _Walker:
  """Evaluates computations into scenarios of collective counts."""

  def __init__(self, comps, align: bool, exclude_scope: str | None = None):
    self.comps = comps
    self.align = align
    self.exclude = (re.compile(r'op_name="(?:[^"]*/)?' + re.escape(
        exclude_scope) + r'(?:/|")') if exclude_scope else None)
    self.collectives: list[Collective] = []
    self.index: dict[tuple[str, str], int] = {}
    self.unknown_trip = False
    self.cache: dict[str, list[tuple[str, dict[int, float]]]] = {}

  def collective(self, comp: str, ins: _Instr, shapes: dict[str, str]) -> int:
    key = (comp, ins.name)
    if key in self.index:
      return self.index[key]
    kind = _kind(ins.opcode)
    names = _operand_names(ins.operands)
    if kind == "collective-permute" and _attr(ins.attrs, "slice_sizes"):
      names = names[:1]  # in-place form: (input, output, offsets...)
    op_shapes = []
    for nm in names:
      if nm not in shapes:
        raise ValueError(f"operand {nm!r} of {ins.name!r} not found in "
                         f"computation {comp!r}.")
      op_shapes.append(_strip_layout(shapes[nm]))
    pairs = groups = None
    if kind == "collective-permute":
      pairs = tuple((a, b) for a, b in _int_lists(
          _attr(ins.attrs, "source_target_pairs") or "{}"))
    else:
      groups = _replica_groups(_attr(ins.attrs, "replica_groups"))
    c = Collective(kind=kind, opcode=ins.opcode, name=ins.name,
                   computation=comp, operand_shapes=tuple(op_shapes),
                   operand_bytes=sum(_shape_bytes(s) for s in op_shapes),
                   source_target_pairs=pairs, replica_groups=groups)
    self.collectives.append(c)
    self.index[key] = len(self.collectives) - 1
    return self.index[key]

  def evaluate(self, comp: str, stack=()) -> list[tuple[str, dict[int, float]]]:
    if comp in self.cache:
      return self.cache[comp]
    if comp in stack:
      raise ValueError(f"recursive HLO computation {comp!r}.")
    if comp not in self.comps:
      return [("", {})]
    stack = stack + (comp,)
    shapes = {i.name: i.shape for i in self.comps[comp]}
    scen: list[tuple[str, dict[int, float], float]] = [("", {}, 1.0)]
    for ins in self.comps[comp]:
      if self.exclude is not None and self.exclude.search(ins.attrs):
        continue
      if _kind(ins.opcode):
        k = self.collective(comp, ins, shapes)
        for _, counts, _ in scen:
          counts[k] = counts.get(k, 0) + 1
        continue
      called = _called(ins)
      if ins.opcode == "conditional":
        branches = called.get("branch_computations") or (
            called.get("true_computation", []) +
            called.get("false_computation", []))
        alts = []
        weights = _branch_weights(ins, len(branches))
        for b, bname in enumerate(branches):
          for label, counts, w in self.evaluate(bname, stack):
            sub = f"{ins.name}={b}" + (f"/{label}" if label else "")
            alts.append((sub, counts, weights[b] * w))
        if any(c for _, c, _ in alts):
          scen = _combine(scen, alts, self.align)
      elif ins.opcode == "while":
        body = self.evaluate(called["body"][0], stack)
        cond = self.evaluate(called["condition"][0], stack)
        trips = _trip_count(ins)
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


def _combine(first, second, align: bool, cap: int = 4096):
  """Sequential composition of two scenario lists (see module docstring)."""
  if align and len(first) == len(second) and len(first) > 1:
    return [(_join(la, lb), _merge(ca, cb), wa)
            for (la, ca, wa), (lb, cb, _) in zip(first, second)]
  if len(first) * len(second) > cap:
    raise ValueError(f"{len(first) * len(second)} branch combinations exceed "
                     f"{cap}; analyse a smaller step.")
  return [(_join(la, lb), _merge(ca, cb), wa * wb)
          for (la, ca, wa), (lb, cb, wb) in itertools.product(first, second)]


def _branch_weights(ins: _Instr, n_branches: int) -> list[float]:
  """Frequency of each branch of a conditional (module docstring)."""
  m = re.search(r'op_name="([^"]*)"', ins.attrs)
  if m and n_branches == 2:
    period = re.search(re.escape(gossip.PERIOD_SCOPE) + r"(\d+)/cond$",
                       m.group(1))
    if period and int(period.group(1)) >= 1:
      h = int(period.group(1))
      return [1.0 - 1.0 / h, 1.0 / h]
  return [1.0 / n_branches] * n_branches


def hlo_text(compiled_or_lowered: Any, stage: str = "optimized") -> str:
  """HLO text of a ``jax.stages.Compiled`` / ``Lowered`` (or a string).

  Args:
    compiled_or_lowered: ``jax.jit(f).lower(*args)`` (compiled here for
      ``stage="optimized"``), its ``.compile()``, or HLO module text.
    stage: ``"optimized"`` (after XLA's passes: what runs) or
      ``"unoptimized"`` (the HLO given to XLA: what the program asks for;
      needs a ``Lowered`` or text).

  Returns:
    The HLO module as text.

  Raises:
    ValueError: unknown ``stage`` or unsupported object.
  """
  if stage not in ("optimized", "unoptimized"):
    raise ValueError(f"stage must be 'optimized' or 'unoptimized', got "
                     f"{stage!r}.")
  obj = compiled_or_lowered
  if isinstance(obj, str):
    return obj
  if isinstance(obj, jax.stages.Lowered):
    if stage == "unoptimized":  # debug_info keeps op_name (gossip.every)
      return obj.as_text(dialect="hlo", debug_info=True)
    obj = obj.compile()
  if isinstance(obj, jax.stages.Compiled):
    if stage == "unoptimized":
      raise ValueError("stage='unoptimized' needs the Lowered object "
                       "(jax.jit(f).lower(*args)), not its compile().")
    text = obj.as_text()
    if text is None:
      raise ValueError("this backend does not expose the compiled HLO text.")
    return text
  raise ValueError(
      f"expected a jax.stages.Compiled, jax.stages.Lowered or HLO text, got "
      f"{type(compiled_or_lowered).__name__}; use "
      "jax.jit(step).lower(*args).compile().")


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
  comps, entry, header_n = _parse_module(text)
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


def is_async_overlapped(compiled_or_lowered: Any) -> dict[str, Any]:
  """Whether gossip collectives are asynchronous with compute between them.

  Looks, in every computation of the optimized HLO, for
  ``collective-permute-start`` ... ``collective-permute-done`` pairs (the
  GPU backend's async form) and counts the compute instructions scheduled
  between each start and its done (fusions, dots, convolutions, custom
  calls), i.e. compute that may run while the data moves. A start inside a
  ``conditional`` branch (the ``lax.switch`` over rounds) can only overlap
  with compute of that branch, not with the forward/backward outside it.

  Args:
    compiled_or_lowered: as for :func:`communication`.

  Returns:
    A dict: ``starts``, ``dones`` (async permute halves), ``sync`` (plain
    ``collective-permute``), ``overlapped`` (starts with compute before their
    done), ``compute_between`` (list, one count per start),
    ``in_branches`` (starts inside conditional branch computations).
  """
  text = hlo_text(compiled_or_lowered, "optimized")
  comps, _, _ = _parse_module(text)
  branch_comps = set()
  for instrs in comps.values():
    for ins in instrs:
      if ins.opcode == "conditional":
        called = _called(ins)
        for key in ("branch_computations", "true_computation",
                    "false_computation"):
          branch_comps.update(called.get(key, []))
  out = {"starts": 0, "dones": 0, "sync": 0, "overlapped": 0,
         "compute_between": [], "in_branches": 0}
  compute = ("fusion", "dot", "convolution", "custom-call")
  for comp, instrs in comps.items():
    open_starts: dict[str, int] = {}
    for ins in instrs:
      if ins.opcode == "collective-permute":
        out["sync"] += 1
      elif ins.opcode == "collective-permute-start":
        out["starts"] += 1
        out["in_branches"] += int(comp in branch_comps)
        open_starts[ins.name] = 0
      elif ins.opcode == "collective-permute-done":
        out["dones"] += 1
        for nm in _operand_names(ins.operands):
          if nm in open_starts:
            between = open_starts.pop(nm)
            out["compute_between"].append(between)
            out["overlapped"] += int(between > 0)
      elif ins.opcode in compute:
        for nm in open_starts:
          open_starts[nm] += 1
  return out


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
    "hlo_text", "is_async_overlapped", "report_to_json", "tree_bytes",
    "DTYPE_BYTES", "KINDS")
