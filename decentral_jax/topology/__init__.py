"""Topologies: periodic schedules of mixing matrices W_k, bottom layer of the library.

- :mod:`~decentral_jax.topology.schedules`: :class:`Topology` and the builders
  (``ring``, ``one_peer_exp``, ``alternating_exp_ring`` (AER), ``torus``, ...),
  re-exported here.
- :mod:`~decentral_jax.topology.rounds`: one round as a sparse ``ppermute`` plan
  and its validation (row and column sums, spectral checks).
- :mod:`~decentral_jax.topology.terms`: the permute terms and partitions a
  round is split into.
- :mod:`~decentral_jax.topology.spectral`: spectral gap and finite-time
  consensus without dense products.

Imports nothing else from the library.
"""

from decentral_jax.topology.schedules import *  # noqa: F401,F403
from decentral_jax.topology.schedules import __all__  # noqa: F401
