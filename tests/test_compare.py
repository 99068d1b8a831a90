"""experiments/compare.py: run set-up, the results table and the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np

from ml_collections import config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compare_module():
  spec = importlib.util.spec_from_file_location(
      "compare_under_test", os.path.join(ROOT, "experiments", "compare.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


compare = _compare_module()


def test_runs_cover_the_four_arms():
  base = config_dict.ConfigDict({
      "algorithm": "decentralized", "topology": "ring", "workers_per_node": 1,
      "optimizer": {"name": "adamw", "accum_steps": 1}})
  base.lock()
  got = [compare.run_config(base, run, accum_steps=4) for run in compare.RUNS]
  assert [(c.algorithm, c.optimizer.name, c.optimizer.accum_steps)
          for c in got] == [("all_reduce", "adamw", 1),
                            ("decentralized", "adamw", 1),
                            ("decentralized", "accum_adamw", 4),
                            ("decentralized", "accum_adamw", 4)]
  assert [c.topology for c in got[1:]] == ["one_peer_exp", "one_peer_exp",
                                           "alternating_exp_ring"]
  assert got[3].workers_per_node == 2 and got[2].workers_per_node == 1
  assert base.algorithm == "decentralized"  # the base config is not changed


def test_per_method_learning_rates():
  base = config_dict.ConfigDict({
      "algorithm": "decentralized", "topology": "ring", "workers_per_node": 1,
      "optimizer": {"name": "adamw", "accum_steps": 1},
      "schedule": {"peak_lr": 1.0, "final_lr": 0.5}})
  base.lock()
  tuned = [compare.run_config(base, run, 4, per_method_lr=True)
           for run in compare.RUNS]
  got = [(c.schedule.peak_lr, c.schedule.final_lr) for c in tuned]
  want = [(3e-3, 3e-4), (3e-3, 3e-4), (1.5e-3, 1.5e-4), (1.5e-3, 1.5e-4)]
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-12)
  same = [compare.run_config(base, run, 4) for run in compare.RUNS]
  assert {(c.schedule.peak_lr, c.schedule.final_lr) for c in same} == {(1.0, 0.5)}


def test_table_and_plots(tmp_path):
  rows, logs = [], []
  for k, run in enumerate(compare.RUNS[:2]):
    path = tmp_path / f"{run.name}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
      for step in (0, 10, 20):
        f.write(json.dumps({"step": step, "train_time_s": step * 0.1,
                            "eval/loss": 5.0 - step / 10 - k}) + "\n")
    logs.append((run, str(path)))
    rows.append((run, {"eval/loss": 3.0 - k, "eval/worker_excess_mean": 0.01,
                       "eval/worker_excess_max": 0.02 * k,
                       "consensus_distance": 0.5 * k, "step_time_ms": 12.5,
                       "tokens_per_sec": 2048.0}))
  table = compare.results_table(rows, "tokens").splitlines()
  assert table[0].count("|") == 7 and len(table) == 4
  assert table[2] == ("| All-Reduce AdamW | 3.0000 | +0.0100 / +0.0000 | 0 | "
                      "12.5 | 2,048 |")
  paths = compare.plot(logs, str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["loss_vs_step.png",
                                                  "loss_vs_time.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
