"""Which links a round's collectives share: how many can truly run at once.

XLA's latency-hiding scheduler lets at most
``xla_gpu_experimental_parallel_collective_overlap_limit`` asynchronous
collectives be in flight on a device, and prices each at its own transfer
time as if it had its links to itself. That holds only for collectives
that use disjoint links; collectives that share one (the buckets of one
round on one NIC) run one after another at best. This module reads the
limit off the same :class:`~decentral_jax.runtime_model.costs.Cluster`
that prices the round (:func:`~decentral_jax.runtime_model.costs.
round_cost`).

A device sends over two kinds of links: its intra-node link (``"intra"``:
NVLink / NVSwitch port) and its rail's NICs (``"nic"``, and the wide-area
uplink behind them). With ``intra_link="pcie"`` both go through the
device's one PCIe link (``"pcie"``, the model of
:class:`~decentral_jax.runtime_model.costs.Cluster`), so there is one link.
Per worker ``w`` and collective class (one ppermute term of the round, the
round's group mean, the fsdp all-gathers and reduce-scatters inside a
worker, an All-Reduce over all workers), the links it uses are:

* a term: the link of ``w``'s send (intra if the destination shares its
  node, else nic) and of its receive;
* a group mean: nic if the group spans nodes, intra if two of its members
  share a node (both for a tree or ring over several nodes of several
  members each);
* fsdp inside a worker of ``D > 1`` devices: intra;
* an All-Reduce over all workers: as the group mean of everyone.

Every bucket of one class uses the same links, so buckets of one class are
serial. Worker ``w`` can run ``k_w = 2`` collectives at once where its
classes split into some on the intra link only and some on the NICs only,
else ``k_w = 1`` (one link, or a class on both links, which shares with
whatever runs beside it). The program is the same on every device, so
the limit is the smallest ``k_w`` over the workers that communicate.

XLA's limit counts collectives, not links: at a limit of 2 it may still
place two buckets of one class side by side (each then takes twice its
profiled time). The limit here is right for the pairing of one class of
each link and never lets more collectives overlap than there are links.

Units: none (counts). NumPy only.
"""

from __future__ import annotations

from typing import Sequence

from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.topology.rounds import Round

INTRA, NIC, PCIE = "intra", "nic", "pcie"


def _kind(c: Cluster, kind: str) -> str:
  """The link that carries traffic of ``kind`` (``"intra"`` or ``"nic"``)."""
  return PCIE if c.intra_link == "pcie" else kind


def _link(c: Cluster, a: int, b: int) -> str:
  """The link worker ``a`` uses to reach worker ``b``."""
  return _kind(c, INTRA if a // c.local_size == b // c.local_size else NIC)


def _group_links(c: Cluster, group: Sequence[int]) -> frozenset:
  """Links one member of ``group`` uses in its mean (empty: alone)."""
  if len(group) < 2:
    return frozenset()
  nodes = [w // c.local_size for w in group]
  out = set()
  if len(set(nodes)) > 1:
    out.add(_kind(c, NIC))
  if len(set(nodes)) < len(nodes):
    out.add(_kind(c, INTRA))
  return frozenset(out)


def worker_link_classes(c: Cluster, rnd: Round | None, *,
                        permutes: bool = False, devices_per_worker: int = 1,
                        worker_layout: str = "fsdp",
                        all_reduce: bool = False) -> list[list[frozenset]]:
  """Per worker, the link sets of its collective classes (see module).

  Args:
    c: the cluster (``c.n_workers`` workers).
    rnd: the round the program sends (None: none).
    permutes: send the round's ppermute terms even if it is a partition
      (compressed gossip, as :func:`~decentral_jax.runtime_model.costs.
      round_cost`).
    devices_per_worker, worker_layout: workers of several devices
      (``"fsdp"``: all-gathers and reduce-scatters inside the worker on the
      intra link; ``"data"``: an All-Reduce inside it, also intra).
    all_reduce: the program also has an All-Reduce over all workers (the
      consensus distance, a global average).

  Returns:
    ``n_workers`` lists of non-empty frozensets of ``"intra"`` /
    ``"nic"`` (``"pcie"`` alone with ``intra_link="pcie"``); a worker that
    sends nothing has an empty list.

  Raises:
    ValueError: the round has another number of workers than the cluster;
      ``devices_per_worker < 1``.
  """
  n = c.n_workers
  if rnd is not None and rnd.n_workers != n:
    raise ValueError(f"round has {rnd.n_workers} workers but the cluster has "
                     f"n_workers={n}; build both for the same n.")
  if int(devices_per_worker) < 1:
    raise ValueError(f"devices_per_worker must be >= 1, got "
                     f"{devices_per_worker!r}.")
  classes = [[] for _ in range(n)]
  if rnd is not None and rnd.groups is not None and not permutes:
    for g in rnd.groups:
      for w in g:
        classes[w].append(_group_links(c, g))
  elif rnd is not None:
    for term in rnd.terms:  # one collective: a worker's send and receive
      used = [set() for _ in range(n)]
      for s, d in term.perm:
        if s != d:
          used[s].add(_link(c, s, d))
          used[d].add(_link(c, d, s))
      for w in range(n):
        classes[w].append(frozenset(used[w]))
  for w in range(n):
    if devices_per_worker > 1:
      classes[w].append(frozenset({_kind(c, INTRA)}))
    if all_reduce:
      classes[w].append(_group_links(c, list(range(n))))
  return [[x for x in cl if x] for cl in classes]


def parallel_collectives(c: Cluster, rnd: Round | None, **kw) -> int:
  """How many of a program's collectives truly run at once (>= 1).

  The smallest, over the workers that send anything, of what that
  worker's collective classes (:func:`worker_link_classes`, keyword
  arguments as there) allow: 2 where they split into classes on the intra
  link only and classes on the NICs only (one of each can run beside the
  other), else 1 (one link, or a class on both links, which shares with
  whatever runs beside it). The value for
  ``xla_gpu_experimental_parallel_collective_overlap_limit``.

  Worked examples: one NIC and PCIe (the ``A40`` and ``T4`` presets): 1
  for every round. ``h100_node`` (NVLink only): 1. ``h100_ib`` one-peer
  round across nodes: 1 (all buckets on the rail's NIC); with fsdp workers
  whose peer is on another node: 2 (fsdp on NVLink beside the gossip on
  the NIC); AER's group means across two nodes of several members each: 1
  (they use both links).

  Raises:
    ValueError: see :func:`worker_link_classes`.
  """
  best = None
  for cl in worker_link_classes(c, rnd, **kw):
    if not cl:
      continue
    k = 2 if (all(len(x) == 1 for x in cl)
              and len(frozenset().union(*cl)) == 2) else 1
    best = k if best is None else min(best, k)
  return best or 1
