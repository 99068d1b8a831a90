"""Communication: collectives over the worker axis, and gossip.

- :mod:`~decentral_jax.comm.collectives`: worker index, ``pmean``,
  ``all_gather``, ``permute`` and group means, with two-level plans for
  ``K`` vmapped workers per device.
- :mod:`~decentral_jax.comm.gossip`: ``mix`` (one round of W_k with
  ``ppermute``), ``mean``, ``consensus_distance``.
- :mod:`~decentral_jax.comm.fault_schedule`: a seeded schedule of slow and
  failing workers (NumPy); :mod:`~decentral_jax.comm.faults`: gossip over
  the live workers (``live_mix``), frozen dead workers, rejoining.

Imports :mod:`decentral_jax.topology` only.
"""
