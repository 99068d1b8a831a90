"""Learners that train a runner config (tools/learners/runner_problem.py):
the config's fields a learner refuses or carries, its data shards, and (slow)
synchronous learners equal to the runner's one-program DiLoCo."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from conftest import require_devices
from helpers import run_steps
from helpers import to_host
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment
from decentral_jax.runner import methods
from decentral_jax.tools.learners import flags as flags_lib
from decentral_jax.tools.learners import learner as learner_lib
from decentral_jax.tools.learners import main as main_lib
from decentral_jax.tools import cli
from decentral_jax.tools.learners import problems
from decentral_jax.tools.learners import records
from decentral_jax.tools.learners import runner_problem
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib

CONFIG = "configs/gpt_tiny.py"
TINY = ("algorithm=diloco", "optimizer.name=adamw", "optimizer.accum_steps=1",
        "model.block_size=16", "model.n_layer=1", "model.n_embd=16",
        "model.n_head=2", "global_batch=4", "steps=6", "sync_every=3",
        "eval_batches=1", "schedule.warmup_steps=2")
# TINY on the command line without --workdir (no evaluation is run, so an
# eval_batches override would be refused as having no effect).
NO_WORKDIR = tuple(o for o in TINY if not o.startswith("eval_batches="))


def _flags(*overrides):
  """``--config.FIELD=VALUE`` flags of ``overrides``, a later one of a
  field replacing the earlier (a field given twice is refused)."""
  last = {o.partition("=")[0]: o for o in overrides}
  return [f"--config.{o}" for o in last.values()]


@pytest.mark.parametrize("override, field", [
    ((), "config.algorithm='decentralized'"),  # gpt_tiny's own: gossip
    (("outer_optimizer.name=adam",), "config.outer_optimizer.name='adam'"),
    (("outer_optimizer.nesterov=False",), "config.outer_optimizer.nesterov"),
    (("faults.enabled=True",), "config.faults.enabled=True"),
    (("comm_dtype=bfloat16",), "config.comm_dtype='bfloat16'"),
    (("compression.format=topk",), "config.compression.format='topk'"),
    (("compression.format=int8",), "config.compression.error_feedback"),
    (("compression.format=int8", "compression.error_feedback=True",
      "compression.error_decay=0.9"), "config.compression.error_decay=0.9"),
    (("workers_per_device=2",), "config.workers_per_device=2"),
    (("distributed.enabled=True",), "config.distributed.enabled=True"),
])
def test_fields_without_meaning_for_learners_are_refused_by_name(
    override, field):
  base = TINY if override else tuple(o for o in TINY
                                     if not o.startswith("algorithm"))
  with pytest.raises(ValueError, match="has no meaning for learners") as e:
    runner_problem.load(CONFIG, base + override, 2)
  assert str(e.value).startswith(field), e.value


def test_streaming_diloco_in_the_config_names_the_learners_flags():
  base = tuple(o for o in TINY if not o.startswith("algorithm"))
  with pytest.raises(ValueError, match="has no meaning for learners") as e:
    runner_problem.load(CONFIG, base + ("algorithm=streaming_diloco",), 2)
  assert "--fragments P --overlap-steps TAU" in str(e.value), e.value


def test_n_workers_is_the_number_of_learners():
  c = runner_problem.load(CONFIG, TINY, 2)
  assert c.n_workers == 2
  with pytest.raises(ValueError, match="--config.n_workers=4: learners set"):
    runner_problem.load(CONFIG, TINY + ("n_workers=4",), 2)
  # global_batch 4 over 3 learners: the runner's own message.
  with pytest.raises(ValueError, match="global_batch"):
    runner_problem.load(CONFIG, TINY, 3)


def test_spec_fields_come_from_the_config():
  c = runner_problem.load(CONFIG, TINY + (
      "outer_optimizer.lr=0.5", "outer_optimizer.momentum=0.8",
      "compression.format=int8", "compression.error_feedback=True",
      "compression.block=64"), 2)
  assert runner_problem.spec_fields(c) == {
      "shards": 2, "sync_every": 3, "periods": 2, "outer_lr": 0.5,
      "outer_momentum": 0.8, "compressor": "int8", "block": 64,
      # gpt_tiny's peak 3e-3, final 3e-4; TINY's warmup 2, steps 6
      "inner": "adamw", "inner_lr": 3e-3,
      "inner_schedule": "warmup_cosine, warmup 2, to 0.0003 at step 6"}
  spec_lib.RunSpec(problem="runner", quorum=2,
                   **runner_problem.spec_fields(c))  # a valid RunSpec


def test_dynamic_updates_with_a_config_sync_period_of_one_is_refused(
    capsys, monkeypatch):
  # H_w = max(1, floor(v_w / v_max * 1)) = 1 for every speed v_w <= v_max.
  from decentral_jax.tools.learners import cluster  # pylint: disable=import-outside-toplevel
  def start(*a, **k):
    raise AssertionError("Ray started: the flags were accepted")
  monkeypatch.setattr(cluster, "start", start)
  argv = ["learners", "--learners", "2", "--dynamic-updates", "--sleep",
          "0,0.5", "--config", CONFIG, *_flags(*NO_WORKDIR, "sync_every=1")]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --dynamic-updates has no effect with "
                 "config.sync_every = 1 (H_w = max(1, floor(v_w / v_max * "
                 "H)) is 1 for every learner when H = 1); set "
                 "--config.sync_every=2 or more or drop --dynamic-updates."]


@pytest.mark.parametrize("extra, inner", [
    (("schedule.final_lr=0.0002",), "inner adamw peak lr 0.002 "
     "(warmup_cosine, warmup 2, to 0.0002 at step 6)"),
    (("schedule.name=constant", "schedule.warmup_steps=30",
      "schedule.final_lr=0.00015"),
     "inner adamw lr 0.002"),
    (("schedule.name=inverse_sqrt", "schedule.final_lr=0.00015",
      "optimizer.name=accum_adamw",
      "optimizer.accum_steps=2"),
     "inner accum_adamw peak lr 0.002 (inverse_sqrt, warmup 2)")])
def test_the_summary_and_json_of_a_config_name_what_the_learners_run(
    extra, inner):
  """The run line and --json's run describe the config's inner optimizer
  and schedule, outer step and compression, not the flags' defaults (sgd,
  lr 0.1, outer 0.7/0.9)."""
  argv = ["--learners", "2", "--config", CONFIG, *_flags(
      *NO_WORKDIR, "schedule.peak_lr=0.002", "outer_optimizer.lr=0.5",
      "outer_optimizer.momentum=0.8", "compression.format=int8",
      "compression.error_feedback=True", "compression.block=64", *extra)]
  rest, overrides = config_lib.split_overrides(["learners", *argv])
  run = flags_lib.run_spec(flags_lib.parser().parse_args(rest[1:]), overrides)
  assert main_lib.describe(run) == (
      f"run: sync, 2 learners, H=3, {inner}, outer Nesterov lr 0.5 momentum "
      "0.8, int8 pseudo-gradients")
  got = run.trajectory()
  schedule = inner.partition(" (")[2].rstrip(")") or "constant"
  assert (got["inner"], got["inner_lr"], got["inner_schedule"]) == (
      inner.split()[1], 0.002, schedule)
  assert (got["sync_every"], got["outer_lr"], got["outer_momentum"],
          got["compressor"], got["block"]) == (3, 0.5, 0.8, "int8", 64)


@pytest.mark.parametrize("steps, h, fix", [
    (5, 10, "set --config.steps=10, or --config.sync_every=5."),
    (25, 10, "set --config.steps=20 or --config.steps=30, or "
     "--config.sync_every=5."),
    (7, 3, "set --config.steps=6 or --config.steps=9, or "
     "--config.sync_every=1."),
    (8, 3, "set --config.steps=6 or --config.steps=9, or "
     "--config.sync_every=2.")])  # divisors of 8: 2 and 4 tie, the smaller
def test_steps_not_whole_sync_periods_are_refused_naming_both_fields(
    capsys, steps, h, fix):
  """steps // sync_every periods would run another length than steps (5
  steps of H=10 ran 10, 25 ran 20): refused before Ray starts."""
  over = TINY + (f"steps={steps}", f"sync_every={h}",
                 "schedule.warmup_steps=1")
  with pytest.raises(ValueError) as e:
    runner_problem.load(CONFIG, over, 2)
  assert str(e.value) == (
      f"config.steps={steps} is not a multiple of config.sync_every={h}: "
      f"learners run whole sync periods; {fix}"), e.value
  assert cli.main(["learners", "--learners", "2", "--config", CONFIG,
                   "--address", "127.0.0.1:1",
                   *_flags(*(o for o in over if o in NO_WORKDIR
                             or o not in TINY))]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [f"error: {e.value}"]
  ok = runner_problem.load(CONFIG, TINY + ("steps=12",), 2)  # 12 = 4 x 3
  assert runner_problem.spec_fields(ok)["periods"] == 4


def test_a_runner_problem_without_a_config_is_one_line():
  with pytest.raises(ValueError, match="needs problem_args"):
    problems.build("runner", 2, ())


@pytest.mark.parametrize("flags, words", [
    (("--config", CONFIG, "--inner-lr", "0.1"),
     "--inner-lr does not apply with --config (the config sets it): set "
     "--config.schedule.peak_lr"),
    (("--config", CONFIG, "--sync-every", "4"), "set --config.sync_every"),
    (("--config.steps=4",), "--config.steps=4 needs --config"),
    (("--workdir", "/nonexistent"), "--workdir needs --config"),
    (("--config", CONFIG, "--eval-every", "0"), "argument --eval-every: must be an integer in [1, "),
    (("--config", CONFIG), "config.algorithm='decentralized' has no meaning "
     "for learners"),
    (("--config", CONFIG, "--config.nope=1"), "unknown config field 'nope'"),
])
def test_the_command_names_a_flag_the_config_sets_before_ray_starts(
    capsys, flags, words):
  assert cli.main(["learners", "--learners", "2", *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_a_segment_states_a_recomputed_sharding():
  first = records.segment(None, 4, 0, 3)
  assert first == {"from_period": 0, "from_step": 0, "learners": 4,
                   "n_workers": 4, "sharding": "learner i reads worker i's "
                   "shard of n_workers=4"}
  same = records.segment({"segments": [first]}, 4, 5, 3)
  assert same["sharding"] == first["sharding"] and same["from_step"] == 15
  other = records.segment({"segments": [first]}, 2, 5, 3)
  assert other["sharding"] == (
      "recomputed: 4 -> 2 learners at period 5; from inner step 15 on "
      "learner i reads worker i's shard of n_workers=2")


def _run_spec(overrides, learners, **kw):
  c = runner_problem.load(CONFIG, overrides, learners)
  return spec_lib.RunSpec(
      problem="runner", quorum=learners,
      problem_args=(("config", CONFIG), ("overrides", tuple(overrides))),
      **{**runner_problem.spec_fields(c), **kw}), c


@pytest.mark.slow
def test_sync_learners_of_a_runner_config_equal_the_runners_diloco():
  """gpt_tiny (tiny sizes, dropout 0.1, AdamW on a warmup-cosine schedule,
  grad clip) with 2 learners of H = 3 for 2 periods through the
  synchronizer, in threads of this process: theta equals the runner's
  one-program DiLoCo's after its 6th step to float32 rounding. The
  learners' batches are the rows the runner feeds each worker."""
  require_devices(2)
  overrides = TINY + ("model.dropout=0.1",)
  run, c = _run_spec(overrides, 2)
  sync = sync_lib.Synchronizer(run)
  link = learner_lib.Link(lambda name, *args: getattr(sync, name)(*args))
  learners = [learner_lib.Learner(run, i, link) for i in range(2)]
  deadline = time.monotonic() + 300
  while sync.version < run.periods and time.monotonic() < deadline:
    time.sleep(0.02)
  status = [lrn.stop() for lrn in learners]
  sync.close()
  assert sync.version == 2 and all(s["error"] is None for s in status)
  assert sync.log["tokens"] == [{"0": 96, "1": 96}] * 2  # 3 x 2 rows x 16

  exp = experiment.Experiment(c, devices=require_devices(2))
  problem = problems.build(run.problem, 2, run.problem_args)
  for t in (0, 4):
    rows = to_host(exp.get_batch(t))
    for i in range(2):
      got = problem.batch(i, t)
      for x, y in zip(got[:2], rows):
        np.testing.assert_array_equal(x, y[i])
      assert got[2].dtype == np.uint32 and got[2].shape == (2,)
  state = run_steps(exp, exp.init_state(), 0, 6)
  # The records' evaluation of theta is the runner's of its DiLoCo state.
  np.testing.assert_allclose(problem.runner.evaluate(sync.theta)["eval/loss"],
                             exp.evaluate(state)["eval/loss"], rtol=1e-5)
  theta = methods.ALGORITHMS["diloco"].eval_params(state.params,
                                                   state.opt_state)
  want = runner_problem.flat(jax.tree.map(lambda x: x[0], to_host(theta)))
  start = problem.params
  assert sorted(want) == sorted(sync.theta)
  for k in want:
    np.testing.assert_allclose(sync.theta[k], want[k], rtol=2e-6, atol=2e-7)
    # the comparison is not vacuous: theta moved far beyond the tolerance
  assert max(np.max(np.abs(want[k] - start[k])) for k in want) > 1e-3
