"""Runtime model: when, how and by how much decentralized training beats All-Reduce.

See :mod:`decentral_jax.runtime_model.core` for the model (hardware and
collective costs in ``costs``, model and compute in ``workload``),
``local_updates`` for Local SGD / DiLoCo / Streaming DiLoCo / local D-SGD,
``traffic`` for bytes per iteration, ``paper`` for the Figure 6 in-sample
fit, ``holdout`` for the leave-one-cluster-out validation, ``measure`` and
``cluster_file`` for calibrating on a cluster (``measure`` writes the
cluster JSON that ``predict --cluster`` reads), ``calibrate`` for measuring a
config on this machine and ``python -m decentral_jax.runtime_model --help``
for the command line.
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
