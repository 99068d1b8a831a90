"""The run directory of learners that train a runner config: the runner's
``metrics.jsonl`` and ``config.json``, and ``learners.json`` (the config and
the number of learners of each stretch of the run).

``<workdir>/metrics.jsonl`` holds one record per merged period ``k``
(:class:`decentral_jax.runner.metrics.MetricsWriter`: the runner's record
format, read back with the learners' own rules, ``runner=False`` of
:func:`decentral_jax.runner.metrics_rules.null_error`):

* ``step``: inner steps ``k * H`` (``H = config.sync_every``; 0 = the
  initial evaluation);
* ``tokens`` (``samples`` for classifiers): all merged since the start;
* ``learners/merged``: how many learners' pseudo-gradients the merge took,
  ``learners/tokens/<i>``: the tokens of learner ``i`` in it;
* ``lr``: the inner learning rate of step ``k * H``;
* ``train_time_s``: wall seconds of the run (an invocation's seconds from
  its start, added to the last record of the one it resumed);
* on the records of the periods the command saw merged (it polls the
  synchronizer, which keeps only its newest ``theta``: a period merged
  between two polls, in sync mode too, has a record without these):
  ``train/loss``, the mean over the learners of the loss of ``theta_k`` on
  their batches of step ``k * H`` (the loss the runner logs for step
  ``k * H + 1``, without dropout), and on the first such period at least
  ``eval_every`` periods after the last evaluation and on the last period
  ``eval/loss`` (``eval/accuracy``) of ``theta_k`` on the config's
  validation split.

``learners.json`` records the config, its source and overrides, and one
segment per invocation: the period it started from and its number of
learners ``K`` (= ``n_workers``: learner ``i`` reads worker ``i``'s shard of
``K``). A resume with another ``K`` recomputes the sharding from the resumed
period on and says so in the new segment's ``sharding``.
"""

from __future__ import annotations

import json
import logging
import os
import time

from decentral_jax import checks
from decentral_jax import records as records_lib
from decentral_jax.runner import meta_schema
from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.runner import tmpfile
from decentral_jax.runner import workdir as workdir_lib
from decentral_jax.tools import distinct_paths
from decentral_jax.tools import flag_types

META_FILE = "learners.json"



def check_json_output(json_path, config, data_path, workdir,
                      checkpoint_dir=None) -> None:
  """``learners --json`` (written last, replacing the file) names none of
  the files the run reads or keeps: the ``--config`` file, the config's
  ``data.path`` (``data_path``), and ``workdir``'s ``metrics.jsonl``,
  ``config.json`` and :data:`META_FILE` (None: not given); and
  ``--checkpoint-dir`` (``checkpoint_dir``, a directory the synchronizer
  creates; None: ``workdir``'s ``checkpoints``) is none of those files
  nor holds ``--json``.

  Raises:
    ValueError: naming ``--json`` or ``--checkpoint-dir`` and the other
      path's flag.
  """
  from decentral_jax.runner import presets  # pylint: disable=import-outside-toplevel
  inputs = [("--config", distinct_paths.config_file(config, presets.PRESETS))]
  inputs += distinct_paths.data_inputs(data_path, "--config.data.path")
  dirs = [("--checkpoint-dir", checkpoint_dir)]
  if workdir is not None:
    inputs += [(f"--workdir's {name}", os.path.join(workdir, name)) for name
               in (metrics_lib.METRICS_FILE, "config.json", META_FILE)]
    if checkpoint_dir is None:
      dirs = [("--workdir's checkpoints", os.path.join(workdir,
                                                       "checkpoints"))]
  distinct_paths.check_distinct_paths([("--json", json_path)], inputs, dirs)

def _write_json(path: str, value) -> None:
  """Writes ``value`` to ``path`` whole through ``path + ".tmp"``
  (:func:`decentral_jax.runner.tmpfile.replace`: a link or FIFO left at
  either name is replaced, never followed nor opened)."""
  try:
    tmpfile.replace(path, json.dumps(value, indent=1))
  except OSError as e:
    raise workdir_lib.path_error("write", path, e) from None


def check_appended(workdir: str) -> None:
  """``<workdir>/metrics.jsonl``, which the run appends to, is a regular
  file or missing (``lstat``, before any open: a symbolic link would send
  the records into its target, a FIFO would block for ever).

  Raises:
    ValueError: a link, a directory, a FIFO, a socket or a device there,
      naming the file and the fix.
  """
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  why = workdir_lib.not_regular_error(path)
  if why:
    raise ValueError(f"{path} {why}; move it away (the run appends its "
                     "records to its own file) and run again.")


_INT = ("int", 0, None, False)

SEGMENT_SCHEMA = {"from_period": _INT, "from_step": _INT,
                  "learners": ("int", 1, None, False),
                  "n_workers": ("int", 1, None, False),
                  "sharding": ("str", None, None, False)}
META_SCHEMA = {"config_source": ("str", None, None, False),
               "overrides": ("strs", None, None, False),
               "config": ("object", None, None, False),
               "learners": ("int", 1, None, False),
               "segments": ("list", None, None, False)}


def _segments_error(meta: dict):
  for i, seg in enumerate(meta["segments"]):
    got = records_lib.object_error(seg, f"segments[{i}]", SEGMENT_SCHEMA,
                                   tuple(SEGMENT_SCHEMA), extra=True)
    if got:
      return got
  return _values_error(meta)


def _values_error(meta: dict):
  """``(key, why)`` for the first value that contradicts the others, or
  None: a file without segments, a segment whose ``n_workers`` is not its
  ``learners``, whose ``from_period`` precedes the one before (a resume
  starts where the run stood) or whose ``from_step`` is not ``from_period
  * config.sync_every``, and a ``learners`` that is not the last segment's
  (what :meth:`RunRecords.begin` writes)."""
  segs, fix = meta["segments"], "restore the file or start a new --workdir"
  if not segs:
    return "segments", f'"segments" is empty (one per invocation); {fix}'
  h = meta["config"].get("sync_every")
  h = h if isinstance(h, int) and not isinstance(h, bool) and h >= 1 else None
  for i, seg in enumerate(segs):
    key = f"segments[{i}]"
    if seg["n_workers"] != seg["learners"]:
      return f"{key}.n_workers", (
          f'"{key}.n_workers" is {seg["n_workers"]}, not its learners '
          f'{seg["learners"]} (learner i reads worker i\'s shard); {fix}')
    if i and seg["from_period"] < segs[i - 1]["from_period"]:
      return f"{key}.from_period", (
          f'"{key}.from_period" is {seg["from_period"]}, before segments'
          f'[{i - 1}]\'s {segs[i - 1]["from_period"]}; {fix}')
    if h is not None and seg["from_step"] != seg["from_period"] * h:
      return f"{key}.from_step", (
          f'"{key}.from_step" is {seg["from_step"]}, not from_period * '
          f'config.sync_every = {seg["from_period"]} * {h} = '
          f'{seg["from_period"] * h}; {fix}')
  if meta["learners"] != segs[-1]["learners"]:
    return "learners", (
        f'"learners" is {meta["learners"]}, not the last segment\'s '
        f'{segs[-1]["learners"]}; {fix}')
  return None


def read_meta(workdir: str) -> dict | None:
  """``learners.json`` of ``workdir``, checked (None if there is none).

  Raises:
    ValueError: the file cannot be read or is damaged (not JSON, a key
      missing or of the wrong type, a segment without ``learners``, values
      that contradict each other: a ``from_step`` not ``from_period *
      config.sync_every``, a ``learners`` not the last segment's, ...),
      naming the file and the key; or it is not a regular file (a
      symbolic link, a FIFO, a directory), naming it.
  """
  path = os.path.join(workdir, META_FILE)
  why = workdir_lib.not_regular_error(path)  # a dangling link: not missing
  if why:
    raise ValueError(f"{path} {why}; move it away (the run writes its own) "
                     "and run again.")
  if not os.path.exists(path):
    return None
  meta = records_lib.read_json(path, META_SCHEMA, tuple(META_SCHEMA),
                               extra=True, check=_segments_error)
  if isinstance(meta, records_lib.Damaged):
    raise meta.error()
  return meta


def read_metrics(workdir: str) -> list[dict]:
  """The records of ``<workdir>/metrics.jsonl`` a resume reads, checked
  (``[]`` without the file): what :func:`check_workdir` and
  :meth:`RunRecords.begin` read, one reader for both.

  Each record is a runner metrics record
  (:func:`decentral_jax.runner.metrics.read_jsonl`: an integer ``step >=
  0``, finite JSON scalars); the steps increase from record to record (one
  per merged period); ``train_time_s``, where present, is a number in
  ``[0, MAX_TRAIN_TIME_S]`` (:data:`decentral_jax.runner.meta_schema.
  MAX_TRAIN_TIME_S`, the runner's bound) not below the one before it (the
  wall seconds of the run only grow; a resume adds its seconds to them).
  Each field :class:`RunRecords` writes is checked where present against
  what it can write (with ``learners.json``'s ``config.sync_every`` ``H``
  and segments, :func:`read_meta`): ``step`` a multiple of ``H`` and at
  most ``INT32_MAX`` (the :class:`~decentral_jax.tools.learners.spec.
  RunSpec` bound); ``tokens`` / ``samples`` an integer ``>= 0`` (0 at step
  0) that never decreases; ``learners/merged`` an integer in ``[1, K]``
  (``K`` the learners of the segment that wrote the record) and no more
  ``learners/tokens/<i>`` keys, each ``i`` in ``[0, K)`` (ASCII digits
  without leading zeros) with an integer ``>= 0``; and ``tokens_k =
  tokens_{k-1} + sum_i learners/tokens/i`` from one merged period's record
  to the next (at least that across periods not recorded, or where the
  record holds fewer than ``learners/merged`` learners).

  Raises:
    ValueError: one line naming the file, the record's step and the key,
      and the fix (restore the file or start a new ``--workdir``); a
      ``metrics.jsonl`` that is not a regular file (:func:`check_appended`).
    workdir.PathError: the file cannot be read.
  """
  check_appended(workdir)
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  if not os.path.exists(path):
    return []
  meta = read_meta(workdir)
  got = metrics_lib.read_jsonl(path)
  why = _metrics_error(got) or _fields_error(got, meta, _line_numbers(path))
  if why:
    raise ValueError(f"{path}: {why}; restore the file or start a new "
                     "--workdir.")
  return got


def _metrics_error(got: list[dict]) -> str | None:
  """Why the records ``got`` are not the learners' (see
  :func:`read_metrics`), or None."""
  step, seconds = None, 0.0
  for rec in got:
    at = f"the record of step {rec['step']}"
    if step is not None and rec["step"] <= step:
      return (f"{at} follows the record of step {step} (the steps must "
              "increase, one record per merged period)")
    step = rec["step"]
    if "train_time_s" not in rec:
      continue
    t = rec["train_time_s"]
    why = records_lib.value_error(f'{at}: "train_time_s"', t, "number", 0.0,
                                  meta_schema.MAX_TRAIN_TIME_S)
    if why:
      return why + " (wall seconds of the run)"
    if t < seconds:
      return (f'{at}: "train_time_s" is {t:g}, fewer than the {seconds:g} '
              "of the record before (the run's wall seconds only grow)")
    seconds = t
  return None


def _line_numbers(path: str) -> list[int]:
  """The line number of each record of ``path`` (blank lines skipped, as
  :func:`decentral_jax.records.parse_jsonl` skips them)."""
  data = records_lib.read_bytes(path)
  if isinstance(data, records_lib.Damaged):
    raise data.error()
  return [n for n, raw in enumerate(data.split(b"\n"), start=1)
          if raw.strip(b" \t\r\0")]


def _meta_h(meta: dict | None) -> int | None:
  h = (meta or {}).get("config", {}).get("sync_every")
  return h if isinstance(h, int) and not isinstance(h, bool) and h >= 1 \
      else None


def _learners_at(meta: dict | None, step: int) -> int | None:
  """The learners of the segment that wrote the record of ``step`` (the
  last one starting before it: a resume drops the later records), or
  None without segments."""
  segs = [s for s in (meta or {}).get("segments", [])
          if s["from_step"] < step]
  return segs[-1]["learners"] if segs else None


def _fields_error(got: list[dict], meta: dict | None, lines: list[int]
                  ) -> str | None:
  """Why a record of ``got`` is not one :meth:`RunRecords.update` or
  :meth:`RunRecords.begin` writes (see :func:`read_metrics`), or None
  (``lines``: the line number of each record)."""
  h, merged_so_far = _meta_h(meta), {}  # the last value of each unit
  for n_rec, rec in enumerate(got):
    step = rec["step"]
    at = f"the record of step {step} (line {lines[n_rec]})"
    if step > checks.INT32_MAX:
      return (f'{at}: "step" is past {checks.INT32_MAX} (periods * '
              "sync_every of a run fit int32)")
    if h is not None and step % h:
      return (f'{at}: "step" is not a multiple of config.sync_every = {h} '
              "(one record per merged period)")
    for unit in ("tokens", "samples"):
      if unit not in rec:
        continue
      n = rec[unit]
      why = records_lib.value_error(f'{at}: "{unit}"', n, "int", 0)
      if why:
        return why + " (all merged since the start)"
      if step == 0 and n:
        return (f'{at}: "{unit}" is {n}, not 0 (all merged since the start: '
                "nothing is merged at step 0)")
      if n < merged_so_far.get(unit, 0):
        return (f'{at}: "{unit}" is {n}, fewer than the '
                f"{merged_so_far[unit]} before it (all merged since the "
                "start only grow)")
      merged_so_far[unit] = n
    why = (_merged_error(rec, at, _learners_at(meta, step))
           or _sum_error(rec, got[n_rec - 1] if n_rec else None, at, h))
    if why:
      return why
  return None


def _learner_tokens(rec: dict) -> dict[str, int]:
  """``rec``'s ``learners/tokens/<i>`` values by key."""
  return {key: v for key, v in rec.items()
          if key.startswith("learners/tokens/")}


def _sum_error(rec: dict, prev: dict | None, at: str, h: int | None
               ) -> str | None:
  """Why ``rec``'s ``tokens`` (``samples``) contradicts the record before
  it, ``prev``, and the merge it records, or None. The writer sets
  ``tokens_k = tokens_{k-1} + sum_i learners/tokens/i`` (one record per
  merged period), so the next period's record (``step`` one ``H`` on)
  that holds all ``learners/merged`` of its learners must have exactly
  that; any later record (periods between them not recorded) or one
  holding fewer learners at least that."""
  per = _learner_tokens(rec)
  if prev is None or "learners/merged" not in rec:
    return None
  added = sum(per.values())
  exact = (len(per) == rec["learners/merged"] and h is not None
           and rec["step"] == prev["step"] + h)
  for unit in ("tokens", "samples"):
    if unit not in rec or unit not in prev:
      continue
    want = prev[unit] + added
    if rec[unit] < want or (exact and rec[unit] != want):
      return (f'{at}: "{unit}" is {rec[unit]}, but the record before (step '
              f'{prev["step"]}) has {prev[unit]} and this merge adds {added} '
              f"(its learners/tokens/<i>), so it must be "
              f"{'' if exact else 'at least '}{prev[unit]} + {added} = "
              f"{want} (all merged since the start)")
  return None


def _merged_error(rec: dict, at: str, k: int | None) -> str | None:
  """Why ``rec``'s ``learners/merged`` and ``learners/tokens/<i>`` are not
  a merge of at most ``k`` learners (None: unknown), or None."""
  ids = [key[len("learners/tokens/"):] for key in rec
         if key.startswith("learners/tokens/")]
  if "learners/merged" not in rec:
    return None if not ids else (
        f'{at}: has "learners/tokens/{ids[0]}" without "learners/merged"')
  m = rec["learners/merged"]
  why = records_lib.value_error(f'{at}: "learners/merged"', m, "int", 1,
                                k)
  if why:
    return why + f" (of the {k} learners of that segment)" if k else why
  for i in ids:
    v = rec[f"learners/tokens/{i}"]
    n = flag_types.ascii_int(i)  # "²" or "01" (a 2nd learner 1) name none
    if n is None or (k is not None and n >= k):
      return (f'{at}: "learners/tokens/{i}" names no learner (0 to '
              f"{'K' if k is None else k - 1}, in ASCII digits without "
              "leading zeros)")
    why = records_lib.value_error(f'{at}: "learners/tokens/{i}"', v, "int",
                                  0)
    if why:
      return why
  if len(ids) > m:
    return (f'{at}: "learners/merged" is {m} but the record holds '
            f"{len(ids)} learners/tokens/<i> (one per learner merged)")
  return None


def check_workdir(workdir: str) -> int:
  """Reads back what a resume of ``workdir`` uses (``learners.json``,
  ``metrics.jsonl``: :func:`read_meta`, :func:`read_metrics`) before the
  run starts; returns the last inner step they record merged (0: none, or
  no records).

  Raises:
    ValueError: a damaged file, naming it (and the line or key).
  """
  meta = read_meta(workdir) or {}
  step = max((int(s["from_step"]) for s in meta.get("segments", [])),
             default=0)
  return max([step, *(r["step"] for r in read_metrics(workdir))])


def segment(meta: dict | None, learners: int, version: int,
            sync_every: int) -> dict:
  """The segment of an invocation with ``learners`` learners starting at
  merged period ``version``, after the segments of ``meta``."""
  seg = {"from_period": version, "from_step": version * sync_every,
         "learners": learners, "n_workers": learners,
         "sharding": f"learner i reads worker i's shard of n_workers="
                     f"{learners}"}
  last = (meta or {}).get("segments", [])
  if last and last[-1]["learners"] != learners:
    seg["sharding"] = (
        f"recomputed: {last[-1]['learners']} -> {learners} learners at "
        f"period {version}; from inner step {version * sync_every} on "
        f"learner i reads worker i's shard of n_workers={learners}")
  return seg


def lost_warning(workdir: str, rows: list[dict], version: int, h: int
                 ) -> str | None:
  """The warning for the records of merged periods ``k <= version`` that
  ``rows`` (``workdir``'s ``metrics.jsonl``) lacks, or None: the learners
  write one record per period, of step ``k * h`` (``k = 0..version``);
  a resume from period ``version`` writes only later ones, so those are
  lost."""
  got = {r["step"] for r in rows}
  missing = [k for k in range(version + 1) if k * h not in got]
  if not missing:
    return None
  shown = ", ".join(f"{k} (step {k * h})" for k in missing[:8]) + (
      f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  return (f"{path} lacks the records of merged period(s) {shown} (one per "
          f"period k * sync_every, k = 0..{version}): they are lost; the "
          f"resumed run writes from period {version + 1} (step "
          f"{(version + 1) * h}) on.")


class RunRecords:
  """Writes the run directory as the run goes.

  Args:
    workdir: the run directory (created).
    task: the run's :class:`~decentral_jax.tools.learners.runner_problem.
      RunnerTask`.
    run: the :class:`~decentral_jax.tools.learners.spec.RunSpec`.
    source: the config's preset name or file; ``overrides`` its overrides.
    eval_every: evaluate ``theta`` every this many merged periods.
  """

  def __init__(self, workdir: str, task, run, source: str, overrides,
               eval_every: int):
    self.workdir, self.task, self.run = workdir, task, run
    self.eval_every = eval_every
    self._source, self._overrides = source, list(overrides)
    self._start = time.monotonic()
    self._written = None  # last period written
    self._evaluated = 0
    os.makedirs(workdir, exist_ok=True)
    self._writer = None
    self._offset = 0.0  # train_time_s of the invocations resumed

  def begin(self, version: int, theta: dict) -> dict:
    """Starts at merged period ``version`` (0, or a resumed run's): drops
    later records of an earlier invocation (the runner's
    :func:`~decentral_jax.runner.metrics.truncate_after`), writes
    ``config.json`` and the new segment of ``learners.json``, and at 0 the
    initial evaluation; warns once of records of periods up to ``version``
    the file lacks (:func:`lost_warning`). Returns the new segment."""
    h = self.run.sync_every
    rows = read_metrics(self.workdir)  # checked before anything is dropped
    kept = os.path.exists(os.path.join(self.workdir,
                                       metrics_lib.METRICS_FILE))
    metrics_lib.truncate_after(self.workdir, version * h)
    lost = lost_warning(self.workdir, rows, version, h) if kept else None
    if lost:  # a missing file: truncate_after says so
      logging.warning("%s", lost)
    if version:  # the last seconds recorded (read_metrics: they only grow)
      self._offset = max([float(r["train_time_s"]) for r in rows
                          if r.get("train_time_s") is not None
                          and r["step"] <= version * h], default=0.0)
    meta = read_meta(self.workdir)
    seg = segment(meta, self.run.shards, version, h)
    config = json.loads(self.task.config.to_json())
    _write_json(os.path.join(self.workdir, "config.json"), config)
    _write_json(os.path.join(self.workdir, META_FILE), {
        "config_source": self._source, "overrides": self._overrides,
        "config": config, "learners": self.run.shards,
        "segments": [*(meta or {}).get("segments", []), seg]})
    self._writer = metrics_lib.MetricsWriter(self.workdir)
    self._written = self._evaluated = version
    if version == 0:
      self._writer.write({"step": 0, self.task.task.unit: 0,
                          **self.task.evaluate(theta), "train_time_s": 0.0})
    return seg

  def update(self, status: dict, theta_of, status_of) -> None:
    """Writes the records of the periods merged since the last call.

    Args:
      status: the synchronizer's ``status()`` (``version``, ``log``).
      theta_of: ``() -> (version, theta)``: the synchronizer's current
        ``theta``, read only when a new period was merged.
      status_of: ``() -> status``, read again if ``theta`` is newer.
    """
    version = int(status["version"])
    if version <= self._written:
      return
    seen, theta = theta_of()
    if seen > version:
      status = status_of()
      version = int(status["version"])
    h, log = self.run.sync_every, status["log"]["tokens"]
    unit = self.task.task.unit
    for k in range(self._written + 1, version + 1):
      rec = {"step": k * h, unit: sum(sum(t.values()) for t in log[:k]),
             "learners/merged": len(log[k - 1]),
             **{f"learners/tokens/{w}": n for w, n in log[k - 1].items()},
             "lr": self.task.learning_rate(k * h),
             "train_time_s": self._offset + time.monotonic() - self._start}
      if k == seen:
        rec["train/loss"] = self.task.train_loss(
            theta, range(self.run.shards), k * h)
        if (k - self._evaluated >= self.eval_every
            or k >= int(status["periods"])):
          rec.update(self.task.evaluate(theta))
          self._evaluated = k
      self._writer.write(rec)
    self._written = version

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
