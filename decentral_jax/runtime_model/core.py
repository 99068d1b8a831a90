"""Methods, closed forms and a max-plus simulator of the runtime model.

Collective costs and the hardware (:class:`Cluster`) are in
:mod:`decentral_jax.runtime_model.costs`, the model and its compute
(:class:`Workload`) in :mod:`decentral_jax.runtime_model.workload`; both are
re-exported here.

The model predicts the mean per-iteration time (seconds) of data-parallel
training with All-Reduce of gradients (PyTorch-DDP style: bucketed, overlapped
with the backward only) and with decentralized gossip of parameters
(Decent-DP style: per-bucket, overlapped with the whole next forward and
backward), from three factors (Wang et al. 2025, Sec. 4 / App. A.5):

1. overlap: gossip hides behind forward + backward, All-Reduce only behind the
   rest of the backward;
2. heterogeneous links: fast intra-node links, one slow NIC per node shared by
   every flow that leaves the node in the same round;
3. compute variability: All-Reduce waits for the slowest of n workers every
   step, gossip only for the members of the current group.

Units everywhere: seconds (``_s``), bytes, bytes per second (``_Bps``).

References:
  Wang, Zhang, Wu, Johansson, `From Promise to Practice: Realizing
  High-performance Decentralized Training <https://arxiv.org/abs/2410.11998>`_,
  ICLR 2025. Thakur, Rabenseifner, Gropp, `Optimization of Collective
  Communication Operations in MPICH`, IJHPCA 2005 (alpha-beta ring costs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np
from scipy import special

from decentral_jax.topology import schedules as topology_lib
# Re-exported: the model's public names live in ``core`` too.
from decentral_jax.runtime_model.costs import (  # noqa: F401
    MULTI_NODE_ALGORITHMS, Cluster, RoundCost, _group_cost, _members,
    _positive, all_reduce_cost, group_round_cost, pair_exchange_time,
    permute_round_cost, ring_all_reduce_time, round_cost)
from decentral_jax.runtime_model import spanning
from decentral_jax.runtime_model.workload import (  # noqa: F401
    Workload, expected_max_normal)

METHOD_KINDS = ("all_reduce", "gossip", "local")

# ---------------------------------------------------------------------------
# Methods.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Method:
  """A training method to cost.

  Attributes:
    name: label used in tables ("all_reduce", "sgp", or the topology name).
    kind: "all_reduce" (All-Reduce of gradients, bucketed; the PyTorch DDP
      schedule), "gossip" (mixing of parameters over ``topology``; the
      Decent-DP schedule) or "local" (local updates with a sync every
      ``period`` steps, below).
    topology: the gossip topology (``None`` for all_reduce, and for the
      exact all-reduce of kind "local").
    overlap: True: communication overlaps compute (All-Reduce: bucket by
      bucket with the rest of the backward; gossip: with the next forward and
      backward). False: it runs after the step and is waited for (e.g. SGP,
      Assran et al. 2019, or a runtime without async collectives).
    measured_s: optional measured seconds, overriding the formulas: for
      all_reduce one value (the whole gradient), for gossip one per round
      (the whole parameter message), for local one value for the exact
      all-reduce of the whole sync message (split evenly over fragments)
      or one per topology round.
    period: kind "local" only: the sync period ``H`` in steps (>= 1;
      ``sync_every`` of Local SGD / DiLoCo, ``gossip_every`` of local
      D-SGD / DAdam). Default 1.
    fragments: kind "local", exact all-reduce only: Streaming DiLoCo's
      ``P`` (``num_fragments``), ``1 <= P <= H``. Default 1.
    overlap_steps: kind "local", exact all-reduce only: Streaming DiLoCo's
      ``tau`` (``overlap_steps``), inner steps during which a fragment's
      all-reduce may run; ``tau * P < H``. Default 0 (blocking).
    message: kind "local" only: what is synchronised, which sets the dtype
      on the wire: "params" (the parameters in ``Workload.param_dtype``;
      Local SGD, local D-SGD / DAdam) or "theta" (DiLoCo's global copy,
      ``param_dtype`` promoted to at least float32). Default "params".
    comm_dtype: kinds "local" and "gossip": optional dtype of the message
      on the wire (numpy name, e.g. "bfloat16"; ``config.comm_dtype``),
      overriding ``message``'s (gossip: the parameters') dtype; bytes scale
      with its itemsize. Default None.
    bucket_bytes: optional bucket size (bytes) for this method, replacing
      ``Workload.bucket_bytes`` (``config.bucket_bytes`` of bucketed
      gossip). Default None.

  Kind "local" (local-update methods: Local SGD, DiLoCo, Streaming DiLoCo,
  decentralized DiLoCo, local D-SGD / DAdam) takes ``H - 1`` purely local
  steps, then a synchronisation that is never overlapped with the step's
  compute (it runs inside a ``lax.cond`` after the inner update): an exact
  all-reduce of the message (``topology`` None) or one round of
  ``topology``; ``overlap`` is ignored. See
  :mod:`decentral_jax.runtime_model.local_methods`.
  """

  name: str
  kind: str
  topology: topology_lib.Topology | None = None
  overlap: bool = True
  measured_s: tuple[float, ...] | None = None
  period: int = 1
  fragments: int = 1
  overlap_steps: int = 0
  message: str = "params"
  comm_dtype: str | None = None
  bucket_bytes: float | None = None

  def round_costs(self, c: Cluster, w: Workload) -> list[RoundCost]:
    """One :class:`RoundCost` per topology round (measured times if given)."""
    rounds = list(_topology_round_costs(self.topology, c))
    if self.measured_s is not None:
      if len(self.measured_s) != len(rounds):
        raise ValueError(f"measured_s has {len(self.measured_s)} entries, "
                         f"topology {self.name!r} has {len(rounds)} rounds.")
      rounds = [RoundCost(np.zeros(c.n_workers),
                          np.full(c.n_workers, t / max(w.param_bytes, 1.0)),
                          r.members, r.crosses)
                for t, r in zip(self.measured_s, rounds)]
    return rounds


@functools.lru_cache(maxsize=512)
def _topology_round_costs(topo: topology_lib.Topology,
                          c: Cluster) -> tuple[RoundCost, ...]:
  """Round costs of ``topo`` on ``c`` (cached: both are immutable)."""
  return tuple(round_cost(c, r) for r in topo.rounds)


def sgp_topology(n: int, local_size: int = 1) -> topology_lib.Topology:
  """Directed one-peer exponential graph: round k receives from ``i - 2^k``."""
  if n == 1:
    return topology_lib.make("complete", 1)
  rounds = []
  for k in range(max(1, (n - 1).bit_length())):
    perm = [(i - (1 << k)) % n for i in range(n)]
    rounds.append([(list(range(n)), 0.5), (perm, 0.5)])
  topo = topology_lib.from_permutations(rounds, name="sgp")
  return topology_lib.Topology("sgp", topo.rounds, local_size)


def make_method(spec, c: Cluster) -> Method:
  """A :class:`Method` from a name, a ``Topology`` or a ``Method``.

  Args:
    spec: "all_reduce", "sgp" (non-overlapped gossip on :func:`sgp_topology`),
      a topology name accepted by :func:`decentral_jax.topology.make` (e.g.
      "one_peer_exp", "aer"; overlapped gossip), a local-update spec such as
      "diloco:H=10" or "streaming_diloco:H=10,P=4,tau=1" (syntax in
      :func:`decentral_jax.runtime_model.local_methods.parse_spec`), a
      ``Topology`` or a ``Method`` (returned as is after checks).
    c: the cluster; topologies are built for ``c.n_workers``, ``c.local_size``.

  Raises:
    ValueError: unknown name, a bad local-update spec or field (naming the
      bad part), or a topology built for another ``n``.
  """
  from decentral_jax.runtime_model import local_methods  # pylint: disable=import-outside-toplevel
  from decentral_jax.runtime_model import specs  # pylint: disable=import-outside-toplevel
  if isinstance(spec, Method):
    topo = spec.topology
  elif isinstance(spec, topology_lib.Topology):
    topo, spec = spec, Method(spec.name, "gossip", spec)
  else:
    key = str(spec).strip().lower().replace("-", "_")
    if specs.is_gossip_spec(key):
      return specs.parse(str(spec), c)
    if local_methods.is_local_spec(key):
      return local_methods.parse_spec(str(spec), c)
    if key in ("all_reduce", "allreduce", "ar"):
      return Method("all_reduce", "all_reduce")
    if key == "sgp":
      return Method("sgp", "gossip", sgp_topology(c.n_workers, c.local_size),
                    overlap=False)
    topo = topology_lib.make(key, c.n_workers, c.local_size)
    spec = Method(topology_lib.canonical_name(key), "gossip", topo)
  if spec.kind not in METHOD_KINDS:
    raise ValueError(f"Method.kind must be one of {METHOD_KINDS}, got "
                     f"{spec.kind!r}.")
  if topo is not None and topo.n_workers != c.n_workers:
    raise ValueError(f"topology {topo.name!r} has n_workers={topo.n_workers}"
                     f" but the cluster has n_workers={c.n_workers}; build "
                     "both for the same n.")
  if spec.kind == "gossip" and topo is None:
    raise ValueError("a gossip Method needs a topology.")
  if spec.bucket_bytes is not None:
    _positive("Method.bucket_bytes", spec.bucket_bytes)
  local_methods.check_method(spec)
  return spec


# ---------------------------------------------------------------------------
# Estimators.
# ---------------------------------------------------------------------------


def _split(w: Workload) -> tuple[float, float]:
  """Mean forward and backward seconds (samples rescale the pair)."""
  total = w.forward_s + w.backward_s
  mean = w.compute_mean_s
  if total <= 0:
    return 0.0, mean
  return mean * w.forward_s / total, mean * w.backward_s / total


def _all_reduce_taus(m: Method, c: Cluster, w: Workload):
  """Per-bucket All-Reduce seconds [nb] and ready fractions [nb]."""
  sizes, ready = w.buckets(w.grad_bytes)
  if m.measured_s is not None:
    taus = m.measured_s[0] * sizes / max(sizes.sum(), 1.0)
  else:
    rc = all_reduce_cost(c)
    taus = rc.latency_s[0] + sizes * rc.s_per_byte[0]
  if not m.overlap:
    return np.array([taus.sum()]), np.array([1.0])
  return taus, ready


def _all_reduce_iteration(fwd, bwd, opt_s, taus, ready) -> np.ndarray:
  """DDP iteration time(s): buckets reduce in order once all workers have them.

  ``fwd``, ``bwd``: float arrays [..., n] (seconds); returns [...] seconds:
  ``e_b = max(e_{b-1}, max_i(F_i + ready_b B_i)) + tau_b``,
  ``T = max(e_nb, max_i(F_i + B_i)) + O``.
  """
  arrive = (fwd[..., None] + bwd[..., None] * ready).max(axis=-2)
  d = np.cumsum(taus)
  e_last = (arrive - (d - taus)).max(axis=-1) + d[-1]
  return np.maximum(e_last, (fwd + bwd).max(axis=-1)) + opt_s


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Predicted mean per-iteration time and its parts (all seconds).

  Attributes:
    method: method label.
    iteration_s: predicted mean seconds per iteration.
    compute_s: mean forward + backward + optimizer seconds.
    exposed_comm_s: deterministic iteration time minus ``compute_s``
      (communication not hidden by overlap; factors 1 and 2).
    variability_s: ``iteration_s`` minus the deterministic time (factor 3).
  """

  method: str
  iteration_s: float
  compute_s: float
  exposed_comm_s: float
  variability_s: float


@functools.lru_cache(maxsize=4096)
def coupling_excess(m: int, slack_sigmas: float) -> float:
  """``E[(max(Z_1..Z_{m-1}) - Z_0 - s)^+]`` for i.i.d. standard normals.

  The expected wait (in units of the compute standard deviation) of a worker
  for the slowest of the ``m - 1`` other members of its group when its
  communication has ``s`` standard deviations of slack. ``m = n``, ``s = 0``
  is All-Reduce's barrier minus the worker's own time.
  """
  if m <= 1:
    return 0.0
  s = max(0.0, round(float(slack_sigmas), 3))
  x = np.linspace(-8.0, 8.0, 321)
  pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
  y = np.linspace(s, s + 12.0, 241)
  cdf_y = np.trapezoid(pdf * special.ndtr(x[None, :] + y[:, None])**(m - 1),
                       x, axis=1)
  return float(np.trapezoid(1.0 - cdf_y, y))


def _stream_windows(costs: Sequence[RoundCost], w: Workload) -> list[np.ndarray]:
  """Per round ``r``, seconds from the start of step ``r`` to its gossip's end.

  Deterministic (mean compute) steady state of the simulator's recursion with
  one in-order stream per worker. Round ``r`` is posted during step ``r-1``
  and waited for in step ``r``. Its first bucket starts ``slack_r`` before
  step ``r`` does, at the latest of: bucket 1 posted (``F + phi_1 B + o_1``
  into step ``r-1``), bucket 1 of round ``r-1`` received and mixed, and the
  end of round ``r-1`` on the worker's stream. With the stream busy through
  the round, the round ends ``tau_r - slack_r`` after step ``r`` starts, and
  step ``r`` takes ``T_r = max(C + O, tau_r - slack_r + o_nb)``. The
  recursion over the period is iterated to its fixed point.

  Returns:
    One float64 [n] array per round: ``tau_r - slack_r`` (seconds).
  """
  fwd, bwd = _split(w)
  sizes, ready = w.buckets(w.param_bytes)
  o_b = w.optimizer_s * sizes / max(sizes.sum(), 1e-300)
  base = fwd + bwd + w.optimizer_s
  taus = [rc.time(w.param_bytes, len(sizes)) for rc in costs]
  firsts = [rc.time(sizes[0]) for rc in costs]
  slack = [np.zeros_like(t) for t in taus]
  for _ in range(100):
    before = [x.copy() for x in slack]
    for r in range(len(costs)):
      p = r - 1
      step = np.maximum(base, taus[p] - slack[p] + o_b[-1])  # T_{r-1}
      slack[r] = np.maximum(0.0, np.minimum.reduce([
          step - fwd - ready[0] * bwd - o_b[0],
          step + slack[p] - firsts[p] - o_b[0],
          step + slack[p] - taus[p]]))
    if all(np.allclose(x, y, rtol=0.0, atol=1e-15) for x, y in
           zip(slack, before)):
      break
  return [t - x for t, x in zip(taus, slack)]


def closed_form(method, c: Cluster, w: Workload) -> Estimate:
  """Closed-form per-iteration time of ``method`` (no simulation).

  * All-Reduce: the DDP bucket pipeline (``_all_reduce_iteration``) with
    forward and backward inflated by ``E[max of n] - mean`` of the compute
    distribution (``sigma E[max of n N(0,1)]``, about ``sigma sqrt(2 ln n)``).
  * Gossip: per worker, ``mean_r [max(C + O, tau_r - slack_r + o_nb) +
    d_r]`` over the period, the slowest worker setting the pace. ``tau_r``
    is the worker's round time for the full parameter message (one latency
    per bucket), and ``o_nb`` the optimizer time of the last bucket. Each
    worker's collectives run in order on one stream, so ``slack_r`` (how
    long before step ``r`` the round's first bucket got onto the stream) is
    at most ``(1 - ready_1) B`` and is cut to the time the stream was idle
    after round ``r-1`` (:func:`_stream_windows`). ``d_r = sigma *
    coupling_excess(|G|, |C + O - tau_eff| / sigma)`` is the expected wait
    caused by the slowest group member once the gap between compute and
    communication is used up. Without variance it is the simulator's
    steady state (equal to rounding for one bucket or equal buckets); with
    variance an approximation of :func:`simulate`.
  * Gossip without overlap (SGP): ``mean_r [C + O + tau_r + sigma *
    coupling_excess(|G|, 0)]``.
  * Local updates (kind "local"): see
    :func:`decentral_jax.runtime_model.local_methods.closed_form`.

  Returns:
    An :class:`Estimate`.
  """
  m = make_method(method, c)
  c_eff, w_eff = spanning.effective(m, c, w)
  est = _closed_form(m, c_eff, w_eff)
  inner = w_eff.optimizer_s - w.optimizer_s
  if inner <= 0:
    return est
  # Collectives inside a worker of several devices: communication, exposed.
  return dataclasses.replace(est, compute_s=est.compute_s - inner,
                             exposed_comm_s=est.exposed_comm_s + inner)


def _closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  if m.kind == "local":
    from decentral_jax.runtime_model import local_methods  # pylint: disable=import-outside-toplevel
    return local_methods.closed_form(m, c, w)
  fwd, bwd = _split(w)
  comp = fwd + bwd
  base = comp + w.optimizer_s
  sigma = w.compute_std_s
  if m.kind == "all_reduce":
    taus, ready = _all_reduce_taus(m, c, w)
    det = float(_all_reduce_iteration(np.array([fwd]), np.array([bwd]),
                                      w.optimizer_s, taus, ready))
    scale = 1.0 + w.expected_max_excess(c.n_workers) / max(comp, 1e-300)
    tot = float(_all_reduce_iteration(np.array([fwd * scale]),
                                      np.array([bwd * scale]),
                                      w.optimizer_s, taus, ready))
    return Estimate(m.name, tot, base, det - base, tot - det)
  costs = m.round_costs(c, w)
  det = np.zeros(c.n_workers)
  tot = np.zeros(c.n_workers)
  if not m.overlap:
    for rc in costs:
      size = np.array([len(set(row)) for row in rc.members.tolist()])
      tau = rc.time(w.param_bytes)
      d = np.array([sigma * coupling_excess(int(s), 0.0) for s in size])
      det += base + tau
      tot += base + tau + d
  else:
    sizes, _ = w.buckets(w.param_bytes)
    o_last = w.optimizer_s * sizes[-1] / max(sizes.sum(), 1e-300)
    for rc, eff in zip(costs, _stream_windows(costs, w)):
      size = np.array([len(set(row)) for row in rc.members.tolist()])
      step = np.maximum(base, eff + o_last)
      hidden = np.abs(base - eff - o_last) / max(sigma, 1e-300)
      d = np.array([sigma * coupling_excess(int(s), h) if sigma > 0 else 0.0
                    for s, h in zip(size, hidden)])
      det += step
      tot += step + d
  det_s, tot_s = det.max() / len(costs), tot.max() / len(costs)
  return Estimate(m.name, float(tot_s), base, float(max(det_s - base, 0.0)),
                  float(tot_s - det_s))


def simulate(method, c: Cluster, w: Workload, *, steps: int = 300,
             warmup: int = 60, seed: int = 0) -> float:
  """Mean per-iteration time (seconds) from a max-plus simulation.

  Per worker and step, forward and backward are drawn from the workload's
  distribution (same draws for every method with the same seed). Recursions:

  * All-Reduce: global barrier each step; see ``_all_reduce_iteration``.
  * Gossip (Decent-DP): for bucket b of worker i in step k, gradients are
    ready at ``t + B_i dphi_b``; the worker waits for the bucket's gossip
    launched in step k-1, mixes and updates (``o_b``) and posts the bucket for
    the next round. A worker's collectives share its links and run one at a
    time in issue order (one stream per worker), so worker j can start its
    part of bucket b once it has posted b and finished its previous
    collective: bucket b-1, or for b = 1 the previous round's last bucket,
    whatever round that was.
    The collective ends ``tau_r,i(M_b)`` after every member could start.
    Step k+1 starts when the last bucket is posted.
  * SGP: post after the step, next step after receiving the peer's message.
  * Local updates (kind "local"): see
    :func:`decentral_jax.runtime_model.local_methods.simulate`; the mean is
    over whole sync periods after ``warmup``.

  Args:
    method: anything :func:`make_method` accepts.
    c: cluster.
    w: workload.
    steps: simulated iterations (> warmup).
    warmup: iterations discarded before averaging.
    seed: seed of the compute draws.

  Returns:
    Mean seconds per iteration over steps ``warmup .. steps``.

  Raises:
    ValueError: ``steps <= warmup`` or ``warmup < 0``; for kind "local",
      no whole schedule period between ``warmup`` and ``steps``.
  """
  if warmup < 0 or steps <= warmup:
    raise ValueError(f"need 0 <= warmup < steps, got warmup={warmup}, "
                     f"steps={steps}.")
  m = make_method(method, c)
  c, w = spanning.effective(m, c, w)
  n = c.n_workers
  fwd_m, bwd_m = _split(w)
  fac = w.compute_factors(steps, n, seed)
  if m.kind == "local":
    from decentral_jax.runtime_model import local_methods  # pylint: disable=import-outside-toplevel
    return local_methods.simulate(m, c, w, fac, warmup)
  fwd, bwd, opt = fwd_m * fac, bwd_m * fac, w.optimizer_s
  if m.kind == "all_reduce":
    taus, ready = _all_reduce_taus(m, c, w)
    return float(_all_reduce_iteration(fwd, bwd, opt, taus, ready)[warmup:].mean())
  costs = m.round_costs(c, w)
  period = len(costs)
  sizes, ready = w.buckets(w.param_bytes)
  s = np.zeros(n)
  marks = {}
  if not m.overlap:
    taus = [rc.time(w.param_bytes) for rc in costs]
    for k in range(steps):
      if k == warmup:
        marks["start"] = s.copy()
      post = s + fwd[k] + bwd[k] + opt
      rc = costs[(k + 1) % period]
      s = post[rc.members].max(axis=1) + taus[(k + 1) % period]
    return float(np.mean(s - marks["start"]) / (steps - warmup))
  d_ready = np.diff(ready, prepend=0.0)
  opt_b = opt * sizes / max(sizes.sum(), 1e-300)
  taus = [rc.latency_s[:, None] + rc.s_per_byte[:, None] * sizes for rc in costs]
  wait = np.full((n, len(sizes)), -np.inf)
  for k in range(steps):
    if k == warmup:
      marks["start"] = s.copy()
    cum = np.cumsum(bwd[k][:, None] * d_ready + opt_b, axis=1)
    v = np.maximum.accumulate(wait + opt_b - cum, axis=1)
    post = np.maximum((s + fwd[k])[:, None], v) + cum
    s = post[:, -1]
    r = (k + 1) % period
    members, tau = costs[r].members, taus[r]
    # One in-order stream per worker: a member's part of bucket b starts once
    # it posted b and its stream finished its previous collective (bucket
    # b-1, or the previous round's last bucket); the collective then needs
    # every member.
    free = wait[:, -1].copy()
    for b in range(len(sizes)):
      free = np.maximum(post[:, b], free)[members].max(axis=1) + tau[:, b]
      wait[:, b] = free
  return float(np.mean(s - marks["start"]) / (steps - warmup))
