"""The tuning protocol's bookkeeping (decentral_jax.runner.tuning), by hand."""

import math

import pytest

from decentral_jax.runner import tuning


def test_grid_first_then_done_when_interior():
  assert tuning.next_lrs({}) == [1.5e-3, 3e-3, 6e-3, 1.2e-2]
  assert tuning.next_lrs({3e-3: 2.0}) == [1.5e-3, 6e-3, 1.2e-2]
  losses = {1.5e-3: 2.0, 3e-3: 1.8, 6e-3: 1.9, 1.2e-2: 2.5}
  assert tuning.next_lrs(losses) == []
  assert tuning.choose(losses) == (3e-3, 1.8, "")


def test_high_edge_extends_twice_then_stops():
  losses = {1.5e-3: 2.0, 3e-3: 1.9, 6e-3: 1.8, 1.2e-2: 1.7}
  assert tuning.choose(losses).edge == "high"
  assert tuning.next_lrs(losses) == [2.4e-2]
  losses[2.4e-2] = 1.6
  assert tuning.next_lrs(losses) == [4.8e-2]
  losses[4.8e-2] = 1.5
  assert tuning.next_lrs(losses) == []  # two extensions: reported as an edge
  assert tuning.choose(losses) == (4.8e-2, 1.5, "high")


def test_low_edge_extends_down():
  losses = {1.5e-3: 1.7, 3e-3: 1.8, 6e-3: 1.9, 1.2e-2: 2.0}
  assert tuning.next_lrs(losses) == [7.5e-4]
  losses[7.5e-4] = 1.75
  assert tuning.next_lrs(losses) == []
  assert tuning.choose(losses) == (1.5e-3, 1.7, "")


def test_diverged_runs_score_infinite():
  losses = {1.5e-3: 2.0, 3e-3: 1.9, 6e-3: None, 1.2e-2: float("nan")}
  assert tuning.choose(losses) == (3e-3, 1.9, "")
  assert tuning.next_lrs(losses) == []
  with pytest.raises(ValueError, match="every learning rate diverged"):
    tuning.choose({1e-3: None, 2e-3: math.inf})
  with pytest.raises(ValueError, match="no learning rates"):
    tuning.choose({})
  # The whole grid diverged: nothing to extend, and choose names it.
  assert tuning.next_lrs({lr: None for lr in tuning.LR_GRID}) == []
  with pytest.raises(ValueError, match="finite and > 0"):
    tuning.choose({-1e-3: 1.0, 1e-3: 2.0})


def test_ties_pick_the_smaller_lr():
  assert tuning.choose({3e-3: 1.5, 1.5e-3: 1.5, 6e-3: 1.6}).lr == 1.5e-3


def test_summary_is_mean_and_two_sample_sigmas():
  # mean 2.0; deviations -1, 0, 1: sample variance 1, sigma 1, 2 sigma 2.
  assert tuning.summarize([1.0, 2.0, 3.0]) == (2.0, 2.0, 3)
  mean, two_sigma, n = tuning.summarize([1.6])
  assert (mean, n) == (1.6, 1) and math.isnan(two_sigma)
  mean, _, n = tuning.summarize([1.0, None, 2.0])
  assert math.isinf(mean) and n == 3
  assert tuning.format_mean_2sigma([1.0, 2.0, 3.0]) == "2.0000 +- 2.0000 (3 seeds)"
  assert tuning.format_mean_2sigma([1.65634]) == "1.6563 (1 seed)"
  assert tuning.format_mean_2sigma([1.0, float("nan")]) == "diverged (2 seeds)"
  with pytest.raises(ValueError):
    tuning.summarize([])
