"""Output paths checked before the work: what ``flag_types`` refuses, by
name, that would otherwise fail only at the write (after training,
compiling or measuring)."""

from __future__ import annotations

import os

import pytest

from decentral_jax.tools import cli
from decentral_jax.tools import flag_types


@pytest.mark.parametrize("name, says", [
    ("", "is empty; give a file name."),
    ("newdir/", "is a directory; give a file name."),
    ("DIR", "is a directory; give a file name."),
    ("afile/", "is a directory; give a file name."),
    ("a" * 300 + ".txt", "is longer than the 255 bytes"),
    ("dangling", "is a symbolic link to 'nowhere/x.png', which does not "
     "exist."),
    ("missing/x.png", "does not exist; give a file in an existing "
     "directory.")])
def test_an_output_file_that_cannot_be_written_is_named(tmp_path, name, says):
  (tmp_path / "afile").write_text("x")
  os.symlink("nowhere/x.png", tmp_path / "dangling")
  path = str(tmp_path) if name == "DIR" else (
      os.path.join(str(tmp_path), name) if name else "")
  with pytest.raises(ValueError) as e:
    flag_types.check_output_file(path, "--png")
  assert str(e.value).startswith("--png") and says in str(e.value), e.value


@pytest.mark.parametrize("name, says", [
    ("dangling", "which does not exist."),
    ("b" * 300, "is longer than the 255 bytes"),
    ("afile", "is a file, not a directory")])
def test_an_output_directory_that_cannot_be_made_is_named(tmp_path, name,
                                                          says):
  (tmp_path / "afile").write_text("x")
  os.symlink("nowhere", tmp_path / "dangling")
  with pytest.raises(ValueError, match="--workdir") as e:
    flag_types.check_output_dir(os.path.join(str(tmp_path), name),
                                "--workdir")
  assert says in str(e.value), e.value


def test_writable_paths_pass(tmp_path):
  flag_types.check_output_file(str(tmp_path / "x.png"), "--png")
  flag_types.check_output_dir(str(tmp_path / "new" / "dir"), "--workdir")
  assert not os.path.exists(tmp_path / "new")  # nothing created


@pytest.mark.parametrize("name, says", [
    ("chart", "has no extension"), ("chart.xyz", "ends in '.xyz'")])
def test_a_chart_path_needs_an_image_extension(tmp_path, name, says, capsys):
  path = str(tmp_path / name)
  assert cli.main(["predict", "--methods", "all_reduce", "--png", path]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0] and "--png" in err[0], err
  assert os.listdir(tmp_path) == []  # nothing written, not chart.png


def test_an_output_is_tried_not_guessed_and_nothing_is_left(tmp_path):
  """procfs: the directory exists and the permission bits allow writing,
  yet no file can be created there; the write is tried and refused. A
  file or directory made to try it is removed; an existing one kept."""
  with pytest.raises(ValueError) as e:
    flag_types.check_output_file("/proc/x.jsonl", "--out")
  assert str(e.value).startswith("--out '/proc/x.jsonl' cannot be written")
  with pytest.raises(ValueError) as e:
    flag_types.check_output_dir("/proc/new/dir", "--fixtures")
  assert str(e.value).startswith("--fixtures '/proc/new/dir' cannot be "
                                 "written")
  kept = tmp_path / "kept.jsonl"
  kept.write_text("row\n")
  flag_types.check_output_file(str(kept), "--out")
  flag_types.check_output_file(str(tmp_path / "new.jsonl"), "--out")
  flag_types.check_output_dir(str(tmp_path), "--fixtures")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl"]
  assert kept.read_text() == "row\n"


@pytest.mark.parametrize("name, says", [
    ("none.txt", "'DIR/none.txt' does not exist; give an existing file."),
    ("", "'DIR' is a directory; give a file.")])
def test_an_input_file_that_cannot_be_read_is_named(tmp_path, name, says):
  with pytest.raises(ValueError) as e:
    flag_types.check_input_file(os.path.join(str(tmp_path), name) if name
                                else str(tmp_path), "--profile")
  assert str(e.value) == "--profile " + says.replace("DIR", str(tmp_path))
  (tmp_path / "p.pbtxt").write_text("costs {}")
  flag_types.check_input_file(str(tmp_path / "p.pbtxt"), "--profile")
  flag_types.check_input_file("", "--profile")  # not given


def test_a_pipe_or_device_as_an_input_file_is_refused_without_blocking(
    tmp_path):
  """Opening a FIFO without a writer blocked the check for ever; /dev/zero
  never ends."""
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  for path in (str(fifo), "/dev/zero"):
    with pytest.raises(ValueError, match="is not a regular file"):
      flag_types.check_input_file(path, "--profile")


def test_a_socket_as_an_output_file_is_refused(tmp_path):
  import socket  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / "s")
  with socket.socket(socket.AF_UNIX) as s:
    s.bind(path)
    with pytest.raises(ValueError, match="--out .* is a socket"):
      flag_types.check_output_file(path, "--out")


def test_a_full_device_as_an_output_is_one_line(capsys):
  """/dev/full passes the output check (a device is left alone) and the
  write fails: one error line, not an OSError traceback."""
  from decentral_jax.tools.runtime_model_cli import main as rm_main  # pylint: disable=import-outside-toplevel
  assert rm_main.main(["utilisation", "--table", "/dev/full"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  # The line names the flag and the path (it named neither).
  assert err == ["error: --table '/dev/full' could not be written (No space "
                 "left on device); give another --table."], err


def test_measure_names_its_out_flag_when_the_write_fails(monkeypatch,
                                                         capsys, tmp_path):
  from decentral_jax.runtime_model import cluster_file  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import main as rm_main  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(measure, "measure", lambda *a, **k: {})
  monkeypatch.setattr("decentral_jax.runner.launch.initialize_from_config",
                      lambda c: None)
  def full(path, data):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(cluster_file, "write", full)
  out = str(tmp_path / "c.json")
  assert rm_main.main(["measure", "--config", "gpt_tiny", "--out", out]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: --out {out!r} could not be written (No space left "
                 "on device); give another --out."], err


_FULL = ("could not be written (No space left on device)")


def test_a_failed_final_write_is_one_line_naming_the_flag(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    flag_types.write_output("/dev/full", "--json", lambda f: f.write("x" *
                                                                    10**5),
                            kept="the rows were printed above")
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: --json '/dev/full' {_FULL}; the rows were printed above; "
      "give another --json."]
  path = tmp_path / "o.jsonl"  # a write that works: the text, as given
  flag_types.write_output(str(path), "--out", lambda f: f.write("a\n"))
  flag_types.write_output(str(path), "--out", lambda f: f.write("b\n"),
                          mode="a")
  assert path.read_text() == "a\nb\n"


def test_overlap_out_on_a_full_device_keeps_the_printed_rows(monkeypatch,
                                                             capsys):
  """The compile is replaced by one stored row; the rest is the command."""
  import json  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools import gpu_compile, overlap  # pylint: disable=import-outside-toplevel
  from helpers import ROOT  # pylint: disable=import-outside-toplevel
  with open(os.path.join(ROOT, "benchmarks", "results", "gpu_overlap",
                         "main.jsonl"), encoding="utf-8") as f:
    row = json.loads(f.readline())
  monkeypatch.setattr(gpu_compile, "check_compiler_options", lambda o: None)
  monkeypatch.setattr(overlap, "run_case", lambda case, mode, target, args,
                      timelines=None: [dict(row, case=case, mode=mode,
                                            target=target)])
  with pytest.raises(SystemExit) as e:
    overlap.main(["--cases", "gpt_tiny", "--modes", "after", "--out",
                  "/dev/full"])
  assert e.value.code == 2
  out, err = capsys.readouterr()
  assert "| gpt_tiny | " in out  # the row was printed before the append
  assert err.strip().splitlines() == [
      f"error: --out '/dev/full' {_FULL}; the rows of the table above were "
      "compiled; give another --out."]


def test_learners_json_on_a_full_device_after_the_run(monkeypatch, capsys):
  from decentral_jax.tools.learners import main as learners  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import flags as learners_flags  # pylint: disable=import-outside-toplevel
  args = learners_flags.parser().parse_args(["--json", "/dev/full"])
  run = learners_flags.run_spec(args)
  monkeypatch.setattr(learners, "distance_to_optimum", lambda r, t: None)
  status = {"version": 10, "log": {"tokens": [{0: 64}], "rejected": []}}
  with pytest.raises(SystemExit) as e:
    learners._summary(status, 2.0, {}, args, run, {})  # pylint: disable=protected-access
  assert e.value.code == 2
  out, err = capsys.readouterr()
  assert "10 periods merged in 2.0 s; 64 tokens merged (32.0 tokens/s)" in out
  assert err.strip().splitlines() == [
      f"error: --json '/dev/full' {_FULL}; the summary above was printed; "
      "give another --json."]


@pytest.mark.parametrize("name", ["afile", "/dev/null"])
def test_train_workdir_naming_a_file_is_refused_before_training(
    tmp_path, name, capsys, monkeypatch):
  """Was "cannot create the work directory X: File exists (EEXIST)",
  after JAX started, with no fix."""
  from decentral_jax.runner import train as runner_train  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools import train as train_cli  # pylint: disable=import-outside-toplevel
  def trained(*a, **k):
    raise AssertionError("trained")
  monkeypatch.setattr(runner_train, "train_and_evaluate", trained)
  (tmp_path / "afile").write_text("x")
  path = name if name.startswith("/") else str(tmp_path / name)
  assert train_cli.main(["--config=gpt_quick", f"--workdir={path}"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"error: --workdir {path!r} is a file, not a directory; give a "
      "directory (it is created if missing)."]
  assert (tmp_path / "afile").read_text() == "x"
