"""Elastic resume in one process: a checkpoint written on one worker layout
resumes on another with the same number of workers.

A run on layout A is stopped after its checkpoint of step K and resumed by
``train_and_evaluate`` on layout B (the Orbax restore onto B's shardings).
The reference never touches a checkpoint: the same steps on A, the state
moved to B's shardings in memory (``jax.device_put``), the remaining steps
on B. The restored checkpoint of step K must equal A's state bit for bit
and the resumed run must end with the reference's state, bit for bit. Cases:
one_peer_exp on 1 x 8 devices -> 4 devices x 2 workers per device; DiLoCo
with a worker dead across the checkpoint on 4 workers of 2 devices
("fsdp") -> 2 devices x 2 workers per device. A resume with another number
of workers is refused, saying why. The multi-process cases (a process
killed, the job restarted on fewer processes) are in
``tests/runner/test_multihost.py``.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import multihost_worker as worker
from conftest import require_devices
from decentral_jax.runner import checkpoint
from decentral_jax.runner import experiment as experiment_lib
from decentral_jax.runner import run_meta
from decentral_jax.runner import train

STEPS, STOP_AT = 4, 2  # checkpoints after steps 2 and 4


class Interrupted(Exception):
  pass


def _config(case, *extra):
  return worker.case_config(case, "--config.checkpoint_interval=2",
                            *extra, steps=STEPS)


def _interrupt_at(exp, step_k):
  step_fn = exp.train_step

  def step(state, batch, step=None):
    if step == step_k:
      raise Interrupted(step)
    return step_fn(state, batch, step)

  exp.train_step = step


def _reference(config_a, devices_a, config_b, devices_b):
  """(state after STOP_AT steps on A, final state) without checkpoints."""
  exp_a = experiment_lib.Experiment(config_a, devices=devices_a)
  state = exp_a.init_state()
  for s in range(STOP_AT):
    state, _ = exp_a.train_step(state, exp_a.get_batch(s), s)
  at_stop = jax.device_get(state)
  exp_b = experiment_lib.Experiment(config_b, devices=devices_b)
  shardings = jax.tree.map(lambda x: x.sharding, exp_b.init_state())
  state = jax.device_put(state, shardings)
  for s in range(STOP_AT, STEPS):
    state, _ = exp_b.train_step(state, exp_b.get_batch(s), s)
  return at_stop, jax.device_get(state), exp_b


def _assert_trees_equal(got, want, what):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_array_equal(
        g, w, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _dead_worker_trace(tmp_path):
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"n_workers": 4, "events": [
      {"worker": 1, "start": 1, "end": 3, "state": "dead"}]}))
  return str(path)


CASES = {
    # 1 process x 8 devices -> 1 process x 4 devices x 2 workers per device.
    "one_peer_exp_8_devices_to_4x2": (
        "one_peer_exp", (), 8, ("--config.workers_per_device=2",), 4),
    # DiLoCo (H = 3, so the checkpoint is inside a round), worker 1 dead at
    # steps 1..2, 4 workers of 2 devices ("fsdp") -> 2 devices x 2 workers.
    "diloco_fsdp_to_2x2": (
        "diloco", ("--config.n_workers=4", "--config.devices_per_worker=2",
                   "--config.worker_layout=fsdp"), 8,
        ("--config.n_workers=4", "--config.workers_per_device=2"), 2),
}


@pytest.mark.integration  # two training runs and a reference per case
@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_on_another_layout_is_bit_exact(tmp_path, name):
  case, extra_a, n_dev_a, extra_b, n_dev_b = CASES[name]
  devices = require_devices(8)
  faults = ()
  if case == "diloco":
    faults = ("--config.faults.enabled=True",
              f"--config.faults.trace={_dead_worker_trace(tmp_path)}")
  config_a = _config(case, *extra_a, *faults)
  config_b = _config(case, *extra_b, *faults)
  workdir = str(tmp_path / "run")
  exp_a = experiment_lib.Experiment(config_a, devices=devices[:n_dev_a])
  _interrupt_at(exp_a, STOP_AT)
  with pytest.raises(Interrupted):
    train.train_and_evaluate(config_a, workdir, experiment=exp_a)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  at_stop, final, exp_b = _reference(config_a, devices[:n_dev_a], config_b,
                                     devices[:n_dev_b])
  # The two layouts differ (so a row order mix-up would show).
  a_layout = run_meta.checkpoint_meta(exp_a, 0)["layout"]
  b_layout = run_meta.checkpoint_meta(exp_b, 0)["layout"]
  assert a_layout != b_layout
  train.train_and_evaluate(config_b, workdir, experiment=exp_b)
  with checkpoint.Checkpointer(ckpt_dir) as ckpt:
    assert ckpt.all_steps() == [STOP_AT, STEPS]
    like = exp_b.init_state()
    restored_stop, meta_stop = ckpt.restore(STOP_AT, like)
    restored_end, meta_end = ckpt.restore(STEPS, like)
  assert meta_stop["layout"] == a_layout and meta_end["layout"] == b_layout
  _assert_trees_equal(restored_stop, at_stop, f"{name} checkpoint {STOP_AT}")
  _assert_trees_equal(restored_end, final, f"{name} final state")
  # The workers differ from each other (a comparison per worker).
  leaf = np.asarray(jax.tree.leaves(final.params)[0])
  assert np.ptp(leaf, axis=0).max() > 0


@pytest.mark.slow  # a training run and a resume (the default run: ~3 min)
def test_another_number_of_workers_is_refused_saying_why(tmp_path):
  devices = require_devices(8)
  workdir = str(tmp_path / "run")
  config_a = _config("one_peer_exp")
  exp_a = experiment_lib.Experiment(config_a, devices=devices)
  _interrupt_at(exp_a, STOP_AT)
  with pytest.raises(Interrupted):
    train.train_and_evaluate(config_a, workdir, experiment=exp_a)
  config_b = _config("one_peer_exp", "--config.n_workers=4")
  exp_b = experiment_lib.Experiment(config_b, devices=devices[:4])
  with pytest.raises(ValueError) as info:
    train.train_and_evaluate(config_b, workdir, experiment=exp_b)
  message = str(info.value)
  for part in ("holds 8 workers", "config.n_workers=4",
               "not the number of workers", "merge or split",
               "--config.n_workers=8",
               "this run's 4 device(s) with --config.workers_per_device=2"):
    assert part in message, message
  assert "\n" not in message


def test_layout_descriptions():
  two = {"processes": 2, "devices": 8, "devices_per_worker": 1,
         "workers_per_device": 1, "worker_layout": ""}
  assert run_meta.describe_layout(two) == \
      "2 processes x 4 devices, 1 worker per device"
  virtual = dict(two, processes=1, devices=2, workers_per_device=4)
  assert run_meta.describe_layout(virtual) == \
      "1 process x 2 devices x 4 workers per device"
  fsdp = dict(two, processes=1, devices_per_worker=2, worker_layout="fsdp")
  assert run_meta.describe_layout(fsdp) == \
      "1 process x 8 devices, 2 devices per worker (fsdp)"
  # A checkpoint of an older version: its top-level keys, counts unknown.
  old = run_meta.saved_layout({"n_workers": 8, "devices_per_worker": 2})
  assert old == {"processes": None, "devices": None,
                 "devices_per_worker": 2, "workers_per_device": 1,
                 "worker_layout": ""}
  # Hand-edited values are unknown, never an exception.
  odd = run_meta.saved_layout({"layout": {
      "processes": "two", "devices": True, "devices_per_worker": -1,
      "workers_per_device": 2.5, "worker_layout": 3}})
  assert odd == {"processes": None, "devices": None,
                 "devices_per_worker": None, "workers_per_device": None,
                 "worker_layout": None}
  assert run_meta.describe_layout(odd) == (
      "an unrecorded number of processes and devices, unrecorded workers "
      "per device")
  assert run_meta.saved_layout({"layout": []})["devices_per_worker"] == 1
  assert run_meta.check_elastic_resume(
      {"n_workers": 8, "layout": two}, {"n_workers": 8, "layout": virtual},
      "d")
  assert not run_meta.check_elastic_resume(
      {"n_workers": 8, "layout": two}, {"n_workers": 8, "layout": dict(two)},
      "d")
