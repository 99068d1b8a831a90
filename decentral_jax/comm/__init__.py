"""Communication: collectives over the worker axis, and gossip.

- :mod:`~decentral_jax.comm.collectives`: worker index, ``pmean``,
  ``all_gather``, ``permute`` and group means, with two-level plans for
  ``K`` vmapped workers per device
  (:mod:`~decentral_jax.comm.virtual_plans` builds those static plans).
- :mod:`~decentral_jax.comm.gossip`: ``mix`` (one round of W_k with
  ``ppermute``), ``mean``, ``consensus_distance``.
- :mod:`~decentral_jax.comm.compress`: compressed payloads (block-scaled
  formats, top-k) with error feedback, and compressed gossip;
  :mod:`~decentral_jax.comm.compressed_mean`: the compressed worker means.
- :mod:`~decentral_jax.comm.fault_schedule`: a seeded schedule of slow and
  failing workers (NumPy); :mod:`~decentral_jax.comm.faults`: gossip over
  the live workers (``live_mix``), frozen dead workers, rejoining.

Imports :mod:`decentral_jax.topology` only.
"""

from decentral_jax.comm.collectives import (
    VirtualAxes, all_gather, group_mean, index, permute, pmean, psum, size)
from decentral_jax.comm.gossip import (
    DEFAULT_BUCKET_BYTES, consensus_distance, every, map_round, mean, mix)
from decentral_jax.comm.fault_schedule import FaultSchedule, STRAGGLER_MODES
from decentral_jax.comm.faults import (
    dropped_weight, freeze, from_worker, live_mix, neighbour_mean)
from decentral_jax.comm.compress import Compressor, compress_with_feedback
from decentral_jax.comm.compressed_mean import (
    gather_mean_compressed, mean_compressed)

__all__ = ["Compressor", "DEFAULT_BUCKET_BYTES", "FaultSchedule",
           "STRAGGLER_MODES", "VirtualAxes", "all_gather",
           "compress_with_feedback", "consensus_distance", "dropped_weight",
           "every", "freeze", "from_worker", "gather_mean_compressed",
           "group_mean", "index", "live_mix", "map_round", "mean",
           "mean_compressed", "mix", "neighbour_mean", "permute", "pmean",
           "psum", "size"]
