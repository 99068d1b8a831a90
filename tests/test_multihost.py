"""Multi-process jobs: 2 processes x 4 CPU devices on 127.0.0.1 (gloo).

Each test launches ``tests/multihost_worker.py`` twice (process ids 0 and 1)
as a real 2-process JAX job and compares it with an independent reference:
the same configs trained in this pytest process on 8 of its devices (one
process). Per-worker parameters and losses must agree to float32 rounding,
the checkpoint written by both processes must restore to the same
parameters, and a process that dies mid-run must make the other one exit
with an error within a bounded time.

Every launched process runs in its own session and is killed (process group)
when the test ends, passes or fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import multihost_worker as worker
from conftest import require_devices
from decentral_jax import metrics
from decentral_jax import train

HERE = os.path.dirname(os.path.abspath(__file__))
N = worker.N_PROCESSES * worker.DEVICES_PER_PROCESS
CASES = tuple(worker.CASES)  # one_peer_exp, all_reduce, aer
JOB_TIMEOUT_S = 200


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict[str, str]:
  env = dict(os.environ)
  flags_ = [f for f in env.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f]
  flags_.append("--xla_force_host_platform_device_count="
                f"{worker.DEVICES_PER_PROCESS}")
  env.update(XLA_FLAGS=" ".join(flags_), JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [worker.ROOT, HERE, env.get("PYTHONPATH", "")]).rstrip(
                     os.pathsep))
  return env


@contextlib.contextmanager
def launch(out, *args: str):
  """Starts the 2 processes of one job; kills what is left on exit."""
  port, procs = free_port(), []
  try:
    for pid in range(worker.N_PROCESSES):
      log = open(os.path.join(out, f"p{pid}.log"), "wb")
      procs.append(subprocess.Popen(
          [sys.executable, os.path.join(HERE, "multihost_worker.py"),
           "--out", str(out), "--port", str(port), "--process_id", str(pid),
           *args], env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True))
      log.close()
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def wait_all(procs, out, timeout_s: float) -> list[int]:
  deadline = time.monotonic() + timeout_s
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      pytest.fail(f"the 2-process job did not finish in {timeout_s:.0f} s; "
                  f"logs:\n{logs(out)}")
  return [p.returncode for p in procs]


def logs(out) -> str:
  text = []
  for pid in range(worker.N_PROCESSES):
    path = os.path.join(out, f"p{pid}.log")
    if os.path.exists(path):
      with open(path, encoding="utf-8", errors="replace") as f:
        lines = [l for l in f.read().splitlines() if "[Gloo]" not in l]
      text.append(f"--- process {pid} ---\n" + "\n".join(lines[-30:]))
  return "\n".join(text)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """The 2-process job (all cases) and the 1-process references, side by side.

  The job runs in the background while this process computes the references
  on its first 8 devices with the same code path (``worker.run_case``).
  """
  devices = require_devices(N)
  out = tmp_path_factory.mktemp("multihost")
  ref_dir = tmp_path_factory.mktemp("reference")
  args = [a for case in CASES for a in ("--case", case)]
  with launch(out, *args) as procs:
    t0 = time.monotonic()
    reference = {}
    for case in CASES:
      config = worker.case_config(case)
      exp = train.Experiment(config, devices=devices)
      reference[case] = worker.run_case(config, str(ref_dir / case), exp)
    codes = wait_all(procs, out, JOB_TIMEOUT_S - (time.monotonic() - t0))
  assert codes == [0, 0], logs(out)
  results = {}
  for case in CASES:
    parts = [dict(np.load(out / f"{case}_p{p}.npz"))
             for p in range(worker.N_PROCESSES)]
    results[case] = parts
  return out, results, reference


def assert_close(actual, expected, what):
  np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-6,
                             err_msg=what)


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one_process(job, case):
  """Per-worker params and losses of 2 x 4 devices == 1 x 8 devices."""
  _, results, reference = job
  ref = reference[case]
  assert ref["losses"].shape == (worker.STEPS, N)
  # Every worker learns and the workers differ (so the comparison is per
  # worker, not of 8 copies of one model).
  assert np.all(ref["losses"][-1] < ref["losses"][0] - 0.05)
  keys = sorted(k for k in ref if k.startswith("param/"))
  assert keys
  if case != "all_reduce":
    assert np.ptp(ref[keys[0]], axis=0).max() > 1e-6
  for pid, part in enumerate(results[case]):
    workers = np.arange(pid * 4, pid * 4 + 4)
    np.testing.assert_array_equal(part["workers"], workers)
    # Both processes see every worker's loss (gathered), equal to the ref.
    assert_close(part["losses"], ref["losses"], f"{case} losses, p{pid}")
    assert sorted(k for k in part if k.startswith("param/")) == keys
    for k in keys:
      assert part[k].shape == ref[k][workers].shape, k
      assert_close(part[k], ref[k][workers], f"{case} {k}, process {pid}")
      # The checkpoint written by both processes restores bit-exactly.
      np.testing.assert_array_equal(part[k.replace("param/", "restored/")],
                                    part[k], err_msg=f"{case} restore {k}")
    assert_close(part["eval_loss"], ref["eval_loss"], f"{case} eval loss")
    assert part["eval_loss_restored"] == part["eval_loss"]


def test_only_process_zero_writes_metrics(job):
  """One metrics.jsonl (from process 0) with the job's losses, one config."""
  out, _, reference = job
  for case in CASES:
    records = metrics.read_jsonl(str(out / case / "metrics.jsonl"))
    # train at steps 5 and 10, then the re-run's final evaluation only
    # (returned, not written): no duplicate lines from process 1.
    assert [r["step"] for r in records] == [5, 10], records
    loss_10 = records[-1]["train/loss"]
    # The mean over workers of steps 6..10 (log_interval 5).
    expected = float(np.mean(reference[case]["losses"][5:10]))
    assert loss_10 == pytest.approx(expected, rel=1e-5)
    assert os.path.exists(out / case / "config.json")


@pytest.mark.parametrize("dying", [1, 0], ids=["worker", "coordinator"])
def test_a_dying_process_stops_the_job(tmp_path, dying):
  """One process exits at step 3 of 200; the other must fail, not hang."""
  other = 1 - dying
  with launch(tmp_path, "--case", "one_peer_exp", "--steps", "200",
              "--die_at", "3", "--die_process", str(dying),
              "--heartbeat", "5") as procs:
    codes = wait_all(procs, tmp_path, 120)
    ended = time.time()
  assert codes[dying] == 17, logs(tmp_path)
  assert codes[other] != 0, logs(tmp_path)
  with open(tmp_path / "died_at", encoding="utf-8") as f:
    died = float(f.read())
  # Bounded: within a few heartbeat timeouts (5 s), far from a hang.
  assert ended - died < 60, (ended - died, logs(tmp_path))
  assert not os.path.exists(tmp_path / f"one_peer_exp_p{other}.npz")
