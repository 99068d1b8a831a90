"""An output path naming an input file, or another output, is refused
before any work (measure's --out over its --config; gpu_check's --json
and --workload over each other or over --config; an output file in an
output directory such as learners' --checkpoint-dir or overlap's
--fixtures, or such a directory at a file the command reads or writes)."""

import os
import shutil
import sys

import pytest

from decentral_jax.tools import distinct_paths
from decentral_jax.tools.runtime_model_cli import main as cli
from helpers import ROOT, benchmark_module


def test_an_output_equal_to_an_input_is_refused_by_its_real_path(tmp_path):
  cfg = tmp_path / "my.py"
  cfg.write_text("x = 1\n")
  (tmp_path / "sub").mkdir()
  spelled = str(tmp_path / "sub" / ".." / "my.py")  # the same file
  with pytest.raises(ValueError) as e:
    distinct_paths.check_distinct_paths([("--out", spelled)],
                                        [("--config", str(cfg))])
  assert str(e.value).startswith(f"--out {spelled!r} is the file --config "
                                 "reads"), e.value
  assert "give --out another path" in str(e.value)
  os.symlink(cfg, tmp_path / "link.py")
  with pytest.raises(ValueError, match="is the file --config reads"):
    distinct_paths.check_distinct_paths(
        [("--out", str(tmp_path / "link.py"))], [("--config", str(cfg))])


def test_two_outputs_naming_one_file_are_refused(tmp_path):
  f = str(tmp_path / "f.json")
  with pytest.raises(ValueError) as e:
    distinct_paths.check_distinct_paths([("--json", f), ("--workload", f)])
  assert str(e.value).startswith(f"--workload {f!r} is also --json's file")


def test_distinct_or_absent_paths_pass(tmp_path):
  cfg = tmp_path / "my.py"
  cfg.write_text("x = 1\n")
  distinct_paths.check_distinct_paths(
      [("--json", str(tmp_path / "a.json")), ("--workload", None),
       ("--out", str(tmp_path / "b.json"))], [("--config", str(cfg))])
  # a preset name or a FILE.py:ARG value reads a file only when it exists
  assert distinct_paths.config_file("gpt_tiny", ("gpt_tiny",)) is None
  assert distinct_paths.config_file(f"{cfg}:decentralized") == str(cfg)
  assert distinct_paths.config_file(str(tmp_path / "no.py")) is None


def test_measure_out_over_its_config_is_refused_before_measuring(
    tmp_path, capsys):
  cfg = tmp_path / "my.py"
  shutil.copy(os.path.join(ROOT, "configs", "gpt_tiny.py"), cfg)
  before = cfg.read_text()
  code = cli.main(["measure", "--config", str(cfg), "--out", str(cfg),
                   "--repeats", "2"])
  assert code == 2
  err = capsys.readouterr().err
  assert f"error: --out {str(cfg)!r} is the file --config reads" in err, err
  assert cfg.read_text() == before


@pytest.mark.parametrize("extra, message", [
    (["--workload", "F"], "--workload {F!r} is also --json's file"),
    (["--config", "F"], "--json {F!r} is the file --config reads")])
def test_gpu_check_outputs_over_each_other_or_config_are_refused(
    tmp_path, capsys, extra, message):
  f = str(tmp_path / "f.py")
  shutil.copy(os.path.join(ROOT, "configs", "gpt_tiny.py"), f)
  argv = ["--deviceless", "h200", "--json", f] + [
      f if a == "F" else a for a in extra]
  with pytest.raises(SystemExit) as e:
    benchmark_module("_gpu_check_flags").parse_args(argv)
  assert e.value.code == 2
  assert "error: " + message.format(F=f) in capsys.readouterr().err


@pytest.mark.parametrize("target", ["corpus.txt", "bins/train.bin"])
def test_measure_out_over_the_configs_data_is_refused_before_measuring(
    tmp_path, capsys, monkeypatch, target):
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  def no_measure(*a, **k):
    raise AssertionError("measured: --out was accepted")
  monkeypatch.setattr(measure, "measure", no_measure)
  (tmp_path / "corpus.txt").write_text("alpha beta gamma " * 3000)
  (tmp_path / "bins").mkdir()
  (tmp_path / "bins" / "train.bin").write_bytes(b"\0" * 64)
  source, path = (("text_file", tmp_path / "corpus.txt")
                  if target == "corpus.txt" else
                  ("token_bins", tmp_path / "bins"))
  out = tmp_path / target
  before = out.read_bytes()
  code = cli.main(["measure", "--config", "gpt_tiny", "--set",
                   f"data.source={source}", "--set", f"data.path={path}",
                   "--out", str(out), "--repeats", "2"])
  assert code == 2
  err = capsys.readouterr().err
  assert f"error: --out {str(out)!r} is the file --set data.path reads" in err
  assert out.read_bytes() == before


def test_a_data_directory_reads_the_files_in_it(tmp_path):
  (tmp_path / "train.bin").write_bytes(b"x")
  (tmp_path / "val.bin").write_bytes(b"y")
  (tmp_path / "sub").mkdir()
  assert distinct_paths.data_inputs(str(tmp_path), "F") == [
      ("F", str(tmp_path / "train.bin")), ("F", str(tmp_path / "val.bin"))]
  assert distinct_paths.data_inputs(None, "F") == []
  assert distinct_paths.data_inputs("x.txt", "F") == [("F", "x.txt")]


def _config_importing_a_helper(tmp_path, monkeypatch):
  """``c.py``, a gpt_tiny config whose n_layer comes from ``helper.py`` next
  to it (imported, so not a file any flag names); ``sys.path`` and the
  modules it imports are restored after the test."""
  monkeypatch.setattr(sys, "path", list(sys.path))
  for name in ("helper", "gpt_tiny"):
    if name in sys.modules:
      monkeypatch.setitem(sys.modules, name, sys.modules[name])
    else:
      monkeypatch.setitem(sys.modules, name, None)
      monkeypatch.delitem(sys.modules, name)
  (tmp_path / "helper.py").write_text("N_LAYER = 1\n")
  (tmp_path / "c.py").write_text(
      "import os, sys\n"
      "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
      f"sys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
      "import helper\nimport gpt_tiny\n"
      "def get_config():\n"
      "  c = gpt_tiny.get_config()\n"
      "  c.model.n_layer = helper.N_LAYER\n"
      "  return c\n")
  return tmp_path / "c.py", tmp_path / "helper.py"


def test_an_output_ending_in_py_is_refused_after_the_clashes(tmp_path):
  helper = str(tmp_path / "helper.py")
  with pytest.raises(ValueError) as e:
    distinct_paths.check_distinct_paths([("--out", helper)],
                                        [("--config", str(tmp_path / "c.py"))])
  assert str(e.value) == (
      f"--out {helper!r} ends in .py: it may be a Python module the config "
      "file imports, which the output would replace (no output of this "
      "command is Python source); give --out a path not ending in .py.")
  # a clash with an input is named first, as before
  with pytest.raises(ValueError, match="is the file --config reads"):
    distinct_paths.check_distinct_paths([("--out", helper)],
                                        [("--config", helper)])
  distinct_paths.check_distinct_paths([("--out", helper + "on")])  # .pyon


def test_a_link_to_a_module_or_to_an_input_is_refused(tmp_path):
  """A link's target is what gets written: chart.png -> helper.py was
  followed and the module overwritten."""
  config, helper = tmp_path / "c.py", tmp_path / "helper.py"
  config.write_text("def get_config(): ...\n")
  helper.write_text("X = 1\n")
  chart = tmp_path / "chart.png"
  chart.symlink_to(helper)
  with pytest.raises(ValueError) as e:
    distinct_paths.check_distinct_paths([("--png", str(chart))])
  assert str(e.value).startswith(
      f"--png {str(chart)!r} is a link to {str(helper)!r}, which ends in "
      ".py: it may be a Python module"), e.value
  assert str(e.value).endswith("give --png a path not ending in .py.")
  other = tmp_path / "other.png"
  other.symlink_to(config)
  with pytest.raises(ValueError, match="is the file --config reads"):
    distinct_paths.check_distinct_paths([("--png", str(other))],
                                        [("--config", str(config))])
  png = tmp_path / "real.png"  # a link to a file not ending in .py passes
  (tmp_path / "link.png").symlink_to(png)
  distinct_paths.check_distinct_paths([("--png", str(tmp_path / "link.png"))])


def test_predict_png_linked_to_a_module_leaves_the_module(tmp_path, capsys):
  helper = tmp_path / "helper.py"
  helper.write_text("X = 1\n")
  (tmp_path / "chart.png").symlink_to(helper)
  code = cli.main(["predict", "--n-workers", "16", "--png",
                    str(tmp_path / "chart.png")])
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: --png ") and "is a link to" in err[-1]
  assert helper.read_text() == "X = 1\n"


def test_measure_out_over_a_module_the_config_imports_is_refused(
    tmp_path, capsys, monkeypatch):
  from decentral_jax.tools.runtime_model_cli import measure  # pylint: disable=import-outside-toplevel
  def no_measure(*a, **k):
    raise AssertionError("measured: --out was accepted")
  monkeypatch.setattr(measure, "measure", no_measure)
  cfg, helper = _config_importing_a_helper(tmp_path, monkeypatch)
  code = cli.main(["measure", "--config", str(cfg), "--out", str(helper),
                   "--repeats", "2"])
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      f"error: --out {str(helper)!r} ends in .py"), err
  assert helper.read_text() == "N_LAYER = 1\n"


def test_learners_json_over_a_module_the_config_imports_is_refused(
    tmp_path, capsys, monkeypatch):
  from decentral_jax.tools import cli as main_cli  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  def start(*a, **k):
    raise AssertionError("Ray started: --json was accepted")
  monkeypatch.setattr(cluster, "start", start)
  cfg, helper = _config_importing_a_helper(tmp_path, monkeypatch)
  code = main_cli.main([
      "learners", "--learners", "2", "--config", str(cfg),
      *(f"--config.{o}" for o in (
          "algorithm=diloco", "optimizer.name=adamw",
          "optimizer.accum_steps=1", "global_batch=4", "sync_every=3",
          "steps=6", "schedule.warmup_steps=2")), "--json", str(helper)])
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      f"error: --json {str(helper)!r} ends in .py"), err
  assert helper.read_text() == "N_LAYER = 1\n"


def test_a_file_in_an_output_directory_or_a_directory_over_a_file(tmp_path):
  d = str(tmp_path / "ckpt")
  for out in (d, os.path.join(d, "a", "log.json"), d + "/"):
    with pytest.raises(ValueError) as e:
      distinct_paths.check_distinct_paths(
          [("--json", out)], dirs=[("--checkpoint-dir", d)])
    assert str(e.value).startswith(
        f"--json {out!r} lies in the directory {d!r} of --checkpoint-dir")
  rec = str(tmp_path / "metrics.jsonl")
  with pytest.raises(ValueError) as e:
    distinct_paths.check_distinct_paths(
        [], [("--workdir's metrics.jsonl", rec)], [("--checkpoint-dir", rec)])
  assert str(e.value).startswith(f"--checkpoint-dir {rec!r} is the file "
                                 "--workdir's metrics.jsonl reads or writes")
  # a sibling whose name only starts like the directory's is outside it
  distinct_paths.check_distinct_paths(
      [("--json", d + "2.json")], [("--config", rec)],
      [("--checkpoint-dir", d), ("--fixtures", None)])


@pytest.mark.parametrize("json_at, ckpt_at, says", [
    ("P", "P", "--json 'P' lies in the directory 'P' of --checkpoint-dir"),
    (None, "W/metrics.jsonl", "--checkpoint-dir 'W/metrics.jsonl' is the "
     "file --workdir's metrics.jsonl reads or writes"),
    ("W/checkpoints", None, "--json 'W/checkpoints' lies in the directory "
     "'W/checkpoints' of --workdir's checkpoints")])
def test_learners_directory_clashes_are_refused_before_ray(
    tmp_path, capsys, json_at, ckpt_at, says):
  from decentral_jax.tools.learners import main as learners  # pylint: disable=import-outside-toplevel
  (tmp_path / "W").mkdir()
  argv = ["--config", "gpt_quick", "--config.algorithm=diloco",
          "--workdir", str(tmp_path / "W")]
  if json_at:
    argv += ["--json", str(tmp_path / json_at)]
  if ckpt_at:
    argv += ["--checkpoint-dir", str(tmp_path / ckpt_at)]
  assert learners.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert err[0].replace(str(tmp_path) + "/", "").startswith(
      "error: " + says), err
  assert sorted(os.listdir(tmp_path / "W")) == []


def test_learners_records_refused_after_ray_starts_are_one_line(
    monkeypatch, capsys):
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import main as learners  # pylint: disable=import-outside-toplevel
  closed = []

  class Cluster:  # no Ray: the records refuse before any learner starts
    def __init__(self, *a):
      pass

    def close(self):
      closed.append(True)

  def refuse(*a):
    raise ValueError("--workdir 'W': metrics.jsonl is a directory; remove it.")
  monkeypatch.setattr(cluster, "start", lambda *a, **k: None)
  monkeypatch.setattr(cluster, "Cluster", Cluster)
  monkeypatch.setattr(learners, "_open_records", refuse)
  assert learners.main(["--periods", "2"]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "error: --workdir 'W': metrics.jsonl is a directory; remove it."]
  assert closed == [True]
