"""Learners and the synchronizer as Ray actors in their own processes:
SIGKILL of a learner and of the synchronizer, join and leave, a slow learner.

One Ray session on 127.0.0.1 for the file (started once, shut down at the
end). Ray is part of the full run's requirements (requirements-ray.txt):
without it these tests fail, they never skip.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import spmd_diloco
from decentral_jax.tools.learners import cluster
from decentral_jax.tools.learners import spec as spec_lib

pytestmark = pytest.mark.slow


def _until(condition, timeout_s=120.0, what="condition"):
  deadline = time.monotonic() + timeout_s
  while True:
    value = condition()
    if value:
      return value
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def _joins(c, learner):
  return [v for w, v, _ in c.status()["log"]["joins"] if w == learner]


def test_sync_learners_equal_one_program_through_a_learner_sigkill(
    ray_session):
  """Learner 1 is SIGKILLed mid-run; Ray restarts it, it rejoins at the
  current version and redoes that period on the same data: theta equals
  one-program DiLoCo's exactly as without the failure."""
  del ray_session
  run = spec_lib.RunSpec(shards=2, sync_every=3, periods=8, quorum=2,
                         sleep_s=(0.03, 0.03))
  c = cluster.Cluster(run)
  try:
    c.add(0), c.add(1)
    killed_at = c.wait(version=2, timeout_s=120)["version"]
    c.kill(1)
    _until(lambda: len(_joins(c, 1)) == 2, what="learner 1 to rejoin")
    status = c.wait(timeout_s=120)
    assert status["version"] == 8
    assert _joins(c, 1)[1] >= killed_at  # rejoined with a current theta
    assert status["log"]["merged_with"] == [[0, 1]] * 8
    theta = c.params()["theta"]
    want = spmd_diloco(2, 3, 8)
    for k in want:
      np.testing.assert_allclose(theta[k], want[k], rtol=2e-6, atol=2e-6)
  finally:
    c.close()


def test_decoupled_learners_merge_without_a_killed_one_and_a_slow_one(
    ray_session):
  """3 learners, quorum 2, grace 0.3 s, Dynamic Local Updates; learner 2
  sleeps 4x longer per step, learner 1 is SIGKILLed. Nobody waits past the
  grace window, merges go on without learner 1, which rejoins with the
  current theta and is merged again; the slow learner takes fewer steps."""
  del ray_session
  grace = 0.3
  run = spec_lib.RunSpec(shards=3, sync_every=8, periods=10**6,
                         mode="decoupled", quorum=2, grace_s=grace,
                         dynamic_updates=True, sleep_s=(0.01, 0.01, 0.04))
  c = cluster.Cluster(run)
  try:
    for i in range(3):
      c.add(i)
    killed_at = c.wait(version=3, timeout_s=120)["version"]
    c.kill(1)
    rejoin = _until(lambda: _joins(c, 1)[1:], what="learner 1 to rejoin")[0]
    assert rejoin >= killed_at
    merged = lambda: c.status()["log"]["merged_with"]
    _until(lambda: any(1 in m for m in merged()[rejoin:]),
           what="learner 1 merged again")
    c.set_periods(c.status()["version"] + 2)
    status = c.wait(timeout_s=60)
    log = status["log"]
    assert status["version"] == len(log["merged_with"]) == status["periods"]
    # Merged without the dead learner while it was down.
    assert any(1 not in m for m in log["merged_with"][killed_at:rejoin])
    assert all(len(m) >= 2 for m in log["merged_with"])
    learners = c.learner_status()
    for i in (0, 2):  # live learners never waited on a peer
      assert max(learners[i]["waits"]) <= grace, learners[i]["waits"]
    # H_w ~ v_w / v_max * 8: about 2 for the slow learner, ~8 for learner 0.
    assert np.median(learners[2]["h"][1:]) <= 4
    assert np.median(learners[0]["h"][1:]) >= 6
    tokens = log["tokens"]
    assert all(sum(t.values()) > 0 for t in tokens)
  finally:
    c.close()


def test_a_killed_synchronizer_resumes_from_its_checkpoint(ray_session,
                                                          tmp_path):
  """SIGKILL of the synchronizer after >= 3 merges: Ray restarts it, it
  restores its last Orbax checkpoint (no merged period lost), the learners
  carry on, and theta equals one-program DiLoCo's."""
  del ray_session
  run = spec_lib.RunSpec(shards=2, sync_every=3, periods=7, quorum=2,
                         sleep_s=(0.03, 0.03))
  c = cluster.Cluster(run, str(tmp_path / "sync"))
  try:
    c.add(0), c.add(1)
    before = c.wait(version=3, timeout_s=120)["version"]
    pid = c.kill()
    status = c.wait(timeout_s=180)
    assert status["pid"] != pid and status["resumed"]
    assert status["version"] == 7
    assert len(status["log"]["merged_with"]) == 7 and before >= 3
    theta = c.params()["theta"]
    want = spmd_diloco(2, 3, 7)
    for k in want:
      np.testing.assert_allclose(theta[k], want[k], rtol=2e-6, atol=2e-6)
  finally:
    c.close()


def test_join_and_leave_between_periods_and_a_mismatched_learner(
    ray_session):
  """Learners 0 and 1 start; 2 joins, then 1 leaves: the merges go from
  {0, 1} to {0, 1, 2} to {0, 2}. A learner with another sync period is
  refused at join, naming the field."""
  del ray_session
  run = spec_lib.RunSpec(shards=3, sync_every=3, periods=10**6, quorum=2,
                         sleep_s=(0.02, 0.02, 0.02))
  c = cluster.Cluster(run)
  try:
    c.add(0), c.add(1)
    c.wait(version=2, timeout_s=120)
    c.add(2)
    merged = lambda: c.status()["log"]["merged_with"]
    _until(lambda: [0, 1, 2] in merged(), what="learner 2 merged")
    c.remove(1)
    left = c.status()["version"]
    c.set_periods(left + 2)
    log = c.wait(timeout_s=60)["log"]["merged_with"]
    assert log[:2] == [[0, 1], [0, 1]]
    assert set(map(tuple, log)) <= {(0, 1), (0, 1, 2), (0, 2)}
    assert log[-1] == [0, 2] and (0, 1, 2) in set(map(tuple, log))
    assert all(m == [0, 2] for m in log[left + 1:])
    bad = spec_lib.RunSpec(**{**run.__dict__, "sync_every": 5})
    c.add(1, bad)
    err = _until(lambda: c.learner_status()[1]["error"], what="refusal")
    assert "refused at join: field 'sync_every'" in err
  finally:
    c.close()


def _reference(run):
  """The run without failures: synchronizer and learners in this process."""
  from decentral_jax.tools.learners import learner as learner_lib  # pylint: disable=import-outside-toplevel
  from decentral_jax.tools.learners import synchronizer as sync_lib  # pylint: disable=import-outside-toplevel
  sync = sync_lib.Synchronizer(run)
  link = learner_lib.Link(lambda name, *args: getattr(sync, name)(*args))
  learners = [learner_lib.Learner(run, i, link) for i in range(run.shards)]
  _until(lambda: sync.version >= run.periods, 60, "the reference run")
  for lrn in learners:
    lrn.stop()
  sync.close()
  return sync.theta


def test_a_sigkilled_learner_restarts_with_its_adamw_state_and_residual(
    ray_session):
  """Sync mode, inner AdamW, int8 pseudo-gradients with error feedback:
  learner 1 is SIGKILLed mid-period; Ray restarts it, it rejoins with the
  AdamW moments and residual it sent before its last merged
  pseudo-gradient and redoes the period: theta equals the run without a
  failure to float32 rounding (afresh moments and residual move it by
  about 0.2: the in-process test of tests/tools/test_learners.py)."""
  del ray_session
  run = spec_lib.RunSpec(shards=2, sync_every=3, periods=6, inner="adamw",
                         inner_lr=0.05, quorum=2, compressor="int8", block=2,
                         sleep_s=(0.03, 0.03))
  c = cluster.Cluster(run)
  try:
    c.add(0), c.add(1)
    c.wait(version=2, timeout_s=120)
    time.sleep(0.04)  # inside a period
    c.kill(1)
    _until(lambda: len(_joins(c, 1)) == 2, what="learner 1 to rejoin")
    status = c.wait(timeout_s=120)
    assert status["version"] == 6 and not status["log"]["rejected"]
    restarted = c.learner_status()[1]
    assert restarted["restored"] and restarted["error"] is None
    theta = c.params()["theta"]
  finally:
    c.close()
  want = _reference(run)
  for k in want:
    np.testing.assert_allclose(theta[k], want[k], rtol=1e-6, atol=1e-7)
