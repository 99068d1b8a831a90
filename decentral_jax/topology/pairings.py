"""Pairings: schedules whose rounds split the workers into groups of two.

NoLoCo (Kolehmainen et al., arXiv 2506.10911) averages each worker with one
random peer per outer step. Here such a schedule is a :class:`~decentral_jax.
topology.Topology` like any other: round ``r`` is the group-mean matrix of
a partition of the workers into pairs (``W_ij = 1/2`` within a pair), which
:mod:`decentral_jax.comm.gossip` realises with one ``ppermute`` (a pair is
an involution: one permute term carries both directions). With an odd
number of workers one worker per round is alone (a group of one: its row
of ``W`` is the identity, it sends and receives nothing that round); which
one is drawn with the pairs.

* :func:`random_pairs`: a seeded cycle of ``rounds`` pairings, round ``r``
  pairing consecutive entries of the ``r``-th permutation of a
  ``numpy.random.default_rng(seed)`` stream (the last entry alone when
  ``n`` is odd).
* :func:`pair_schedule`: given pairings (tests, or a schedule of one's
  own).
* :func:`check_groups`: refuses a topology whose rounds are not
  partitions into groups of at most ``max_size`` workers.

NumPy only; builds on :mod:`decentral_jax.topology.schedules`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from decentral_jax import checks
from decentral_jax.topology.rounds import Round
from decentral_jax.topology.rounds import check_n_workers
from decentral_jax.topology.schedules import Topology
from decentral_jax.topology.terms import Partition

__all__ = ["DEFAULT_ROUNDS", "check_groups", "pair_schedule",
           "random_pairs"]

#: Default period of :func:`random_pairs`: distinct pairings precomputed
#: (one ``lax.switch`` branch each in the compiled step).
DEFAULT_ROUNDS = 8


def _pairs_of(order: np.ndarray) -> list[tuple[int, ...]]:
  """Consecutive entries of ``order`` paired; an odd last entry alone."""
  n = order.size
  groups = [(int(order[j]), int(order[j + 1])) for j in range(0, n - 1, 2)]
  if n % 2:
    groups.append((int(order[-1]),))
  return groups


def random_pairs(n_workers: int, *, seed: int = 0,
                 rounds: int = DEFAULT_ROUNDS,
                 local_size: int = 1) -> Topology:
  """A seeded cycle of ``rounds`` random pairings of ``n_workers`` workers.

  Round ``r`` pairs ``(p[0], p[1]), (p[2], p[3]), ...`` of the ``r``-th
  draw ``p = rng.permutation(n)`` of ``rng = numpy.random.default_rng(
  seed)``; with ``n`` odd, ``p[n - 1]`` is alone that round (a group of
  one: it keeps its own value). The schedule repeats after ``rounds``
  rounds; equal pairings drawn twice share one compiled branch
  (``Topology.distinct_rounds``).

  Args:
    n_workers: ``n >= 1``.
    seed: an int >= 0, the NumPy generator's seed.
    rounds: the period, an int in ``[1, 1024]``.
    local_size: workers per node (as for :func:`~decentral_jax.topology.
      make`; the pairs ignore nodes).

  Returns:
    A :class:`Topology` named ``"random_pairs"`` with ``period ==
    rounds``, every round a partition into pairs (and one single).

  Raises:
    ValueError: ``n_workers``, ``seed``, ``rounds`` or ``local_size`` not
      an int in its range, or ``local_size`` not dividing ``n_workers``.
  """
  n = check_n_workers(n_workers)
  seed = checks.check_int("seed", seed, minimum=0)
  rounds = checks.check_int("rounds", rounds, minimum=1, maximum=1024)
  rng = np.random.default_rng(seed)
  pairings = [_pairs_of(rng.permutation(n)) for _ in range(rounds)]
  return pair_schedule(pairings, n, name="random_pairs",
                       local_size=local_size)


def pair_schedule(pairings: Sequence[Sequence[Sequence[int]]],
                  n_workers: int, *, name: str = "pairs",
                  local_size: int = 1) -> Topology:
  """The schedule whose round ``r`` averages within the groups ``pairings[r]``.

  Args:
    pairings: per round, a sequence of groups of one or two worker indices;
      workers that no group names are alone that round.
    n_workers: ``n >= 1``.
    name: the topology's name.
    local_size: workers per node (must divide ``n_workers``).

  Returns:
    A :class:`Topology` with ``period == len(pairings)``.

  Raises:
    ValueError: ``pairings``, a round or a group that is not a sequence
      (a number, None, a 0-d array; named as ``pairings[r][k]``), no
      rounds, a group of more than two workers, or a worker
      index that is not an int in ``[0, n)`` or appears twice in a round
      (the message names ``pairings[r]``).
  """
  n = check_n_workers(n_workers)
  pairings = checks.check_sequence(
      "pairings", pairings, "a list of rounds, each a list of groups of one "
      "or two workers")
  if not pairings:
    raise ValueError("pairings needs at least one round (a list of pairs).")
  out = []
  for r, groups in enumerate(pairings):
    groups = checks.check_sequence(f"pairings[{r}]", groups,
                                   "a list of groups of one or two workers")
    groups = [checks.check_sequence(f"pairings[{r}][{k}]", g,
                                    "a group of one or two worker indices")
              for k, g in enumerate(groups)]
    if any(not 1 <= len(g) <= 2 for g in groups):
      raise ValueError(f"pairings[{r}]={groups!r}: every group must have one "
                       "or two workers.")
    members = [checks.check_int(f"pairings[{r}] worker", w, minimum=0,
                                maximum=n - 1) for g in groups for w in g]
    if len(set(members)) != len(members):
      raise ValueError(f"pairings[{r}]={groups!r} names a worker twice; each "
                       "worker is in at most one pair per round.")
    alone = [[w] for w in range(n) if w not in set(members)]
    out.append(Round(groups=Partition.from_groups(groups + alone)))
  topo = Topology(name, out, local_size)
  if n % topo.local_size:
    raise ValueError(f"n_workers={n} is not divisible by local_size="
                     f"{topo.local_size} (workers per node).")
  return topo


def check_groups(topology: Topology, max_size: int = 2,
                 name: str = "pairing") -> Topology:
  """``topology`` if every round is a partition into groups of at most
  ``max_size`` workers (group means), else ValueError naming ``name``."""
  if not isinstance(topology, Topology):
    raise ValueError(f"{name} must be a decentral_jax.topology.Topology (e.g. "
                     f"topology.pairings.random_pairs(n)), got "
                     f"{type(topology).__name__}.")
  for r, rnd in enumerate(topology.rounds):
    part = rnd.partition
    if part is None or not rnd.same_matrix(Round(groups=part)):
      raise ValueError(f"{name} {topology.name!r}: round {r} is not a set of "
                       "group means; build it with topology.pairings.")
    if int(part.sizes.max()) > max_size:
      raise ValueError(f"{name} {topology.name!r}: round {r} has a group of "
                       f"{int(part.sizes.max())} workers; at most {max_size}.")
  return topology
