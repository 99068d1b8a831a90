"""Runtime model: when, how and by how much decentralized training beats All-Reduce.

Bottom up: ``costs`` (hardware, alpha-beta collective costs) and
``workload`` (model size, buckets, compute distribution); ``method`` (the
:class:`Method` to price, its checks, :class:`Estimate`); the estimators
per kind, ``per_step_methods`` (All-Reduce, gossip) and ``local_methods``
(Local SGD / DiLoCo / Streaming DiLoCo / local D-SGD); ``specs`` (gossip
spec syntax); ``core`` (:func:`make_method`, :func:`closed_form`,
:func:`simulate`: spec parsing and the dispatch over kinds); ``traffic``
for bytes per iteration, ``compression`` for the bytes and codec time of
compressed communication, ``recommend`` for pricing methods side by side
(and the break-even bandwidth of compression), ``paper`` for the Figure 6
in-sample fit, ``holdout`` for the leave-one-cluster-out validation,
``presets`` for the named clusters and workloads, ``utilisation`` for
compute utilisation against bandwidth (Kale et al. 2025, Table 5) and
``cluster_file`` for the cluster JSON that ``measure`` writes and
``predict --cluster`` reads. The command line
(``python -m decentral_jax.runtime_model --help``), ``measure`` and
``calibrate`` are in :mod:`decentral_jax.tools.runtime_model_cli`.
"""

from __future__ import annotations

from decentral_jax.runtime_model.core import Cluster
from decentral_jax.runtime_model.core import Estimate
from decentral_jax.runtime_model.core import Method
from decentral_jax.runtime_model.core import RoundCost
from decentral_jax.runtime_model.core import Workload
from decentral_jax.runtime_model.core import all_reduce_cost
from decentral_jax.runtime_model.core import closed_form
from decentral_jax.runtime_model.core import coupling_excess
from decentral_jax.runtime_model.core import expected_max_normal
from decentral_jax.runtime_model.core import make_method
from decentral_jax.runtime_model.core import pair_exchange_time
from decentral_jax.runtime_model.core import ring_all_reduce_time
from decentral_jax.runtime_model.core import round_cost
from decentral_jax.runtime_model.core import simulate
from decentral_jax.runtime_model.core import sgp_topology
from decentral_jax.runtime_model.traffic import Traffic
from decentral_jax.runtime_model.traffic import bytes_per_iteration
