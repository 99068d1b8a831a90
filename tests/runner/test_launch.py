"""Joining a multi-process job and agreeing on its start, without processes.

What :func:`decentral_jax.runner.launch.initialize_from_config` asks JAX for
(``jax.distributed.initialize`` stubbed) under each config and SLURM
environment, the coordinator-port check it makes before JAX starts, and the
messages of :mod:`decentral_jax.runner.agreement` that name the config fields
and initial parameters that differ between processes. The real 2-process jobs
are in ``tests/runner/test_multihost.py`` (integration tier).
"""

from __future__ import annotations

import os
import socket

import jax
import numpy as np
import pytest

import multihost_worker as worker
from decentral_jax.runner import agreement
from decentral_jax.runner import launch
from decentral_jax.runner import validation


def _dist_config(**fields):
  config = worker.case_config("one_peer_exp")
  with config.unlocked():
    for k, v in fields.items():
      config.distributed[k] = v
  return config


def test_initialize_distributed_decides_and_validates(monkeypatch):
  """Which set-up ``initialize_distributed`` asks for (JAX call stubbed)."""
  calls = []
  monkeypatch.setattr(launch, "initialize",
                      lambda **kw: calls.append(kw) or True)
  for var in [v for v in os.environ if v.startswith("SLURM_")]:
    monkeypatch.delenv(var)
  assert launch.initialize_from_config(_dist_config()) is False
  with pytest.raises(ValueError, match="no SLURM job"):
    launch.initialize_from_config(_dist_config(enabled=True))
  assert launch.initialize_from_config(_dist_config(
      enabled=True, coordinator_address="10.0.0.1:1234", num_processes=4,
      process_id=3, heartbeat_timeout_seconds=7,
      initialization_timeout_seconds=9))
  assert calls.pop() == dict(coordinator_address="10.0.0.1:1234",
                             num_processes=4, process_id=3,
                             heartbeat_timeout_seconds=7,
                             initialization_timeout_seconds=9)
  for bad, match in (({"num_processes": -1}, "distributed.num_processes"),
                     ({"process_id": -2}, "distributed.process_id"),
                     ({"heartbeat_timeout_seconds": 0},
                      "distributed.heartbeat_timeout_seconds"),
                     ({"initialization_timeout_seconds": 0},
                      "distributed.initialization_timeout_seconds")):
    with pytest.raises(ValueError, match=match):
      launch.initialize_from_config(_dist_config(**bad))
  # A batch script's own step (no srun step with several tasks) stays alone.
  monkeypatch.setenv("SLURM_JOB_ID", "5")
  monkeypatch.setenv("SLURM_NTASKS", "2")
  monkeypatch.setenv("SLURM_PROCID", "0")
  assert launch.initialize_from_config(_dist_config()) is False
  assert not calls
  # enabled=True with empty fields on SLURM: JAX detects the set-up.
  assert launch.initialize_from_config(_dist_config(enabled=True))
  assert calls.pop() == dict(coordinator_address="", num_processes=0,
                             process_id=-1, heartbeat_timeout_seconds=100,
                             initialization_timeout_seconds=120)
  # Inside `srun` with 2 tasks the job is joined even when not enabled.
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
  assert launch.initialize_from_config(_dist_config())
  assert calls.pop()["num_processes"] == 0
  # JAX's SLURM rule gives each task the one GPU numbered SLURM_LOCALID;
  # with one task per node the process gets all GPUs of its node back.
  visible = lambda: jax.config.values["jax_cuda_visible_devices"]
  try:
    for tasks_per_node, expected in (("2", "0"), ("1(x2)", "all")):
      monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks_per_node)
      jax.config.update("jax_cuda_visible_devices", "0")  # as JAX does
      assert launch.initialize_from_config(_dist_config(enabled=True))
      assert visible() == expected, tasks_per_node
  finally:
    jax.config.update("jax_cuda_visible_devices", "all")
    jax.config.update("jax_rocm_visible_devices", "all")


@pytest.mark.parametrize("field,value", [
    ("num_processes", 2), ("num_processes", 99999999999999),
    ("coordinator_address", "h:1"), ("process_id", 0),
    ("heartbeat_timeout_seconds", 7), ("initialization_timeout_seconds", 9)])
def test_distributed_fields_without_enabled_are_refused(monkeypatch, field,
                                                        value):
  """Off an srun step no job is joined with ``enabled=False``: a set-up
  field would be silently unused; refused naming ``distributed.enabled``.
  Inside an srun step with several tasks the job is joined: accepted."""
  for var in [v for v in os.environ if v.startswith("SLURM_")]:
    monkeypatch.delenv(var)
  config = _dist_config(**{field: value})
  for check in (validation.check_config, launch.initialize_from_config):
    with pytest.raises(ValueError, match=(
        f"config.distributed.{field}={value!r} has no effect with config."
        "distributed.enabled=False")):
      check(config)
  for var, v in (("SLURM_JOB_ID", "5"), ("SLURM_NTASKS", "2"),
                 ("SLURM_PROCID", "0"), ("SLURM_STEP_NUM_TASKS", "2")):
    monkeypatch.setenv(var, v)
  validation.check_config(config)


def test_config_differences_name_the_fields():
  """Only fields outside config.distributed and workdir are compared."""
  base = agreement.config_fields(worker.case_config("one_peer_exp"))
  other = agreement.config_fields(worker.case_config(
      "one_peer_exp", "--config.seed=1", "--config.schedule.peak_lr=0.02",
      "--config.workdir=/elsewhere", "--config.distributed.process_id=1",
      "--config.distributed.heartbeat_timeout_seconds=7"))
  assert base["seed"] == "0" and base["schedule.peak_lr"] == "0.01"
  assert not [k for k in base if k.startswith("distributed") or
              k == "workdir"], base
  expected = ("schedule.peak_lr (process 0: 0.01, process 1: 0.02), "
              "seed (process 0: 0, process 1: 1)")
  assert agreement.config_differences([base, other]) == expected
  assert agreement.config_differences([base, dict(base), dict(base)]) == ""
  # Processes 2 and 3 differ; a field missing on one process is named.
  missing = {k: v for k, v in base.items() if k != "model.bias"}
  diff = agreement.config_differences([base, base, other, missing])
  assert diff.startswith("model.bias (process 0: false, process 3: <missing>"
                         "), schedule.peak_lr (process 0: 0.01, process 2: "
                         "0.02)"), diff
  assert "seed (process 0: 0, process 2: 1)" in diff
  assert "seed (process 0: 0, process 1: 1; 2 processes differ from " \
         "process 0)" in agreement.config_differences([base, other, other])


def test_init_differences_tolerate_rounding_only():
  """Initial parameters that differ by rounding agree, another draw not."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(64, 32)).astype(np.float32),
            "b": np.zeros(32, np.float32)}
  rounded = {"w": np.nextafter(params["w"], np.inf), "b": params["b"]}
  redrawn = {"w": rng.normal(size=(64, 32)).astype(np.float32),
             "b": params["b"]}
  reshaped = {"w": params["w"].reshape(32, 64), "b": params["b"]}
  fp = agreement.init_fingerprint
  assert agreement.init_differences([fp(params), fp(rounded)]) == ""
  for bad in (redrawn, reshaped):
    assert agreement.init_differences(
        [fp(params), fp(rounded), fp(bad)]) == (
            "process 2 differs from process 0 in 1 of 2 leaves: ['w']")


def test_port_check_runs_before_jax(monkeypatch):
  """Process 0 tests the port before jax.distributed.initialize."""
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda **kw: pytest.fail("initialize was called"))
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(ValueError, match=f"port {port} .* already in use"):
      launch.initialize_from_config(_dist_config(
          enabled=True, coordinator_address=f"127.0.0.1:{port}",
          num_processes=2, process_id=0))
  # A host with a blank, a newline or a scheme passed (only the port was
  # checked) and reached jax.distributed.
  for bad in ("127.0.0.1", "127.0.0.1:0", "host:port", "ho st:1234",
              "h\n:1234", "http://x:1234", "[zz]:1234", "999.0.0.1:1234"):
    with pytest.raises(ValueError, match="must be 'host:port'"):
      launch.initialize_from_config(_dist_config(
          enabled=True, coordinator_address=bad, num_processes=2,
          process_id=1))
