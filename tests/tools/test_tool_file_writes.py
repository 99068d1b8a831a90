"""The files the main job and the learners write whole go through a
temporary name that is never followed nor opened if something else sits
there (a symbolic link would send the records outside the directory, a
FIFO would block for ever); a file the learners append to must be a
regular file."""

from __future__ import annotations

import json
import os
import re
import threading
import types

import pytest
from ml_collections import config_dict

from decentral_jax.runner import tmpfile
from decentral_jax.tools.compare import job
from decentral_jax.tools.compare import record as record_lib
from decentral_jax.tools.compare import plots
from decentral_jax.tools.learners import records


def _in_thread(fn, *args):
  """Runs ``fn(*args)``; fails if it has not returned after 20 s (a FIFO
  opened for writing blocks for ever). Returns its exception or None."""
  got = []

  def target():
    try:
      fn(*args)
      got.append(None)
    except Exception as e:  # pylint: disable=broad-except
      got.append(e)
  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(20)
  assert not t.is_alive(), f"{fn.__name__} blocked"
  return got[0]


def _victim(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  return victim


def _result_args(workdir):
  return (str(workdir), config_dict.ConfigDict({"steps": 6, "seed": 0}),
          {"eval/loss": 4.5}, None, {})


@pytest.mark.parametrize("kind", ["symlink", "fifo", "file"])
def test_compare_record_replaces_what_sits_at_its_temporary_name(
    tmp_path, kind):
  run = tmp_path / "diloco"
  run.mkdir()
  victim = _victim(tmp_path)
  tmp = run / "compare_result.json.tmp"
  {"symlink": lambda: os.symlink(victim, tmp),
   "fifo": lambda: os.mkfifo(tmp),
   "file": lambda: tmp.write_text("half a record")}[kind]()
  assert _in_thread(record_lib.write, *_result_args(run)) is None
  assert victim.read_text() == "precious\n"
  out = run / "compare_result.json"
  assert not out.is_symlink() and out.is_file()
  assert json.loads(out.read_text()) == {
      "config": {"steps": 6, "seed": 0}, "final": {"eval/loss": 4.5},
      "diverged": None, "data_files": {}}
  assert not os.path.lexists(tmp)


def test_compare_record_refuses_a_directory_at_its_temporary_name(
    tmp_path):
  run = tmp_path / "diloco"
  (run / "compare_result.json.tmp").mkdir(parents=True)
  with pytest.raises(ValueError, match=r"compare_result\.json\.tmp is a "
                     "directory.*move it away"):
    record_lib.write(*_result_args(run))


def test_a_plot_never_follows_a_link_at_its_name_or_temporary_name(
    tmp_path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  victim, other = _victim(tmp_path), tmp_path / "other.txt"
  other.write_text("kept\n")
  out = tmp_path / "loss_vs_step.png"
  os.symlink(victim, out)
  os.symlink(other, str(out) + ".tmp")
  fig = plt.figure(figsize=(1, 1))
  plots.save_png(fig, str(out))
  plt.close(fig)
  assert victim.read_text() == "precious\n" and other.read_text() == "kept\n"
  assert not out.is_symlink()
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  (tmp_path / "x.png.tmp").mkdir()
  fig = plt.figure(figsize=(1, 1))
  with pytest.raises(ValueError, match=r"x\.png\.tmp is a directory"):
    plots.save_png(fig, str(tmp_path / "x.png"))
  plt.close(fig)


@pytest.mark.parametrize("name", ["results.md", "loss_vs_step.png",
                                  "compare_result.json"])
def test_a_directory_at_an_output_s_own_name_is_named_with_the_fix(
    tmp_path, name):
  """compare named its own results.md.tmp (a file it had just written and
  left behind) when results.md was a directory: the directory is named,
  with the fix, before anything is written."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  out = tmp_path / name
  (out / "kept").mkdir(parents=True)
  fig = plt.figure(figsize=(1, 1))
  write = {"results.md": lambda: tmpfile.replace(str(out), "# results\n"),
           "loss_vs_step.png": lambda: plots.save_png(fig, str(out)),
           "compare_result.json": lambda: record_lib.write(*_result_args(
               tmp_path))}[name]
  with pytest.raises(ValueError) as info:
    write()
  plt.close(fig)
  assert str(info.value) == (
      f"{out} is a directory, not the file the run writes there; move it "
      "away (the run writes and renames its own file) and run again.")
  assert sorted(os.listdir(tmp_path)) == [name]  # no .tmp left
  assert os.listdir(out) == ["kept"]


def test_a_failed_rename_removes_the_temporary_file_and_names_the_file(
    tmp_path, monkeypatch):
  out = tmp_path / "results.md"
  out.write_text("old\n")

  def fail(src, dst):
    raise OSError(28, "No space left on device", src, None, dst)
  monkeypatch.setattr(os, "replace", fail)
  with pytest.raises(OSError) as info:
    tmpfile.replace(str(out), "new\n")
  assert (info.value.errno, info.value.filename) == (28, str(out))
  assert sorted(os.listdir(tmp_path)) == ["results.md"]
  assert out.read_text() == "old\n"


def _run_records(workdir):
  task = types.SimpleNamespace(
      config=config_dict.ConfigDict({"sync_every": 5}),
      task=types.SimpleNamespace(unit="tokens"),
      evaluate=lambda theta: {"eval/loss": 5.0})
  return records.RunRecords(str(workdir), task,
                            types.SimpleNamespace(sync_every=5, shards=4),
                            "gpt_tiny", [], 1)


@pytest.mark.parametrize("name", ["config.json", "config.json.tmp",
                                  "learners.json.tmp"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_learners_documents_replace_a_link_or_fifo_never_follow_it(
    tmp_path, name, kind):
  run = tmp_path / "run"
  run.mkdir()
  victim = _victim(tmp_path)
  at = run / name
  os.symlink(victim, at) if kind == "symlink" else os.mkfifo(at)
  rr = _run_records(run)
  assert _in_thread(rr.begin, 0, None) is None
  rr.close()
  assert victim.read_text() == "precious\n"
  for doc in ("config.json", "learners.json"):
    assert not (run / doc).is_symlink() and (run / doc).is_file()
  assert json.loads((run / "config.json").read_text()) == {"sync_every": 5}
  meta = json.loads((run / "learners.json").read_text())
  assert (meta["learners"], meta["segments"][0]["from_period"]) == (4, 0)
  assert [json.loads(x) for x in (run / "metrics.jsonl").read_text(
  ).splitlines()] == [{"step": 0, "tokens": 0, "eval/loss": 5.0,
                       "train_time_s": 0.0}]


@pytest.mark.parametrize("kind, words", [
    ("symlink", "is a symbolic link"), ("dangling", "is a symbolic link"),
    ("fifo", "is not a regular file"), ("dir", "is a directory")])
@pytest.mark.parametrize("name", ["metrics.jsonl", "learners.json"])
def test_a_record_the_run_reads_back_must_be_a_regular_file(
    tmp_path, kind, words, name):
  """metrics.jsonl (appended to) and learners.json (read, then rewritten)
  are refused, naming them, before anything is written."""
  run = tmp_path / "run"
  run.mkdir()
  victim = _victim(tmp_path)
  at = run / name
  {"symlink": lambda: os.symlink(victim, at),
   "dangling": lambda: os.symlink(tmp_path / "nowhere", at),
   "fifo": lambda: os.mkfifo(at), "dir": at.mkdir}[kind]()
  want = re.escape(str(at)) + " " + words + ".*move it away"
  err = _in_thread(records.check_workdir, str(run))
  assert isinstance(err, ValueError) and re.search(want, str(err)), err
  err = _in_thread(_run_records(run).begin, 0, None)
  assert isinstance(err, ValueError) and re.search(want, str(err)), err
  assert victim.read_text() == "precious\n"
  assert not (tmp_path / "nowhere").exists()
  assert not (run / "config.json").exists()  # refused before any write
