"""Multi-process jobs: 2 processes x 4 CPU devices on 127.0.0.1 (gloo).

The jobs are real 2-process JAX jobs: ``tests/runner/multihost_worker.py`` (or the
``experiments/train.py`` command line under SLURM variables) started once
per process id. The reference is independent of the multi-process code: the
same configs trained in this pytest process on 8 of its devices. Per-worker
parameters and losses must agree to float32 rounding (one_peer_exp and
All-Reduce on a 1-D mesh, AER with each process one node, DiLoCo with its
global parameters theta, stopped and resumed inside a sync window, and 4
workers of 2 devices each with their state split over them), checkpoints
written by both processes must restore, layout mismatches must be clear
errors, and a process killed mid-run must make the other one exit with an
error within a bounded time. Start-up refusals (configs or initial
parameters that differ between processes, a process that never starts, a
coordinator port already taken) must reach every process as one-line errors.
SIGTERM to both processes must save one checkpoint at the same step, and the
job started again must end exactly like the uninterrupted one.
A job with one process killed by SIGKILL, restarted as one process of 2
devices with 4 workers each, must resume from the newest checkpoint and end
bit for bit like a reference that switches layouts in memory (elastic
resume; the single-process layout changes are in
``tests/runner/test_elastic_resume.py``).

Every launched process runs in its own session and is killed (process group)
when the test ends, passes or fails.

The worker jobs share a JAX compilation cache in a fresh temporary directory
of this pytest session (``compile_cache``): the ``job`` fixture fills it and
later jobs of the same configs (SIGTERM and resume, the killed coordinator,
the start-up checks) read their executables from it instead of compiling
again. Nothing persists between sessions; the single-process reference
compiles its own.
"""

from __future__ import annotations

import contextlib
import json
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
from decentral_jax.runner import checkpoint
from decentral_jax.runner import checkpoint_files
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import metrics

HERE = os.path.dirname(os.path.abspath(__file__))
N = worker.N_PROCESSES * worker.DEVICES_PER_PROCESS
CASES = tuple(worker.CASES)  # one_peer_exp, all_reduce, aer, diloco, fsdp
JOB_TIMEOUT_S = 200

# Every test starts processes; the in-process checks of the same code are in
# tests/runner/test_launch.py.
pytestmark = pytest.mark.integration


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def free_slurm_port() -> int:
  """A free port that JAX's SLURM detection derives from a job id."""
  first = 65535 - 2**12 + 1  # JAX: port = job_id % 4096 + first
  for port in np.random.default_rng().permutation(2**12) + first:
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", int(port)))
      except OSError:
        continue
      return int(port)
  raise RuntimeError("no free port in the SLURM range")


def clean_env(devices_per_process: int | None = None) -> dict[str, str]:
  """This environment without SLURM variables or the 16-device flag."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  flags_ = [f for f in env.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f]
  if devices_per_process:
    flags_.append("--xla_force_host_platform_device_count="
                  f"{devices_per_process}")
  env.update(XLA_FLAGS=" ".join(flags_), JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [worker.ROOT, HERE, env.get("PYTHONPATH", "")]).rstrip(
                     os.pathsep))
  return env


@contextlib.contextmanager
def launch_processes(out, argv, env, pids=range(worker.N_PROCESSES)):
  """Starts ``argv(pid)`` with ``env(pid)`` for every process id (or those
  of ``pids``), each in its own session; kills the process groups left on
  exit."""
  procs = []
  try:
    for pid in pids:
      with open(os.path.join(out, f"p{pid}.log"), "wb") as log:
        procs.append(subprocess.Popen(
            argv(pid), env=env(pid), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def cache_env(env: dict[str, str], cache: str | None) -> dict[str, str]:
  """``env`` with the JAX compilation cache in ``cache`` (every compile)."""
  if cache:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return env


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> str:
  """This session's compilation cache of the worker jobs (starts empty)."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def launch(out, *args: str, cache: str | None = None):
  """The 2 processes of a ``multihost_worker.py`` job on a free port."""
  port = free_port()
  env = cache_env(clean_env(worker.DEVICES_PER_PROCESS), cache)
  script = os.path.join(HERE, "multihost_worker.py")
  return launch_processes(
      out, lambda pid: [sys.executable, script, "--out", str(out), "--port",
                        str(port), "--process_id", str(pid), *args],
      lambda pid: env)


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
def job(tmp_path_factory, compile_cache):
  """The 2-process job (all cases) and the 1-process references, side by side.

  The job runs in the background while this process computes the references
  on its first 8 devices with the same code path (``worker.run_case``).
  """
  devices = require_devices(N)
  out = tmp_path_factory.mktemp("multihost")
  ref_dir = tmp_path_factory.mktemp("reference")
  args = ["--check_errors"] + [a for case in CASES for a in ("--case", case)]
  with launch(out, *args, cache=compile_cache) as procs:
    t0 = time.monotonic()
    reference = {}
    for case in CASES:
      config = worker.case_config(case)
      exp = experiment_lib.Experiment(config, devices=devices)
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


RESTORED = {"param/": "restored/", "theta/": "restored_theta/"}


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one_process(job, case):
  """Per-worker params (and DiLoCo's theta) and losses of 2 x 4 devices ==
  1 x 8 devices."""
  _, results, reference = job
  ref = reference[case]
  n = int(worker.case_config(case).n_workers)
  per = n // worker.N_PROCESSES  # workers per process
  assert ref["losses"].shape == (worker.STEPS, n)
  # Every worker learns and the workers differ (so the comparison is per
  # worker, not of 8 copies of one model).
  assert np.all(ref["losses"][-1] < ref["losses"][0] - 0.05)
  keys = sorted(k for k in ref if k.startswith(tuple(RESTORED)))
  params = [k for k in keys if k.startswith("param/")]
  assert params
  if case != "all_reduce":
    assert np.ptp(ref[params[0]], axis=0).max() > 1e-6
  thetas = [k for k in keys if k.startswith("theta/")]
  assert bool(thetas) == (case == "diloco")
  for k in thetas:
    # theta: equal on all workers (to the all-reduce's rounding) and, one
    # inner step after the sync of step 9, not the workers' own models.
    assert np.ptp(ref[k], axis=0).max() < 1e-6, k
    own = ref[k.replace("theta/", "param/")]
    assert np.abs(ref[k] - own).max() > 1e-4, k
  # The reference trained straight; the job of an INTERRUPT_AT case
  # stopped after that checkpoint (inside a sync window) and resumed.
  assert ref["resumed_from"] == -1
  resumed = worker.INTERRUPT_AT.get(case, -1)
  if resumed != -1:  # not at a sync step, and a checkpoint step
    config = worker.case_config(case)
    assert resumed % config.sync_every and \
        resumed % config.checkpoint_interval == 0
  for pid, part in enumerate(results[case]):
    assert part["resumed_from"] == resumed
    workers = np.arange(pid * per, pid * per + per)
    np.testing.assert_array_equal(part["workers"], workers)
    # Each process read the training rows of its own workers only.
    np.testing.assert_array_equal(part["data_workers"], workers)
    # Both processes see every worker's loss (gathered), equal to the ref.
    assert_close(part["losses"], ref["losses"], f"{case} losses, p{pid}")
    assert sorted(k for k in part if k.startswith(tuple(RESTORED))) == keys
    for k in keys:
      assert part[k].shape == ref[k][workers].shape, k
      assert_close(part[k], ref[k][workers], f"{case} {k}, process {pid}")
      # The checkpoint written by both processes restores bit-exactly.
      prefix = k[:k.index("/") + 1]
      restored = RESTORED[prefix] + k[len(prefix):]
      np.testing.assert_array_equal(part[restored], part[k],
                                    err_msg=f"{case} restore {k}")
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


def test_layout_mismatch_is_a_clear_error(job):
  """AER with 2 workers per node on 4-device hosts; 4 workers on 8 devices;
  workers of 3 devices on 4-device hosts."""
  out, _, _ = job
  for pid in range(worker.N_PROCESSES):
    with open(out / f"errors_p{pid}.json", encoding="utf-8") as f:
      errors = json.load(f)
    aer = errors["aer_workers_per_node_2"]
    for part in ("config.topology='alternating_exp_ring'",
                 "config.workers_per_node=2", "4 devices",
                 "--config.workers_per_node=4"):
      assert part in aer, aer
    n = errors["n_workers_4"]
    for part in ("config.n_workers=4", "2-process job has 8 devices",
                 "--config.n_workers=8"):
      assert part in n, n
    assert "\n" not in aer + n
    # A worker of 3 devices would span the two 4-device hosts.
    d = errors["devices_per_worker_3"]
    for part in ("config.devices_per_worker=3", "4 devices of each process",
                 "span two hosts"):
      assert part in d, d


def read_records(path) -> list[dict]:
  """Complete lines of a metrics.jsonl that is being written."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    text = f.read()
  return [json.loads(line) for line in text.split("\n")[:-1] if line]


def wait_for_records(path, count: int, procs, out, timeout_s: float):
  """Polls ``path`` until it has ``count`` records (the job is training)."""
  deadline = time.monotonic() + timeout_s
  while len(records := read_records(path)) < count:
    if any(p.poll() is not None for p in procs):
      pytest.fail(f"a process ended early; logs:\n{logs(out)}")
    if time.monotonic() > deadline:
      pytest.fail(f"no {count} metric records in {timeout_s:.0f} s; "
                  f"logs:\n{logs(out)}")
    time.sleep(0.2)
  return records


def kill_and_expect_failure(procs, victim: int, out, bound_s: float = 60):
  """SIGKILLs process ``victim``; the other must exit non-zero in time."""
  os.killpg(procs[victim].pid, signal.SIGKILL)
  killed = time.monotonic()
  survivor = procs[1 - victim]
  try:
    code = survivor.wait(timeout=bound_s)
  except subprocess.TimeoutExpired:
    pytest.fail(f"process {1 - victim} still runs {bound_s:.0f} s after "
                f"process {victim} was killed; logs:\n{logs(out)}")
  assert code != 0, logs(out)
  return time.monotonic() - killed


def test_cli_under_slurm_then_a_killed_worker_stops_the_job(job, tmp_path):
  """``srun``-style start of experiments/train.py from SLURM variables only.

  Process 0 runs with ``--config.distributed.enabled=True`` and empty
  fields, process 1 without it (a multi-task srun step joins by itself);
  the CLI simulates 8 / 2 CPU devices per process. AER's nodes are the two
  processes. The first steps' losses (learning rates still equal to the
  10-step reference's) must match the 1-process run and only process 0
  reports. Then process 1 is killed (SIGKILL): process 0 must exit with an
  error within a bounded time instead of hanging.
  """
  _, _, reference = job
  port = free_slurm_port()
  workdir = tmp_path / "run"
  base = last_wins([
      sys.executable, os.path.join(worker.ROOT, "experiments", "train.py"),
      f"--config={os.path.join(worker.ROOT, 'configs', 'gpt_tiny.py')}",
      f"--workdir={workdir}", *worker.TINY, *worker.CASES["aer"],
      "--config.steps=100000", "--config.log_interval=1",
      "--config.distributed.heartbeat_timeout_seconds=5"])

  def env(pid):
    e = clean_env()
    e.update(SLURM_JOB_ID=str(port - (65535 - 2**12 + 1)),
             SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
             SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
             SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid))
    return e

  argv = lambda pid: base + (["--config.distributed.enabled=True"]
                             if pid == 0 else [])
  warm = 4  # steps 1..4 use learning rates of the warmup and the peak only
  with launch_processes(tmp_path, argv, env) as procs:
    records = wait_for_records(workdir / "metrics.jsonl", warm, procs,
                               tmp_path, JOB_TIMEOUT_S)
    kill_and_expect_failure(procs, 1, tmp_path)
  losses = reference["aer"]["losses"]
  assert [r["step"] for r in records[:warm]] == list(range(1, warm + 1))
  for r in records[:warm]:
    assert r["train/loss"] == pytest.approx(
        float(np.mean(losses[r["step"] - 1])), rel=1e-5), r
  with open(tmp_path / "p0.log", encoding="utf-8") as f:
    log0 = f.read()
  with open(tmp_path / "p1.log", encoding="utf-8") as f:
    log1 = f.read()
  assert "2 process(es)" in log0 and "mesh {'nodes': 2, 'local': 4}" in log0
  assert "step 1:" in log0 and "step 1:" not in log1
  assert "process(es)" not in log1


def test_a_killed_coordinator_stops_the_job(tmp_path, compile_cache):
  """Process 0 (the coordinator) is killed mid-run; process 1 must fail.

  The job's config is ``job``'s (its compiled steps are in the cache); the
  steps are slowed down (1 s each) so that it is killed with about 7 steps
  to go.
  """
  require_devices(1)
  with launch(tmp_path, "--case", "one_peer_exp", "--log_interval", "1",
              "--heartbeat", "5", "--step_delay", "1",
              cache=compile_cache) as procs:
    wait_for_records(tmp_path / "one_peer_exp" / "metrics.jsonl", 2, procs,
                     tmp_path, JOB_TIMEOUT_S)
    kill_and_expect_failure(procs, 0, tmp_path)


# ----------------------------------------------------------------------------
# Start-up checks: configs and initial parameters that differ between the
# processes, a process that never starts, a coordinator port already taken.
# ----------------------------------------------------------------------------

STARTUP_TIMEOUT_S = 60  # a refused start-up takes ~10 s on a loaded machine
JOIN_TIMEOUT_S = 5  # config.distributed.initialization_timeout_seconds


def last_wins(argv: list[str]) -> list[str]:
  """``argv`` with each ``--config.FIELD=`` override kept at its last
  place only (the command line refuses a field given twice)."""
  key = lambda a: a.partition("=")[0] if a.startswith("--config.") else None
  last = {key(a): i for i, a in enumerate(argv) if key(a)}
  return [a for i, a in enumerate(argv) if not key(a) or last[key(a)] == i]


def cli_argv(out, port: int, *extra: str):
  """``argv(pid)`` of experiments/train.py in a 2-process job on ``port``."""
  base = [sys.executable, os.path.join(worker.ROOT, "experiments", "train.py"),
          f"--config={os.path.join(worker.ROOT, 'configs', 'gpt_tiny.py')}",
          f"--workdir={out / 'run'}", *worker.TINY,
          *worker.CASES["one_peer_exp"], "--config.steps=5",
          "--config.distributed.enabled=True",
          f"--config.distributed.coordinator_address=127.0.0.1:{port}",
          f"--config.distributed.num_processes={worker.N_PROCESSES}",
          "--config.distributed.initialization_timeout_seconds="
          f"{JOIN_TIMEOUT_S}", *extra]
  return lambda pid: last_wins(
      base + [f"--config.distributed.process_id={pid}"])


def error_line(out, pid: int) -> str:
  """The one ``error: ...`` line of process ``pid``'s log."""
  with open(out / f"p{pid}.log", encoding="utf-8", errors="replace") as f:
    lines = [l for l in f.read().splitlines() if l.startswith("error: ")]
  assert len(lines) == 1, logs(out)
  return lines[0]


def test_startup_refusals_reach_every_process(tmp_path, compile_cache):
  """Different steps, initial params or a task failing on one host: every
  process raises (in step, so the job goes on to the next check)."""
  require_devices(1)
  with launch(tmp_path, "--case", "one_peer_exp", "--startup_checks",
              cache=compile_cache) as procs:
    assert wait_all(procs, tmp_path, STARTUP_TIMEOUT_S) == [0, 0], \
        logs(tmp_path)
  errors = []
  for pid in range(worker.N_PROCESSES):
    with open(tmp_path / f"startup_p{pid}.json", encoding="utf-8") as f:
      errors.append(json.load(f))
  for e in errors:
    assert "steps (process 0: 10, process 1: 20)" in e["steps"], e
    assert "different initial parameters" in e["init"], e
    assert "['wte']['embedding']" in e["init"], e
    assert e["same"] == "", e
    assert "\n" not in "".join(e.values())
  assert errors[0]["steps"] == errors[1]["steps"]
  assert errors[0]["init"] == errors[1]["init"]
  missing = "config.data.path='/data/x' does not exist"
  assert errors[1]["task"] == missing
  assert errors[0]["task"].startswith(
      f"process 1 of this job could not start (ValueError: {missing})")


def test_cli_with_different_configs_stops_both_processes(tmp_path):
  """Process 1 with another seed and peak_lr: both exit with one line."""
  require_devices(1)
  argv = cli_argv(tmp_path, free_port())
  differ = ["--config.seed=1", "--config.schedule.peak_lr=0.02"]
  with launch_processes(tmp_path,
                        lambda pid: last_wins(argv(pid) + differ * pid),
                        lambda pid: clean_env()) as procs:
    codes = wait_all(procs, tmp_path, STARTUP_TIMEOUT_S)
  assert codes == [2, 2], logs(tmp_path)
  for pid in range(worker.N_PROCESSES):
    line = error_line(tmp_path, pid)
    assert "have different configs: schedule.peak_lr (process 0: 0.01, " \
           "process 1: 0.02), seed (process 0: 0, process 1: 1);" in line, line
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_a_process_that_never_starts_ends_the_job_in_time(tmp_path):
  """Only process 0 runs: it exits after initialization_timeout_seconds."""
  require_devices(1)
  port = free_port()
  start = time.monotonic()
  with launch_processes(tmp_path, cli_argv(tmp_path, port),
                        lambda pid: clean_env(), pids=[0]) as procs:
    codes = wait_all(procs, tmp_path, JOIN_TIMEOUT_S + 30)
  elapsed = time.monotonic() - start
  assert codes == [2], logs(tmp_path)  # not a C++ abort (-6)
  assert elapsed >= JOIN_TIMEOUT_S
  assert error_line(tmp_path, 0) == (
      f"error: the job at 127.0.0.1:{port} expected 2 processes, but not all "
      f"of them joined within initialization_timeout_seconds={JOIN_TIMEOUT_S}"
      " (this is process 0); start the same command on every host with "
      "process_id 0..1, make sure process 0 runs and its address is reachable"
      " from every host, or raise "
      "--config.distributed.initialization_timeout_seconds.")


def test_a_taken_coordinator_port_is_a_clear_error(tmp_path):
  """Another program listens on the port: process 0 refuses to start (it
  used to crash), process 1 ends after its initialization timeout."""
  require_devices(1)
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with launch_processes(tmp_path, cli_argv(tmp_path, port),
                          lambda pid: clean_env()) as procs:
      codes = wait_all(procs, tmp_path, JOIN_TIMEOUT_S + 30)
  assert codes == [2, 2], logs(tmp_path)
  line = error_line(tmp_path, 0)
  assert line.startswith(
      f"error: config.distributed: coordinator_address='127.0.0.1:{port}': "
      f"port {port} on this host (process 0 runs the coordinator) is already "
      "in use by another program; pick a free port"), line
  line = error_line(tmp_path, 1)
  assert f"the job at 127.0.0.1:{port} expected 2 processes" in line, line
  assert "(this is process 1)" in line, line


def test_sigterm_to_both_processes_saves_one_step_and_resumes(
    job, tmp_path, compile_cache):
  """SIGTERM to both processes (what ``timeout``, ``kill`` and SLURM send).

  JAX's preemption service receives it in each process; both must stop
  after the same step with a committed checkpoint of it and exit with 143.
  The job started again (a requeue) resumes from that checkpoint and ends
  with the parameters of the uninterrupted job of ``job``, bit for bit.
  """
  _, results, _ = job
  # ``job``'s compiled steps (one_peer_exp, the same config).
  env = cache_env(clean_env(worker.DEVICES_PER_PROCESS), compile_cache)
  script = os.path.join(HERE, "multihost_worker.py")

  def argv(*extra):
    port = free_port()
    return lambda pid: [sys.executable, script, "--out", str(tmp_path),
                        "--port", str(port), "--process_id", str(pid),
                        "--case", "one_peer_exp", *extra]

  workdir = tmp_path / "one_peer_exp"
  with launch_processes(tmp_path, argv("--log_interval", "1",
                                       "--step_delay", "0.3"),
                        lambda pid: env) as procs:
    wait_for_records(workdir / "metrics.jsonl", 2, procs, tmp_path,
                     JOB_TIMEOUT_S)
    for p in procs:
      os.killpg(p.pid, signal.SIGTERM)
    sent = time.monotonic()
    codes = wait_all(procs, tmp_path, 60)
  assert codes == [128 + signal.SIGTERM] * 2, logs(tmp_path)
  assert time.monotonic() - sent < 30
  steps = set()
  for pid in range(worker.N_PROCESSES):
    with open(tmp_path / f"preempted_p{pid}.json", encoding="utf-8") as f:
      steps.add(json.load(f)["step"])
  assert len(steps) == 1, steps  # the same step on both processes
  step = steps.pop()
  assert 2 <= step < worker.STEPS
  directory = workdir / "checkpoints"
  assert sorted(os.listdir(directory)) == [str(step)]
  assert checkpoint_files.check_checkpoint(str(directory / str(step))) == ("ok", "")
  assert (workdir / "run.lock").read_text() == ""  # released
  with launch_processes(tmp_path, argv(), lambda pid: env) as procs:
    codes = wait_all(procs, tmp_path, JOB_TIMEOUT_S)
  assert codes == [0, 0], logs(tmp_path)
  for pid in range(worker.N_PROCESSES):
    part = dict(np.load(tmp_path / f"one_peer_exp_p{pid}.npz"))
    ref = results["one_peer_exp"][pid]
    assert part["losses"].shape[0] == worker.STEPS - step  # resumed
    keys = sorted(k for k in ref if k.startswith("param/"))
    assert keys and keys == sorted(k for k in part if k.startswith("param/"))
    for k in keys:
      np.testing.assert_array_equal(part[k], ref[k], err_msg=k)
    assert part["eval_loss"] == ref["eval_loss"]


# ----------------------------------------------------------------------------
# Elastic resume: a process killed, the job restarted on fewer processes.
# ----------------------------------------------------------------------------

ELASTIC_STEPS = 8
ELASTIC = ("--config.checkpoint_interval=2", "--config.keep_checkpoints=8")


def committed_steps(directory) -> list[int]:
  """Steps of the committed checkpoints (renamed from their temporary
  directory) in ``directory``."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_sigkill_then_restart_on_one_process_with_virtual_workers(
    tmp_path, compile_cache):
  """2 processes x 4 devices, one SIGKILLed; 1 process x 2 devices x 4.

  The 2-process job (one_peer_exp, 8 workers, a checkpoint every 2 steps,
  steps slowed to 1 s) has process 1 killed with SIGKILL once checkpoint 2
  is committed; process 0 must stop with an error. The command line then
  restarts the job as one process of 2 CPU devices with 4 workers each
  (``--config.workers_per_device=4``) on the same work directory: it must
  resume from the newest committed checkpoint K and finish. The
  reference never reads a checkpoint: the config trained in this process
  on 8 devices for K steps, the state moved to a 2-device, 4-workers-per-
  device experiment in memory, and trained to the end there. Checkpoint K
  and the final checkpoint must equal the reference's states bit for bit.
  """
  devices = require_devices(N)
  extra = [f"--extra={a}" for a in ELASTIC]
  workdir = tmp_path / "one_peer_exp"
  with launch(tmp_path, "--case", "one_peer_exp", "--steps",
              str(ELASTIC_STEPS), "--log_interval", "1", "--step_delay", "1",
              *extra, cache=compile_cache) as procs:
    wait_for_records(workdir / "metrics.jsonl", 3, procs, tmp_path,
                     JOB_TIMEOUT_S)
    kill_and_expect_failure(procs, 1, tmp_path)
  stop = committed_steps(workdir / "checkpoints")[-1]
  assert 2 <= stop < ELASTIC_STEPS, stop
  restart = last_wins([
      sys.executable, os.path.join(worker.ROOT, "experiments", "train.py"),
      f"--config={os.path.join(worker.ROOT, 'configs', 'gpt_tiny.py')}",
      f"--workdir={workdir}", *worker.TINY, *worker.CASES["one_peer_exp"],
      f"--config.steps={ELASTIC_STEPS}", *ELASTIC,
      "--config.workers_per_device=4"])
  log = tmp_path / "restart.log"
  with open(log, "wb") as f:
    done = subprocess.run(restart, env=cache_env(clean_env(), compile_cache),
                          stdout=f, stderr=subprocess.STDOUT,
                          timeout=JOB_TIMEOUT_S, check=False)
  text = log.read_text(encoding="utf-8", errors="replace")
  assert done.returncode == 0, text[-3000:]
  assert f"at step {stop}" in text, text[-3000:]
  assert ("written on 2 processes x 4 devices, 1 worker per device; "
          "resuming its 8 workers on 1 process x 2 devices x 4 workers per "
          "device") in text, text[-3000:]
  # The reference: 1 x 8 devices to step ``stop``, then 2 devices x 4.
  config_a = worker.case_config("one_peer_exp", *ELASTIC,
                                steps=ELASTIC_STEPS)
  config_b = worker.case_config("one_peer_exp", *ELASTIC,
                                "--config.workers_per_device=4",
                                steps=ELASTIC_STEPS)
  exp_a = experiment_lib.Experiment(config_a, devices=devices)
  state = exp_a.init_state()
  for s in range(stop):
    state, _ = exp_a.train_step(state, exp_a.get_batch(s), s)
  at_stop = jax.device_get(state)
  exp_b = experiment_lib.Experiment(config_b, devices=devices[:2])
  like = exp_b.init_state()
  state = jax.device_put(state, jax.tree.map(lambda x: x.sharding, like))
  for s in range(stop, ELASTIC_STEPS):
    state, _ = exp_b.train_step(state, exp_b.get_batch(s), s)
  final = jax.device_get(state)
  with checkpoint.Checkpointer(str(workdir / "checkpoints")) as ckpt:
    assert ckpt.all_steps()[-1] == ELASTIC_STEPS
    for step, want in ((stop, at_stop), (ELASTIC_STEPS, final)):
      got, _ = ckpt.restore(step, like)
      for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                              jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
          g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_array_equal(
            g, w, err_msg=f"checkpoint {step} {jax.tree_util.keystr(path)}")
  # The 8 workers' models differ (the comparison is per worker).
  assert np.ptp(np.asarray(jax.tree.leaves(final.params)[0]), axis=0).max() > 0
