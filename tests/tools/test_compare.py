"""decentral_jax.tools.compare: run set-up, the results table and the plots.

The pricing on clusters (tools/compare/pricing.py) and the answer
(tools/compare/answer.py) are in tests/tools/test_compare_answer.py.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from ml_collections import config_dict

from decentral_jax.runner import builders
from decentral_jax.runner import methods
from decentral_jax.tools import compare
from decentral_jax.tools.compare import flags as compare_flags
from decentral_jax.tools.compare import job as job_lib
from decentral_jax.tools.compare import record as record_lib
from decentral_jax.tools.compare import plots
from decentral_jax.tools.compare import progress
from decentral_jax.tools.compare import reference
from decentral_jax.tools.compare import results
from decentral_jax.tools.compare import runs as runs_lib

from helpers import agreeing_evaluation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _base(**schedule):
  base = config_dict.ConfigDict({
      "algorithm": "decentralized", "topology": "ring", "workers_per_node": 1,
      "optimizer": {"name": "adamw", "accum_steps": 1,
                    "beta_convention": "per_window"},
      "sync_every": 1, "gossip_every": 1,
      "outer_optimizer": {"lr": 0.7}, "compression": {}, **schedule})
  methods.add_declared_fields(base)  # the method homes' own fields
  base.lock()
  return base


def test_default_and_full_methods():
  # The quick default: one method per kind of communication (every step
  # All-Reduce, every step gossip, a sync every 10 steps, twice).
  assert runs_lib.DEFAULT_METHODS == ("all_reduce", "dadam", "diloco",
                                     "local_sgd")
  base = _base()
  got = [runs_lib.run_config(base, run, accum_steps=4)
         for run in runs_lib.select_runs(",".join(runs_lib.FULL_METHODS))]
  assert [(c.algorithm, c.optimizer.name, c.optimizer.accum_steps)
          for c in got] == [("all_reduce", "adamw", 1),
                            ("decentralized", "adamw", 1),
                            ("decentralized", "accum_adamw", 4),
                            ("diloco", "adamw", 1),
                            ("local_sgd", "adamw", 1),
                            ("decentralized", "adamw", 1)]
  assert [c.topology for c in got[1:3]] == ["one_peer_exp", "one_peer_exp"]
  # AccumAdamW's best measured setting: horizon-matched betas.
  assert got[2].optimizer.beta_convention == "per_step"
  assert [c.sync_every for c in got[3:5]] == [10, 10]
  assert got[3].outer_optimizer.lr == 0.3 and got[5].gossip_every == 5
  paper = runs_lib.run_config(base, runs_lib.METHODS["accum_adamw_paper"], 4)
  assert paper.optimizer.beta_convention == "per_window"
  aer = runs_lib.run_config(base, runs_lib.METHODS["accum_adamw_aer"], 4)
  assert (aer.topology, aer.workers_per_node) == ("alternating_exp_ring", 2)
  assert base.algorithm == "decentralized"  # the base config is not changed


def test_labels_are_the_method_homes_display_names_and_the_runs_settings():
  from decentral_jax import method_names
  from decentral_jax.runner import methods
  base = _base()
  for run in runs_lib.RUNS:  # the home's name of the run's own config
    name = methods.display_name(runs_lib.run_config(base, run, 4))
    assert run.label == name or run.label.startswith(name + ", "), run
  # The names predict prints for the same methods.
  assert [runs_lib.METHODS[m].label for m in ("all_reduce", "dadam", "sgp")
          ] == [method_names.label(k) for k in ("all_reduce",
                                                "one_peer_exp", "sgp")]
  assert [runs_lib.METHODS[m].label for m in (
      "diloco", "accum_adamw_aer", "streaming_diloco", "local_dadam")] == [
          "DiLoCo, H=10, Nesterov lr 0.3",
          "AccumAdamW (AER), 2 workers/node, horizon-matched betas",
          "Streaming DiLoCo, H=10, P=2, tau=1, alpha=0.5, Nesterov lr 0.3",
          "DAdam (Exp), gossip every 5"]


def test_per_method_learning_rates():
  base = _base(schedule={"peak_lr": 1.0, "final_lr": 0.5})
  names = ("all_reduce", "dadam", "accum_adamw", "accum_adamw_paper",
           "local_sgd", "diloco", "local_dadam")
  tuned = [runs_lib.run_config(base, runs_lib.METHODS[x], 4, per_method_lr=True)
           for x in names]
  got = [(c.schedule.peak_lr, c.schedule.final_lr) for c in tuned]
  # The protocol's choices, BENCHMARKS.md section 10 (main job's setting).
  want = [(6e-3, 6e-4), (6e-3, 6e-4), (3e-3, 3e-4), (1.5e-3, 1.5e-4),
          (3e-3, 3e-4), (3e-3, 3e-4), (3e-3, 3e-4)]
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-12)
  same = [runs_lib.run_config(base, runs_lib.METHODS[x], 4) for x in names]
  assert {(c.schedule.peak_lr, c.schedule.final_lr) for c in same} == {(1.0, 0.5)}
  # A constant schedule does not read final_lr: it keeps its value (which
  # check_config refuses unless it is the default).
  flat = _base(schedule={"name": "constant", "peak_lr": 1.0,
                         "final_lr": 0.5})
  c = runs_lib.run_config(flat, runs_lib.METHODS["dadam"], 4,
                          per_method_lr=True)
  assert (c.schedule.peak_lr, c.schedule.final_lr) == (6e-3, 0.5)


def test_table_and_plots(tmp_path):
  rows, logs = [], []
  for k, run in enumerate(runs_lib.RUNS[:2]):
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
  table = results.results_table(rows, "tokens").splitlines()
  assert table[0].count("|") == 8 and len(table) == 4
  assert table[2] == ("| All-Reduce | 3.0000 | +0.0100 / +0.0000 | 0 | "
                      "1.750 (3.04) | 12.5 | 2,048 |")
  # This machine's timings: dropped by default, labelled when kept.
  default = results.timing_columns("\n".join(table), keep=False).splitlines()
  assert default[0] == ("| run | val loss, averaged model | workers' own "
                        "models: extra loss, mean / max | consensus distance "
                        "| sent per step, x params (MB) |")
  assert default[1] == "|---|---|---|---|---|"
  assert default[2] == ("| All-Reduce | 3.0000 | +0.0100 / +0.0000 | 0 "
                        "| 1.750 (3.04) |")
  kept = results.timing_columns("\n".join(table), keep=True).splitlines()
  assert kept[0].endswith("| this CPU's ms/step (load-dependent, not a "
                          "ranking) | this CPU's tokens/s (load-dependent, "
                          "not a ranking) |")
  assert kept[2] == table[2] and kept[1] == table[1]
  paths = plots.plot(logs, str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["loss_vs_step.png"]
  paths = plots.plot(logs, str(tmp_path), cpu_timing=True)
  assert [os.path.basename(p) for p in paths] == [
      "loss_vs_step.png", "cpu_loss_vs_time_this_machine.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_methods_flag_selects_and_validates():
  assert [r.name for r in runs_lib.select_runs("diloco, sgp")] == ["diloco",
                                                                  "sgp"]
  assert runs_lib.select_runs("all") == runs_lib.RUNS
  for bad, match in (
      ("diloco,nope", "--methods='diloco,nope': unknown method(s) 'nope'"),
      ("sgp,sgp", "--methods='sgp,sgp' names sgp more than once"),
      (" , ", "--methods=' , ' names no method"),
      ("", "--methods='' names no method"),
      ("dadam,,sgp", "--methods='dadam,,sgp': entry 2 is empty"),
      ("dadam,sgp,", "--methods='dadam,sgp,': entry 3 is empty"),
      ("all,dadam", "--methods='all,dadam': 'all' selects every method and "
       "takes no other names"),
      ("--outdir=x", "--methods needs a value, got the flag '--outdir=x'")):
    try:
      runs_lib.select_runs(bad)
    except ValueError as e:
      assert str(e).startswith(match) and "\n" not in str(e), str(e)
    else:
      raise AssertionError(f"--methods={bad!r} was accepted")


def test_errors_name_the_flags_the_user_typed(tmp_path, monkeypatch, capsys):
  from decentral_jax.runner import config as config_lib
  # The topology and nodes are the method's own; --config.n_workers is not.
  base = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["--config.n_workers=6", "--config.global_batch=60"])
  with pytest.raises(ValueError) as info:
    runs_lib.arm_configs(base, 4, False,
                         runs_lib.select_runs("accum_adamw_aer"))
  message = str(info.value)
  assert message.startswith(
      "run 'accum_adamw_aer' (AccumAdamW (AER), 2 workers/node, "
      "horizon-matched betas): its topology alternating_exp_ring with 2 "
      "worker(s) per node does not fit --config.n_workers=6: "), message
  assert "config.topology=" not in message and "\n" not in message
  # Too many simulated devices: the override that asked for them.
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  assert compare.main(
      [f"--outdir={tmp_path / 'out'}", "--methods=dadam",
       "--config.n_workers=2048", "--config.global_batch=2048"]) == 2
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith("error: --config.n_workers=2048 asks for 2048 "
                         "simulated CPU devices"), line
  assert not (tmp_path / "out").exists()


def test_every_method_arm_is_a_valid_config_with_its_fields():
  from decentral_jax.runner import config as config_lib
  base = config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"))
  arms = dict((run.name, config) for run, config in runs_lib.arm_configs(
      base, 4, per_method_lr=True, runs=runs_lib.RUNS))
  assert len(arms) == len(runs_lib.RUNS)
  # Each arm has its tuned lr, except a home's arm declared without one
  # (Arm.peak_lr None: the config's lr).
  untuned = {arm.name for m in methods.ALGORITHMS.values() for arm in m.arms
             if arm.peak_lr is None}
  assert set(runs_lib.TUNED_PEAK_LR) == set(arms) - untuned
  for name, config in arms.items():
    want = runs_lib.TUNED_PEAK_LR.get(name, base.schedule.peak_lr)
    assert config.schedule.peak_lr == want, name
  s = arms["streaming_diloco"]
  assert (s.algorithm, s.sync_every, s.num_fragments, s.overlap_steps,
          s.merge_alpha) == ("streaming_diloco", 10, 2, 1, 0.5)
  assert (arms["local_dadam"].gossip_every, arms["dadam"].gossip_every) == (5,
                                                                           1)
  assert arms["sgp"].topology == "one_peer_exp"
  assert base.sync_every == 10 and base.algorithm == "decentralized"


@pytest.mark.slow
def test_sent_per_step_is_read_from_the_hlo():
  # 8 workers, DiLoCo with H = 5: the ring figure 2 (n - 1) / n = 1.75 x the
  # parameter bytes once per 5 steps (0.35); the consensus-distance
  # diagnostic apart: on every 10th (logging) step a mean of every
  # parameter leaf and of the float32 total, 1.75 x (params + 4 B).
  from decentral_jax.runner import config as config_lib
  from decentral_jax.runner import experiment
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
  assert results.results_table(
      [(runs_lib.METHODS["diloco"], {
          "eval/loss": 1.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 0.0,
          "comm/ratio": got["ratio"],
          "comm/bytes_per_step": got["bytes_per_step"]})],
      "tokens").splitlines()[2].count("| 0.350 (") == 1


def test_overrides_of_a_method_s_own_fields_are_named():
  runs = runs_lib.select_runs("diloco,sgp")
  lines = runs_lib.overridden_fields(
      ["--config.sync_every=5", "--config.topology=ring",
       "--config.steps=4"], runs)
  assert len(lines) == 3
  assert "--config.sync_every=5 is ignored by diloco" in lines[0]
  # SGP has no sync period: its run keeps the default.
  assert lines[1] == ("--config.sync_every=5 is not read by the algorithm "
                      "of sgp: those runs keep its default.")
  assert "--config.topology=ring is ignored by diloco, sgp" in lines[2]
  # AccumAdamW takes its window from the config; the others fix it at 1.
  lines = runs_lib.overridden_fields(["--config.optimizer.accum_steps=8"],
                                    runs_lib.select_runs("dadam,accum_adamw"))
  assert lines == ["--config.optimizer.accum_steps=8 is ignored by dadam: "
                   "each method sets config.optimizer.accum_steps itself (see "
                   "RUNS in decentral_jax/tools/compare/runs.py); run "
                   "experiments/train.py for other values."]


def test_a_method_field_is_kept_only_where_the_algorithm_reads_it():
  from decentral_jax.runner import config as config_lib
  base = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["--config.comm_dtype=bfloat16", "--config.bucket_bytes=4096"])
  arms = dict((run.name, config) for run, config in runs_lib.arm_configs(
      base, 4, per_method_lr=False, runs=runs_lib.RUNS))  # all are valid
  got = {name: (c.comm_dtype, c.bucket_bytes, c.topology)
         for name, c in arms.items()}
  # All-Reduce sends gradients, not parameters, and has no topology.
  assert got["all_reduce"] == ("", 0, "one_peer_exp")
  assert got["diloco"] == ("bfloat16", 0, "one_peer_exp")  # no gossip
  assert got["dadam"] == ("bfloat16", 4096, "one_peer_exp")
  assert got["decentralized_diloco"] == ("bfloat16", 4096, "one_peer_exp")
  assert got["accum_adamw_aer"][2] == "alternating_exp_ring"
  lines = runs_lib.overridden_fields(["--config.comm_dtype=bfloat16"],
                                    runs_lib.select_runs("all_reduce,dadam"))
  assert lines == ["--config.comm_dtype=bfloat16 is not read by the "
                   "algorithm of all_reduce: those runs keep its default."]


def _tiny_arms(tmp_path, methods):
  from decentral_jax.runner import config as config_lib
  base = config_lib.load_config(
      os.path.join(ROOT, "configs", "gpt_tiny.py"),
      ["--config.model.n_layer=1", "--config.model.n_embd=16",
       "--config.model.n_head=2", "--config.model.block_size=8",
       "--config.global_batch=16", "--config.eval_batches=1",
       "--config.steps=4", "--config.eval_interval=2",
       "--config.log_interval=1", "--config.checkpoint_interval=0"])
  return [(run, config, str(tmp_path / run.name)) for run, config in
          runs_lib.arm_configs(base, 4, False, runs_lib.select_runs(methods))]


def test_run_arm_locks_before_it_replaces_and_replaces_only_run_dirs(
    tmp_path, monkeypatch):
  """Nothing trains: each case is refused before the experiment is built."""
  from decentral_jax.runner import workdir as workdir_lib
  def built(config):
    raise AssertionError("the arm was about to train")

  monkeypatch.setattr(job_lib.experiment, "Experiment", built)
  [(run, config, workdir)] = _tiny_arms(tmp_path, "dadam")
  # A run of another config (so "fresh": to be replaced), held by another
  # invocation: refused, and not one of its files removed.
  os.makedirs(os.path.join(workdir, "checkpoints", "2"))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write('{"steps": 99}')
  with workdir_lib.WorkdirLock(workdir):
    before = sorted(os.listdir(workdir))
    with pytest.raises(workdir_lib.WorkdirInUse, match="is in use by another"):
      job_lib.run_arm(run, config, workdir)
    assert sorted(os.listdir(workdir)) == before
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
  # A directory named after the method that holds something no run writes
  # is not a run directory: refused in one line naming it, kept whole.
  notes = os.path.join(workdir, "notes.txt")
  with open(notes, "w") as f:
    f.write("mine")
  with pytest.raises(ValueError) as info:
    job_lib.run_arm(run, config, workdir)
  message = str(info.value)
  assert "\n" not in message
  assert f"{workdir} is not a run directory" in message and "'notes.txt'" \
      in message
  assert os.path.isfile(notes) and os.path.isdir(
      os.path.join(workdir, "checkpoints", "2"))


@pytest.mark.integration  # trains two short runs
def test_rerun_keeps_finished_runs_and_resumes_the_interrupted_one(
    tmp_path, monkeypatch):
  """A stop inside the second run; the same arms again: the first is kept,
  the second resumes from its checkpoint (steps 2 and 3 only)."""
  import signal
  from decentral_jax.runner import train
  (ar, ar_config, ar_dir), (dadam, dadam_config, dadam_dir) = _tiny_arms(
      tmp_path, "all_reduce,dadam")
  steps = []
  plain_step = job_lib.experiment.Experiment.train_step

  def step(self, state, batch, s=None):
    steps.append((self.config.algorithm, s))
    if (self.config.algorithm, s) == ("decentralized", 1) and len(
        [x for x in steps if x == ("decentralized", 1)]) == 1:
      signal.raise_signal(signal.SIGTERM)  # as a scheduler's notice
    return plain_step(self, state, batch, s)

  monkeypatch.setattr(job_lib.experiment.Experiment, "train_step", step)
  ar_final, reason = job_lib.run_arm(ar, ar_config, ar_dir)
  assert reason is None and ar_final["step"] == 4
  with pytest.raises(train.Preempted) as info:
    job_lib.run_arm(dadam, dadam_config, dadam_dir)
  assert info.value.step == 2
  message = job_lib.preempted_message(info.value, dadam, [ar], [])
  assert "keeps the finished runs (all_reduce), resumes 'dadam' from step 2" \
      in message, message
  assert job_lib.arm_status(ar_dir, ar_config)[0] == "finished"
  assert job_lib.arm_status(dadam_dir, dadam_config) == ("resume", None)
  ar_log = (tmp_path / "all_reduce" / "metrics.jsonl").read_bytes()

  steps.clear()
  again, _ = job_lib.run_arm(ar, ar_config, ar_dir)
  assert steps == [] and again == ar_final  # kept, not trained again
  assert (tmp_path / "all_reduce" / "metrics.jsonl").read_bytes() == ar_log
  final, reason = job_lib.run_arm(dadam, dadam_config, dadam_dir)
  assert steps == [("decentralized", 2), ("decentralized", 3)]
  assert reason is None and final["step"] == 4
  records = [json.loads(x) for x in
             (tmp_path / "dadam" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval/loss" in r] == [0, 2, 4]
  # Another config in the same directory is not resumed: it starts over,
  # the finished run moved aside first (run_arm).
  with dadam_config.unlocked():
    dadam_config.steps = 6
  assert job_lib.arm_status(dadam_dir, dadam_config) == (
      "fresh", "compare_result.json records a finished run of another config")



@pytest.mark.integration  # trains two short runs
def test_a_checkpoint_of_another_run_is_set_aside_and_the_run_retrained(
    tmp_path, monkeypatch, capsys):
  """A run whose config.json is this config's but whose checkpoint another
  config wrote (copied in): compare's own decision to resume is wrong, not
  the job's input; the run is moved aside whole, named in one warning, and
  trained from step 0 (steps 0 to 3), the job going on."""
  import shutil
  (ar, ar_config, ar_dir), (dadam, dadam_config, dadam_dir) = _tiny_arms(
      tmp_path, "all_reduce,dadam")
  steps = []
  plain_step = job_lib.experiment.Experiment.train_step

  def step(self, state, batch, s=None):
    steps.append((self.config.algorithm, s))
    return plain_step(self, state, batch, s)

  monkeypatch.setattr(job_lib.experiment.Experiment, "train_step", step)
  job_lib.run_arm(ar, ar_config, ar_dir)
  ckpts = os.listdir(os.path.join(ar_dir, "checkpoints"))
  assert "4" in ckpts, ckpts
  shutil.copytree(os.path.join(ar_dir, "checkpoints"),
                  os.path.join(dadam_dir, "checkpoints"))
  with open(os.path.join(dadam_dir, "config.json"), "w") as f:
    f.write(dadam_config.to_json(indent=2))
  assert job_lib.arm_status(dadam_dir, dadam_config) == ("resume", None)
  steps.clear()
  capsys.readouterr()
  final, reason = job_lib.run_arm(dadam, dadam_config, dadam_dir)
  assert reason is None and final["step"] == 4
  assert steps == [("decentralized", s) for s in range(4)]
  aside = dadam_dir + ".not_resumed"
  assert sorted(os.listdir(os.path.join(aside, "checkpoints"))) == sorted(
      ckpts)
  warned = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("warning: ")]
  assert warned == [
      f"warning: {dadam_dir}: its checkpoint is not resumed (the checkpoint "
      f"in {os.path.abspath(os.path.join(dadam_dir, 'checkpoints'))} was "
      "written with config.algorithm='all_reduce' but this run has "
      f"'decentralized'); the run was moved to {aside} and is trained again "
      "from step 0."], warned
  assert job_lib.arm_status(dadam_dir, dadam_config)[0] == "finished"


# --- The job: seeds, checkpoints, progress, reference ---


def test_seeds_name_the_runs_and_checkpoints_are_off_by_default():
  assert runs_lib.parse_seeds(" 0, 1,2 ") == (0, 1, 2)
  assert runs_lib.parse_seeds("") == ()
  for bad, match in (("0,x", "'x' is not a seed"), ("1,1", "more than once"),
                     ("-1", "'-1' is not a seed"),
                     (str(2**32), "is not a seed")):
    with pytest.raises(ValueError, match=match) as info:
      runs_lib.parse_seeds(bad)
    assert "--seeds" in str(info.value)
  base = config_dict.ConfigDict({"seed": 7, "checkpoint_interval": 100})
  run = runs_lib.METHODS["dadam"]
  (one,) = runs_lib.job_arms([(run, base)], (), checkpoints=False)
  assert (one.run, one.seed, one.config.seed) == (run, 7, 7)
  assert one.config.checkpoint_interval == 0  # only SIGTERM's and the last
  two = runs_lib.job_arms([(run, base)], (3, 4), checkpoints=True)
  assert [(a.run.name, a.run.label, a.seed, a.config.seed,
           a.config.checkpoint_interval) for a in two] == [
               ("dadam_seed3", "DAdam (Exp), seed 3", 3, 3, 100),
               ("dadam_seed4", "DAdam (Exp), seed 4", 4, 4, 100)]
  assert all(a.method is run for a in two) and base.seed == 7


def test_one_progress_bar_counts_every_step_of_the_job(capsys):
  arms = runs_lib.job_arms(
      [(runs_lib.METHODS[x], config_dict.ConfigDict({"seed": 0, "steps": s}))
       for x, s in (("all_reduce", 5), ("dadam", 7))], (), True)
  job = progress.JobProgress(arms)
  assert job.bar.total == 12
  job.start(1, arms[0])
  with job.attach():
    # What train.train_and_evaluate does: a bar of its own run's steps.
    bar = progress.metrics_lib.progress_bar(5, initial=2)
    for _ in range(3):
      bar.update(1)
    bar.set_postfix({"eval/loss": "1.0"})
    bar.close()
    print("a log line")
  assert job.bar.n == 5  # 2 done by an earlier invocation, 3 now
  assert progress.metrics_lib.progress_bar is not bar  # restored
  job.finish(2)  # the second run was kept from an earlier invocation
  assert job.bar.n == 12
  job.close()
  assert "a log line" in capsys.readouterr().out


def test_reference_check():
  ref = {"tolerance": 0.02, "produced_on": "machine X",
         "jobs": {"quick": {"final_loss": {"all_reduce/seed0": 2.2,
                                           "dadam/seed0": 2.5}}}}
  got = reference.reference_check(ref, "quick", {"all_reduce/seed0": 2.21,
                                               "dadam/seed0": 2.4875})
  assert got == ("matches the reference within 0.02 nats (largest "
                 "difference 0.0125 over 2 runs; reference produced on "
                 "machine X).")
  got = reference.reference_check(ref, "quick", {"all_reduce/seed0": 2.25,
                                               "dadam/seed0": 2.5})
  assert got.startswith("differs: all_reduce/seed0 2.2500 vs reference "
                        "2.2000 (tolerance 0.02 nats;")
  for job, losses in ((None, {"dadam/seed0": 2.5}),  # not the default set-up
                      ("full", {"dadam/seed0": 2.5}),  # no such job stored
                      ("quick", {"sgp/seed0": 2.5})):  # no such run stored
    assert reference.reference_check(ref, job, losses).startswith(
        "no stored reference for this set-up")
  assert reference.reference_check(None, "quick", {}).startswith(
      "no reference file")


def test_stored_reference_covers_the_default_jobs():
  with open(reference.REFERENCE_FILE, encoding="utf-8") as f:
    ref = json.load(f)
  assert 0 < ref["tolerance"] < 0.1 and ref["produced_on"]
  losses = ref["jobs"]["quick"]["final_loss"]
  assert sorted(losses) == sorted(f"{m}/seed0"
                                  for m in runs_lib.DEFAULT_METHODS)
  full = ref["jobs"]["full"]["final_loss"]
  assert sorted(full) == sorted(f"{m}/seed0" for m in runs_lib.FULL_METHODS)
  # Below the initial loss of a byte-level model, ln 256 = 5.545 nats.
  assert all(0 < x < 5.5 for x in [*losses.values(), *full.values()])


def test_full_changes_the_defaults_and_explicit_flags_win():
  flags = compare_flags.FLAGS

  def settings(*argv, overrides=()):
    flags.unparse_flags()
    flags(["compare.py", *argv])
    try:
      return compare_flags.job_settings(list(overrides))
    finally:
      flags.unparse_flags()

  quick = ",".join(runs_lib.DEFAULT_METHODS)
  assert settings() == (compare_flags.QUICK_CONFIG, quick, "", False, "quick")
  assert settings("--full") == (compare_flags.FULL_CONFIG,
                                ",".join(runs_lib.FULL_METHODS), "0,1,2",
                                True, "full")
  assert settings("--full", "--seeds=4", "--methods=sgp",
                  "--nocheckpoints") == (compare_flags.FULL_CONFIG, "sgp", "4",
                                         False, "full")
  # Another config, a --config override or untuned lrs: not the default
  # set-up, so no reference applies.
  assert settings(f"--config={compare_flags.FULL_CONFIG}")[4] is None
  assert settings(overrides=["--config.steps=5"])[4] is None
  assert settings("--noper_method_lr")[4] is None
  # An explicit checkpoint interval asks for checkpoints.
  assert settings(overrides=["--config.checkpoint_interval=10"])[3] is True


# --- Whole invocations with training faked (nothing compiles) ---

# param_count: one float32 worker model of 1 MB, as the faked
# sent_per_step's ratio 1.0 of 1e6 bytes says.
_FINAL = {"step": 3, "eval/loss": 2.0, "eval/worker_excess_mean": 0.0,
          "eval/worker_excess_max": 0.0, "consensus_distance": 0.0,
          "param_count": 250_000}


def _fake_job(monkeypatch, train_fn):
  monkeypatch.setattr(job_lib.train, "train_and_evaluate", train_fn)
  monkeypatch.setattr(job_lib.experiment, "Experiment", lambda config: None)
  monkeypatch.setattr(job_lib, "sent_per_step", lambda exp: {
      "comm/ratio": 1.0, "comm/bytes_per_step": 1e6})
  monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # nothing to simulate here


def _main(tmp_path, *flags_):
  return compare.main([f"--outdir={tmp_path}", "--config.steps=3",
                       "--config.eval_interval=3", *flags_])


def _write_curve(workdir, config, losses=(4.0, 2.0)):
  """The records of steps 0 and 3 with the keys the runner writes in each
  (metrics_rules.missing_error): ``lr`` (the config's schedule, as the
  recorder takes it), ``train_time_s``, ``train/loss`` after step 0, and
  the evaluation's (both are evaluated: eval_interval=3)."""
  os.makedirs(workdir, exist_ok=True)
  schedule = builders.make_schedule(config)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step, loss in zip((0, 3), losses):
      row = {"step": step, "lr": float(schedule(max(step, 1) - 1))}
      if step:
        row["train/loss"] = 2.5
      row.update({"train_time_s": 1.0, **agreeing_evaluation(loss)})
      f.write(json.dumps(row) + "\n")


def test_all_runs_diverged_and_stale_plots_are_removed(
    tmp_path, monkeypatch, capsys):
  def diverges(config, workdir, experiment=None):
    raise FloatingPointError("non-finite training loss at step 2; enable "
                             "config.grad_clip.")

  _fake_job(monkeypatch, diverges)
  # Plots an earlier invocation wrote (with --cpu_timing and clusters),
  # and a file of the same kind that is not ours.
  for name in ("cpu_loss_vs_time_this_machine.png",
               "loss_vs_predicted_time.png", "loss_vs_step.png",
               "my_plot.png"):
    (tmp_path / name).write_bytes(b"old")
  assert _main(tmp_path, "--methods=all_reduce,dadam", "--clusters=") == 3
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error: ")]
  assert errors == [
      "error: all 2 runs diverged: 'all_reduce' (All-Reduce): "
      "non-finite training loss at step 2; enable config.grad_clip; 'dadam' "
      "(DAdam (Exp)): non-finite training loss at step 2; enable "
      f"config.grad_clip; no run finished, so there is no answer "
      f"({tmp_path / 'results.md'} lists the divergences)."]
  # This invocation wrote loss_vs_step.png only: the stale plots are gone.
  assert sorted(p.name for p in tmp_path.glob("*.png")) == [
      "loss_vs_step.png", "my_plot.png"]
  assert (tmp_path / "loss_vs_step.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "my_plot.png").read_bytes() == b"old"


def test_some_runs_diverged_message():
  runs = [runs_lib.METHODS["dadam"]]
  assert job_lib.diverged_message([(runs[0], "it blew up.")], 3, "r.md") == (
      "1 of 3 runs diverged: 'dadam' (DAdam (Exp)): it blew up; the "
      "other runs' results are in r.md.")


@pytest.mark.parametrize("contents, key", [
    ({"tolerance": "0.02", "jobs": {}}, "key 'tolerance' is str '0.02'"),
    ({"tolerance": 0.02, "jobs": {"quick": {"final_loss": {
        "dadam/seed0": None}}}},
     "key 'jobs.quick.final_loss.dadam/seed0' is NoneType None, not a loss"),
    ({"tolerance": 0.02, "jobs": []}, "key 'jobs' is list [], not an object"),
    ("{", "it is not readable JSON (Expecting "),
    # Integers JSON allows but a float64 does not hold, and deep nesting.
    ('{"tolerance": 1' + "0" * 400 + ', "jobs": {}}',
     "key 'tolerance' is int 1" + "0" * 39 + ", not a number of nats"),
    ('{"tolerance": 0.02, "jobs": {"quick": {"final_loss": {"dadam/seed0": '
     + "4" * 400 + "}}}}",
     "key 'jobs.quick.final_loss.dadam/seed0' is int " + "4" * 40
     + ", not a loss"),
    ("[" * 100000, "it is not readable JSON (nested too deeply)"),
])
def test_a_malformed_reference_is_one_line_and_the_results_are_written(
    tmp_path, monkeypatch, capsys, contents, key):
  def trains(config, workdir, experiment=None):
    _write_curve(workdir, config)
    return dict(_FINAL)

  _fake_job(monkeypatch, trains)
  ref = tmp_path / "ref.json"
  ref.write_text(contents if isinstance(contents, str) else
                 json.dumps(contents))
  monkeypatch.setattr(reference, "REFERENCE_FILE", str(ref))
  out = tmp_path / "out"
  assert _main(out, "--methods=all_reduce", "--clusters=") == 0
  err = capsys.readouterr().err
  warnings = [l for l in err.splitlines() if "reference" in l]
  assert len(warnings) == 1, err
  assert warnings[0].startswith(
      f"warning: reference check not checked: the reference file {ref} is "
      f"malformed: {key}"), warnings[0]
  md = (out / "results.md").read_text()
  assert f"Reference check: not checked: the reference file {ref}" in md
  assert "| All-Reduce | 2.0000 |" in md


def test_checkpoints_are_dropped_while_the_run_folder_is_locked(
    tmp_path, monkeypatch):
  from decentral_jax.runner import workdir as workdir_lib
  def trains(config, workdir, experiment=None):
    _write_curve(workdir, config)
    os.makedirs(os.path.join(workdir, "checkpoints", "3"))
    return dict(_FINAL)

  _fake_job(monkeypatch, trains)
  seen = []
  drop = job_lib.drop_checkpoints

  def drop_checking_the_lock(workdir):
    try:
      workdir_lib.WorkdirLock(workdir).acquire()
    except workdir_lib.WorkdirInUse:
      seen.append("held")
    else:
      seen.append("free")
    drop(workdir)

  monkeypatch.setattr(job_lib, "drop_checkpoints", drop_checking_the_lock)
  assert _main(tmp_path, "--methods=all_reduce", "--clusters=") == 0
  assert seen == ["held"]
  assert not (tmp_path / "all_reduce" / "checkpoints").exists()


def test_a_symlinked_run_folder_is_refused_and_left_as_it_was(
    tmp_path, monkeypatch, capsys):
  def trains(config, workdir, experiment=None):
    raise AssertionError("the arm was about to train")

  _fake_job(monkeypatch, trains)
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / "checkpoints" / "5").mkdir(parents=True)
  out = tmp_path / "out"
  out.mkdir()
  (out / "all_reduce").symlink_to(elsewhere, target_is_directory=True)
  assert _main(out, "--methods=all_reduce", "--clusters=") == 2
  [line] = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error: ")]
  assert f"{out / 'all_reduce'} is a symbolic link" in line
  assert sorted(os.listdir(elsewhere)) == ["checkpoints"]  # no run.lock
  assert os.listdir(elsewhere / "checkpoints") == ["5"]


def test_empty_seed_entries_are_refused():
  assert runs_lib.parse_seeds("") == () and runs_lib.parse_seeds("1, 0") == (
      1, 0)
  for bad, entry in ((",", 1), ("0,,1", 2), ("0,1,", 3)):
    with pytest.raises(ValueError) as info:
      runs_lib.parse_seeds(bad)
    assert str(info.value).startswith(
        f"--seeds={bad!r}: entry {entry} is empty;"), str(info.value)


def test_the_eta_counts_steps_not_compile_time():
  arms = runs_lib.job_arms(
      [(runs_lib.METHODS[x], config_dict.ConfigDict({"seed": 0, "steps": s}))
       for x, s in (("all_reduce", 10), ("dadam", 10))], (), True)
  job = progress.JobProgress(arms)
  assert job.bar.desc.startswith("run 1 of 2 (all_reduce)")  # not "run 0"
  clock = [0.0]
  job.bar._time = lambda: clock[0]  # pylint: disable=protected-access
  job.bar.start_t = job.bar.last_print_t = 0.0
  with job.attach():
    bar = progress.metrics_lib.progress_bar(10)
    clock[0] = 20.0  # building and compiling, then step 1 (1 s)
    bar.update(1)
    for _ in range(9):  # 1 s per step
      clock[0] += 1.0
      bar.update(1)
  job.finish(1)
  info = job.bar.format_dict
  elapsed = info["elapsed"]
  rate = info["rate"] or (info["n"] - info["initial"]) / elapsed
  # 10 steps in 9 s of stepping (the compile's 20 s left out): the next 10
  # steps take about 9 s, not the 29 s a clock with the compile would say.
  assert elapsed == pytest.approx(9.0)
  assert 8.0 <= (job.bar.total - job.bar.n) / rate <= 10.0
  # Steps kept from an earlier invocation move the bar, not the rate.
  job.skip(5)
  info = job.bar.format_dict
  assert info["n"] == 15 and info["n"] - info["initial"] == 10
  job.close()


def test_a_second_invocation_on_a_held_outdir_is_refused(
    tmp_path, monkeypatch, capsys):
  # Another invocation (other methods) holds --outdir: nothing is trained
  # or written, and the one error line names --outdir and the holder.
  from decentral_jax.runner import workdir as workdir_lib
  def trains(config, workdir, experiment=None):
    raise AssertionError("the arm was about to train")

  _fake_job(monkeypatch, trains)
  out = tmp_path / "out"
  other = workdir_lib.WorkdirLock(str(out), "--outdir")
  other.acquire()
  try:
    assert _main(out, "--methods=dadam", "--clusters=") == 2
  finally:
    other.release()
  errors = [l for l in capsys.readouterr().err.splitlines()
            if l.startswith("error: ")]
  assert len(errors) == 1, errors
  assert errors[0].startswith(f"error: --outdir {str(out)!r}: the work "
                              f"directory {out} is in use by another run")
  assert f"pid {os.getpid()} on host" in errors[0]
  assert errors[0].endswith("or pass another --outdir.")
  assert sorted(os.listdir(out)) == [workdir_lib.LOCK_FILE]


def test_the_outdir_and_each_run_folder_are_locked_while_a_run_trains(
    tmp_path, monkeypatch):
  from decentral_jax.runner import workdir as workdir_lib
  seen = []

  def held(path):
    rival = workdir_lib.WorkdirLock(path)  # another open file
    try:
      rival.acquire()
    except workdir_lib.WorkdirInUse:
      return True
    rival.release()
    return False

  def trains(config, workdir, experiment=None):
    seen.append((held(str(tmp_path)), held(workdir)))
    _write_curve(workdir, config)
    return dict(_FINAL)

  _fake_job(monkeypatch, trains)
  assert _main(tmp_path, "--methods=all_reduce,dadam", "--clusters=") == 0
  assert seen == [(True, True), (True, True)]
  assert (tmp_path / "results.md").exists()
  assert not held(str(tmp_path))  # released when the invocation ends


def test_help_exits_0_and_the_command_runs_the_module(capsys):
  from decentral_jax.tools import cli
  assert compare.main(["--help"]) == 0
  out = capsys.readouterr().out
  usage, rest = out.split("\n", 1)
  assert usage.startswith("usage: python -m decentral_jax.tools.compare ")
  assert rest.lstrip().startswith("The main job: which communication scheme")
  assert "--outdir" in out and "--methods" in out
  assert ":mod:" not in out and ":data:" not in out  # plain names in help
  # `decentral-jax compare` calls the module in this process, named as typed.
  assert cli.main(["compare", "-h"]) == 0
  assert capsys.readouterr().out == out.replace(
      "usage: python -m decentral_jax.tools.compare ",
      "usage: decentral-jax compare ", 1)
  assert compare.main(["--methods=dadam", "stray"]) == 2
  assert capsys.readouterr().err == "error: unexpected arguments: stray\n"


def test_the_default_configs_are_package_presets_without_a_checkout(
    tmp_path, monkeypatch):
  from decentral_jax.runner import config as config_lib
  # An installed package: no configs/ under the current directory. The
  # defaults are presets of the package, the runs of the config files.
  monkeypatch.chdir(tmp_path)
  for name, path in ((compare_flags.QUICK_CONFIG, "gpt_quick.py"),
                     (compare_flags.FULL_CONFIG, "gpt_tiny.py")):
    assert compare_flags.load_base(name).to_dict() == config_lib.load_config(
        os.path.join(ROOT, "configs", path)).to_dict()
  quick = compare_flags.load_base(compare_flags.QUICK_CONFIG,
                                  ["--config.steps=4"])
  assert quick.steps == 4 and quick.model.n_embd == 64
  with pytest.raises(ValueError) as info:
    compare_flags.load_base(compare_flags.QUICK_CONFIG, ["--config.nope=1"])
  assert str(info.value) == ("--config.nope=1: unknown config field 'nope' "
                             "in the gpt_quick preset.")
  with pytest.raises(ValueError) as info:  # a near miss names the field
    compare_flags.load_base(compare_flags.QUICK_CONFIG,
                            ["--config.model.n_embed=8"])
  assert str(info.value) == (
      "--config.model.n_embed=8: unknown config field 'model.n_embed' in "
      "the gpt_quick preset (did you mean model.n_embd?).")
  with pytest.raises(ValueError) as info:  # a misspelt group: the whole key
    compare_flags.load_base(compare_flags.QUICK_CONFIG,
                            ["--config.optimiser.b1=0.8"])
  assert str(info.value) == (
      "--config.optimiser.b1=0.8: unknown config field 'optimiser.b1' in "
      "the gpt_quick preset (did you mean optimizer.b1?).")


@pytest.mark.parametrize("argv, words", [
    (["--nocheckpoints", "--config.checkpoint_interval=2"],
     ("--nocheckpoints", "--config.checkpoint_interval=2")),
    (["--config.workdir=/tmp/x"], ("--config.workdir=/tmp/x", "--outdir")),
    # the seeds of --seeds (or --full's) replace config.seed in every run
    (["--seeds=0,1", "--config.seed=5"],
     ("error: --config.seed=5: --seeds=0,1 sets every run's seed, so "
      "config.seed is not used; give the seeds with --seeds and drop "
      "--config.seed.",)),
    (["--full", "--config.seed=5"], ("--config.seed=5: --full's "
                                     "--seeds=0,1,2 sets every run's seed",)),
    (["--cpu_devices=2"], ("--cpu_devices=2 simulates 2 CPU devices",
                           "--config.n_workers=8 needs 8")),
    # an explicit --per_method_lr and an explicit lr contradict each other
    (["--per_method_lr", "--config.schedule.peak_lr=1e-3"],
     ("error: --per_method_lr runs each method at its tuned peak lr, but "
      "--config.schedule.peak_lr=1e-3 sets every run's; drop one of the "
      "two",)),
    (["--per_method_lr=true", "--config.schedule.final_lr=0.5"],
     ("error: --per_method_lr ", "--config.schedule.final_lr=0.5")),
])
def test_overrides_the_job_would_drop_are_refused(tmp_path, capsys, argv,
                                                   words):
  assert compare.main([f"--outdir={tmp_path / 'out'}", "--methods=dadam",
                       *argv]) == 2
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith("error: ") and all(w in line for w in words), line
  assert not (tmp_path / "out").exists()
  # Consistent: no checkpoints and a zero interval.
  flags = compare_flags.FLAGS
  flags.unparse_flags()
  flags(["compare.py", "--nocheckpoints"])
  try:
    assert compare_flags.job_settings(
        ["--config.checkpoint_interval=0"])[3] is False
    # without --seeds, config.seed is the job's one seed
    assert compare_flags.job_settings(["--config.seed=5"])[2] == ""
    # an explicit lr without an explicit --per_method_lr: the lr wins
    assert compare_flags.job_settings(
        ["--config.schedule.peak_lr=1e-3"])[4] is None
    flags.unparse_flags()
    flags(["compare.py", "--noper_method_lr"])
    assert compare_flags.job_settings(
        ["--config.schedule.peak_lr=1e-3"])[4] is None
  finally:
    flags.unparse_flags()


# --- A kept run's records are signed: edited ones are trained again ---


def _signed_job(monkeypatch, tmp_path):
  trained = []

  def trains(config, workdir, experiment=None):
    trained.append(os.path.basename(workdir))
    _write_curve(workdir, config)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write("{}")  # not signed: only the two records are
    return dict(_FINAL)

  _fake_job(monkeypatch, trains)
  out = tmp_path / "out"
  run = lambda: _main(out, "--methods=all_reduce,diloco", "--clusters=")
  assert run() == 0 and trained == ["all_reduce", "diloco"]
  return out, run, trained


def _warnings(err: str, out) -> list[str]:
  """The warning lines about the runs in ``out``."""
  return [l for l in err.splitlines() if l.startswith(f"warning: {out}")]


def test_a_finished_run_signs_its_records_with_sha256sums(
    tmp_path, monkeypatch):
  import hashlib
  out, _, _ = _signed_job(monkeypatch, tmp_path)
  run_dir = out / "diloco"
  want = "".join(
      f"{hashlib.sha256((run_dir / name).read_bytes()).hexdigest()}  {name}\n"
      for name in ("compare_result.json", "metrics.jsonl"))
  assert (run_dir / "SHA256SUMS").read_text() == want


def test_consistently_edited_comm_figures_are_not_kept(
    tmp_path, monkeypatch, capsys):
  out, run, trained = _signed_job(monkeypatch, tmp_path)
  path = out / "diloco" / "compare_result.json"
  record = json.loads(path.read_text())
  # Both doubled: 2e6 bytes / (250000 x 4 bytes) = 2.0, as the rules allow.
  record["final"].update({"comm/bytes_per_step": 2e6, "comm/ratio": 2.0})
  path.write_text(json.dumps(record))
  capsys.readouterr()
  assert run() == 0
  assert trained[2:] == ["diloco"]
  sums = out / "diloco" / "SHA256SUMS"
  assert _warnings(capsys.readouterr().err, out) == [
      f"warning: {sums}: compare_result.json does not match its checksum "
      "(the record was changed since the run finished); the run is not "
      "kept: it is trained again."]
  [row] = [l for l in (out / "results.md").read_text().splitlines()
           if l.startswith("| DiLoCo")]
  assert row.endswith("| 1.000 (1.00) |"), row  # the trained ratio
  assert run() == 0 and len(trained) == 3  # signed again: kept from now on


def test_a_step_0_loss_edited_in_every_run_is_not_kept(
    tmp_path, monkeypatch, capsys):
  out, run, trained = _signed_job(monkeypatch, tmp_path)
  for name in ("all_reduce", "diloco"):  # all agree: no cross-check fails
    path = out / name / "metrics.jsonl"
    path.write_text(path.read_text().replace('"eval/loss": 4.0',
                                             '"eval/loss": 9.0'))
  capsys.readouterr()
  assert run() == 0 and trained[2:] == ["all_reduce", "diloco"]
  warnings = _warnings(capsys.readouterr().err, out)
  assert len(warnings) == 2 and all(
      "metrics.jsonl does not match its checksum" in w for w in warnings)


@pytest.mark.parametrize("damage", ["remove", *(
    pytest.param(d, marks=pytest.mark.slow)
    for d in ("truncate", "unlist_result", "unlist_metrics"))])
def test_a_record_without_its_checksums_is_trained_again(
    tmp_path, monkeypatch, capsys, damage):
  out, run, trained = _signed_job(monkeypatch, tmp_path)
  sums = out / "all_reduce" / "SHA256SUMS"
  if damage == "remove":  # an outdir an older version wrote
    sums.unlink()
  elif damage == "truncate":
    sums.write_text(sums.read_text()[:30])
  else:  # a line deleted: that file could be edited unchecked
    name = {"unlist_result": "compare_result.json",
            "unlist_metrics": "metrics.jsonl"}[damage]
    kept = [l for l in sums.read_text().splitlines(True)
            if not l.rstrip().endswith("  " + name)]
    assert len(kept) == 1
    sums.write_text("".join(kept))
  capsys.readouterr()
  assert run() == 0 and trained[2:] == ["all_reduce"]
  [line] = _warnings(capsys.readouterr().err, out)
  assert line.startswith(f"warning: {sums}: ") and line.endswith(
      "the run is not kept: it is trained again."), line


def _edit_final(**changes):
  def edit(path):
    record = json.loads(path.read_text())
    record["final"].update(changes)
    record["final"] = {k: v for k, v in record["final"].items()
                       if v is not None}
    path.write_text(json.dumps(record))
  return "compare_result.json", edit


def _add_row(row):
  return "metrics.jsonl", lambda path: path.write_text(
      path.read_text() + json.dumps(row) + "\n")


# Records re-signed after the edit: the rules of the values catch them (the
# job's config: steps 3).
@pytest.mark.parametrize("edit, says", [
    (_edit_final(lr=-1), "final.lr must be >= 0, got -1"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        (_edit_final(lr=1e30), "final.lr must be <= schedule.peak_lr "),
        (_edit_final(step=None), "final.step is missing"),
        (_add_row({"step": 3, "lr": "x", "train/loss": 2.0,
                   "train_time_s": 1.0}),
         "at step 3: lr must be a number, got 'x'"),
        (_add_row({"step": 99, "lr": 3e-4, "train/loss": 2.0,
                   "train_time_s": 1.0}),
         "at step 99: step must be in [0, steps] = [0, 3]"))),
])
def test_a_re_signed_record_with_an_impossible_value_is_not_kept(
    tmp_path, monkeypatch, capsys, edit, says):
  out, run, trained = _signed_job(monkeypatch, tmp_path)
  name, change = edit
  change(out / "diloco" / name)
  record_lib.sign(str(out / "diloco"))
  capsys.readouterr()
  assert run() == 0 and trained[2:] == ["diloco"]
  [line] = _warnings(capsys.readouterr().err, out)
  assert line.startswith(f"warning: {out / 'diloco' / name}: ") and (
      says in line) and line.endswith("trained again."), line
