"""The local-update methods in the runner: config, evaluation of theta, resume."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import TINY_RUN
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax import optim
from decentral_jax.runner import run_meta
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8
TINY = TINY_RUN
METHODS = {
    "local_sgd": ("--config.algorithm=local_sgd", "--config.sync_every=3"),
    "diloco": ("--config.algorithm=diloco", "--config.sync_every=3"),
    "decentralized_diloco": ("--config.algorithm=decentralized_diloco",
                             "--config.sync_every=3",
                             "--config.topology=ring"),
    "streaming_diloco": ("--config.algorithm=streaming_diloco",
                         "--config.sync_every=4", "--config.num_fragments=2",
                         "--config.overlap_steps=1",
                         "--config.merge_alpha=0.25"),
    "diloco_delayed": ("--config.algorithm=diloco", "--config.sync_every=3",
                       "--config.outer_overlap=delayed",
                       "--config.outer_latency=2"),
    "diloco_eager": ("--config.algorithm=diloco", "--config.sync_every=3",
                     "--config.outer_overlap=eager"),
    "streaming_eager": ("--config.algorithm=streaming_diloco",
                        "--config.sync_every=4", "--config.num_fragments=2",
                        "--config.merge_alpha=0.25",
                        "--config.outer_overlap=eager"),
    "local_dadam": ("--config.algorithm=decentralized",
                    "--config.gossip_every=3"),
    "sgp": ("--config.algorithm=sgp", "--config.topology=exponential",
            "--config.global_avg_interval=5"),
}


def _config(method, *extra):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*TINY, *METHODS[method], *extra))


_EXPERIMENTS = {}


def _experiment(method):
  """One Experiment per method for the whole module (one compile each)."""
  require_devices(N)
  if method not in _EXPERIMENTS:
    _EXPERIMENTS[method] = experiment_lib.Experiment(_config(method))
  return _EXPERIMENTS[method]


@pytest.fixture(scope="module", autouse=True)
def _release_experiments():
  yield
  _EXPERIMENTS.clear()


def _run(exp, state, start, stop):
  for s in range(start, stop):
    state, m = exp.train_step(state, exp.get_batch(s), s)
    jax.block_until_ready(m)
  return state


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _spread(params):
  """Largest difference between workers over all leaves."""
  return max(float(np.max(np.ptp(x, axis=0))) for x in
             jax.tree.leaves(_host(params)))


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_method_trains_syncs_and_resumes_exactly(method, tmp_path):
  """Synchronised at sync steps, apart between; resume mid-window is exact."""
  exp = _experiment(method)
  h = 4 if method.startswith("streaming") else 3
  state = _run(exp, exp.init_state(), 0, h)
  # XLA:CPU's all-reduce sums in a different order on each device, so the
  # synchronised values agree to rounding, not bit for bit.
  if method in ("local_sgd", "diloco"):
    assert _spread(state.params) < 1e-8  # all workers equal at the sync
  state = _run(exp, state, h, h + 1)
  assert _spread(state.params) > 1e-4  # local steps make them differ
  result = exp.evaluate(state)
  assert np.isfinite(result["eval/loss"])
  theta = optim.global_params(state.opt_state)
  if method in ("diloco", "streaming_diloco"):
    # The averaged model is theta (equal on all workers), not mean(x).
    assert _spread(theta) < 1e-8
  # Resume in the middle of a sync window (and, for streaming, between a
  # fragment's send at step 2 of the window and its merge).
  straight = _run(exp, state, h + 1, 9)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  part = _run(exp, _run(exp, exp.init_state(), 0, h + 1), h + 1, 6)
  ckpt.save(6, part, run_meta.checkpoint_meta(exp, 6))
  restored, _ = ckpt.restore(6, exp.init_state())
  ckpt.close()
  resumed = _run(exp, restored, 6, 9)
  for a, b in zip(jax.tree.leaves(_host(straight)),
                  jax.tree.leaves(_host(resumed))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_diloco_evaluates_theta():
  """eval/loss of DiLoCo is the loss of theta; the own models are x."""
  exp = _experiment("diloco")  # the compiled steps of the test above
  state = _run(exp, exp.init_state(), 0, 4)  # one step past the sync
  result = exp.evaluate(state)
  # The loss of theta on the whole eval set, computed directly.
  theta = jax.tree.map(lambda x: x[0],
                       _host(optim.global_params(state.opt_state)))
  inputs, targets = exp.task.eval_set
  # One compile of the task's loss (op by op it dispatches every primitive).
  loss = jax.jit(lambda p, x, y: exp.task.loss(p, (x, y), None)[0])
  want = np.mean([float(loss(theta, inputs[e], targets[e]))
                  for e in range(inputs.shape[0])])
  np.testing.assert_allclose(result["eval/loss"], want, rtol=1e-5)
  assert result["eval/worker_loss_mean"] != pytest.approx(
      result["eval/loss_subset"], abs=1e-7)  # own models x differ from theta


@pytest.mark.parametrize("extra,match", [
    (("--config.algorithm=streaming_diloco", "--config.sync_every=4",
      "--config.num_fragments=5"), "num_fragments"),
    (("--config.algorithm=streaming_diloco", "--config.sync_every=4",
      "--config.num_fragments=2", "--config.overlap_steps=2"),
     "overlap_steps"),
    (("--config.algorithm=diloco", "--config.sync_every=0"), "sync_every"),
    (("--config.algorithm=streaming_diloco", "--config.merge_alpha=1.5"),
     "merge_alpha"),
    (("--config.outer_optimizer.name=lamb",), "outer_optimizer.name"),
    (("--config.algorithm=decentralized_diloco",
      "--config.gossip_rounds=static"), "gossip_rounds"),
    (("--config.algorithm=diloco", "--config.global_avg_interval=5"),
     "global_avg_interval"),
    (("--config.algorithm=diloco", "--config.outer_overlap=eagre"),
     "unknown config.outer_overlap=.eagre."),
    (("--config.algorithm=local_sgd", "--config.outer_overlap=eager"),
     "config.outer_overlap='eager' has no effect with config.algorithm="
     "'local_sgd'"),
    (("--config.algorithm=streaming_diloco", "--config.sync_every=4",
      "--config.num_fragments=2", "--config.overlap_steps=1",
      "--config.outer_overlap=eager"),
     "config.overlap_steps=1 and config.outer_overlap='eager' both"),
    (("--config.algorithm=diloco", "--config.outer_latency=2"),
     "config.outer_latency=2 has no effect with config.outer_overlap='none'"),
    (("--config.algorithm=diloco", "--config.outer_overlap=delayed",
      "--config.outer_latency=0"), "config.outer_latency"),
    (("--config.algorithm=decentralized_diloco", "--config.topology=ring",
      "--config.outer_overlap=delayed"),
     "config.trickle_reduction=True needs a topology with one distinct"),
    (("--config.algorithm=diloco", "--config.outer_overlap=eager",
      "--config.faults.enabled=True"),
     "config.outer_overlap='eager' and config.faults.enabled=True"),
    # 100000 x 100000 slices in flight: the library refused it only once
    # the experiment was built, naming its own arguments.
    (("--config.algorithm=diloco", "--config.outer_overlap=delayed",
      "--config.outer_latency=100000", "--config.sync_every=100000"),
     r"config.outer_latency=100000 x config.sync_every=100000 = "
     r"10000000000 in-flight slices, above 67108864"),
    (("--config.algorithm=streaming_diloco", "--config.outer_overlap=eager",
      "--config.outer_latency=8193", "--config.sync_every=4096",
      "--config.num_fragments=2"),
     r"x config.num_fragments = 67117056 in-flight slices"),
])
def test_bad_local_update_fields_name_the_field(extra, match):
  config = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"), extra)
  with pytest.raises(ValueError, match=match):
    validation.check_config(config)


def test_resume_refuses_a_changed_sync_schedule():
  """A checkpoint's sync period, fragments and outer optimizer must match."""
  exp = _experiment("streaming_diloco")
  meta = run_meta.checkpoint_meta(exp, 5)
  run_meta.check_resumable(exp, dict(meta), "ckpt")  # same config: accepted
  for key, value, field in (
      ("sync_every", 8, "config.sync_every"),
      ("num_fragments", 1, "config.num_fragments"),
      ("overlap_steps", 0, "config.overlap_steps"),
      ("merge_alpha", 0.5, "config.merge_alpha"),
      ("outer_optimizer", dict(meta["outer_optimizer"], lr=0.1),
       "config.outer_optimizer"),
      ("comm_dtype", "bfloat16", "config.comm_dtype"),
      ("outer_overlap", "eager", "config.outer_overlap")):
    with pytest.raises(ValueError, match=field):
      run_meta.check_resumable(exp, dict(meta, **{key: value}), "ckpt")
  # Fields Streaming DiLoCo does not read changed nothing in the checkpoint.
  run_meta.check_resumable(
      exp, dict(meta, gossip_every=2, workers_per_node=2), "ckpt")
  with pytest.raises(ValueError, match="config.algorithm"):
    run_meta.check_resumable(
        exp, dict(meta, gossip_every=2, algorithm="decentralized"), "ckpt")


def test_warning_when_the_run_ends_inside_a_sync_window():
  """eval/loss reports theta: a run ending mid-window is warned about."""
  ends_mid = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.algorithm=diloco", "--config.sync_every=10",
       "--config.steps=25"))
  assert any("not a multiple of config.sync_every" in w
             for w in validation.config_warnings(ends_mid))
  whole = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.algorithm=diloco", "--config.sync_every=10",
       "--config.steps=300"))
  assert not any("sync_every" in w for w in validation.config_warnings(whole))
  # 30 rounds: a delayed outer step 30 rounds late never lands (theta stays
  # at its initial value); 29 rounds late lands once.
  def latency_warnings(latency):
    late = config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        ("--config.algorithm=diloco", "--config.sync_every=10",
         "--config.steps=300", "--config.outer_overlap=delayed",
         f"--config.outer_latency={latency}"))
    return [w for w in validation.config_warnings(late)
            if "outer_latency" in w]
  assert len(latency_warnings(30)) == 1
  assert "theta never changes" in latency_warnings(30)[0]
  assert latency_warnings(29) == []
  independent = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ("--config.algorithm=streaming_diloco", "--config.sync_every=10",
       "--config.steps=300", "--config.merge_alpha=1"))
  assert [w for w in validation.config_warnings(independent)
          if "merge_alpha" in w] == [
              "config.merge_alpha=1: every worker keeps its own fragment and "
              "never takes the synced theta, so the workers train "
              "independently; use a value below 1."]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco_delayed", "diloco_eager",
                                    "streaming_eager"])
def test_overlap_resumes_mid_round_and_evaluates_mean_theta(method,
                                                             tmp_path):
  """A checkpoint after step 4 resumes bit for bit: mid-round for H = 3
  (one slice of the trickled reduction done; the generic test above
  resumes at the sync step 6), and for Streaming DiLoCo (H = 4, fragments
  synced at t % 4 = 0 and 2) a sync step of one fragment and mid-round of
  the other. eval/loss is the loss of the worker mean of theta_m
  (per-worker with eager, equal with delayed)."""
  exp = _experiment(method)
  straight = _run(exp, exp.init_state(), 0, 9)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  ckpt.save(4, _run(exp, exp.init_state(), 0, 4),
            run_meta.checkpoint_meta(exp, 4))
  restored, _ = ckpt.restore(4, exp.init_state())
  ckpt.close()
  resumed = _run(exp, restored, 4, 9)
  for a, b in zip(jax.tree.leaves(_host(straight)),
                  jax.tree.leaves(_host(resumed))):
    np.testing.assert_array_equal(a, b)
  theta = _host(optim.global_params(straight.opt_state))
  if method != "diloco_delayed":
    assert _spread(theta) > 1e-6  # each worker its own theta_m
  else:
    assert _spread(theta) < 1e-8
  mean_theta = jax.tree.map(lambda x: np.mean(x, axis=0), theta)
  inputs, targets = exp.task.eval_set
  loss = jax.jit(lambda p, x, y: exp.task.loss(p, (x, y), None)[0])
  want = np.mean([float(loss(mean_theta, inputs[e], targets[e]))
                  for e in range(inputs.shape[0])])
  np.testing.assert_allclose(exp.evaluate(straight)["eval/loss"], want,
                             rtol=1e-5)
