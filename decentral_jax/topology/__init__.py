"""Topologies: periodic schedules of mixing matrices W_k, bottom layer of the library.

- :mod:`~decentral_jax.topology.schedules`: :class:`Topology` and the builders
  (``ring``, ``one_peer_exp``, ``alternating_exp_ring`` (AER), ``torus``, ...).
- :mod:`~decentral_jax.topology.rounds`: one round as a sparse ``ppermute`` plan
  and its validation (row and column sums, spectral checks).
- :mod:`~decentral_jax.topology.terms`: the permute terms and partitions a
  round is split into.
- :mod:`~decentral_jax.topology.spectral`: spectral gap and finite-time
  consensus without dense products.

Imports nothing else from the library.
"""

from decentral_jax.topology.rounds import (
    MAX_WORKERS, Round, check_column_sums, check_n_workers)
from decentral_jax.topology.schedules import (
    NAMES, Topology, alternating_exp_ring, canonical_name, complete,
    exponential, from_matrices, from_permutations, make, one_peer_exp, ring,
    static_ring, torus)
from decentral_jax.topology.terms import Partition, PermuteTerm

__all__ = ["MAX_WORKERS", "NAMES", "Partition", "PermuteTerm", "Round",
           "Topology", "alternating_exp_ring", "canonical_name",
           "check_column_sums", "check_n_workers", "complete", "exponential",
           "from_matrices", "from_permutations", "make", "one_peer_exp",
           "ring", "static_ring", "torus"]
