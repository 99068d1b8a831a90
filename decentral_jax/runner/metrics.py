"""Metric output: JSON lines, optional TensorBoard, and a progress bar.

Every log point is one JSON object per line in ``<workdir>/metrics.jsonl``
(appended, so a resumed run continues the same file), e.g.::

  {"step": 100, "lr": 0.0029, "train/loss": 2.31, "consensus_distance":
   0.0012, "step_time_ms": 310.2, "tokens_per_sec": 13200.5,
   "train_time_s": 30.7, "eval/loss": 2.25, "eval/worker_loss_mean": 2.27,
   "eval/worker_loss_min": 2.26, "eval/worker_loss_max": 2.29,
   "eval/worker_loss_std": 0.008}

Keys written by :func:`decentral_jax.runner.train.train_and_evaluate`:

* ``step``: completed optimizer steps (0 = the initial evaluation);
* ``lr``: learning rate of the last update;
* ``train/loss`` (and ``train/accuracy``): mean over workers and over the
  steps since the previous record (nats; taken in float64, as the ``eval/*``
  means are, so finite float32 losses give a finite mean);
* ``consensus_distance``: ``(1/n) sum_i ||x_i - x_bar||^2`` at that step;
* ``step_time_ms``, ``tokens_per_sec`` (or ``samples_per_sec``): mean over
  the timed steps since the previous record (wall time between consecutive
  step completions, after ``block_until_ready``; the first step of a run,
  which compiles, is not timed, and evaluation / checkpoint time is
  excluded);
* ``train_time_s``: cumulative timed training seconds (continues across a
  resume);
* ``eval/*`` at evaluation points (see ``Experiment.evaluate``).

Non-finite floats are written as ``null`` (strict JSON); a record whose
loss is not finite is never written, the run stops instead
(:func:`decentral_jax.runner.recorder.non_finite_record_error`). Every
record is one ``write`` of a line ending in a newline, so a run that dies
while writing leaves at most an incomplete last line; :func:`truncate_after`
(called when a run resumes) drops it with a warning, since it belongs to a
step after the checkpoint, which the resumed run logs again. The reader
applies the rules ``compare`` keeps a run by (:func:`row_error`, steps
strictly increasing); a file that breaks them raises :class:`MetricsError`
(a resumed train run moves it aside: ``runner.train.resume_metrics``).
"""

from __future__ import annotations

import json
import uuid
import logging
import math
import re
import os
import stat
from typing import Any, Iterable

import numpy as np
import tqdm

from decentral_jax import checks
from decentral_jax import records as records_lib
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import metrics_rules
from decentral_jax.runner import tmpfile
from decentral_jax.runner import workdir as workdir_lib

METRICS_FILE = "metrics.jsonl"
#: Where a resumed run moves a damaged ``metrics.jsonl`` (:func:`set_aside`).
CORRUPT_FILE = METRICS_FILE + ".corrupt"
# Relative slack of values one computation gives twice (float32 rounding
# of a mean of per-worker losses).
REL_TOL = metrics_resume.REL_TOL


class MetricsError(ValueError):
  """A damaged ``metrics.jsonl`` (one line naming the file and line);
  ``path`` and ``reason`` (without the fix) as attributes."""

  def __init__(self, message: str, path: str = "", reason: str = ""):
    super().__init__(message)
    self.path, self.reason = path, reason


def _plain(value: Any) -> Any:
  """Converts NumPy / JAX scalars to JSON values (non-finite -> None)."""
  if isinstance(value, (str, bool)) or value is None:
    return value
  if isinstance(value, (int, np.integer)):
    return int(value)
  value = float(np.asarray(value))
  return value if math.isfinite(value) else None


class MetricsWriter:
  """Writes scalar metrics to ``metrics.jsonl`` (and TensorBoard if asked).

  Attributes:
    path: the JSON-lines file.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = False,
               tracker: str = "", run_config: dict | None = None):
    """Opens ``<workdir>/metrics.jsonl`` for appending.

    Args:
      workdir: run directory (created if missing).
      tensorboard: also write event files to ``<workdir>/tensorboard``.
      tracker: ``"wandb"``: also log every record to Weights & Biases
        (:class:`WandbTracker`); ``""``: no tracker.
      run_config: the run config as a dict, stored with the tracker's run.

    Raises:
      ValueError: ``tensorboard`` requested but ``tensorboardX`` is missing,
        or ``tracker="wandb"`` without the ``wandb`` package or whose
        ``wandb.init`` fails (a key W&B refuses: one line with its reason).
      workdir.PathError: the file cannot be created or opened for writing.
    """
    self.path = os.path.join(workdir, METRICS_FILE)
    try:
      os.makedirs(workdir, exist_ok=True)
      self._file = open(self.path, "a", encoding="utf-8")
    except OSError as e:
      raise workdir_lib.path_error("write", self.path, e) from None
    self._tb = self._tracker = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      except ImportError:
        raise ValueError(
            "config.tensorboard=True needs the tensorboardX package: "
            "`pip install tensorboardX`, or set --config.tensorboard=False "
            "(metrics.jsonl is always written).") from None
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    try:
      self._tracker = (WandbTracker(workdir, run_config or {})
                       if tracker == "wandb" else None)
    except BaseException:
      self.close()
      raise

  def write(self, record: dict) -> None:
    """Appends one record; it must contain an integer ``"step"``.

    Raises:
      workdir.PathError: the write failed (e.g. the disk is full).
    """
    record = {k: _plain(v) for k, v in record.items()}
    try:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    except OSError as e:
      raise workdir_lib.path_error("write", self.path, e) from None
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
          self._tb.add_scalar(key, value, record["step"])
    if self._tracker is not None:
      self._tracker.log(record)

  def close(self) -> None:
    try:
      self._file.close()
    except OSError:
      pass  # a failed flush was reported by write()
    if self._tb is not None:
      self._tb.close()
    if self._tracker is not None:
      self._tracker.close()


# What the Weights & Biases tracker keeps in a run directory.
WANDB_ID_FILE = "wandb_run_id"
TRACKER_FILES = ("wandb", WANDB_ID_FILE)


# The characters of a W&B run id (W&B refuses an empty one and :;,#?/').
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_run_id(workdir: str) -> str:
  """The W&B run id kept in ``<workdir>/wandb_run_id``; a new 12-character
  hex id, written there atomically, when the file does not exist.

  Raises:
    ValueError: the file is not a regular file, cannot be read, is not
      UTF-8, or is not one id of 1 to 64 ASCII letters, digits, ``_`` or
      ``-`` (e.g. empty); one line naming it: move it away (a new W&B run
      is started) and run again.
    workdir.PathError: the new id cannot be written.
  """
  id_path = os.path.join(workdir, WANDB_ID_FILE)
  why = workdir_lib.not_regular_error(id_path)  # a FIFO blocks the open
  raw = b"" if why else records_lib.read_bytes(id_path, max_bytes=4096)
  if isinstance(raw, records_lib.Damaged) and raw.missing:
    run_id = uuid.uuid4().hex[:12]
    try:
      tmpfile.replace(id_path, run_id + "\n")
    except OSError as e:
      raise workdir_lib.path_error("write", id_path, e) from None
    return run_id
  run_id = None
  if not why:
    run_id, why = _parse_wandb_id(raw)
  if why:
    raise ValueError(f"{id_path} {why}; move it away (a new W&B run is "
                     "started) and run again.")
  return run_id


def _parse_wandb_id(raw) -> tuple[str | None, str | None]:
  """``(id, None)`` for the bytes ``raw`` of one W&B run id, else ``(None,
  why)``; decoded once, only ASCII spaces, tabs and line ends stripped, so
  the id checked is the id returned."""
  if isinstance(raw, records_lib.Damaged):
    return None, raw.reason
  try:
    text = raw.decode("utf-8").strip(" \t\r\n")
  except UnicodeDecodeError as e:
    return None, (f"is not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                  f"{e.start})")
  if not text:
    return None, "is empty"
  if not _WANDB_ID.fullmatch(text):
    return None, (f"holds {records_lib.short(text)}, not a W&B run id (1 to "
                  "64 ASCII letters, digits, _ or -)")
  return text, None


class WandbTracker:
  """Logs metrics records to a Weights & Biases run.

  The run's id is kept in ``<workdir>/wandb_run_id``, so a resumed run logs
  to the same W&B run (``resume="allow"``; W&B drops records of steps it
  already has). Project, entity, mode (``WANDB_MODE=offline`` writes
  ``wandb/offline-run-*`` without a network) and directory come from W&B's
  own ``WANDB_*`` variables; the directory defaults to ``workdir``. Each
  record's numbers and strings are logged at its ``step`` (the records of
  one step are merged into one W&B row).
  """

  def __init__(self, workdir: str, run_config: dict):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise ValueError(
          "config.tracker='wandb' needs the wandb package: `pip install -r "
          "requirements-extras.txt`, or set --config.tracker=''.") from None
    run_id = wandb_run_id(workdir)
    try:
      self._run = wandb.init(
          project=os.environ.get("WANDB_PROJECT", "decentral_jax"),
          dir=os.environ.get("WANDB_DIR") or workdir, id=run_id,
          resume="allow", config=run_config,
          name=os.path.basename(os.path.abspath(workdir)))
    except Exception as e:  # pylint: disable=broad-except
      said = " ".join(str(e).split())[:300] or type(e).__name__
      raise ValueError(
          f"config.tracker='wandb': W&B refused to start the run "
          f"({type(e).__name__}: {said}); log in with `wandb login` (or set "
          "a valid WANDB_API_KEY), set WANDB_MODE=offline, or set "
          "--config.tracker='' (metrics.jsonl is always written).") from None

  def log(self, record: dict) -> None:
    """Logs ``record``'s values (not its step) at ``record["step"]``."""
    self._run.log({k: v for k, v in record.items()
                   if k != "step" and v is not None}, step=int(record["step"]))

  def close(self) -> None:
    self._run.finish()



def _file_checker(signed_losses: bool = False, config=None, schedule=None,
                  upto: int | None = None):
  """``check(record) -> why | None`` for the lines of one file in order:
  :func:`metrics_rules.record_error`, :func:`row_error`,
  :func:`metrics_rules.null_error` (a loss too with ``config``: a train
  run's log), ``lr`` within the ``schedule.peak_lr`` its log ``schedule``
  segment records (:func:`metrics_resume.logged_lr_error`), with ``upto``
  the ``eval/`` keys at exactly the steps that ``schedule`` evaluates
  (:func:`metrics_resume.eval_keys_error`; the checkpoint at ``upto``
  ended its invocation if ``config.steps`` is ``upto``), with
  ``config`` the throughput (:func:`metrics_rules.throughput_error`) and
  ``train_time_s`` never smaller (:func:`metrics_rules.train_time_error`;
  the learners' reader applies it by their record), and each step larger
  than the previous line's. With ``upto`` (the step a resume restores),
  a record of a later step, dropped and redone, is checked only for its
  own syntax, ranges and order: the ``config`` and ``schedule`` rules are
  the checkpoint's, and a later invocation may have logged that record
  under another config (a raised peak)."""
  last, timed = [], []
  total = metrics_resume.field(config, "steps")
  total = (total if isinstance(total, int) and not isinstance(total, bool)
           else None)

  def check(record: dict) -> str | None:
    why = (metrics_rules.record_error(record)
           or metrics_rules.row_error(record, signed_losses)
           or metrics_rules.null_error(record, runner=config is not None))
    dropped = why is None and upto is not None and record["step"] > upto
    if why is None and not dropped:
      why = (metrics_resume.logged_lr_error(record, schedule)
             or (upto is not None and metrics_resume.eval_keys_error(
                 record, schedule, upto, total))
             or (config is not None
                 and metrics_rules.throughput_error(record, config)) or None)
    if why is None and last and record["step"] <= last[-1]:
      why = (f"\"step\" must increase from line to line, got "
             f"{record['step']} after {last[-1]} (lines repeated or out of "
             "order)")
    if config is not None and not dropped:  # the learners' reader: own
      why = why or metrics_rules.train_time_error(timed[-1:] + [record])
    last.append(record.get("step"))
    if "train_time_s" in record:
      timed.append(record)
    return why
  return check


def _kind_error(mode: int) -> str | None:
  """Why a file of ``mode`` (``lstat``) is not a metrics file, or None."""
  if stat.S_ISREG(mode):
    return None
  if stat.S_ISLNK(mode):
    return ("is a symbolic link (the run writes its records into "
            "metrics.jsonl itself, not through a link)")
  return ("is a directory" if stat.S_ISDIR(mode) else
          "is not a regular file (a FIFO, a socket or a device)")


def _read_regular(path: str) -> bytes:
  """The bytes of ``path``, refused in one line before any blocking open
  if it is not a regular file (a FIFO would block the read for ever).

  Raises:
    MetricsError: a symbolic link, a directory, a FIFO, a socket or a
      device (names the file and the fix).
    workdir.PathError: the file cannot be read.
  """
  try:
    why = _kind_error(os.lstat(path).st_mode)
    if why is None:
      fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                   | getattr(os, "O_NOFOLLOW", 0))
      why = _kind_error(os.fstat(fd).st_mode)
      if why is None:
        with os.fdopen(fd, "rb") as f:
          return f.read()
      os.close(fd)
  except OSError as e:
    raise workdir_lib.path_error("read", path, e) from None
  raise MetricsError(f"{path} {why}; move it away (a fresh file is "
                     "written), and run again.", path, why)


def _parse(path: str, config=None, schedule=None, upto: int | None = None
           ) -> tuple[list[dict], int | None, bool, bytes]:
  """Records of a JSON-lines file, the line number of a torn last line,
  whether the file needs rewriting (torn or unterminated last line) and the
  bytes after its last newline.

  Raises:
    MetricsError: the file is a symbolic link or not a regular file
      (refused before opening), a line other than the last is not a JSON
      object, or a record has no integer ``"step" >= 0``, a value that is not a JSON
      scalar or is NaN or infinite or outside its key's range
      (:func:`row_error`), or a step not larger than the line before's;
      names the file, the line, the key and the fix.
    workdir.PathError: the file cannot be read.
  """
  data = _read_regular(path)
  got = records_lib.parse_jsonl(data, path, _file_checker(
      metrics_rules.workdir_losses_signed(os.path.dirname(path)), config,
      schedule, upto))
  if isinstance(got, records_lib.Damaged):
    fix = ("the file is corrupt: fix or delete that line (one JSON object "
           "per line)" if "not a JSON record" in got.reason else
           "fix or delete that line")
    raise MetricsError(f"{path}, {got.reason}; {fix}, or move the file "
                       "away, and run again.", path, got.reason)
  return got.records, got.torn, got.dirty, data.rsplit(b"\n", 1)[-1]


# A record's step, from the start of a torn line (its complete digits only).
_TORN_STEP = re.compile(rb'(?:^\s*\{|,)\s*"step"\s*:\s*(\d+)\s*[,}]')


def _torn_message(path: str, line: int, tail: bytes, step: int) -> str:
  """What dropping the torn ``line`` (bytes ``tail``) of a run resumed
  after ``step`` steps costs: nothing if its record is of a later step
  (logged again), that record if of ``step`` or before."""
  found = _TORN_STEP.search(tail)
  head = (f"{path}: line {line} is incomplete (the run stopped while writing "
          "it); dropped it")
  if found is None:
    return (f"{head}: its step cannot be read; if it was after step {step} "
            "the resumed run logs it again, else its record is lost.")
  torn = int(found.group(1))
  if torn > step:
    return f"{head}, the resumed run logs step {torn} again."
  return (f"{head}: the record of step {torn} is lost (the run resumes "
          f"after step {step}, from a checkpoint at or after it).")


def read_jsonl(path: str) -> list[dict]:
  """Reads a ``metrics.jsonl`` file into a list of dicts (one per line).

  An incomplete last line (a run died while writing it) is ignored.

  Raises:
    MetricsError: another line is not a JSON object, or a record has no
      integer ``"step" >= 0``, a value that is not a JSON scalar or is
      outside its key's range, or a step not larger than the previous
      line's (names file, line and key); the file cannot be read
      (``workdir.PathError``).
  """
  return _parse(path)[0]


def read_curve(path: str, key: str = "eval/loss", x: str = "step"):
  """The ``(x, key)`` curve of a metrics file, checked, or why not.

  Returns:
    ``(xs, ys)``, two float64 arrays of equal, non-zero length with finite
    values (records whose ``key`` is null are left out), or a
    :class:`decentral_jax.records.Damaged` naming the file: missing
    (``.missing``), unreadable, a corrupt line, or no finite ``key`` record
    (e.g. a file truncated before its first evaluation).
  """
  got = records_lib.read_jsonl(path, metrics_rules.record_error)
  if isinstance(got, records_lib.Damaged):
    return got
  pts = records_lib.finite_series(got.records, key, x)
  if isinstance(pts, str):
    return records_lib.Damaged(path, pts, key=key)
  return np.asarray(pts[0], np.float64), np.asarray(pts[1], np.float64)


def truncate_after(workdir: str, step: int, config=None,
                   schedule=None, at_step: dict | None = None) -> int:
  """Drops records of ``<workdir>/metrics.jsonl`` that a resumed run redoes.

  A run resumed from a checkpoint after ``step`` steps logs every later step
  again, so records with a larger step (or, for ``step == 0``, all records)
  are removed; at ``step == 0`` the file is still read by the rules below,
  so a file that is no run's log (notes of your own at that name) raises
  :class:`MetricsError` and is moved aside by the caller, not emptied. An
  incomplete last line is dropped with a warning naming the
  file and line, and whether its record is logged again (a step after
  ``step``) or lost (``step`` or before, as read from the line; the rest
  of a torn record is not kept). The file is rewritten atomically.

  A missing file after ``step > 0`` is a warning (the earlier records
  are lost); a record of a step beyond ``config.steps``' largest value is
  damage, not a redone record. Every record is checked by
  :mod:`decentral_jax.runner.metrics_rules` (values, nulls, order,
  ``train_time_s``). With the checkpoint's stored ``config`` (a dict), a
  null loss and a throughput that disagrees with its step time are damage
  too, and a log that ends before the last step that config logs up to
  ``step`` is a warning (records lost:
  :func:`metrics_resume.lost_warning`), as is a step its log ``schedule``
  (the document's history) logs and the log lacks. A kept record that
  lacks an evaluation key at a step that history evaluates, or holds one
  at a step it does not, is damage (:func:`metrics_resume.eval_keys_error`).
  An ``lr`` above the
  ``schedule.peak_lr`` of its record's ``schedule`` segment is damage; a
  record no segment with a peak covers (no history: an older document) is
  not checked for it, since a resume may have changed the peak. Records
  after ``step`` (dropped) are checked only for their own syntax, ranges
  and order: a later invocation may have logged them under another config.
  With ``at_step`` (what the checkpoint fixes: the ``lr`` its config logs
  at ``step`` and the document's ``train_time_s``), kept records that
  disagree with it are damage (:func:`metrics_resume.checkpoint_error`:
  the log of another run).

  Returns:
    How many complete records were removed (0 if the file does not exist).

  Raises:
    MetricsError: the file is a symbolic link or not a regular file (a
      FIFO, a directory: refused before opening), a record's step is
      beyond any run's last, the kept records disagree with ``at_step``,
      or a line before the
      last is corrupt, breaks its key's range, or repeats or goes back in
      step (names file, line, key and fix; nothing is rewritten).
    workdir.PathError: the file cannot be read or rewritten.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.lexists(path):
    if step > 0:
      logging.warning(
          "%s is missing although the run resumes after step %d: the "
          "records of steps 0 to %d are lost; the resumed run writes a new "
          "file from step %d on.", path, step, step, step + 1)
    return 0
  if step == 0:  # everything is redone; a file that is no run's log is
    records, torn, dirty, tail = _parse(path)  # moved aside, not emptied
    keep, removed = [], len(records)
  else:
    records, torn, dirty, tail = _parse(path, config, schedule, upto=step)
    _check_reachable(path, records)
    keep = [r for r in records if r.get("step", 0) <= step]
    why = metrics_resume.checkpoint_error(keep, step, at_step)
    if why:
      raise MetricsError(f"{path}, {why}; move the file away, and run "
                         "again.", path, why)
    removed = len(records) - len(keep)
    lost = metrics_resume.lost_warning(path, keep, step, config, schedule)
    if lost and torn is None:  # a torn record says it is lost itself
      logging.warning("%s", lost)
  if torn is not None:
    logging.warning("%s", _torn_message(path, torn, tail, step))
  if not removed and not dirty:
    return 0
  try:
    tmpfile.replace(path, "".join(json.dumps(r) + "\n" for r in keep))
  except OSError as e:
    raise workdir_lib.path_error("rewrite", path, e) from None
  return removed


def _check_reachable(path: str, records: list[dict]) -> None:
  """Raises :class:`MetricsError` for a record of a step no run reaches
  (beyond ``config.steps``' largest value): damage, not a record a
  resumed run redoes."""
  for n, r in enumerate(records):
    if r.get("step", 0) > checks.INT32_MAX:
      why = (f"record {n + 1} has step {records_lib.short(r['step'])}, "
             f"beyond the last step any run reaches (config.steps <= "
             f"{checks.INT32_MAX})")
      raise MetricsError(f"{path}, {why}; fix or delete that line, or move "
                         "the file away, and run again.", path, why)


def set_aside(workdir: str) -> str:
  """Renames ``<workdir>/metrics.jsonl`` to :data:`CORRUPT_FILE` (or
  ``.corrupt-2``, ... if taken: an older damaged log is kept too) and
  returns the new path."""
  src = os.path.join(workdir, METRICS_FILE)
  dst, n = os.path.join(workdir, CORRUPT_FILE), 1
  while os.path.lexists(dst):
    n += 1
    dst = os.path.join(workdir, f"{CORRUPT_FILE}-{n}")
  try:
    os.rename(src, dst)
  except OSError as e:
    raise workdir_lib.path_error("move", src, e) from None
  return dst


def series(records: Iterable[dict], key: str,
           x: str = "step") -> tuple[np.ndarray, np.ndarray]:
  """The ``(x, y)`` points of records that have a non-null ``key``.

  Returns:
    Two float64 arrays of equal length.

  Raises:
    ValueError: a value of ``key`` or ``x`` that is not a number.
  """
  pts = [(r[x], r[key]) for r in records
         if r.get(key) is not None and r.get(x) is not None]
  for px, py in pts:
    for name, v in ((x, px), (key, py)):
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"metrics record at {x}={px!r:.40}: {name!r} is "
                         f"{v!r:.40}, not a number.")
  if not pts:
    return np.zeros(0), np.zeros(0)
  xs, ys = zip(*pts)
  return np.asarray(xs, np.float64), np.asarray(ys, np.float64)


def progress_bar(total: int, initial: int = 0, desc: str = "train",
                 disable: bool | None = None) -> tqdm.tqdm:
  """A ``tqdm`` bar over training steps (hidden when stderr is not a TTY)."""
  return tqdm.tqdm(total=total, initial=initial, desc=desc, unit="step",
                   dynamic_ncols=True, disable=disable, leave=True)
