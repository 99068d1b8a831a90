"""Arrays and devices of a multi-process job.

Worker ``i`` lives on process ``i // local_device_count``
(:func:`ordered_devices`); :func:`host_local_size` gives the number of
workers per process, so that AER's nodes are the hosts. Arrays of a
multi-process job are not fully addressable from one process:
:func:`put_global` places host values that every process holds,
:func:`to_host` reads (possibly remote) results back, and
:func:`process_workers` says which workers this process feeds. Joining the
job is the runner's (:mod:`decentral_jax.runner.launch`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from decentral_jax import checks

PyTree = Any


def is_main_process() -> bool:
  """True on process 0 (the one that logs, plots and shows progress)."""
  return jax.process_index() == 0


def ordered_devices() -> list:
  """All devices ordered by (process index, device id): worker order."""
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def device_counts() -> dict[int, int]:
  """Process index -> number of its devices."""
  counts = {}
  for d in jax.devices():
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  return counts


def host_local_size() -> int:
  """Devices (workers) per process; raises if processes differ."""
  counts = device_counts()
  sizes = set(counts.values())
  if len(sizes) != 1:
    raise ValueError(f"processes have different device counts {counts}; "
                     "node-aware topologies need the same number per host.")
  return sizes.pop()


def check_node_layout(n_workers: int, workers_per_node: int) -> None:
  """Checks that nodes of ``workers_per_node`` workers coincide with processes.

  Raises:
    ValueError: ``n_workers`` or ``workers_per_node`` not an int >= 1; in a
      multi-process job, when ``workers_per_node`` differs from the number
      of devices per process (the message gives both numbers).
  """
  checks.check_int("n_workers", n_workers, minimum=1)
  checks.check_int("workers_per_node", workers_per_node, minimum=1)
  if jax.process_count() == 1:
    return
  per_host = host_local_size()
  if workers_per_node != per_host:
    raise ValueError(
        f"workers_per_node={workers_per_node} but each of the "
        f"{jax.process_count()} processes has {per_host} devices; node-aware "
        f"topologies put one node on each host: set "
        f"--config.workers_per_node={per_host}.")


def process_workers(mesh: jax.sharding.Mesh) -> np.ndarray:
  """This process's workers (int64 [k]).

  All workers in a single-process run. In a multi-process job they must be
  consecutive (worker ``i`` on process ``i // workers_per_process``), which
  :func:`ordered_devices` guarantees, and each worker's devices (the
  ``"inner"`` axis of a mesh whose workers span several devices) must
  belong to one process.

  Raises:
    ValueError: a multi-process mesh whose workers on this process are not
      consecutive, or a worker whose devices lie on two processes.
  """
  me = jax.process_index()
  devices = mesh.devices
  if "inner" in mesh.axis_names:  # one row of devices per worker
    devices = np.moveaxis(devices, mesh.axis_names.index("inner"), -1)
  per_worker = devices.reshape(-1, devices.shape[-1] if
                               "inner" in mesh.axis_names else 1)
  owners = [{d.process_index for d in row} for row in per_worker]
  split = [i for i, o in enumerate(owners) if len(o) > 1]
  if split:
    raise ValueError(
        f"worker {split[0]} spans devices of processes {sorted(owners[split[0]])}"
        "; a worker's devices must be on one host (make devices_per_worker "
        "divide each process's device count).")
  workers = np.array([i for i, o in enumerate(owners) if me in o], np.int64)
  if jax.process_count() > 1 and (
      workers.size == 0 or
      np.any(workers != np.arange(workers[0], workers[0] + workers.size))):
    raise ValueError(
        "each process's workers must be consecutive (worker i on process "
        "i // local_device_count); pass devices=None to use "
        "decentral_jax.parallel.multiprocess.ordered_devices().")
  return workers


def put_global(tree: PyTree, sharding: NamedSharding) -> PyTree:
  """Places host values that are equal on every process with ``sharding``.

  Single process: ``jax.device_put``. Multi-process: each process fills its
  own devices' shards from its copy (no cross-process traffic, no equality
  check).

  Args:
    tree: pytree of host arrays, the same on every process.
    sharding: the target sharding (of the job-wide mesh).

  Returns:
    A pytree of global ``jax.Array`` with the shapes and dtypes of ``tree``.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(one, tree)


def to_host(tree: PyTree) -> PyTree:
  """NumPy values of (possibly multi-process) arrays; every process calls it.

  In a multi-process job the arrays are not fully addressable: replicated
  ones are read from a local device, others are gathered with
  ``multihost_utils.process_allgather`` (a collective, so all processes must
  call this in the same order).
  """
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def one(x):
    if x.sharding.is_fully_replicated:  # e.g. the train step's metrics
      return np.asarray(x.addressable_data(0))
    return multihost_utils.process_allgather(x, tiled=True)

  return jax.tree.map(one, tree)
