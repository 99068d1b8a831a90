"""NoLoCo in the runner: its own config fields, the stability refusal,
training, resume mid-period, its HLO bytes against the hand count and its
runtime-model price."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from helpers import assert_same_tree
from helpers import resume_mid_run
from helpers import run_steps
from helpers import to_host
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import methods
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.traffic import bytes_per_iteration
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.tools.compare import runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
H = 4
NOLOCO = ("--config.algorithm=noloco", f"--config.sync_every={H}")


def _config(*extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY_RUN, *NOLOCO, *extra))


def test_config_fields_are_validated_by_name():
  config = _config()
  validation.check_config(config)
  assert methods.display_name(config) == "NoLoCo"
  assert builders.spec_for_config(config)[0] == "noloco:H=4,seed=0,rounds=8"
  assert (config.noloco.alpha, config.noloco.beta, config.noloco.gamma) == (
      0.5, 0.7, 0.7)
  for extra, words in (
      (("--config.noloco.alpha=1.0",), r"config.noloco.alpha must be a "
       r"finite number in \[0, 1\)"),
      (("--config.noloco.beta=0",), "config.noloco.beta must be a finite "
       "number > 0"),
      (("--config.noloco.gamma=3.2",), r"config.noloco.gamma=3.2 with "
       r"config.noloco.alpha=0.5 is outside NoLoCo's stability range 0 < "
       r"config.noloco.gamma < 2 \(1 \+ config.noloco.alpha\) = 3 "),
      (("--config.noloco.alpha=0.0", "--config.noloco.gamma=2.0"),
       "config.noloco.gamma=2.0 with config.noloco.alpha=0.0 is outside"),
      (("--config.noloco.pairing_seed=-1",), r"config.noloco.pairing_seed "
       r"must be an integer in \[0, "),
      (("--config.noloco.pairing_rounds=0",), r"config.noloco.pairing_rounds"
       r" must be an integer in \[1, 1024\]"),
      (("--config.compression.format=int8",), "config.compression.format="
       "'int8' has no effect with config.algorithm='noloco'"),
      (("--config.comm_dtype=bfloat16",), "config.comm_dtype='bfloat16' has "
       "no effect with config.algorithm='noloco'"),
      (("--config.topology=ring",), "config.topology='ring' has no effect "
       "with config.algorithm='noloco'")):
    with pytest.raises(ValueError, match=words):
      validation.check_config(_config(*extra))
  # Another method refuses NoLoCo's fields.
  with pytest.raises(ValueError, match="config.noloco.gamma=0.5 has no "
                     "effect with config.algorithm='diloco'"):
    validation.check_config(config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        ("--config.algorithm=diloco", "--config.noloco.gamma=0.5")))
  assert any("not a multiple of config.sync_every=5" in w for w in
             validation.config_warnings(_config("--config.sync_every=5")))
  # The main job's arm: H = 10 with the paper's alpha, beta, gamma.
  arm = runs.METHODS["noloco"]
  assert (arm.algorithm, dict(arm.fields)) == ("noloco", {"sync_every": 10})


def test_the_runtime_model_prices_it_by_the_hand_count():
  """8 workers on 8 nodes, one NIC of 1 GB/s each, no latency, 25e6
  float32 parameters (M = 100 MB): every H steps each worker exchanges one
  float32 copy with its partner (M / 1 GB/s = 0.1 s, both directions at
  once); compute 60 ms; nothing else is sent."""
  spec, fields = builders.spec_for_config(_config())
  c = Cluster(N, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,), **fields)
  m = make_method(spec, c)
  assert (m.kind, m.period, m.topology.name) == ("local", H, "random_pairs")
  copy = 25e6 * 4
  assert bytes_per_iteration(spec, c, w).worker_bytes == pytest.approx(
      copy / H, rel=1e-12)
  t = simulate(m, c, w, steps=64, warmup=16)
  assert t == pytest.approx(0.06 + copy / 1e9 / H, rel=1e-9)
  assert closed_form(m, c, w).iteration_s == pytest.approx(t, rel=1e-9)
  # Against DiLoCo's all-reduce of the same float32 copy: 2 (n-1)/n M.
  ring = make_method(f"diloco:H={H}", c)
  assert bytes_per_iteration(ring, c, w).worker_bytes == pytest.approx(
      2 * (N - 1) / N * copy / H, rel=1e-12)
  # Five workers: one alone per round; no worker sends more than one copy
  # per sync.
  c5 = Cluster(5, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  assert bytes_per_iteration("noloco:H=4,rounds=3", c5, w).worker_bytes \
      <= copy / H * (1 + 1e-12)
  with pytest.raises(ValueError, match="rounds='0' must be an integer >= 1"):
    make_method("noloco:H=4,rounds=0", c)


@pytest.mark.slow
def test_trains_and_resumes_bit_exactly_mid_period(tmp_path):
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  losses = []
  state = run_steps(exp, exp.init_state(), 0, 12, losses)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert np.isfinite(exp.evaluate(state)["eval/loss"])
  # The workers differ (their pairs differ) but after 12 = 3 H steps each
  # worker's parameters are its phi.
  leaf = jax.tree.leaves(to_host(state.params))[0]
  assert np.ptp(leaf, axis=0).max() > 0
  # Straight 0..11 against a checkpoint after step 6 (two steps into the
  # second period, one outer step taken) resumed to 12.
  resumed, meta = resume_mid_run(exp, tmp_path / "ckpt", 6, 12)
  assert_same_tree(state, resumed)
  # A resume with another pairing or outer coefficient is refused by name.
  run_meta.check_resumable(exp, dict(meta), "ckpt")
  for key, value in (("noloco.pairing_seed", 3), ("noloco.gamma", 0.3),
                     ("sync_every", 8)):
    with pytest.raises(ValueError, match=f"config.{key}="):
      run_meta.check_resumable(exp, dict(meta, **{key: value}), "ckpt")


@pytest.mark.slow
def test_hlo_bytes_equal_the_hand_count():
  """One ppermute of the float32 ``beta Delta + gamma phi`` (one copy of
  the parameters) every H steps, no all-reduce: ``4 P / H`` bytes per step
  for ``P`` parameters per worker."""
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  state = exp.init_state()
  comm = exp.communication(state, exp.get_batch(0))
  floats = sum(x.size for x in jax.tree.leaves(state.params)) // N
  assert comm["param_bytes"] == 4 * floats
  np.testing.assert_allclose(comm["bytes_per_step"], 4 * floats / H,
                             rtol=1e-12)
