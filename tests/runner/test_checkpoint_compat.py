"""A checkpoint written before the package was split into subpackages resumes.

``tests/fixtures/checkpoint_57b480f/`` was written at commit 57b480f, the last
one with the flat module layout (``decentral_jax/accum_adam.py``,
``optim.py``, ``step.py``, ...): a 1-layer GPT of width 4 on 8 workers,
DAdam/AccumAdamW (``accum_steps`` 4, so step 6 leaves the accumulator half
way through a window) over ``one_peer_exp``, dropout 0.1, checkpointed after
step 6. Next to the run directory lie the restored state's fingerprint as the
old code saw it (``state_at_57b480f.npz``: every leaf's path, float64 sum and
sum of squares, and the full arrays of the small leaves and of the
``c_attn`` kernel with its moments and accumulator) and the metrics record
of step 7 written when the old code resumed the same checkpoint with
``--config.steps=7`` (``step7_at_57b480f.json``). They were made by this
script, run from a checkout of 57b480f with ``PYTHONPATH`` set to it and
``OUT=tests/fixtures/checkpoint_57b480f``::

  ARGS="--config configs/gpt_tiny.py --config.model.n_layer=1
    --config.model.n_embd=4 --config.model.n_head=2 --config.model.block_size=8
    --config.model.dropout=0.1 --config.global_batch=16 --config.eval_batches=1
    --config.eval_interval=0 --config.log_interval=1
    --config.checkpoint_interval=0 --config.keep_checkpoints=1
    --config.schedule.warmup_steps=2"
  python experiments/train.py $ARGS --config.steps=6 --workdir $OUT/run
  rm $OUT/run/run.lock
  cp -r $OUT/run $OUT/resumed
  python experiments/train.py $ARGS --config.steps=7 --workdir $OUT/resumed
  tail -n 1 $OUT/resumed/metrics.jsonl > $OUT/step7_at_57b480f.json
  rm -r $OUT/resumed
  python - $OUT <<'PY'
  import json, os, sys
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import jax, numpy as np
  from ml_collections import config_dict
  from decentral_jax import checkpoint, experiment
  run = os.path.join(sys.argv[1], "run")
  with open(os.path.join(run, "config.json")) as f:
    exp = experiment.Experiment(config_dict.ConfigDict(json.load(f)))
  ckpt = checkpoint.Checkpointer(os.path.join(run, "checkpoints"))
  state, _ = ckpt.restore(6, exp.init_state())
  ckpt.close()
  pairs = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
  paths = [jax.tree_util.keystr(p) for p, _ in pairs]
  leaves = [np.asarray(x) for _, x in pairs]
  kept = {f"leaf{i}": x for i, (p, x) in enumerate(zip(paths, leaves))
          if "c_attn" in p or x.size <= 16}
  np.savez_compressed(
      os.path.join(sys.argv[1], "state_at_57b480f.npz"), paths=np.array(paths),
      sums=[x.astype(np.float64).sum() for x in leaves],
      sumsq=[np.square(x.astype(np.float64)).sum() for x in leaves], **kept)
  PY

The test resumes a copy of the run directory with the current code the way
a user does (``train_and_evaluate`` on the same work directory with
``steps`` raised to 7), after checking the restored state against the
fingerprint through the same calls the resume makes.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import FIXTURES, require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = os.path.join(FIXTURES, "checkpoint_57b480f")
SAVED_STEP = 6
# The script's $ARGS (the config file aside).
OVERRIDES = (
    "--config.model.n_layer=1", "--config.model.n_embd=4",
    "--config.model.n_head=2", "--config.model.block_size=8",
    "--config.model.dropout=0.1", "--config.global_batch=16",
    "--config.eval_batches=1", "--config.eval_interval=0",
    "--config.log_interval=1", "--config.checkpoint_interval=0",
    "--config.keep_checkpoints=1", "--config.schedule.warmup_steps=2")
# Loss-like values of the old code's records; the same machine gives them to
# the bit, another CPU may round a few ulp differently. The worker excess
# losses are differences of two such values near 0: an absolute bound.
RTOL = 1e-5
EXCESS_ATOL = 1e-6


def old_config(steps: int):
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*OVERRIDES, f"--config.steps={steps}"))


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def experiment():
  require_devices(8)
  return experiment_lib.Experiment(old_config(SAVED_STEP + 1))


@pytest.fixture
def workdir(tmp_path):
  path = str(tmp_path / "run")
  shutil.copytree(os.path.join(OLD, "run"), path)
  return path


def restore_as_the_runner_does(exp, workdir: str):
  """The calls of the runner's resume: select, check the meta, restore."""
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 max_to_keep=1)
  try:
    step = ckpt.select_restore_step()
    assert step == SAVED_STEP
    meta = ckpt.restore_meta(step)
    run_meta.check_resumable(exp, meta, ckpt.directory)
    state, restored_meta = ckpt.restore(step, exp.init_state())
  finally:
    ckpt.close()
  assert restored_meta == meta
  return state, meta


@pytest.mark.slow  # a checkpoint restored (the default run: ~3 min)
def test_old_checkpoint_restores_the_saved_state(experiment, workdir):
  state, _ = restore_as_the_runner_does(experiment, workdir)
  saved = np.load(os.path.join(OLD, "state_at_57b480f.npz"))
  pairs = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
  # Same leaves under the same names (the optimizer-state structure of
  # AccumAdamW inside the gossip transform is unchanged) ...
  assert [jax.tree_util.keystr(p) for p, _ in pairs] == list(saved["paths"])
  leaves = [np.asarray(x) for _, x in pairs]
  # ... with the values the old code restored.
  np.testing.assert_array_equal(
      [x.astype(np.float64).sum() for x in leaves], saved["sums"])
  np.testing.assert_array_equal(
      [np.square(x.astype(np.float64)).sum() for x in leaves], saved["sumsq"])
  kept = [k for k in saved.files if k.startswith("leaf")]
  assert len(kept) == 9  # step, rng, 3 counts, c_attn kernel, mu, nu, acc
  for key in kept:
    x = leaves[int(key[len("leaf"):])]
    assert x.dtype == saved[key].dtype
    np.testing.assert_array_equal(x, saved[key])
  # Half a window of AccumAdamW at step 6 (T = 4): the accumulator is live.
  [acc] = [x for p, x in zip(saved["paths"], leaves)
           if "acc" in p and "c_attn" in p]
  assert np.abs(acc).max() > 0
  # The restored parameters evaluate to the old run's step-6 evaluation.
  old_eval = read_jsonl(os.path.join(OLD, "run", "metrics.jsonl"))[-1]
  assert old_eval["step"] == SAVED_STEP
  new_eval = experiment.evaluate(state)
  for key in ("eval/loss", "eval/worker_loss_mean", "eval/worker_loss_max"):
    np.testing.assert_allclose(new_eval[key], old_eval[key], rtol=RTOL,
                               err_msg=key)


@pytest.mark.slow
def test_checkpoint_meta_is_the_old_format_without_module_paths(
    experiment, workdir):
  _, old_meta = restore_as_the_runner_does(experiment, workdir)
  new_meta = run_meta.checkpoint_meta(experiment, SAVED_STEP)
  # The loop adds its timing and the metrics window to the run facts; every
  # fact the old code stored is stored the same way (a field added since
  # is allowed: check_resumable gives old checkpoints its default).
  run_facts = {k: v for k, v in old_meta.items()
               if k not in ("train_time_s", "metrics_window")}
  assert len(run_facts) == 23
  assert {k: new_meta.get(k) for k in run_facts} == run_facts
  assert json.loads(json.dumps(new_meta)) == new_meta  # plain JSON values
  # Neither the old checkpoint's files nor the new meta name a module: a
  # checkpoint does not depend on where the code lives.
  for text in [json.dumps(new_meta)] + [
      open(os.path.join(d, f), "rb").read().decode("latin-1")
      for d, _, files in os.walk(os.path.join(workdir, "checkpoints"))
      for f in files]:
    assert "decentral_jax" not in text and "<class" not in text


def test_the_old_format_is_read_with_its_keys_required(experiment):
  """The fixture's document (no ``config``, no ``lr``) is the older format:
  read as intact; without a key that format always holds (the seed, the
  model) it is damaged, never resumed with that field uncompared."""
  step_dir = os.path.join(OLD, "run", "checkpoints", str(SAVED_STEP))
  like = run_meta.checkpoint_meta(experiment, SAVED_STEP)
  assert run_meta.meta_file_error(step_dir, SAVED_STEP, like) is None
  with open(run_meta.meta_file(step_dir), encoding="utf-8") as f:
    meta = json.load(f)
  assert "config" not in meta and "lr" not in meta
  for key in ("seed", "model", "global_batch"):
    damaged = {k: v for k, v in meta.items() if k != key}
    assert run_meta.meta_error(damaged, SAVED_STEP, like) == (
        f"the document misses ['{key}'] (every checkpoint of its format "
        "holds them)")
  # The fields older versions lacked (beta_convention here) default.
  assert run_meta.meta_error({k: v for k, v in meta.items()
                              if k != "beta_convention"},
                             SAVED_STEP, like) is None


@pytest.mark.slow
def test_resuming_continues_as_the_old_code_did(experiment, workdir):
  config = experiment.config
  last = train.train_and_evaluate(config, workdir, experiment=experiment)
  with open(os.path.join(OLD, "step7_at_57b480f.json"), encoding="utf-8") as f:
    old = json.load(f)
  assert last["step"] == old["step"] == SAVED_STEP + 1
  records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, SAVED_STEP + 2))
  new = records[-1]
  # train/loss: the restored parameters and dropout key on batch 7;
  # eval/* and consensus_distance: after the update from the restored
  # moments, accumulator and gossip round.
  keys = sorted(k for k in old if k not in ("step", "train_time_s"))
  assert "train/loss" in keys and "eval/loss" in keys
  assert set(keys) <= set(new)
  for key in keys:
    np.testing.assert_allclose(new[key], old[key], rtol=RTOL, err_msg=key,
                               atol=EXCESS_ATOL if "excess" in key else 0)
  # The new code's checkpoint of step 7 names no module either.
  step7 = os.path.join(workdir, "checkpoints", str(SAVED_STEP + 1))
  for d, _, files in os.walk(step7):
    for f in files:
      with open(os.path.join(d, f), "rb") as fh:
        assert b"decentral_jax" not in fh.read()


def test_a_changed_schedule_on_resume_is_named_with_both_rates(
    experiment, caplog):
  """A resume whose config gives the checkpoint's step another learning
  rate (longer ``steps`` stretch the cosine) continues, saying so; the
  same rate says nothing; an old checkpoint without ``lr`` says nothing."""
  cfg = experiment.config
  warm, steps = int(cfg.schedule.warmup_steps), int(cfg.steps)
  peak, final = float(cfg.schedule.peak_lr), float(cfg.schedule.final_lr)
  # optax's warmup-cosine by hand at step 6 of 7 (2 warmup steps).
  frac = (SAVED_STEP - warm) / (steps - warm)
  by_hand = final + 0.5 * (peak - final) * (1 + np.cos(np.pi * frac))
  mine = run_meta.checkpoint_meta(experiment, SAVED_STEP)
  assert mine["lr"] == pytest.approx(by_hand, rel=1e-6)
  caplog.set_level("WARNING")
  for meta in (dict(mine), {k: v for k, v in mine.items() if k != "lr"}):
    run_meta.check_resumable(experiment, meta, "DIR")
  assert not caplog.records
  run_meta.check_resumable(experiment, {**mine, "lr": 1e-3}, "DIR")
  (line,) = [r.getMessage() for r in caplog.records]
  assert line == (
      f"the learning rate at step {SAVED_STEP} was 0.001 in the run that "
      f"wrote the checkpoint in DIR and is {mine['lr']:.4g} with this config "
      "(config.steps or config.schedule changed); training continues on "
      "this config's schedule.")
