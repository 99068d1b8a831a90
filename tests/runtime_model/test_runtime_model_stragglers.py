"""Straggler and failure pricing (runtime_model.stragglers, predict's flags).

Expected values are worked by hand: maxima of normals from their closed
forms (E[max of 2 N(0,1)] = 1/sqrt(pi), of 3 = 3/(2 sqrt(pi)), E[max(X,
0)] = 1/sqrt(2 pi)), and the three modes' formulas evaluated on numbers.
"""

from __future__ import annotations

import math
import re

import pytest

from decentral_jax.runtime_model import stragglers
from decentral_jax.tools.runtime_model_cli import main as cli


def test_expected_max_of_normals_matches_closed_forms():
  assert stragglers.expected_max([0, 0], [1, 1]) == pytest.approx(
      1 / math.sqrt(math.pi), abs=1e-6)
  assert stragglers.expected_max([0, 0, 0], [1, 1, 1]) == pytest.approx(
      3 / (2 * math.sqrt(math.pi)), abs=1e-6)
  # A point mass at 0 and a standard normal: E[max(X, 0)].
  assert stragglers.expected_max([0, 0], [1, 0]) == pytest.approx(
      1 / math.sqrt(2 * math.pi), abs=1e-5)
  # Point masses only, and a shift with a scale.
  assert stragglers.expected_max([0.1, 0.2], [0, 0]) == 0.2
  assert stragglers.expected_max([5, 5], [2, 2]) == pytest.approx(
      5 + 2 / math.sqrt(math.pi), abs=1e-5)
  with pytest.raises(ValueError, match="as many means as stds"):
    stragglers.expected_max([0, 1], [1])


FAULTS = stragglers.Faults(slow_fraction=0.125, slow_speed=0.5,
                           failure_rate=0.01, mean_downtime=10)


def test_waiting_for_the_slowest_and_stalling_while_one_is_down():
  # One of 8 workers at half speed: +T (1/s - 1) = +0.1 s on a 0.15 s step.
  slow_only = stragglers.Faults(slow_fraction=0.125, slow_speed=0.5)
  cost = stragglers.straggler_cost("wait", 8, 0.15, slow_only,
                                   compute_s=0.1)
  assert cost.step_s == pytest.approx(0.25)
  assert (cost.work_done, cost.useful) == (1.0, 1.0)
  # Up 1/1.1 of the time each: all 8 up (1/1.1)^8 of it.
  cost = stragglers.straggler_cost("wait", 8, 0.15, FAULTS, compute_s=0.1)
  assert cost.step_s == pytest.approx(0.25 * 1.1**8)
  assert cost.time_per_useful_step == pytest.approx(0.25 * 1.1**8)
  # With noise, every worker slow: E[max] scales by 1/s, so the excess is
  # (1/s - 1) (T + sigma / sqrt(pi)) for n = 2.
  all_slow = stragglers.Faults(slow_fraction=1.0, slow_speed=0.5)
  cost = stragglers.straggler_cost("wait", 2, 0.2, all_slow, compute_s=0.1,
                                   compute_std_s=0.01)
  assert cost.step_s == pytest.approx(
      0.2 + 0.1 + 0.01 / math.sqrt(math.pi), abs=1e-6)


def test_deadline_and_quorum_lose_work_not_time():
  work = (1 / 1.1) * (7 + 0.5) / 8  # up share x (7 healthy + 1 at half)
  for mode in ("deadline", "quorum"):
    cost = stragglers.straggler_cost(mode, 8, 0.15, FAULTS, period=10)
    assert cost.step_s == 0.15
    assert cost.work_done == pytest.approx(work)
    assert cost.useful == pytest.approx(work)
    assert cost.time_per_useful_step == pytest.approx(0.15 / work)
  # Rollback: a round is lost if any of the ~8/1.1 live workers fails in
  # its 10 steps: kept with probability 0.99^(10 * 8 / 1.1).
  cost = stragglers.straggler_cost("quorum", 8, 0.15, FAULTS, period=10,
                                   on_failure="rollback")
  assert cost.useful == pytest.approx(work * 0.99 ** (80 / 1.1))
  assert cost.useful < cost.work_done
  # round(0.1 * 8) = 1 slow worker, as the fault schedule counts.
  assert stragglers.Faults(slow_fraction=0.1).slow_workers(8) == 1


def test_no_faults_cost_nothing():
  none = stragglers.Faults()
  assert none.none
  for mode in stragglers.MODES:
    cost = stragglers.straggler_cost(mode, 8, 0.15, none, compute_s=0.1,
                                     compute_std_s=0.02)
    assert (cost.step_s, cost.work_done, cost.useful) == (0.15, 1.0, 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(slow_speed=0.0), "slow_speed"),
    (dict(slow_fraction=1.5), "slow_fraction"),
    (dict(failure_rate=1.0), "failure_rate"),
    (dict(mean_downtime=0.5), "mean_downtime"),
])
def test_bad_faults_are_one_line_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    stragglers.Faults(**kwargs)


def test_bad_mode_is_an_error():
  with pytest.raises(ValueError, match="mode"):
    stragglers.straggler_cost("hope", 8, 0.1, FAULTS)
  with pytest.raises(ValueError, match="on_failure"):
    stragglers.straggler_cost("quorum", 8, 0.1, FAULTS, on_failure="x")


def test_predict_prints_what_faults_cost_each_method(capsys):
  assert cli.main(["predict", "--n-workers", "8", "--local-size", "4",
                   "--methods", "all_reduce,one_peer_exp,diloco:H=10",
                   "--slow-fraction", "0.125", "--failure-rate", "0.01",
                   "--mean-downtime", "10", "--steps", "50"]) == 0
  out = capsys.readouterr().out
  sim = {m.group(1): float(m.group(2)) for m in re.finditer(
      r"^  (All-Reduce|DAdam \(Exp\)|diloco:H=10)\s+([\d.]+)", out, re.M)}
  rows = {m.group(1): (m.group(2), *map(float, m.group(3, 4, 5, 6)))
          for m in re.finditer(r"^  (All-Reduce|DAdam \(Exp\)|diloco:H=10)"
                               r"\s+(wait|deadline|quorum)\s+([\d.]+)\s+"
                               r"([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
  assert set(rows) == set(sim) == {"All-Reduce", "DAdam (Exp)",
                                   "diloco:H=10"}
  # All-Reduce waits: compute 30 + 60 ms (CV 0) doubles for the slow one.
  mode, ms, work, useful, per = rows["All-Reduce"]
  assert mode == "wait" and (work, useful) == (100.0, 100.0)
  assert ms == pytest.approx((sim["All-Reduce"] + 90.0) * 1.1**8, abs=0.3)
  work = 100 * (1 / 1.1) * 7.5 / 8
  for key, want in (("DAdam (Exp)", "deadline"), ("diloco:H=10", "quorum")):
    mode, ms, got_work, useful, per = rows[key]
    assert mode == want and ms == sim[key]
    assert got_work == pytest.approx(work, abs=0.05)
    assert per == pytest.approx(ms / (work / 100), abs=0.2)
  assert "1 of 8 workers at speed 0.5" in out
  # Without fault flags there is no second table.
  assert cli.main(["predict", "--n-workers", "8", "--local-size", "4",
                   "--steps", "50"]) == 0
  assert "with faults" not in capsys.readouterr().out


def test_predict_names_only_the_faults_that_are_set(capsys):
  """Failures alone: no slow workers in the line; slow workers alone: no
  failure rate."""
  base = ["predict", "--n-workers", "8", "--methods", "all_reduce",
          "--steps", "20"]
  for flags, want in (
      (["--failure-rate", "0.01"], "  with faults: failure rate 0.01/step, "
       "mean downtime 10 steps (up 90.9% of the time); on_failure=proceed"),
      (["--slow-fraction", "0.25"], "  with faults: 2 of 8 workers at speed "
       "0.5")):
    assert cli.main(base + flags) == 0
    lines = [l for l in capsys.readouterr().out.splitlines()
             if "with faults" in l]
    assert lines == [want]


def test_predict_refuses_a_slow_fraction_of_no_worker(capsys):
  # As the runner: round(0.03 x 16) = round(0.48) = 0 slow workers would
  # print the fault-free table whatever --slow-speed says; 1/16 = 0.0625 is
  # one worker. With several counts the smallest decides (round(0.03 x 32)
  # = 1, but round(0.03 x 16) = 0).
  for counts in ("16", "16,32"):
    assert cli.main(["predict", "--n-workers", counts, "--slow-fraction",
                     "0.03", "--slow-speed", "0.1"]) == 2
    assert capsys.readouterr().err == (
        "error: --slow-fraction 0.03 makes round(0.03 x --n-workers 16) = 0 "
        "workers slow; set --slow-fraction 0.0625 (one worker) or more, "
        "or 0.\n")
  # 0.01 x 8 = 0.08 rounds to 0 with failures too (no worker is slow).
  assert cli.main(["predict", "--n-workers", "8", "--slow-fraction", "0.01",
                   "--failure-rate", "0.01"]) == 2
  assert "set --slow-fraction 0.125 (one worker)" in capsys.readouterr().err
  assert cli.main(["predict", "--n-workers", "16", "--methods", "all_reduce",
                   "--steps", "20", "--slow-fraction", "0.0625",
                   "--slow-speed", "0.1"]) == 0
  assert "  with faults: 1 of 16 workers at speed 0.1" in \
      capsys.readouterr().out


def test_predict_fault_flags_are_checked(capsys):
  assert cli.main(["predict", "--n-workers", "8", "--local-size", "4",
                   "--slow-speed", "1.5"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --slow-speed must be") and \
      err.count("\n") == 1, err
