"""``--flagfile=FILE`` arguments of ``train`` and ``compare``, expanded.

absl's line rules (``FlagValues.read_flags_from_files``): one argument a
line, surrounding whitespace dropped; blank lines and lines that begin
with ``#`` or ``//`` skipped; a ``--flagfile=OTHER`` line is replaced by
``OTHER``'s lines, in place (names relative to the working directory, ``~``
expanded); a file that includes itself, directly or through others, is
skipped there with one ``warning:`` line. Each file is read through
:func:`decentral_jax.records.read_bytes` (never a blocking open: a FIFO
would wait for a writer for ever) and decoded as UTF-8, a leading byte
order mark skipped; what cannot be read is one ValueError naming
``--flagfile FILE``.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Collection, Sequence

from decentral_jax import records

#: The largest flag file read: a flag file is a few hundred bytes.
MAX_FLAGFILE_BYTES = 2**20

_FLAGFILE = ("--flagfile", "-flagfile")
_BOM = b"\xef\xbb\xbf"
_FIX = "give a text file of flags, one a line"
_COMMENT_AFTER = re.compile(r"\s(#|//)")


def expand_flagfiles(args: Sequence[str]) -> list[tuple[str, str]]:
  """``args`` with each ``--flagfile=FILE`` (or ``--flagfile FILE``)
  replaced by the file's arguments (nested files too, by the rules of this
  module's docstring); nothing after ``--`` is expanded.

  Returns:
    ``[(argument, where)]``: ``where`` is ``""`` for an argument typed on
    the command line, ``" in --flagfile FILE"`` for one read from ``FILE``
    named there, ``" in --flagfile INNER, included by FILE"`` for one read
    from a file ``FILE`` includes (and so on, innermost first).

  Raises:
    ValueError: one line naming ``--flagfile``: no file or an empty name
      (``--flagfile=`` with an unset variable), or a file that does not
      exist, is not a regular file (a directory, a FIFO, a device), is
      larger than :data:`MAX_FLAGFILE_BYTES`, is not UTF-8 or holds a NUL
      byte, also when a nested ``--flagfile`` names it.
  """
  out, i = [], 0
  while i < len(args):
    if args[i] == "--":
      out += [(t, "") for t in args[i:]]
      break
    named = _named_file(args[i], args[i + 1:], "")
    if named is None:
      out.append((args[i], ""))
      i += 1
      continue
    name, used = named
    i += used
    out += _file_arguments(name, "", [])
  return out


def origin(argument: str, where: str, known: Collection[str] = ()) -> str:
  """Where ``argument`` was given, for a message naming it: ``where`` as
  :func:`expand_flagfiles` returns it (``""``: the command line), with the
  fix of a flag-file line that was meant otherwise: an indented comment
  (``"  # note"``: a comment must start the line), a comment after a flag
  (``"--config.steps=5  # five"``), or a flag and its value separated by
  a blank as on a command line (``"--workdir runs/a"``: write
  ``--workdir=runs/a``) where the first word is ``--flagfile``, a
  ``--config.FIELD`` override or a flag named in ``known`` (flag names
  without dashes).
  """
  if not where:
    return ""
  arg = argument.strip()
  head, rest = (arg.split(None, 1) + [""])[:2]
  if arg.startswith(("#", "//")):
    return f"{where} (a comment must start the line, no spaces before it)"
  if _COMMENT_AFTER.search(arg):
    return f"{where} (a comment must start a line of its own)"
  name = head.lstrip("-")
  if rest.strip() and head.startswith("-") and "=" not in head and (
      head in _FLAGFILE or name.startswith("config.") or name in known):
    return (f"{where} (a line is one argument: write "
            f"{head}={rest.strip()})")
  return where


def _named_file(token: str, rest: Sequence[str],
                where: str) -> tuple[str, int] | None:
  """``(file name, arguments used)`` of a ``--flagfile`` argument
  ``token`` (``rest``: the arguments after it), or None for another
  argument; ``where`` names the file holding it in an error."""
  if token in _FLAGFILE:
    if not rest:
      raise ValueError(f"--flagfile{where} has no file; give "
                       "--flagfile=FILE.")
    name, used = rest[0], 2
  elif token.startswith(tuple(f + "=" for f in _FLAGFILE)):
    name, used = token.partition("=")[2].strip(), 1
  else:
    return None
  if not name.strip():
    raise ValueError(f"--flagfile{where} is empty; give a flag file or drop "
                     "--flagfile.")
  return name, used


def _file_arguments(name: str, where: str,
                    including: list[str]) -> list[tuple[str, str]]:
  """The ``(argument, where)`` pairs of flag file ``name`` and of the files
  it includes; ``where`` names the file that included it (``""``: the
  command line), ``including`` the real paths of the files being read
  around it."""
  text = _read_text(name, where)
  including = [*including, _real(name)]
  inner = f" in --flagfile {name}" + where.replace(" in --flagfile ",
                                                   ", included by ", 1)
  out = []
  for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
    arg = line.strip()  # a comment starts the line, as in absl
    if not arg or line.startswith(("#", "//")):
      continue
    named = _named_file(arg, [], inner)
    if named is None:
      out.append((arg, inner))
    elif _real(named[0]) in including:
      sys.stderr.write(f"warning: --flagfile {named[0]}{inner} includes a "
                       "file being read (a circle of flag files); that line "
                       "is skipped.\n")
    else:
      out += _file_arguments(named[0], inner, including)
  return out


def _real(name: str) -> str:
  """The real path of flag file ``name`` (``~`` expanded)."""
  return os.path.realpath(os.path.expanduser(name))


def _read_text(name: str, where: str) -> str:
  """The text of flag file ``name`` (``~`` expanded), UTF-8 with a leading
  byte order mark dropped, or one ValueError naming ``--flagfile name``
  (``where``: the file that named it)."""
  raw = records.read_bytes(os.path.expanduser(name), MAX_FLAGFILE_BYTES)
  if isinstance(raw, records.Damaged):
    fix = ("give an existing flag file" if raw.missing else _FIX)
    raise ValueError(f"--flagfile {name}{where} {raw.reason}; {fix}.")
  skip = len(_BOM) if raw.startswith(_BOM) else 0
  try:
    text = raw[skip:].decode("utf-8")
  except UnicodeDecodeError as e:
    at = skip + e.start
    raise ValueError(f"--flagfile {name}{where} is not UTF-8 text (byte "
                     f"{raw[at]:#04x} at offset {at}); {_FIX}, saved as "
                     "UTF-8.") from None
  if "\0" in text:
    raise ValueError(f"--flagfile {name}{where} holds a NUL byte (at offset "
                     f"{skip + len(text[:text.index(chr(0))].encode())}); "
                     f"{_FIX}.")
  return text
