"""compare's run directories: the data a kept run trained on, the status of
a run set aside at resume, and the check of every run directory before the
first run trains. Training is faked (nothing compiles)."""

import hashlib
import json
import os
import types

from ml_collections import config_dict
import pytest

from decentral_jax.runner import builders
from decentral_jax.runner import metrics
from decentral_jax.tools import compare
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.compare import record as record_lib

from helpers import agreeing_evaluation

_FINAL = {"step": 3, "eval/loss": 2.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 0.0,
          "param_count": 250_000}


def _fake_job(monkeypatch, trained: list):
  def trains(config, workdir, experiment=None):
    trained.append(os.path.basename(workdir))
    os.makedirs(workdir, exist_ok=True)
    schedule = builders.make_schedule(config)  # lr as the recorder takes it
    with open(os.path.join(workdir, metrics.METRICS_FILE), "w") as f:
      for step, loss in ((0, 4.0), (3, 2.0)):  # the runner's keys
        row = {"step": step, "lr": float(schedule(max(step, 1) - 1)),
               "train_time_s": step / 3, **agreeing_evaluation(loss)}
        f.write(json.dumps({**row, **({"train/loss": 2.1} if step else {})})
                + "\n")
    return dict(_FINAL)

  monkeypatch.setattr(job_lib.train, "train_and_evaluate", trains)
  monkeypatch.setattr(job_lib.experiment, "Experiment", lambda config: None)
  monkeypatch.setattr(job_lib, "sent_per_step", lambda exp: {
      "comm/ratio": 1.0, "comm/bytes_per_step": 1e6})
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")


def _main(out, *flags_):
  return compare.main([f"--outdir={out}", "--config.steps=3",
                       "--config.eval_interval=3", "--clusters=", *flags_])


def _shown(data: bytes) -> str:
  """The fingerprint of a file under 1 MiB as the messages show it: its
  size and the SHA-256 of the whole file at both ends (by hand)."""
  h = hashlib.sha256(data).hexdigest()[:12]
  return (f"{len(data)} bytes, SHA-256 of the first MiB {h} and of the "
          f"last {h}")


def test_a_finished_run_trained_on_other_data_is_set_aside_and_trained(
    tmp_path, monkeypatch, capsys):
  trained = []
  _fake_job(monkeypatch, trained)
  text = tmp_path / "corpus.txt"
  old, new = b"the old corpus\n" * 3, b"another text entirely\n"
  text.write_bytes(old)
  out = tmp_path / "out"
  data = ["--methods=all_reduce", "--config.data.source=text_file",
          f"--config.data.path={text}"]
  assert _main(out, *data) == 0 and trained == ["all_reduce"]
  record = json.loads((out / "all_reduce" / record_lib.RESULT_FILE).read_text())
  assert record["data_files"] == {"text": {
      "bytes": 45, "head_sha256": hashlib.sha256(old).hexdigest(),
      "tail_sha256": hashlib.sha256(old).hexdigest()}}
  capsys.readouterr()
  assert _main(out, *data) == 0 and trained == ["all_reduce"]  # kept
  assert "kept" in capsys.readouterr().out
  text.write_bytes(new)  # the file at config.data.path replaced
  assert _main(out, *data) == 0 and trained == ["all_reduce"] * 2
  run = out / "all_reduce"
  warnings = [l for l in capsys.readouterr().err.splitlines()
              if l.startswith(f"warning: {run}")]
  assert warnings == [
      f"warning: {run}: {record_lib.RESULT_FILE} records a run trained on other "
      f"data than this run's config.data.path={str(text)!r} (text: "
      f"{_shown(old)} in the recorded run, {_shown(new)} in this one); the "
      f"run was moved to {run}.not_resumed and is trained again from step 0."]
  assert json.loads((out / "all_reduce.not_resumed" / record_lib.RESULT_FILE)
                    .read_text())["data_files"]["text"]["bytes"] == 45


def test_a_record_without_its_data_fingerprint_is_trained_again_once(
    tmp_path, monkeypatch, capsys):
  trained = []
  _fake_job(monkeypatch, trained)
  assert _main(tmp_path, "--methods=all_reduce") == 0
  run = tmp_path / "all_reduce"
  path = run / record_lib.RESULT_FILE
  record = json.loads(path.read_text())
  assert record.pop("data_files") == {}  # pydoc: no file of its own
  path.write_text(json.dumps(record))  # as written before the key existed
  record_lib.sign(str(run))
  capsys.readouterr()
  assert _main(tmp_path, "--methods=all_reduce") == 0
  assert trained == ["all_reduce"] * 2
  assert [l for l in capsys.readouterr().err.splitlines()
          if l.startswith(f"warning: {run}")] == [
      f"warning: {run}: {record_lib.RESULT_FILE} records no fingerprint of the "
      "data the run read (written before it was stored); the run was moved "
      f"to {run}.not_resumed and is trained again from step 0."]
  assert _main(tmp_path, "--methods=all_reduce") == 0
  assert trained == ["all_reduce"] * 2  # kept from now on


def test_a_run_set_aside_at_resume_is_recorded_as_trained_from_step_0(
    tmp_path, monkeypatch):
  config = config_dict.ConfigDict({"steps": 3, "seed": 0, "model": {
      "name": "gpt"}, "data": {"source": "pydoc", "path": None}})
  workdir = tmp_path / "dadam"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  (workdir / "config.json").write_text(config.to_json())
  calls = []

  def trains(config, workdir, experiment=None):
    calls.append(workdir)
    if len(calls) == 1:  # the checkpoint's run read other data
      raise ValueError(
          f"the checkpoint in {os.path.join(workdir, 'checkpoints')} was "
          "trained on other data; resume with the original data.")
    return dict(_FINAL)

  monkeypatch.setattr(job_lib.train, "train_and_evaluate", trains)
  monkeypatch.setattr(job_lib.experiment, "Experiment", lambda config: None)
  monkeypatch.setattr(job_lib, "sent_per_step", lambda exp: {
      "comm/ratio": 1.0, "comm/bytes_per_step": 1e6})
  assert job_lib.arm_status(str(workdir), config) == ("resume", None)
  statuses = {}
  run = types.SimpleNamespace(name="dadam", label="DAdam")
  job_lib.run_arm(run, config, str(workdir), statuses=statuses)
  assert len(calls) == 2 and os.path.isdir(f"{workdir}.not_resumed")
  assert statuses == {"dadam": "fresh"}  # trusted by the cross-check


def _dangling(p):
  os.symlink(p.parent / "nowhere", p)


def _foreign(p):
  p.mkdir()
  (p / "notes.txt").write_text("mine\n")


_BAD_RUN_DIRS = {
    "dangling_link": (_dangling, "is a symbolic link (to {parent}/nowhere, "
                      "which does not exist), so it is not replaced"),
    "link_to_a_directory": (lambda p: os.symlink(p.parent, p),
                            "is a symbolic link (to {parent}), so it"),
    "file": (lambda p: p.write_text("x"), "is not a directory"),
    "fifo": (os.mkfifo, "is not a directory"),
    "foreign_entry": (_foreign, "is not a run directory of this project "
                      "(it holds 'notes.txt')"),
}


@pytest.mark.parametrize("case", sorted(_BAD_RUN_DIRS))
def test_every_run_directory_is_checked_before_the_first_run_trains(
    tmp_path, monkeypatch, capsys, case):
  trained = []
  _fake_job(monkeypatch, trained)
  make, words = _BAD_RUN_DIRS[case]
  out = tmp_path / "out"
  out.mkdir()
  make(out / "all_reduce")  # the second run's directory
  assert _main(out, "--methods=dadam,all_reduce") == 2
  assert trained == []  # dadam, the first run, did not train
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error:")]
  assert len(errors) == 1, errors
  assert errors[0].startswith(
      f"error: run 'all_reduce' (All-Reduce): {out}/all_reduce ")
  assert words.format(parent=out) in errors[0]
  assert not os.path.lexists(out / "dadam")


@pytest.mark.parametrize("entry", ["all_reduce/config.json",
                                   "dadam.not_resumed/metrics.jsonl",
                                   "results.md", "run.lock",
                                   "loss_vs_step.png"])
def test_a_data_file_the_job_writes_in_outdir_is_refused_before_any_run(
    tmp_path, monkeypatch, capsys, entry):
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  data = out / entry
  data.parent.mkdir(parents=True)
  corpus = b"the user's corpus\n" * 50
  data.write_bytes(corpus)
  before = sorted(str(p) for p in out.rglob("*"))
  assert _main(out, "--methods=dadam,all_reduce",
               "--config.data.source=text_file",
               f"--config.data.path={data}") == 2
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error:")]
  top = entry.split("/")[0]
  assert errors == [
      f"error: --config.data.path '{data}' is or lies in '{top}' of "
      f"--outdir '{out}', which the run writes, moves aside or removes: the "
      "data would be lost; give --config.data.path a path outside the run's "
      "own files, or --outdir another directory."]
  assert trained == [] and data.read_bytes() == corpus
  assert sorted(str(p) for p in out.rglob("*")) == before  # no run.lock


def test_a_data_file_elsewhere_in_outdir_is_read(tmp_path, monkeypatch):
  trained = []
  _fake_job(monkeypatch, trained)
  out = tmp_path / "out"
  out.mkdir()
  (out / "corpus.txt").write_bytes(b"the user's corpus\n" * 50)
  assert _main(out, "--methods=all_reduce", "--config.data.source=text_file",
               f"--config.data.path={out / 'corpus.txt'}") == 0
  assert trained == ["all_reduce"]


def test_an_outdir_that_is_a_dangling_link_is_named_as_one(
    tmp_path, monkeypatch, capsys):
  trained = []
  _fake_job(monkeypatch, trained)
  os.symlink(tmp_path / "gone" / "target", tmp_path / "out")
  assert _main(tmp_path / "out", "--methods=all_reduce") == 2
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error:")]
  assert errors == [f"error: --outdir '{tmp_path / 'out'}' is a symbolic "
                    f"link to '{tmp_path / 'gone' / 'target'}', which does "
                    "not exist."]
  assert trained == [] and not os.path.exists(tmp_path / "gone")
