"""Reading HLO module text: computations, instructions, shapes, attributes.

The parser behind :mod:`decentral_jax.analysis`: it splits the text that
``jax.stages.Compiled.as_text()`` or ``Lowered.as_text(dialect="hlo")``
prints into computations of :class:`Instruction` records and reads the
attributes the byte accounting needs (``source_target_pairs``,
``replica_groups``, called computations, ``known_trip_count``,
``op_name`` metadata). It handles the HLO printed by jax/jaxlib 0.10
(async ``-start``/``-done`` pairs, ``/*index=5*/`` comments, iota replica
groups, tuple shapes); anything else is a :class:`ValueError` naming the
instruction.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

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
#: One array shape, e.g. ``f32[16,32]``: groups (element type, dims).
ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLED = ("calls", "to_apply", "branch_computations", "true_computation",
           "false_computation", "body", "condition")

# ---------------------------------------------------------------------------
# HLO text parsing.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: ``name = shape opcode(operands), attrs``."""
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


def _parse_instr(line: str) -> Instruction | None:
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
  return Instruction(name, shape, opcode, rest[m2.end():close - 1],
                     rest[close:])


def parse_module(text: str):
  """Returns ``({computation: [instr]}, entry_name, n_devices or None)``."""
  comps: dict[str, list[Instruction]] = {}
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


def attribute(attrs: str, key: str) -> str | None:
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


def int_lists(value: str) -> tuple[tuple[int, ...], ...]:
  """``{{0,1},{1,0}}`` -> ``((0, 1), (1, 0))``."""
  return tuple(tuple(int(x) for x in re.findall(r"-?\d+", g))
               for g in re.findall(r"\{([^{}]*)\}", value))


def replica_groups(value: str | None) -> tuple[tuple[int, ...], ...]:
  """Parses ``{{0,1},{2,3}}``, ``{}`` or the iota form ``[2,4]<=[8]``."""
  if value is None:
    return ()
  value = value.strip()
  if value.startswith("{"):
    inner = value[1:-1].strip()
    if not inner:
      return ()
    return int_lists(value[1:-1] if inner.startswith("{") else value)
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


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape (arrays or a tuple of them)."""
  total = 0.0
  for m in ARRAY.finditer(shape):
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


def strip_layout(shape: str) -> str:
  """A shape without its ``{1,0}`` layout suffixes."""
  return re.sub(r"\{[^{}]*\}", "", shape).replace(" ", "")


def operand_names(operands: str) -> list[str]:
  """The operand names of an operand list (a shape prefix is dropped)."""
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


def called_computations(ins: Instruction) -> dict[str, list[str]]:
  """Computations an instruction calls, by attribute (``body``, ...)."""
  out = {}
  for key in _CALLED:
    v = attribute(ins.attrs, key)
    if v is not None:
      out[key] = [m.group(1) for m in re.finditer(r"%?([A-Za-z_][\w.\-]*)",
                                                  v.strip("{}"))]
  return out


def trip_count(ins: Instruction) -> int | None:
  """A ``while``'s ``known_trip_count`` (None if XLA does not know it)."""
  m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attrs)
  return int(m.group(1)) if m else None


def collective_kind(opcode: str) -> str | None:
  """The :data:`KINDS` entry of an opcode (``-start`` forms mapped), or None."""
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


def wrapped_collective_kind(ins: Instruction, comps) -> str | None:
  """The collective an ``async-start`` runs (``reduce-scatter``, ...): the
  :func:`collective_kind` of the first collective instruction in the
  computations it calls (``comps``: name -> its instructions), or None."""
  for sub in called_computations(ins).get("calls", []):
    for inner in comps.get(sub, ()):
      kind = collective_kind(inner.opcode)
      if kind:
        return kind
  return None


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


def op_name(ins: Instruction) -> str:
  """The ``op_name`` metadata of an instruction (``""`` if none)."""
  m = re.search(r'op_name="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""
