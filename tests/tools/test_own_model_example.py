"""experiments/own_model.py: a model and data defined outside the package
(experiments/mixer.py, read through Grain) train, resume bit-exactly and are
priced by the runtime model; its config also runs through the train command."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import require_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
EXAMPLE = os.path.join(ROOT, "experiments", "own_model.py")


def _load():
  spec = importlib.util.spec_from_file_location("own_model", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_own_model_trains_resumes_bit_exactly_and_is_priced(tmp_path):
  require_devices(4)
  out = _load().main(["--workdir", str(tmp_path), "--steps", "16",
                      "--n-workers-priced", "8"])
  assert out["bit_exact"]
  straight, resumed = out["straight"], out["resumed"]
  assert straight["eval/loss"] == resumed["eval/loss"]
  # Four classes: chance is log 4 = 1.386 nats and accuracy 0.25.
  assert straight["eval/loss"] < 1.2 and straight["eval/accuracy"] > 0.4
  lines = [json.loads(s) for s in open(tmp_path / "straight" /
                                       "metrics.jsonl")]
  assert lines[0]["step"] == 0 and "eval/loss" in lines[0]
  assert lines[0]["eval/loss"] > straight["eval/loss"]
  text = out["pricing"]
  assert f"workload: {out['param_count']:,} parameters" in text
  assert re.search(r"dadam:topology=one_peer_exp +[0-9.]+ +[0-9.]+ +"
                   r"[0-9.]+x", text), text


@pytest.mark.slow
def test_own_model_config_runs_through_the_train_command(tmp_path):
  module = _load()
  data = tmp_path / "data"
  sys.path.insert(0, os.path.dirname(EXAMPLE))
  try:
    import mixer  # pylint: disable=import-outside-toplevel
    mixer.write_stripes(str(data), n_train=256, n_eval=64)
  finally:
    sys.path.remove(os.path.dirname(EXAMPLE))
  del module
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
       "--config", EXAMPLE, "--workdir", str(tmp_path / "run"),
       f"--config.data.options.path={data}", "--config.steps=4",
       "--config.eval_batches=1", "--config.checkpoint_interval=4"],
      capture_output=True, text=True, cwd=ROOT, timeout=600,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  lines = [json.loads(s) for s in open(tmp_path / "run" / "metrics.jsonl")]
  assert lines[-1]["step"] == 4 and "eval/accuracy" in lines[-1]


@pytest.mark.parametrize("args, message", [
    # Accepted: a run of 1e11 steps, or a price at a NaN forward time after
    # the whole training.
    (["--steps", "99999999999"], "--steps=99999999999 must be a whole "
     "number in [2, 2147483647]"),
    (["--steps", "1"], "--steps=1 must be a whole number in [2, "),
    (["--forward-ms", "nan"], "--forward-ms=nan must be a time in [0, 5e5]"),
    (["--forward-ms", "-1"], "--forward-ms=-1.0 must be a time in [0, 5e5]"),
    # Trained both runs (~30 s), then a traceback from predict.
    (["--n-workers-priced", ""], "argument --n-workers-priced: '': entry 1 "
     "is empty"),
    (["--n-workers-priced", "8,8"], "argument --n-workers-priced: '8,8': "
     "entry 2 repeats entry 1 (8)"),
    (["--n-workers-priced", "0"], "--n-workers-priced 0 is outside [1, "
     "4096]"),
    (["--n-workers-priced", "99999999"], "--n-workers-priced 99999999 is "
     "outside [1, 4096]"),
    # The A40 preset holds 4 GPUs per node.
    (["--n-workers-priced", "6"], "--n-workers-priced 6 with --preset A40: "
     "local_size=4 must be a positive integer dividing n_workers=6"),
    (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    # argparse kept the last value.
    (["--steps", "4", "--steps", "8"],
     "--steps is given twice (--steps 4, then --steps 8); give it once."),
])
def test_bad_numeric_flags_are_one_error_line_before_any_work(
    args, message, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    _load().main(args + ["--workdir", str(tmp_path)])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].partition(" error: ")[2].startswith(message), err
  assert not os.listdir(tmp_path)  # no data written
  assert "(see " not in err[-1]  # predict's --help is not this script's


def test_an_empty_workdir_is_refused_before_any_work(capsys, tmp_path,
                                                      monkeypatch):
  monkeypatch.chdir(tmp_path)  # wrote data/, straight/, resumed/ here
  with pytest.raises(SystemExit) as e:
    _load().main(["--workdir", ""])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].partition(" error: ")[2].startswith("--workdir is empty")
  assert not os.listdir(tmp_path)


def test_a_count_the_method_cannot_take_is_said_in_this_script_s_flags(
    capsys, tmp_path):
  """Named --methods and advised 'exponential': flags this script lacks.
  12 is no power of two; the ones beside it are 8 and 16."""
  with pytest.raises(SystemExit) as e:
    _load().main(["--n-workers-priced", "12", "--workdir", str(tmp_path)])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].partition(" error: ")[2] == (
      "--n-workers-priced 12: this script's method "
      "dadam:topology=one_peer_exp (its get_config()) cannot be priced at "
      "12 workers: topology 'one_peer_exp' needs n_workers to be a power of "
      "two, got 12; the nearest valid values are 8 and 16; give other "
      "--n-workers-priced counts."), err


@pytest.mark.parametrize("name", ["afile", "/dev/null"])
def test_a_workdir_naming_a_file_is_refused_before_any_work(
    name, capsys, tmp_path):
  """Was a NotADirectoryError traceback after JAX started."""
  (tmp_path / "afile").write_text("x")
  path = name if name.startswith("/") else str(tmp_path / name)
  with pytest.raises(SystemExit) as e:
    _load().main(["--workdir", path])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].partition(" error: ")[2] == (
      f"--workdir {path!r} is a file, not a directory; give a directory (it "
      "is created if missing).")
  assert os.listdir(tmp_path) == ["afile"]


@pytest.mark.slow  # writes ArrayRecord files: grain (requirements-extras.txt)
def test_a_preempted_run_is_one_line_and_its_signal_exit_code(
    capsys, tmp_path, monkeypatch):
  """SIGTERM ended in a traceback of ``Preempted``."""
  import signal  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import train  # pylint: disable=import-outside-toplevel

  def stopped(config, workdir):
    raise train.Preempted(3, signal.SIGTERM, os.path.join(workdir, "ckpt"))
  monkeypatch.setattr(train, "train_and_evaluate", stopped)
  with pytest.raises(SystemExit) as e:
    _load().main(["--workdir", str(tmp_path), "--steps", "8"])
  assert e.value.code == 128 + 15  # as a shell reports SIGTERM
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("preempted: "), err


@pytest.mark.slow  # trains twice
def test_the_same_command_again_resumes_and_fewer_steps_are_one_line(
    capsys, tmp_path):
  """The half run found the full run's checkpoint: a ValueError
  traceback naming --config.steps, not a flag of this script."""
  require_devices(4)
  argv = ["--workdir", str(tmp_path), "--steps", "4",
          "--n-workers-priced", "8"]
  first = _load().main(argv)
  again = _load().main(argv)  # nothing left to train: the same answers
  assert again["bit_exact"] and first["bit_exact"]
  assert again["straight"]["eval/loss"] == first["straight"]["eval/loss"]
  assert again["resumed"]["eval/loss"] == first["resumed"]["eval/loss"]
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    _load().main(["--workdir", str(tmp_path), "--steps", "2"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == (
      f"error: --workdir '{tmp_path}' holds a straight run trained to step "
      "4, past --steps 2; give --steps 4 or more (the same command resumes) "
      "or a new --workdir."), err
