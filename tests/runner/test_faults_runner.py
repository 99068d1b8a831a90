"""config.faults in the runner: bit-identical without faults, training with
them, the goodput and live mask in metrics.jsonl, a bit-exact resume inside
the faults, and the config checks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import fault_run
from decentral_jax.runner import metrics
from decentral_jax.runner import train
from decentral_jax.runner import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 8
TINY = ("--config.model.n_layer=1", "--config.model.n_embd=16",
        "--config.model.n_head=2", "--config.model.block_size=8",
        "--config.global_batch=16", "--config.eval_batches=1",
        "--config.steps=12", "--config.schedule.warmup_steps=2",
        "--config.optimizer.name=adamw", "--config.optimizer.accum_steps=1",
        "--config.log_interval=2", "--config.sync_every=3")


def _config(*extra):
  tiny = TINY
  if any(a in extra for a in ("--config.algorithm=decentralized",
                              "--config.algorithm=sgp")):
    tiny = TINY[:-1]  # no sync period: refused where it has no effect
  return config_lib.load_config(os.path.join(ROOT, "configs", "gpt_tiny.py"),
                                (*tiny, *extra))


def _params_after(config, steps):
  exp = experiment_lib.Experiment(config)
  state = exp.init_state()
  for s in range(steps):
    state, m = exp.train_step(state, exp.get_batch(s), s)
    jax.block_until_ready(m)
  return jax.tree.map(np.asarray, jax.device_get(state.params))


@pytest.mark.slow  # two training runs each: the slow tier
@pytest.mark.parametrize("algorithm", ["diloco", "local_sgd"])
def test_no_faults_is_bit_identical(algorithm):
  require_devices(N)
  plain = _params_after(_config(f"--config.algorithm={algorithm}"), 7)
  enabled = _params_after(_config(f"--config.algorithm={algorithm}",
                                  "--config.faults.enabled=True"), 7)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(enabled)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.integration
def test_run_with_faults_trains_and_records_goodput(tmp_path):
  require_devices(N)
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"n_workers": N, "events": [
      {"worker": 2, "start": 1, "end": 5, "state": "dead"},
      {"worker": 5, "start": 0, "state": "slow", "speed": 0.5}]}))
  config = _config("--config.algorithm=diloco", "--config.faults.enabled=True",
                   f"--config.faults.trace={trace}",
                   "--config.faults.on_failure=rollback",
                   "--config.eval_interval=12",
                   "--config.checkpoint_interval=6")
  exp = experiment_lib.Experiment(config)
  workdir = str(tmp_path / "run")
  final = train.train_and_evaluate(config, workdir, experiment=exp)
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  by_step = {r["step"]: r for r in records}
  assert np.isfinite(final["eval/loss"])
  assert by_step[12]["eval/loss"] < by_step[0]["eval/loss"]
  # Worker 2 is dead at step index 1..4: the record of step 2 shows step
  # 1's mask, the one of step 6 everyone.
  assert by_step[2]["faults/alive"] == "11011111"
  assert by_step[2]["faults/live_workers"] == 7
  assert by_step[6]["faults/alive"] == "11111111"
  # Work done by step 12: worker 2 misses 4 steps, worker 5 half of 12.
  assert by_step[12]["faults/work_done"] == pytest.approx(
      (12 * 8 - 4 - 6) / 96)
  # Rollback: worker 2 died during the round t = 1..3, which is lost; the
  # rounds ending at t = 6, 9, 12 commit. Committed worker-steps by hand:
  # t = 4..6: six workers x 3 + worker 5 at t = 4, 6 (worker 2 rejoins at
  # t = 6 and takes no step) = 20; t = 7..9: 7 x 3 + 1 = 22; t = 10..12:
  # 7 x 3 + 2 = 23.
  assert by_step[12]["faults/skipped_syncs"] == 1
  assert by_step[12]["faults/useful_steps"] == 20 + 22 + 23
  assert by_step[12]["faults/goodput"] == pytest.approx(65 / 96)
  # Resumed from step 6 (inside the faults), the run ends bit for bit where
  # it ended, with the same records.
  ckpt_dir = os.path.join(workdir, "checkpoints")
  done12 = _restore(exp, ckpt_dir, 12)
  shutil.rmtree(os.path.join(ckpt_dir, "12"))
  again = train.train_and_evaluate(config, workdir, experiment=exp)
  assert again["eval/loss"] == final["eval/loss"]
  for a, b in zip(jax.tree.leaves(done12), jax.tree.leaves(
      _restore(exp, ckpt_dir, 12))):
    np.testing.assert_array_equal(a, b)
  timings = ("step_time_ms", "tokens_per_sec", "train_time_s")
  assert [{k: v for k, v in r.items() if k not in timings} for r in records] \
      == [{k: v for k, v in r.items() if k not in timings}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _restore(exp, directory, step):
  ckpt = checkpoint.Checkpointer(directory)
  try:
    state, _ = ckpt.restore(step, exp.init_state())
  finally:
    ckpt.close()
  return jax.tree.map(np.asarray, jax.device_get(state))


@pytest.mark.slow  # a full training run: the slow tier
def test_decentralized_dead_worker_is_frozen(tmp_path):
  # D-AdamW over one_peer_exp with worker 3 dead at steps 2..4: its
  # parameters stay bit for bit, the others keep training.
  require_devices(N)
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"events": [
      {"worker": 3, "start": 2, "end": 5, "state": "dead"}]}))
  config = _config("--config.algorithm=decentralized",
                   "--config.faults.enabled=True",
                   "--config.faults.rejoin=copy_mean",
                   f"--config.faults.trace={trace}")
  exp = experiment_lib.Experiment(config)
  state = exp.init_state()
  params = []
  for s in range(7):
    state, m = exp.train_step(state, exp.get_batch(s), s)
    assert np.all(np.isfinite(np.asarray(m["loss"])))
    params.append(jax.tree.map(np.asarray, jax.device_get(state.params)))
  for a, b in zip(jax.tree.leaves(params[1]), jax.tree.leaves(params[4])):
    np.testing.assert_array_equal(a[3], b[3])  # dead for steps 2, 3, 4
    assert not np.array_equal(a[0], b[0])
  # Rejoined at step 5 with the mean of its round's live neighbours.
  for a, b in zip(jax.tree.leaves(params[4]), jax.tree.leaves(params[5])):
    assert not np.array_equal(a[3], b[3])


@pytest.mark.slow
def test_decentralized_without_faults_is_the_plain_run():
  require_devices(N)
  plain = _params_after(_config("--config.algorithm=decentralized"), 4)
  healthy = _params_after(_config("--config.algorithm=decentralized",
                                  "--config.faults.enabled=True"), 4)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(healthy)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("overrides,match", [
    (("--config.algorithm=sgp",),
     r"config.faults.enabled=True needs config.algorithm in local_sgd, "
     r"diloco, decentralized, got 'sgp'"),
    (("--config.algorithm=decentralized", "--config.faults.failure_rate=0.1"),
     r"config.faults.rejoin='copy_theta': config.algorithm=decentralized"),
    (("--config.algorithm=decentralized", "--config.faults.trace=/x.json"),
     r"config.faults.rejoin='copy_theta': config.algorithm=decentralized"),
    (("--config.algorithm=diloco", "--config.faults.min_quorum=9"),
     r"config.faults.min_quorum=9 exceeds config.n_workers=8"),
    (("--config.algorithm=diloco", "--config.faults.failure_rate=0.1",
      "--config.faults.trace=/x.json"),
     r"config.faults.failure_rate=0.1 has no effect with config.faults.trace "
     r"\(the trace replaces the rates\); leave it at its default: "
     r"--config.faults.failure_rate=0.0\.$"),
    (("--config.algorithm=diloco", "--config.faults.trace=/nonexistent.json"),
     r"fault trace '/nonexistent.json' is not a file"),
    (("--config.algorithm=diloco", "--config.faults.mean_downtime=0.5"),
     r"config.faults.mean_downtime must be a finite number >= 1"),
    (("--config.algorithm=diloco", "--config.faults.on_failure=retry"),
     r"unknown config.faults.on_failure='retry'"),
])
def test_bad_faults_config(overrides, match):
  config = _config("--config.faults.enabled=True", *overrides)
  with pytest.raises(ValueError, match=match):
    validation.check_config(config)


# Settings the enabled schedule would not read, each refused by name.
_DECENTRALIZED = ("--config.algorithm=decentralized",)


@pytest.mark.parametrize("overrides,match", [
    ((*_DECENTRALIZED, "--config.faults.min_quorum=2"),
     r"^config.faults.min_quorum=2 has no effect with config.algorithm="
     r"'decentralized' .*--config.faults.min_quorum=1\.$"),
    ((*_DECENTRALIZED, "--config.faults.on_failure=rollback"),
     r"^config.faults.on_failure='rollback' has no effect with "
     r"config.algorithm='decentralized' .*--config.faults.on_failure="
     r"'proceed'\.$"),
    *[(("--config.algorithm=diloco", "--config.faults.trace=/x.json",
        f"--config.faults.{key}={value}"),
       rf"^config.faults.{key}={value} has no effect with config.faults."
       rf"trace \(the trace replaces the rates\)")
      for key, value in (("mean_downtime", 5.0), ("slow_fraction", 0.5),
                         ("slow_speed", 0.25), ("seed", 3))],
    (("--config.algorithm=diloco", "--config.faults.mean_downtime=5"),
     r"^config.faults.mean_downtime=5.0 has no effect with config.faults."
     r"failure_rate=0 \(no worker fails\)"),
    (("--config.algorithm=diloco", "--config.faults.slow_speed=0.25"),
     r"^config.faults.slow_speed=0.25 has no effect with config.faults."
     r"slow_fraction=0 \(no worker is slow\)"),
    (("--config.algorithm=diloco", "--config.faults.seed=3"),
     r"^config.faults.seed=3 has no effect with config.faults.failure_rate=0 "
     r"and slow_fraction=0"),
    # Nothing reads the straggler policy without a slow worker, nor the
    # rejoin policy without a failing one, nor on_failure without either
    # (the masks of "wait" and "deadline" are then equal).
    (("--config.algorithm=diloco", "--config.faults.failure_rate=0.1",
      "--config.faults.stragglers=wait"),
     r"^config.faults.stragglers='wait' has no effect with config.faults."
     r"slow_fraction=0 and no config.faults.trace \(no worker is slow\); "
     r"leave it at its default: --config.faults.stragglers='deadline'\.$"),
    (("--config.algorithm=diloco", "--config.faults.slow_fraction=0.25",
      "--config.faults.rejoin=keep"),
     r"^config.faults.rejoin='keep' has no effect with config.faults."
     r"failure_rate=0 and no config.faults.trace \(no worker fails\)"),
    # decentralized rejoins with the live neighbours' mean where workers can
    # fail; without failures its copy_mean is as unread as diloco's.
    *[((*_DECENTRALIZED, *slow, "--config.faults.rejoin=copy_mean"),
       r"^config.faults.rejoin='copy_mean' has no effect with config.faults."
       r"failure_rate=0 and no config.faults.trace \(no worker fails\); "
       r"leave it at its default: --config.faults.rejoin='copy_theta'\.$")
      for slow in ((), ("--config.faults.slow_fraction=0.25",))],
    (("--config.algorithm=local_sgd", "--config.faults.on_failure=rollback"),
     r"^config.faults.on_failure='rollback' has no effect with config.faults."
     r"failure_rate=0 and no config.faults.trace, and no slow worker left "
     r"behind"),
    # the quorum without failures or a slow worker that misses it ("wait":
    # every live worker completes every step)
    (("--config.algorithm=diloco", "--config.faults.min_quorum=3"),
     r"^config.faults.min_quorum=3 has no effect with config.faults."
     r"failure_rate=0 and no config.faults.trace, and no slow worker left "
     r"behind"),
    (("--config.algorithm=diloco", "--config.faults.slow_fraction=0.125",
      "--config.faults.stragglers=wait", "--config.faults.on_failure="
      "rollback"),
     r"^config.faults.on_failure='rollback' has no effect with config.faults."
     r"failure_rate=0"),
    # round(0.05 x 8) = round(0.4) = 0 slow workers; 1/8 makes one.
    (("--config.algorithm=diloco", "--config.faults.slow_fraction=0.05"),
     r"^config.faults.slow_fraction=0.05 makes round\(0.05 x config.n_workers"
     r"=8\) = 0 workers slow; set --config.faults.slow_fraction=0.125 "),
    (("--config.algorithm=diloco", "--config.faults.slow_fraction=0.25",
      "--config.faults.slow_speed=1"),
     r"^config.faults.slow_fraction=0.25 with config.faults.slow_speed=1 "
     r"slows no worker down"),
])
def test_fault_settings_the_schedule_ignores_are_refused(overrides, match):
  config = _config("--config.faults.enabled=True", *overrides)
  with pytest.raises(ValueError, match=match):
    validation.check_config(config)


def test_fault_settings_that_are_read_are_accepted(tmp_path):
  trace = _trace(tmp_path / "t.json",
                 {"worker": 1, "start": 3, "end": 5, "state": "dead"})
  for overrides in (
      ("--config.algorithm=diloco", "--config.faults.slow_fraction=0.125",
       "--config.faults.slow_speed=0.25", "--config.faults.seed=3"),
      ("--config.algorithm=diloco", "--config.faults.failure_rate=0.01",
       "--config.faults.mean_downtime=5", "--config.faults.min_quorum=2",
       "--config.faults.on_failure=rollback"),
      (*_DECENTRALIZED, "--config.faults.failure_rate=0.01",
       "--config.faults.rejoin=copy_mean"),
      _DECENTRALIZED,  # nothing rejoins: rejoin at its default
      (*_DECENTRALIZED, "--config.faults.slow_fraction=0.125"),
      ("--config.algorithm=diloco", "--config.faults.slow_fraction=0.125",
       "--config.faults.on_failure=rollback", "--config.faults.min_quorum="
       "8"),  # a slow worker past the deadline misses the quorum
      ("--config.algorithm=diloco", "--config.faults.trace=" + trace,
       "--config.faults.stragglers=wait", "--config.faults.rejoin=keep",
       "--config.faults.on_failure=rollback")):
    validation.check_config(_config("--config.faults.enabled=True",
                                    *overrides))
  # One slow worker of eight at 0.125, as the schedule draws it.
  run = fault_run.make(_config(
      "--config.algorithm=diloco", "--config.faults.enabled=True",
      "--config.faults.slow_fraction=0.125", "--config.faults.slow_speed=0.25"))
  assert sorted(run.schedule.speed(0).tolist()) == [0.25] + [1.0] * 7


def _trace(path, *events):
  path.write_text(json.dumps({"n_workers": N, "events": list(events)}))
  return str(path)


def test_trace_event_after_the_last_step_is_refused(tmp_path):
  dead = {"worker": 1, "start": 3, "end": 5, "state": "dead"}
  late = {"worker": 2, "start": 12, "state": "slow", "speed": 0.5}  # steps=12
  trace = _trace(tmp_path / "t.json", dead, late)
  config = _config("--config.algorithm=diloco", "--config.faults.enabled=True",
                   f"--config.faults.trace={trace}")
  with pytest.raises(ValueError) as info:
    fault_run.make(config)
  assert str(info.value) == (
      f"fault trace {trace}: events[1].start=12 is not before config.steps="
      "12, so the event never happens; remove it or set --config.steps "
      "above 12.")
  late["start"] = 11  # the last step
  trace = _trace(tmp_path / "t.json", dead, late)
  assert fault_run.make(config).schedule.speed(11).tolist()[2] == 0.5


def test_resume_skips_a_fault_setting_this_run_does_not_read():
  # A checkpoint of decentralized with slow workers only, written when the
  # method required rejoin='copy_mean' whatever the schedule: this run
  # leaves rejoin at its default (nothing rejoins), and a resume goes on.
  c = _config("--config.algorithm=decentralized", "--config.faults.enabled=True",
              "--config.faults.slow_fraction=0.25")
  mine = json.loads(c.faults.to_json())
  older = dict(mine, rejoin="copy_mean")
  assert set(validation.unread_fault_keys(c)) == {
      "min_quorum", "on_failure", "mean_downtime", "rejoin"}
  assert fault_run.resume_mismatch(older, mine) == (
      "config.faults.rejoin='copy_mean' but this run has 'copy_theta'")
  assert fault_run.resume_mismatch(
      older, mine, validation.unread_fault_keys(c)) is None
  # A setting the run reads is still compared.
  assert fault_run.resume_mismatch(
      dict(older, slow_fraction=0.5), mine, validation.unread_fault_keys(c)
  ) == "config.faults.slow_fraction=0.5 but this run has 0.25"


def test_resume_compares_the_trace_by_content_and_names_the_setting(
    tmp_path):
  require_devices(N)
  dead = {"worker": 1, "start": 3, "end": 5, "state": "dead"}
  first = _trace(tmp_path / "first.json", dead)
  moved = _trace(tmp_path / "moved.json", dead)  # the same bytes elsewhere
  other = _trace(tmp_path / "other.json", dict(dead, end=6))

  def config(trace, *extra):
    return _config("--config.algorithm=diloco", "--config.faults.enabled=True",
                   f"--config.faults.trace={trace}", *extra)

  def meta_of(c):
    return fault_run.resume_meta(c, fault_run.make(c))

  written = meta_of(config(first))
  assert written["trace_sha256"] == hashlib.sha256(
      (tmp_path / "first.json").read_bytes()).hexdigest()
  assert fault_run.resume_mismatch(written, meta_of(config(moved))) is None
  why = fault_run.resume_mismatch(written, meta_of(config(other)))
  assert why.startswith(f"config.faults.trace={first!r} (content SHA-256 "
                        f"{written['trace_sha256'][:12]}) but this run's "
                        f"config.faults.trace={other!r} has content SHA-256 ")
  assert fault_run.resume_mismatch(
      written, meta_of(config(moved, "--config.faults.on_failure=rollback"))
  ) == "config.faults.on_failure='proceed' but this run has 'rollback'"
  # A checkpoint of an older version has no hash: compared by path.
  older = {k: v for k, v in written.items() if k != "trace_sha256"}
  assert fault_run.resume_mismatch(older, meta_of(config(first))) is None
  assert fault_run.resume_mismatch(older, meta_of(config(moved))) == (
      f"config.faults.trace={first!r} but this run has {moved!r}")
  # The experiment's resume check says which setting, in one line.
  exp = experiment_lib.Experiment(config(other))
  with pytest.raises(ValueError) as info:
    run_meta.check_resumable(
        exp, dict(run_meta.checkpoint_meta(exp, 6), faults=written), "ckpt")
  message = str(info.value)
  assert message.startswith(
      f"the checkpoint in ckpt was written with config.faults.trace={first!r} "
      "(content SHA-256 ") and "\n" not in message
  run_meta.check_resumable(exp, dict(run_meta.checkpoint_meta(exp, 6)),
                           "ckpt")  # its own
