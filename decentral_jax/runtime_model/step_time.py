"""Per-iteration time of a method: closed_form and simulate.

Both take a method spec (anything
:func:`decentral_jax.runtime_model.specs.make_method` accepts), build the
checked :class:`~decentral_jax.runtime_model.method.Method` and dispatch on
its kind to the estimators (:data:`ESTIMATORS`: the every-step methods of
:mod:`~decentral_jax.runtime_model.per_step_methods`, the local-update
methods of :mod:`~decentral_jax.runtime_model.local_methods`). Collective
costs and the hardware (:class:`~decentral_jax.runtime_model.costs.Cluster`)
are in :mod:`decentral_jax.runtime_model.costs`, the model and its compute
(:class:`~decentral_jax.runtime_model.workload.Workload`) in
:mod:`decentral_jax.runtime_model.workload`, the method
(:class:`~decentral_jax.runtime_model.method.Method`,
:class:`~decentral_jax.runtime_model.method.Estimate`) in
:mod:`decentral_jax.runtime_model.method`.

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

from decentral_jax.runtime_model import local_methods
from decentral_jax.runtime_model import method_messages
from decentral_jax.runtime_model import per_step_methods
from decentral_jax.runtime_model.costs import Cluster
from decentral_jax.runtime_model.method import Estimate
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.workload import Workload
from decentral_jax.runtime_model.workload import check_model_arguments

# Method.kind -> the module with its ``closed_form(m, c, w)`` and
# ``simulate(m, c, w, fac, warmup)``.
ESTIMATORS = {"all_reduce": per_step_methods, "gossip": per_step_methods,
              "local": local_methods}


def closed_form(method, c: Cluster, w: Workload) -> Estimate:
  """Closed-form per-iteration time of ``method`` (no simulation).

  * All-Reduce: the DDP bucket pipeline (the recursion of :func:`simulate`)
    with forward and backward inflated by ``E[max of n] - mean`` of the
    compute distribution (``sigma E[max of n N(0,1)]``: 2.34 sigma at n =
    64, below the asymptotic ``sigma sqrt(2 ln n)`` = 2.88 sigma).
  * Gossip: per worker, ``mean_r [max(C + O, tau_r - slack_r + o_nb) +
    d_r]`` over the period, the slowest worker setting the pace. ``tau_r``
    is the worker's round time for the full parameter message (one latency
    per bucket), and ``o_nb`` the optimizer time of the last bucket. Each
    worker's collectives run in order on one stream, so ``slack_r`` (how
    long before step ``r`` the round's first bucket got onto the stream) is
    at most ``(1 - ready_1) B`` and is cut to the time the stream was idle
    after round ``r-1`` (the fixed point of the simulator's recursion with
    mean compute). ``d_r = sigma *
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

  Raises:
    ValueError: ``c`` not a ``Cluster``, ``w`` not a ``Workload``, or as
      :func:`~decentral_jax.runtime_model.specs.make_method`.
  """
  check_model_arguments(c=c, w=w)
  m = make_method(method, c)
  c_eff, w_eff = method_messages.effective(m, c, w)
  est = ESTIMATORS[m.kind].closed_form(m, c_eff, w_eff)
  inner = w_eff.optimizer_s - w.optimizer_s
  if inner <= 0:
    return est
  # Collectives inside a worker of several devices: communication, exposed.
  return dataclasses.replace(est, compute_s=est.compute_s - inner,
                             exposed_comm_s=est.exposed_comm_s + inner)


def simulate(method, c: Cluster, w: Workload, *, steps: int = 300,
             warmup: int = 60, seed: int = 0) -> float:
  """Mean per-iteration time (seconds) from a max-plus simulation.

  Per worker and step, forward and backward are drawn from the workload's
  distribution (same draws for every method with the same seed). Recursions:

  * All-Reduce (DDP): global barrier each step; bucket ``b`` reduces once
    every worker has it, after bucket ``b-1``: ``e_b = max(e_{b-1},
    max_i(F_i + ready_b B_i)) + tau_b``, ``T = max(e_nb, max_i(F_i + B_i))
    + O``.
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
    method: anything
      :func:`~decentral_jax.runtime_model.specs.make_method` accepts.
    c: cluster.
    w: workload.
    steps: simulated iterations, an int in ``(warmup,
      MAX_SIMULATED_STEPS]`` (100,000).
    warmup: iterations discarded before averaging, an int >= 0.
    seed: seed of the compute draws, an int >= 0.

  Returns:
    Mean seconds per iteration over steps ``warmup .. steps``.

  Raises:
    ValueError: an argument outside the ranges above (naming it; ``c``
      not a ``Cluster``, ``w`` not a ``Workload``); for kind "local", no
      whole schedule period between ``warmup`` and ``steps``.
  """
  check_model_arguments(c=c, w=w, steps=steps, warmup=warmup, seed=seed)
  m = make_method(method, c)
  c, w = method_messages.effective(m, c, w)
  fac = w.compute_factors(steps, c.n_workers, seed)
  return ESTIMATORS[m.kind].simulate(m, c, w, fac, warmup)
