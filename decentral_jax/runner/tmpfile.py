"""Writing a run's file through a temporary name, then renaming it in place.

Every file the runner rewrites whole (``metrics.jsonl`` cut back on a
resume, a ``SHA256SUMS`` manifest) is first written to ``<path>.tmp`` and
then renamed over ``<path>``, so a crash leaves the old file or the new
one, never half of one. Whatever a crashed or hostile earlier run left at
the ``.tmp`` name is never followed nor opened: a symbolic link there would
send the records into the file it points to (outside the work directory),
and a FIFO would block the open for ever. It is removed (``unlink``, which
removes a link itself, not its target) and the temporary file is created
anew with ``O_CREAT | O_EXCL | O_NOFOLLOW``; a directory at that name, or
at the file's own name, is refused, naming it, since removing a directory
could lose files. A write or rename that fails removes the temporary file
and names the file it was to replace.
"""

from __future__ import annotations

import contextlib
import os
import stat

_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL
          | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))


class TmpDirectoryError(ValueError):
  """A directory sits at the name of a file the run rewrites, or at its
  temporary name."""


def _refuse_directory(path: str, what: str) -> bool:
  """Whether something is at ``path`` (``lstat``, never following a link).

  Raises:
    TmpDirectoryError: a directory is there, named with ``what`` it is
      not and the fix.
  """
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    return False
  if stat.S_ISDIR(mode):
    raise TmpDirectoryError(
        f"{path} is a directory, not {what}; move it away (the run writes "
        "and renames its own file) and run again.")
  return True


def replace(path: str, data: str | bytes, fsync: bool = False) -> None:
  """Writes ``data`` (a ``str`` as UTF-8, or ``bytes``) to ``path +
  ".tmp"`` and renames it to ``path``.

  Args:
    path: the file to replace (created if missing; a link or FIFO there
      is replaced, not followed).
    data: its whole new content.
    fsync: flush the temporary file to disk before the rename.

  Raises:
    TmpDirectoryError: a directory is at ``path`` or ``path + ".tmp"`` (a
      ``ValueError`` naming that path and the fix); nothing is written.
    OSError: the file cannot be written or renamed; the temporary file is
      removed and the error's ``filename`` is ``path`` (the caller names
      it).
  """
  tmp = path + ".tmp"
  _refuse_directory(path, "the file the run writes there")
  if _refuse_directory(tmp, "a temporary file of the run"):
    os.unlink(tmp)
  try:
    with os.fdopen(os.open(tmp, _FLAGS, 0o644), "wb") as f:
      f.write(data.encode("utf-8") if isinstance(data, str) else data)
      if fsync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    if isinstance(e, OSError):
      raise OSError(e.errno, e.strerror, path) from None
    raise


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
