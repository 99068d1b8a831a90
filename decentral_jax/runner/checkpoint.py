"""Checkpoints of stacked per-worker training state with Orbax, verified.

A checkpoint holds the whole pytree it is given (every worker's parameters
and optimizer state, stacked ``[n_workers, ...]`` and sharded over the worker
axis, plus step and RNG leaves) and a small JSON document (step, data
position, run facts; :mod:`decentral_jax.runner.run_meta` writes and checks
it) under ``<directory>/<step>/``.

Atomicity: Orbax writes into ``<step>.orbax-checkpoint-tmp`` and renames it
to ``<step>`` once every file is written, so an interrupted save leaves at
most a temporary directory, which :class:`Checkpointer` removes when it
opens the directory and after a failed save. Orbax reports the first of a
save's writes that fails while its other writes (one thread per item or
array batch) may still run, and TensorStore recreates the directories it
writes into; so after a failure :meth:`Checkpointer.close` first waits for
those threads, then removes the temporary directory. Old checkpoints are
deleted only after a newer one is committed.

Integrity: just before the rename, process 0 writes ``<step>/SHA256SUMS``
(every file's SHA-256; ``cd <step> && sha256sum -c SHA256SUMS`` checks it by
hand; :func:`checkpoint_files.check_checkpoint` says which unlisted files
are damage and which are only not the run's) in Orbax's background
thread, so saves stay asynchronous. Only
Orbax's top-level ``_CHECKPOINT_METADATA`` and ``commit_success.txt`` come
later (the first must parse, as a JSON object like every JSON file Orbax
reads). :meth:`Checkpointer.select_restore_step`
verifies before a restore, listing the step entries itself (a regular
file or an empty directory named like a step is damage too, found before
Orbax reads it): a corrupt newest checkpoint is moved to
``<step>.corrupt`` and the previous one used, with one warning naming both;
one without ``SHA256SUMS`` (an older version's) is used unverified.

Errors: a failed save raises :class:`CheckpointWriteError` (the step, the
directory and the OS error, in one line) from the first
:meth:`~Checkpointer.poll`, :meth:`~Checkpointer.wait` or
:meth:`~Checkpointer.save` after it; an unreadable checkpoint raises
:class:`CheckpointError`; both are ``ValueError`` subclasses. Orbax's own
tracebacks of the same failure are dropped from the logs while the
:class:`Checkpointer` is open (for the whole process after
:func:`decentral_jax.runner.orbax_quiet.quiet_orbax_logs`, which the
command-line programs call).
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import re
import shutil
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from decentral_jax.runner import checkpoint_files
from decentral_jax.runner import checkpoint_json
from decentral_jax.runner import orbax_quiet
from decentral_jax.runner import workdir as workdir_lib

PyTree = Any
SUMS_FILE = workdir_lib.SUMS_FILE
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# How long close() waits for the writes of a failed save before removing
# its temporary directory.
_WRITERS_WAIT_S = 300.0
_LATE_WRITES_S = 1.0  # a failed save's directory must stay gone this long


class CheckpointError(ValueError):
  """A checkpoint cannot be read, or none is intact; one line, names it."""


class CheckpointWriteError(OSError, CheckpointError):
  """A checkpoint could not be saved; ``errno`` is the OS error if known."""


def abstract_like(tree: PyTree) -> PyTree:
  """``jax.ShapeDtypeStruct`` (with sharding) for every array in ``tree``."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=getattr(x, "sharding", None)),
      tree)


def _orbax_threads_since(before: set) -> list[threading.Thread]:
  """Orbax's threads started since ``before`` was taken and still alive:
  the write (commit) threads of a save."""
  return [t for t in threading.enumerate() if t not in before
          and type(t).__module__.split(".")[0] == "orbax"]


def _remove_tree(path: str, quiet_s: float = 0.0,
                 timeout_s: float = 10.0) -> None:
  """``rmtree`` until ``path`` has stayed absent for ``quiet_s`` seconds.

  After a failed save TensorStore's own (C++) writer threads, which cannot
  be joined, may still create files under ``path`` and so re-create it;
  the removal repeats every 0.1 s until the path has been gone for
  ``quiet_s`` seconds, for at most ``timeout_s`` seconds.
  """
  deadline = time.monotonic() + timeout_s
  gone_since = None
  while time.monotonic() < deadline:
    now = time.monotonic()
    if os.path.lexists(path):
      shutil.rmtree(path, ignore_errors=True)
      gone_since = None
    elif gone_since is None:
      gone_since = now
    if gone_since is not None and now - gone_since >= quiet_s:
      return
    time.sleep(0.1)


class Checkpointer:
  """Saves, verifies and restores ``(state, meta)`` pairs in one directory.

  Saves are asynchronous: :meth:`save` returns once the arrays have been
  copied off the devices (so the caller may donate or overwrite them) and
  writes files, then ``SHA256SUMS``, in the background; :meth:`poll` reports
  a failed save without blocking, :meth:`wait` / :meth:`close` block until
  the files are committed. The directory must not be written by anything
  else while it is open (:mod:`decentral_jax.runner.workdir` locks it for a run).
  While it is open, Orbax's log records and "ignored" exceptions that echo
  an error raised here are dropped (filters on the ``absl`` and ``asyncio``
  loggers, ``sys.unraisablehook``); :meth:`close` (or leaving a ``with``
  block) removes them again.

  Attributes:
    directory: absolute path of the checkpoint directory.
    sums_seconds: seconds each checksum pass of a save took (process 0).
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2,
               async_save: bool = True):
    """Opens (creating if needed) a checkpoint directory.

    Removes temporary directories of interrupted saves (process 0), with a
    warning naming them.

    Args:
      directory: where the ``<step>/`` subdirectories live.
      max_to_keep: number of most recent checkpoints kept (>= 1).
      async_save: write files in a background thread.

    Raises:
      ValueError: ``max_to_keep < 1``.
      workdir.PathError: the directory cannot be created or written.
    """
    if max_to_keep < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {max_to_keep}.")
    self._echoes = orbax_quiet.EchoFilter()
    self._echoes.install()
    try:
      self._open(directory, max_to_keep, async_save)
    except BaseException:
      self._echoes.remove()
      raise

  def _open(self, directory: str, max_to_keep: int, async_save: bool) -> None:
    self.directory = os.path.abspath(directory)
    self._main = jax.process_index() == 0
    self._async = async_save
    self._pending = None  # step of the save in flight, until reported
    self._saving = None  # step the commit hook checksums
    self._failed = False
    self._writers = []  # Orbax's write threads of the latest save
    self.sums_seconds = []
    if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
      kind = ("a symbolic link that leads to no directory"
              if os.path.islink(self.directory) else "a regular file"
              if os.path.isfile(self.directory) else
              "not a directory (a FIFO, a socket or a device)")
      raise workdir_lib.PathError(
          f"{self.directory} is {kind}; move it away (the run creates its "
          "own checkpoint directory) and run again.")
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise workdir_lib.path_error("create the checkpoint directory",
                                   self.directory, e) from None
    if self._main:
      self._remove_tmp_dirs()
    # Step metadata is read at the first reload, after selection: a step
    # whose Orbax metadata is damaged must reach select_restore_step (moved
    # aside there), not stop the open with Orbax's error naming no file.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, lightweight_initialize=True,
        enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(
            post_finalization_callback=self._before_commit))
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    """Closes; with an exception in flight a failed save is only logged."""
    if exc is None:
      self.close()
      return
    try:
      self.close()
    except CheckpointWriteError as e:  # behind the first
      logging.error("%s", e)

  # -- listing and verification ---------------------------------------------

  def _remove_tmp_dirs(self, quiet_s: float = 0.0) -> None:
    """Removes temporary save directories (the directory is ours: locked)."""
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name)
      if TMP_SUFFIX in name and os.path.isdir(path):
        _remove_tree(path, quiet_s)
        logging.warning("removed %s, left by an interrupted checkpoint save.",
                        path)

  def step_dir(self, step: int) -> str:
    """Path of checkpoint ``step``."""
    return os.path.join(self.directory, str(int(step)))

  def latest_step(self) -> int | None:
    """Step of the newest committed checkpoint, or None if there is none.

    Raises:
      CheckpointError: a step's Orbax metadata is damaged (names it).
    """
    self._reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of all committed checkpoints, ascending.

    Raises:
      CheckpointError: a step's Orbax metadata is damaged (names it).
    """
    self._reload()
    return sorted(self._manager.all_steps())

  def _reload(self) -> None:
    """Orbax's ``reload``; its error on a damaged step's metadata (e.g. a
    JSON list) becomes one line naming that step and the fix."""
    try:
      self._manager.reload()
    except (ValueError, TypeError, KeyError) as e:
      bad = [(s, why) for s in self._step_entries_listed() or [] for why
             in [checkpoint_json.json_files_error(self.step_dir(s))] if why]
      if not bad:
        raise
      step, why = bad[-1]
      raise CheckpointError(
          f"checkpoint {step} ({self.step_dir(step)}) is corrupt: {why}; "
          "move that step directory away to use an older one, or use a "
          f"fresh --workdir (Orbax: {str(e).splitlines()[0]})") from None

  def _step_entries(self) -> list[int]:
    """Steps of every entry named like a checkpoint (``<step>``), damaged
    ones too (a file, an empty directory, unreadable Orbax metadata),
    ascending: read from the directory, not through Orbax, which logs
    about a damaged one and skips some."""
    got = self._step_entries_listed()
    return self.all_steps() if got is None else got

  def _step_entries_listed(self) -> list[int] | None:
    """:meth:`_step_entries` from the directory listing (None if it
    cannot be listed)."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return None
    return sorted(int(n) for n in names  # ASCII: int() refuses "²"
                  if n.isascii() and n.isdigit() and str(int(n)) == n)

  def verify(self, step: int) -> tuple[str, str]:
    """Checks checkpoint ``step`` against its checksums (reads every file).

    Returns:
      ``(status, why)``: ``"ok"``, ``"unverified"`` (no checksums),
      ``"extra"`` (intact, beside files not the run's) or ``"corrupt"``;
      ``why`` says what is wrong (:func:`.checkpoint_files.check_checkpoint`).
    """
    return checkpoint_files.check_checkpoint(self.step_dir(step))

  def _quarantine(self, step: int) -> str:
    """Renames checkpoint ``step`` to the first free ``<step>.corrupt``,
    ``<step>.corrupt-2``, ... (a dangling link there is not free); a
    failed rename is a one-line ``workdir.PathError``."""
    src = self.step_dir(step)
    dst, n = src + ".corrupt", 1
    while os.path.lexists(dst):
      n += 1
      dst = f"{src}.corrupt-{n}"
    try:
      os.rename(src, dst)
    except OSError as e:
      raise workdir_lib.path_error("move", f"{src} to {dst}", e) from None
    return dst

  def select_restore_step(self, check=None) -> int | None:
    """The newest intact checkpoint's step, moving corrupt newer ones away.

    Process 0 verifies from the newest down; corrupt ones are renamed
    ``<step>.corrupt`` if an older intact one exists, with one warning
    naming both. A checkpoint that verifies beside files that are not the
    run's (``"extra"``) is the one to restore: the call refuses, naming
    them, and moves nothing. All processes of a job call this together
    and get the same answer.

    Args:
      check: ``check(step) -> why | None``, called on process 0 for a
        checkpoint that passes its checksums: a reason (e.g. its JSON
        document is damaged: ``run_meta.meta_file_error``) makes it
        corrupt too.

    Returns:
      The step to restore, or None if the directory has no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none is intact (nothing is
        moved; the message lists them and says what to do), the one to
        restore holds files that are not the run's (one line naming them:
        move them away), or a corrupt one cannot be moved away (one line
        naming both names).
    """
    answer = ""
    if self._main:
      bad = []
      for step in reversed(self._step_entries()):
        status, why = self.verify(step)
        if status != "corrupt" and check is not None:
          damaged = check(step)
          status, why = ("corrupt", damaged) if damaged else (status, why)
        if status == "corrupt":
          bad.append((step, why))
          continue
        if status == "extra":  # intact: nothing is moved or retrained
          answer = (f"error:checkpoint {step} ({self.step_dir(step)}): {why}; "
                    "move the file(s) named out of that directory and run "
                    "again.")
          break
        if status == "unverified":
          logging.warning("checkpoint %d in %s has %s; restoring it "
                          "unverified.", step, self.step_dir(step), why)
        try:
          moved = [(s, why, self._quarantine(s)) for s, why in bad]
        except workdir_lib.PathError as e:  # every process gets the error
          answer = f"error:{e}; move the corrupt one away and run again."
          break
        for s, why, dst in moved:
          logging.warning(
              "checkpoint %d (%s) is corrupt: %s; moved it to %s and "
              "resuming from checkpoint %d (%s) instead.", s, self.step_dir(s),
              why, dst, step, self.step_dir(step))
        answer = str(step)
        break
      else:
        if bad:
          listed = "; ".join(f"{s}: {why}" for s, why in bad)
          answer = (f"error:no intact checkpoint in {self.directory} "
                    f"({listed}); delete the corrupt step directories to "
                    "start over, or use a fresh --workdir.")
    answer = workdir_lib.broadcast_from_main(answer)
    if answer.startswith("error:"):
      raise CheckpointError(answer[len("error:"):])
    self._reload()
    return int(answer) if answer else None

  def last_good_step(self) -> tuple[int | None, bool]:
    """The newest checkpoint that passes its checksums, after pending saves.

    Local to this process (no collective): usable on error paths.

    Returns:
      ``(step, verified)``: the newest verified checkpoint and True; else
      the newest unverified (older-format) one and False; else
      ``(None, False)``.
    """
    try:
      self.wait()
    except CheckpointWriteError:
      pass  # reported by whoever polls; the older checkpoints count here
    unverified = None
    for step in reversed(self.all_steps()):
      status, _ = self.verify(step)
      if status in ("ok", "extra"):  # "extra": its listed files verify
        return step, True
      if status == "unverified" and unverified is None:
        unverified = step
    return unverified, False

  # -- saving ----------------------------------------------------------------

  def _before_commit(self) -> None:
    """Orbax hook on process 0: all files written, rename still to come."""
    tmp = os.path.join(self.directory, f"{self._saving}{TMP_SUFFIX}")
    if not os.path.isdir(tmp):
      raise FileNotFoundError(errno.ENOENT, "temporary checkpoint missing",
                              tmp)
    t0 = time.perf_counter()
    workdir_lib.write_sums(tmp, skip=checkpoint_files.UNSUMMED)
    self.sums_seconds.append(time.perf_counter() - t0)

  def _save_error(self, step, e: BaseException) -> CheckpointWriteError:
    code, reason = workdir_lib.os_error_text(e)
    err = CheckpointWriteError(
        f"checkpoint {step} could not be saved in {self.directory}: {reason}")
    err.errno = code
    self._failed = True
    return err

  def save(self, step: int, state: PyTree, meta: dict) -> None:
    """Starts saving ``state`` and the JSON-serialisable ``meta`` as ``step``.

    Waits for the previous save first (Orbax writes one at a time).

    Args:
      step: checkpoint number (completed training steps), int >= 0.
      state: pytree of jax arrays (sharded arrays are saved shard by shard).
      meta: JSON-serialisable dict, copied when the save starts (the write
        runs in the background while the caller goes on changing its own
        lists, e.g. the losses of the next steps' log window).

    Raises:
      CheckpointWriteError: this save, or the previous one, failed.
    """
    self.wait()
    meta = copy.deepcopy(meta)
    self._pending = self._saving = int(step)
    before = set(threading.enumerate())
    try:
      self._manager.save(
          int(step), force=True,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._pending = None
      raise self._save_error(step, e) from None
    finally:
      self._writers = _orbax_threads_since(before)
    if not self._async:
      self.wait()

  def poll(self) -> None:
    """Raises if the save in flight has failed; returns at once otherwise.

    Raises:
      CheckpointWriteError: one line naming the step, the directory and the
        OS error (e.g. ``ENOSPC``).
    """
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Blocks until a save in progress has been committed.

    Raises:
      CheckpointWriteError: the save failed.
    """
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(step, e) from None

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources.

    After a failed save, removes its temporary directory (process 0).
    Removes the log filters and the unraisable hook installed when the
    checkpointer was opened (``sys.unraisablehook`` and the loggers' filters
    are then what they were).

    Raises:
      CheckpointWriteError: the pending save failed.
    """
    error = None
    try:
      self.wait()
    except CheckpointWriteError as e:
      error = e
    try:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-exception-caught
        pass  # Orbax raising the error of a failed save again
      if self._failed and self._main:
        self._wait_for_writers()
        self._remove_tmp_dirs(quiet_s=_LATE_WRITES_S)
    finally:
      if self._echoes is not None:
        self._echoes.remove()
        self._echoes = None
    if error is not None:
      raise error

  def _wait_for_writers(self) -> None:
    """Waits for the write threads of the last save (after a failure)."""
    deadline = time.monotonic() + _WRITERS_WAIT_S
    for t in self._writers:
      # Thread.join itself: Orbax's threads re-raise their error in join().
      threading.Thread.join(t, max(deadline - time.monotonic(), 0.0))
    running = [t.name for t in self._writers if t.is_alive()]
    if running:
      logging.warning("writes of the failed save (%s) still running after "
                      "%.0f s; a temporary directory may be left in %s (it "
                      "is removed when the directory is next opened).",
                      ", ".join(running), _WRITERS_WAIT_S, self.directory)
    self._writers = []

  # -- restoring -------------------------------------------------------------

  def _read_error(self, step: int, e: BaseException) -> CheckpointError:
    _, reason = workdir_lib.os_error_text(e)
    return CheckpointError(
        f"checkpoint {step} in {self.step_dir(step)} cannot be read: "
        f"{reason}; move that directory away to resume from an older "
        "checkpoint.")

  def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict]:
    """Restores checkpoint ``step`` with the structure and shardings of
    ``like`` (not verified: see :meth:`select_restore_step`).

    Args:
      step: a step listed by :meth:`all_steps`.
      like: a pytree with the saved structure; its leaves may be arrays or
        ``jax.ShapeDtypeStruct`` with ``sharding`` set.

    Returns:
      ``(state, meta)``: arrays with the shapes, dtypes and shardings of
      ``like``, and the saved JSON dict.

    Raises:
      ValueError: no checkpoint ``step`` in the directory, or ``like`` does
        not have the saved structure, shapes or dtypes (Orbax's message).
      CheckpointError: the checkpoint's files cannot be read.
    """
    if step not in self.all_steps():
      raise ValueError(f"no complete checkpoint for step {step} in "
                       f"{self.directory} (have {self.all_steps()}).")
    try:
      restored = self._manager.restore(
          int(step),
          args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_like(like)),
              meta=ocp.args.JsonRestore()))
    except ValueError as e:
      if re.match(r"[A-Z_]{4,}: ", str(e)):  # a TensorStore read error
        raise self._read_error(step, e) from None
      raise  # structure, shape or dtype mismatch
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._read_error(step, e) from None
    return restored.state, self._meta_dict(step, restored.meta)

  def restore_meta(self, step: int) -> dict:
    """Only the JSON document of checkpoint ``step``.

    Raises:
      CheckpointError: it cannot be read, or is not a JSON object.
    """
    try:
      restored = self._manager.restore(
          int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._read_error(step, e) from None
    return self._meta_dict(step, restored.meta)

  def _meta_dict(self, step: int, meta) -> dict:
    if not isinstance(meta, dict):
      raise CheckpointError(
          f"checkpoint {step} in {self.step_dir(step)}: its JSON document is "
          f"a {type(meta).__name__}, not an object; move that directory away "
          "to resume from an older checkpoint.")
    return dict(meta)
