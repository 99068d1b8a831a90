"""Every reader of a file a run keeps, against a table of damaged files.

Where a damaged file can be treated as missing it is, with one
``warning:`` line naming it: a kept run of the main job whose
``compare_result.json`` or ``metrics.jsonl`` is damaged is trained again
(the job ends with its results, exit 0). Where it cannot, it is refused
with one line naming the file and the key: cluster files, compiled
workloads, in-flight fraction files, ``metrics.jsonl`` of a run being
resumed, overlap's ``--render`` rows, checkpoints' step metadata. Never a
traceback. All in process, without training (the runs are faked).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from decentral_jax.runner import builders
from decentral_jax.runner import checkpoint_files
from decentral_jax.runner import metrics
from decentral_jax.runtime_model import cluster_file
from decentral_jax.runtime_model import in_flight
from decentral_jax.runtime_model import workload_file
from decentral_jax.tools import compare
from decentral_jax.tools import overlap
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.compare import record as record_lib
from decentral_jax.tools.compare import kept

from helpers import agreeing_evaluation

BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"

# -- the main job's kept runs ---------------------------------------------------

# param_count: one float32 worker model of 1 MB, as the faked
# sent_per_step's ratio 1.0 of 1e6 bytes says.
_FINAL = {"step": 3, "eval/loss": 2.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 0.0,
          "param_count": 250_000}


def _row(step: int, lr: float = 1e-3, **values) -> str:
  """A line of metrics.jsonl as the runner writes it: ``lr`` and
  ``train_time_s`` in every record, ``train/loss`` after step 0 (a record
  without one is damage: metrics_rules.missing_error); a training loss of
  2.1 and 1/3 s a step (the last step's: _GPT_FINAL's), then ``values``
  (which override them)."""
  row = {"step": step, "lr": lr}
  if step:
    row["train/loss"] = 2.1
  row.update(values)
  row.setdefault("train_time_s", step / 3)
  return json.dumps(row) + "\n"


# A kept run's metrics.jsonl: the evaluations at steps 0 and 3.
_METRICS = _row(0, **agreeing_evaluation(4.0)) + _row(3, **agreeing_evaluation(2.0))


def _fake_job(monkeypatch, trained: list):
  def trains(config, workdir, experiment=None):
    trained.append(workdir)
    os.makedirs(workdir, exist_ok=True)
    schedule = builders.make_schedule(config)  # lr as the recorder takes it
    with open(os.path.join(workdir, metrics.METRICS_FILE), "w") as f:
      for step, loss in ((0, 4.0), (3, 2.0)):
        f.write(_row(step, float(schedule(max(step, 1) - 1)),
                     **agreeing_evaluation(loss)))
    return dict(_FINAL)

  monkeypatch.setattr(job_lib.train, "train_and_evaluate", trains)
  monkeypatch.setattr(job_lib.experiment, "Experiment", lambda config: None)
  monkeypatch.setattr(job_lib, "sent_per_step", lambda exp: {
      "comm/ratio": 1.0, "comm/bytes_per_step": 1e6})
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")


def _main(out):
  return compare.main([f"--outdir={out}", "--config.steps=3",
                       "--config.eval_interval=3", "--methods=all_reduce",
                       "--clusters="])


def _record_edit(**changes):
  def edit(text):
    d = json.loads(text)
    for k, v in changes.items():
      if v is _DROP:
        d.pop(k)
      elif k == "final" and isinstance(v, dict):
        d["final"] = {**d["final"], **v}
      else:
        d[k] = v
    return json.dumps(d)
  return edit


_DROP = object()

# case -> (new contents: bytes, text, or an edit of the good record's text;
# a word the warning must hold).
RECORD_CASES = {
    "empty": (b"", "empty"),
    "truncated_mid_line": (lambda t: t[:len(t) // 2], "not JSON"),
    "binary": (BINARY, "not UTF-8"),
    "wrong_json_type": ("[1, 2]", "must be an object"),
    "final_missing": (_record_edit(final=_DROP), "misses ['final']"),
    "final_garbage": (_record_edit(final="garbage"), "final"),
    "loss_a_string": (_record_edit(final={"eval/loss": "2.0"}),
                      "final.eval/loss"),
    "loss_missing": (lambda t: t.replace('"eval/loss"', '"eval/lost"'),
                     "eval/loss"),
    "loss_nan": (lambda t: t.replace('"eval/loss": 2.0',
                                     '"eval/loss": NaN'), "final.eval/loss"),
    "distance_inf": (lambda t: t.replace('"consensus_distance": 0.0',
                                         '"consensus_distance": Infinity'),
                     "final.consensus_distance"),
    "timing_a_string": (_record_edit(final={"step_time_ms": "fast"}),
                        "final.step_time_ms"),
    "both_null": (_record_edit(final=None), "exactly one of"),
    "both_set": (_record_edit(diverged="nan loss"), "exactly one of"),
    "diverged_a_number": (_record_edit(final=None, diverged=3), "diverged"),
    "config_a_list": (_record_edit(config=[]), "config"),
    # Impossible or inconsistent values: a cross-entropy loss < 0, an
    # accuracy outside [0, 1], a final loss other than the last evaluation's
    # (metrics.jsonl's step 3 says 2.0).
    # (the ranges are the run's model's: the evaluation they must equal)
    "loss_negative": (_record_edit(final={"eval/loss": -3.0}),
                      "final.eval/loss is -3.0, but the last evaluation"),
    "accuracy_above_one": (_record_edit(final={"eval/accuracy": 1.5}),
                           "final.eval/accuracy is 1.5, but "),
    "loss_not_the_last_evaluation": (
        _record_edit(final={"eval/loss": 1.0}),
        "final.eval/loss is 1.0, but the last evaluation in"),
}

# metrics.jsonl of a kept, finished run.
METRICS_CASES = {
    "empty": (b"", "has no 'eval/loss' record"),
    "missing": (None, "does not exist"),
    "truncated_mid_line": (lambda t: t[:len(t) // 3], "has no 'eval/loss'"),
    "cut_in_the_middle": (lambda t: t.split("\n")[0][:10] + "\n" + t,
                          "line 1: not a JSON record"),
    "binary": (BINARY + b"\n" + BINARY + b"\n", "line 1"),
    "wrong_json_type": ("[1]\n[2]\n", "line 1: not a JSON record"),
    "step_missing": ('{"eval/loss": 2.0}\n', "\"step\" must be an integer"),
    "loss_a_string": ('{"step": 0, "eval/loss": "low"}\n',
                      "'eval/loss' at step=0 must be a finite number"),
    "loss_nan": ('{"step": 0, "eval/loss": NaN}\n', "'eval/loss'"),
    "loss_an_integer_beyond_float": (
        '{"step": 0, "eval/loss": 1' + "0" * 400 + '}\n'
        '{"step": 3, "eval/loss": 2.0}\n', "'eval/loss' must be a finite "
        "number"),
    "no_loss": ('{"step": 0, "train/loss": 2.0}\n', "has no 'eval/loss'"),
    "only_null_losses": ('{"step": 0, "eval/loss": null}\n',
                         "has no 'eval/loss'"),
    "lines_reversed": ('{"step": 3, "eval/loss": 2.0}\n'
                       '{"step": 0, "eval/loss": 4.0}\n',
                       "'step' must increase, got 0 after 3"),
    "a_step_repeated": ('{"step": 0, "eval/loss": 4.0}\n'
                        '{"step": 3, "eval/loss": 2.0}\n'
                        '{"step": 3, "eval/loss": 0.5}\n',
                        "got 3 after 3"),
    "cut_to_whole_lines": ('{"step": 0, "eval/loss": 4.0}\n',
                           "ends at step 0, not at the run's last step 3"),
}


def _damage(path: str, content) -> None:
  """Writes ``content`` to ``path`` (None: removes it); a kept run's
  records are signed again, so the rules of the values catch them."""
  if content is None:
    os.remove(path)
  else:
    if callable(content):
      content = content(open(path, encoding="utf-8").read())
    with open(path, "wb") as f:
      f.write(content if isinstance(content, bytes) else content.encode())
  run_dir = os.path.dirname(path)
  if os.path.isfile(os.path.join(run_dir, record_lib.RESULT_FILE)):
    record_lib.sign(run_dir)


class _Config:
  """What arm_status reads of a run's config: its JSON, and its model and
  data (no data files)."""

  model, data = {}, {}

  def to_json(self) -> str:
    return '{"steps": 3, "seed": 0}'


def _kept_run(tmp_path) -> str:
  """A finished run's directory as the main job leaves it."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / record_lib.RESULT_FILE).write_text(json.dumps(
      {"config": json.loads(_Config().to_json()), "final": dict(_FINAL),
       "diverged": None, "data_files": {}}, indent=1))
  (run_dir / metrics.METRICS_FILE).write_text(_METRICS)
  record_lib.sign(str(run_dir))
  return str(run_dir)


def _status_of_damaged(tmp_path, capsys, name, content):
  run_dir = _kept_run(tmp_path)
  assert job_lib.arm_status(run_dir, _Config())[0] == "finished"
  assert capsys.readouterr().err == ""
  path = os.path.join(run_dir, name)
  _damage(path, content)
  status = job_lib.arm_status(run_dir, _Config())
  err = capsys.readouterr().err.splitlines()
  assert status == ("fresh", None)
  assert len(err) == 1 and err[0].startswith(f"warning: {path}: "), err
  assert err[0].endswith("the run is not kept: it is resumed from its "
                         "checkpoint or trained again."), err
  return err[0]


@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_kept_run_with_a_damaged_record_is_not_kept(tmp_path, capsys, case):
  content, word = RECORD_CASES[case]
  line = _status_of_damaged(tmp_path, capsys, record_lib.RESULT_FILE, content)
  assert word in line, line


@pytest.mark.parametrize("case", sorted(METRICS_CASES))
def test_a_kept_run_with_damaged_metrics_is_not_kept(tmp_path, capsys, case):
  content, word = METRICS_CASES[case]
  line = _status_of_damaged(tmp_path, capsys, metrics.METRICS_FILE, content)
  assert word in line, line


# metrics.jsonl values no run can produce: the run is trained again, not
# resumed (a resume keeps the records before its checkpoint).
RANGE_CASES = {
    "loss_negative": ('{"step": 0, "eval/loss": -3}\n'
                      '{"step": 3, "eval/loss": 2.0}\n',
                      "'eval/loss' at step=0 must be >= 0, got -3"),
    "accuracy_above_one": ('{"step": 0, "eval/loss": 4.0}\n'
                           '{"step": 3, "eval/loss": 2.0, '
                           '"eval/accuracy": 1.25}\n',
                           "'eval/accuracy' at step=3 must be in [0, 1], "
                           "got 1.25"),
}


@pytest.mark.parametrize("case", sorted(RANGE_CASES))
def test_impossible_metrics_train_the_run_again(tmp_path, capsys, case):
  content, word = RANGE_CASES[case]
  run_dir = _kept_run(tmp_path)
  os.makedirs(os.path.join(run_dir, "checkpoints", "3"))
  (tmp_path / "run" / "config.json").write_text(_Config().to_json())
  path = os.path.join(run_dir, metrics.METRICS_FILE)
  _damage(path, content)
  assert job_lib.arm_status(run_dir, _Config()) == ("fresh", None)
  err = capsys.readouterr().err.splitlines()
  assert err == [f"warning: {path}: {word}; the run is not kept: it is "
                 "trained again."], err


def test_a_kept_run_s_final_values_match_its_lastagreeing_evaluation(
    tmp_path, capsys):
  run_dir = _kept_run(tmp_path)
  _damage(os.path.join(run_dir, metrics.METRICS_FILE),
          _row(0, **agreeing_evaluation(4.0), **{"eval/accuracy": 0.0})
          + _row(3, **agreeing_evaluation(2.0), **{"eval/accuracy": 1.0}))
  _damage(os.path.join(run_dir, record_lib.RESULT_FILE),
          _record_edit(final={"eval/accuracy": 1.0}))
  assert job_lib.arm_status(run_dir, _Config())[0] == "finished"
  _damage(os.path.join(run_dir, record_lib.RESULT_FILE),
          _record_edit(final={"eval/accuracy": 0.5}))
  assert job_lib.arm_status(run_dir, _Config()) == ("fresh", None)
  assert "final.eval/accuracy is 0.5" in capsys.readouterr().err


def test_a_record_of_another_config_is_not_kept_and_not_lost(
    tmp_path, capsys):
  run_dir = _kept_run(tmp_path)
  other = type("Other", (), {"to_json": lambda self: '{"steps": 4}'})()
  assert job_lib.arm_status(run_dir, other) == (
      "fresh", f"{record_lib.RESULT_FILE} records a finished run of another "
      "config")
  assert capsys.readouterr().err == ""  # said once, when moved aside


def _outdir_files(run_dir) -> dict:
  return {n: open(os.path.join(run_dir, n), "rb").read()
          for n in sorted(os.listdir(run_dir)) if n != "run.lock"}


@pytest.mark.parametrize("steps", ["4", "swapped"])
def test_a_finished_run_of_another_config_is_moved_aside_not_replaced(
    tmp_path, monkeypatch, capsys, steps):
  """The job run again with another --config.steps, or the run's
  directory swapped with another run's: the finished run there is moved
  whole to <run>.not_resumed with one warning naming both directories,
  and the run is trained in the emptied directory. An absent or empty
  directory is fresh: no warning."""
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  assert _main(out) == 0
  run_dir = str(out / "all_reduce")
  before = _outdir_files(run_dir)
  if steps == "swapped":  # another config's record in its place
    _damage(os.path.join(run_dir, record_lib.RESULT_FILE),
            _record_edit(config={"steps": 5}))
    before = _outdir_files(run_dir)
    argv = [f"--outdir={out}", "--config.steps=3",
            "--config.eval_interval=3", "--methods=all_reduce",
            "--clusters="]
  else:
    argv = [f"--outdir={out}", "--config.steps=4",
            "--config.eval_interval=3", "--methods=all_reduce",
            "--clusters="]
  capsys.readouterr()
  assert compare.main(argv) == 0
  err = capsys.readouterr().err
  aside = run_dir + ".not_resumed"
  assert _job_warnings(err, tmp_path) == [
      f"warning: {run_dir}: {record_lib.RESULT_FILE} records a finished run "
      f"of another config; the run was moved to {aside} and is trained "
      "again from step 0."], err
  assert _outdir_files(aside) == before  # byte for byte
  assert trained == [run_dir, run_dir]
  assert not os.path.exists(out / "empty.not_resumed")
  empty = out / "empty"
  empty.mkdir()
  assert job_lib.arm_status(str(empty), _Config()) == ("fresh", None)


def _job_warnings(err: str, tmp_path) -> list[str]:
  return [l for l in err.splitlines()
          if l.startswith(f"warning: {tmp_path}")]


@pytest.mark.parametrize("name, content, word", [
    (record_lib.RESULT_FILE, _record_edit(final="garbage"), "final"),
    (metrics.METRICS_FILE, lambda t: t[:len(t) // 3], "eval/loss"),
    # step 3's row without the training loss the runner writes there
    (metrics.METRICS_FILE, lambda t: t.replace('"train/loss": 2.1, ', ""),
     "at step 3: train/loss missing")])
def test_the_job_trains_a_damaged_kept_run_again(
    tmp_path, monkeypatch, capsys, name, content, word):
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  assert _main(out) == 0
  run_dir = str(out / "all_reduce")
  assert trained == [run_dir]
  capsys.readouterr()
  _damage(os.path.join(run_dir, name), content)
  assert _main(out) == 0  # was a TypeError or a numpy traceback
  err = capsys.readouterr().err
  assert trained == [run_dir, run_dir] and "Traceback" not in err
  warnings = _job_warnings(err, tmp_path)
  assert len(warnings) == 1 and word in warnings[0], err
  assert "| All-Reduce | 2.0000 |" in (out / "results.md").read_text()
  assert _main(out) == 0 and len(trained) == 2  # kept from now on


def test_a_damaged_config_of_a_checkpoint_is_named_and_not_resumed(
    tmp_path, monkeypatch, capsys):
  trained = []
  _fake_job(monkeypatch, trained)
  run_dir = tmp_path / "out" / "all_reduce"
  os.makedirs(run_dir / "checkpoints" / "2")
  (run_dir / "config.json").write_bytes(BINARY)
  assert _main(tmp_path / "out") == 0
  err = capsys.readouterr().err
  assert _job_warnings(err, tmp_path) == [
      f"warning: {run_dir}: its checkpoint is not resumed ("
      f"{run_dir / 'config.json'}: is not UTF-8 text (byte 0x89 at offset "
      f"0)); the run was moved to {run_dir}.not_resumed and is trained "
      "again from step 0."], err
  assert trained == [str(run_dir)]
  aside = tmp_path / "out" / "all_reduce.not_resumed"
  assert (aside / "config.json").read_bytes() == BINARY
  assert sorted(os.listdir(aside / "checkpoints")) == ["2"]


def test_metrics_damaged_after_the_run_was_kept_is_left_out(
    tmp_path, monkeypatch, capsys):
  """Damaged between keeping and writing the results (another process):
  named once, left out of the answer, the table still written."""
  trained = []
  _fake_job(monkeypatch, trained)
  from decentral_jax.tools.compare import pricing
  real = pricing.eval_curve

  def damaged_then_read(path):
    with open(path, "w") as f:
      f.write('{"step": 0, "eval/loss": "low"}\n')
    return real(path)

  monkeypatch.setattr(pricing, "eval_curve", damaged_then_read)
  out = tmp_path / "out"
  assert _main(out) == 0
  err = capsys.readouterr().err
  warnings = _job_warnings(err, tmp_path)
  assert len(warnings) == 1 and "'eval/loss' at step=0" in warnings[0], err
  assert warnings[0].endswith("its loss curve is left out."), warnings
  md = (out / "results.md").read_text()
  assert "Left out of the answer (a seed's metrics.jsonl is missing or " \
      "damaged): All-Reduce." in md
  assert "| All-Reduce | 2.0000 |" in md


# -- metrics.jsonl of a run that resumes: refused -------------------------------


@pytest.mark.parametrize("case", sorted(set(METRICS_CASES) - {
    "missing", "empty", "truncated_mid_line", "no_loss", "only_null_losses",
    "loss_a_string", "lines_reversed", "a_step_repeated",
    "cut_to_whole_lines"}))
def test_resuming_refuses_damaged_metrics_in_one_line(tmp_path, case):
  content, word = METRICS_CASES[case]
  path = tmp_path / metrics.METRICS_FILE
  path.write_text('{"step": 0, "eval/loss": 4.0}\n{"step": 3, '
                  '"eval/loss": 2.0}\n')
  _damage(str(path), content)
  with pytest.raises(ValueError) as info:
    metrics.truncate_after(str(tmp_path), 1)
  text = str(info.value)
  assert "\n" not in text and text.startswith(f"{path}, line ")
  assert "line" in word or word.split("'")[0] in text, text


# -- files refused in one line naming the file and the key ---------------------


def _write(tmp_path, content, name="f.json") -> str:
  path = tmp_path / name
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content if isinstance(content, str)
                    else json.dumps(content))
  return str(path)


GOOD_WORKLOAD = {"format": workload_file.FORMAT, "param_count": 1e6,
                 "param_dtype": "float32",
                 "compute_s": {"forward": 0.01, "backward": 0.02,
                               "optimizer": 0.001},
                 "gossip_in_flight": {"forward": 0.0, "backward": 0.5}}


def _workload(**edits):
  d = json.loads(json.dumps(GOOD_WORKLOAD))
  for k, v in edits.items():
    section, _, key = k.partition("__")
    if key:
      d[section][key] = v
    elif v is _DROP:
      d.pop(section)
    else:
      d[section] = v
  return json.dumps(d)


WORKLOAD_CASES = {
    "empty": ("", "not readable JSON"),
    "truncated": (json.dumps(GOOD_WORKLOAD)[:30], "not readable JSON"),
    "binary": (BINARY, "not readable JSON"),
    "wrong_type": ("[1]", "format must be"),
    "other_format": (_workload(format="v0"), "format must be"),
    "key_missing": (_workload(compute_s=_DROP), "'compute_s'"),
    "string_for_number": (_workload(param_count="1e6"), "'param_count'"),
    "fractional_count": (_workload(param_count=1e6 + 0.25), "'param_count'"),
    "integer_dtype": (_workload(param_dtype="int8"), "param_dtype 'int8'"),
    "byte_swapped_dtype": (_workload(param_dtype=">f4"),
                           "param_dtype '>f4' is not in this machine's"),
    "unscaled_8_bit_dtype": (_workload(param_dtype="float8_e4m3fn"),
                             "8-bit float"),
    "nan_seconds": (_workload(compute_s__forward=float("nan")),
                    "compute_s.forward"),
    "inf_seconds": (_workload(compute_s__backward=float("inf")),
                    "compute_s.backward"),
    "fraction_above_one": (_workload(gossip_in_flight__backward=1.5),
                           "gossip_in_flight.backward"),
    "section_a_list": (_workload(gossip_in_flight=[0, 1]),
                       "'gossip_in_flight'"),
    # predict --params's bounds: at most 1e15, in at most 4096 buckets of
    # 25 MiB (1e15 float32: 4e15 / 26214400 -> 152587891 buckets).
    "param_count_above_max": (_workload(param_count=2e15), "'param_count'"),
    "param_count_in_too_many_buckets": (
        _workload(param_count=1e15),
        "param_count 1e+15 of 4-byte values in buckets of 25 MiB makes "
        "152587891 buckets, more than the 4096"),
}


def test_the_good_workload_file_is_read(tmp_path):
  w = workload_file.read_workload(_write(tmp_path, GOOD_WORKLOAD))
  assert (w.param_count, w.forward_s, w.backward_s) == (1e6, 0.01, 0.02)


@pytest.mark.parametrize("case", sorted(WORKLOAD_CASES))
def test_a_damaged_workload_file_is_refused_naming_its_key(tmp_path, case):
  content, word = WORKLOAD_CASES[case]
  path = _write(tmp_path, content)
  with pytest.raises(ValueError) as info:
    workload_file.read_workload(path)
  text = str(info.value)
  assert "\n" not in text and text.startswith(f"workload file {path!r}: ")
  assert word in text, text


IN_FLIGHT_CASES = {
    "empty": ("", "empty"),
    "truncated": ('{"in_flight_fractions": {"forw', "not JSON"),
    "binary": (BINARY, "not UTF-8"),
    "wrong_type": ("[0.5, 0.5]", "must be an object"),
    "key_missing": ({"in_flight_fractions": {"forward": 0.5}},
                    "misses ['backward']"),
    "section_missing": ({"collectives": []}, "misses ['in_flight_fractions']"),
    "string_for_number": ({"in_flight_fractions": {"forward": "0.5",
                                                   "backward": 0.5}},
                          "in_flight_fractions.forward"),
    "nan": ('{"in_flight_fractions": {"forward": NaN, "backward": 0.5}}',
            "in_flight_fractions.forward"),
    "above_one": ({"in_flight_fractions": {"forward": 0.5, "backward": 2}},
                  "in_flight_fractions.backward"),
}


@pytest.mark.parametrize("case", sorted(IN_FLIGHT_CASES))
def test_a_damaged_in_flight_file_is_refused_naming_its_key(tmp_path, case):
  content, word = IN_FLIGHT_CASES[case]
  path = _write(tmp_path, content, "report.json")
  with pytest.raises(ValueError) as info:
    in_flight.read_in_flight(path)
  text = str(info.value)
  assert "\n" not in text and text.startswith(f"--gossip-in-flight {path}: ")
  assert word in text, text


def test_the_good_in_flight_file_is_read(tmp_path):
  path = _write(tmp_path, {"in_flight_fractions": {"forward": 0.25,
                                                   "backward": 0.5},
                           "collectives": []}, "report.json")
  assert in_flight.read_in_flight(path) == (0.25, 0.5)


def test_a_cluster_file_without_measurements_names_what_it_must_have(
    tmp_path):
  sizes = [1e6, 4e6]
  good = {"schema": cluster_file.SCHEMA,
          "cluster": cluster_file.fit_links(
              {"sizes_bytes": sizes, "intra_pair_s": [1e-5 + m / 2e10
                                                      for m in sizes]},
              n_workers=8, local_size=8),
          "workload": None, "meta": {}}
  path = _write(tmp_path, good)
  with pytest.raises(ValueError) as info:
    cluster_file.read(path)
  text = str(info.value)
  assert text == (f"--cluster {path!r}: the file misses ['measurements'] "
                  "(the keys it must have: ['schema', 'cluster', 'workload', "
                  "'measurements', 'meta']).")


OVERLAP_ROW = {"case": "gpt_tiny", "target": "h200", "mode": "after",
               "consensus": "none", "distinct_round": None,
               "gossip_rounds": "static", "consensus_at": "next_step",
               "param_bytes": 1e6,
               "total_flops": 1e9, "flops_in_flight": 5e8,
               "collectives": []}


@pytest.mark.parametrize("content, word", [
    # No record at all: an empty table (rc 0) said nothing was read.
    ("", "no record (the file is empty or only blank lines)"),
    ("\n\n  \n", "no record (the file is empty or only blank lines)"),
    (json.dumps(OVERLAP_ROW) + "\n", None),  # one row: its table
    (json.dumps(OVERLAP_ROW)[:40] + "\n" + json.dumps(OVERLAP_ROW) + "\n",
     "line 1: not a JSON record"),
    (BINARY + b"\n{}\n", "line 1: not a JSON record"),
    ("[1]\n", "line 1: not a JSON record"),
    (json.dumps({**OVERLAP_ROW, "total_flops": "many"}) + "\n",
     "line 1: total_flops must be a finite number"),
    (json.dumps({k: v for k, v in OVERLAP_ROW.items() if k != "case"})
     + "\n", "line 1: the file misses ['case']"),
    ('{"total_flops": NaN}\n', "line 1: the file misses"),
])
def test_overlap_render_refuses_damaged_rows(tmp_path, capsys, content, word):
  path = _write(tmp_path, content, "rows.jsonl")
  rc = overlap.main(["--render", path])
  out = capsys.readouterr()
  if word is None:
    assert rc == 0 and "| case |" in out.out and "| gpt_tiny |" in out.out
    return
  assert rc == 2 and "Traceback" not in out.err
  lines = out.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"error: --render {path}: {word}"), lines


def test_overlap_render_refuses_a_file_without_a_readable_record(
    tmp_path, capsys):
  # 100 bytes of noise without a newline: no row at all, named.
  noise = bytes((7 * k + 3) % 256 for k in range(100)).replace(b"\n", b"x")
  path = _write(tmp_path, noise, "noise.jsonl")
  assert overlap.main(["--render", path]) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == [f"error: --render {path}: no readable record (line 1, "
                   "its only one, is not JSON); give the --out file of an "
                   "earlier run."], lines
  # A write cut short after a good row: the row's table and a note.
  path = _write(tmp_path, json.dumps(OVERLAP_ROW) + "\n"
                + json.dumps(OVERLAP_ROW)[:30], "torn.jsonl")
  assert overlap.main(["--render", path]) == 0
  out = capsys.readouterr()
  assert out.out.count("| gpt_tiny |") == 1, out.out
  assert out.err.strip() == (f"note: --render {path}: line 2 (the last, "
                             "without its newline) is not JSON, a write cut "
                             "short; left out."), out.err


@pytest.mark.parametrize("content, word", [
    (b"", "empty"), (b'{"step": ', "not JSON"), (BINARY, "not UTF-8"),
    (b"[" * 100_000, "nested too deeply")])
def test_damaged_step_metadata_marks_a_checkpoint_corrupt(
    tmp_path, content, word):
  from decentral_jax.runner import workdir as workdir_lib
  root = tmp_path / "5"
  root.mkdir()
  (root / "state").write_bytes(b"arrays")
  meta = root / "_CHECKPOINT_METADATA"
  meta.write_text('{"item_handlers": {}}')
  workdir_lib.write_sums(str(root), skip=(meta.name,))
  assert checkpoint_files.check_checkpoint(str(root)) == ("ok", "")
  meta.write_bytes(content)
  status, why = checkpoint_files.check_checkpoint(str(root))
  assert status == "corrupt", why
  assert why.startswith("_CHECKPOINT_METADATA unreadable (") and word in why
  meta.unlink()  # not every Orbax version writes it
  assert checkpoint_files.check_checkpoint(str(root)) == ("ok", "")


@pytest.mark.parametrize("argv, says", [
    ([], "error: --render needs the JSON-lines files of earlier runs"),
    (["DIR"], "error: --render 'DIR' is a directory; give the JSON-lines "
     "files"),
    (["DIR/none.jsonl"], "error: --render DIR/none.jsonl: does not exist")])
def test_overlap_render_names_a_missing_file_list_or_a_directory(
    tmp_path, capsys, argv, says):
  argv = [a.replace("DIR", str(tmp_path)) for a in argv]
  assert overlap.main(["--render", *argv]) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      says.replace("DIR", str(tmp_path))), lines


def test_a_final_accuracy_without_an_accuracy_evaluation_is_not_kept(
    tmp_path, capsys):
  run_dir = _kept_run(tmp_path)  # its metrics.jsonl evaluates no accuracy
  _damage(os.path.join(run_dir, record_lib.RESULT_FILE),
          _record_edit(final={"eval/accuracy": 0.5}))
  assert job_lib.arm_status(run_dir, _Config()) == ("fresh", None)
  assert "final.eval/accuracy is 0.5, but" in capsys.readouterr().err


def test_a_diverged_run_with_impossible_metrics_is_not_kept(tmp_path, capsys):
  run_dir = _kept_run(tmp_path)
  _damage(os.path.join(run_dir, record_lib.RESULT_FILE),
          _record_edit(final=None, diverged="nan loss"))
  assert job_lib.arm_status(run_dir, _Config())[0] == "finished"
  _damage(os.path.join(run_dir, metrics.METRICS_FILE),
          '{"step": 0, "eval/loss": -3}\n')
  assert job_lib.arm_status(run_dir, _Config()) == ("fresh", None)
  assert "'eval/loss' at step=0 must be >= 0" in capsys.readouterr().err


def test_a_curve_past_the_run_is_not_called_cut_short(tmp_path, capsys):
  run_dir = _kept_run(tmp_path)  # a run of 3 steps
  _damage(os.path.join(run_dir, metrics.METRICS_FILE),
          '{"step": 0, "eval/loss": 4.0}\n{"step": 6, "eval/loss": 2.0}\n')
  assert job_lib.arm_status(run_dir, _Config()) == ("fresh", None)
  assert "(longer than the run)" in capsys.readouterr().err


# -- one rule set for every value of a kept run ---------------------------------


class _GptConfig:
  """A gpt run's config as compare_result.json holds it (8 workers)."""

  model, data = {}, {}

  def to_json(self) -> str:
    return json.dumps({"steps": 3, "seed": 0, "n_workers": 8, "model": {
        "name": "gpt", "param_dtype": "float32"}})


# A run of 7344 float32 parameters (29376 bytes) sending 5140.8 bytes per
# step: ratio 5140.8 / 29376 = 0.175 (by hand).
_GPT_FINAL = {**_FINAL, "step": 3, "param_count": 7344, "train_time_s": 1.0,
              "train/loss": 2.1, "eval/worker_loss_min": 2.0,  # _METRICS'
              "eval/worker_loss_mean": 2.0, "eval/worker_loss_max": 2.0,
              "comm/bytes_per_step": 5140.8, "comm/ratio": 0.175}

FINAL_CASES = {
    "ratio_contradicts_bytes": ({"comm/ratio": 0.5}, "final.comm/ratio is 0.5"),
    "bytes_1e300": ({"comm/bytes_per_step": 1e300}, "final.comm/ratio is"),
    # consistent (40 x 29376 bytes) but above 4 messages to each of 8 workers
    "ratio_above_bound": ({"comm/bytes_per_step": 40 * 29376.0,
                           "comm/ratio": 40.0}, "must be <= 4 x n_workers"),
    "ratio_without_param_count": ({"param_count": None},
                                  "final.param_count is None"),
    "step_short": ({"step": 1}, "final.step is 1, but the run's config has "
                                "steps 3"),
    "step_fraction": ({"step": 3.5}, "final.step is 3.5"),
    "param_count_0": ({"param_count": 0}, "final.param_count must be a whole"),
    "param_count_half": ({"param_count": 7344.5},
                         "final.param_count must be a whole number >= 1, got "
                         "7344.5"),
    "train_time_negative": ({"train_time_s": -1},
                            "final.train_time_s must be in [0, 1e+09], got -1"),
    "worker_min_above_max": ({"eval/worker_loss_min": 99},
                             "eval/worker_loss_min <= eval/worker_loss_mean"),
    "worker_mean_negative": ({"eval/worker_loss_mean": -3},
                             "final.eval/worker_loss_mean must be >= 0"),
    "train_loss_negative": ({"train/loss": -2},
                            "final.train/loss must be >= 0, got -2"),
}


def _gpt_kept_run(tmp_path) -> str:
  run_dir = _kept_run(tmp_path)
  _damage(os.path.join(run_dir, record_lib.RESULT_FILE), json.dumps(
      {"config": json.loads(_GptConfig().to_json()), "final": _GPT_FINAL,
       "diverged": None, "data_files": {}}))
  return run_dir


@pytest.mark.parametrize("case", sorted(FINAL_CASES))
def test_a_kept_run_s_impossible_final_values_are_not_kept(
    tmp_path, capsys, case):
  edit, word = FINAL_CASES[case]
  run_dir = _gpt_kept_run(tmp_path)
  assert job_lib.arm_status(run_dir, _GptConfig())[0] == "finished"
  assert capsys.readouterr().err == ""
  path = os.path.join(run_dir, record_lib.RESULT_FILE)
  _damage(path, _record_edit(final=edit))
  assert job_lib.arm_status(run_dir, _GptConfig()) == ("fresh", None)
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith(f"warning: {path}: ") and word in line, line
  assert line.endswith("resumed from its checkpoint or trained again."), line


def test_an_impossible_value_in_any_metrics_row_trains_the_run_again(
    tmp_path, capsys):
  run_dir = _gpt_kept_run(tmp_path)
  os.makedirs(os.path.join(run_dir, "checkpoints", "3"))
  (tmp_path / "run" / "config.json").write_text(_GptConfig().to_json())
  path = os.path.join(run_dir, metrics.METRICS_FILE)
  _damage(path, _row(0, **agreeing_evaluation(4.0))
          + _row(2, **{"train/loss": -1.0})
          + _row(3, **agreeing_evaluation(2.0)))
  assert job_lib.arm_status(run_dir, _GptConfig()) == ("fresh", None)
  assert capsys.readouterr().err.splitlines() == [
      f"warning: {path}: at step 2: train/loss must be >= 0, got -1.0; the "
      "run is not kept: it is trained again."]


def test_a_kept_run_whose_row_lost_its_training_loss_is_trained_again(
    tmp_path, capsys):
  """The runner writes train/loss in every record after step 0: step 3's
  row without it (the records re-signed) is an edited log, so the run is
  not kept, and not resumed either (a resume keeps that row)."""
  run_dir = _gpt_kept_run(tmp_path)
  os.makedirs(os.path.join(run_dir, "checkpoints", "3"))
  (tmp_path / "run" / "config.json").write_text(_GptConfig().to_json())
  assert job_lib.arm_status(run_dir, _GptConfig())[0] == "finished"
  assert capsys.readouterr().err == ""
  path = os.path.join(run_dir, metrics.METRICS_FILE)
  _damage(path, lambda t: t.replace('"train/loss": 2.1, ', ""))
  with open(path, encoding="utf-8") as f:
    assert [("train/loss" in json.loads(l)) for l in f] == [False, False]
  assert job_lib.arm_status(run_dir, _GptConfig()) == ("fresh", None)
  assert capsys.readouterr().err.splitlines() == [
      f"warning: {path}: at step 3: train/loss missing, but the runner "
      "writes it in every record after step 0; the run is not kept: it is "
      "trained again."]


def test_shared_values_name_the_run_that_disagrees():
  one = {"seed": 0, "method": "m", "job": 0, "param_count": 10.0}
  facts = {"a": {**one, "step-0 eval/loss": 5.507034778594971},
           "b": {**one, "step-0 eval/loss": 5.507035},  # float32 rounding
           "c": {**one, "step-0 eval/loss": 9.0},
           "d": {**one, "seed": 1, "step-0 eval/loss": 7.0}}  # another seed
  assert set(kept.disagreeing(facts, set())) == {"c"}
  assert "step-0 eval/loss 9.0 differs from 5.50" in kept.disagreeing(
      facts, set())["c"]
  # A trusted run (trained now) settles it, even against a majority.
  assert set(kept.disagreeing(facts, {"c"})) == {"a", "b"}
  # Two kept runs that disagree, none trusted: both are named.
  two = {k: facts[k] for k in ("a", "c")}
  assert set(kept.disagreeing(two, set())) == {"a", "c"}
  # The parameter count is one across the job, the communication one per
  # method.
  facts["d"]["param_count"] = 11.0
  assert set(kept.disagreeing(facts, {"a"})) == {"c", "d"}
  comm = {"x": {**one, "comm/ratio": 0.175}, "y": {**one, "comm/ratio": 0.5},
          "z": {**one, "method": "n", "comm/ratio": 1.75}}
  assert set(kept.disagreeing(comm, {"x"})) == {"y"}


def _main_methods(out, methods):
  return compare.main([f"--outdir={out}", "--config.steps=3",
                       "--config.eval_interval=3", f"--methods={methods}",
                       "--clusters="])


@pytest.mark.parametrize("methods, again", [
    ("all_reduce,dadam,local_dadam", ["local_dadam"]),  # the majority wins
    ("all_reduce,local_dadam", ["all_reduce", "local_dadam"]),  # no majority
])
def test_a_kept_run_whose_step_0_loss_disagrees_is_trained_again(
    tmp_path, monkeypatch, capsys, methods, again):
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  assert _main_methods(out, methods) == 0
  first = len(trained)
  path = out / "local_dadam" / metrics.METRICS_FILE
  _damage(str(path), lambda t: t.replace('"eval/loss": 4.0',
                                        '"eval/loss": 9.0'))  # re-signed
  capsys.readouterr()
  assert _main_methods(out, methods) == 0
  err = capsys.readouterr().err
  assert trained[first:] == [str(out / m) for m in again], err
  warnings = _job_warnings(err, tmp_path)
  assert len(warnings) == len(again), err
  assert all("step-0 eval/loss" in w and w.endswith("trained again.")
             for w in warnings), warnings
  assert _main_methods(out, methods) == 0 and len(trained) == first + len(
      again)  # kept from now on


def test_a_kept_run_disagreeing_with_a_fresh_run_is_trained_again(
    tmp_path, monkeypatch, capsys):
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  assert _main_methods(out, "all_reduce,local_dadam") == 0
  path = out / "local_dadam" / metrics.METRICS_FILE
  _damage(str(path), lambda t: t.replace('"eval/loss": 4.0',
                                        '"eval/loss": 9.0'))  # re-signed
  shutil.rmtree(out / "all_reduce")  # trained now: it settles the value
  del trained[:]
  assert _main_methods(out, "all_reduce,local_dadam") == 0
  assert trained == [str(out / "all_reduce"), str(out / "local_dadam")]
  [warning] = _job_warnings(capsys.readouterr().err, tmp_path)
  assert "its step-0 eval/loss 9.0 differs from 4.0" in warning, warning


def test_overlap_render_reads_the_rows_overlap_writes(capsys):
  """The rows of the shipped overlap results (written by ``overlap
  --out``: gossip_rounds "static"/"switch", consensus_at "log_step"/
  "next_step") render, one table row per record."""
  results = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), "benchmarks", "results", "gpu_overlap")
  for name in ("gpt2.jsonl", "main.jsonl"):
    path = os.path.join(results, name)
    with open(path, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    assert {type(r["gossip_rounds"]) for r in rows} == {str}
    assert overlap.main(["--render", path]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "| case |" in out.out
    assert all(f"| {r['case']} |" in out.out or r["case"] in out.out
               for r in rows)
