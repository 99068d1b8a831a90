"""One validating reader for every file a run keeps and reads back.

Records and metrics of runs (``compare_result.json``, ``config.json``,
``metrics.jsonl``), cluster files, compiled-workload files, in-flight
fraction files: each is read here and checked against a schema before any
number of it is used. A reader returns either the checked content or a
:class:`Damaged` that names the file, the key and what is wrong, in one
line; the caller decides what a damaged file means: treated as missing (a
kept run whose record is damaged is trained again, with a one-line warning)
or refused (one ``error:`` line naming the file and the key). A key given
twice in one JSON object is damage in every file (no writer writes one).

A schema maps each key of a JSON object to a field ``(kind, lo, hi,
nullable)``:

* ``"int"``: a JSON integer in ``[lo, hi]`` (not ``true``/``false``);
* ``"number"``: a finite number in ``[lo, hi]`` (not NaN, not Infinity,
  not a string, not a boolean); ``"whole"``: one with an integral value
  (a count written ``1.3e9``);
* ``"numbers"``: a list of such numbers; ``"series"``: a non-empty one;
* ``"bool"``, ``"str"``, ``"strs"`` (a list of strings);
* ``"object"``, ``"list"``: any JSON object, list; an :class:`Obj`: an object with its own
  schema.

``lo`` and ``hi`` are None where there are no bounds; ``nullable`` lets
the value be ``null``. This module imports only :mod:`decentral_jax.checks`
(no JAX, no NumPy arrays).
"""

from __future__ import annotations

import dataclasses
import json
import os
import reprlib
import stat
from typing import Callable

from decentral_jax import checks

#: The largest file read by default: a record or a metrics log of a long
#: run is a few megabytes.
MAX_FILE_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Damaged:
  """A file that cannot be used: ``file``, ``reason`` (one line), the
  ``key`` at fault (None for the whole file) and whether the file is
  simply ``missing``."""
  file: str
  reason: str
  key: str | None = None
  missing: bool = False

  def __str__(self) -> str:
    return f"{self.file}: {self.reason}"

  def warning(self, consequence: str) -> str:
    """The one line that says the file is treated as missing, e.g.
    ``"warning: runs/x/compare_result.json: "final" must be an object or
    null, got 'garbage'; the run is trained again."``."""
    return f"warning: {self}; {consequence}"

  def error(self, prefix: str = "") -> ValueError:
    """A one-line ValueError for a caller that refuses the file."""
    return ValueError(f"{prefix}{self}")


@dataclasses.dataclass(frozen=True)
class Obj:
  """A field that is a JSON object with its own ``schema``: keys in
  ``required`` must be there; other keys than the schema's are refused
  unless ``extra``."""
  schema: dict
  required: tuple = ()
  extra: bool = False


_RULES = {"int": "an integer", "number": "a finite number",
          "whole": "a whole number",
          "numbers": "a list of finite numbers",
          "series": "a non-empty list of finite numbers",
          "bool": "true or false", "str": "a string",
          "strs": "a list of strings", "object": "an object",
          "list": "a list"}

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40
_REPR.maxlist = _REPR.maxdict = 4


def short(v) -> str:
  """A short one-line repr (a value from a file may be long or deep)."""
  return _REPR.repr(v)


def _in(x, lo, hi) -> bool:
  return (lo is None or x >= lo) and (hi is None or x <= hi)


def is_real(v) -> bool:
  """A finite number that is also a finite float (JSON allows integers of
  any length; one beyond float64's range would overflow where it is used)."""
  return checks.is_number(v)  # refuses ints beyond float64's range


def _ok(v, kind: str, lo, hi) -> bool:
  if kind in ("numbers", "series"):
    return isinstance(v, list) and (v or kind == "numbers") and all(
        is_real(x) and _in(x, lo, hi) for x in v)
  if kind == "strs":
    return isinstance(v, list) and all(isinstance(x, str) for x in v)
  if kind in ("bool", "str", "object", "list"):
    return isinstance(v, {"bool": bool, "str": str, "object": dict,
                          "list": list}[kind])
  if kind == "whole":
    return is_real(v) and float(v).is_integer() and _in(v, lo, hi)
  if kind == "number":
    return is_real(v) and _in(v, lo, hi)
  return checks.is_int(v) and _in(v, lo, hi)


def value_error(key: str, v, kind: str, lo=None, hi=None) -> str | None:
  """Why ``v`` is not a ``kind`` in ``[lo, hi]`` (one line naming ``key``),
  or None if it is."""
  rule = _RULES[kind]
  if lo is not None and hi is not None:
    rule += " in [{}, {}]".format(*(x if isinstance(x, int) else f"{x:g}"
                                    for x in (lo, hi)))
  elif lo is not None:
    rule += f" >= {lo:g}"
  return None if _ok(v, kind, lo, hi) else (
      f"{key} must be {rule}, got {short(v)}")


def object_error(obj, name: str, schema: dict, required=(),
                 extra: bool = False) -> tuple[str, str] | None:
  """``(key, why)`` for the first thing wrong with the JSON object ``obj``
  (called ``name``; ``""`` for the whole file) against ``schema``, or None.

  The message lists the keys the object misses and those it must have, or
  the unknown keys and those it may have.
  """
  where = f"\"{name}\"" if name else "the file"
  dot = f"{name}." if name else ""
  if not isinstance(obj, dict):
    return name or "(top level)", (
        f"{where} must be an object with keys among {list(schema)}, got "
        f"{short(obj)}")
  missing = [k for k in required if k not in obj]
  if missing:
    return dot + missing[0], (
        f"{where} misses {missing} (the keys it must have: "
        f"{list(required)})")
  unknown = [] if extra else [k for k in obj if k not in schema]
  if unknown:
    return dot + str(unknown[0]), (
        f"{where} has unknown {short(unknown)} (the keys it may have: "
        f"{list(schema)})")
  for key, v in obj.items():
    if key not in schema:
      continue
    kind, lo, hi, nullable = schema[key]
    if v is None and nullable:
      continue
    if isinstance(kind, Obj):
      got = object_error(v, dot + key, kind.schema, kind.required,
                         kind.extra)
      if got:
        return got
      continue
    why = value_error(dot + key, v, kind, lo, hi)
    if why:
      return dot + key, why
  return None


def read_bytes(path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes | Damaged:
  """The bytes of the regular file ``path`` (at most ``max_bytes``).

  Opened non-blocking (a FIFO without a writer would block the open) and
  checked with ``fstat`` before reading: a directory, a FIFO or a device
  (``/dev/zero`` never ends) is :class:`Damaged`, as is a file that cannot
  be read or is larger; a file that does not exist is ``Damaged(...,
  missing=True)``.
  """
  if not isinstance(path, (str, os.PathLike)) or isinstance(path, bool):
    return Damaged(str(path), f"is not a path (got {type(path).__name__})")
  path = os.fspath(path)
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
  except FileNotFoundError:
    return Damaged(path, "does not exist", missing=True)
  except OSError as e:
    return Damaged(path, f"cannot be read: {e.strerror or e}")
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    return Damaged(path, "is a directory" if stat.S_ISDIR(mode) else
                   "is not a regular file (a FIFO or a device?)")
  with os.fdopen(fd, "rb") as f:
    try:
      raw = f.read(max_bytes + 1)
    except OSError as e:
      return Damaged(path, f"cannot be read: {e.strerror or e}")
  if len(raw) > max_bytes:
    return Damaged(path, f"is larger than {max_bytes} bytes")
  return raw


class _RepeatedKey(Exception):
  """A key given twice in one JSON object (``args[0]`` the key)."""


def _unique_keys(pairs: list) -> dict:
  """``object_pairs_hook`` of :func:`parse_json`: the object, or
  :class:`_RepeatedKey` for its first key given twice."""
  obj = {}
  for key, value in pairs:
    if key in obj:
      raise _RepeatedKey(key)
    obj[key] = value
  return obj


def parse_json(raw: bytes, path: str):
  """The JSON value of ``raw`` (the bytes of ``path``), or :class:`Damaged`:
  not UTF-8, empty, not JSON (truncated, binary), nested too deeply,
  holding an integer longer than Python converts (4,300 digits), or an
  object holding a key twice (``key`` that key; no writer writes one, and
  which value was meant is unknown)."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return Damaged(path, f"is not UTF-8 text (byte {raw[e.start]:#04x} at "
                   f"offset {e.start})")
  if not text.strip():
    return Damaged(path, "is not JSON: the file is empty")
  try:
    return json.loads(text, object_pairs_hook=_unique_keys)
  except _RepeatedKey as e:
    return Damaged(path, f"holds the key {e.args[0]!r} twice in one object; "
                   "keep one", key=e.args[0])
  except json.JSONDecodeError as e:
    return Damaged(path, f"is not JSON: {e}")
  except RecursionError:
    return Damaged(path, "is not JSON: nested too deeply")
  except ValueError:  # an integer longer than Python converts
    return Damaged(path, "is not JSON: it holds a number of more than "
                   "4300 digits (no run writes one)")


def read_json(path: str, schema: dict | None = None, required=(), *,
              extra: bool = False, check: Callable | None = None,
              max_bytes: int = MAX_FILE_BYTES):
  """The JSON document of ``path``, checked, or :class:`Damaged`.

  Args:
    path: the file.
    schema: the top-level object's fields (see the module docstring); None:
      any JSON value.
    required: keys the object must have.
    extra: accept keys ``schema`` does not name.
    check: a further ``check(value) -> (key, why) | None`` (rules between
      keys).
    max_bytes: the largest file read.
  """
  raw = read_bytes(path, max_bytes)
  if isinstance(raw, Damaged):
    return raw
  value = parse_json(raw, os.fspath(path))
  if isinstance(value, Damaged) or schema is None:
    return value
  got = object_error(value, "", schema, required, extra) or (
      check(value) if check else None)
  if got:
    return Damaged(os.fspath(path), got[1], key=got[0])
  return value


@dataclasses.dataclass(frozen=True)
class Lines:
  """A JSON-lines file read back: its ``records``, the line number of a
  ``torn`` last line (a write cut short; ignored) or None, and whether the
  file needs rewriting (``dirty``: a torn or unterminated last line)."""
  records: list
  torn: int | None
  dirty: bool


def read_jsonl(path: str, check: Callable[[dict], str | None] | None = None,
               max_bytes: int = MAX_FILE_BYTES) -> Lines | Damaged:
  """One JSON object per line, each checked by ``check(record) -> why |
  None`` (:func:`parse_jsonl` of the file's bytes), or :class:`Damaged`."""
  data = read_bytes(path, max_bytes)
  if isinstance(data, Damaged):
    return data
  return parse_jsonl(data, os.fspath(path), check)


def parse_jsonl(data: bytes, path: str,
                check: Callable[[dict], str | None] | None = None
                ) -> Lines | Damaged:
  """The records of the JSON-lines bytes ``data`` (of the file ``path``).

  Blank lines are skipped. A last line without its newline that is not
  JSON (one holding a key twice is JSON: damage) is a write cut short (the run died while writing it): it is left
  out (``Lines.torn``). Any other line that is not a JSON object, or that
  ``check`` refuses, makes the file :class:`Damaged` (its ``key`` the
  ``"line N"`` at fault, its reason starting with it).
  """
  lines = data.split(b"\n")
  tail = lines.pop()  # after the last newline: b"" unless a write was torn
  records, torn = [], None
  for number, raw in enumerate(lines + [tail], start=1):
    if not raw.strip(b" \t\r\0"):
      continue
    record = parse_json(raw, path)
    if not isinstance(record, (dict, Damaged)):
      record = Damaged(path, "is not a JSON object")
    if isinstance(record, Damaged):
      if number == len(lines) + 1 and record.key is None:  # write cut short
        torn = number
        break
      why = record.reason.removeprefix("is ")
      return Damaged(path, f"line {number}: not a JSON record ({why})",
                     key=f"line {number}")
    why = check(record) if check else None
    if why:
      return Damaged(path, f"line {number}: {why}", key=f"line {number}")
    records.append(record)
  return Lines(records, torn, bool(tail))


def finite_series(records: list[dict], key: str, x: str = "step"
                  ) -> tuple[list, list] | str:
  """``(xs, ys)`` of the records with a non-null ``key`` and ``x``: a
  non-empty series of finite numbers with increasing ``xs``, or why not
  (one line naming ``key``)."""
  pairs = [(r[x], r[key]) for r in records
           if r.get(key) is not None and r.get(x) is not None]
  if not pairs:
    return f"has no {key!r} record"
  for step, v in pairs:
    if not is_real(step):
      return (f"{x!r} of a {key!r} record must be a finite number, got "
              f"{short(step)}")
    if not is_real(v):
      return (f"{key!r} at {x}={short(step)} must be a finite number, got "
              f"{short(v)}")
  for (a, _), (b, _) in zip(pairs, pairs[1:]):
    if b <= a:
      return (f"the {key!r} records' {x!r} must increase, got {short(b)} "
              f"after {short(a)} (lines out of order or repeated)")
  return [p[0] for p in pairs], [p[1] for p in pairs]


def series_range_error(xs, ys, key: str, lo=None, hi=None,
                       x: str = "step") -> str | None:
  """Why a series of :func:`finite_series` has a value outside ``[lo, hi]``
  (None: unbounded), naming ``key`` and the first such ``x``; None if all
  are in range (e.g. a cross-entropy loss >= 0, an accuracy in [0, 1])."""
  for step, v in zip(xs, ys):
    if not _in(v, lo, hi):
      rule = (f"in [{lo:g}, {hi:g}]" if lo is not None and hi is not None
              else f">= {lo:g}" if lo is not None else f"<= {hi:g}")
      return (f"{key!r} at {x}={float(step):g} must be {rule}, got "
              f"{float(v):g}")
  return None


__all__ = ("Damaged", "Lines", "MAX_FILE_BYTES", "Obj", "finite_series",
           "object_error", "parse_json", "parse_jsonl", "read_bytes",
           "read_json", "read_jsonl", "series_range_error", "short",
           "value_error")
