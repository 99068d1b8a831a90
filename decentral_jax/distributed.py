"""Multi-host start-up through JAX's multi-controller runtime.

One process per host (or per group of devices) calls :func:`initialize`
before anything touches devices; afterwards ``jax.devices()`` lists every
process's devices and one mesh spans them all. On SLURM the coordinator,
process count and ids are detected by ``jax.distributed.initialize()``
itself; elsewhere pass them explicitly. On CPU, JAX's gloo collectives let
several processes on one machine form one job (used by the tests).

Node-aware topologies follow the physical layout: worker ``i`` lives on
process ``i // local_device_count``; :func:`host_local_size` gives the
number of workers per process so that AER's nodes are the hosts.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np

_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")


def cluster_env_detected() -> bool:
  """True if the usual SLURM variables of a multi-task job are present."""
  return all(v in os.environ for v in _SLURM_VARS) and \
      int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(*, coordinator_address: str = "", num_processes: int = 0,
               process_id: int = -1, heartbeat_timeout_seconds: int = 100,
               initialization_timeout_seconds: int = 300,
               cpu: bool | None = None) -> bool:
  """Joins this process to a multi-process JAX job.

  Must run before any JAX computation or ``jax.devices()`` call.

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator; empty to
      let JAX auto-detect (SLURM, Open MPI, ...).
    num_processes: number of processes; 0 to auto-detect.
    process_id: this process's index in ``[0, num_processes)``; -1 to
      auto-detect.
    heartbeat_timeout_seconds: seconds after which a silent (dead) process
      is declared failed and the others stop with an error instead of
      hanging.
    initialization_timeout_seconds: seconds to wait for all processes to join.
    cpu: use gloo CPU collectives (several processes on one machine). Default:
      True when ``JAX_PLATFORMS`` is ``cpu``.

  Returns:
    True if a multi-process job was initialised, False if there is nothing to
    do (single process, no cluster environment).

  Raises:
    ValueError: an explicit set-up that is incomplete (e.g. a coordinator
      address without ``num_processes``/``process_id``) or inconsistent.
  """
  explicit = bool(coordinator_address) or num_processes > 0 or process_id >= 0
  if explicit:
    missing = [name for name, bad in (
        ("coordinator_address", not coordinator_address),
        ("num_processes", num_processes <= 0),
        ("process_id", process_id < 0)) if bad]
    if missing:
      raise ValueError(
          "distributed start-up needs coordinator_address, num_processes and "
          f"process_id together; missing: {', '.join(missing)} (or set none "
          "of them to auto-detect on SLURM).")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must be in [0, "
                       f"{num_processes}).")
  elif not cluster_env_detected():
    return False
  if cpu is None:
    cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
  if cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(heartbeat_timeout_seconds=int(heartbeat_timeout_seconds),
                initialization_timeout=int(initialization_timeout_seconds))
  if explicit:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=int(num_processes),
                               process_id=int(process_id), **kwargs)
  else:
    jax.distributed.initialize(**kwargs)
  return True


def is_main_process() -> bool:
  """True on process 0 (the one that logs, plots and shows progress)."""
  return jax.process_index() == 0


def ordered_devices() -> list:
  """All devices ordered by (process index, device id): worker order."""
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def host_local_size() -> int:
  """Devices (workers) per process; raises if processes differ."""
  counts = {}
  for d in jax.devices():
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  sizes = set(counts.values())
  if len(sizes) != 1:
    raise ValueError(f"processes have different device counts {counts}; "
                     "node-aware topologies need the same number per host.")
  return sizes.pop()


def local_workers(n_workers: int) -> np.ndarray:
  """Indices of the workers whose devices belong to this process (int64 [k])."""
  devices = ordered_devices()[:n_workers]
  me = jax.process_index()
  return np.array([i for i, d in enumerate(devices) if d.process_index == me],
                  dtype=np.int64)


def check_node_layout(n_workers: int, workers_per_node: int) -> None:
  """Checks that nodes of ``workers_per_node`` workers coincide with processes.

  Raises:
    ValueError: in a multi-process job, when ``workers_per_node`` differs from
      the number of devices per process (the message gives both numbers).
  """
  if jax.process_count() == 1:
    return
  per_host = host_local_size()
  if workers_per_node != per_host:
    raise ValueError(
        f"workers_per_node={workers_per_node} but each of the "
        f"{jax.process_count()} processes has {per_host} devices; node-aware "
        f"topologies put one node on each host: set "
        f"--config.workers_per_node={per_host}.")


def global_batch_from_local(local: np.ndarray, mesh, spec,
                            global_shape: Sequence[int]) -> jax.Array:
  """Assembles a global ``[n_workers, ...]`` array from this process's rows.

  Args:
    local: this process's rows (its workers, in worker order), NumPy.
    mesh: the worker mesh; spec: its ``PartitionSpec``.
    global_shape: the global shape ``[n_workers, ...]``.
  """
  sharding = jax.sharding.NamedSharding(mesh, spec)
  return jax.make_array_from_process_local_data(sharding, local,
                                                tuple(global_shape))
