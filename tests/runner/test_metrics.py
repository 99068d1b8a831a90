"""metrics.jsonl: reading it back and cutting it at a restored step.

The loop writes and rewrites the file in tests/runner/test_train_loop.py (fast tier)
and tests/runner/test_faults.py (a torn last line, integration tier).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decentral_jax.runner import metrics
from decentral_jax.runner import meta_schema

from decentral_jax.runner import metrics_rules
from decentral_jax.runner import metrics_resume
from decentral_jax.runner import run_meta
from decentral_jax.runner import workdir as workdir_lib


# An evaluation's keys (evaluation.Evaluator.evaluate), by hand: each
# excess is the worker loss minus eval/loss_subset.
EVAL = {"eval/loss": 2.1, "eval/worker_loss_mean": 2.2,
        "eval/worker_loss_min": 2.15, "eval/worker_loss_max": 2.25,
        "eval/worker_loss_std": 0.05, "eval/loss_subset": 2.1,
        "eval/worker_excess_mean": 0.1, "eval/worker_excess_max": 0.15}


def _record(step: int, evaluated: bool = False, **values) -> dict:
  """A record as the runner writes it (recorder.record): ``lr`` and
  ``train_time_s`` in every record, ``train/loss`` after step 0 (a record
  without one is damage: metrics_rules.missing_error), :data:`EVAL` at an
  ``evaluated`` step (and only there); lr 1e-3 (at most every peak below),
  0.1 s per step, a training loss of 2.0, then ``values`` (which override
  them)."""
  record = {"step": step, "lr": 1e-3}
  if step:
    record["train/loss"] = 2.0
  if evaluated:
    record.update(EVAL)
  record["train_time_s"] = 0.1 * step
  record.update(values)
  return record


def _line(step: int, evaluated: bool = False, **values) -> str:
  """:func:`_record` as the line the writer writes (json.dumps, as a
  rewrite on resume writes it too)."""
  return json.dumps(_record(step, evaluated, **values)) + "\n"


def test_corrupt_metrics_line_in_the_middle_is_an_error(tmp_path):
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0}\n{"step": 5, "lr"\n{"step": 10}\n')
  before = path.read_text()
  with pytest.raises(ValueError) as info:
    metrics.truncate_after(str(tmp_path), 5)
  assert str(info.value).startswith(f"{path}, line 2: not a JSON record")
  assert "fix or delete that line" in str(info.value)
  assert path.read_text() == before  # nothing rewritten
  path.write_text('{"step": 0}\n{"step": 5}')  # complete, newline missing
  assert metrics.truncate_after(str(tmp_path), 5) == 0
  assert path.read_text() == '{"step": 0}\n{"step": 5}\n'


@pytest.mark.parametrize("torn,resumed_after,says", [
    # The checkpoint is at the torn record's step: nothing logs it again.
    ('{"step": 15, "lr": 0.00', 15, "the record of step 15 is lost"),
    ('{"step": 15, "lr": 0.00', 20, "the record of step 15 is lost"),
    # Resumed before it: the run redoes step 15 and logs it.
    ('{"step": 15, "lr": 0.00', 10, "the resumed run logs step 15 again"),
    # Cut inside the step's digits or before: not known.
    ('{"step": 1', 10, "its step cannot be read; if it was after step 10"),
    ('{"st', 10, "its step cannot be read"),
])
def test_torn_last_line_says_whether_its_record_is_lost(
    tmp_path, caplog, torn, resumed_after, says):
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0}\n{"step": 5}\n{"step": 10}\n' + torn)
  caplog.set_level("WARNING")
  metrics.truncate_after(str(tmp_path), resumed_after)
  (line,) = [r.getMessage() for r in caplog.records]
  assert line.startswith(f"{path}: line 4 is incomplete"), line
  assert says in line, line
  assert path.read_text() == '{"step": 0}\n{"step": 5}\n{"step": 10}\n'


DAMAGED = {  # lines 1-3 of a file a resume after step 5 reads
    "repeated": (_line(0) + _line(0) + _line(5),
                 'line 2: "step" must increase from line to line, got 0 '
                 "after 0"),
    # train_time_s constant: only the steps go back
    "reversed": (_line(5, train_time_s=0.5) + _line(3, train_time_s=0.5)
                 + _line(0, train_time_s=0.5),
                 'line 2: "step" must increase from line to line, got 3 '
                 "after 5"),
    "negative_loss": (_line(0) + _line(3, **{"eval/loss": -3.0}) + _line(5),
                      "line 2: eval/loss must be >= 0, got -3"),
    "accuracy_above_one": (_line(0, **{"eval/accuracy": 1.5}),
                           "line 1: eval/accuracy must be in [0, 1], got "
                           "1.5"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_resume_reads_metrics_by_the_rules_compare_reads_them(
    tmp_path, case):
  """Lines repeated, out of order, or with an impossible value are damage
  to truncate_after (nothing rewritten), as to compare's kept-run check."""
  from decentral_jax.tools.compare import kept  # pylint: disable=import-outside-toplevel
  text, why = DAMAGED[case]
  path = tmp_path / metrics.METRICS_FILE
  path.write_text(text)
  with pytest.raises(metrics.MetricsError) as info:
    metrics.truncate_after(str(tmp_path), 5)
  assert str(info.value).startswith(f"{path}, {why}"), str(info.value)
  assert path.read_text() == text
  rows = [json.loads(line) for line in text.splitlines()]
  # compare names the same rule (not a key the rows lack)
  rule = why.split(": ", 1)[1].replace('"step"', "step").replace(
      "from line to line", "from row to row")
  assert rule in (kept.metrics_error(rows) or ""), kept.metrics_error(rows)


# One record with a key of each kind the writers write (runner, evaluation,
# faults, learners, compare's final figures), each a valid value.
EVERY_KEY = {
    "step": 10, "lr": 1e-4, "train/loss": 5.5, "train/accuracy": 0.25,
    "eval/loss": 5.5, "eval/accuracy": 0.25, "eval/worker_loss_mean": 5.5,
    "eval/worker_loss_min": 5.5, "eval/worker_loss_max": 5.5,
    "eval/worker_loss_std": 0.0, "eval/loss_subset": 5.5,
    "eval/worker_excess_mean": 0.0, "eval/worker_excess_max": 0.0,
    "consensus_distance": 0.0, "step_time_ms": 10.0, "tokens_per_sec": 1e5,
    "samples_per_sec": 1e3, "train_time_s": 1.0, "faults/alive": "1101",
    "faults/live_workers": 3, "faults/work_done": 0.75,
    "faults/useful_steps": 30, "faults/skipped_syncs": 0,
    "faults/goodput": 0.75, "learners/merged": 2, "learners/tokens/0": 64,
    "tokens": 128, "comm/bytes_per_step": 4e6, "comm/ratio": 1.0,
    "param_count": 1e6}


@pytest.mark.parametrize("key", sorted(set(EVERY_KEY) - {"step"}))
@pytest.mark.parametrize("bad", [True, False, "abc", "1.5"])
def test_every_key_the_writers_write_holds_its_kind_of_value(tmp_path, key,
                                                             bad):
  """eval/worker_excess_* (and every key but the loss-like ones) kept a
  bool or a string on resume: each value the writers write is a number
  (null for a non-finite one) but faults/alive, a live mask of 0s and 1s."""
  from decentral_jax.tools.compare import kept  # pylint: disable=import-outside-toplevel
  assert metrics_rules.row_error(EVERY_KEY) is None
  want = "must be a number" if key != "faults/alive" else (
      "must be a string of 0s and 1s")
  if key == "faults/alive" and bad == "abc":
    bad = "10a1"
  row = {**EVERY_KEY, key: bad}
  path = tmp_path / metrics.METRICS_FILE
  path.write_text(json.dumps(row) + "\n")
  with pytest.raises(metrics.MetricsError, match=f"line 1: {key} {want}"):
    metrics.truncate_after(str(tmp_path), 10)
  assert f"{key} {want}" in kept.metrics_error([row])
  path.write_text(json.dumps({**EVERY_KEY, key: None}) + "\n")
  if "loss" not in key and key != "lr":  # null: a non-finite value
    assert metrics.truncate_after(str(tmp_path), 10) == 0


def test_a_resumed_run_moves_a_damaged_metrics_file_aside(tmp_path, caplog):
  """The run resumes (its checkpoint is intact): the damaged log is moved
  to metrics.jsonl.corrupt (then .corrupt-2: an older one is kept) with
  one warning naming it, and the run writes a fresh file."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  text = DAMAGED["reversed"][0]
  caplog.set_level("WARNING")
  for n, name in ((1, "metrics.jsonl.corrupt"), (2, "metrics.jsonl.corrupt-2")):
    path.write_text(text)
    train.resume_metrics(str(tmp_path), 5)
    assert not path.exists()
    assert (tmp_path / name).read_text() == text
    assert len(caplog.records) == n
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"{path}, line 2: \"step\" must increase"), line
    assert f"moved it to {tmp_path / name}" in line, line
  path.write_text('{"step": 0}\n{"step": 5}\n{"step": 7}\n')  # intact: cut
  train.resume_metrics(str(tmp_path), 5)
  assert path.read_text() == '{"step": 0}\n{"step": 5}\n'
  assert len(caplog.records) == 2


@pytest.mark.parametrize("seconds, bad", [(0.0, False), (1e9, False),
                                          (1e9 * (1 + 1e-15) + 1, True),
                                          (1e300, True), (-1.0, True)])
def test_train_seconds_are_bounded_in_every_record(seconds, bad):
  """A final record of 1e300 training seconds was kept by compare (the
  checkpoint's bound, 1e9 s, now holds for every metrics record)."""
  why = metrics_rules.row_error({"step": 3, "train_time_s": seconds})
  assert (why is not None) == bad, why
  if bad:
    assert why.startswith("train_time_s must be in [0, 1e+09]"), why


def test_a_model_of_your_own_may_log_negative_losses(tmp_path):
  """A custom task's loss (MSE - 10) was read as damage: its intact log
  was set aside on resume and its checkpoints refused. Built-in models'
  cross-entropies stay >= 0."""
  row = {"step": 0, "eval/loss": -8.57, "train/loss": -9.1}
  assert metrics_rules.row_error(row) == "eval/loss must be >= 0, got -8.57"
  assert metrics_rules.row_error(row, signed_losses=True) is None
  assert metrics_rules.row_error({"step": 0, "eval/loss": "x"},
                           signed_losses=True) is not None
  path = tmp_path / metrics.METRICS_FILE
  path.write_text(json.dumps(row) + "\n")
  for name, signed in (("gpt", False), ("cnn", False),
                       ("my_pkg.model:Net", True)):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"name": name}}))
    assert metrics_rules.workdir_losses_signed(str(tmp_path)) == signed
    if signed:
      assert metrics.read_jsonl(str(path)) == [row]
    else:
      with pytest.raises(metrics.MetricsError, match="eval/loss must be >= 0"):
        metrics.read_jsonl(str(path))


def test_the_built_in_models_are_the_runner_s():
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  assert set(metrics_rules.BUILT_IN_MODELS) == set(config_lib.DATA_SOURCES)


@pytest.mark.parametrize("kind", ["fifo", "directory", "link_to_devnull",
                                  "link_to_file"])
@pytest.mark.parametrize("resumed_after", [0, 5])
def test_a_metrics_file_that_is_not_a_regular_file_is_moved_aside(
    tmp_path, caplog, capsys, kind, resumed_after):
  """A FIFO would block the resume's read for ever, a link would send the
  resumed run's records elsewhere (/dev/null: lost): refused before any
  open, moved aside with one warning; the readers of compare and the
  learners refuse it too instead of blocking."""
  import os  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  target = tmp_path / "elsewhere.jsonl"
  target.write_text('{"step": 0}\n')
  {"fifo": lambda: os.mkfifo(path), "directory": path.mkdir,
   "link_to_devnull": lambda: os.symlink("/dev/null", path),
   "link_to_file": lambda: os.symlink(target, path)}[kind]()
  with pytest.raises(metrics.MetricsError) as info:
    metrics.read_jsonl(str(path))
  assert str(info.value).startswith(f"{path} is "), str(info.value)
  caplog.set_level("WARNING")
  train.resume_metrics(str(tmp_path), resumed_after)
  moved = tmp_path / metrics.CORRUPT_FILE
  if resumed_after:  # the resume's own warnings about its log are logged
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{path} is "), line
    assert f"moved it to {moved}, and the resumed run" in line, line
  else:  # a fresh run: one warning: line, no resume, no records
    assert not caplog.records
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {path} is "), line
    assert line.endswith(f"; this fresh run (no checkpoint to resume) moved "
                         f"it to {moved} and writes its own metrics.jsonl."), (
                             line)
    assert "resumed" not in line and "step 0" not in line, line
  assert not os.path.lexists(path)
  assert os.path.lexists(tmp_path / metrics.CORRUPT_FILE)
  assert target.read_text() == '{"step": 0}\n'


def test_a_missing_metrics_file_on_resume_says_the_records_are_lost(
    tmp_path, caplog):
  """Deleted between the runs: one warning that the records up to the
  checkpoint are gone (a fresh start, after step 0, says nothing)."""
  caplog.set_level("WARNING")
  assert metrics.truncate_after(str(tmp_path), 0) == 0
  assert not caplog.records
  assert metrics.truncate_after(str(tmp_path), 6) == 0
  (line,) = [r.getMessage() for r in caplog.records]
  assert line == (f"{tmp_path / metrics.METRICS_FILE} is missing although "
                  "the run resumes after step 6: the records of steps 0 to "
                  "6 are lost; the resumed run writes a new file from step "
                  "7 on."), line


def test_a_step_no_run_reaches_is_damage_not_a_redone_record(
    tmp_path, caplog):
  """A record of step 10**30 (config.steps is at most 2**31 - 1) was not
  written by a run: the file is moved aside with one warning naming the
  record, not cut silently as a step the resumed run logs again; a step
  after the checkpoint within reach is cut without a word."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  text = '{"step": 0}\n{"step": %d}\n' % 10**30
  path.write_text(text)
  caplog.set_level("WARNING")
  train.resume_metrics(str(tmp_path), 6)
  (line,) = [r.getMessage() for r in caplog.records]
  assert line.startswith(f"{path}, record 2 has step {10**30}, beyond the "
                         "last step any run reaches"), line
  assert (tmp_path / metrics.CORRUPT_FILE).read_text() == text
  assert not path.exists()
  path.write_text('{"step": 0}\n{"step": %d}\n' % (2**31 - 1))
  assert metrics.truncate_after(str(tmp_path), 6) == 1
  assert path.read_text() == '{"step": 0}\n'
  assert len(caplog.records) == 1


def test_a_wandb_run_id_file_that_is_a_fifo_is_named_not_opened(
    tmp_path, monkeypatch):
  """The id file of the W&B run, read on resume: a FIFO would block the
  open for ever; one line names it (before W&B starts a run)."""
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  started = []
  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
      init=lambda **kw: started.append(kw)))
  path = tmp_path / metrics.WANDB_ID_FILE
  os.mkfifo(path)
  with pytest.raises(ValueError) as info:
    metrics.WandbTracker(str(tmp_path), {})
  assert str(info.value) == (
      f"{path} is not a regular file (a FIFO, a socket or a device); move "
      "it away (a new W&B run is started) and run again."), info.value
  assert not started


def _log_past_step_1(tmp_path) -> str:
  """A log with records at steps 1 and 2 (the run resumes after step 1)."""
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 1, "train/loss": 2.0}\n'
                  '{"step": 2, "train/loss": 1.5}\n')
  return str(path)


def test_a_link_at_the_rewrite_s_temporary_name_is_not_followed(tmp_path):
  """The .tmp name's link is removed, its target kept as it was, and
  metrics.jsonl stays a regular file holding the kept record."""
  path = _log_past_step_1(tmp_path)
  victim = tmp_path.parent / (tmp_path.name + "_victim")
  victim.write_text("OTHER FILE\n")
  os.symlink(victim, path + ".tmp")
  assert metrics.truncate_after(str(tmp_path), 1) == 1
  assert victim.read_text() == "OTHER FILE\n"
  assert not os.path.islink(path)
  assert open(path).read() == '{"step": 1, "train/loss": 2.0}\n'


@pytest.mark.slow  # a second process
def test_a_fifo_at_the_rewrite_s_temporary_name_does_not_block(tmp_path):
  path = _log_past_step_1(tmp_path)
  os.mkfifo(path + ".tmp")
  code = ("import sys; from decentral_jax.runner import metrics; "
          "print(metrics.truncate_after(sys.argv[1], 1))")
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
  assert open(path).read() == '{"step": 1, "train/loss": 2.0}\n'
  assert not os.path.lexists(path + ".tmp")


def test_a_directory_at_the_rewrite_s_temporary_name_is_named(tmp_path):
  path = _log_past_step_1(tmp_path)
  os.mkdir(path + ".tmp")
  with pytest.raises(ValueError) as e:
    metrics.truncate_after(str(tmp_path), 1)
  text_ = str(e.value)
  assert "\n" not in text_ and f"{path}.tmp is a directory" in text_
  assert "move it away" in text_


def test_a_link_at_the_manifest_s_temporary_name_is_not_followed(tmp_path):
  root = tmp_path / "ckpt"
  root.mkdir()
  (root / "a").write_bytes(b"abc")
  victim = tmp_path / "victim"
  victim.write_text("OTHER FILE\n")
  os.symlink(victim, root / "SHA256SUMS.tmp")
  workdir_lib.write_sums(str(root))
  assert victim.read_text() == "OTHER FILE\n"
  assert (root / "SHA256SUMS").read_text() == (
      hashlib.sha256(b"abc").hexdigest() + "  a\n")
  assert not os.path.lexists(root / "SHA256SUMS.tmp")


# The checkpoint's stored config (the fields the log's rules read).
WRITTEN = {"steps": 10, "log_interval": 1, "eval_interval": 3,
           "schedule": {"peak_lr": 3e-3}}
# Its log schedule's history: one segment, which records that peak.
PEAKED = [[0, 1, 3, 3e-3]]
# By hand: the steps WRITTEN evaluates (0, every third, its last step 10).
WRITTEN_EVALS = (0, 3, 6, 9, 10)


def test_a_resumed_run_moves_aside_a_log_with_lr_above_the_peak(
    tmp_path, caplog):
  """An ``lr`` above ``schedule.peak_lr`` (no schedule exceeds it; compare
  rules it out) is damage of the log on resume, as in compare."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  ok = "".join(_line(s, s in WRITTEN_EVALS, lr=0.003) for s in range(6))
  path.write_text(ok)  # at the peak exactly: intact
  assert metrics.truncate_after(str(tmp_path), 5, WRITTEN, PEAKED) == 0
  bad = ok.replace(_line(1, lr=0.003), _line(1, lr=1000000.0))
  assert bad != ok
  path.write_text(bad)
  with pytest.raises(metrics.MetricsError) as e:
    metrics.truncate_after(str(tmp_path), 5, WRITTEN, PEAKED)
  assert "lr must be <= schedule.peak_lr 0.003" in str(e.value)
  caplog.set_level("WARNING")
  train.resume_metrics(str(tmp_path), 5, WRITTEN, PEAKED)
  assert not path.exists()
  assert (tmp_path / metrics.CORRUPT_FILE).read_text() == bad
  assert len(caplog.records) == 1 and "line 2: lr must be <=" in \
      caplog.records[0].getMessage()


def test_records_after_the_checkpoint_are_dropped_unchecked_against_its_peak(
    tmp_path, caplog):
  """Records after the resumed step were written by a later invocation
  (here one that raised the peak to 0.05 and stopped before its next
  checkpoint): they are dropped and redone, not held to the checkpoint's
  peak; the records up to the step stay, byte for byte, with no warning.
  A record up to the step above the peak is still damage."""
  path = tmp_path / metrics.METRICS_FILE
  kept = "".join(_line(s, s in WRITTEN_EVALS, lr=0.003) for s in range(7))
  path.write_text(kept + _line(7, lr=0.0113) + _line(8, lr=0.02))
  caplog.set_level("WARNING")
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN, PEAKED) == 2
  assert path.read_text() == kept
  assert not caplog.records
  path.write_text(kept.replace(_line(6, True, lr=0.003),
                              _line(6, True, lr=0.0113)))
  with pytest.raises(metrics.MetricsError, match="line 7: lr must be <="):
    metrics.truncate_after(str(tmp_path), 6, WRITTEN, PEAKED)


@pytest.mark.parametrize("step, log, ev, steps, want", [
    (6, 1, 3, 10, 6), (7, 4, 6, 10, 6), (9, 4, 6, 10, 8), (5, 10, 30, 10, 0),
    (5, 10, 0, 10, None), (10, 4, 0, 10, 10), (3, 10, 0, 3, 3)])
def test_the_last_step_a_config_logs(step, log, ev, steps, want):
  """By hand: the largest multiple of log_interval or eval_interval up to
  the step (0: the starting evaluation, with eval_interval > 0), or the
  run's last step."""
  config = {"steps": steps, "log_interval": log, "eval_interval": ev}
  assert metrics_resume.last_logged(step, config) == want


def test_a_log_cut_back_before_the_checkpoint_is_one_warning(
    tmp_path, caplog):
  """Records deleted before the checkpoint (as a missing file is): one
  warning naming the steps lost; the kept records stay."""
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  _steps_file(path, range(7))
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN) == 0
  assert caplog.records == []  # whole up to the checkpoint
  _steps_file(path, [0, 1])
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN) == 0
  assert path.read_text() == _line(0) + _line(1)
  [record] = caplog.records
  assert record.getMessage().startswith(
      f"{path} ends at step 1 although the checkpoint's config logs step 6 "
      "(log_interval=1, eval_interval=3): the records of steps 2 to 6 are "
      "lost"), record.getMessage()
  path.write_text("")
  metrics.truncate_after(str(tmp_path), 6, WRITTEN)
  assert "holds no record" in caplog.records[-1].getMessage()
  assert "up to step 6" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("history, start, log, ev, want", [
    (None, 0, 1, 3, [[0, 1, 3]]),  # a fresh run
    ([[0, 1, 3]], 6, 1, 3, [[0, 1, 3]]),  # the same intervals: unchanged
    ([[0, 1, 3]], 6, 2, 3, [[0, 1, 3], [6, 2, 3]]),
    # resumed at 6 again, with the first intervals: the segment from 6 goes
    ([[0, 1, 3], [6, 2, 3]], 6, 1, 3, [[0, 1, 3]]),
    (None, 4, 2, 0, [[4, 2, 0]])])  # an older document: steps <= 4 unknown
def test_the_log_schedule_history(history, start, log, ev, want):
  assert metrics_resume.schedule_history(history, start, log, ev) == want


@pytest.mark.parametrize("history, start, restored_steps, want", [
    # the invocation ran to its steps=10 and logged step 10: closed there,
    # a new segment from 10 even with the same intervals
    ([[0, 3, 0, 1e-3]], 10, 10, [[0, 3, 0, 1e-3, 10], [10, 3, 0, 1e-3]]),
    # stopped at 10 of its 20 (preempted): step 10 unlogged, not closed
    ([[0, 3, 0, 1e-3]], 10, 20, [[0, 3, 0, 1e-3]]),
    # a segment written before peaks were recorded: closed with a null peak
    ([[0, 3, 0]], 10, 10, [[0, 3, 0, None, 10], [10, 3, 0, 1e-3]]),
    # resumed at 20 again: the segment from 20 goes, 10's end stays
    ([[0, 3, 0, 1e-3, 10], [10, 3, 0, 1e-3, 20], [20, 5, 0, 1e-3]], 20,
     20, [[0, 3, 0, 1e-3, 10], [10, 3, 0, 1e-3, 20], [20, 3, 0, 1e-3]])])
def test_the_history_closes_a_segment_where_its_invocation_ended(
    history, start, restored_steps, want):
  assert metrics_resume.schedule_history(
      history, start, 3, 0, 1e-3, restored_steps) == want


@pytest.mark.parametrize("history, step, want", [
    ([[0, 1, 3]], 5, [0, 1, 2, 3, 4, 5]),
    # log 2 / eval 3 up to 6, then log 4 without evaluations up to 12
    ([[0, 2, 3], [6, 4, 0]], 12, [0, 2, 3, 4, 6, 8, 12]),
    ([[0, 2, 0]], 5, [2, 4]),  # no starting evaluation
    ([[4, 2, 0]], 9, [6, 8]),  # nothing known up to step 4
    # log 3 up to 10, the invocation's last step; then log 3 from 10
    ([[0, 3, 0, 1e-3, 10], [10, 3, 0, 1e-3]], 15, [3, 6, 9, 10, 12, 15]),
    # 10 is on the eval interval already: listed once
    ([[0, 2, 10, None, 10], [10, 4, 0]], 12, [0, 2, 4, 6, 8, 10, 12]),
    ([[0, 3, 0, 1e-3, 10], [10, 3, 0, 1e-3]], 9, [3, 6, 9])])  # 10 > 9
def test_the_steps_a_log_schedule_logs(history, step, want):
  assert metrics_resume.scheduled_steps(history, step) == want


def _steps_file(path, steps, evaluated=()):
  """A runner's records (:func:`_record`) of ``steps``, with the
  evaluation's keys at the ``evaluated`` ones."""
  path.write_text("".join(_line(s, s in evaluated) for s in steps))


def test_a_hole_in_the_log_before_the_checkpoint_is_one_warning(
    tmp_path, caplog):
  """A record deleted in the middle (log_interval=1: steps 0..6, step 2
  gone) is named by the document's log schedule; the kept records stay.
  Without a schedule (an older document) only a log cut short is named."""
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  _steps_file(path, [0, 1, 3, 4, 5, 6], WRITTEN_EVALS)
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN) == 0
  assert caplog.records == []  # the older rule: it ends at step 6
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN, [[0, 1, 3]]) == 0
  [record] = caplog.records
  assert record.getMessage() == (
      f"{path} lacks records the checkpoint's log schedule writes (segments "
      "[from_step, log_interval, eval_interval]: [[0, 1, 3]]): the record "
      "of step 2 is lost; the resumed run logs from step 7 on.")
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [
      0, 1, 3, 4, 5, 6]
  # A hole and a log cut short: all the steps lost, in one warning.
  _steps_file(path, [0, 1, 3], WRITTEN_EVALS)
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, [[0, 1, 3]])
  assert len(caplog.records) == 2
  assert "the records of steps 2, 4, 5, 6 are lost" in \
      caplog.records[-1].getMessage()
  # A history whose segments record the peak: the label names it too.
  caplog.clear()
  _steps_file(path, [0, 1, 3, 4, 5, 6], WRITTEN_EVALS)
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, PEAKED)
  [record] = caplog.records
  assert ("(segments [from_step, log_interval, eval_interval, peak_lr]: "
          "[[0, 1, 3, 0.003]]): the record of step 2 is lost;"
          ) in record.getMessage(), record.getMessage()


def test_a_log_whose_intervals_changed_is_read_by_its_history(
    tmp_path, caplog):
  """log_interval 2 (eval 3) up to step 4, then 1: steps 0, 2, 3, 4 then
  5, 6 (by hand). The whole log draws no warning (the stored config's
  log_interval=1 alone would ask for step 1); without step 3 it names 3."""
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  history = [[0, 2, 3], [4, 1, 3]]
  _steps_file(path, [0, 2, 3, 4, 5, 6], WRITTEN_EVALS)
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN, history) == 0
  assert caplog.records == []
  _steps_file(path, [0, 2, 4, 5, 6], WRITTEN_EVALS)
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, history)
  [record] = caplog.records
  assert "the record of step 3 is lost" in record.getMessage()


def test_a_log_moved_aside_is_not_named_again(tmp_path, caplog):
  """After a damaged log was moved aside, the new file starts after the
  step it resumed at: its earlier steps are in the moved file (named once
  then), not lost again at every resume; a hole after its first record
  still is."""
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  _steps_file(path, [5, 6], WRITTEN_EVALS)
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, [[0, 1, 3]])
  assert "the records of steps 0, 1, 2, 3, 4 are lost" in \
      caplog.records[-1].getMessage()
  (tmp_path / metrics.CORRUPT_FILE).write_text('{"step": 0}\n')
  caplog.clear()
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, [[0, 1, 3]])
  assert caplog.records == []
  _steps_file(path, [4, 6], WRITTEN_EVALS)
  metrics.truncate_after(str(tmp_path), 6, WRITTEN, [[0, 1, 3]])
  assert "the record of step 5 is lost" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("history, why", [
    ([[0, 1]], "must be a list of [from_step, log_interval >= 1"),
    ([[0, 0, 3]], "must be a list of [from_step, log_interval >= 1"),
    ([[0, 1, 3], [0, 2, 3]], "from_step increasing"),
    ([[0, 1, 3], [7, 1, 3]], "at most the step 6"),
    ([[0, 1, True]], "integer segments"),
    ([[0, 1, 3], [4, 2, 3]], "last segment [4, 2, 3] disagrees with "
     "config.log_interval=1, eval_interval=3"),
    ([[0, 1, 3, 1e-3, 4]], "closed segment [0, 1, 3, 0.001, 4] must be "
     "followed by one from its last_step 4, got none"),
    ([[0, 1, 3, 1e-3, 4], [5, 1, 3]], "followed by one from its last_step 4"),
    ([[0, 1, 3, 1e-3, 0], [0, 1, 3]], "then last_step > from_step"),
    ([[0, 1, 3, 1e-3, True], [1, 1, 3]], "then last_step > from_step"),
    ([[0, 1, 3, None], [1, 1, 3]], "integer segments (then peak_lr")])
def test_a_damaged_log_schedule_is_a_damaged_document(history, why):
  meta = {"step": 6, "data_position": 6, "config": WRITTEN,
          metrics_resume.SCHEDULE_KEY: history}
  assert why in meta_schema.meta_error(meta)
  assert meta_schema.meta_error(
      dict(meta, **{metrics_resume.SCHEDULE_KEY: [[0, 2, 0], [3, 1, 3]]})
  ) is None
  assert meta_schema.meta_error(dict(meta, **{metrics_resume.SCHEDULE_KEY: [
      [0, 2, 0, None, 3], [3, 1, 3, 3e-3]]})) is None  # a closed segment


def test_a_lost_record_of_an_earlier_invocation_s_last_step_is_named(
    tmp_path, caplog):
  """Three invocations (steps 10, 20, 30; log 2/3/5, eval 10/7/0) log
  0 2 4 6 8 10 12 14 15 18 20 25 30 (by hand: 20 only as invocation 2's
  last step). Deleting 20 is named against checkpoint 30's history; with
  the older 4-field history nothing is known of it (as before)."""
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  kept = [0, 2, 4, 6, 8, 10, 12, 14, 15, 18, 25, 30]
  closed = [[0, 2, 10, 1e-3, 10], [10, 3, 7, 1e-3, 20], [20, 5, 0, 1e-3]]
  config = dict(WRITTEN, steps=30, log_interval=5, eval_interval=0)
  # evaluated by hand: 0, 10 (eval 10), 14 (eval 7), 20, 30 (last steps)
  _steps_file(path, kept, (0, 10, 14, 20, 30))
  metrics.truncate_after(str(tmp_path), 30, config, [s[:4] for s in closed])
  assert caplog.records == []
  metrics.truncate_after(str(tmp_path), 30, config, closed)
  [record] = caplog.records
  assert "the record of step 20 is lost" in record.getMessage()
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == kept


def _timed_log(times, lrs) -> str:
  return "".join(f'{{"step": {s}, "lr": {lr}, "train_time_s": {t}}}\n'
                 for s, t, lr in zip(range(0, 10, 2), times, lrs))


def test_a_log_of_another_run_is_moved_aside_on_resume(tmp_path, caplog):
  """The checkpoint at step 8 fixes its record: lr 0.00165 and 0.032 s.
  A log of another run (its step 8 at lr 0.00078 and 0.029 s; or a step-4
  record timed after the checkpoint) is damage: moved aside, one warning.
  The run's own log (the same values to float32 rounding) is kept, byte
  for byte, with no warning."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  at_step = {"lr": 0.00165, "train_time_s": 0.032}
  own = _timed_log([0.0, 0.003, 0.009, 0.024, 0.032],
                   [0.0015, 0.00225, 0.0029339, 0.0024435, 0.0016499999])
  path.write_text(own)
  caplog.set_level("WARNING")
  assert metrics.truncate_after(str(tmp_path), 8, None, None, at_step) == 0
  assert path.read_text() == own and not caplog.records
  other_lr = own.replace('"lr": 0.0016499999', '"lr": 0.00077667')
  other_time = own.replace('"train_time_s": 0.009', '"train_time_s": 0.038')
  other_end = own.replace('"train_time_s": 0.032', '"train_time_s": 0.029')
  for bad, said in (
      (other_lr, "lr 0.00077667 at step 8 must be the checkpoint's 0.00165"),
      (other_time, "train_time_s 0.038 at step 4 must be at most the "
                   "checkpoint's 0.032 at step 8"),
      (other_end, "train_time_s 0.029 at step 8 must be equal to the "
                  "checkpoint's 0.032")):
    path.write_text(bad)
    caplog.clear()
    train.resume_metrics(str(tmp_path), 8, None, None, at_step)
    assert not path.exists()
    moved = tmp_path / metrics.CORRUPT_FILE
    assert moved.read_text() == bad
    moved.unlink()
    assert len(caplog.records) == 1, caplog.records
    assert said in caplog.records[0].getMessage(), caplog.records[0]
  # A checkpoint that does not say (an older document) checks nothing.
  path.write_text(other_lr)
  assert metrics.truncate_after(str(tmp_path), 8, None, None,
                                {"lr": None, "train_time_s": None}) == 0


def test_the_checkpoint_fixes_its_step_s_record():
  """warmup_cosine, peak 3e-3, warmup 2, 12 steps, final 3e-4: the record
  of step 8 logs the update of step 8, schedule(7) = 3e-4 + 2.7e-3 x 0.5 x
  (1 + cos(pi (7 - 2) / (12 - 2))) = 1.65e-3; step 0's is schedule(0) =
  3e-3 / 2."""
  config = {"steps": 12, "schedule": {"name": "warmup_cosine",
                                      "peak_lr": 3e-3, "warmup_steps": 2,
                                      "final_lr": 3e-4}}
  got = run_meta.logged_at_checkpoint(
      {"step": 8, "config": config, "train_time_s": 0.032})
  want = 3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * 5 / 10))
  assert np.isclose(got["lr"], want, rtol=1e-6) and got["train_time_s"] == 0.032
  got = run_meta.logged_at_checkpoint({"step": 0, "config": config})
  assert np.isclose(got["lr"], 1.5e-3, rtol=1e-6) and got["train_time_s"] is None
  assert run_meta.logged_at_checkpoint({"step": 8}) == {
      "lr": None, "train_time_s": None}
  assert run_meta.logged_at_checkpoint(None) is None


def test_a_fresh_run_moves_a_file_that_is_no_run_s_log_aside(tmp_path,
                                                              capsys):
  """A fresh start (no checkpoint) emptied whatever ``metrics.jsonl`` held,
  notes of the user's own included; a run's records are still dropped."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  notes = b"my notes line 1\nmy notes line 2\n"
  (tmp_path / "metrics.jsonl").write_bytes(notes)
  train.resume_metrics(str(tmp_path), 0)
  assert (tmp_path / "metrics.jsonl.corrupt").read_bytes() == notes
  assert not (tmp_path / "metrics.jsonl").exists()
  assert "moved it to" in capsys.readouterr().err
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 0, "eval/loss": 2.5}\n{"step": 2, "train/loss": 2.4}\n')
  assert metrics.truncate_after(str(tmp_path), 0) == 2
  assert (tmp_path / "metrics.jsonl").read_text() == ""


# -- the evaluations of the log schedule --------------------------------------

# Two invocations: eval 2 up to step 4 (ran to its end there), then eval 3.
RESUMED = [[0, 1, 2, 3e-3, 4], [4, 1, 3, 3e-3]]


@pytest.mark.parametrize("history, upto, total, want", [
    # by hand: 0, then every 3rd, then the last step 10 when it is reached
    ([[0, 1, 3]], 10, 10, [0, 3, 6, 9, 10]),
    ([[0, 1, 3]], 7, 10, [0, 3, 6]),  # checkpoint 7 of 10: 7 unevaluated
    ([[0, 1, 0]], 6, 6, [6]),  # eval_interval 0: only at the end
    (RESUMED, 7, 10, [0, 2, 4, 6]),  # 4: invocation 1's last step
    ([[0, 2, 10, 1e-3, 10], [10, 3, 7, 1e-3, 20], [20, 5, 0, 1e-3]], 30, 30,
     [0, 10, 14, 20, 30])])
def test_the_steps_a_log_schedule_evaluates(history, upto, total, want):
  got = [s for s in range(upto + 1)
         if metrics_resume.evaluated(history, s, upto, total)]
  assert got == want


def test_what_a_log_schedule_does_not_know_of_its_evaluations():
  """An open segment's end before the next (stopped early, or an older
  document), steps before the first segment, and the checkpoint's own
  step without its config: not known (None)."""
  history = [[0, 1, 2], [5, 1, 3]]
  assert metrics_resume.evaluated(history, 5, 9, 9) is None
  assert metrics_resume.evaluated(history, 4, 9, 9) is True
  assert metrics_resume.evaluated(history, 7, 9, 9) is False
  assert metrics_resume.evaluated([[4, 1, 3]], 2, 9, 9) is None
  assert metrics_resume.evaluated([[4, 1, 3]], 0, 9, 9) is None
  assert metrics_resume.evaluated([[0, 1, 3]], 7, 7, None) is None
  # what is not known is kept either way
  for evaluated in (False, True):
    assert metrics_resume.eval_keys_error(
        _record(5, evaluated), history, 9, 9) is None


def _without_eval(text: str, step: int) -> str:
  """``text`` with the ``eval/`` keys of ``step``'s record deleted."""
  rows = [json.loads(line) for line in text.splitlines()]
  return "".join(json.dumps({k: v for k, v in r.items() if r["step"] != step
                             or not k.startswith("eval/")}) + "\n"
                 for r in rows)


_GONE = ", ".join(EVAL) + " missing, but the runner writes them at step"


@pytest.mark.parametrize("history, evals, step", [
    (PEAKED, WRITTEN_EVALS, 3),  # one invocation, eval_interval 3
    (RESUMED, (0, 2, 4, 6), 4),  # invocation 1's last step
    (RESUMED, (0, 2, 4, 6), 2)])  # eval_interval 2 before the resume
def test_an_evaluation_deleted_from_its_record_is_damage(
    tmp_path, caplog, history, evals, step):
  """The record of a step the schedule evaluates, its eval/ keys deleted:
  damage, moved aside with one warning (the whole record deleted is one
  lost-record warning); the intact log is kept with none."""
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel
  path = tmp_path / metrics.METRICS_FILE
  caplog.set_level("WARNING")
  _steps_file(path, range(7), evals)
  assert metrics.truncate_after(str(tmp_path), 6, WRITTEN, history) == 0
  assert not caplog.records
  bad = _without_eval(path.read_text(), step)
  path.write_text(bad)
  with pytest.raises(metrics.MetricsError) as e:
    metrics.truncate_after(str(tmp_path), 6, WRITTEN, history)
  assert f"line {step + 1}: {_GONE} {step}, an evaluation of" in str(e.value)
  train.resume_metrics(str(tmp_path), 6, WRITTEN, history)
  assert not path.exists()
  assert (tmp_path / metrics.CORRUPT_FILE).read_text() == bad
  [record] = caplog.records
  assert f"{_GONE} {step}" in record.getMessage()
  assert "moved it to" in record.getMessage()


@pytest.mark.parametrize("history, evals, step", [
    (PEAKED, WRITTEN_EVALS, 4), (RESUMED, (0, 2, 4, 6), 3),
    (RESUMED, (0, 2, 4, 6), 5)])
def test_evaluation_keys_at_a_step_not_evaluated_are_damage(
    tmp_path, history, evals, step):
  """Fabricated eval/ keys (two of them) on a record of a step the
  schedule does not evaluate: damage, naming the keys and the segment."""
  path = tmp_path / metrics.METRICS_FILE
  path.write_text("".join(_line(s, s in evals, **(
      {"eval/loss": 1.234, "eval/worker_loss_mean": 1.2} if s == step
      else {})) for s in range(7)))
  with pytest.raises(metrics.MetricsError) as e:
    metrics.truncate_after(str(tmp_path), 6, WRITTEN, history)
  assert (f"line {step + 1}: eval/loss, eval/worker_loss_mean at step "
          f"{step}, but the runner writes eval/ keys only at an evaluation"
          ) in str(e.value)


def test_a_kept_compare_run_holds_its_evaluations_where_its_config_says():
  """compare keeps only runs trained under one config: steps 10, eval 3
  evaluate 0, 3, 6, 9 and 10 (by hand)."""
  from decentral_jax.tools.compare import kept  # pylint: disable=import-outside-toplevel
  rows = [_record(s, s in WRITTEN_EVALS) for s in range(11)]
  assert kept.metrics_error(rows, WRITTEN) is None
  rows[10] = _record(10)
  assert kept.metrics_error(rows, WRITTEN).startswith(f"at step 10: {_GONE}")
  rows[10] = _record(10, True)
  rows[4] = _record(4, True)
  assert kept.metrics_error(rows, WRITTEN).startswith(
      "at step 4: " + ", ".join(EVAL) + " at step 4, but the runner writes")
  assert kept.metrics_error(rows) is None  # no config: not known
