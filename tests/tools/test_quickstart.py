"""experiments/optax_quickstart.py (the README's optax composition) runs,
and refuses bad flags and device counts in one error line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import require_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
  spec = importlib.util.spec_from_file_location(
      "optax_quickstart", os.path.join(ROOT, "experiments", "optax_quickstart.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("args", [
    ["--topology", "alternating_exp_ring", "--local_size", "4"],
    pytest.param(["--all_reduce"], marks=pytest.mark.integration)])
def test_quickstart_trains(args):
  require_devices(8)
  # At w = 0 the expected loss is E[(x @ w_true)^2] = |w_true|^2.
  w_true = np.random.default_rng(0).normal(size=(4, 1))
  out = _load().main(args + ["--steps", "40"])
  assert out["loss"] < 0.25 * float(np.sum(w_true ** 2))
  assert np.isfinite(out["consensus_distance"]) and len(out["worker0_w"]) == 4


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps=0 must be a whole number >= 1."),
    (["--steps", "-1"], "--steps=-1 must be a whole number >= 1."),
    (["--local_size", "3"], "--local_size=3 must divide the 8 workers"),
    (["--local_size", "0"], "--local_size=0 must divide the 8 workers"),
    (["--topology", "nope"], "--topology='nope': unknown topology 'nope'"),
    # Accepted and ignored: All-Reduce averages over all workers.
    (["--all_reduce", "--topology", "ring"], "--topology='ring' is not read "
     "with --all_reduce"),
    (["--topology", "one_peer_exp", "--all_reduce"], "--topology="
     "'one_peer_exp' is not read with --all_reduce"),
    # Accepted and not read: the same output for every --local_size.
    (["--all_reduce", "--local_size", "2"], "--local_size=2 is not read "
     "with --all_reduce"),
    (["--all_reduce", "--local_size", "1"], "--local_size=1 is not read "
     "with --all_reduce"),
    # Read as the default one_peer_exp.
    (["--topology", ""], "--topology='' is empty; give a topology name"),
    # Accepted, and the script ran for ever (the runner bounds config.steps).
    (["--steps", "99999999999"],
     "--steps=99999999999 must be at most 2147483647."),
    # argparse kept the last: trained on complete.
    (["--topology", "ring", "--topology", "complete"],
     "--topology is given twice (--topology ring, then --topology "
     "complete); give it once."),
])
def test_bad_flags_are_one_error_line_before_any_work(args, message, capsys):
  """--steps 0 ended in an UnboundLocalError, --local_size 3 in a
  traceback of the topology."""
  with pytest.raises(SystemExit) as e:
    _load().main(args)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].partition(" error: ")[2].startswith(message), err


def test_an_empty_xla_flags_gets_the_device_count(monkeypatch):
  """An empty XLA_FLAGS kept setdefault from adding the count: make_mesh's
  "8 workers need 8 devices" traceback."""
  module = _load()
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  module._simulate_devices()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
  module._simulate_devices()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"] == ("--xla_cpu_multi_thread_eigen=false "
                                     "--xla_force_host_platform_device_count=8")


@pytest.mark.parametrize("count", ["abc", "0"])
def test_a_bad_xla_flags_count_is_one_error_line(count):
  """'abc' made XLA abort the process printing its whole flag list; the
  check runs before JAX is imported."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count"
         f"={count}", "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  got = subprocess.run([sys.executable, os.path.join(
      ROOT, "experiments", "optax_quickstart.py")], env=env,
                       capture_output=True, text=True, timeout=300,
                       check=False)
  assert got.returncode == 2, got.stderr[-2000:]
  assert got.stderr.strip().splitlines() == [
      f"error: XLA_FLAGS' --xla_force_host_platform_device_count='{count}' "
      "must be a whole number in [1, 1024]; fix it or drop it from "
      "XLA_FLAGS."], got.stderr
