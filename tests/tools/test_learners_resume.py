"""Learners: what a resume and the command refuse before Ray starts (the
run a checkpoint was written by, the problem's leaves, the run directory's
records), in process."""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import numpy as np
import pytest

from decentral_jax.runner import checkpoint
from decentral_jax.tools import cli
from decentral_jax.tools import flag_types
from decentral_jax.tools.learners import cluster
from decentral_jax.tools.learners import learner as learner_lib
from decentral_jax.tools.learners import flags as flags_lib
from decentral_jax.tools.learners import main as main_lib
from decentral_jax.tools.learners import records
from decentral_jax.tools.learners import runner_problem
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib

BASE = dict(shards=2, sync_every=4, periods=3, quorum=2)


def _one_merge(run, directory):
  """A synchronizer of ``run`` that merged one period (zero pseudo-
  gradients of both learners) into ``directory``."""
  sync = sync_lib.Synchronizer(run, directory)
  for w in range(run.shards):
    sync.join(w, run.fingerprint())
  for w in range(run.shards):
    zero = {k: np.zeros_like(v) for k, v in sync.theta.items()}
    assert sync.push(w, 0, zero, 4) == "accepted"
  deadline = time.monotonic() + 30
  while sync.version < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  sync.close()
  assert sync.version == 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("ckpt"))
  _one_merge(spec_lib.RunSpec(**BASE), directory)
  return directory


@pytest.fixture
def no_ray(monkeypatch):
  def start(*a, **k):
    raise AssertionError("Ray started")
  monkeypatch.setattr(cluster, "start", start)


@pytest.mark.parametrize("change, field", [
    ({"sync_every": 8}, "sync_every=4, this run has 8"),
    ({"inner": "adamw"}, "inner='sgd', this run has 'adamw'"),
    ({"inner_lr": 0.05}, "inner_lr=0.1, this run has 0.05"),
    ({"fragments": 2}, "fragments=1, this run has 2"),
    ({"outer": "delayed_nesterov", "delay_buffer": 2},
     "outer='nesterov', this run has 'delayed_nesterov'"),
    ({"problem_args": (("seed", 7),)}, "problem_args.seed='<missing>', this "
     "run has 7"),
    ({"compressor": "int8", "block": 64}, "compressor='none'")])
def test_a_resume_of_another_run_is_refused_naming_the_field(
    saved, change, field):
  run = spec_lib.RunSpec(**{**BASE, **change})
  with pytest.raises(ValueError, match="start a new checkpoint") as e:
    sync_lib.check_run(run, saved)
  assert f"was written by a run with {field}" in str(e.value), e.value
  with pytest.raises(ValueError, match=re.escape(field.split(",")[0])):
    sync_lib.Synchronizer(run, saved)  # the actor refuses it too


def test_a_changed_override_of_a_config_is_named_alone():
  def run(*overrides):
    return spec_lib.RunSpec(problem="runner", problem_args=(
        ("config", "c.py"), ("overrides", overrides)), sync_every=3)
  with pytest.raises(ValueError) as e:
    spec_lib.check_resume(run("--config.steps=6").trajectory(), run(
        "--config.steps=6", "--config.seed=7").trajectory(), "checkpoint 1")
  assert str(e.value).startswith(
      "checkpoint 1 was written by a run with problem_args.overrides=[], "
      "this run has ['--config.seed=7']; "), e.value


def test_a_resume_may_change_learners_periods_and_scheduling(saved):
  run = spec_lib.RunSpec(shards=1, sync_every=4, periods=9, quorum=1,
                         mode="decoupled", grace_s=0.1, sleep_s=(0.01,),
                         keep_state=False)
  sync_lib.check_run(run, saved)
  sync = sync_lib.Synchronizer(run, saved)
  sync.close()
  assert sync.resumed and sync.version == 1


def test_an_older_checkpoint_without_its_run_resumes_with_a_warning(
    tmp_path, capsys):
  run = spec_lib.RunSpec(**BASE)
  sync = sync_lib.Synchronizer(run)
  state = sync._state_tree()  # pylint: disable=protected-access
  sync.close()
  with checkpoint.Checkpointer(str(tmp_path), async_save=False) as ckpt:
    ckpt.save(1, state, {"version": 1, "log": sync.log, "active": [0, 1],
                         "periods": 3})
  other = spec_lib.RunSpec(**{**BASE, "sync_every": 8})
  sync_lib.check_run(other, str(tmp_path))
  assert "does not record its run" in capsys.readouterr().err


def test_the_command_refuses_another_run_before_ray_starts(
    saved, no_ray, capsys):
  assert cli.main(["learners", "--learners", "2", "--sync-every", "8",
                   "--checkpoint-dir", saved]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: checkpoint ") and (
      "sync_every=4, this run has 8" in err[-1]), err


def test_more_fragments_than_leaves_is_refused_before_ray_starts(
    no_ray, capsys):
  assert cli.main(["learners", "--fragments", "4"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --fragments=4 exceeds the 3 parameter leaves "
                 "of the problem; use --fragments <= 3, or a "
                 "problem with more leaves (--problem gpt, or --config)."], err


@pytest.mark.parametrize("text, words", [
    ("{broken", "is not JSON"),
    ("[1, 2]", "must be an object"),
    ('{"config_source": "c", "overrides": [], "config": {}, "learners": 2, '
     '"segments": 5}', "segments"),
    ('{"config_source": "c", "overrides": [], "config": {}, "learners": 2, '
     '"segments": [{"from_period": 0, "from_step": 0, "n_workers": 2, '
     '"sharding": "s"}]}', "segments[0]")])
def test_a_damaged_learners_json_is_one_error_naming_the_file(
    tmp_path, text, words):
  (tmp_path / "learners.json").write_text(text)
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(tmp_path / "learners.json") in str(e.value), e.value
  assert words in str(e.value), e.value


def _meta(**top):
  segs = [{"from_period": 0, "from_step": 0, "learners": 2, "n_workers": 2,
           "sharding": "s"}, {"from_period": 2, "from_step": 6,
                              "learners": 1, "n_workers": 1, "sharding": "s"}]
  meta = {"config_source": "c", "overrides": [], "config": {"sync_every": 3},
          "learners": 1, "segments": segs}
  for key, value in top.items():
    if key[:3] == "seg" and key[3].isdigit():
      segs[int(key[3])][key[5:]] = value
    else:
      meta[key] = value
  return meta


@pytest.mark.parametrize("damage, words", [
    ({"learners": 99}, '"learners" is 99, not the last segment\'s 1'),
    ({"seg0_from_step": 10**9}, '"segments[0].from_step" is 1000000000, not '
     "from_period * config.sync_every = 0 * 3 = 0"),
    ({"seg1_from_step": 7}, '"segments[1].from_step" is 7, not from_period '
     "* config.sync_every = 2 * 3 = 6"),
    ({"seg0_from_period": 5, "seg0_from_step": 15},
     '"segments[1].from_period" is 2, before segments[0]\'s 5'),
    ({"seg1_n_workers": 2}, '"segments[1].n_workers" is 2, not its '
     "learners 1"),
    ({"segments": []}, '"segments" is empty')])
def test_learners_json_values_that_contradict_each_other_are_named(
    tmp_path, no_ray, capsys, damage, words):
  path = tmp_path / "learners.json"
  path.write_text(json.dumps(_meta()))
  assert records.check_workdir(str(tmp_path)) == 6  # undamaged: period 2
  path.write_text(json.dumps(_meta(**damage)))
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(e.value).startswith(f"{path}: {words}"), e.value
  assert str(e.value).endswith("restore the file or start a new --workdir")
  assert cli.main(["learners", "--config", "configs/gpt_tiny.py",
                   *DILOCO, "--workdir", str(tmp_path)]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [f"error: {e.value}"]


def test_a_damaged_metrics_jsonl_is_one_error_naming_the_file(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{broken\n{"step": 1}\n')
  with pytest.raises(ValueError, match="metrics.jsonl"):
    records.check_workdir(str(tmp_path))


def test_the_command_refuses_a_damaged_workdir_before_ray_starts(
    tmp_path, no_ray, capsys):
  (tmp_path / "learners.json").write_text(json.dumps([1, 2]))
  assert cli.main(["learners", "--config", "configs/gpt_tiny.py",
                   "--config.algorithm=diloco", "--config.optimizer.name="
                   "adamw", "--config.optimizer.accum_steps=1", "--workdir", str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and (
      "learners.json" in err[0]), err


def test_learners_that_all_stopped_on_an_error_end_the_run_naming_them():
  run = spec_lib.RunSpec(**{**BASE, "inner_lr": 1000.0, "sync_every": 8,
                            "periods": 10})
  sync = sync_lib.Synchronizer(run)
  link = learner_lib.Link(lambda name, *args: getattr(sync, name)(*args))
  learners = {i: learner_lib.Learner(run, i, link) for i in range(2)}
  deadline = time.monotonic() + 30
  while (any(not lrn.status()["error"] for lrn in learners.values())
         and time.monotonic() < deadline):
    time.sleep(0.01)
  states = {i: lrn.stop() for i, lrn in learners.items()}
  sync.close()
  assert sync.version < run.periods
  why = main_lib.stalled(states)
  assert why.startswith("every learner stopped with an error"), why
  assert "learner 0: RuntimeError: the synchronizer rejected" in why, why
  assert "holds NaN or inf" in why, why
  assert main_lib.stalled({**states, 1: None}) is None  # one restarting
  assert main_lib.stalled({0: states[0], 1: {**states[1], "error": None}}) \
      is None


def test_the_driver_stops_when_no_learner_can_go_on(monkeypatch, capsys):
  class Run:
    learners = {}
    def status(self):
      return {"version": 1, "periods": 4, "done": False}
  down = {"version": 1, "steps": 3, "tokens": 6, "waits": [],
          "error": "RuntimeError: boom"}
  answers = iter([{0: None, 1: None}, {0: down, 1: None}])
  monkeypatch.setattr(main_lib, "_learner_states",
                      lambda c: next(answers, {0: down, 1: down}))
  args = argparse.Namespace(timeout=30.0, every=0.0, kill_every=0)
  with pytest.raises(main_lib.Stalled, match="learner 1: RuntimeError: boom"):
    main_lib._drive(Run(), args)  # pylint: disable=protected-access
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "period 1/4 | L0 starting | L1 starting", lines
  assert lines[1].endswith("| L1 starting"), lines
  assert "L0 restarting" not in lines[1] and "error RuntimeError: boom" in lines[1]


@pytest.mark.parametrize("fields, words", [
    ({"sleep_s": (-1.0,)}, "RunSpec.sleep_s must be a tuple of seconds in "
     "[0, 86400]"),
    ({"sleep_s": ("a",)}, "RunSpec.sleep_s must be a tuple of seconds in"),
    ({"sleep_s": (1e30,)}, "RunSpec.sleep_s must be a tuple of seconds in "
     "[0, 86400] (one per learner), got (1e+30,)"),
    ({"inner_lr": -0.1}, "RunSpec.inner_lr must be a finite number > 0"),
    ({"outer_lr": -0.7}, "RunSpec.outer_lr must be a finite number > 0"),
    ({"outer_lr": float("nan")}, "RunSpec.outer_lr must be"),
    ({"outer_momentum": 1.0}, "RunSpec.outer_momentum must be a number in "
     "[0, 1)")])
def test_run_spec_names_a_bad_number(fields, words):
  with pytest.raises(ValueError) as e:
    spec_lib.RunSpec(**{**BASE, **fields})
  assert str(e.value).startswith(words), e.value


@pytest.mark.parametrize("fields, words", [
    ({"inner_schedule": "warmup_cosine"}, "RunSpec.inner_schedule="
     "'warmup_cosine' needs problem='runner'"),
    ({"inner": "accum_adamw"}, "RunSpec.inner must be one of"),
    ({"problem": "runner", "inner": ""}, "RunSpec.inner must be a non-empty"),
    ({"problem": "runner", "inner_schedule": None},
     "RunSpec.inner_schedule must be a non-empty")])
def test_run_spec_names_a_schedule_it_does_not_run(fields, words):
  with pytest.raises(ValueError) as e:
    spec_lib.RunSpec(**{**BASE, **fields})
  assert str(e.value).startswith(words), e.value
  # a runner config's own optimizer and schedule
  spec_lib.RunSpec(**{**BASE, "problem": "runner", "inner": "accum_adamw",
                      "inner_schedule": "inverse_sqrt, warmup 2"})


RUNNER = dict(BASE, problem="runner", inner="adamw", inner_lr=0.003,
              inner_schedule="warmup_cosine, warmup 2, to 0.0003 at step 6",
              problem_args=(("config", "c.py"), ("overrides", ("a=1",))))


def test_a_checkpoint_written_before_the_inner_schedule_resumes():
  """A checkpoint without ``inner_schedule`` ran a constant learning rate
  (without a config) or recorded placeholders sgd/0.1 (with one): it
  resumes; one that records another inner optimizer is refused."""
  ours = spec_lib.RunSpec(**BASE).trajectory()
  old = {k: v for k, v in ours.items() if k != "inner_schedule"}
  spec_lib.check_resume(old, ours, "checkpoint 1")
  with pytest.raises(ValueError, match="inner_lr=0.1, this run has 0.05"):
    spec_lib.check_resume(old, spec_lib.RunSpec(
        **{**BASE, "inner_lr": 0.05}).trajectory(), "checkpoint 1")
  run = spec_lib.RunSpec(**RUNNER)
  old = {**run.trajectory(), "inner": "sgd", "inner_lr": 0.1}
  del old["inner_schedule"]
  sync_lib.check_resume_meta(run, {"run": old}, "checkpoint 1")
  other = {**run.trajectory(), "inner_schedule": "constant"}
  with pytest.raises(ValueError, match="inner_schedule='constant', this run "
                     "has 'warmup_cosine"):
    sync_lib.check_resume_meta(run, {"run": other}, "checkpoint 1")


def test_run_spec_takes_numpy_scalars():
  run = spec_lib.RunSpec(**{**BASE, "sync_every": 8, "merge_alpha":
                            np.float32(0.5), "inner_lr": np.float64(0.1)})
  assert run.trajectory()["merge_alpha"] == 0.5


def test_a_merge_whose_theta_is_not_finite_is_refused_and_logged(capsys):
  run = spec_lib.RunSpec(**BASE)
  sync = sync_lib.Synchronizer(run)
  for w in range(2):
    sync.join(w, run.fingerprint())
  before = {k: v.copy() for k, v in sync.theta.items()}
  huge = {k: np.full_like(v, 3e38) for k, v in before.items()}
  for w in range(2):
    assert sync.push(w, 0, huge, 4) == "accepted"  # each one finite
  deadline = time.monotonic() + 30
  while len(sync.log["rejected"]) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
  again = sync.push(0, 0, huge, 4)
  sync.close()
  assert sync.version == 0 and sync.log["merged_with"] == []
  for k, v in before.items():
    np.testing.assert_array_equal(sync.theta[k], v)
  assert [r[:2] for r in sync.log["rejected"][:2]] == [[0, 0], [1, 0]]
  assert "merged theta of fragment 0 holds NaN or inf" in again
  assert "refused the merge of learners [0, 1]" in capsys.readouterr().err


def test_a_runner_config_whose_data_is_missing_is_refused_before_ray_starts(
    tmp_path, no_ray, capsys):
  assert cli.main(["learners", "--config", "configs/gpt_tiny.py",
                   "--config.algorithm=diloco", "--config.optimizer.name="
                   "adamw", "--config.optimizer.accum_steps=1",
                   "--config.data.source=text_file",
                   f"--config.data.path={tmp_path}/none.txt"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: config.data.path=") \
      and "does not exist" in err[0], err


def test_learners_that_died_for_good_end_the_run():
  class ActorDiedError(Exception):  # Ray's name for an actor out of restarts
    pass
  class Handle:
    def __init__(self, raises):
      self.status = self
      self.raises = raises
    def remote(self):
      return self.raises
  class Ray:
    @staticmethod
    def get(raises, timeout=None):
      del timeout
      raise raises
  class Run:
    learners = {0: Handle(ActorDiedError("gone")), 1: Handle(TimeoutError())}
    _ray = Ray()
  states = main_lib._learner_states(Run())  # pylint: disable=protected-access
  assert states == {0: main_lib.DEAD, 1: None}
  assert main_lib.stalled(states) is None  # learner 1 may come back
  assert main_lib.progress_line({"version": 2, "periods": 4}, states, {1}) \
      == "period 2/4 | L0 dead | L1 restarting"
  why = main_lib.stalled({0: main_lib.DEAD, 1: {"error": "ValueError: x"}})
  assert why.endswith("(learner 0: its process died and Ray will not "
                      "restart it; learner 1: ValueError: x)"), why


CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                      "gpt_tiny.py")
DILOCO = ("--config.algorithm=diloco", "--config.optimizer.name=adamw",
          "--config.optimizer.accum_steps=1", "--config.sync_every=4")


def _runner_run(*overrides):
  return spec_lib.RunSpec(problem="runner", shards=2, sync_every=4,
                          problem_args=(("config", CONFIG), (
                              "overrides", DILOCO + tuple(overrides))))


@pytest.mark.parametrize("ours", [
    ("--config.steps=12", "--config.seed=3"),  # reordered
    ("--config.seed=3", "--config.steps=12", "--config.seed=3"),  # repeated
    ("--config.seed=3", "--config.steps=12", "--config.model.dropout=0.0"),
    ("--config.seed=3", "--config.steps=12",
     "--config.schedule.peak_lr=3e-3"),  # another literal
])
def test_a_resume_compares_config_overrides_by_value(ours):
  saved = _runner_run("--config.seed=3", "--config.steps=12",
                      "--config.schedule.peak_lr=0.003")
  if "peak_lr" not in str(ours):
    saved = _runner_run("--config.seed=3", "--config.steps=12")
  # gpt_tiny's dropout is 0.0: spelling the default out changes nothing.
  sync_lib.check_resume_meta(_runner_run(*ours),
                             {"run": saved.trajectory()}, "checkpoint 1")


def test_a_resume_with_another_config_value_names_the_field():
  saved = _runner_run("--config.seed=3", "--config.steps=12")
  with pytest.raises(ValueError) as e:
    sync_lib.check_resume_meta(
        _runner_run("--config.steps=12", "--config.seed=4"),
        {"run": saved.trajectory()}, "checkpoint 1")
  assert str(e.value).startswith(
      "checkpoint 1 was written by a run with config.seed=3, this run has "
      "4; "), e.value


def test_a_run_started_with_an_n_workers_override_resumes_without_it():
  # Started as --config.n_workers=2 --learners 2; resumed as --learners 1
  # with the override dropped (it would now say n_workers=2 for 1 learner).
  saved = _runner_run("--config.n_workers=2", "--config.seed=3")
  ours = spec_lib.RunSpec(problem="runner", shards=1, sync_every=4,
                          problem_args=(("config", CONFIG), (
                              "overrides", DILOCO + ("--config.seed=3",))))
  sync_lib.check_resume_meta(ours, {"run": saved.trajectory()},
                             "checkpoint 2")
  with pytest.raises(ValueError, match="config.seed=3, this run has 4"):
    sync_lib.check_resume_meta(
        spec_lib.RunSpec(problem="runner", shards=1, sync_every=4,
                         problem_args=(("config", CONFIG), (
                             "overrides", DILOCO + ("--config.seed=4",)))),
        {"run": saved.trajectory()}, "checkpoint 2")


@pytest.mark.parametrize("flags, says", [
    (["--json", "DIR"], "--json 'DIR' is a directory; give a file name."),
    (["--json", ""], "--json is empty; give a file name."),
    (["--checkpoint-dir", "FILE"], "--checkpoint-dir 'FILE' is a file, not "
     "a directory; give a directory (it is created if missing)."),
    (["--config", "gpt_tiny", "--workdir", "FILE/sub"], "--workdir "
     "'FILE/sub' cannot be created: 'FILE' is a file.")])
def test_output_paths_are_checked_before_ray_starts(
    tmp_path, no_ray, capsys, flags, says):
  (tmp_path / "f").write_text("x")
  sub = {"DIR": str(tmp_path), "FILE": str(tmp_path / "f")}
  fix = lambda s: s.replace("FILE", sub["FILE"]).replace("DIR", sub["DIR"])
  assert cli.main(["learners", *map(fix, flags)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"error: {fix(says)}"], err


def _records(workdir, steps):
  seg = {"from_period": 0, "from_step": 0, "learners": 2, "n_workers": 2,
         "sharding": "s"}
  (workdir / "learners.json").write_text(json.dumps(
      {"config_source": "c", "overrides": [], "config": {}, "learners": 2,
       "segments": [seg]}))
  (workdir / "metrics.jsonl").write_text(
      "".join(json.dumps({"step": s}) + "\n" for s in steps))


def test_records_of_merged_periods_without_their_checkpoints_are_refused(
    tmp_path, saved):
  run = spec_lib.RunSpec(**BASE)
  _records(tmp_path, [0, 4, 8])  # 2 periods of H=4 merged
  gone = str(tmp_path / "checkpoints")  # rm -rf DIR/checkpoints
  with pytest.raises(ValueError) as e:
    main_lib.preflight(run, gone, str(tmp_path))
  assert str(e.value) == (
      f"--workdir {tmp_path} records merged periods (up to inner step 8) "
      f"but {gone} holds no checkpoint to resume them from (the checkpoints "
      "are gone); start a new --workdir."), e.value
  main_lib.preflight(run, saved, str(tmp_path))  # its checkpoint is there
  _records(tmp_path, [0])  # started, nothing merged: a fresh start is right
  main_lib.preflight(run, gone, str(tmp_path))


@pytest.mark.parametrize("flags, says", [
    (["--eval-every", "3"], "--eval-every has no effect without --workdir"),
    (["--mode", "sync", "--grace", "3"], "--grace has no effect in --mode "
     "sync (a merge waits for every active learner); use --mode decoupled "
     "or drop --grace."),
    (["--grace", "3"], "--grace has no effect in --mode sync"),
    # decoupled, quorum = K: the quorum is every learner, nothing to wait for
    (["--mode", "decoupled", "--learners", "2", "--quorum", "2", "--grace",
      "3"], "--grace has no effect with --quorum equal to --learners (the "
     "default quorum 1 with --learners 1): a merge needs every learner's "
     "pseudo-gradient, so it never waits; give --quorum below --learners or "
     "drop --grace."),
    (["--learners", "1", "--mode", "decoupled", "--grace", "30"],
     "--grace has no effect with --quorum equal to --learners"),
    # optax.sgd's state is empty and no compressor keeps a residual
    (["--drop-state"], "--drop-state has no effect with --inner sgd and no "
     "--config (SGD keeps no state and there is no compressor residual: "
     "nothing is sent either way); use --inner adamw or drop --drop-state."),
    (["--inner", "sgd", "--drop-state"], "--drop-state has no effect"),
    (["--connect-timeout", "5"], "--connect-timeout has no effect without "
     "--address (the Ray started on this machine is not waited for); add "
     "--address HOST:PORT or drop --connect-timeout.")])
def test_flags_that_change_nothing_are_refused_before_ray_starts(
    no_ray, capsys, flags, says):
  assert cli.main(["learners", *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
  args = flags_lib.parser().parse_args(["--mode", "decoupled", "--grace", "3"])
  flag_types.check_needs(flags_lib.NEEDS, {"--grace"}, args)  # read there
  args = flags_lib.parser().parse_args(["--mode", "decoupled", "--learners",
                                       "3", "--quorum", "2"])
  flag_types.check_needs(flags_lib.NEEDS, {"--grace"}, args)  # 2 of 3 waits
  args = flags_lib.parser().parse_args(["--inner", "adamw"])
  flag_types.check_needs(flags_lib.NEEDS, {"--drop-state"}, args)  # moments


@pytest.mark.parametrize("override, says", [
    ("tracker=wandb", "config.tracker='wandb' has no meaning for learners: "
     "learners write metrics.jsonl only; set it to ''."),
    ("tensorboard=True", "config.tensorboard=True has no meaning for "
     "learners: learners write metrics.jsonl only; set it to False."),
    ("checkpoint_interval=5", "--config.checkpoint_interval=5 has no effect "
     "for learners: the synchronizer saves a checkpoint after every merge "
     "(the newest 2 kept); drop it."),
    ("keep_checkpoints=9", "--config.keep_checkpoints=9 has no effect for "
     "learners: the synchronizer keeps its newest 2 checkpoints; drop it."),
    ("log_interval=3", "--config.log_interval=3 has no effect for learners: "
     "learners write one metrics record per merged period; drop it."),
    # nothing under tools/learners reads them (no per-step program; the
    # run directory is --workdir)
    ("consensus_at=next_step", "--config.consensus_at=next_step has no "
     "effect for learners: learners have no per-step program; theta is the "
     "synchronizer's, evaluated in --workdir's metrics.jsonl; drop it."),
    ("workdir=/tmp/elsewhere", "--config.workdir=/tmp/elsewhere has no "
     "effect for learners: the learners' run directory is --workdir DIR; "
     "drop it.")])
def test_runner_fields_learners_do_not_read_are_refused_by_name(
    override, says):
  with pytest.raises(ValueError) as e:
    runner_problem.load(CONFIG, DILOCO + (f"--config.{override}",), 2)
  assert str(e.value) == says, e.value


@pytest.mark.parametrize("flags, says", [
    # the evaluation runs only into --workdir's metrics.jsonl
    (["--config.eval_interval=8"], "--config.eval_interval=8 has no effect "
     "for learners without --workdir (theta is evaluated only into "
     "--workdir's metrics.jsonl); add --workdir DIR or drop it."),
    (["--config.eval_batches=1"], "--config.eval_batches=1 has no effect "
     "for learners without --workdir"),
    # --eval-every sets the period config.eval_interval would
    (["--workdir", "WORKDIR", "--eval-every", "2",
      "--config.eval_interval=8"], "--config.eval_interval=8 has no effect "
     "with --eval-every (it sets the merged periods between evaluations); "
     "drop one of them.")])
def test_evaluation_overrides_the_run_would_not_read_are_refused(
    no_ray, capsys, tmp_path, flags, says):
  flags = [str(tmp_path / "w") if f == "WORKDIR" else f for f in flags]
  assert cli.main(["learners", "--learners", "2", "--config", CONFIG,
                   *DILOCO, *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
  assert not (tmp_path / "w").exists()
  # read with --workdir: eval_batches always, eval_interval without
  # --eval-every
  runner_problem.check_evaluation_overrides(
      ["--config.eval_interval=8", "--config.eval_batches=1"], True, False)
  runner_problem.check_evaluation_overrides(
      ["--config.eval_batches=1"], True, True)


def _times(workdir, pairs):
  (workdir / "metrics.jsonl").write_text("".join(
      json.dumps({"step": s, "train_time_s": t}) + "\n" for s, t in pairs))


class _Task:
  """What RunRecords.begin reads of a RunnerTask at a resumed period."""
  config = __import__("ml_collections").ConfigDict({"sync_every": 5})


OURS = "restore the file or start a new --workdir."
RUNNERS = "fix or delete that line, or move the file away, and run again."


# The runner's metrics reader (types, ranges, order; names the line) reads
# the file first; the learners' rules (the time's bound, never decreasing)
# name the record's step.
@pytest.mark.parametrize("pairs, words, fix", [
    ([(0, 0.0), (5, 1e300), (10, 1e300)],
     ", line 2: train_time_s must be in [0, 1e+09], got 1e+300", RUNNERS),
    ([(0, -50.0), (5, -50.0)],
     ", line 1: train_time_s must be in [0, 1e+09], got -50.0", RUNNERS),
    ([(0, 0.0), (5, "5"), (10, 2.0)],
     ", line 2: train_time_s must be a number, got '5'", RUNNERS),
    ([(0, 0.0), (5, True)], ", line 2: train_time_s must be a number",
     RUNNERS),
    ([(0, 0.0), (5, 9.0), (10, 4.0)],
     ': the record of step 10: "train_time_s" is 4, fewer than the 9 of the '
     "record before", OURS),
    ([(0, 0.0), (10, 1.0), (5, 2.0)],
     ', line 3: "step" must increase from line to line, got 5 after 10',
     RUNNERS)])
def test_damaged_train_seconds_or_steps_are_refused_by_preflight_and_resume(
    tmp_path, pairs, words, fix):
  """One reader for the preflight and RunRecords.begin: a time offset out
  of range, of the wrong type or going back, or steps that do not
  increase, is one error naming the file (never trusted, never a
  TypeError)."""
  _times(tmp_path, pairs)
  path = tmp_path / "metrics.jsonl"
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(e.value).startswith(f"{path}{words}"), e.value
  assert str(e.value).endswith(fix), e.value
  run = spec_lib.RunSpec(shards=2, sync_every=5, periods=4, quorum=2)
  rr = records.RunRecords(str(tmp_path), _Task(), run, "c", [], 1)
  with pytest.raises(ValueError) as e2:
    rr.begin(2, None)
  assert str(e2.value) == str(e.value)


def test_a_resume_adds_its_seconds_to_the_last_recorded(tmp_path):
  """The offset of a resumed run is the last record's train_time_s (12.5
  here, written by hand), an int or a float."""
  _times(tmp_path, [(0, 0), (5, 3.25), (10, 12.5)])
  assert records.check_workdir(str(tmp_path)) == 10
  run = spec_lib.RunSpec(shards=2, sync_every=5, periods=4, quorum=2)
  rr = records.RunRecords(str(tmp_path), _Task(), run, "c", [], 1)
  rr.begin(2, None)
  rr.close()
  assert rr._offset == 12.5  # pylint: disable=protected-access


def test_periods_past_an_explicit_config_steps_are_refused(
    tmp_path, no_ray, capsys, saved):
  """--config.steps=20 with sync_every 4 is 5 periods: --periods 6 (24
  inner steps) runs past it on a fresh run and is refused naming both;
  fewer periods stop early, and a resume may extend the run (its
  checkpoint is there)."""
  argv = ["learners", "--config", "configs/gpt_tiny.py", *DILOCO,
          "--config.steps=20", "--periods", "6"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
      "error: --periods 6 runs 6 * config.sync_every 4 = 24 inner steps, "
      "past --config.steps=20 (the steps the schedule runs over); drop "
      "--periods (then 5 periods), give at most 5 to stop early, or raise "
      "--config.steps."], err
  run = spec_lib.RunSpec(**BASE)  # periods 3, H 4: 12 inner steps
  with pytest.raises(ValueError, match="past --config.steps=11 "):
    main_lib.preflight(run, str(tmp_path / "none"), None, 11)
  main_lib.preflight(run, str(tmp_path / "none"), None, 12)  # they agree
  main_lib.preflight(run, str(tmp_path / "none"), None, 20)  # stops early
  main_lib.preflight(run, str(tmp_path / "none"), None, None)  # not given
  main_lib.preflight(run, saved, None, 4)  # a resume extends the run


def test_run_spec_refusals_name_the_flags_typed(no_ray, capsys):
  """A RunSpec refusal names the flag that sets each field: with --config
  the sync period is config.sync_every; words of prose stay (worked by
  hand)."""
  assert cli.main(["learners", "--config", "configs/gpt_tiny.py", *DILOCO,
                   "--fragments", "9"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["error: --fragments=9 exceeds --config.sync_every=4; use "
                 "1 <= --fragments <= --config.sync_every."], err
  said = ("RunSpec.periods must be an int >= 1; the merged periods of the "
          "outer optimizer, quorum <= shards, outer='nesterov'")
  assert spec_lib.flag_words(said, config=False) == (
      "--periods must be an int >= 1; the merged periods of the outer "
      "optimizer, --quorum <= --learners, --outer='nesterov'")
  assert spec_lib.flag_words("RunSpec.inner_lr must be > 0", True) == (
      "--config.schedule.peak_lr must be > 0")


@pytest.mark.parametrize("fields, words", [
    ({"problem": "nope"}, "RunSpec.problem must be one of ('quadratic', "
     "'gpt', 'runner'), got 'nope'."),
    ({"problem_args": (("noise", float("nan")),)},
     "RunSpec.problem_args.noise must be a finite number in [0, 1000], got "
     "nan."),
    ({"problem_args": (("noise", -0.1),)}, "RunSpec.problem_args.noise must"),
    ({"problem_args": (("seed", 1.5),)}, "RunSpec.problem_args.seed must be "
     "an int in [0, 4294967295], got 1.5."),
    ({"problem_args": (("seed", 1), ("seed", 2))},
     "RunSpec.problem_args has 'seed' twice"),
    ({"problem_args": (("n_layer", 2),)}, "RunSpec.problem_args has "
     "'n_layer' for problem 'quadratic'; its keys are seed, noise"),
    ({"problem": "gpt", "problem_args": (("n_embd", 0),)},
     "RunSpec.problem_args.n_embd must be an int in [1, 65536], got 0."),
    ({"problem": "runner", "problem_args": (("config", ""),)},
     "RunSpec.problem_args.config must be a non-empty string"),
    ({"problem_args": ("seed",)}, "RunSpec.problem_args must be a tuple of "
     "(key, value) pairs"),
    ({"inner_lr": 1e300}, "RunSpec.inner_lr must be a finite number > 0 and "
     "at most 1000"),
    ({"outer_lr": 1000.5}, "RunSpec.outer_lr must be a finite number > 0 and "
     "at most 1000")])
def test_run_spec_names_a_bad_problem_or_learning_rate(fields, words):
  """A NaN quadratic noise, an unknown problem and a learning rate of
  1e300 were accepted (every loss NaN, or a refusal only in an actor)."""
  with pytest.raises(ValueError) as e:
    spec_lib.RunSpec(**{**BASE, **fields})
  assert str(e.value).startswith(words), e.value


def test_run_spec_takes_the_problems_and_bounds_it_names():
  from decentral_jax.runner import field_rules
  from decentral_jax.tools.learners import problems
  assert tuple(spec_lib.PROBLEM_ARGS) == problems.NAMES
  assert spec_lib.MAX_LR == field_rules.MAX_LR
  run = spec_lib.RunSpec(**{**BASE, "inner_lr": 1000.0, "outer_lr": 1000,
                            "problem_args": (("seed", 3), ("noise", 0.0))})
  assert run.problem_args == (("seed", 3), ("noise", 0.0))
  spec_lib.RunSpec(problem="gpt", problem_args=(("n_layer", 1), (
      "context", 8)))
  assert "--inner-lr must" in spec_lib.flag_words(str(pytest.raises(
      ValueError, spec_lib.RunSpec, inner_lr=2e3).value), False)


_META4 = {"config_source": "c", "overrides": [], "config": {"sync_every": 10},
          "learners": 4, "segments": [
              {"from_period": 0, "from_step": 0, "learners": 4,
               "n_workers": 4, "sharding": "s"}]}


@pytest.mark.parametrize("key, value, words", [
    ("tokens", 5, '"tokens" is 5, fewer than the 1280 before it'),
    ("tokens", -5, '"tokens" must be an integer >= 0, got -5'),
    ("learners/merged", 99, '"learners/merged" must be an integer in [1, 4], '
     "got 99"),
    ("learners/merged", 0, '"learners/merged" must be an integer in [1, 4]'),
    ("learners/tokens/7", 3, '"learners/tokens/7" names no learner'),
    ("step", 27, '"step" is not a multiple of config.sync_every = 10'),
    ("step", 10**12, '"step" is past 2147483647')])
def test_records_the_writer_cannot_write_are_damage(tmp_path, key, value,
                                                    words):
  """4 learners, sync_every 10: tokens only grow from 0, at most 4 merged
  (ids 0..3), steps k * 10 within int32; anything else is named."""
  (tmp_path / "learners.json").write_text(json.dumps(_META4))
  recs = [{"step": 0, "tokens": 0, "train_time_s": 0.0},
          {"step": 10, "tokens": 1280, "learners/merged": 4,
           "learners/tokens/3": 320, "train_time_s": 1.0},
          {"step": 20, "tokens": 2560, "learners/merged": 4,
           "train_time_s": 2.0}]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  assert records.check_workdir(str(tmp_path)) == 20
  recs[2][key] = value
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(e.value).startswith(f"{path}: the record of step "), e.value
  assert words in str(e.value), e.value
  assert str(e.value).endswith(OURS), e.value


def test_a_count_that_does_not_grow_names_its_own_last_value(tmp_path):
  """Said '"tokens" is 5, fewer than the 0 before it' at step 0, and
  compared "samples" with the "tokens" value before it."""
  (tmp_path / "learners.json").write_text(json.dumps(_META4))
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps({"step": 0, "tokens": 5}) + "\n")
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert '"tokens" is 5, not 0 (all merged since the start: nothing is ' \
      'merged at step 0)' in str(e.value), e.value
  assert "fewer than" not in str(e.value)
  recs = [{"step": 0, "tokens": 0, "samples": 0},
          {"step": 10, "tokens": 1280, "samples": 900, "learners/merged": 4,
           "learners/tokens/3": 320},
          {"step": 20, "tokens": 2560, "samples": 7}]
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert '"samples" is 7, fewer than the 900 before it' in str(e.value), \
      e.value


def _merges(tmp_path, rows, sync_every=5):
  """learners.json of 4 learners, ``sync_every``; metrics.jsonl ``rows``
  (a blank line after the first, so line numbers are not record indices);
  returns the metrics path."""
  meta = dict(_META4, config={"sync_every": sync_every})
  (tmp_path / "learners.json").write_text(json.dumps(meta))
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows]
  path.write_text(lines[0] + "\n" + "".join(lines[1:]), encoding="utf-8")
  return path


_PER = {f"learners/tokens/{i}": 80 for i in range(4)}


@pytest.mark.parametrize("tokens, at, words", [
    (1_000_000, 10, '"tokens" is 1000000, but the record before (step 5) '
     "has 320 and this merge adds 320 (its learners/tokens/<i>), so it must "
     "be 320 + 320 = 640"),
    (639, 10, '"tokens" is 639, but the record before (step 5) has 320 and '
     "this merge adds 320 (its learners/tokens/<i>), so it must be 320 + "
     "320 = 640")])
def test_tokens_that_contradict_the_tokens_merged_are_named_with_the_line(
    tmp_path, tokens, at, words):
  """The writer's tokens_k = tokens_{k-1} + sum_i learners/tokens/i (one
  record per merged period): by hand, 320 + 4 * 80 = 640 at step 10."""
  rows = [{"step": 0, "tokens": 0, "train_time_s": 0.0},
          {"step": 5, "tokens": 320, "train_time_s": 1.0,
           "learners/merged": 4, **_PER},
          {"step": 10, "tokens": 640, "train_time_s": 2.0,
           "learners/merged": 4, **_PER}]
  path = _merges(tmp_path, rows)
  assert records.check_workdir(str(tmp_path)) == 10
  rows[2]["tokens"] = tokens
  path = _merges(tmp_path, rows)
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(e.value) == (f"{path}: the record of step {at} (line 4): "
                          f"{words} (all merged since the start); {OURS}")


def test_tokens_across_an_unrecorded_period_need_only_be_at_least_the_sum(
    tmp_path):
  """Step 5 -> 15 skips period 2 (its record lost): 320 + 320 = 640 is a
  lower bound; 1000 passes, 600 is named."""
  rows = [{"step": 0, "tokens": 0}, {"step": 5, "tokens": 320,
                                     "learners/merged": 4, **_PER},
          {"step": 15, "tokens": 1000, "learners/merged": 4, **_PER}]
  _merges(tmp_path, rows)
  assert records.check_workdir(str(tmp_path)) == 15
  rows[2]["tokens"] = 600
  _merges(tmp_path, rows)
  with pytest.raises(ValueError, match=re.escape(
      "so it must be at least 320 + 320 = 640")):
    records.check_workdir(str(tmp_path))


@pytest.mark.parametrize("key", ["learners/tokens/²", "learners/tokens/01",
                                 "learners/tokens/+1", "learners/tokens/ 1",
                                 "learners/tokens/١"])
def test_a_learner_id_not_in_ascii_digits_is_named_with_file_and_line(
    tmp_path, key):
  """Only canonical ASCII integers name a learner: "²" and "١" pass
  str.isdigit(), "01" and "+1" pass int() as learner 1."""
  per = {"learners/tokens/0": 80, "learners/tokens/2": 80,
         "learners/tokens/3": 80, key: 80}
  path = _merges(tmp_path, [{"step": 0, "tokens": 0},
                            {"step": 5, "tokens": 320,
                             "learners/merged": 4, **per}])
  with pytest.raises(ValueError) as e:
    records.check_workdir(str(tmp_path))
  assert str(e.value) == (
      f'{path}: the record of step 5 (line 3): "{key}" names no learner (0 '
      f"to 3, in ASCII digits without leading zeros); {OURS}")


@pytest.mark.parametrize("steps, lost", [
    ([0, 5, 10, 15], None),  # periods 0..3 of H=5: all there
    ([0, 5, 10], "3 (step 15)"),  # the restored period's own record
    ([0, 10, 15], "1 (step 5)"),  # a hole
    ([5, 15, 20], "0 (step 0), 2 (step 10)"),  # later ones are dropped
])
def test_a_resume_warns_once_of_merged_periods_without_records(
    tmp_path, caplog, steps, lost):
  """The learners write one record per merged period k, of step k * H
  (k = 0..version): resuming at period 3 with H = 5 from a file lacking
  some of steps 0, 5, 10, 15 names exactly those, once."""
  _times(tmp_path, [(s, float(i)) for i, s in enumerate(steps)])
  run = spec_lib.RunSpec(shards=2, sync_every=5, periods=4, quorum=2)
  rr = records.RunRecords(str(tmp_path), _Task(), run, "c", [], 1)
  with caplog.at_level("WARNING"):
    rr.begin(3, None)
  rr.close()
  said = [r.getMessage() for r in caplog.records
          if r.levelname == "WARNING"]
  if lost is None:
    assert said == [], said
    return
  path = tmp_path / "metrics.jsonl"
  assert said == [
      f"{path} lacks the records of merged period(s) {lost} (one per "
      "period k * sync_every, k = 0..3): they are lost; the resumed run "
      "writes from period 4 (step 20) on."], said
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] \
      == [s for s in steps if s <= 15]


class _Scored:
  """A RunnerTask whose losses name the theta scored (theta = version)."""
  config = _Task.config
  task = argparse.Namespace(unit="tokens")

  def train_loss(self, theta, learners, step):
    del learners, step
    return float(theta)

  def evaluate(self, theta):
    return {"eval/loss": 10.0 + theta}

  def learning_rate(self, step):
    del step
    return 1e-3


def test_a_period_merged_between_two_polls_has_no_train_loss(tmp_path):
  """Periods 1 and 2 merge before the first poll (it reads theta_2): the
  record of step 5 holds the merge's counts only, step 10's the loss of
  theta_2 and, 2 >= eval_every periods after step 0, its evaluation;
  period 3, the last, is evaluated though only one period later."""
  run = spec_lib.RunSpec(shards=2, sync_every=5, periods=3, quorum=2)
  rr = records.RunRecords(str(tmp_path), _Scored(), run, "c", [], 2)
  rr.begin(0, 0)
  log = {"tokens": [{"0": 8, "1": 8}] * 3}
  status = {"version": 2, "periods": 3, "log": log}
  rr.update(status, lambda: (2, 2), lambda: status)
  status3 = {**status, "version": 3}
  rr.update(status3, lambda: (3, 3), lambda: status3)
  rr.close()
  got = [json.loads(l) for l in
         (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in got] == [0, 5, 10, 15]
  assert [r["tokens"] for r in got] == [0, 16, 32, 48]
  assert [r.get("train/loss") for r in got] == [None, None, 2.0, 3.0]
  assert [r.get("eval/loss") for r in got] == [10.0, None, 12.0, 13.0]


@pytest.mark.parametrize("where, flag", [
    ("work/metrics.jsonl", "--workdir"), ("work/learners.json", "--workdir"),
    ("work/config.json", "--workdir"), ("ckpt/corpus.txt", "--checkpoint-dir")])
def test_data_at_a_path_the_learners_write_is_refused_before_ray_starts(
    tmp_path, no_ray, capsys, where, flag):
  """The run would replace (or its synchronizer's Orbax directory hold) the
  data: refused, the data untouched."""
  corpus = tmp_path / where
  corpus.parent.mkdir(parents=True)
  corpus.write_text("some text to train on\n" * 200)
  before = corpus.read_bytes()
  assert cli.main(["learners", "--config", "configs/gpt_tiny.py",
                   "--config.algorithm=diloco", "--config.optimizer.name="
                   "adamw", "--config.optimizer.accum_steps=1",
                   "--config.data.source=text_file",
                   f"--config.data.path={corpus}",
                   f"--workdir={tmp_path / 'work'}",
                   f"--checkpoint-dir={tmp_path / 'ckpt'}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"of {flag} " in err[0] and \
      "--config.data.path" in err[0], err
  assert corpus.read_bytes() == before


def test_data_elsewhere_in_the_learners_workdir_is_not_refused(tmp_path,
                                                             no_ray):
  """No run file lies there: every check passes and Ray would start."""
  corpus = tmp_path / "work" / "data" / "corpus.txt"
  corpus.parent.mkdir(parents=True)
  corpus.write_text("some text to train on\n" * 2000)
  with pytest.raises(AssertionError, match="Ray started"):
    cli.main(["learners", "--config", "configs/gpt_tiny.py",
              "--config.algorithm=diloco", "--config.optimizer.name=adamw",
              "--config.optimizer.accum_steps=1",
              "--config.data.source=text_file",
              f"--config.data.path={corpus}",
              f"--workdir={tmp_path / 'work'}"])
