"""experiments/compare.py: run set-up, the results table and the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
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
  got = [compare.run_config(base, run, accum_steps=4)
         for run in compare.select_runs(",".join(compare.DEFAULT_METHODS))]
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
           for run in compare.RUNS[:4]]
  got = [(c.schedule.peak_lr, c.schedule.final_lr) for c in tuned]
  want = [(3e-3, 3e-4), (3e-3, 3e-4), (1.5e-3, 1.5e-4), (1.5e-3, 1.5e-4)]
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-12)
  same = [compare.run_config(base, run, 4) for run in compare.RUNS[:4]]
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
                       "tokens_per_sec": 2048.0, "comm/ratio": 1.75,
                       "comm/bytes_per_step": 3_043_712.0}))
  table = compare.results_table(rows, "tokens").splitlines()
  assert table[0].count("|") == 8 and len(table) == 4
  assert table[2] == ("| All-Reduce AdamW | 3.0000 | +0.0100 / +0.0000 | 0 | "
                      "1.750 (3.04) | 12.5 | 2,048 |")
  paths = compare.plot(logs, str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["loss_vs_step.png",
                                                  "loss_vs_time.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_methods_flag_selects_and_validates():
  assert [r.name for r in compare.select_runs("diloco, sgp")] == ["diloco",
                                                                  "sgp"]
  assert compare.select_runs("all") == compare.RUNS
  for bad, match in (("diloco,nope", "unknown method"),
                     ("sgp,sgp", "more than once"), (" , ", "none given")):
    try:
      compare.select_runs(bad)
    except ValueError as e:
      assert match in str(e) and "--methods" in str(e)
    else:
      raise AssertionError(f"--methods={bad!r} was accepted")


def test_every_method_arm_is_a_valid_config_with_its_fields():
  from decentral_jax import config as config_lib
  base = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"))
  arms = dict((run.name, config) for run, config in compare.arm_configs(
      base, 4, per_method_lr=True, runs=compare.RUNS))
  assert len(arms) == len(compare.RUNS) == len(compare.TUNED_PEAK_LR)
  s = arms["streaming_diloco"]
  assert (s.algorithm, s.sync_every, s.num_fragments, s.overlap_steps,
          s.merge_alpha) == ("streaming_diloco", 10, 2, 1, 0.5)
  assert (arms["local_dadam"].gossip_every, arms["dadam"].gossip_every) == (5,
                                                                           1)
  assert arms["sgp"].topology == "one_peer_exp"
  assert base.sync_every == 10 and base.algorithm == "decentralized"


def test_sent_per_step_is_read_from_the_hlo():
  # 8 workers, DiLoCo with H = 5: the ring figure 2 (n - 1) / n = 1.75 x the
  # parameter bytes once per 5 steps (0.35); the consensus-distance
  # diagnostic apart: on every 10th (logging) step a mean of every
  # parameter leaf and of the float32 total, 1.75 x (params + 4 B).
  from decentral_jax import config as config_lib
  from decentral_jax import experiment
  config = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["--config.algorithm=diloco", "--config.sync_every=5",
       "--config.optimizer.name=adamw", "--config.optimizer.accum_steps=1",
       "--config.model.n_layer=1", "--config.model.n_embd=16",
       "--config.model.n_head=2", "--config.steps=10",
       "--config.log_interval=10"])
  exp = experiment.Experiment(config)
  got = exp.communication(exp.init_state(), exp.get_batch(0))
  params = exp.init_state().params
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) // 8
  assert got["param_bytes"] == param_bytes
  np.testing.assert_allclose(got["bytes_per_step"], 1.75 / 5 * param_bytes,
                             rtol=1e-12)
  np.testing.assert_allclose(got["diagnostics_bytes_per_step"],
                             1.75 / 10 * (param_bytes + 4), rtol=1e-12)
  assert compare.results_table(
      [(compare.METHODS["diloco"], {
          "eval/loss": 1.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 0.0,
          "comm/ratio": got["ratio"],
          "comm/bytes_per_step": got["bytes_per_step"]})],
      "tokens").splitlines()[2].count("| 0.350 (") == 1


def test_overrides_of_a_method_s_own_fields_are_named():
  runs = compare.select_runs("diloco,sgp")
  lines = compare.overridden_fields(
      ["--config.sync_every=5", "--config.topology=ring",
       "--config.steps=4"], runs)
  assert len(lines) == 2
  assert "--config.sync_every=5 is ignored by diloco" in lines[0]
  assert "--config.topology=ring is ignored by diloco, sgp" in lines[1]
