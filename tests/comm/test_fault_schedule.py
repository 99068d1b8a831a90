"""The seeded fault and straggler schedule (comm.fault_schedule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from decentral_jax.comm import fault_schedule
from decentral_jax.comm.fault_schedule import FaultSchedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_long_run_statistics_of_the_rates():
  # Two-state chain per worker: fail w.p. p per live step, come back w.p.
  # 1/D per dead step. Renewal-reward: dead fraction pD / (1 + pD) = 1/6
  # for p = 0.01, D = 20. By hand, over N ~ n T / (1/p + D) = 64 * 20000 /
  # 120 ~ 10700 up/down cycles (U ~ Geom(p): var 9900; D ~ Geom(1/20): var
  # 380), the delta method gives sd(fraction) = sqrt(((5/6)^2 380 + (1/6)^2
  # 9900) / 120^2 / N) ~ 0.0019; the tolerance 0.01 is about 5 sd.
  n, steps, p, downtime = 64, 20000, 0.01, 20.0
  sched = FaultSchedule.from_rates(n, steps, failure_rate=p,
                                   mean_downtime=downtime, seed=7)
  alive, working = sched.masks(0, steps)
  assert alive.shape == (steps, n)
  assert abs((1 - alive.mean()) - p * downtime / (1 + p * downtime)) < 0.01
  np.testing.assert_array_equal(working, alive)  # no slow workers
  assert alive[0].all()  # everyone starts alive
  # Failures per live worker-step: sd sqrt(p / 1.07e6) ~ 1e-4.
  fails = (alive[:-1] & ~alive[1:]).sum()
  assert abs(fails / alive[:-1].sum() - p) < 5e-4
  # Mean downtime of the intervals that end before the horizon: sd of the
  # mean of ~10000 geometric lengths (sd 19.5) ~ 0.2.
  lengths = [e[2] - e[1] for e in sched.events if e[2] < steps]
  assert abs(np.mean(lengths) - downtime) < 1.0


@pytest.mark.slow  # a second process
def test_determinism_across_processes():
  kwargs = dict(failure_rate=0.05, mean_downtime=4.0, slow_fraction=0.25,
                slow_speed=0.5, seed=3)
  a = FaultSchedule.from_rates(8, 500, **kwargs)
  b = FaultSchedule.from_rates(8, 500, **kwargs)
  assert a.events == b.events and len(a.events) > 10
  c = FaultSchedule.from_rates(8, 500, **{**kwargs, "seed": 4})
  assert c.events != a.events
  code = ("from decentral_jax.comm.fault_schedule import FaultSchedule;"
          "import json;"
          f"s = FaultSchedule.from_rates(8, 500, **{kwargs!r});"
          "print(json.dumps(s.masks(0, 500)[1].astype(int).tolist()))")
  env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="123",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env=env, check=True, timeout=300).stdout
  np.testing.assert_array_equal(np.array(json.loads(out)),
                                a.masks(0, 500)[1].astype(int))


def test_a_longer_horizon_keeps_the_earlier_steps():
  kwargs = dict(failure_rate=0.02, mean_downtime=5.0, seed=9)
  short = FaultSchedule.from_rates(8, 600, **kwargs)
  long = FaultSchedule.from_rates(8, 5000, **kwargs)
  for a, b in zip(short.masks(0, 600), long.masks(0, 600)):
    np.testing.assert_array_equal(a, b)
  assert not short.masks(0, 600)[0].all()


def test_slow_workers_complete_steps_in_proportion():
  sched = FaultSchedule.from_rates(8, 100, slow_fraction=0.25, slow_speed=0.5,
                                   seed=1)
  speeds = sched.speed(0)
  assert sorted(speeds.tolist()) == [0.5, 0.5] + [1.0] * 6
  alive, working = sched.masks(0, 10)
  assert alive.all()
  done = working.sum(0)  # H = 10 inner steps: half for a half-speed worker
  np.testing.assert_array_equal(done, np.where(speeds < 1, 5, 10))
  _, waiting = sched.masks(0, 10, stragglers="wait")
  assert waiting.all()
  third = FaultSchedule.from_events(2, [(1, 0, None, 1 / 3)])
  assert third.masks(0, 9)[1].sum(0).tolist() == [9, 3]


def test_decimal_speeds_complete_floor_of_s_times_h_steps():
  """Every round of H steps completes floor(sH) or ceil(sH) steps; the
  reference counts the work with exact decimal fractions (0.7 * 90 is
  62.99999999999999 in float64, and 63 steps are done)."""
  import fractions  # pylint: disable=import-outside-toplevel
  for hundredths in range(1, 100):
    speed = hundredths / 100
    sched = FaultSchedule.from_events(1, [(0, 0, None, speed)])
    done = sched.masks(0, 300)[1][:, 0]
    exact = fractions.Fraction(hundredths, 100)
    for h in (7, 10, 50, 90):
      for t0 in range(0, 300 - h, h):
        want = int((exact * (t0 + h)) // 1 - (exact * t0) // 1)
        assert done[t0:t0 + h].sum() == want, (speed, h, t0)


def test_hand_worked_trace(tmp_path):
  # Worker 1 dead on [2, 5); worker 2 at half speed from step 4 on, and
  # dead on [6, 7) too (the lower speed wins where intervals overlap).
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"n_workers": 3, "events": [
      {"worker": 1, "start": 2, "end": 5, "state": "dead"},
      {"worker": 2, "start": 4, "state": "slow", "speed": 0.5},
      {"worker": 2, "start": 6, "end": 7, "state": "dead"}]}))
  sched = FaultSchedule.from_trace(str(path), 3)
  alive, working = sched.masks(0, 10)
  np.testing.assert_array_equal(alive.T.astype(int), [
      [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
      [1, 1, 0, 0, 0, 1, 1, 1, 1, 1],
      [1, 1, 1, 1, 1, 1, 0, 1, 1, 1]])
  # Worker 2's progress before step k: 0, 1, 2, 3, 4, 4.5, 5, 5, 5.5, 6, 6.5.
  np.testing.assert_array_equal(working.T.astype(int), [
      [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
      [1, 1, 0, 0, 0, 1, 1, 1, 1, 1],
      [1, 1, 1, 1, 0, 1, 0, 0, 1, 0]])
  np.testing.assert_allclose(sched.progress(10), [10, 7, 6.5])
  assert FaultSchedule.healthy(3).is_healthy and not sched.is_healthy


@pytest.mark.parametrize("content,match", [
    ("{not json", r"not a JSON file"),
    ("[]", r"must hold a JSON object"),
    ('{"events": [], "extra": 1}', r"unknown key extra"),
    ('{"n_workers": 5, "events": []}', r"n_workers is 5 but the run has 4"),
    ('{"events": {}}', r"events must be a list"),
    ('{"events": [{"start": 0, "state": "dead"}]}', r"events\[0\]\.worker is missing"),
    ('{"events": [{"worker": 4, "start": 0, "state": "dead"}]}',
     r"events\[0\]\.worker must be in \[0, 3\]"),
    ('{"events": [{"worker": 1, "start": 3, "end": 3, "state": "dead"}]}',
     r"events\[0\]\.end must be in \[4, "),
    ('{"events": [{"worker": 1, "start": 1.5, "state": "dead"}]}',
     r"events\[0\]\.start must be an int"),
    ('{"events": [{"worker": 1, "start": 0, "state": "gone"}]}',
     r"events\[0\]\.state must be 'dead' or 'slow'"),
    ('{"events": [{"worker": 1, "start": 0, "state": "slow"}]}',
     r"events\[0\]\.speed is missing"),
    ('{"events": [{"worker": 1, "start": 0, "state": "slow", "speed": 1}]}',
     r"events\[0\]\.speed must be > 0 and < 1"),
    # one message for the whole range (0, 1), as docs/faults.md quotes it
    ('{"events": [{"worker": 1, "start": 0, "state": "slow", "speed": 1.5}]}',
     r"events\[0\]\.speed must be > 0 and < 1 \(0 is 'dead', 1 healthy\), "
     r"got 1\.5\.$"),
    ('{"events": [{"worker": 1, "start": 0, "state": "slow", "speed": -2}]}',
     r"events\[0\]\.speed must be > 0 and < 1 \(0 is 'dead', 1 healthy\), "
     r"got -2\.0\.$"),
    ('{"events": [{"worker": 1, "start": 0, "state": "dead", "speed": 0.5}]}',
     r"events\[0\]\.speed is only for state 'slow'"),
    ('{"events": [{"worker": 1, "start": 0, "state": "dead", "when": 2}]}',
     r"unknown key events\[0\]\.when"),
])
def test_bad_trace_is_one_line_naming_file_and_key(tmp_path, content, match):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(ValueError, match=match) as e:
    FaultSchedule.from_trace(str(path), 4)
  assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_arguments():
  with pytest.raises(ValueError, match=r"fault trace .*missing.json: cannot be read"):
    FaultSchedule.from_trace("/nonexistent/missing.json", 4)
  with pytest.raises(ValueError, match="failure_rate must be"):
    FaultSchedule.from_rates(4, 10, failure_rate=1.5)
  with pytest.raises(ValueError, match="mean_downtime must be"):
    FaultSchedule.from_rates(4, 10, failure_rate=0.1, mean_downtime=0.5)
  with pytest.raises(ValueError, match="slow_speed must be"):
    FaultSchedule.from_rates(4, 10, slow_fraction=0.5, slow_speed=0.0)
  with pytest.raises(ValueError, match="stragglers must be one of"):
    FaultSchedule.healthy(2).masks(0, 3, stragglers="skip")
  with pytest.raises(ValueError, match=r"events\[0\] worker must be"):
    FaultSchedule.from_events(2, [(2, 0, None, 0.0)])


def test_trace_path_must_be_a_path_to_a_regular_file(tmp_path):
  for path in (None, 3, True):
    with pytest.raises(ValueError, match=r"path must be the path of a JSON "
                       r"fault trace \(a str or os.PathLike\), got "
                       + repr(path)):
      FaultSchedule.from_trace(path, 4)
  # A FIFO without a writer and /dev/zero would block or never end.
  fifo = tmp_path / "trace.fifo"
  os.mkfifo(fifo)
  for path in (fifo, "/dev/zero"):
    with pytest.raises(ValueError, match=r"fault trace .*: cannot be read: "
                       r"not a regular file"):
      FaultSchedule.from_trace(path, 4)
  big = tmp_path / "big.json"
  big.write_bytes(b" " * (64 * 2 ** 20 + 1))
  with pytest.raises(ValueError, match=r"big.json: larger than 67108864 bytes"):
    FaultSchedule.from_trace(big, 4)
  # An os.PathLike reads as its str.
  good = tmp_path / "good.json"
  good.write_text('{"events": [{"worker": 1, "start": 2, "end": 4, '
                  '"state": "dead"}]}')
  assert FaultSchedule.from_trace(good, 2).events == ((1, 2, 4, 0.0),)


def test_extreme_rates_do_not_overflow():
  # NumPy's geometric draw saturates at 2^63 - 1 for p = 1e-20; the running
  # sum of draws used to wrap to negative steps.
  never = FaultSchedule.from_rates(4, 1000, failure_rate=1e-20)
  assert never.events == () and never.alive(999).all()
  # Mean downtime 1e300: each worker fails once, at its first up time (a
  # Geom(p) draw of its own generator, as the module documents), and stays
  # dead to the horizon.
  steps = 50
  sched = FaultSchedule.from_rates(4, steps, failure_rate=0.5,
                                   mean_downtime=1e300, seed=7)
  want = tuple((w, int(np.random.default_rng([7, 0, w]).geometric(0.5)),
                steps, 0.0) for w in range(4))
  assert sched.events == want
  assert not sched.alive(steps - 1).any()


def test_masks_refuses_a_span_it_cannot_build():
  # masks(0, 2**39) asked for 2**39 x 4 entries (4 TiB): a MemoryError.
  # One call builds at most MAX_MASK_CELLS = 2**26 entries: 2**24 steps of
  # 4 workers.
  sched = FaultSchedule.from_events(4, [(0, 0, None, 0.5)])
  with pytest.raises(ValueError) as info:
    sched.masks(0, 2**39)
  msg = str(info.value)
  assert msg.startswith("stop=549755813888 asks for 549755813888 steps from "
                        "start=0; one masks() call builds at most 16777216 "
                        "steps of 4 workers") and "\n" not in msg
  with pytest.raises(ValueError, match="stop=16777227 asks for 16777217"):
    sched.masks(10, 10 + 2**24 + 1)
  alive, working = sched.masks(2**30, 2**30 + 3)  # a short span far out
  assert alive.shape == (3, 4) and alive.all()
  # speed 0.5: work before step t is t / 2, a whole step every other step.
  assert working[:, 0].tolist() == [False, True, False]
  with open(os.path.join(ROOT, "docs", "faults.md")) as f:
    assert "(`MAX_MASK_CELLS` = 2**26 entries)" in f.read()
  assert fault_schedule.MAX_MASK_CELLS == 2**26


@pytest.mark.parametrize("build", [
    lambda n: FaultSchedule(n),
    lambda n: FaultSchedule.from_rates(n, 10, failure_rate=0.1),
])
def test_n_workers_beyond_the_largest_topology_is_one_line(build):
  # 2**23 workers overflowed int64 step keys after minutes of building;
  # 65,536 (topology.MAX_WORKERS) is the largest run a schedule serves.
  with pytest.raises(ValueError) as info:
    build(2**16 + 1)
  assert str(info.value).startswith("n_workers must be") and (
      "<= 65536" in str(info.value)) and "\n" not in str(info.value)
