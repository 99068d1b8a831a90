"""``decentral-jax learners --config ... --workdir DIR`` on Ray: the runner's
records of learners that train a runner config, and a resume with another
number of learners (one Ray session on 127.0.0.1 for the file)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from decentral_jax.runner import metrics as metrics_lib
from decentral_jax.tools import cli
from decentral_jax.tools.learners import flags as flags_lib
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib

pytestmark = pytest.mark.slow

TINY = ("algorithm=diloco", "optimizer.name=adamw", "optimizer.accum_steps=1",
        "model.block_size=16", "model.n_layer=1", "model.n_embd=16",
        "model.n_head=2", "global_batch=4", "steps=12", "sync_every=3",
        "eval_batches=1", "schedule.warmup_steps=2")


def _learners(workdir, k, periods):
  return cli.main(["learners", "--config", "configs/gpt_tiny.py",
                   *(f"--config.{o}" for o in TINY), "--learners", str(k),
                   "--periods", str(periods), "--workdir", str(workdir),
                   "--eval-every", "2", "--every", "30", "--timeout", "300"])


def test_records_and_a_resume_with_fewer_learners(ray_session, tmp_path):
  """2 learners for 2 periods, then the same workdir resumed with 1
  learner to 4 periods: metrics.jsonl has the runner's keys, per-learner
  tokens and the merged learners of every period; learners.json says the
  sharding was recomputed; the checkpoint's theta is the one evaluated."""
  del ray_session
  assert _learners(tmp_path, 2, 2) == 0
  assert _learners(tmp_path, 1, 4) == 0
  records = metrics_lib.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 3, 6, 9, 12]
  # 3 inner steps of global_batch 4 x 16 tokens, split over K learners.
  assert [r["tokens"] for r in records] == [0, 192, 384, 576, 768]
  assert [r.get("learners/merged") for r in records] == [None, 2, 2, 1, 1]
  assert records[1]["learners/tokens/0"] == records[1]["learners/tokens/1"]
  assert records[3]["learners/tokens/0"] == 192
  assert "learners/tokens/1" not in records[3]
  evals = [r["step"] for r in records if "eval/loss" in r]
  assert evals == [0, 6, 12]  # every 2 periods, and the end of each run
  assert all("lr" in r for r in records[1:])
  assert all("train/loss" in r for r in records[1:] if "eval/loss" in r)
  assert records[-1]["eval/loss"] < records[0]["eval/loss"] - 0.5
  times = [r["train_time_s"] for r in records]
  assert times == sorted(times)  # the resumed run's time continues
  meta = json.loads((tmp_path / "learners.json").read_text())
  assert meta["learners"] == 1 and meta["config"]["n_workers"] == 1
  assert [s["learners"] for s in meta["segments"]] == [2, 1]
  assert meta["segments"][1]["from_period"] == 2
  assert meta["segments"][1]["sharding"].startswith("recomputed: 2 -> 1")
  assert json.loads((tmp_path / "config.json").read_text())[
      "algorithm"] == "diloco"
  # The synchronizer's newest checkpoint: period 4, the theta evaluated.
  # (the run the command built: the config's absolute path, its overrides)
  # (gpt_tiny's AdamW peak 3e-3 and final 3e-4; TINY's warmup and steps)
  run = spec_lib.RunSpec(problem="runner", shards=1, sync_every=3, periods=4,
                         inner="adamw", inner_lr=3e-3, inner_schedule=(
                             "warmup_cosine, warmup 2, to 0.0003 at step 12"),
                         problem_args=(
                             ("config", flags_lib.config_source(
                                 "configs/gpt_tiny.py")),
                             ("overrides", tuple(f"--config.{o}"
                                                 for o in TINY))))
  sync = sync_lib.Synchronizer(run, str(tmp_path / "checkpoints"))
  sync.close()
  assert sync.resumed and sync.version == 4
  assert sync.log["merged_with"] == [[0, 1], [0, 1], [0], [0]]
  task = problems.build(run.problem, 1, run.problem_args).runner
  np.testing.assert_allclose(task.evaluate(sync.theta)["eval/loss"],
                             records[-1]["eval/loss"], rtol=1e-6)
