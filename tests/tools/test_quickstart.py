"""experiments/optax_quickstart.py (the README's optax composition) runs."""

from __future__ import annotations

import importlib.util
import os

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
