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
errors (:class:`PathError`, :func:`os_error_text`) and ``SHA256SUMS``
checksum manifests of directories (:func:`write_sums`, :func:`check_sums`;
``sha256sum -c`` reads them too), which
:mod:`decentral_jax.runner.checkpoint` writes into every checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import errno
import fcntl
import fnmatch
import hashlib
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

LOCK_FILE = "run.lock"
SUMS_FILE = "SHA256SUMS"
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


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)  # releases the GIL: files are hashed in parallel
  return h.hexdigest()


def _hash_all(root: str, rels: list[str]) -> list[str]:
  workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda r: _sha256(os.path.join(root, r)), rels))


def write_sums(root: str, skip: Iterable[str] = ()) -> None:
  """Writes ``<root>/SHA256SUMS``: every file under ``root`` but ``skip``.

  Files are hashed in parallel threads; the manifest is written to a
  temporary name, flushed to disk and renamed.
  """
  skip = {SUMS_FILE, SUMS_FILE + ".tmp", *skip}  # the .tmp is replaced
  rels = sorted(os.path.relpath(os.path.join(here, name), root)
                for here, _, names in os.walk(root) for name in names)
  rels = [r for r in rels if r not in skip]
  lines = "".join(f"{h}  {r}\n" for h, r in zip(_hash_all(root, rels), rels))
  tmpfile.replace(os.path.join(root, SUMS_FILE), lines, fsync=True)


def _outside(rel: str) -> bool:
  """True if a manifest path leaves its directory (absolute, or ``..``)."""
  return (not rel or os.path.isabs(rel)
          or ".." in rel.replace("\\", "/").split("/"))


def _unlisted_file(root: str, listed: set, exempt: Iterable[str]) -> str | None:
  """The first file under ``root`` (sorted walk) neither in ``listed`` nor
  ``exempt`` nor the manifest itself, or None."""
  exempt = {os.path.normpath(r) for r in (SUMS_FILE, *exempt)}
  for here, dirs, names in os.walk(root):
    dirs.sort()
    for name in sorted(names):
      rel = os.path.normpath(os.path.relpath(os.path.join(here, name), root))
      if rel not in listed and rel not in exempt:
        return rel
  return None


_SUMS_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def _parse_sums(text: str) -> list[tuple[str, str]] | str:
  """The ``(sha256, path)`` entries of a manifest in ``sha256sum``'s
  format (text `` `` or binary ``*`` mode; an identical line repeated
  counts once), or why it is malformed (naming the line)."""
  entries, seen = [], {}
  for k, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    m = _SUMS_LINE.fullmatch(line)
    if m is None or _outside(m.group(2)):
      return (f"line {k} {line!r:.80} is not a 64-digit hex SHA-256, a "
              "space, a space or '*', and a path inside the directory")
    digest, rel = m.group(1).lower(), m.group(2)
    if seen.get(os.path.normpath(rel), digest) != digest:
      return f"line {k} lists {rel!r:.80} again with another checksum"
    if os.path.normpath(rel) not in seen:
      seen[os.path.normpath(rel)] = digest
      entries.append((digest, rel))
  return entries or "it lists no file"


def check_sums(root: str, required: tuple[str, ...] = (),
               complete_except: Iterable[str] | None = None
               ) -> tuple[str, str]:
  """Checks the files of ``root`` against ``<root>/SHA256SUMS``.

  Args:
    root: the directory.
    required: paths (relative to ``root``) the manifest must list when
      they exist: a manifest that leaves one out would let it be edited
      unchecked.
    complete_except: if given, EVERY file under ``root`` but these paths
      (and the manifest) must be listed: a file present but unlisted is
      damage (a manifest written by :func:`write_sums` lists them all).

  Returns:
    ``("ok", "")``; ``("unverified", why)`` if ``root`` has no manifest;
    or ``("corrupt", why)`` naming the first missing or changed file, a
    manifest that is not a regular file (a FIFO: refused unopened), a
    ``required`` file (or with ``complete_except``, any file) the manifest
    leaves out, or a malformed manifest (a
    line that is not ``<sha256>  <path>`` or ``<sha256> *<path>``, a path
    outside ``root``, which is never read, or one path with two
    checksums).
  """
  sums = os.path.join(root, SUMS_FILE)
  why = not_regular_error(sums)
  if why:  # a FIFO would block the read for ever
    return "corrupt", f"{SUMS_FILE} {why}"
  try:
    with open(sums, encoding="utf-8") as f:
      entries = _parse_sums(f.read())
  except FileNotFoundError:
    if not os.path.isdir(root):
      return "corrupt", "the directory is missing"
    if not os.listdir(root):
      return "corrupt", "the directory is empty"
    return "unverified", f"no {SUMS_FILE} (written by an older version?)"
  except (OSError, UnicodeDecodeError) as e:
    return "corrupt", f"{SUMS_FILE} unreadable: {e}"
  if isinstance(entries, str):
    return "corrupt", f"{SUMS_FILE} is malformed ({entries})"
  listed = {os.path.normpath(r) for _, r in entries}
  unlisted = [r for r in required if os.path.normpath(r) not in listed
              and os.path.lexists(os.path.join(root, r))]
  if not unlisted and complete_except is not None:
    unlisted = [r for r in [_unlisted_file(root, listed, complete_except)] if r]
  if unlisted:
    return "corrupt", f"{SUMS_FILE} does not list {unlisted[0]}"
  missing = [r for _, r in entries if not os.path.isfile(os.path.join(root, r))]
  if missing:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return "corrupt", f"missing {missing[0]}{more}"
  for (want, rel), got in zip(entries, _hash_all(root, [r for _, r in entries])):
    if got != want:
      return "corrupt", f"{rel} does not match its checksum"
  return "ok", ""


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
      ``ValueError``.
    PathError: an entry cannot be removed.
  """
  if os.path.islink(workdir):
    raise NotARunDirectory(
        f"{workdir} is a symbolic link (to {os.readlink(workdir)}), so it "
        "is not replaced; remove the link or choose another output "
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
