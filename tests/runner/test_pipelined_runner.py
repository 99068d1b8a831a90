"""Pipelined gossip in the runner (``config.pipelined_gossip``): fields,
static rounds, resume, bytes per step, pricing."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from helpers import run_steps
from helpers import to_host
from decentral_jax import optim
from decentral_jax.runner import builders
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import programs
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax import topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
PIPE = ("--config.algorithm=decentralized", "--config.pipelined_gossip=True",
        "--config.topology=one_peer_exp")


def _config(*extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY_RUN, *PIPE, *extra))


def test_fields_are_validated_and_priced():
  config = _config()
  validation.check_config(config)
  assert builders.spec_for_config(config)[0] == (
      "dadam:topology=one_peer_exp,pipelined=1")
  for extra, words in (
      (("--config.gossip_every=2",), "config.pipelined_gossip=True with "
       "config.gossip_every=2"),):
    with pytest.raises(ValueError, match=words):
      validation.check_config(_config(*extra))
  # With compression it is pipelined CHOCO-gossip (test_choco_pipelined_
  # runner.py), priced overlapped.
  piped_choco = _config("--config.compression.format=int8",
                        "--config.topology=exponential")
  validation.check_config(piped_choco)
  assert builders.spec_for_config(piped_choco)[0] == (
      "dadam:topology=exponential,compress=int8,block=256,pipelined=1")
  with pytest.raises(ValueError, match="config.pipelined_gossip=True has no "
                     "effect with config.algorithm='local_sgd'"):
    validation.check_config(config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        ("--config.algorithm=local_sgd", "--config.pipelined_gossip=True")))


def test_static_programs_follow_round_floor_k_over_2():
  """Step k runs the program of round floor(k / 2) % period; a period of
  the schedule is 2 x 3 steps on 8 workers."""
  topo = topology.one_peer_exp(N)
  assert programs.round_indices(topo, "static", 1, 2) == {0: 0, 1: 2, 2: 4}
  config = _config()
  assert programs.round_stride(config) == 2
  assert programs.round_stride(_config("--config.pipelined_gossip=False")) == 1


@pytest.mark.slow
def test_static_rounds_resume_and_bytes(tmp_path):
  """Static rounds equal the in-graph switch bit for bit; a resume after
  step 5 (mid pair of steps of one round) equals the straight run; the
  bytes per step equal plain gossip's."""
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  state = run_steps(exp, exp.init_state(), 0, 9)
  assert optim.find_states(state.opt_state, optim.PipelinedState)
  static = experiment_lib.Experiment(_config("--config.gossip_rounds=static"))
  assert static.programs.rounds == {0: 0, 1: 2, 2: 4}
  for a, b in zip(jax.tree.leaves(to_host(state)), jax.tree.leaves(
      to_host(run_steps(static, static.init_state(), 0, 9)))):
    np.testing.assert_array_equal(a, b)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  part = run_steps(exp, exp.init_state(), 0, 5)
  meta = run_meta.checkpoint_meta(exp, 5)
  ckpt.save(5, part, meta)
  restored, _ = ckpt.restore(5, exp.init_state())
  ckpt.close()
  for a, b in zip(jax.tree.leaves(to_host(state)),
                  jax.tree.leaves(to_host(run_steps(exp, restored, 5, 9)))):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="config.pipelined_gossip="):
    run_meta.check_resumable(exp, dict(meta, pipelined_gossip=False), "c")
  plain = experiment_lib.Experiment(_config("--config.pipelined_gossip=False"))
  got = exp.communication(exp.init_state(), exp.get_batch(0))
  want = plain.communication(plain.init_state(), plain.get_batch(0))
  assert got["bytes_per_step"] == want["bytes_per_step"] > 0
