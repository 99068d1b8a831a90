"""A work directory belongs to one run at a time: ``<workdir>/run.lock``.

:func:`hold` takes the lock at the start of
:func:`decentral_jax.runner.train.train_and_evaluate`, before anything else is
written, and releases it when the run ends (normally, on an error, or after
a SIGTERM). While a run holds it the file names the holder (host, pid,
start time, command line); it is empty when no run holds it, and is not
deleted, except by :func:`hold` when this holder created the file and the
body refuses the directory (:class:`NotARunDirectory`) or raises before it
wrote anything there: then nothing of ours is left in a directory that is
not ours, or that a refused run never used. A taker checks, once it
holds the flock, that the path still names the file it locked (else it
opens the new one), so a deleted lock file never lets two runs hold two
different files.

A second run on the same directory is refused with
:class:`WorkdirInUse`, naming the holder. A lock left by a run that was
killed (SIGKILL, OOM, a lost node) is taken over with a warning naming the
old holder.

Why ``fcntl.flock`` rather than ``O_EXCL`` plus a pid check: the kernel
drops a flock when its holder dies however it dies, so a stale lock can
never block a new run, a recycled pid can never keep one alive, and no
liveness guess is needed. A pid check only works on the holder's own host,
but a requeued cluster job usually restarts on another node, where an
``O_EXCL`` file left by the killed job could not be told from a live one.
NFS (v4, or v3 with the lock manager), GPFS and Lustre mounted with
``-o flock`` apply flock across hosts. Where the file system has no locks
(``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``) the run goes ahead with a warning;
on mounts whose flock is local to each host (Lustre ``localflock``, NFS
``local_lock=flock``) only runs on the same host exclude each other. The
lock file descriptor is not inherited across ``exec``; a child forked
without ``exec`` would keep the lock for as long as it lives.

Multi-process jobs: process 0 takes the lock for the whole job (all
processes share the directory) and tells the others the outcome, so every
process stops with the same one-line error when the directory is in use.
:func:`hold` is re-entrant in the thread that holds it, so a caller can
hold the directory over a whole run (e.g. clear it with :func:`clear`,
then train in it) without another run slipping in between.

Also here, for the files a run keeps in its work directory: one-line OS
errors (:class:`PathError`, :func:`os_error_text`); ``SHA256SUMS``
manifests (:func:`write_sums`, :func:`check_sums`) and
:func:`not_regular_error` are re-exported from
:mod:`decentral_jax.runner.checksums` and :mod:`decentral_jax.runner.tmpfile`.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import fnmatch
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import threading
from typing import Iterable, Iterator

import jax
import numpy as np

from decentral_jax.runner import tmpfile
# Re-exported: the manifests and the file-kind check live in their modules.
from decentral_jax.runner.checksums import SUMS_FILE, check_sums, write_sums  # pylint: disable=unused-import
from decentral_jax.runner.tmpfile import not_regular_error  # pylint: disable=unused-import

LOCK_FILE = "run.lock"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
_MESSAGE_BYTES = 4096
# Work directories held by this process: abspath -> (thread id, lock).
_HELD: dict[str, tuple[int, "WorkdirLock | None"]] = {}


class WorkdirInUse(ValueError):
  """Another live run holds the work directory's lock."""


class NotARunDirectory(ValueError):
  """:func:`clear` refuses a directory (a symlink, a file, or one holding
  entries a run does not write)."""


class PathError(OSError, ValueError):
  """A path of the run cannot be created or written.

  Raised for read-only file systems, missing permissions, a file where a
  directory should be, or a full disk. ``str()`` is one line naming the
  path and the OS error; ``errno`` is the OS error number. A subclass of
  both ``OSError`` and ``ValueError`` (the command line reports
  ``ValueError`` in one line).
  """


def path_error(what: str, path: str, err: OSError) -> PathError:
  """A :class:`PathError` ``"cannot <what> <path>: <OS error>"``."""
  reason = err.strerror or str(err)
  code = errno.errorcode.get(err.errno, "") if err.errno else ""
  e = PathError(f"cannot {what} {path}: {reason}"
                + (f" ({code})" if code else ""))
  e.errno = err.errno  # str() stays the one-line message
  return e


def _describe(holder: dict) -> str:
  parts = [f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"]
  if holder.get("started"):
    parts.append(f"started {holder['started']}")
  if holder.get("command"):
    parts.append(f"command: {holder['command']}")
  return ", ".join(parts)


def _is_pid(value) -> bool:
  """A process id a lock record may name (the file may hold anything)."""
  return (isinstance(value, int) and not isinstance(value, bool)
          and 0 < value < 1 << 31)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


class WorkdirLock:
  """The lock file of one work directory (see the module docstring).

  Attributes:
    workdir: the work directory.
    path: ``<workdir>/run.lock``.
    flag: the command-line flag that names the directory, for the
      in-use message (``--workdir`` for train.py, ``--outdir`` for
      compare.py).
    previous: the record of a holder that ended without releasing the lock
      (taken over by :meth:`acquire`), else None.
    created: whether :meth:`acquire` created the lock file.
  """

  def __init__(self, workdir: str, flag: str = "--workdir"):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self.flag = flag
    self.previous = None
    self.created = False
    self._fd = None

  def _read(self, fd: int) -> dict:
    data = os.pread(fd, _MESSAGE_BYTES, 0).decode("utf-8", "replace")
    if not data.strip():
      return {}
    try:
      record = json.loads(data)
    except json.JSONDecodeError:
      return {"pid": "?", "host": "?", "command": data.strip()[:200]}
    return record if isinstance(record, dict) else {}

  def acquire(self) -> None:
    """Creates the work directory if needed and takes its lock.

    Raises:
      WorkdirInUse: a live run holds the lock; the message names its host,
        pid, start time and command.
      PathError: the directory or the lock file cannot be created or
        written (e.g. a read-only file system).
    """
    try:
      os.makedirs(self.workdir, exist_ok=True)
    except OSError as e:
      if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a file on the path
        error = PathError(f"the work directory {self.workdir} is a file, or "
                          "inside one, not a directory; give a directory (it "
                          "is created if missing).")
        error.errno = e.errno
        raise error from None
      raise path_error("create the work directory", self.workdir, e) from None
    for _ in range(8):  # a holder may delete the file we opened (discard)
      fd = self._open()
      try:
        if self._lock(fd):
          break
      except BaseException:
        os.close(fd)
        raise
      os.close(fd)
    else:
      raise path_error("lock", self.path, OSError(
          errno.EAGAIN, "the lock file keeps being replaced"))
    try:
      previous = self._read(fd)
      if previous:
        self.previous = previous
        gone = ""
        if previous.get("host") == socket.gethostname() and _is_pid(
            previous.get("pid")) and not _pid_alive(previous["pid"]):
          gone = f"; pid {previous['pid']} is no longer running"
        logging.warning("taking over the lock %s left by a run that ended "
                        "without releasing it (%s%s).", self.path,
                        _describe(previous), gone)
      record = {"host": socket.gethostname(), "pid": os.getpid(),
                "started": datetime.datetime.now().astimezone().isoformat(
                    timespec="seconds"),
                "command": " ".join(sys.argv)[:500]}
      try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
      except OSError as e:
        raise path_error("write", self.path, e) from None
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd

  def _open(self) -> int:
    """Opens (creating if missing) the lock file; sets :attr:`created`.

    Never follows a symbolic link (``O_NOFOLLOW``): a ``run.lock`` that is
    a link, or not a regular file, is refused (:class:`PathError`), so the
    lock never empties, overwrites or shows a file it points to.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
    try:
      try:
        fd = os.open(self.path, flags | os.O_EXCL, 0o644)
        self.created = True
      except FileExistsError:
        fd = os.open(self.path, flags, 0o644)
        self.created = False
    except OSError as e:
      if e.errno == errno.ELOOP and os.path.islink(self.path):
        raise PathError(
            f"the lock file {self.path} is a symbolic link (to "
            f"{os.readlink(self.path)}), which is never followed; remove the "
            f"link or pass another {self.flag}.") from None
      raise path_error("write to the work directory", self.path, e) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      os.close(fd)
      raise PathError(f"the lock file {self.path} is not a regular file; "
                      f"remove it or pass another {self.flag}.")
    return fd

  def _lock(self, fd: int) -> bool:
    """Flocks ``fd``; False if the path no longer names its file."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._read(fd)
      raise WorkdirInUse(
          f"the work directory {self.workdir} is in use by another run "
          f"({_describe(holder)}; lock file {self.path}); wait for it to "
          f"finish, stop it, or pass another {self.flag}.") from None
    except OSError as e:
      if e.errno not in _NO_LOCKS:
        raise path_error("lock", self.path, e) from None
      logging.warning("%s: the file system has no file locks (%s); a "
                      "second run on this work directory would not be "
                      "detected.", self.path, e.strerror)
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(self.path))
    except FileNotFoundError:
      same = False
    return same

  def discard(self) -> None:
    """Releases the lock, deleting the lock file if :meth:`acquire`
    created it (a directory refused by :func:`clear` keeps nothing of
    ours); else as :meth:`release`."""
    if self._fd is not None and self.created:
      with contextlib.suppress(OSError):
        os.unlink(self.path)  # while held: a taker then opens a new file
    self.release()

  def release(self) -> None:
    """Empties the lock file and releases the lock (no-op if not held)."""
    fd, self._fd = self._fd, None
    if fd is None:
      return
    with contextlib.suppress(OSError):
      os.ftruncate(fd, 0)  # "no holder", while still holding the lock
    os.close(fd)  # releases the flock

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def os_error_text(e: BaseException) -> tuple[int | None, str]:
  """``(errno, "strerror (ENAME)")`` of an OS error, also one reported
  inside TensorStore's message (``os_error_code='28'``) or chained; else
  ``(None, one line)``: a chained TensorStore status (``OUT_OF_RANGE: ...``)
  if there is one, or the first line of the message."""
  seen, cur, status = set(), e, None
  while cur is not None and id(cur) not in seen:
    seen.add(id(cur))
    code = cur.errno if isinstance(cur, OSError) else None
    if not code and (m := re.search(r"os_error_code='(\d+)'", str(cur))):
      code = int(m.group(1))
    if code:
      return code, f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    if status is None and re.match(r"[A-Z_]{4,}: ", str(cur)):
      status = str(cur)
    cur = cur.__cause__ or cur.__context__
  text = status if status is not None else str(e)
  line = (text.strip().splitlines() or [type(e).__name__])[0]
  return None, line[:300]


def broadcast_from_main(text: str) -> str:
  """Process 0's ``text`` (at most 4096 UTF-8 bytes) on every process.

  A collective: every process of a multi-process job must call it, in the
  same order. Returns ``text`` unchanged in a single-process run.
  """
  if jax.process_count() == 1:
    return text
  # pylint: disable-next=import-outside-toplevel
  from jax.experimental import multihost_utils
  raw = text.encode("utf-8")[:_MESSAGE_BYTES - 1]
  buf = np.zeros(_MESSAGE_BYTES, np.uint8)
  buf[:len(raw)] = np.frombuffer(raw, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return out.tobytes().split(b"\0", 1)[0].decode("utf-8", "replace")


def _entries(workdir: str) -> set[str] | None:
  """The names in ``workdir`` (None if it cannot be listed)."""
  try:
    return set(os.listdir(workdir))
  except OSError:
    return None


@contextlib.contextmanager
def hold(workdir: str, flag: str = "--workdir"
         ) -> Iterator[WorkdirLock | None]:
  """Holds ``workdir``'s lock for the body (process 0 of a job takes it).

  Every process of a multi-process job must enter this together: process 0
  acquires the lock and shares the outcome, so all processes raise the
  same error when the directory is in use or not writable. Re-entrant: in
  the thread that already holds ``workdir`` it yields the held lock (no
  collective, nothing released on leaving the inner block). If the body
  raises :class:`NotARunDirectory` (the directory was refused), or raises
  anything before it added or removed an entry of ``workdir`` (the run was
  refused or stopped before it started), a lock file this call created is
  deleted again; a run that wrote something keeps it (emptied).

  Args:
    workdir: the work directory.
    flag: the flag that names it, for the in-use message (``--workdir``,
      compare.py's ``--outdir``).

  Yields:
    The held :class:`WorkdirLock` on process 0, None on other processes.

  Raises:
    WorkdirInUse: another run holds the lock.
    PathError: the work directory cannot be created or written.
  """
  key = os.path.abspath(workdir)
  if key in _HELD and _HELD[key][0] == threading.get_ident():
    yield _HELD[key][1]
    return
  lock = WorkdirLock(workdir, flag) if jax.process_index() == 0 else None
  error = None
  if lock is not None:
    try:
      lock.acquire()
    except (WorkdirInUse, PathError) as e:
      error = e
  kind = "" if error is None else f"{type(error).__name__}:{error}"
  kind = broadcast_from_main(kind)
  if error is not None:
    raise error
  if kind:
    name, _, message = kind.partition(":")
    raise (WorkdirInUse if name == "WorkdirInUse" else PathError)(message)
  _HELD[key] = (threading.get_ident(), lock)
  before = _entries(key) if lock is not None and lock.created else None
  try:
    yield lock
  except BaseException as e:
    # Refused (NotARunDirectory), or stopped before writing anything: a
    # lock file this call created is not left behind.
    if before is not None and (isinstance(e, NotARunDirectory)
                               or _entries(key) == before):
      lock.discard()
    raise
  finally:
    del _HELD[key]
    if lock is not None:
      lock.release()


def holds_entries(workdir: str) -> bool:
  """Whether the directory ``workdir`` holds anything but its lock file
  (False if it does not exist)."""
  return os.path.isdir(workdir) and any(
      n != LOCK_FILE for n in os.listdir(workdir))


def check_run_directory(workdir: str, entries: Iterable[str]) -> list[str]:
  """The sorted names in ``workdir`` if it is a run's work directory:
  a directory, not a symbolic link, holding only ``entries`` (names or
  shell patterns of what a run writes) and its lock file.

  Raises:
    NotARunDirectory: a symbolic link (its target may be anyone's; a
      dangling one too), not a directory (a file, a FIFO), or an entry not
      in ``entries`` (someone's data; one line naming both); a
      ``ValueError``.
  """
  if os.path.islink(workdir):
    dangling = "" if os.path.exists(workdir) else ", which does not exist"
    raise NotARunDirectory(
        f"{workdir} is a symbolic link (to {os.readlink(workdir)}{dangling}),"
        " so it is not replaced; remove the link or choose another output "
        "directory.")
  if not os.path.isdir(workdir):
    raise NotARunDirectory(f"{workdir} is not a directory; move it away or "
                           "choose another output directory.")
  allowed = [*entries, LOCK_FILE]
  names = sorted(os.listdir(workdir))
  foreign = [n for n in names
             if not any(fnmatch.fnmatchcase(n, e) for e in allowed)]
  if foreign:
    raise NotARunDirectory(
        f"{workdir} is not a run directory of this project (it holds "
        f"{foreign[0]!r}" + (f" and {len(foreign) - 1} more" if len(foreign)
                             > 1 else "")
        + "), so it is not replaced; move it away or choose another output "
        "directory.")
  return names


def clear(workdir: str, entries: Iterable[str]) -> None:
  """Empties a run's work directory, keeping its lock file.

  Removes each of ``entries`` (names of files and directories a run
  writes, e.g. ``config.json``, ``checkpoints``, or shell patterns such as
  ``metrics.jsonl.corrupt*``) found in ``workdir``; hold
  the directory (:func:`hold`) while calling it. Nothing is removed if the
  directory is a symbolic link (its target may be anyone's) or holds any
  other entry: it is then not recognisably a run directory, and may be
  someone's data.

  Raises:
    NotARunDirectory: ``workdir`` is a symbolic link, not a directory, or
      holds an entry not in ``entries`` (one line naming both); a
      ``ValueError`` (:func:`check_run_directory`).
    PathError: an entry cannot be removed.
  """
  names = check_run_directory(workdir, entries)
  for name in names:
    if name == LOCK_FILE:
      continue  # never deleted while held (see the module docstring)
    path = os.path.join(workdir, name)
    try:
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.remove(path)
    except OSError as e:
      raise path_error("remove", path, e) from None
