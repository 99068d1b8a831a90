"""README's GPU quick start, run on CPU as far as a CPU can.

The commands are read from README's "GPU quick start" block, so the test
runs what a user copies. The install line must name requirements.txt and
JAX's CUDA 12 extra at the pinned JAX version; ``gpu_check.sh`` must reach
its flags (``--help``) and, without a GPU, run its CPU smoke version
(``integration``). The two training commands' configs must pass the
runner's checks with the README's fields (8 and 16 workers of 30
sequences, AER nodes of 4 and 8 workers), also with the memory controls of
docs/memory.md; in the ``integration`` tier both train on CPU: the one-host
command in one process of 8 simulated devices, the two-host command as two
processes of 8 on 127.0.0.1, each with a tiny model on token bins written
here (the paths, the host address and the model size are the only fields
replaced).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest

from decentral_jax.runner import config as config_lib
from decentral_jax.runner import metrics
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TINY = {"model.n_layer": "1", "model.n_embd": "16", "model.n_head": "2",
        "model.block_size": "16", "steps": "2", "eval_batches": "1",
        "eval_interval": "0", "log_interval": "1",
        "schedule.warmup_steps": "1", "checkpoint_interval": "0"}


def quickstart_commands() -> list[str]:
  """The README's GPU quick start block, one string per command."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text.split("## GPU quick start", 1)[1]
  block = section.split("```bash\n", 1)[1].split("```", 1)[0]
  lines = []
  for line in block.replace("\\\n", " ").splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      lines.append(line)
  return lines


def train_commands() -> list[list[str]]:
  out = [shlex.split(c) for c in quickstart_commands()
         if c.startswith("python experiments/train.py")]
  assert len(out) == 2  # one host, two hosts
  return out


def overrides(argv: list[str]) -> dict[str, str]:
  return dict(a[len("--config."):].split("=", 1) for a in argv
              if a.startswith("--config."))


def config_of(argv: list[str], extra=()):
  path = argv[argv.index("--config") + 1]
  fields = overrides(argv)
  fields["data.path"] = os.path.join(ROOT, "tests", "fixtures")  # any dir
  return config_lib.load_config(
      os.path.join(ROOT, path), [f"{k}={v}" for k, v in fields.items()]
      + list(extra))


def test_install_line_names_requirements_and_the_cuda_extra():
  install = quickstart_commands()[0]
  assert install == 'pip install -r requirements.txt "jax[cuda12]"'
  with open(os.path.join(ROOT, "requirements-lock.txt")) as f:
    pins = dict(line.strip().split("==") for line in f if "==" in line)
  # jax[cuda12] resolves against the pinned jax and jaxlib, which agree.
  assert pins["jax"] == pins["jaxlib"]


@pytest.mark.slow  # a second process
def test_gpu_check_reaches_its_flags():
  assert "bash benchmarks/gpu_check.sh" in quickstart_commands()
  out = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=run_env())
  assert out.returncode == 0, out.stderr[-2000:]
  assert "--deviceless" in out.stdout and "--smoke" in out.stdout


@pytest.mark.parametrize("extra", [
    (), ("micro_batches=5", "model.remat=block"),
    ("micro_batches=15", "model.remat=block", "model.param_dtype=bfloat16")])
def test_both_training_commands_pass_the_runner_checks(extra):
  one, two = train_commands()
  for argv, workers, per_node in ((one, 8, 4), (two, 16, 8)):
    c = config_of(argv, extra)
    validation.check_config(c)
    assert int(c.n_workers) == workers and int(c.workers_per_node) == per_node
    assert int(c.global_batch) // workers == 30 and c.model.block_size == 1024
    assert c.topology == "alternating_exp_ring"
  assert config_of(two).distributed.enabled
  assert int(config_of(two).distributed.num_processes) == 2


def token_bins(directory) -> str:
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  for name, size in (("train.bin", 200_000), ("val.bin", 20_000)):
    rng.integers(0, 50257, size, dtype=np.uint16).tofile(
        os.path.join(directory, name))
  return str(directory)


def cpu_command(argv, workdir: str, **replace) -> list[str]:
  """``argv`` for CPU: a tiny model, and the fields in ``replace``."""
  fields = {**overrides(argv), **TINY, **replace}
  head = [a for a in argv[1:] if not a.startswith("--config.")]
  head[head.index("--workdir") + 1] = workdir
  return [sys.executable] + head + [f"--config.{k}={v}"
                                    for k, v in fields.items()]


def run_env():
  """CPU, this checkout, and this interpreter first on PATH (an activated
  environment: gpu_check.sh calls `python`); without the suite's own
  simulated-device count, which the runner keeps (each process then
  simulates as many devices as its config needs, as on a user's host)."""
  path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
  flags = " ".join(t for t in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in t)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "PATH": path, "XLA_FLAGS": flags}
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return env


@pytest.mark.integration
def test_gpu_check_runs_its_cpu_smoke_version():
  out = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT,
                       capture_output=True, text=True, timeout=320,
                       env=run_env())
  assert out.returncode == 0, out.stderr[-2000:]
  assert "no GPU visible to JAX: CPU smoke run" in out.stdout


@pytest.mark.integration
def test_one_host_command_trains_on_cpu(tmp_path):
  one, _ = train_commands()
  work = str(tmp_path / "run")
  cmd = cpu_command(one, work,
                    **{"data.path": token_bins(tmp_path / "owt")})
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=run_env())
  assert out.returncode == 0, out.stderr[-3000:]
  records = metrics.read_jsonl(os.path.join(work, metrics.METRICS_FILE))
  assert records[-1]["step"] == 2 and np.isfinite(records[-1]["train/loss"])


@pytest.mark.integration
def test_two_host_command_trains_as_two_cpu_processes(tmp_path):
  _, two = train_commands()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  address = overrides(two)["distributed.coordinator_address"]
  assert re.fullmatch(r"HOST0:\d+", address)
  work, data = str(tmp_path / "run"), token_bins(tmp_path / "owt")
  procs = [subprocess.Popen(
      cpu_command(two, work, **{
          "data.path": data, "distributed.process_id": str(i),
          "distributed.coordinator_address": f"127.0.0.1:{port}"}),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=run_env(), start_new_session=True) for i in (1, 0)]
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  records = metrics.read_jsonl(os.path.join(work, metrics.METRICS_FILE))
  assert records[-1]["step"] == 2 and np.isfinite(records[-1]["train/loss"])


@pytest.mark.slow  # a second process
def test_the_two_host_command_names_missing_data_before_it_waits_to_join(
    tmp_path):
  """Without its token bins a process refuses in one line at once, before
  it waits (up to 120 s) for the other host to join."""
  argv = train_commands()[1]
  argv = [a.replace("/shared/runs/owt", str(tmp_path / "run")).replace(
      "/shared/data/openwebtext", str(tmp_path / "none")) for a in argv]
  out = subprocess.run(
      [sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
      timeout=60, env={**os.environ, "PYTHONPATH": ROOT,
                       "JAX_PLATFORMS": "cpu"})
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert out.returncode == 2 and errors == [
      f"error: token directory '{tmp_path / 'none'}' does not exist; set "
      "--config.data.path= a directory with nanoGPT's train.bin and val.bin "
      "(made by nanoGPT's data/openwebtext/prepare.py)."], out.stderr[-2000:]
  assert "joining a 2-process JAX job" not in out.stderr
