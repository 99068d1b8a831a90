"""Pairing schedules (topology/pairings.py): seeded random pairs, injected
pairings, a worker alone per round when n is odd, one ppermute per round."""

from __future__ import annotations

import numpy as np
import pytest

from decentral_jax import topology
from decentral_jax.topology import pairings


def _groups(topo):
  return [r.groups for r in topo.rounds]


@pytest.mark.parametrize("n", [2, 6, 8])
def test_random_pairs_are_seeded_pairings(n):
  topo = pairings.random_pairs(n, seed=5, rounds=6)
  assert topo.name == "random_pairs" and topo.period == 6
  # Independently: pairs of consecutive entries of each permutation.
  rng = np.random.default_rng(5)
  for r in range(6):
    p = rng.permutation(n).tolist()
    want = sorted(tuple(sorted(p[j:j + 2])) for j in range(0, n, 2))
    assert sorted(topo.rounds[r].groups) == want
    w = topo.mixing_matrix(r)
    assert np.allclose(w, w.T) and np.allclose(w.sum(1), 1)
    assert sorted(np.diag(w).tolist()) == [0.5] * n
  assert topo.doubly_stochastic
  assert _groups(pairings.random_pairs(n, seed=5, rounds=6)) == _groups(topo)
  if n > 2:
    assert _groups(pairings.random_pairs(n, seed=6, rounds=6)) != \
        _groups(topo)
    # A pair is an involution: one permute term (one ppermute) per round.
    assert all(len(r.terms) == 1 for r in topo.rounds)
    assert topo.max_messages_per_step() == 1


def test_odd_workers_leave_one_alone_per_round():
  topo = pairings.random_pairs(5, seed=1, rounds=20)
  alone = []
  for rnd in topo.rounds:
    sizes = sorted(len(g) for g in rnd.groups)
    assert sizes == [1, 2, 2]
    alone.append(next(g[0] for g in rnd.groups if len(g) == 1))
    assert rnd.self_weights[alone[-1]] == 1.0
  assert len(set(alone)) > 1  # drawn with the pairs, not always the same
  # Period of random pairings mixes everyone eventually.
  assert topo.spectral_gap() > 0


def test_pair_schedule_takes_given_pairs():
  topo = pairings.pair_schedule([[(0, 1), (2, 3)], [(0, 2)]], 4,
                                name="mine")
  assert topo.name == "mine" and topo.period == 2
  assert topo.rounds[0].groups == ((0, 1), (2, 3))
  assert topo.rounds[1].groups == ((0, 2), (1,), (3,))
  assert pairings.check_groups(topo) is topo


@pytest.mark.parametrize("args,words", [
    (([], 4), "pairings needs at least one round"),
    (([[(0, 1, 2)]], 4), r"pairings\[0\]=.*one or two workers"),
    (([[(0, 1), (1, 2)]], 4), r"pairings\[0\]=.*names a worker twice"),
    (([[(0, 4)]], 4), r"pairings\[0\] worker must be an int >= 0 and <= 3"),
])
def test_pair_schedule_refusals(args, words):
  with pytest.raises(ValueError, match=words):
    pairings.pair_schedule(*args)


@pytest.mark.parametrize("kwargs,words", [
    (dict(n_workers=0), "n_workers must be an int >= 1"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(rounds=0), "rounds must be an int >= 1"),
    (dict(local_size=3), "not divisible by local_size=3"),
])
def test_random_pairs_refusals(kwargs, words):
  args = dict(n_workers=4)
  args.update(kwargs)
  with pytest.raises(ValueError, match=words):
    pairings.random_pairs(**args)


def test_check_groups_refuses_other_schedules():
  with pytest.raises(ValueError, match="round 0 has a group of 4"):
    pairings.check_groups(topology.make("complete", 4))
  with pytest.raises(ValueError, match="not a set of group means"):
    pairings.check_groups(topology.make("exponential", 4))
  assert pairings.check_groups(topology.make("ring", 4))  # pairs too
