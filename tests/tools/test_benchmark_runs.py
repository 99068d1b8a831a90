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


@pytest.mark.parametrize("script", [
    pytest.param("bench_convergence", marks=pytest.mark.slow),
    "bench_step_time", pytest.param("bench_new_methods",
                                    marks=pytest.mark.slow)])
def test_a_script_of_a_fixed_count_names_itself_under_too_few_devices(
    script):
  """Scripts that simulate a fixed count at import (8 or 16) kept an
  environment's lower count and ended in make_mesh's traceback."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  env.pop("JAX_NUM_CPU_DEVICES", None)
  got = subprocess.run([sys.executable, os.path.join(
      ROOT, "benchmarks", f"{script}.py")], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
  need = 16 if script == "bench_convergence" else 8
  assert got.returncode == 2, got.stderr[-2000:]
  assert got.stderr.strip().splitlines()[-1] == (
      "error: the environment (XLA_FLAGS='--xla_force_host_platform_device_"
      f"count=2') simulates 2 CPU devices in this process, but {script}.py "
      f"needs {need}; raise its count to {need} or unset it."), got.stderr


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


@pytest.mark.parametrize("n", ["1", "3", "5", "6", "12", "8192"])
def test_bench_communication_worker_count_is_a_power_of_two(n, capsys):
  """--n_workers 1, 3, 6 passed the flag and ended in a traceback after JAX
  started (a 2-per-node mesh, one_peer_exp): refused at parse, one line."""
  import bench_communication  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    bench_communication.parse_args(["--n_workers", n])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "error: argument --n_workers: must be a power of two in [2, 4096], "
      f"got '{n}' (see {os.path.basename(sys.argv[0])} --help)"]


def test_bench_communication_builds_every_row_at_each_accepted_count():
  """Each power of two the flag accepts (2, 4, ..., 4096, by hand) builds
  every row's topology and 2-per-node mesh (NumPy only)."""
  import bench_communication  # pylint: disable=import-outside-toplevel
  from decentral_jax import topology  # pylint: disable=import-outside-toplevel
  for n in [2 ** k for k in range(1, 13)]:
    assert bench_communication.parse_args(["--n_workers", str(n)]).n_workers \
        == n
    for _, _, name, local, _, _ in bench_communication.cases(n):
      assert n % max(local, 2) == 0  # the node column: 2 workers per node
      if name and n <= 64:  # building 4096-worker topologies takes seconds
        topology.make(name, n, local)


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


# The scripts set XLA_FLAGS when imported: loaded in a child process with
# that stubbed, each argv parsed (nothing runs); prints [code, stderr].
_PARSE_CHILD = r"""
import contextlib, importlib.util, io, json, os, sys
bench, name, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, bench)
import _common
_common.set_cpu_devices = lambda *a, **k: None
spec = importlib.util.spec_from_file_location(name, os.path.join(
    bench, name + ".py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
out = []
for args in argv:
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      module.parse_args(args)
      code = 0
    except SystemExit as e:
      code = e.code
  out.append([code, err.getvalue().strip().splitlines()])
print(json.dumps(out))
"""


def _parse(name: str, argvs: list, tmp_path) -> list:
  import json
  r = subprocess.run(
      [sys.executable, "-c", _PARSE_CHILD, os.path.join(ROOT, "benchmarks"),
       name, json.dumps(argvs)], capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
      cwd=tmp_path, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  rows = json.loads(r.stdout.strip().splitlines()[-1])
  # one line each; the parser adds "(see PROG --help)"
  return [[code, [e.split(" (see ")[0] for e in err]] for code, err in rows]


@pytest.mark.slow  # two processes
def test_a_global_batch_the_workers_cannot_share_is_one_line(tmp_path):
  """bench_convergence --global_batch 7 and bench_evidence --part scale
  --workers 3 ended in validation.py's traceback naming
  --config.global_batch, a flag these scripts do not have."""
  out = str(tmp_path / "o.jsonl")
  conv = _parse("bench_convergence", [
      ["--global_batch", "7", "--plan", "8", "--out", out],
      ["--global_batch", "24", "--out", out],  # 8 divides it, 16 does not
      ["--global_batch", "24", "--plan", "8", "--out", out],
      ["--global_batch", "48", "--out", out]], tmp_path)
  assert conv[0] == [2, [
      "error: --global_batch 7 is not divisible by the worker counts of "
      "--plan 8 (8; the global batch is split evenly across workers); use "
      "e.g. --global_batch 8 or 16."]]
  assert conv[1] == [2, [
      "error: --global_batch 24 is not divisible by the worker counts of "
      "--plan full (8, 16; the global batch is split evenly across "
      "workers); use e.g. --global_batch 16 or 32."]]
  assert conv[2] == [0, []] and conv[3] == [0, []]
  ev = _parse("bench_evidence", [
      ["--part", "scale", "--workers", "8", "3", "--out", out],
      ["--part", "scale", "--workers", "1", "64", "--out", out],
      ["--part", "main", "--out", out]], tmp_path)
  assert ev[0] == [2, [
      "error: --workers 3: --part scale splits its global batch of 64 "
      "sequences evenly across the workers; give worker counts that divide "
      "it (1, 2, 4, 8, 16, 32, 64)."]]
  assert ev[1] == [0, []] and ev[2] == [0, []]


@pytest.mark.parametrize("variable, value, message", [
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=abc",
     "error: XLA_FLAGS' --xla_force_host_platform_device_count='abc' must be "
     "a whole number in [1, 1024]; fix it or drop it from XLA_FLAGS."),
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=0",
     "error: XLA_FLAGS' --xla_force_host_platform_device_count='0' must be "
     "a whole number in [1, 1024]; fix it or drop it from XLA_FLAGS."),
    ("JAX_NUM_CPU_DEVICES", "x",
     "error: the environment variable JAX_NUM_CPU_DEVICES='x' must be a "
     "whole number in [1, 1024]; fix or unset it."),
])
def test_set_cpu_devices_checks_the_environment_s_count(variable, value,
                                                        message):
  """A count kept from the environment was not checked: 'abc' made XLA
  abort printing its flag list, 0 ended in a JAX traceback."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         variable: value}
  child = ("import sys; sys.path.insert(0, sys.argv[1]); import _common; "
           "_common.set_cpu_devices(4); print('jax' in sys.modules)")
  got = subprocess.run([sys.executable, "-c", child,
                        os.path.join(ROOT, "benchmarks")], env=env,
                       capture_output=True, text=True, timeout=300,
                       check=False)
  assert got.returncode == 2 and got.stdout == "", (got.stdout, got.stderr)
  assert got.stderr.strip().splitlines() == [message], got.stderr
