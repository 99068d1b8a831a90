"""DES-LOC-Adam in the runner: config fields, training, resume mid-period,
its HLO bytes against the hand count and its runtime-model price."""

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
from decentral_jax.runner import builders
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
N = 8
# K_x = 2, K_u = 4, K_v = 8 (the worked example's periods).
DESLOC = ("--config.algorithm=desloc_adam", "--config.sync_every=2",
          "--config.sync_every_u=4", "--config.sync_every_v=8")


def _config(*extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY_RUN, *DESLOC, *extra))


def test_config_fields_are_validated_by_name():
  config = _config()
  validation.check_config(config)
  assert methods.display_name(config) == "DES-LOC"
  assert builders.spec_for_config(config)[0] == "desloc:Kx=2,Ku=4,Kv=8"
  for extra, words in (
      (("--config.sync_every_u=0",), "config.sync_every_u must be an integer "
       "in [1, 2147483647]"),
      (("--config.sync_every_v=2147483648",), "config.sync_every_v must be "
       "an integer in"),
      (("--config.optimizer.name=accum_adamw",),
       "config.optimizer.name='accum_adamw' with config.algorithm="
       "'desloc_adam'"),
      (("--config.topology=ring",), "config.topology='ring' has no effect "
       "with config.algorithm='desloc_adam'")):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
      validation.check_config(_config(*extra))
  # Another method refuses the moments' periods.
  with pytest.raises(ValueError, match="config.sync_every_u=4 has no effect "
                     "with config.algorithm='local_sgd'"):
    validation.check_config(config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        ("--config.algorithm=local_sgd", "--config.sync_every_u=4")))
  assert any("sync_every_u=1" in w for w in validation.config_warnings(
      _config("--config.sync_every_u=1")))


@pytest.mark.slow
def test_trains_and_resumes_bit_exactly_mid_period(tmp_path):
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  losses = []
  state = run_steps(exp, exp.init_state(), 0, 12, losses)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
  assert np.isfinite(exp.evaluate(state)["eval/loss"])
  # Straight 0..11 against a checkpoint after step 5 (mid K_u and K_v
  # periods, one step after a parameter sync) resumed to 12.
  resumed, meta = resume_mid_run(exp, tmp_path / "ckpt", 5, 12)
  assert_same_tree(state, resumed)
  # A resume with other moment periods is refused by name.
  run_meta.check_resumable(exp, dict(meta), "ckpt")
  for key in ("sync_every_u", "sync_every_v", "sync_every"):
    with pytest.raises(ValueError, match=f"config.{key}="):
      run_meta.check_resumable(exp, dict(meta, **{key: 16}), "ckpt")


@pytest.mark.slow
def test_hlo_bytes_equal_the_hand_count():
  """An all-reduce of |x| every 2 steps, |u| every 4 and |v| every 8: each
  ``2 (n - 1) / n`` x its float32 bytes, so ``2 (n-1)/n * 4 P * (1/2 + 1/4
  + 1/8)`` per step for ``P`` parameters per worker."""
  require_devices(N)
  exp = experiment_lib.Experiment(_config())
  state = exp.init_state()
  comm = exp.communication(state, exp.get_batch(0))
  floats = sum(x.size for x in jax.tree.leaves(state.params)) // N
  assert comm["param_bytes"] == 4 * floats
  want = 2 * (N - 1) / N * 4 * floats * (1 / 2 + 1 / 4 + 1 / 8)
  np.testing.assert_allclose(comm["bytes_per_step"], want, rtol=1e-12)


def test_the_runtime_model_prices_it_by_the_hand_count():
  """``desloc:Kx=2,Ku=4,Kv=8``: per step the all-reduce bytes of |x| / 2 +
  |u| / 4 + |v| / 8, one blocking sync every 2 steps."""
  spec, fields = builders.spec_for_config(_config())
  c = Cluster(N, 1, 0.0, 10e9, 0.0, 1e9, multi_node="tree")
  w = Workload(25e6, 0.02, 0.04, bucket_shares=(1.0,), **fields)
  m = make_method(spec, c)
  assert (m.kind, m.period, m.sync_share) == ("local", 2, 1.75)
  copy = 25e6 * 4  # float32 parameters
  per_step = 2 * (N - 1) / N * copy * (1 / 2 + 1 / 4 + 1 / 8)
  assert bytes_per_iteration(spec, c, w).worker_bytes == pytest.approx(
      per_step, rel=1e-12)
  # No latency, 1 GB/s, 60 ms of compute: a step is the compute plus the
  # bytes' time (the sync blocks).
  t = simulate(m, c, w, steps=64, warmup=16)
  assert t == pytest.approx(closed_form(m, c, w).iteration_s, rel=1e-6)
  assert t == pytest.approx(0.06 + per_step / 1e9, rel=1e-6)
  assert make_method("desloc:Kx=16", c).name == "desloc:Kx=16,Ku=48,Kv=96"
  with pytest.raises(ValueError, match="Ku='0' must be an integer >= 1"):
    make_method("desloc:Kx=4,Ku=0", c)
  # The moments' share is a local exact all-reduce's only.
  for kwargs, words in (
      (dict(kind="local", period=2, sync_share=0.5),
       "sync_share=0.5 must be a finite number >= 1"),
      (dict(kind="local", period=2, fragments=2, sync_share=2.0),
       "sync_share=2.0 needs the exact uncompressed all-reduce"),
      (dict(kind="all_reduce", sync_share=2.0),
       "sync_share do not apply to kind 'all_reduce'")):
    with pytest.raises(ValueError, match=words):
      make_method(PricedMethod("x", **kwargs), c)
