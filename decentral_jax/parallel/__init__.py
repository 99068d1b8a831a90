"""Parallel layouts: worker meshes, stacked per-worker state, ``per_worker``.

- :mod:`~decentral_jax.parallel.mesh`: ``make_mesh`` (one or ``K`` workers
  per device, or ``D`` devices per worker), ``shard``, ``per_worker``.
- :mod:`~decentral_jax.parallel.layouts`: workers of several devices
  (``fsdp`` / ``data`` placement; their bytes per worker are
  :func:`decentral_jax.analysis.traffic`).
- :mod:`~decentral_jax.parallel.multiprocess` (imported by name): the device order, process
  workers and host transfers of a multi-process run.

Imports :mod:`decentral_jax.comm` and :mod:`decentral_jax.topology`.
"""

from decentral_jax.parallel.mesh import (
    INNER, LOCAL, NODES, VIRTUAL, WORKERS, AnyMesh, VirtualMesh, check_mesh,
    device_hint, device_mesh, devices_per_worker, is_node_aware, make_mesh,
    mesh_shape, n_workers_of, per_worker, replicate, shard, unstack,
    worker_axis, worker_sharding, worker_spec, workers_per_device)
from decentral_jax.parallel.layouts import (
    WorkerLayout, batch_sharding, check_batch, check_params, inner_dim, place,
    place_batch, state_shardings, state_specs, unsplit_leaves)

__all__ = ["AnyMesh", "INNER", "LOCAL", "NODES",
           "VIRTUAL", "VirtualMesh", "WORKERS", "WorkerLayout",
           "batch_sharding", "check_batch", "check_mesh", "check_params",
           "device_hint", "device_mesh", "devices_per_worker", "inner_dim",
           "is_node_aware", "make_mesh", "mesh_shape", "n_workers_of",
           "per_worker", "place", "place_batch", "replicate", "shard",
           "state_shardings", "state_specs", "unsplit_leaves", "unstack",
           "worker_axis", "worker_sharding", "worker_spec",
           "workers_per_device"]
