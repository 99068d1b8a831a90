"""Pipelined CHOCO-gossip in the runner (``config.pipelined_gossip`` with
``config.compression``): built, refused where it means nothing, priced
overlapped by hand, trained and resumed bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from helpers import assert_same_tree
from helpers import resume_mid_run
from helpers import run_steps
from decentral_jax import topology
from decentral_jax.optim import choco
from decentral_jax.optim import transforms
from decentral_jax.runner import builders
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import programs
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax.runtime_model import method as method_lib
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
PIPED = ("--config.algorithm=decentralized", "--config.topology=exponential",
         "--config.compression.format=int8", "--config.compression.block=64",
         "--config.pipelined_gossip=True")


def _config(*extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY_RUN, *PIPED, *extra))


def test_built_priced_and_refused_by_name():
  config = _config()
  validation.check_config(config)
  assert builders.spec_for_config(config)[0] == (
      "dadam:topology=exponential,compress=int8,block=64,pipelined=1")
  assert programs.round_stride(config) == 1  # CHOCO's rounds in step order
  tx = builders.make_optimizer(config, builders.make_schedule(config),
                               topology.make("exponential", N), "workers")
  found = transforms.find_states(
      tx.init({"w": np.zeros((3, 4), np.float32)}),
      (choco.ChocoState, transforms.DecentralizedState))
  assert [type(s) for s in found] == [choco.ChocoState]
  for extra, words in (
      (("--config.gossip_every=2",), "config.pipelined_gossip=True with "
       "config.gossip_every=2"),
      (("--config.topology=one_peer_exp",), "static mixing matrix.*; set "
       "--config.topology to one of exponential, static_ring, torus, "),
      (("--config.faults.enabled=True",), "config.faults.enabled=True")):
    with pytest.raises(ValueError, match=words) as info:
      validation.check_config(_config(*extra))
    assert "\n" not in str(info.value)


def test_priced_as_overlapped_gossip_by_hand():
  """static_ring on 4 workers, int8 (blocks of 256): a round of 2 permute
  terms of the payload, ``2 (a + P / b)`` = 1.6 ms, shorter than the 10 ms
  of compute: blocking CHOCO pays it every step, pipelined CHOCO hides it
  behind the next forward and backward; both pay the codec, ``(2 + 2) N``
  float32 values quantized or dequantized."""
  n, a, b, codec_bps = 1_000_000, 5e-6, 1.25e9, 20e9
  c = Cluster(n_workers=4, local_size=1, inter_latency_s=a,
              nic_bandwidth_Bps=b, multi_node="ring", codec_Bps=codec_bps)
  w = Workload(n, 0.01 / 3, 0.02 / 3, bucket_bytes=1e15)
  payload = 3907 * 260  # ceil(N / 256) blocks of 256 codes and a scale
  codec = 4 * n * 4 / codec_bps
  blocking = make_method("dadam:topology=static_ring,compress=int8", c)
  piped = make_method("dadam:topology=static_ring,compress=int8,pipelined=1",
                      c)
  assert (piped.overlap, piped.pipelined, method_lib.library_gap(piped)) == (
      True, False, None)
  assert closed_form(blocking, c, w).iteration_s == pytest.approx(
      0.01 + codec + 2 * (a + payload / b))
  assert closed_form(piped, c, w).iteration_s == pytest.approx(0.01 + codec)


@pytest.mark.slow
def test_trains_and_resumes_bit_exactly(tmp_path):
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  losses = []
  state = run_steps(exp, exp.init_state(), 0, 10, losses)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  resumed, meta = resume_mid_run(exp, tmp_path / "ckpt", 4, 10)
  assert_same_tree(state, resumed)
  with pytest.raises(ValueError, match="config.pipelined_gossip="):
    run_meta.check_resumable(exp, dict(meta, pipelined_gossip=False), "c")
