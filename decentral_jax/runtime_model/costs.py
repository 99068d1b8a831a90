"""Alpha-beta collective costs on a cluster of nodes (seconds, bytes).

:class:`Cluster` describes the hardware; the functions here price one
collective round for every worker: ring all-reduce, pair exchange, group
means inside a node or over several nodes (ring or two-level tree), and
rounds of point-to-point ``ppermute`` terms, with concurrent inter-node flows
sharing their node's NIC. Three levels of links: workers in a node (intra
link), nodes in a datacenter (NICs), datacenters over a wide-area link
(``Cluster.datacenters > 1``: latency-dominated, one uplink per datacenter
shared by every flow that leaves it; group means that span datacenters run
hierarchically, see :func:`group_round_cost`). Units: seconds (``_s``),
bytes, bytes per second (``_Bps``).

References:
  Thakur, Rabenseifner, Gropp, `Optimization of Collective Communication
  Operations in MPICH`, IJHPCA 2005 (alpha-beta ring costs). NCCL user guide
  (ring and tree algorithms, channels; docs.nvidia.com/deeplearning/nccl).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from decentral_jax import checks
from decentral_jax.topology.rounds import Round

MULTI_NODE_ALGORITHMS = ("ring", "tree")
#: Most workers a :class:`Cluster` holds. Pricing keeps per-worker lists of
#: the workers each one waits for: an All-Reduce's are [n, n] (4096: about
#: 1 GB and 3 s; 65536 would need 32 GiB). The command line's bound too.
MAX_WORKERS = 4096
INTRA_LINKS = ("pcie", "nvlink")


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Hardware of a data-parallel job (one worker per accelerator).

  Attributes:
    n_workers: number of workers ``n``, an int in ``[1, MAX_WORKERS]``
      (:data:`MAX_WORKERS` = 4096).
    local_size: workers per node ``L`` (divides ``n``); workers
      ``v*L .. v*L+L-1`` share node ``v``.
    intra_latency_s: per-message latency of an intra-node hop (seconds).
    intra_bandwidth_Bps: per-worker, per-direction intra-node bandwidth
      (bytes/s), e.g. PCIe Gen3 x16 = 15.75e9.
    inter_latency_s: per-message latency of an inter-node hop (seconds).
    nic_bandwidth_Bps: line rate of one NIC port per direction (bytes/s),
      e.g. 100 Gbit/s InfiniBand EDR = 12.5e9, 25 Gbit/s Ethernet =
      3.125e9. With ``nics_per_node = 1`` (the default) it is the node's
      inter-node bandwidth, shared by all flows that leave (enter) the node
      at the same time.
    flow_bandwidth_Bps: optional cap on one inter-node flow (one collective's
      connections on one node, bytes/s); ``None``: no cap beyond the NICs the
      flow can use. E.g. the rate one NCCL socket connection sustains.
    nics_per_node: NIC ports per node (>= 1). They are split into
      ``min(nics_per_node, local_size)`` rails: worker ``v*L + j`` sends its
      point-to-point flows (pair exchanges, ppermutes) through rail ``j *
      rails // L`` (one NIC per GPU on rail-optimised nodes, e.g. 8 HCAs for
      8 GPUs); a group mean over several nodes spreads its channels over all
      of the node's NICs, as NCCL does with several NICs.
    nic_efficiency: fraction of the line rate that large transfers achieve
      (0 < x <= 1; protocol headers, e.g. about 0.94 for TCP/IPv4 over
      Ethernet with a 1500-byte MTU). Default 1.
    full_duplex: True (the default; InfiniBand and switched Ethernet links
      are full duplex): a NIC sends and receives at its rate at once. False:
      sending and receiving share it, so exchanges take twice as long.
    multi_node: how a group mean over several whole nodes runs: ``"ring"``
      (flat ring over all ranks, each node's NIC carries ``2(p-1)/p M`` per
      direction) or ``"tree"`` (two levels, like NCCL's tree: reduce in the
      node, one flow per node carries ``2(q-1)/q M`` across ``q`` nodes,
      broadcast in the node; stages pipelined, so the slower one sets the
      time).
    intra_link: what connects a node's accelerators: ``"pcie"`` (the
      default; each accelerator has one PCIe link, which carries both its
      intra-node traffic and its traffic to the NIC, so the two add up on
      it) or ``"nvlink"`` (intra-node traffic on NVLink/NVSwitch at
      ``intra_bandwidth_Bps``; traffic to the NIC on a separate path that is
      not limiting).
    datacenters: number of datacenters ``D`` (divides the number of nodes);
      datacenter ``d`` holds nodes ``d*N/D .. (d+1)*N/D - 1`` (workers
      ``d*n/D ..``). Default 1 (no wide-area link).
    wan_latency_s: one-way latency of a message between two datacenters
      (seconds; it replaces ``inter_latency_s`` on such hops), e.g. 0.03
      for about 6000 km of fibre. Default 0.
    wan_bandwidth_Bps: rate of one datacenter's wide-area uplink per
      direction (bytes/s), shared by every flow that leaves (enters) the
      datacenter at the same time, e.g. 10 Gbit/s = 1.25e9. Needed when
      ``datacenters > 1``; default None.
    codec_Bps: bytes of float32 values one device quantizes or dequantizes
      per second (compressed communication; see
      :mod:`decentral_jax.runtime_model.compression`). Default 100e9, an
      assumption (docs/runtime_model.md, "Compressed communication").

  Raises:
    ValueError: a field out of its range, one line naming it (e.g.
      ``n_workers`` above :data:`MAX_WORKERS`).
  """

  n_workers: int
  local_size: int = 1
  intra_latency_s: float = 5e-6
  intra_bandwidth_Bps: float = 15.75e9
  inter_latency_s: float = 10e-6
  nic_bandwidth_Bps: float = 12.5e9
  flow_bandwidth_Bps: float | None = None
  multi_node: str = "ring"
  intra_link: str = "pcie"
  nics_per_node: int = 1
  nic_efficiency: float = 1.0
  full_duplex: bool = True
  datacenters: int = 1
  wan_latency_s: float = 0.0
  wan_bandwidth_Bps: float | None = None
  codec_Bps: float = 100e9

  def __post_init__(self):
    n, big_l = self.n_workers, self.local_size
    checks.check_int("n_workers", n, minimum=1, maximum=MAX_WORKERS)
    if not checks.is_int(big_l) or big_l < 1 or n % big_l:
      raise ValueError(f"local_size={big_l!r} must be a positive integer "
                       f"dividing n_workers={n} (workers per node).")
    for name in ("intra_latency_s", "inter_latency_s"):
      checks.check_float(name, getattr(self, name), minimum=0)
    for name in ("intra_bandwidth_Bps", "nic_bandwidth_Bps"):
      checks.check_float(name, getattr(self, name), minimum=0, open_min=True)
    if self.flow_bandwidth_Bps is not None:
      checks.check_float("flow_bandwidth_Bps", self.flow_bandwidth_Bps,
                         minimum=0, open_min=True)
    checks.check_choice("multi_node", self.multi_node, MULTI_NODE_ALGORITHMS)
    checks.check_int("nics_per_node", self.nics_per_node, minimum=1)
    checks.check_float("nic_efficiency", self.nic_efficiency,
                       minimum=0, open_min=True)
    if self.nic_efficiency > 1:
      raise ValueError("nic_efficiency is a fraction of the line rate in "
                       f"(0, 1], got {self.nic_efficiency!r}.")
    checks.check_bool("full_duplex", self.full_duplex)
    checks.check_choice("intra_link", self.intra_link, INTRA_LINKS)
    self._check_wan()

  def _check_wan(self) -> None:
    d = self.datacenters
    if not checks.is_int(d) or d < 1 or self.n_nodes % d:
      raise ValueError(f"datacenters={d!r} must be a positive integer "
                       f"dividing the number of nodes ({self.n_nodes} = "
                       f"n_workers / local_size).")
    checks.check_float("wan_latency_s", self.wan_latency_s, minimum=0)
    if self.wan_bandwidth_Bps is not None:
      checks.check_float("wan_bandwidth_Bps", self.wan_bandwidth_Bps,
                         minimum=0, open_min=True)
    elif d > 1:
      raise ValueError(f"datacenters={d} needs wan_bandwidth_Bps (the rate "
                       "of a datacenter's wide-area uplink, bytes/s).")
    checks.check_float("codec_Bps", self.codec_Bps, minimum=0, open_min=True)

  @property
  def n_nodes(self) -> int:
    return self.n_workers // self.local_size

  @property
  def dc_size(self) -> int:
    """Workers per datacenter: ``n_workers // datacenters``."""
    return self.n_workers // self.datacenters

  def datacenter(self, worker: int) -> int:
    """The datacenter of ``worker``."""
    return worker // self.dc_size

  def wan_flow_Bps(self, sharing: int) -> float:
    """Bytes/s of one flow between datacenters when ``sharing`` flows use its uplinks."""
    return self.wan_bandwidth_Bps / max(1, sharing)

  @property
  def rails(self) -> int:
    """NIC groups per node: ``min(nics_per_node, local_size)``."""
    return min(self.nics_per_node, self.local_size)

  def rail(self, worker: int) -> int:
    """The rail (NIC group) of ``worker``'s point-to-point flows."""
    return (worker % self.local_size) * self.rails // self.local_size

  def nic_capacity_Bps(self, rail: bool = False) -> float:
    """Bytes/s per direction of a node's NICs (``rail``: of one rail's).

    Line rate x ``nic_efficiency`` x number of NICs, halved when the links
    are not full duplex (an exchange sends and receives on them at once).
    """
    nics = self.nics_per_node / self.rails if rail else self.nics_per_node
    rate = self.nic_bandwidth_Bps * self.nic_efficiency * nics
    return rate if self.full_duplex else rate / 2

  def inter_flow_Bps(self, sharing: int, rail: bool = False) -> float:
    """Bandwidth (bytes/s) of one inter-node flow when ``sharing`` flows use its NICs.

    Args:
      sharing: concurrent flows on the same NICs (the node's, or with
        ``rail`` the rail's), this one included.
      rail: a point-to-point flow of one worker, limited to its rail; else a
        group mean that uses all of the node's NICs.
    """
    share = self.nic_capacity_Bps(rail) / max(1, sharing)
    if self.flow_bandwidth_Bps is None:
      return share
    return min(self.flow_bandwidth_Bps, share)


def ring_all_reduce_time(p: int, nbytes: float, latency_s: float,
                         bandwidth_Bps: float) -> float:
  """Ring all-reduce over ``p`` ranks: ``2(p-1) a + 2(p-1)/p * M / b``.

  Args:
    p: ranks in the ring, an int >= 1.
    nbytes: message size M (bytes, >= 0) held by every rank.
    latency_s: per-step latency a (seconds, >= 0) of the slowest hop.
    bandwidth_Bps: per-direction bandwidth b (bytes/s, > 0) of the slowest
      hop.

  Returns:
    Seconds (float); 0.0 for ``p == 1``.

  Raises:
    ValueError: an argument that is not a finite number in its range (or
      ``p`` not an int), named, as :class:`Cluster` refuses its fields.
  """
  p = checks.check_int("p", p, minimum=1)
  nbytes, latency_s, bandwidth_Bps = _alpha_beta_args(nbytes, latency_s,
                                                      bandwidth_Bps)
  if p == 1:
    return 0.0
  return 2 * (p - 1) * latency_s + 2 * (p - 1) / p * nbytes / bandwidth_Bps


def pair_exchange_time(nbytes: float, latency_s: float,
                       bandwidth_Bps: float) -> float:
  """Two ranks swap M bytes at once (full duplex): ``a + M / b`` seconds.

  Args, Raises: as :func:`ring_all_reduce_time` (``nbytes`` >= 0,
  ``latency_s`` >= 0, ``bandwidth_Bps`` > 0).
  """
  nbytes, latency_s, bandwidth_Bps = _alpha_beta_args(nbytes, latency_s,
                                                      bandwidth_Bps)
  return latency_s + nbytes / bandwidth_Bps


def _alpha_beta_args(nbytes, latency_s, bandwidth_Bps):
  """``(M, a, b)`` as floats, each checked (M, a >= 0; b > 0)."""
  return (checks.check_float("nbytes", nbytes, minimum=0),
          checks.check_float("latency_s", latency_s, minimum=0),
          checks.check_float("bandwidth_Bps", bandwidth_Bps, minimum=0,
                             open_min=True))


@dataclasses.dataclass(frozen=True)
class RoundCost:
  """Per-worker cost of one collective round: ``latency_s + bytes * s_per_byte``.

  Attributes:
    latency_s: float64 [n], seconds paid per message (per bucket).
    s_per_byte: float64 [n], seconds per byte of the full message.
    members: int [n, m], workers whose data worker ``i`` waits for (padded
      with ``i``).
    crosses: bool [n], whether worker ``i``'s traffic uses its node's NIC.
  """

  latency_s: np.ndarray
  s_per_byte: np.ndarray
  members: np.ndarray
  crosses: np.ndarray

  def time(self, nbytes: float, n_messages: int = 1) -> np.ndarray:
    """Seconds per worker to move ``nbytes`` in ``n_messages`` messages."""
    return n_messages * self.latency_s + nbytes * self.s_per_byte


def _members(matrix: np.ndarray) -> np.ndarray:
  n = matrix.shape[0]
  rows = [sorted(set(np.flatnonzero(matrix[i] > 0).tolist()) | {i})
          for i in range(n)]
  width = max(len(r) for r in rows)
  return np.array([r + [i] * (width - len(r)) for i, r in enumerate(rows)])


def _group_cost(c: Cluster, group: Sequence[int], sharing: int,
                wan_sharing: int = 1):
  """(latency, seconds/byte) of an all-reduce (group mean) over ``group``.

  ``sharing``: concurrent inter-node flows on the NICs this group's flow uses
  (its rail's for a two-worker group, else the node's); ``wan_sharing``:
  concurrent flows on the wide-area uplink of its busiest datacenter (groups
  that span datacenters only).
  """
  p = len(group)
  nodes = {w // c.local_size for w in group}
  if p == 1:
    return 0.0, 0.0
  if c.datacenters > 1 and len({c.datacenter(w) for w in group}) > 1:
    if p == 2:
      return c.wan_latency_s, 1.0 / min(c.inter_flow_Bps(sharing, rail=True),
                                        c.wan_flow_Bps(wan_sharing))
    return _hierarchical_cost(c, group, sharing, wan_sharing)
  if len(nodes) == 1:
    if p == 2:
      return c.intra_latency_s, 1.0 / c.intra_bandwidth_Bps
    return 2 * (p - 1) * c.intra_latency_s, 2 * (p - 1) / p / c.intra_bandwidth_Bps
  q = len(nodes)
  if p == 2:
    return c.inter_latency_s, 1.0 / c.inter_flow_Bps(sharing, rail=True)
  per_node = p // q
  if c.multi_node == "tree" and per_node * q == p and per_node > 1:
    lat = 2 * (per_node - 1) * c.intra_latency_s + 2 * (q - 1) * c.inter_latency_s
    # Per byte of M: each worker's link carries its intra-node share and, on
    # PCIe, also its 1/per_node share of the node's flow to the NIC.
    link = 2 * (per_node - 1) / per_node
    if c.intra_link == "pcie":
      link += 2 * (q - 1) / q / per_node
    spb = max(link / c.intra_bandwidth_Bps,
              2 * (q - 1) / q / c.inter_flow_Bps(sharing))
    return lat, spb
  bw = min(c.intra_bandwidth_Bps, c.inter_flow_Bps(sharing))
  return 2 * (p - 1) * c.inter_latency_s, 2 * (p - 1) / p / bw


def _hierarchical_cost(c: Cluster, group: Sequence[int], sharing: int,
                       wan_sharing: int):
  """(latency, seconds/byte) of a group mean over ``k > 1`` datacenters.

  Hierarchical, in three stages run one after the other: a reduce-scatter
  inside each datacenter, an all-reduce of each shard across the ``k``
  datacenters (the ``m`` shard flows of a datacenter together move ``2(k-1)/k
  M`` through its uplink, ``2(k-1)`` wide-area latencies), an all-gather
  inside each datacenter. The two in-datacenter stages cost one group mean
  over the datacenter's members (:func:`_group_cost`; the slowest
  datacenter's latency and seconds per byte); the cross stage runs at the
  slower of the uplink's share and the NICs of the group's ``q`` nodes in a
  datacenter (``q`` inter-node flows):
  ``2(k-1) a_wan + 2(k-1)/k M / min(b_wan / wan_sharing, q b_flow)``.
  """
  by_dc: dict[int, list[int]] = {}
  for w in group:
    by_dc.setdefault(c.datacenter(w), []).append(w)
  k = len(by_dc)
  inner = [_group_cost(c, sub, sharing) for sub in by_dc.values()]
  q = min(len({w // c.local_size for w in sub}) for sub in by_dc.values())
  rate = min(c.wan_flow_Bps(wan_sharing), q * c.inter_flow_Bps(sharing))
  lat = max(a for a, _ in inner) + 2 * (k - 1) * c.wan_latency_s
  spb = max(b for _, b in inner) + 2 * (k - 1) / k / rate
  return lat, spb


def group_round_cost(c: Cluster, groups: Sequence[Sequence[int]]) -> RoundCost:
  """Cost of a round of simultaneous group means (a partition of workers).

  Every group that spans several nodes puts one flow per direction on the
  NICs of each node it touches; flows of one round share them
  (:meth:`Cluster.inter_flow_Bps`). A two-worker group is a point-to-point
  flow on each worker's rail; a larger one uses all of the node's NICs (and
  so shares them with every flow of the node). One-node groups use the
  intra link. A group that spans datacenters also puts one flow on the
  wide-area uplink of each datacenter it touches, shared with the round's
  other such groups; a pair across datacenters is one exchange at ``a_wan
  + M / min(rail share, uplink share)``, a larger group runs hierarchically
  (:func:`_hierarchical_cost`). Each worker's cost is set by the slowest
  link on its group's path.

  Returns:
    A :class:`RoundCost` over ``c.n_workers`` workers.
  """
  n, big_l = c.n_workers, c.local_size
  node_f = np.zeros(c.n_nodes, int)  # flows of groups of > 2 workers
  rail_f = np.zeros((c.n_nodes, c.rails), int)  # flows of pairs
  wan_f = np.zeros(c.datacenters, int)  # groups leaving each datacenter
  for g in groups:
    nodes = {w // big_l for w in g}
    if len(nodes) > 1:
      if len(g) == 2:
        for w in g:
          rail_f[w // big_l, c.rail(w)] += 1
      else:
        node_f[list(nodes)] += 1
    dcs = {c.datacenter(w) for w in g}
    if len(dcs) > 1:
      wan_f[list(dcs)] += 1
  lat, spb = np.zeros(n), np.zeros(n)
  crosses = np.zeros(n, bool)
  matrix = np.zeros((n, n))
  for g in groups:
    g = list(g)
    nodes = {w // big_l for w in g}
    if len(g) == 2:
      sharing = max(rail_f[w // big_l, c.rail(w)] + node_f[w // big_l]
                    for w in g)
    else:
      sharing = max(node_f[v] + rail_f[v].sum() for v in nodes)
    wan = max(wan_f[c.datacenter(w)] for w in g)
    lat[g], spb[g] = _group_cost(c, g, int(sharing), int(wan))
    crosses[g] = len(nodes) > 1
    matrix[np.ix_(g, g)] = 1.0
  return RoundCost(lat, spb, _members(matrix), crosses)


def permute_round_cost(c: Cluster, rnd: Round) -> RoundCost:
  """Cost of a round realised as sequential point-to-point ``ppermute`` terms.

  In each term, every worker sends one full message and receives one; flows
  leaving (entering) the same node on the same rail share its NICs, and
  flows leaving (entering) the same datacenter share its wide-area uplink
  (latency ``wan_latency_s`` on such hops). A worker's round time is the sum
  over terms of its slower direction.
  """
  n, big_l = c.n_workers, c.local_size
  lat, spb = np.zeros(n), np.zeros(n)
  crosses = np.zeros(n, bool)
  for term in rnd.terms:
    out_f = np.zeros((c.n_nodes, c.rails), int)
    in_f = np.zeros((c.n_nodes, c.rails), int)
    dc_out = np.zeros(c.datacenters, int)
    dc_in = np.zeros(c.datacenters, int)
    for s, d in term.perm:
      if s // big_l != d // big_l:
        out_f[s // big_l, c.rail(s)] += 1
        in_f[d // big_l, c.rail(d)] += 1
      if c.datacenter(s) != c.datacenter(d):
        dc_out[c.datacenter(s)] += 1
        dc_in[c.datacenter(d)] += 1
    t_lat, t_spb = np.zeros(n), np.zeros(n)
    for s, d in term.perm:
      if s // big_l == d // big_l:
        a, b = c.intra_latency_s, 1.0 / c.intra_bandwidth_Bps
      else:
        share = max(out_f[s // big_l, c.rail(s)], in_f[d // big_l, c.rail(d)])
        a, b = c.inter_latency_s, 1.0 / c.inter_flow_Bps(share, rail=True)
        if c.datacenter(s) != c.datacenter(d):
          wan = max(dc_out[c.datacenter(s)], dc_in[c.datacenter(d)])
          a, b = c.wan_latency_s, max(b, 1.0 / c.wan_flow_Bps(int(wan)))
        crosses[[s, d]] = True
      for w in (s, d):
        t_lat[w], t_spb[w] = max(t_lat[w], a), max(t_spb[w], b)
    lat, spb = lat + t_lat, spb + t_spb
  return RoundCost(lat, spb, _members(rnd.matrix), crosses)


def round_cost(c: Cluster, rnd: Round,
               permutes: bool = False) -> RoundCost:
  """Cost of one topology round: group means if it is a partition, else ppermutes.

  ``permutes``: realise the round with its ``ppermute`` terms even if it is
  a partition (compressed gossip sends every payload point to point).

  Raises:
    ValueError: ``c`` not a :class:`Cluster`, ``rnd`` not a topology
      ``Round`` (``Topology.rounds[r]``), or built for another ``n``.
  """
  checks.check_type("c", c, Cluster, "a runtime_model.Cluster")
  checks.check_type("rnd", rnd, Round,
                    "a topology Round (an entry of Topology.rounds)")
  if rnd.n_workers != c.n_workers:
    raise ValueError(f"topology has {rnd.n_workers} workers but the cluster "
                     f"has n_workers={c.n_workers}; build both for the same n.")
  if rnd.groups is not None and not permutes:
    return group_round_cost(c, rnd.groups)
  return permute_round_cost(c, rnd)


def all_reduce_cost(c: Cluster) -> RoundCost:
  """Cost of one All-Reduce over all ``n`` workers (one group; ring or tree).

  Over several datacenters it is hierarchical (:func:`_hierarchical_cost`):
  the wide-area link carries ``2(D-1)/D M`` per datacenter and pays
  ``2(D-1)`` wide-area latencies, not the ``2(n-1)`` of a flat ring.
  """
  return group_round_cost(c, [tuple(range(c.n_workers))])



def all_gather_cost(c: Cluster) -> RoundCost:
  """Cost of one All-Gather over all ``n`` workers, per byte of ONE worker's part.

  Every worker contributes ``P`` bytes and receives the other ``(n-1) P``.
  An all-reduce of ``M`` is a reduce-scatter plus an all-gather of its
  ``M/n`` shards, two halves that move the same bytes on every link, so an
  all-gather of ``P`` per worker moves what an all-reduce of ``M = nP/2``
  moves (ring: ``(p-1) P`` through each worker's link; tree: ``(q-1)/q
  nP`` leaving each node; over ``D`` datacenters ``(D-1)/D nP`` leaving
  each). It pays half the all-reduce's latencies: ring ``(p-1) a``, tree
  ``(L'-1) a_intra + (q-1) a_inter``, hierarchical ``(D-1) a_wan`` plus
  half the in-datacenter stages (a datacenter of two workers: half its
  pair latency, one in-datacenter latency low). Two workers exchange ``P`` (``a + P/b``),
  as the pair all-reduce does. Returns seconds ``latency_s + P s_per_byte``
  per worker (:meth:`RoundCost.time` of ``P``).

  References:
    Thakur, Rabenseifner, Gropp, IJHPCA 2005 (ring all-gather ``(p-1) a +
    (p-1)/p nP / b``).
  """
  rc = all_reduce_cost(c)
  n = c.n_workers
  if n <= 2:  # the pair exchange (or nothing): P each way, one latency
    return rc
  return RoundCost(rc.latency_s / 2, rc.s_per_byte * n / 2, rc.members,
                   rc.crosses)
