"""``measure`` end to end and the cluster JSON that ``predict --cluster`` reads.

The end-to-end test is a real 2-process JAX job (2 x 4 CPU devices over
gloo on 127.0.0.1) started through the command line, as a user would on
two hosts: each process joins with ``--set distributed.*`` (the runner's
start-up), process 0 writes the file. The numbers are CPU numbers; the test
checks the file, its schema and the pipeline into ``predict``, not the
values.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from decentral_jax.tools.runtime_model_cli import main as cli
from decentral_jax.runtime_model import cluster_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("model.n_layer=1", "model.n_embd=16", "model.n_head=2",
        "model.block_size=8", "global_batch=16", "n_workers=8")
TIMEOUT_S = 240

# The tests share one 2-process job; the file's fits, schema and a
# one-process measure are in tests/runtime_model/test_runtime_model_cluster_file.py.
pytestmark = pytest.mark.integration


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env() -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
      flags + ["--xla_force_host_platform_device_count=4"]),
      PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
  return env


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
  """Runs the 2-process ``measure`` job once; returns (file, logs)."""
  out = tmp_path_factory.mktemp("measure")
  path = str(out / "cluster.json")
  port = _free_port()
  procs = []
  try:
    for pid in range(2):
      argv = [sys.executable, "-m", "decentral_jax.runtime_model", "measure",
              "--config", os.path.join(ROOT, "configs", "gpt_tiny.py"),
              "--out", path, "--sizes-MB", "0.004,0.04", "--repeats", "2"]
      for kv in TINY + ("distributed.enabled=true",
                        f"distributed.coordinator_address=127.0.0.1:{port}",
                        "distributed.num_processes=2",
                        f"distributed.process_id={pid}",
                        "distributed.initialization_timeout_seconds=120"):
        argv += ["--set", kv]
      log = open(out / f"p{pid}.log", "wb")  # pylint: disable=consider-using-with
      procs.append((subprocess.Popen(argv, env=_env(), stdout=log,
                                     stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True), log))
    for p, _ in procs:
      p.wait(timeout=TIMEOUT_S)
  finally:
    for p, log in procs:
      if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
      log.close()
  logs = [(out / f"p{pid}.log").read_text() for pid in range(2)]
  assert [p.returncode for p, _ in procs] == [0, 0], "\n".join(logs)
  return path, logs


def test_two_process_measure_writes_a_valid_cluster_file(measured):
  path, logs = measured
  data = cluster_file.read(path)  # schema, keys and values checked
  assert "wrote" in logs[0] and "wrote" not in logs[1]  # process 0 writes
  meta, meas, c, w = (data[k] for k in ("meta", "measurements", "cluster",
                                          "workload"))
  assert (meta["process_count"], meta["devices"], meta["backend"]) == (
      2, 8, "cpu")
  # One node per process: 4 devices each.
  assert (c["n_workers"], c["local_size"]) == (8, 4)
  assert meas["sizes_bytes"] == [4000, 40000]
  assert meas["concurrent_flows"] == 4
  for key in ("intra_pair_s", "inter_pair_s", "inter_concurrent_s"):
    assert len(meas[key]) == 2 and all(t > 0 for t in meas[key]), key
  assert len(meas["forward_backward_samples_s"]) == meas["repeats"] == 2
  assert meas["all_reduce_bytes"] == 4 * w["param_count"]
  assert meas["all_reduce_s"] > 0
  assert w["forward_s"] > 0 and w["backward_s"] >= 0
  assert w["forward_s"] == pytest.approx(np.median(meas["forward_samples_s"]))
  assert w["backward_s"] == pytest.approx(max(
      np.median(w["compute_samples_s"]) - w["forward_s"], 0.0))
  # The cluster fields are the fit of the file's own measurements.
  assert c == cluster_file.fit_links(meas, 8, 4)
  # The parameter count is the tiny model's, counted here from its shapes.
  import jax  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import config as config_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.runner import tasks  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                               list(TINY))
  shapes = jax.eval_shape(tasks.make_task(cfg, 8, 2).init_params,
                          jax.random.PRNGKey(0))
  assert w["param_count"] == sum(int(np.prod(x.shape))
                                 for x in jax.tree.leaves(shapes))


def test_predict_reads_the_measured_file(measured, capsys):
  path, _ = measured
  assert cli.main(["predict", "--cluster", path, "--steps", "20"]) == 0
  out = capsys.readouterr().out
  assert f"cluster from {path}: 8 cpu devices, 4 per node" in out
  assert "n=8 workers (2 nodes x 4)" in out  # the file's worker count
  assert "measured All-Reduce" in out and "recommendation:" in out


