"""``predict``'s dependency table: flags that have an effect only with others.

:class:`Setting` is what the rows look at (the flags, the clusters and
workloads at every worker count, the methods built); :data:`NEEDS` is the
table :func:`~decentral_jax.tools.flag_types.check_needs` reads (each flag
given where no printed number reads it is refused, in one line naming it
and why). No JAX.
"""

from __future__ import annotations

import dataclasses

from decentral_jax.runtime_model import recommend
from decentral_jax.tools import flag_types
from decentral_jax.tools.runtime_model_cli import inputs
from decentral_jax.tools.runtime_model_cli import tables
from decentral_jax.tools.runtime_model_cli import wire_dtype


class Setting:
  """What :data:`NEEDS` looks at: the flags, the clusters and workloads at
  every worker count (preset, file or flags) and the methods built."""

  def __init__(self, args, setups, built, base_flows=None, measured=None,
               build=None, printed=None):
    self.args = args
    # printed(n, cluster, workload, built methods): the tables' text, for
    # the --intra-link rule (None: taken to change).
    self._printed, self._built = printed, built
    # The --cluster file's contents (or None) and predict's way of building
    # a cluster and workload, for the --param-dtype rule.
    self.measured, self._build = measured, build
    # The flow cap of the preset or cluster file at each worker count
    # (None: none), which --flow-Gbps replaces.
    self.base_flows = base_flows or [None] * len(setups)
    self.clusters = [(n, c) for n, c, _ in setups]
    self.workloads = [w for _, _, w in setups]
    self.methods = [m for made in built for _, m, _ in made]
    self.per_setup = [(m, c, w) for (_, c, w), made in zip(setups, built)
                      for _, m, _ in made]
    self._break_evens = {}
    self._plain = None  # id(workload) -> the one without --param-dtype

  def several_nodes(self) -> bool:
    return any(n > c.local_size for n, c in self.clusters)

  def intra_node_hops(self) -> bool:
    """Whether a node holds two workers or a worker several devices (an
    intra-node hop's latency and link type enter the price)."""
    return (any(min(n, c.local_size) > 1 for n, c in self.clusters)
            or any(w.devices_per_worker > 1 for w in self.workloads))

  def tree_or_ring(self) -> bool:
    """Whether a group mean spans several nodes of two or more workers in
    one datacenter (a datacenter of several nodes, ``local_size > 1``):
    only there do the tree (an intra-node stage, then the nodes) and the
    ring differ (:func:`~decentral_jax.runtime_model.costs._group_cost`
    reads ``multi_node`` only when ``per_node > 1``; a group over
    datacenters runs each datacenter's part on its own nodes)."""
    return any(c.local_size > 1 and c.dc_size > c.local_size
               for _, c in self.clusters)

  def tree_over_nodes(self) -> bool:
    """Whether a group mean runs the tree over nodes (the cluster's
    ``multi_node`` is ``"tree"`` where :meth:`tree_or_ring` holds): the
    only price that reads ``Cluster.intra_link``
    (:func:`~decentral_jax.runtime_model.costs._group_cost` charges the
    tree's NIC share to a PCIe link; a ring over nodes, a pair exchange and
    a mean inside one node never read it)."""
    return any(c.multi_node == "tree" and c.local_size > 1
               and c.dc_size > c.local_size for _, c in self.clusters)

  def intra_link_moves(self) -> bool:
    """Whether the other ``intra_link`` prints another table at some worker
    count: the tree's per-byte time is the larger of its PCIe-or-NVLink
    stage and its NIC stage, so where the NICs bind everywhere the link
    kind changes nothing (checked by pricing both)."""
    if self._printed is None:
      return True
    other = {"pcie": "nvlink", "nvlink": "pcie"}
    for (n, c), w, made in zip(self.clusters, self.workloads, self._built):
      flipped = dataclasses.replace(c, intra_link=other[c.intra_link])
      if self._printed(n, c, w, made) != self._printed(n, flipped, w, made):
        return True
    return False

  def reads_intra_bandwidth(self) -> bool:
    """Whether ``Cluster.intra_bandwidth_Bps`` enters a price: an
    intra-node hop (:meth:`intra_node_hops`), or a group mean of more
    than two workers in one datacenter, a ring over nodes at the slower of
    the intra-node link and the flow (every price includes the
    All-Reduce, a group mean over each datacenter's workers; a larger
    group has no more workers in a datacenter). With one worker per node
    and at most two per datacenter every message between workers is a
    pair exchange over the NICs, which the intra-node rate never prices."""
    return self.intra_node_hops() or any(c.dc_size > 2
                                         for _, c in self.clusters)

  def quorum_method(self) -> bool:
    return any(tables.fault_mode(m)[0] == "quorum" for m in self.methods)

  def reads_param_dtype(self) -> bool:
    """Whether a printed number reads ``Workload.param_dtype``: the inner
    collectives of a worker of several devices, an uncompressed gossip
    method or local sync without its own ``comm_dtype`` (a sync of
    DiLoCo's global copy, ``message="theta"``, sends at least float32: the
    flag changes it only where that differs from the workload's without
    the flag, :func:`wire_dtype.theta_dtype_moves`), or a compressed
    method's break-even line (priced
    against its uncompressed form: where that form reads the dtype, the
    line is computed at the given dtype and at the workload's without
    the flag and compared;
    the first is kept for printing, :meth:`break_even`)."""
    if any(w.devices_per_worker > 1 for w in self.workloads):
      return True
    counts = [n for n, _ in self.clusters]
    moves = wire_dtype.theta_dtype_moves(
        self.args, list(zip(counts, self.workloads)), self.measured,
        self._build)
    if any(m.compress is None and wire_dtype.sends_params(m, moves)
           for m in self.methods):
      return True
    return any(
        m.compress is not None and wire_dtype.sends_params(
            recommend.uncompressed(m, c), moves)
        and self._break_even_moves(m, c, w) for m, c, w in self.per_setup)

  def _break_even_moves(self, m, c, w) -> bool:
    """Whether ``m``'s break-even line at ``w`` differs from the line at
    the workload built without ``--param-dtype`` (the one the flag
    replaces: a preset's, a cluster or workload file's, or the default;
    one that cannot be built: True)."""
    if self._plain is None:
      counts = [n for n, _ in self.clusters]
      bases = wire_dtype.plain_workloads(self.args, counts, self.measured,
                                         self._build)
      self._plain = {id(wk): base for wk, base in zip(self.workloads, bases)}
    base = self._plain[id(w)]
    if base is None:
      return True
    if base.param_dtype == w.param_dtype:
      return False
    line = recommend.break_even_line
    return (line("", self.break_even(m, c, w))
            != line("", recommend.break_even(m, c, base)))

  def break_even(self, m, c, w):
    """:func:`recommend.break_even`, each ``(m, c, w)`` computed once
    (the check above and the table print the same line)."""
    key = (id(m), id(c), id(w))
    if key not in self._break_evens:
      self._break_evens[key] = (m, c, w, recommend.break_even(m, c, w))
    return self._break_evens[key][3]

  def reads_in_flight(self) -> bool:
    """Whether a printed number reads ``Workload.gossip_in_flight``: a
    gossip method that overlaps its step, or a compressed method whose
    uncompressed form (its break-even line's reference) is one."""
    overlaps = lambda m: m.kind == "gossip" and m.overlap  # noqa: E731
    return any(overlaps(m) or (m.compress is not None and overlaps(
        recommend.uncompressed(m, c))) for m, c, _ in self.per_setup)

  def flow_cap_binds(self) -> bool:
    """Whether ``--flow-Gbps`` is below a node's NIC capacity (line rate x
    efficiency x NICs, halved half duplex), or replaces a preset's or
    cluster file's cap below it: a flow's share of the NICs is at most
    that capacity, so caps at or above it never bind."""
    below = lambda cap, c: cap is None or cap < c.nic_capacity_Bps()  # noqa: E731
    return any(below(c.flow_bandwidth_Bps, c) or (
        base is not None and below(base, c))
        for (_, c), base in zip(self.clusters, self.base_flows))


_ONE_NODE = ("on one node (every --n-workers fits in its --local-size "
             "workers per node)")
_INTER_NODE = ("--nic-Gbps", "--nics-per-node", "--nic-efficiency",
               "--flow-Gbps", "--inter-latency-us", "--multi-node",
               "--half-duplex")
# --intra-GBps is not among them: one worker's PCIe link also carries its
# traffic to the NIC (costs.all_reduce_cost's ring over nodes); its own
# row (Setting.reads_intra_bandwidth) follows.
_INTRA_NODE = ("--intra-latency-us", "--intra-link")
_NO_FAILURES = "without --failure-rate above 0"

#: ``predict``'s flags that have an effect only with others (checked once
#: the cluster, workload and methods are built, so a preset's or a cluster
#: file's fields count): each given where it has none is refused.
NEEDS = (
    flag_types.Needs(
        "--slow-speed", lambda s: s.args.slow_fraction > 0,
        "without --slow-fraction above 0", "add --slow-fraction F (the share "
        "of slow workers) or drop --slow-speed"),
    flag_types.Needs(
        "--slow-fraction",
        lambda s: s.args.slow_fraction == 0 or s.args.slow_speed < 1,
        "with --slow-speed 1 (the slow workers run at full speed)",
        "give --slow-speed below 1 or drop --slow-fraction"),
    flag_types.Needs(
        "--mean-downtime", lambda s: s.args.failure_rate > 0, _NO_FAILURES,
        "add --failure-rate P or drop --mean-downtime"),
    flag_types.Needs(
        "--on-failure", lambda s: s.args.failure_rate > 0, _NO_FAILURES,
        "add --failure-rate P or drop --on-failure"),
    flag_types.Needs(
        "--on-failure", Setting.quorum_method, "without a method that "
        "syncs by a quorum in --methods (diloco, local_sgd and the other "
        "local-update methods over an exact all-reduce)", "add one, e.g. "
        "diloco:H=10, or drop --on-failure"),
    *(flag_types.Needs(
        flag, lambda s: any(c.datacenters > 1 for _, c in s.clusters),
        "without --datacenters above 1 (this cluster is one datacenter)",
        f"add --datacenters 2 (or a cross_region --preset) or drop {flag}")
      for flag in ("--wan-Gbps", "--wan-latency-ms")),
    *(flag_types.Needs(flag, Setting.several_nodes, _ONE_NODE,
                       f"add workers beyond one node or drop {flag}")
      for flag in _INTER_NODE),
    # Across datacenters the wide-area latency replaces it on every hop
    # between nodes of two datacenters (costs.Cluster.wan_latency_s).
    flag_types.Needs(
        "--inter-latency-us", lambda s: any(
            n // c.datacenters > c.local_size for n, c in s.clusters),
        "with one node per datacenter: every hop between nodes crosses "
        "datacenters and pays --wan-latency-ms instead",
        "give --wan-latency-ms, add nodes per datacenter, or drop "
        "--inter-latency-us"),
    *(flag_types.Needs(
        flag, Setting.intra_node_hops, "with one worker per node (--local-"
        "size 1, or --n-workers 1) of one device (--devices-per-worker 1): "
        "no message stays inside a node", f"add workers per node or drop "
        f"{flag}") for flag in _INTRA_NODE),
    # pcie vs nvlink says only whether a device's NIC traffic shares its
    # one link (costs.Cluster.intra_link, links.py): no NIC traffic on one
    # node, where the link's rate is --intra-GBps alone.
    flag_types.Needs(
        "--intra-link", Setting.several_nodes, _ONE_NODE + ": no message "
        "goes to a NIC, so whether NIC traffic shares the accelerators' "
        "link (pcie) or not (nvlink) changes nothing; the intra-node rate "
        "is --intra-GBps", "give --intra-GBps for the link's rate, add "
        "workers beyond one node, or drop --intra-link"),
    flag_types.Needs(
        "--intra-link", Setting.tree_over_nodes, "where no group mean runs "
        "the tree over nodes (--multi-node ring, or no datacenter of several "
        "nodes of two or more workers): only the tree's intra-node stage "
        "shares the accelerators' link with NIC traffic", "give --multi-node "
        "tree with workers per node and nodes per datacenter, or drop "
        "--intra-link"),
    flag_types.Needs(
        "--intra-link", Setting.intra_link_moves, "with these clusters and "
        "--methods: every tree's time per byte is set by its NIC stage, not "
        "by the accelerators' link, so pcie and nvlink price alike", "give "
        "a faster --nic-Gbps or more --nics-per-node, or drop --intra-link"),
    flag_types.Needs(
        "--multi-node", Setting.tree_or_ring, "where no datacenter holds "
        "several nodes of two or more workers (--local-size 1, or one node "
        "per --datacenters): a group mean over nodes has no intra-node "
        "stage there, so tree and ring are one schedule", "add workers per "
        "node and nodes per datacenter, or drop --multi-node"),
    flag_types.Needs(
        "--intra-GBps", Setting.reads_intra_bandwidth, "with one worker "
        "per node (--local-size 1, or --n-workers 1) of one device "
        "(--devices-per-worker 1) and at most two workers per datacenter: "
        "every message between workers is a pair exchange over the NICs, "
        "which no intra-node link prices", "add workers per node or more "
        "than two workers per datacenter, or drop --intra-GBps"),
    flag_types.Needs(
        "--worker-layout",
        lambda s: any(w.devices_per_worker > 1 for w in s.workloads),
        "without --devices-per-worker above 1", "add --devices-per-worker "
        "D or drop --worker-layout"),
    flag_types.Needs(
        "--compute-cv",
        lambda s: all(w.compute_samples_s is None for w in s.workloads),
        "with --compute-samples-ms (the samples give the spread)",
        "drop one of them"),
    flag_types.Needs(
        "--codec-GBps",
        lambda s: any(m.compress is not None for m in s.methods),
        "without a compressed method in --methods", "add one, e.g. "
        "dadam:topology=static_ring,compress=int8, or drop --codec-GBps"),
    flag_types.Needs(
        "--gossip-in-flight",
        Setting.reads_in_flight,
        "without a gossip method that overlaps its step in --methods "
        "(one_peer_exp, aer, dadam:..., gradient_tracking:...; not sgp, "
        "which blocks, or the local-update methods), nor a compressed one "
        "whose break-even line prices such a method", "add one or drop "
        "--gossip-in-flight"),
    flag_types.Needs(
        "--param-dtype", Setting.reads_param_dtype,
        "with these --methods: all_reduce sends gradients (--grad-dtype), a "
        "compressed method or one with comm_dtype its own format (and no "
        "break-even line changes), and DiLoCo's global copy at least "
        "float32", "add a gossip method or "
        "local_sgd, or drop --param-dtype"),
    flag_types.Needs(
        "--flow-Gbps", Setting.flow_cap_binds,
        "at or above a node's NIC capacity (--nic-Gbps x --nic-efficiency x "
        "--nics-per-node), replacing no lower cap of a --preset or "
        "--cluster file: no flow gets more, so the cap never binds",
        "give a cap below it or drop --flow-Gbps"),
    flag_types.Needs(
        "--seed", lambda s: any(w.compute_std_s > 0 for w in s.workloads)
        or all(w.compute_samples_s is None for w in s.workloads),
        "with compute samples that do not vary (--compute-samples-ms or the "
        "--cluster file's: every sample equal, so every draw is the same)",
        "give samples that differ or drop --seed"),
    flag_types.Needs(
        "--seed", lambda s: any(w.compute_std_s > 0 for w in s.workloads),
        "without compute that varies (--compute-cv above 0 or "
        "--compute-samples-ms; the seed draws the compute times)",
        "add one or drop --seed"),
)


def check_slow_workers(args) -> None:
  """Refuses a ``--slow-fraction`` ``f`` above 0 that makes ``k = round(f
  n)`` no worker at a ``--n-workers`` count ``n``, as the runner refuses
  ``config.faults.slow_fraction``: no worker runs at ``--slow-speed``, so
  the faults table prints the fault-free numbers. The fix is ``1 / n`` at
  the smallest count (one worker there, at least one at every larger one).

  Raises:
    ValueError: one line naming ``--slow-fraction``, the count and the fix.
  """
  f = args.slow_fraction
  if not f:
    return
  n = min(args.n_workers)
  if int(round(f * n)) == 0:  # as stragglers.Faults.slow_workers counts
    raise ValueError(
        f"--slow-fraction {f:g} makes round({f:g} x --n-workers {n}) = 0 "
        f"workers slow; set --slow-fraction {1 / n:.6g} (one worker) or "
        "more, or 0.")


def _pipelining_moves(m, c, w) -> bool:
  """Whether ``pipelined=1`` changes a number of ``m`` on ``c`` and ``w``
  (:mod:`~decentral_jax.runtime_model.in_flight`): only with in-flight
  fractions, and there either by hiding the optimizer's update (``C + O +
  max(0, tau - W - O)``: ``O > 0``) or, in the simulation, by its round
  order ``floor(k / 2)`` (a topology of several rounds and compute that
  varies: which neighbours a slow step waits for changes)."""
  if w.gossip_in_flight is None:
    return False
  return w.optimizer_s > 0 or (len(m.topology.rounds) > 1
                               and w.compute_std_s > 0)


def check_pipelined(setting: Setting) -> None:
  """Refuses ``pipelined=1`` on an uncompressed gossip spec of
  ``--methods`` where it changes no printed number at any worker count:
  the pipelined round differs from the default one only in hiding the
  optimizer's update too and in its round order (:func:`_pipelining_moves`),
  which only ``Workload.gossip_in_flight`` prices, the update only where
  its time (``--optimizer-ms``, a workload's ``optimizer_s``) is above 0.

  Raises:
    ValueError: one line naming the spec, ``pipelined=1`` and the fix.
  """
  for m, _, _ in setting.per_setup:
    if not m.pipelined or any(_pipelining_moves(m2, c, w) for m2, c, w
                              in setting.per_setup if m2.name == m.name):
      continue
    if all(w.gossip_in_flight is None for w in setting.workloads):
      raise ValueError(
          f"--methods {m.name!r}: pipelined=1 has no effect without "
          "in-flight fractions (a round already hides behind the next "
          "forward and backward; pipelining also hides the optimizer's "
          "update, which only --gossip-in-flight or a workload file's "
          "gossip_in_flight prices); give --gossip-in-flight or drop "
          "pipelined=1.")
    raise ValueError(
        f"--methods {m.name!r}: pipelined=1 has no effect with an optimizer "
        "time of 0 (--optimizer-ms, or the workload's optimizer_s): it hides "
        "only the optimizer's update behind the round, C + O + max(0, tau - "
        "W - O) (its round order floor(k/2) matters only on a topology of "
        "several rounds with compute that varies); give --optimizer-ms "
        "above 0 or drop pipelined=1.")


def unused_file_keys(path: str, measured: dict, setting) -> list[str]:
  """A ``warning:`` line per optional key of a cluster file that has no
  effect in ``setting`` (a :class:`Setting`), where the equivalent flag
  is refused by :data:`NEEDS`: ``wan_latency_s``, ``wan_bandwidth_Bps``
  on one datacenter, ``codec_Bps`` without a compressed method."""
  given = measured["cluster"]
  rules = (("wan_latency_s", "--wan-latency-ms"),
           ("wan_bandwidth_Bps", "--wan-Gbps"), ("codec_Bps", "--codec-GBps"))
  rows = {r.flag: r for r in NEEDS}
  return [f"warning: --cluster {path!r}: cluster.{key} has no effect "
          f"{rows[flag].unless} (as {flag}); it is ignored."
          for key, flag in rules
          if given.get(key) is not None and not rows[flag].holds(setting)]


