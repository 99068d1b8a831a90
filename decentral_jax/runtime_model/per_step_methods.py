"""Methods that communicate every step: All-Reduce and gossip (kinds "all_reduce", "gossip").

The estimators behind :func:`decentral_jax.runtime_model.step_time.closed_form`
and :func:`~decentral_jax.runtime_model.step_time.simulate` for data-parallel
training with All-Reduce of gradients (PyTorch-DDP style: bucketed,
overlapped with the backward only) and with gossip of parameters
(Decent-DP style: per bucket, overlapped with the whole next forward and
backward; SGP: blocking, after the step; with ``Workload.gossip_in_flight``
only behind the part of the step the compiled program overlaps,
:mod:`~decentral_jax.runtime_model.in_flight`). Both take the worker-level
cluster and workload (:func:`decentral_jax.runtime_model.method_messages.effective`
applied) and a checked :class:`~decentral_jax.runtime_model.method.Method`.
The recursions and closed forms are stated in ``step_time``'s docstrings.

Units: seconds, bytes.

References:
  Wang, Zhang, Wu, Johansson, From Promise to Practice: Realizing
  High-performance Decentralized Training, ICLR 2025 (Sec. 4 / App. A.5).
  Assran et al., Stochastic Gradient Push for Distributed Deep Learning,
  ICML 2019.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from decentral_jax.runtime_model import in_flight
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.costs import RoundCost
from decentral_jax.runtime_model.costs import all_reduce_cost
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.method import Method
from decentral_jax.runtime_model.method import split_compute
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import coupling_excess


def all_reduce_bucket_times(m: Method, c: Cluster, w: Workload
                            ) -> tuple[np.ndarray, np.ndarray]:
  """Per-bucket All-Reduce seconds and ready fractions of the backward.

  ``m.measured_s[0]`` (the whole gradient) is split over the buckets in
  proportion to their bytes; else the alpha-beta cost of
  :func:`~decentral_jax.runtime_model.costs.all_reduce_cost`. Without
  ``m.overlap``, one bucket of the summed time, ready at the end of the
  backward.

  Returns:
    ``(taus, ready)``: float64 [nb] seconds, float64 [nb] fractions.
  """
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
  fwd, bwd = split_compute(w)
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


# ---------------------------------------------------------------------------
# Closed forms.
# ---------------------------------------------------------------------------


def closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """Closed-form per-iteration time of a kind "all_reduce" or "gossip" method.

  See :func:`decentral_jax.runtime_model.step_time.closed_form` for the
  formulas; ``c`` and ``w`` are the worker-level pair.
  """
  if m.kind == "all_reduce":
    return _all_reduce_closed_form(m, c, w)
  if m.overlap and w.gossip_in_flight is not None:
    return in_flight.closed_form(m, c, w)
  return _gossip_closed_form(m, c, w)


def _all_reduce_closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """The DDP pipeline with compute inflated by ``E[max of n] - mean``."""
  fwd, bwd = split_compute(w)
  comp = fwd + bwd
  base = comp + w.optimizer_s
  taus, ready = all_reduce_bucket_times(m, c, w)
  det = float(_all_reduce_iteration(np.array([fwd]), np.array([bwd]),
                                    w.optimizer_s, taus, ready))
  scale = 1.0 + w.expected_max_excess(c.n_workers) / max(comp, 1e-300)
  tot = float(_all_reduce_iteration(np.array([fwd * scale]),
                                    np.array([bwd * scale]),
                                    w.optimizer_s, taus, ready))
  return Estimate(m.name, tot, base, det - base, tot - det)


def _group_sizes(rc: RoundCost) -> np.ndarray:
  """Distinct members of each worker's group in round ``rc``, int [n]."""
  return np.array([len(set(row)) for row in rc.members.tolist()])


def _gossip_closed_form(m: Method, c: Cluster, w: Workload) -> Estimate:
  """Per worker, the mean over the period of step time plus expected wait."""
  fwd, bwd = split_compute(w)
  base = fwd + bwd + w.optimizer_s
  sigma = w.compute_std_s
  costs = m.round_costs(c, w)
  det = np.zeros(c.n_workers)
  tot = np.zeros(c.n_workers)
  if not m.overlap:
    for rc in costs:
      tau = rc.time(w.param_bytes)
      d = np.array([sigma * coupling_excess(int(s), 0.0)
                    for s in _group_sizes(rc)])
      det += base + tau
      tot += base + tau + d
  else:
    sizes, _ = w.buckets(w.param_bytes)
    o_last = w.optimizer_s * sizes[-1] / max(sizes.sum(), 1e-300)
    for rc, eff in zip(costs, _stream_windows(costs, w)):
      step = np.maximum(base, eff + o_last)
      hidden = np.abs(base - eff - o_last) / max(sigma, 1e-300)
      d = np.array([sigma * coupling_excess(int(s), h) if sigma > 0 else 0.0
                    for s, h in zip(_group_sizes(rc), hidden)])
      det += step
      tot += step + d
  det_s, tot_s = det.max() / len(costs), tot.max() / len(costs)
  return Estimate(m.name, float(tot_s), base, float(max(det_s - base, 0.0)),
                  float(tot_s - det_s))


# ---------------------------------------------------------------------------
# Simulators.
# ---------------------------------------------------------------------------


def simulate(m: Method, c: Cluster, w: Workload, fac: np.ndarray,
             warmup: int) -> float:
  """Mean seconds per iteration of a kind "all_reduce" or "gossip" method.

  Args:
    m: a checked method of kind "all_reduce" or "gossip".
    c, w: the worker-level cluster and workload.
    fac: compute multipliers float64 [steps, n] (``Workload.compute_factors``).
    warmup: steps discarded before averaging (``0 <= warmup < steps``).

  Returns:
    Mean seconds per iteration over steps ``warmup .. steps`` (recursions in
    :func:`decentral_jax.runtime_model.step_time.simulate`).
  """
  fwd_m, bwd_m = split_compute(w)
  fwd, bwd = fwd_m * fac, bwd_m * fac
  if m.kind == "all_reduce":
    taus, ready = all_reduce_bucket_times(m, c, w)
    return float(_all_reduce_iteration(fwd, bwd, w.optimizer_s, taus,
                                       ready)[warmup:].mean())
  if not m.overlap:
    return _simulate_blocking_gossip(m, c, w, fwd, bwd, warmup)
  if w.gossip_in_flight is not None:
    return in_flight.simulate(m, c, w, fwd, bwd, warmup)
  return _simulate_overlapped_gossip(m, c, w, fwd, bwd, warmup)


def _simulate_blocking_gossip(m: Method, c: Cluster, w: Workload, fwd, bwd,
                              warmup: int) -> float:
  """SGP: post after the step, next step after receiving the group's message."""
  costs = m.round_costs(c, w)
  period = len(costs)
  steps = fwd.shape[0]
  taus = [rc.time(w.param_bytes) for rc in costs]
  s = np.zeros(c.n_workers)
  start = s
  for k in range(steps):
    if k == warmup:
      start = s.copy()
    post = s + fwd[k] + bwd[k] + w.optimizer_s
    rc = costs[(k + 1) % period]
    s = post[rc.members].max(axis=1) + taus[(k + 1) % period]
  return float(np.mean(s - start) / (steps - warmup))


def _simulate_overlapped_gossip(m: Method, c: Cluster, w: Workload, fwd, bwd,
                                warmup: int) -> float:
  """Decent-DP: per-bucket gossip overlapped with the next forward/backward."""
  costs = m.round_costs(c, w)
  period = len(costs)
  steps = fwd.shape[0]
  sizes, ready = w.buckets(w.param_bytes)
  d_ready = np.diff(ready, prepend=0.0)
  opt_b = w.optimizer_s * sizes / max(sizes.sum(), 1e-300)
  taus = [rc.latency_s[:, None] + rc.s_per_byte[:, None] * sizes for rc in costs]
  s = np.zeros(c.n_workers)
  start = s
  wait = np.full((c.n_workers, len(sizes)), -np.inf)
  for k in range(steps):
    if k == warmup:
      start = s.copy()
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
  return float(np.mean(s - start) / (steps - warmup))
