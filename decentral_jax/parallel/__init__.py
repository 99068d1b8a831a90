"""Parallel layouts: worker meshes, stacked per-worker state, ``per_worker``.

- :mod:`~decentral_jax.parallel.mesh`: ``make_mesh`` (one or ``K`` workers
  per device, or ``D`` devices per worker), ``shard``, ``per_worker``;
  re-exported here.
- :mod:`~decentral_jax.parallel.layouts`: workers of several devices
  (``fsdp`` / ``data`` placement; their bytes per worker are
  :func:`decentral_jax.analysis.traffic`).

Imports :mod:`decentral_jax.comm` and :mod:`decentral_jax.topology`.
"""

from decentral_jax.parallel.mesh import *  # noqa: F401,F403
from decentral_jax.parallel.mesh import __all__  # noqa: F401
