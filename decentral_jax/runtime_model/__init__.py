"""Runtime model: when, how and by how much decentralized training beats All-Reduce.

Bottom up: ``costs`` (hardware, alpha-beta collective costs) and
``workload`` (model size, buckets, compute distribution); ``method`` (the
:class:`Method` to price, its checks, :class:`Estimate`); the estimators
per kind, ``per_step_methods`` (All-Reduce, gossip) and ``local_methods``
(Local SGD / DiLoCo / Streaming DiLoCo / local D-SGD); ``specs`` (the spec
syntax and :func:`make_method`, which turns any spec into a checked
:class:`Method`); ``step_time`` (:func:`closed_form`, :func:`simulate`:
the per-iteration time, dispatched over kinds to the estimators); ``traffic``
for bytes per iteration, ``compression`` for the bytes and codec time of
compressed communication, ``recommend`` for pricing methods side by side
(and the break-even bandwidth of compression), ``paper`` for the Figure 6
in-sample fit, ``holdout`` for the leave-one-cluster-out validation,
``presets`` for the named clusters and workloads, ``links`` for how
many collectives truly run at once on a cluster (the overlap limit of GPU
compiles), ``utilisation`` for
compute utilisation against bandwidth (Kale et al. 2025, Table 5) and
``cluster_file`` for the cluster JSON that ``measure`` writes and
``predict --cluster`` reads. The command line
(``python -m decentral_jax.runtime_model --help``), ``measure`` and
``calibrate`` are in :mod:`decentral_jax.tools.runtime_model_cli`.
"""

from decentral_jax.runtime_model.costs import (
    Cluster, RoundCost, all_reduce_cost, pair_exchange_time,
    ring_all_reduce_time, round_cost)
from decentral_jax.runtime_model.method import Estimate, Method, sgp_topology
from decentral_jax.runtime_model.specs import make_method
from decentral_jax.runtime_model.step_time import closed_form, simulate
from decentral_jax.runtime_model.traffic import Traffic, bytes_per_iteration
from decentral_jax.runtime_model.workload import (
    Workload, coupling_excess, expected_max_normal)

__all__ = ["Cluster", "Estimate", "Method", "RoundCost", "Traffic",
           "Workload", "all_reduce_cost", "bytes_per_iteration",
           "closed_form", "coupling_excess", "expected_max_normal",
           "make_method", "pair_exchange_time", "ring_all_reduce_time",
           "round_cost", "sgp_topology", "simulate"]
