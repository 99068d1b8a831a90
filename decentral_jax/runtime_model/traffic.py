"""Bytes on the wire per iteration: per worker and leaving each node.

Counts what the collectives of :mod:`decentral_jax.runtime_model.costs`
move, with the same algorithms as their costs (message ``M`` bytes):

* group mean of ``p`` ranks in one node: ``M`` each for ``p = 2`` (pair
  exchange), else ring ``2(p-1)/p M`` each; nothing leaves the node;
* over ``q`` nodes: ``p = 2``: ``M`` each, ``M`` leaves each node; ``tree``
  (``L'`` ranks on each node): each worker ``2(L'-1)/L' M`` in the node
  plus its ``1/L'`` share of the node's flow, ``2(q-1)/q M`` leaves each
  node; flat ``ring``: ``2(p-1)/p M`` each, and the same on each ring edge
  that leaves a node (ring order: sorted ranks);
* a ppermute term: ``M`` from each source to its destination (leaving the
  source's node if the destination is elsewhere);
* over ``k > 1`` datacenters (hierarchical, as its cost): a pair sends
  ``M`` each, leaving both nodes and datacenters; a larger group counts
  its group mean inside each datacenter as above, plus the cross stage:
  ``2(k-1)/k M`` leaves each datacenter, split over the group's ``q``
  nodes and ``m`` workers in it.

Compressed methods send the payload of
:mod:`~decentral_jax.runtime_model.compression` (gossip: every round as
its ppermute terms). A top-k sync all-gathers ``P`` bytes per worker,
counted as the all-reduce of ``M = nP/2`` that moves the same bytes on
every link (:func:`~decentral_jax.runtime_model.costs.all_gather_cost`):
``(n-1) P`` per worker on a ring.

All-Reduce moves ``M_g`` (gradients) every step; gossip one round of
``M_x`` (in ``comm_dtype`` if set) every step; local-update methods one
sync message (all fragments) every ``H`` steps. A worker of ``D`` devices
sends ``D`` times these with the ``"data"`` layout (every device sends the
full message) and the same with ``"fsdp"`` (each device its ``1/D``
shard); its devices also send each other ``Traffic.inner_bytes``
(:func:`decentral_jax.runtime_model.worker_devices.inner_bytes`). Measured times (``Method.measured_s``) do not change the
bytes.

Units: bytes per iteration (one step of one worker).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from decentral_jax.runtime_model import compression
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import check_model_arguments
from decentral_jax.runtime_model import local_sync
from decentral_jax.runtime_model import method_messages
from decentral_jax.runtime_model import worker_devices


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes per iteration, averaged over the method's schedule period.

  Attributes:
    worker_bytes: bytes the busiest worker sends to other workers per
      iteration (all its devices together).
    node_bytes: bytes leaving the busiest node per iteration (0 on one node).
    inner_bytes: bytes a worker's devices send to each other per iteration
      (workers of several devices; 0 otherwise).
    dc_bytes: bytes leaving the busiest datacenter per iteration over the
      wide-area link (0 with one datacenter).
  """

  worker_bytes: float
  node_bytes: float
  inner_bytes: float = 0.0
  dc_bytes: float = 0.0


def _group_bytes(c: Cluster, group, nbytes: float, worker, node,
                 dc=None) -> None:
  g = sorted(int(x) for x in group)
  p, big_l = len(g), c.local_size
  nodes = sorted({w // big_l for w in g})
  q = len(nodes)
  if p <= 1:
    return
  dcs = sorted({c.datacenter(w) for w in g})
  if len(dcs) > 1:
    _cross_dc_bytes(c, g, dcs, nbytes, worker, node, dc)
    return
  if p == 2:
    worker[g] += nbytes
    if q > 1:
      node[nodes] += nbytes
    return
  ring = 2 * (p - 1) / p * nbytes
  per_node = p // q
  if q > 1 and c.multi_node == "tree" and per_node * q == p and per_node > 1:
    flow = 2 * (q - 1) / q * nbytes
    worker[g] += 2 * (per_node - 1) / per_node * nbytes + flow / per_node
    node[nodes] += flow
    return
  worker[g] += ring
  for k in range(p):
    src, dst = g[k], g[(k + 1) % p]
    if src // big_l != dst // big_l:
      node[src // big_l] += ring


def _cross_dc_bytes(c: Cluster, g, dcs, nbytes: float, worker, node,
                    dc) -> None:
  """A group over several datacenters: pair, or hierarchical (module doc)."""
  big_l = c.local_size
  if len(g) == 2:
    worker[g] += nbytes
    node[[w // big_l for w in g]] += nbytes
    if dc is not None:
      dc[dcs] += nbytes
    return
  k = len(dcs)
  cross = 2 * (k - 1) / k * nbytes
  for d in dcs:
    sub = [w for w in g if c.datacenter(w) == d]
    _group_bytes(c, sub, nbytes, worker, node, dc)
    sub_nodes = sorted({w // big_l for w in sub})
    worker[sub] += cross / len(sub)
    node[sub_nodes] += cross / len(sub_nodes)
    if dc is not None:
      dc[d] += cross


def round_bytes(c: Cluster, rnd, nbytes: float, permutes: bool = False,
                dc=None):
  """Bytes sent per worker, float64 [n], and leaving each node, [N], in one round.

  ``permutes``: the round realised with its ppermute terms (compressed
  gossip). ``dc``: optional float64 [D], bytes leaving each datacenter,
  added to in place.
  """
  worker, node = np.zeros(c.n_workers), np.zeros(c.n_nodes)
  if rnd.groups is not None and not permutes:
    for g in rnd.groups:
      _group_bytes(c, g, nbytes, worker, node, dc)
    return worker, node
  for term in rnd.terms:
    for s, d in term.perm:
      if s != d:
        worker[s] += nbytes
        if s // c.local_size != d // c.local_size:
          node[s // c.local_size] += nbytes
        if dc is not None and c.datacenter(s) != c.datacenter(d):
          dc[c.datacenter(s)] += nbytes
  return worker, node


def bytes_per_iteration(method, c: Cluster, w: Workload) -> Traffic:
  """Bytes per iteration of ``method`` (anything
  :func:`~decentral_jax.runtime_model.specs.make_method` takes).

  Raises:
    ValueError: ``c`` not a ``Cluster``, ``w`` not a ``Workload``, or as
      :func:`decentral_jax.runtime_model.specs.make_method`.
  """
  check_model_arguments(c=c, w=w)
  m = make_method(method, c)
  d, layout = w.devices_per_worker, w.worker_layout
  inner = worker_devices.inner_bytes(w)
  c, w = method_messages.effective(m, c, w)
  # "data": each of the D devices sends the full message; "fsdp": its shard.
  copies = d if layout == "data" else 1
  dc = np.zeros(c.datacenters)
  if m.kind == "all_reduce" or (m.kind == "local" and m.topology is None):
    nbytes = (w.grad_bytes if m.kind == "all_reduce"
              else local_sync.message_bytes(m, w, c.n_workers))
    if m.compress is not None and compression.gathers(m.compress):
      nbytes *= c.n_workers / 2  # all-gather of P: an all-reduce of nP/2
    worker, node = np.zeros(c.n_workers), np.zeros(c.n_nodes)
    _group_bytes(c, range(c.n_workers), nbytes, worker, node, dc)
    steps = m.period if m.kind == "local" else 1
  else:
    nbytes = (w.param_bytes if m.kind == "gossip"
              else local_sync.message_bytes(m, w, c.n_workers))
    worker, node = np.zeros(c.n_workers), np.zeros(c.n_nodes)
    for rnd in m.topology.rounds:
      wb, nb = round_bytes(c, rnd, nbytes, m.compress is not None, dc)
      worker, node = worker + wb, node + nb
    steps = m.topology.period * (m.period if m.kind == "local" else 1)
  return Traffic(copies * float(worker.max()) / steps,
                 copies * float(node.max()) / steps if node.size else 0.0,
                 inner, copies * float(dc.max()) / steps)
