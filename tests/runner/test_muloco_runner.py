"""MuLoCo in the runner (runner/methods/muloco.py): its config and fields,
refusals by name, training, resume bit-exact mid-period, the HLO bytes
against DiLoCo's hand count (exact and int4) and the runtime model's price."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from helpers import assert_same_tree
from helpers import resume_mid_run
from helpers import run_steps
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import methods
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.traffic import bytes_per_iteration
from decentral_jax.runtime_model.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "muloco_tiny.py")
N, H, BLOCK = 8, 4, 64
EXACT = ("--config.compression.format=none",
         "--config.compression.error_feedback=False")
STREAMING = ("--config.num_fragments=2", "--config.overlap_steps=1",
             "--config.merge_alpha=0.5")


def _config(*extra):
  block = () if EXACT[0] in extra else (f"--config.compression.block={BLOCK}",)
  return config_lib.load_config(CONFIG, (
      *TINY_RUN, f"--config.sync_every={H}", *block, *extra))


_EXPERIMENTS = {}


def _experiment(*extra):
  if extra not in _EXPERIMENTS:
    _EXPERIMENTS[extra] = experiment_lib.Experiment(_config(*extra))
  return _EXPERIMENTS[extra]


@pytest.fixture(scope="module", autouse=True)
def _release_experiments():
  yield
  _EXPERIMENTS.clear()


def test_the_shipped_config_is_valid_and_priced():
  config = config_lib.load_config(CONFIG, ())
  validation.check_config(config)
  assert methods.display_name(config) == "MuLoCo"
  assert (config.muon.ns_steps, config.muon.beta, config.muon.consistent_rms,
          config.muon.adam_lr_ratio) == (5, 0.95, 0.2, 1.0)
  assert builders.spec_for_config(config)[0] == \
      "diloco:H=10,compress=int4,block=256"
  assert builders.spec_for_config(_config(*EXACT, *STREAMING))[0] == \
      "streaming_diloco:H=4,P=2,tau=1"


@pytest.mark.parametrize("extra, words", [
    (("--config.muon.ns_steps=0",), "config.muon.ns_steps must be an integer"),
    (("--config.muon.beta=1.0",), "config.muon.beta must be a finite number "
     "in [0, 1)"),
    (("--config.muon.consistent_rms=-1.0",), "config.muon.consistent_rms "
     "must be a finite number in [0, 1000]"),
    (("--config.muon.adam_lr_ratio=0.0",), "config.muon.adam_lr_ratio must "
     "be a finite number in (0, 1000]"),
    # Factors of a learning rate, bounded as the rates are (1e300 passed and
    # the run diverged at step 1 naming other fields).
    (("--config.muon.consistent_rms=1e300",), "config.muon.consistent_rms "
     "must be a finite number in [0, 1000], got 1e"),
    (("--config.muon.adam_lr_ratio=1000.5",), "config.muon.adam_lr_ratio "
     "must be a finite number in (0, 1000], got 1000.5"),
    (("--config.num_fragments=5",), "config.num_fragments=5 exceeds "
     "config.sync_every=4"),
    (("--config.overlap_steps=1",), "config.overlap_steps=1 has no effect "
     "with config.num_fragments=1"),
    (("--config.topology=ring",), "config.topology='ring' has no effect "
     "with config.algorithm='muloco'"),
    (("--config.outer_overlap=delayed",), "config.outer_overlap='delayed' "
     "has no effect with config.algorithm='muloco'"),
    ((*EXACT, "--config.faults.enabled=True"), "config.faults.enabled=True "
     "needs config.algorithm in local_sgd, diloco, decentralized, got "
     "'muloco'"),
])
def test_bad_fields_are_refused_by_name(extra, words):
  with pytest.raises(ValueError, match=words.replace("[", r"\[")
                     .replace("(", r"\(").replace(")", r"\)")):
    validation.check_config(_config(*extra))


def test_the_rate_factors_accept_their_bound():
  validation.check_config(_config("--config.muon.consistent_rms=1000.0",
                                  "--config.muon.adam_lr_ratio=1000.0"))


def test_the_other_leaves_take_the_runs_adam():
  """AccumAdamW is accepted (its window then reads accum_steps)."""
  validation.check_config(_config("--config.optimizer.name=accum_adamw",
                                  "--config.optimizer.accum_steps=2"))


def test_another_method_refuses_the_muon_fields():
  with pytest.raises(ValueError, match="config.muon.beta=0.9 has no effect "
                     "with config.algorithm='diloco'"):
    validation.check_config(_config("--config.algorithm=diloco",
                                    "--config.muon.beta=0.9"))


def test_the_runtime_model_prices_dilocos_hand_count():
  """``diloco:H=4``: an all-reduce of the float32 pseudo-gradients every 4
  steps, ``2 (n - 1) / n x 4 P / 4`` bytes per step."""
  spec, fields = builders.spec_for_config(_config(*EXACT))
  assert spec == "diloco:H=4"
  c = Cluster(N, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,), **fields)
  assert make_method(spec, c).period == H
  want = 2 * (N - 1) / N * 4 * 25e6 / H
  assert bytes_per_iteration(spec, c, w).worker_bytes == pytest.approx(
      want, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), STREAMING], ids=["int4", "streaming"])
def test_trains_and_resumes_bit_exactly_mid_period(extra, tmp_path):
  require_devices(N)
  exp = _experiment(*extra)
  losses = []
  state = run_steps(exp, exp.init_state(), 0, 12, losses)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert np.isfinite(exp.evaluate(state)["eval/loss"])
  # Straight 0..11 against a checkpoint after step 6 (mid period: two
  # steps after the sync at step 4, and for Streaming between a fragment's
  # send and its merge) resumed to 12.
  resumed, meta = resume_mid_run(exp, tmp_path / "ckpt", 6, 12)
  assert_same_tree(state, resumed)
  run_meta.check_resumable(exp, dict(meta), "ckpt")
  with pytest.raises(ValueError, match="config.muon.ns_steps="):
    run_meta.check_resumable(exp, dict(meta, **{"muon.ns_steps": 3}), "ckpt")


@pytest.mark.slow
def test_hlo_bytes_equal_dilocos_hand_count():
  """Exact: an all-reduce of the float32 pseudo-gradients every H steps,
  ``2 (n - 1) / n x 4 P / H`` per step. int4: the leaves in one buffer
  (far below the 25 MB bucket), padded once to a multiple of ``n x
  block``, ``2 (n - 1) / n`` of its payload (half a byte per value and a
  float32 scale per block) every H steps."""
  require_devices(N)
  for extra in (EXACT, ()):
    exp = _experiment(*extra)
    state = exp.init_state()
    comm = exp.communication(state, exp.get_batch(0))
    sizes = [x.size // N for x in jax.tree.leaves(state.params)]
    assert comm["param_bytes"] == 4 * sum(sizes)
    if extra:
      want = 2 * (N - 1) / N * 4 * sum(sizes) / H
    else:
      unit = N * BLOCK
      padded = max(unit, math.ceil(sum(sizes) / unit) * unit)
      want = 2 * (N - 1) / N * (padded // BLOCK) * (BLOCK // 2 + 4) / H
    np.testing.assert_allclose(comm["bytes_per_step"], want, rtol=1e-12)
