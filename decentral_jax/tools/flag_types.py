"""Flag types and flag rules shared by the command lines.

Every numeric flag of a command is read by a type of this module: a
bounded, finite integer (:func:`integer`, :func:`power_of_two`), real
number (:func:`real`) or
comma-separated list of them (:func:`number_list`). A value it cannot use
(NaN, inf, a negative count, a count the program cannot hold) is refused
while the flags are parsed, before any work starts, in one line that
argparse prefixes with the flag (``error: argument --repeats: must be an
integer in [2, 1000], got '99999999999'``).

A flag that has a meaning only together with another one is a row of a
command's dependency table, :class:`Needs`; :func:`check_needs` checks the
table once after parsing and refuses a flag given where it has no effect
(``--slow-speed has no effect without --slow-fraction above 0; ...``), as
the runner refuses the equivalent config fields
(:mod:`decentral_jax.runner.field_rules`). :func:`given_flags` tells which
flags the command line gave (abbreviations resolved as argparse does).

An output path is checked before the work that writes it, by trying the
write (:func:`check_output_file`, :func:`check_output_dir`), and an input
file by opening it (:func:`check_input_file`), so a typo does not cost the
run; the final write itself goes through :func:`write_output` (a full
device: one ``error:`` line naming the flag and path, not a traceback).

:class:`Parser` is argparse with its errors as one ``error:`` line and exit
code 2, and a flag given twice refused (:func:`repeated_flag`: the last
value would silently win) but for one that adds to a list. No JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import stat
import sys
import tempfile
from typing import Any, Callable, Iterable

from decentral_jax import checks

#: Largest int32: step counters, periods and counts are int32 on device.
INT32_MAX = 2**31 - 1
#: Most entries of a comma-separated numeric flag.
MAX_LIST = 64


class Parser(argparse.ArgumentParser):
  """argparse with its errors as one ``error:`` line (exit code 2), and a
  flag given twice refused (:func:`repeated_flag`) instead of the last
  value silently winning."""

  def error(self, message):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)

  def parse_known_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    owner, why = _repeat(self, args)
    if why:  # the subcommand's parser names its own --help
      (owner if isinstance(owner, Parser) else self).error(why)
    return super().parse_known_args(args, namespace)


# Actions a flag may repeat: each use adds to a list or a count.
_REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction,  # pylint: disable=protected-access
               argparse._CountAction, argparse._HelpAction,  # pylint: disable=protected-access
               argparse._VersionAction)  # pylint: disable=protected-access


def _flag_action(parser: argparse.ArgumentParser, token: str):
  """The action ``token`` (``--x``, ``--x=v``, ``-x``, a unique prefix of
  a long flag) names in ``parser``, or None."""
  name = token.split("=", 1)[0] if token.startswith("--") else token
  table = parser._option_string_actions  # pylint: disable=protected-access
  if name in table:
    return table[name]
  if not name.startswith("--"):
    return None
  matches = {a for o, a in table.items() if o.startswith(name)}
  return matches.pop() if len(matches) == 1 else None


def _shown(args: list[str], k: int, action) -> str:
  """The flag at ``args[k]`` with its value, as typed (``--n 8``)."""
  token = args[k]
  if "=" in token or action.nargs == 0 or k + 1 >= len(args):
    return token
  return f"{token} {args[k + 1]}"


def repeated_flag(parser: argparse.ArgumentParser,
                  args: list[str]) -> str | None:
  """Why ``args`` give one flag of ``parser`` (or of the subcommand they
  name) twice, or None: ``--n-workers 8 --n-workers 32`` would price 32
  alone, so a repeat is refused as a typo, like a repeated entry inside a
  list flag (:func:`repeated_entry`). A flag that adds to a list or a
  count (``action="append"``: ``--set``, ``--xla``) may repeat. Spellings
  of one flag (an abbreviation, ``--x=v``, ``--no-x``) count as one.
  Nothing after ``--`` counts."""
  return _repeat(parser, args)[1]


def _repeat(parser, args):
  """``(the parser owning the repeated flag, why)``, or ``(parser, None)``
  (:func:`repeated_flag`)."""
  seen = {}
  for k, token in enumerate(args):
    if token == "--":
      break
    subs = [a for a in parser._actions  # pylint: disable=protected-access
            if isinstance(getattr(a, "choices", None), dict)
            and a.option_strings == [] and token in a.choices]
    if subs:  # the subcommand's own flags from here on
      parser, seen = subs[0].choices[token], {}
      continue
    action = _flag_action(parser, token) if token.startswith("-") else None
    if action is None or isinstance(action, _REPEATABLE):
      continue
    if id(action) in seen:
      first = seen[id(action)]
      return parser, (f"{action.option_strings[-1]} is given twice "
                      f"({_shown(args, first, action)}, then "
                      f"{_shown(args, k, action)}); give it once.")
    seen[id(action)] = k
  return parser, None


def _range_words(lo, hi, open_lo: bool) -> str:
  return f"in {'(' if open_lo else '['}{lo:g}, {hi:g}]"


def integer(lo: int, hi: int, unit: str = ""):
  """An argparse ``type``: a whole number in ``[lo, hi]``.

  ``"1e3"`` (a whole float in a count's usual spelling) reads as 1000;
  ``"2.5"``, ``"nan"``, ``"inf"`` and values out of range are refused.
  ``unit`` ends the message (e.g. ``" (steps)"``).

  Raises:
    argparse.ArgumentTypeError: ``must be an integer in [lo, hi], got 'x'``.
  """
  def parse(text: str) -> int:
    value = _whole(text)
    if value is None or not lo <= value <= hi:
      raise argparse.ArgumentTypeError(
          f"must be an integer in [{lo}, {hi}]{unit}, got {text!r}")
    return value
  parse.bounds, parse.kind, parse.unit = (lo, hi, False), "integer", unit
  return parse


def power_of_two(lo: int, hi: int, unit: str = ""):
  """An argparse ``type``: a power of two in ``[lo, hi]`` (a worker count
  of ``one_peer_exp``, whose rounds pair ``j`` with ``j XOR 2^r``).

  Raises:
    argparse.ArgumentTypeError: ``must be a power of two in [lo, hi],
      got 'x'``.
  """
  def parse(text: str) -> int:
    value = _whole(text)
    if value is None or not lo <= value <= hi or value & (value - 1):
      raise argparse.ArgumentTypeError(
          f"must be a power of two in [{lo}, {hi}]{unit}, got {text!r}")
    return value
  parse.bounds, parse.kind, parse.unit = (lo, hi, False), "integer", unit
  return parse


# An integer's canonical text: ASCII digits without a leading zero.
_CANONICAL_INT = re.compile(r"0|[1-9][0-9]*")


def ascii_int(text: str) -> int | None:
  """``text`` as an int if it is the canonical spelling of one (ASCII
  digits without a leading zero: ``"0"``, ``"16"``), else None.
  ``str.isdigit()`` also takes ``"²"``, which ``int`` refuses, and ``int``
  reads ``"٣"``, ``"01"`` or ``" 1"`` as 3 and 1: a value another one could
  spell differently."""
  if not isinstance(text, str) or not _CANONICAL_INT.fullmatch(text):
    return None
  return int(text)


def host_port(address: str, flag: str) -> tuple[str, int]:
  """``HOST:PORT`` as ``(host, port)``: a hostname, an IPv4 address or a
  bracketed IPv6 address (returned without the brackets) and a port of
  ASCII digits in [1, 65535] (:func:`decentral_jax.checks.host_port`).

  Raises:
    ValueError: any other form or port, naming ``flag`` and the form.
  """
  got = checks.host_port(address)
  if got is None:
    raise ValueError(f"{flag} must be HOST:PORT with a port in [1, 65535] "
                     f"and HOST a hostname, an IPv4 address or [IPv6] (the "
                     f"head node's `ray start --head` address, e.g. "
                     f"{flag} 10.0.0.1:6379), got {address!r}.")
  return got


def _whole(text: str) -> int | None:
  """``text`` as an int (``"16"``, ``"1e3"``), or None
  (:func:`decentral_jax.checks.whole_number`)."""
  return checks.whole_number(text)


def real(lo: float, hi: float, unit: str = "", *, open_lo: bool = False):
  """An argparse ``type``: a finite number in ``[lo, hi]`` (``(lo, hi]``
  with ``open_lo``).

  Raises:
    argparse.ArgumentTypeError: ``must be a finite number in [lo, hi],
      got 'x'``.
  """
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      value = math.nan
    ok = math.isfinite(value) and (value > lo if open_lo else value >= lo) \
        and value <= hi
    if not ok:
      raise argparse.ArgumentTypeError(
          f"must be a finite number {_range_words(lo, hi, open_lo)}{unit}, "
          f"got {text!r}")
    return value
  parse.bounds, parse.kind, parse.unit = (lo, hi, open_lo), "real", unit
  return parse


def comma_parts(text: str, example: str) -> list[str]:
  """``text`` split at commas, each part stripped.

  Raises:
    argparse.ArgumentTypeError: an empty part (a stray comma), named by
      its position, with ``example`` as the fix.
  """
  parts = [t.strip() for t in text.split(",")]
  if "" in parts:
    raise argparse.ArgumentTypeError(
        f"{text!r}: entry {parts.index('') + 1} is empty; separate the "
        f"values by single commas, e.g. {example}")
  return parts


def repeated_entry(text: str, values: list, example: str) -> str | None:
  """Why a list flag's ``values`` (parsed from ``text``) name one value
  twice (``'16,16': entry 2 repeats entry 1 (16); ...``), or None: each
  entry of such a flag is a setting of its own (a worker count, a method),
  so a repeat only prints the same table twice."""
  seen = {}
  for k, value in enumerate(values):
    if value in seen:
      return (f"{text!r}: entry {k + 1} repeats entry {seen[value] + 1} "
              f"({value!r}); give each value once, e.g. {example}")
    seen[value] = k
  return None


def number_list(item, *, max_items: int = MAX_LIST, unique: bool = False):
  """An argparse ``type``: comma-separated values of ``item``
  (:func:`integer`, :func:`power_of_two` or :func:`real`), at most
  ``max_items`` of them.

  Raises:
    argparse.ArgumentTypeError: an empty entry (a stray comma), too many
      entries, an entry ``item`` refuses (named by its position), or with
      ``unique`` a value given twice (:func:`repeated_entry`).
  """
  unit = getattr(item, "unit", "")

  def parse(text: str) -> list:
    parts = comma_parts(text, "1,16")
    if len(parts) > max_items:
      raise argparse.ArgumentTypeError(
          f"at most {max_items} comma-separated values, got {len(parts)}")
    out = []
    for k, part in enumerate(parts):
      try:
        out.append(item(part))
      except argparse.ArgumentTypeError as e:  # "must be ..., got 'x'"
        raise argparse.ArgumentTypeError(
            f"entry {k + 1} of {text!r} {e}") from None
    why = repeated_entry(text, out, "1,16") if unique else None
    if why:
      raise argparse.ArgumentTypeError(why)
    return out
  parse.bounds, parse.kind, parse.unit = item.bounds, item.kind, unit
  return parse


def is_numeric_type(typ: Any) -> bool:
  """Whether ``typ`` is a type of this module (it carries ``bounds``)."""
  return hasattr(typ, "bounds")


def _long_options(parser: argparse.ArgumentParser,
                  command: str | None) -> list[str]:
  """``parser``'s long flags, with those of its subcommand ``command``."""
  out = set()
  for action in parser._actions:  # pylint: disable=protected-access
    out |= {s for s in action.option_strings if s.startswith("--")}
    subs = getattr(action, "choices", None)
    if command is not None and isinstance(subs, dict) and command in subs:
      out |= set(_long_options(subs[command], None))
  return sorted(out)


def given_flags(parser: argparse.ArgumentParser, argv: Iterable[str],
                command: str | None = None) -> set:
  """The long flags ``argv`` gives, as ``parser`` (and its subcommand
  ``command``, if any) spells them: ``--x`` and ``--x=v``, and a unique
  prefix of a flag (argparse's abbreviations) resolved to the flag.
  Nothing after ``--`` counts."""
  options = _long_options(parser, command)
  out = set()
  for token in argv:
    if token == "--":
      break
    if not token.startswith("--"):
      continue
    name = token.split("=", 1)[0]
    if name in options:
      out.add(name)
      continue
    matches = [o for o in options if o.startswith(name)]
    if len(matches) == 1:
      out.add(matches[0])
  return out


@dataclasses.dataclass(frozen=True)
class Needs:
  """One row of a dependency table: ``flag`` has an effect only when
  ``holds(context)`` is true.

  The refusal reads ``f"{flag} has no effect {unless}; {fix}."``, e.g.
  ``unless="without --slow-fraction above 0"``, ``fix="add --slow-fraction
  F or drop --slow-speed"``.
  """
  flag: str
  holds: Callable[[Any], bool]
  unless: str
  fix: str

  def message(self) -> str:
    return f"{self.flag} has no effect {self.unless}; {self.fix}."


def check_needs(table: Iterable[Needs], given: set, context: Any) -> None:
  """Refuses the first flag of ``table`` that was given (``given``, e.g.
  :func:`given_flags`) while its condition does not hold in ``context``.

  Raises:
    ValueError: :meth:`Needs.message` of that row (one line).
  """
  for row in table:
    if row.flag in given and not row.holds(context):
      raise ValueError(row.message())


def _check_path_names(path: str, flag: str) -> None:
  """Refuses a dangling symbolic link and a path component longer than the
  file system allows (both pass the checks below and fail at the write)."""
  if os.path.islink(path) and not os.path.exists(path):
    raise ValueError(f"{flag} {path!r} is a symbolic link to "
                     f"{os.readlink(path)!r}, which does not exist.")
  limit = 255
  with contextlib.suppress(OSError, ValueError):
    limit = os.pathconf(_existing(os.path.abspath(path)), "PC_NAME_MAX")
  long = [p for p in str(path).split(os.sep) if len(os.fsencode(p)) > limit]
  if long:
    raise ValueError(f"{flag}: the name {long[0][:40]!r}... is longer than "
                     f"the {limit} bytes a file name may have.")


def _existing(path: str) -> str:
  """The nearest existing file or directory at or above ``path``."""
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def check_output_file(path: str | None, flag: str) -> None:
  """Refuses an output file ``path`` of ``flag`` that cannot be written:
  empty, a directory, in a parent that is missing or not a directory, or
  not writable: the file is opened for append as the work will (and
  removed again if it did not exist) (None: the flag was not given).

  Raises:
    ValueError: one line naming ``flag``, the path and the fix.
  """
  if path is None:
    return
  if not str(path).strip():
    raise ValueError(f"{flag} is empty; give a file name.")
  _check_path_names(path, flag)
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path) or str(path).endswith(("/", os.sep)):
    raise ValueError(f"{flag} {path!r} is a directory; give a file name.")
  if not os.path.isdir(parent):
    problem = "is not a directory" if os.path.exists(parent) else (
        "does not exist")
    raise ValueError(f"{flag} {path!r}: {parent!r} {problem}; give a file "
                     "in an existing directory.")
  if not os.access(parent, os.W_OK | os.X_OK) or (
      os.path.exists(path) and not os.access(path, os.W_OK)):
    raise ValueError(f"{flag} {path!r} is not writable.")
  _try_append(path, flag)


def _try_append(path: str, flag: str) -> None:
  """Opens ``path`` for append as the work will (a file it creates is
  removed again): what the permission bits do not tell (a read-only or
  virtual file system, a root user) is refused before the work. A FIFO or
  device is left alone (opening one may block or act: ``/dev/stdout`` is
  fine); a socket is refused."""
  existed = os.path.exists(path)
  if existed and stat.S_ISSOCK(os.stat(path).st_mode):
    raise ValueError(f"{flag} {path!r} is a socket, which cannot be opened "
                     "as a file; give a file.")
  if existed and not stat.S_ISREG(os.stat(path).st_mode):
    return
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be written ({e.strerror}); "
                     "give a file in a writable directory.") from None
  os.close(fd)
  if not existed:
    os.remove(path)


def write_output(path: str, flag: str, write: Callable[[Any], Any], *,
                 mode: str = "w", kept: str = "") -> None:
  """The write of a command's output ``path`` (of ``flag``): opens it in
  ``mode`` (``"w"``, ``"a"``, ``"wb"``; text as UTF-8) and calls
  ``write(file)``. A failure the checks before the work cannot foresee (a
  full device, a disk gone) ends the command in one ``error:`` line
  naming the flag and the path, with ``kept`` (where the results still
  are, e.g. ``"the rows were printed above"``), and exit code 2, not a
  traceback.

  Raises:
    SystemExit: code 2 after the ``error:`` line on stderr.
  """
  try:
    with open(path, mode, **({} if "b" in mode else
                             {"encoding": "utf-8"})) as f:
      write(f)
  except OSError as e:
    print(f"error: {flag} {path!r} could not be written ({e.strerror or e})"
          f"{'; ' + kept if kept else ''}; give another "
          f"{flag if flag.startswith('--') else 'path'}.",
          file=sys.stderr)
    raise SystemExit(2) from None


#: Image formats matplotlib writes without extra packages.
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps",
                  ".tif", ".tiff", ".webp")


def check_image_name(path: str, flag: str) -> None:
  """Refuses an image path without one of :data:`IMAGE_SUFFIXES` (without
  one, matplotlib writes ``PATH.png``, another file than the one named;
  an unknown one fails only after the work)."""
  suffix = os.path.splitext(str(path))[1].lower()
  if suffix not in IMAGE_SUFFIXES:
    got = f"ends in {suffix!r}" if suffix else "has no extension"
    raise ValueError(f"{flag} {path!r} {got}; give an image file name, e.g. "
                     f"chart.png (one of {', '.join(IMAGE_SUFFIXES)}).")


def check_output_dir(path: str | None, flag: str) -> None:
  """Refuses an output directory ``path`` of ``flag`` that cannot be used:
  empty, an existing file, or (existing or to be created) not writable
  (None: the flag was not given). Leaves nothing behind: a directory or
  file it creates to try the write is removed.

  Raises:
    ValueError: one line naming ``flag``, the path and the fix.
  """
  if path is None:
    return
  if not str(path).strip():
    raise ValueError(f"{flag} is empty; give a directory.")
  _check_path_names(path, flag)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a file, not a directory; give a "
                     "directory (it is created if missing).")
  existing = _existing(os.path.abspath(path))
  if not os.path.isdir(existing):
    raise ValueError(f"{flag} {path!r} cannot be created: {existing!r} is "
                     "a file.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path!r} is not writable ({existing!r}).")
  _try_directory(os.path.abspath(path), existing, flag)


def _try_directory(path: str, existing: str, flag: str) -> None:
  """Creates ``path`` (below its nearest ``existing`` ancestor) and a file
  in it as the work will, then removes what it created: a read-only or
  virtual file system is refused before the work."""
  made = []
  try:
    for part in os.path.relpath(path, existing).split(os.sep):
      if part in ("", os.curdir):
        continue
      existing = os.path.join(existing, part)
      if not os.path.isdir(existing):
        os.mkdir(existing)
        made.append(existing)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".write_check_")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be written ({e.strerror}); "
                     "give a directory where files can be created.") from None
  finally:
    for made_dir in reversed(made):
      with contextlib.suppress(OSError):
        os.rmdir(made_dir)


def check_input_file(path: str | None, flag: str) -> None:
  """Refuses an input file ``path`` of ``flag`` that cannot be read:
  empty, missing, a directory, not a regular file, or not readable (opened as the work will;
  None or ``""``: the flag was not given).

  Raises:
    ValueError: one line naming ``flag``, the path and the fix.
  """
  if not path:
    return
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a file.")
  if not os.path.exists(path):
    raise ValueError(f"{flag} {path!r} does not exist; give an existing "
                     "file.")
  # Opening a FIFO blocks until a writer comes; /dev/zero never ends.
  if not os.path.isfile(path):
    raise ValueError(f"{flag} {path!r} is not a regular file (a pipe, a "
                     "device or a socket); give a file.")
  try:
    with open(path, "rb"):
      pass
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror}).") \
        from None
