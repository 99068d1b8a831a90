"""Gradient tracking in the runner: config fields and refusals, training,
resume mid-period, its HLO bytes against the hand count (twice the
parameter gossip) and its runtime-model price."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from helpers import run_steps
from helpers import to_host
from decentral_jax.runner import builders
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import methods
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Method as PricedMethod
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form
from decentral_jax.runtime_model.step_time import simulate
from decentral_jax.runtime_model.traffic import bytes_per_iteration
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.tools.compare import runs as compare_runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
GT = ("--config.algorithm=gradient_tracking",
      "--config.topology=one_peer_exp")


def _config(*extra, algorithm=GT):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY_RUN, *algorithm, *extra))


def test_config_fields_are_validated_by_name():
  config = _config()
  validation.check_config(config)
  assert methods.display_name(config) == "Gradient tracking (Exp)"
  assert builders.spec_for_config(config)[0] == (
      "gradient_tracking:topology=one_peer_exp")
  spec = builders.spec_for_config(_config(
      "--config.comm_dtype=bfloat16", "--config.bucket_bytes=1048576"))[0]
  assert spec == ("gradient_tracking:topology=one_peer_exp,"
                  "comm_dtype=bfloat16,bucket_MiB=1")
  validation.check_config(_config("--config.optimizer.name=accum_adamw",
                                  "--config.optimizer.accum_steps=4"))
  for extra, words in (
      (("--config.gossip_every=2",), "config.gossip_every=2 with "
       "config.algorithm='gradient_tracking'"),
      (("--config.compression.format=int8",), "config.compression.format="
       "'int8' with config.algorithm='gradient_tracking': compressed"),
      (("--config.global_avg_interval=10",), "config.global_avg_interval=10 "
       "with config.algorithm='gradient_tracking'"),
      (("--config.faults.enabled=True",), "config.faults.enabled=True needs "
       "config.algorithm in"),
      (("--config.sync_every=4",), "config.sync_every=4 has no effect with "
       "config.algorithm='gradient_tracking'")):
    with pytest.raises(ValueError, match=words):
      validation.check_config(_config(*extra))
  validation.check_config(_config("--config.tracking.adapt_then_combine="
                                  "True"))
  # Another method refuses the tracker's own field.
  with pytest.raises(ValueError, match="config.tracking.adapt_then_combine="
                     "True has no effect with config.algorithm="
                     "'decentralized'"):
    validation.check_config(_config(
        "--config.tracking.adapt_then_combine=True",
        algorithm=("--config.algorithm=decentralized",)))


def test_the_main_job_has_its_arm():
  run = compare_runs.METHODS["gradient_tracking"]
  assert (run.algorithm, run.optimizer, run.topology) == (
      "gradient_tracking", "adamw", "one_peer_exp")
  assert run.label == "Gradient tracking (Exp)"
  [(_, config)] = compare_runs.arm_configs(
      _config(algorithm=()), 4, True, (run,))
  assert config.schedule.peak_lr == compare_runs.TUNED_PEAK_LR[run.name]
  assert builders.spec_for_config(config)[0] == (
      "gradient_tracking:topology=one_peer_exp")


def _resume_case(exp, tmp_path):
  """Steps 0..11 straight, and to 5, checkpointed, restored, on to 12."""
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  part = run_steps(exp, exp.init_state(), 0, 5)
  meta = run_meta.checkpoint_meta(exp, 5)
  ckpt.save(5, part, meta)
  restored, _ = ckpt.restore(5, exp.init_state())
  ckpt.close()
  return run_steps(exp, restored, 5, 12), meta


@pytest.mark.slow
@pytest.mark.parametrize("atc", [False, True])
def test_trains_and_resumes_bit_exactly_mid_period(tmp_path, atc):
  """Step 5 is in the middle of the one-peer exponential graph's period
  of 3 rounds; the tracker and the previous gradient are in the state."""
  require_devices(N)
  exp = experiment_lib.Experiment(_config(
      f"--config.tracking.adapt_then_combine={atc}"))
  losses = []
  state = run_steps(exp, exp.init_state(), 0, 12, losses)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert np.isfinite(exp.evaluate(state)["eval/loss"])
  resumed, meta = _resume_case(exp, tmp_path)
  for a, b in zip(jax.tree.leaves(to_host(state)),
                  jax.tree.leaves(to_host(resumed))):
    np.testing.assert_array_equal(a, b)
  run_meta.check_resumable(exp, dict(meta), "ckpt")
  # A resume in the other form is refused by name.
  with pytest.raises(ValueError, match="config.tracking.adapt_then_combine"):
    run_meta.check_resumable(
        exp, dict(meta, **{"tracking.adapt_then_combine": not atc}), "ckpt")


@pytest.mark.slow
def test_hlo_bytes_are_twice_the_parameter_gossip():
  """One-peer exponential graph on 8 workers: each round a worker sends
  its float32 parameters to one peer, ``4 P`` bytes, and its tracker (the
  gradients' shapes, float32) to the same peer: ``8 P`` per step, twice
  DAdam's on the same run."""
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  state = exp.init_state()
  comm = exp.communication(state, exp.get_batch(0))
  floats = sum(x.size for x in jax.tree.leaves(state.params)) // N
  assert comm["param_bytes"] == 4 * floats
  assert comm["bytes_per_step"] == 2 * 4 * floats
  dadam = experiment_lib.Experiment(_config(
      algorithm=("--config.algorithm=decentralized",
                 "--config.topology=one_peer_exp")))
  base = dadam.communication(dadam.init_state(), dadam.get_batch(0))
  assert comm["bytes_per_step"] == 2 * base["bytes_per_step"]


def test_the_runtime_model_prices_it_by_the_hand_count():
  """``gradient_tracking:topology=static_ring``: per step each worker sends
  its parameters and its tracker to its two ring neighbours, ``2 x 2 x 4
  P`` bytes, overlapped with the compute."""
  spec, fields = builders.spec_for_config(
      _config("--config.topology=static_ring"))
  c = Cluster(N, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,), **fields)
  m = make_method(spec, c)
  assert (m.kind, m.sync_share, m.overlap) == ("gossip", 2.0, True)
  per_step = 2 * 2 * 25e6 * 4
  assert bytes_per_iteration(spec, c, w).worker_bytes == pytest.approx(
      per_step, rel=1e-12)
  assert bytes_per_iteration("dadam:topology=static_ring", c,
                             w).worker_bytes == pytest.approx(per_step / 2)
  # No latency, 1 GB/s: the overlapped gossip (0.4 s) hides the 60 ms of
  # compute.
  t = simulate(m, c, w, steps=64, warmup=16)
  assert t == pytest.approx(closed_form(m, c, w).iteration_s, rel=1e-6)
  assert t == pytest.approx(per_step / 1e9, rel=1e-6)
  half = make_method("gradient_tracking:topology=ring,comm_dtype=bfloat16", c)
  assert bytes_per_iteration(half, c, w).worker_bytes == pytest.approx(
      2 * 25e6 * 2, rel=1e-12)
  assert make_method("gradient_tracking", c).name == (
      "gradient_tracking:topology=one_peer_exp")
  for bad, words in (
      ("gradient_tracking:compress=int8", "has no parameter 'compress'"),
      ("gradient_tracking:topology=star", "topology='star' is not a "
       "topology")):
    with pytest.raises(ValueError, match=words):
      make_method(bad, c)
  # The share of a gossip round is an uncompressed round's only.
  topo = m.topology
  with pytest.raises(ValueError, match="sync_share=2.0 needs uncompressed "
                     "gossip"):
    make_method(PricedMethod("x", "gossip", topo, overlap=False,
                             compress="int8", sync_share=2.0), c)
  with pytest.raises(ValueError, match="sync_share=0.5 must be a finite "
                     "number >= 1"):
    make_method(PricedMethod("x", "gossip", topo, sync_share=0.5), c)


@pytest.mark.integration
def test_the_tracker_gossip_overlaps_the_backward_on_h200():
  """Compiled for 8 x H200 without a GPU (requirements-gpu-compile.txt):
  the tracker's permute and the parameters' go out together (XLA combines
  them into one collective-permute of twice the parameter bytes), async,
  outside any conditional, with backward work in flight, as the parameter
  gossip of DAdam does (docs/gpu_overlap.md)."""
  from decentral_jax.tools import gpu_compile
  config = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.algorithm=gradient_tracking", "--config.optimizer.name=adamw",
       "--config.optimizer.accum_steps=1"))
  exp, [step] = gpu_compile.compile_steps(config, target="h200",
                                          topology="1x1x8",
                                          programs=[(0, "none")])
  assert exp.programs.gossip_rounds == "static"
  param_bytes = 1_739_264  # float32 gpt_tiny (tests/tools/test_overlap.py)
  big = step.report.select(min_bytes=param_bytes / 4)
  assert sum(c.bytes for c in big) == 2 * param_bytes, step.report.summary()
  for c in big:
    assert c.is_async and not c.in_conditional, step.report.summary()
    assert c.overlapped and c.backward > 0 and c.flops > 0, c
