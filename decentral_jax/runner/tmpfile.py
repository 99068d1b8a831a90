"""Writing a run's file through a temporary name, then renaming it in place.

Every file the runner rewrites whole (``metrics.jsonl`` cut back on a
resume, a ``SHA256SUMS`` manifest) is first written to ``<path>.tmp`` and
then renamed over ``<path>``, so a crash leaves the old file or the new
one, never half of one. Whatever a crashed or hostile earlier run left at
the ``.tmp`` name is never followed nor opened: a symbolic link there would
send the records into the file it points to (outside the work directory),
and a FIFO would block the open for ever. It is removed (``unlink``, which
removes a link itself, not its target) and the temporary file is created
anew with ``O_CREAT | O_EXCL | O_NOFOLLOW``; a directory at that name is
refused, naming it, since removing a directory could lose files.
"""

from __future__ import annotations

import os
import stat

_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL
          | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))


class TmpDirectoryError(ValueError):
  """A directory sits at the temporary name of a file the run rewrites."""


def _clear(tmp: str) -> None:
  """Removes what is at ``tmp`` (a file, a link, a FIFO ...), never
  following a link. Raises :class:`TmpDirectoryError` for a directory."""
  try:
    mode = os.lstat(tmp).st_mode
  except FileNotFoundError:
    return
  if stat.S_ISDIR(mode):
    raise TmpDirectoryError(
        f"{tmp} is a directory, not a temporary file of the run; move it "
        "away (the run writes and renames its own) and run again.")
  os.unlink(tmp)


def replace(path: str, text: str, fsync: bool = False) -> None:
  """Writes ``text`` (UTF-8) to ``path + ".tmp"`` and renames it to ``path``.

  Args:
    path: the file to replace (created if missing).
    text: its whole new content.
    fsync: flush the temporary file to disk before the rename.

  Raises:
    TmpDirectoryError: a directory is at ``path + ".tmp"`` (a
      ``ValueError`` naming that path and the fix).
    OSError: the file cannot be written or renamed (the caller names it).
  """
  tmp = path + ".tmp"
  _clear(tmp)
  fd = os.open(tmp, _FLAGS, 0o644)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
    if fsync:
      f.flush()
      os.fsync(f.fileno())
  os.replace(tmp, path)


def not_regular_error(path: str) -> str | None:
  """Why ``path``, if it exists, is not a regular file a run may read or
  rewrite (checked with ``lstat``, before any open: opening a FIFO blocks
  for ever), or None: a symbolic link, a directory, a FIFO, a socket or a
  device."""
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    return None
  except OSError as e:
    return f"cannot be read: {e.strerror or e}"
  if stat.S_ISREG(mode):
    return None
  if stat.S_ISLNK(mode):
    return "is a symbolic link, not the run's own file"
  return ("is a directory" if stat.S_ISDIR(mode) else
          "is not a regular file (a FIFO, a socket or a device)")
