"""The training loop in six steps: checkpoint, metrics, resume (fast tier).

A 1-layer, width-16 gpt_tiny on 8 workers (AccumAdamW with a 4-step window,
dropout, one_peer_exp gossip) trains 6 steps with a checkpoint, a log record
and an evaluation every 3. The loop's final state must be the state of 6
calls of the compiled step on batches 0..5; after checkpoint 6 is deleted,
the run resumes from checkpoint 3 (inside an accumulation window) and must
end bit for bit where the uninterrupted run ended, with its metrics records
redone, not duplicated. A finished run run again is evaluated and not
trained; a config with fewer steps than its checkpoint is refused before
anything is written. Longer runs, faults and command lines are in
tests/runner/test_train.py and tests/runner/test_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import metrics
from decentral_jax.runner import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8
STEPS = 6
TIMINGS = ("step_time_ms", "tokens_per_sec", "train_time_s")


def six_step_config():
  return config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
       "model.block_size=16", "model.dropout=0.1", "global_batch=16",
       f"n_workers={N}", "topology=one_peer_exp", "optimizer.accum_steps=4",
       f"steps={STEPS}", "schedule.warmup_steps=2", "eval_batches=1",
       "log_interval=3", "eval_interval=3", "checkpoint_interval=3"])


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))):
    assert x.dtype == y.dtype and np.array_equal(x, y)


def restore(exp, workdir: str, step: int):
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    steps = ckpt.all_steps()
    state, meta = ckpt.restore(step, exp.init_state())
  finally:
    ckpt.close()
  return steps, host(state), meta


@pytest.mark.slow  # a full training run: the slow tier
def test_six_steps_checkpoint_every_three_resume_bit_exact(tmp_path):
  require_devices(N)
  config = six_step_config()
  exp = experiment_lib.Experiment(config)
  workdir = str(tmp_path / "run")
  final = train.train_and_evaluate(config, workdir, experiment=exp)
  assert final["step"] == STEPS
  path = os.path.join(workdir, metrics.METRICS_FILE)
  first = metrics.read_jsonl(path)
  assert [r["step"] for r in first] == [0, 3, 6]
  assert all(np.isfinite(r["eval/loss"]) for r in first)
  assert first[-1]["eval/loss"] == final["eval/loss"]
  steps, done6, meta = restore(exp, workdir, STEPS)
  assert steps == [3, 6] and meta["step"] == STEPS

  # The loop is 6 steps of the compiled step on batches 0..5, evaluation
  # and checkpoints between them changing nothing.
  state = exp.init_state()
  for s in range(STEPS):
    state, _ = exp.train_step(state, exp.get_batch(s), s)
  assert_trees_equal(done6, state)

  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
  again = train.train_and_evaluate(config, workdir, experiment=exp)
  steps, resumed6, meta = restore(exp, workdir, STEPS)
  assert steps == [3, 6] and meta["step"] == STEPS
  assert_trees_equal(done6, resumed6)
  assert again["eval/loss"] == final["eval/loss"]
  second = metrics.read_jsonl(path)
  assert [r["step"] for r in second] == [0, 3, 6]  # 6 redone, not appended
  for a, b in zip(first, second):
    assert {k: v for k, v in a.items() if k not in TIMINGS} == \
        {k: v for k, v in b.items() if k not in TIMINGS}
  assert second[2]["train_time_s"] >= second[1]["train_time_s"] > 0


@pytest.mark.slow  # two training runs (the default run: ~3 min)
def test_finished_run_is_only_evaluated_and_a_shorter_one_refused(tmp_path,
                                                                  caplog):
  """A checkpoint of the last step (here the initial state saved as step
  6): the same command evaluates it and trains nothing; a config of fewer
  steps is refused before anything is written."""
  require_devices(N)
  config = six_step_config()
  exp = experiment_lib.Experiment(config)
  state = exp.init_state()
  workdir = str(tmp_path / "run")
  with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as ckpt:
    ckpt.save(STEPS, state, dict(run_meta.checkpoint_meta(exp, STEPS),
                                 train_time_s=1.0, metrics_window=None))
  want = exp.evaluate(state)["eval/loss"]

  def no_training(*args, **kwargs):
    raise AssertionError("a finished run trained")

  exp.train_step = no_training
  with caplog.at_level("INFO"):
    done = train.train_and_evaluate(config, workdir, experiment=exp)
  assert done["step"] == STEPS and done["eval/loss"] == want
  assert "the run already finished" in caplog.text

  shorter = six_step_config()
  with shorter.unlocked():
    shorter.steps = 4
  with pytest.raises(ValueError) as info:
    train.train_and_evaluate(shorter, workdir)
  message = str(info.value)
  assert "\n" not in message
  assert message.startswith(
      f"checkpoint {STEPS} in {os.path.join(workdir, 'checkpoints')} is past "
      "the end of this run (config.steps=4); set --config.steps=6 or more")
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    assert json.load(f)["steps"] == STEPS  # the run's record is kept


@pytest.mark.slow  # three training runs: the slow tier
def test_resumes_that_change_the_log_interval_name_a_hole_in_the_log(
    tmp_path, caplog):
  """3 steps logged every 3, resumed to 6 logged every step: the document
  records both segments and the log holds steps 0, 3, 4, 5, 6 (by hand).
  With step 4's record deleted, the resume to 7 names it in one warning."""
  require_devices(N)
  workdir = str(tmp_path / "run")

  def run(steps, log):
    config = config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        [*_SMALL, f"steps={steps}", f"log_interval={log}"])
    train.train_and_evaluate(config, workdir)

  caplog.set_level("WARNING")
  run(3, 3)
  run(6, 1)
  path = os.path.join(workdir, metrics.METRICS_FILE)
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 3, 4, 5, 6]
  _, _, meta = restore(experiment_lib.Experiment(six_step_config()),
                       workdir, 6)
  peak = float(six_step_config().schedule.peak_lr)  # unchanged: one peak
  # invocation 1 ran to its end (step 3): its segment is closed there
  assert meta["log_schedule"] == [[0, 3, 3, peak, 3], [3, 1, 3, peak]]
  assert not [r for r in caplog.records if re.search("(is|are) lost", r.getMessage())]
  lines = open(path).read().splitlines(keepends=True)
  with open(path, "w") as f:
    f.writelines(line for line in lines if json.loads(line)["step"] != 4)
  run(7, 1)
  [lost] = [r for r in caplog.records if re.search("(is|are) lost", r.getMessage())]
  assert "the record of step 4 is lost" in lost.getMessage()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 3, 5, 6, 7]


_SMALL = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
          "model.block_size=16", "model.dropout=0.1", "global_batch=16",
          f"n_workers={N}", "topology=one_peer_exp", "optimizer.accum_steps=4",
          "schedule.warmup_steps=2", "eval_batches=1", "eval_interval=3",
          "checkpoint_interval=3"]


@pytest.mark.slow  # three training runs: the slow tier
def test_a_log_resumed_with_changed_eval_intervals_holds_its_evaluations(
    tmp_path, caplog):
  """Steps 4 logged every 2, evaluated every 3 (0, 3 and its last step 4),
  then resumed to 7 logged every step, evaluated every 2 (6 and its last
  step 7): the runner writes the evaluation's keys (metrics_resume.EVAL_KEYS,
  a gpt: no accuracy) at steps 0, 3, 4, 6, 7 and nowhere else (by hand),
  and the resume to 8 keeps that log with no warning. With step 3's
  evaluation deleted, the resume to 8 moves the log aside, naming it."""
  from decentral_jax.runner import metrics_resume  # pylint: disable=g-import-not-at-top
  require_devices(N)
  workdir = str(tmp_path / "run")
  small = [f for f in _SMALL if not f.startswith(("eval_interval=",
                                                  "checkpoint_interval="))]

  def run(steps, log, ev):
    config = config_lib.load_config(
        os.path.join(ROOT, "configs", "gpt_tiny.py"),
        [*small, "checkpoint_interval=2", f"steps={steps}",
         f"log_interval={log}", f"eval_interval={ev}"])
    train.train_and_evaluate(config, workdir)

  caplog.set_level("WARNING")
  path = os.path.join(workdir, metrics.METRICS_FILE)
  run(4, 2, 3)
  run(7, 1, 2)
  records = metrics.read_jsonl(path)
  assert [r["step"] for r in records] == [0, 2, 3, 4, 5, 6, 7]
  evals = {r["step"]: sorted(k for k in r if k.startswith("eval/"))
           for r in records}
  assert [s for s, keys in evals.items() if keys] == [0, 3, 4, 6, 7]
  assert all(keys in ([], sorted(metrics_resume.EVAL_KEYS))
             for keys in evals.values())
  whole = open(path).read()
  run(7, 1, 2)  # finished: nothing trained, the log kept as it is
  assert open(path).read() == whole
  assert not [r for r in caplog.records if path in r.getMessage()]
  lines = whole.splitlines(keepends=True)
  with open(path, "w") as f:
    f.writelines(json.dumps({k: v for k, v in json.loads(line).items()
                             if json.loads(line)["step"] != 3
                             or not k.startswith("eval/")}) + "\n"
                 for line in lines)
  run(8, 1, 2)
  [moved] = [r.getMessage() for r in caplog.records
             if "moved it to" in r.getMessage()]
  assert ("line 3: eval/loss, eval/worker_loss_mean, eval/worker_loss_min"
          in moved and "at step 3, an evaluation of" in moved), moved
  assert [r["step"] for r in metrics.read_jsonl(path)] == [8]
