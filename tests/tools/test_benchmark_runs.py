"""Benchmark scripts refuse, in one ``error:`` line and exit code 2 before
any work, what they could not finish: more workers than the environment's
simulated CPU devices, a global batch the workers cannot share, and write
an output given as a bare file name into the current directory."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402  pylint: disable=wrong-import-position


def test_more_workers_than_the_environment_simulates_is_one_line(capsys):
  """--n_workers 16 under XLA_FLAGS' 8 devices ended in make_mesh's
  ValueError traceback."""
  have = jax.local_device_count()  # tests/conftest.py: 8
  with pytest.raises(SystemExit) as e:
    _common.check_cpu_devices(have + 8, f"--n_workers={have + 8}")
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: the environment (XLA_FLAGS="), err
  assert (f"simulates {have} CPU devices in this process, but --n_workers="
          f"{have + 8} needs {have + 8}; raise its count to {have + 8}, "
          "unset it, or lower --n_workers.") in err[0]
  _common.check_cpu_devices(have, f"--n_workers={have}")  # enough: passes


def test_a_bad_jax_num_cpu_devices_is_named(capsys, monkeypatch):
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "x")
  with pytest.raises(SystemExit) as e:
    _common.check_cpu_devices(2, "--workers=2")
  assert e.value.code == 2
  assert capsys.readouterr().err.startswith(
      "error: the environment variable JAX_NUM_CPU_DEVICES='x' must be")


@pytest.mark.slow
def test_bench_communication_refuses_before_any_work():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  r = subprocess.run([sys.executable, os.path.join(
      ROOT, "benchmarks", "bench_communication.py"), "--n_workers", "16"],
                     env=env, capture_output=True, text=True, timeout=300,
                     check=False)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "Traceback" not in r.stderr and "machine:" not in r.stdout
  assert "but --n_workers=16 needs 16" in r.stderr


def test_an_output_given_as_a_bare_file_name_goes_in_the_current_dir(
    tmp_path, monkeypatch):
  """bench_vs_decentdp --out vs.jsonl and bench_step_time --json step.json
  raised FileNotFoundError from os.makedirs('') (the latter after all its
  timing work)."""
  monkeypatch.chdir(tmp_path)
  _common.make_parent_dir("vs.jsonl")  # no error, nothing made
  assert os.listdir(tmp_path) == []
  _common.make_parent_dir(os.path.join("a", "b", "step.json"))
  assert os.path.isdir(tmp_path / "a" / "b")


def test_no_benchmark_makes_an_output_folder_by_hand():
  """Every output folder is made by _common.make_parent_dir, which takes a
  bare file name."""
  bad = []
  for folder in ("benchmarks", os.path.join("benchmarks", "studies")):
    for name in sorted(os.listdir(os.path.join(ROOT, folder))):
      if name.endswith(".py") and name != "_common.py":
        with open(os.path.join(ROOT, folder, name)) as f:
          if "makedirs(os.path.dirname(" in f.read():
            bad.append(name)
  assert not bad, bad
