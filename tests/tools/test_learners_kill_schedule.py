"""``learners --kill-every N`` kills at every merged period N, 2N, ...
below the run's periods, however fast periods merge: the synchronizer
holds the next kill's period until the driver has killed."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from decentral_jax.tools.learners import main as main_lib
from decentral_jax.tools.learners import spec as spec_lib
from decentral_jax.tools.learners import synchronizer as sync_lib


def _push_all(sync, run, base):
  zeros = {k: np.zeros_like(v) for k, v in sync.theta.items()}
  for i in range(run.shards):
    assert sync.push(i, base, zeros, 1) == "accepted"


def _wait_version(sync, want, timeout=10.0):
  deadline = time.monotonic() + timeout
  while sync.version < want and time.monotonic() < deadline:
    time.sleep(0.01)
  return sync.version


def test_the_synchronizer_merges_no_period_past_a_hold():
  run = spec_lib.RunSpec(shards=2, quorum=2, periods=4)
  sync = sync_lib.Synchronizer(run)
  try:
    for i in range(run.shards):
      sync.join(i, run.fingerprint())
    sync.hold(1)
    _push_all(sync, run, 0)
    assert _wait_version(sync, 1) == 1
    _push_all(sync, run, 1)  # every learner's period 2 is in: held
    time.sleep(0.3)
    assert sync.version == 1 and sync.status()["pending"] == 2
    sync.hold(None)
    assert _wait_version(sync, 2) == 2
  finally:
    sync.close()


class _Merging:
  """A cluster whose synchronizer merges two periods per status poll from
  the second on (the first: before the learners joined), faster than the
  driver's 50 ms poll, and honours a hold."""
  learners: dict = {}

  def __init__(self, periods):
    self.version, self.periods, self.held, self.killed = 0, periods, None, []
    self.polls = 0

  def hold(self, version):
    self.held = version

  def status(self):
    stop = self.periods if self.held is None else min(self.periods,
                                                      self.held)
    self.version = min(self.version + 2 * (self.polls > 0), stop)
    self.polls += 1
    return {"version": self.version, "periods": self.periods,
            "done": self.version >= self.periods}

  def kill(self, learner):
    self.killed.append((learner, self.version))
    return 0


@pytest.mark.parametrize("periods, every, killed", [
    # kills due at multiples of --kill-every below --periods (by hand)
    (3, 1, [(0, 1), (1, 2)]),
    (10, 2, [(0, 2), (1, 4), (2, 6), (0, 8)]),
    (5, 4, [(0, 4)]),
])
def test_every_kill_due_is_made_at_its_period(capsys, periods, every, killed):
  c = _Merging(periods)
  args = argparse.Namespace(timeout=30.0, every=1e9, kill_every=every,
                            learners=3)
  status = main_lib._drive(c, args)  # pylint: disable=protected-access
  assert c.killed == killed
  assert status["kills"] == [len(killed), len(killed)]
  assert c.held is None  # released after the last kill
  assert capsys.readouterr().out.count("killed learner") == len(killed)
