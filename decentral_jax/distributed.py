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

Arrays of a multi-process job are not fully addressable from one process:
:func:`put_global` places host values that every process holds,
:func:`to_host` reads (possibly remote) results back, and
:func:`process_workers` says which workers this process feeds.

Start-up checks: :func:`initialize` refuses a coordinator port that is
already taken and ends a process whose job is not complete within the
initialization timeout with a one-line message; :func:`check_same_config`
and :func:`check_same_start` make every process of a job refuse to train
when the processes were given different configs, failed to build the run
on some host or computed different initial parameters.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
from typing import Any

from absl import logging
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from ml_collections import config_dict

from decentral_jax import validation

PyTree = Any

_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")


def cluster_env_detected() -> bool:
  """True if the usual SLURM variables of a multi-task job are present."""
  return all(v in os.environ for v in _SLURM_VARS) and \
      int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(*, coordinator_address: str = "", num_processes: int = 0,
               process_id: int = -1, heartbeat_timeout_seconds: int = 100,
               initialization_timeout_seconds: int = 120,
               cpu: bool | None = None) -> bool:
  """Joins this process to a multi-process JAX job.

  Must run before any JAX computation or ``jax.devices()`` call. Process 0
  of an explicit set-up first checks that it can bind the coordinator's
  port. Then every process waits up to ``initialization_timeout_seconds``
  for all processes to join; if the job is still incomplete by then, this
  process prints a one-line ``error: ...`` (the timeout, the coordinator
  address, the number of processes expected) to stderr and exits with
  status 2. JAX itself would abort the process from C++ a few seconds
  later with a stack trace, which Python cannot catch.

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
      address without ``num_processes``/``process_id``) or inconsistent, a
      coordinator address that is not ``host:port``, or (process 0) a
      coordinator port that another program already uses.
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
    port = coordinator_port(coordinator_address)
    if process_id == 0:
      _check_port_free(coordinator_address, port)
  elif not cluster_env_detected():
    return False
  if cpu is None:
    cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
  if cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout = int(initialization_timeout_seconds)
  kwargs = dict(heartbeat_timeout_seconds=int(heartbeat_timeout_seconds),
                initialization_timeout=timeout)
  if explicit:
    kwargs.update(coordinator_address=coordinator_address,
                  num_processes=int(num_processes), process_id=int(process_id))
  logging.info("joining a %s-process JAX job at %s (waiting up to %d s for "
               "all processes)", num_processes or "detected",
               coordinator_address or "the detected coordinator", timeout)
  _join(kwargs, timeout)
  return True


def coordinator_port(address: str) -> int:
  """The port of a ``"host:port"`` coordinator address.

  Raises:
    ValueError: ``address`` is not ``host:port`` with a port in 1..65535.
  """
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator_address={address!r} must be 'host:port' "
                     "with a port in 1..65535, e.g. '10.0.0.1:12355'.")
  return int(port)


def _check_port_free(address: str, port: int) -> None:
  """Raises ValueError if the coordinator could not bind ``port``.

  Binds what JAX's coordinator binds (every interface, IPv6 and IPv4, or
  ``JAX_COORDINATOR_BIND_ADDRESS``), with ``SO_REUSEADDR`` as gRPC sets it,
  so connections of a previous job still in TIME_WAIT do not count.
  """
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "")
  host = bind.rpartition(":")[0].strip("[]") if bind else ""
  if bind:
    port = coordinator_port(bind)
  attempts = [(socket.AF_INET6, host or "::"), (socket.AF_INET,
                                                 host or "0.0.0.0")]
  for family, addr in attempts:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
          s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((addr, port))
      return
    except OSError as e:
      if e.errno in (errno.EADDRINUSE, errno.EACCES):
        why = ("is already in use by another program" if
               e.errno == errno.EADDRINUSE else "cannot be bound (permission "
               "denied; ports below 1024 are privileged)")
        raise ValueError(
            f"coordinator_address={address!r}: port {port} on this host "
            f"(process 0 runs the coordinator) {why}; pick a free port, e.g. "
            f"{address.rpartition(':')[0]}:{_free_port_hint(port)}, and pass "
            "the same coordinator_address to every process.") from None
      # No IPv6 (or no such local address): try the next family, as gRPC
      # falls back from [::] to 0.0.0.0.


def _free_port_hint(port: int) -> int:
  """A port near ``port`` that is free now (just a suggestion)."""
  for candidate in range(port + 1, min(port + 100, 65536)):
    with socket.socket() as s:
      try:
        s.bind(("", candidate))
      except OSError:
        continue
      return candidate
  return 12355


def _join(kwargs: dict, timeout: int) -> None:
  """``jax.distributed.initialize(**kwargs)``, ended cleanly on timeout.

  JAX gives up after ``timeout`` seconds with a fatal C++ error (abort and
  stack trace) that Python cannot catch; a watchdog thread prints a
  one-line error first and exits the process (status 2).
  """
  joined = threading.Event()

  def watchdog():
    if joined.wait(timeout):
      return
    message = join_timeout_message(
        timeout, kwargs.get("coordinator_address") or _jax_state(
            "coordinator_address"),
        kwargs.get("num_processes") or _jax_state("num_processes"),
        kwargs.get("process_id", _jax_state("process_id")))
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(2)  # pylint: disable=protected-access

  threading.Thread(target=watchdog, name="distributed-init-watchdog",
                   daemon=True).start()
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    joined.set()


def _jax_state(name: str):
  """A field of JAX's distributed state (set before the join), or None."""
  try:
    # pylint: disable-next=import-outside-toplevel
    from jax._src import distributed as jax_distributed
    return getattr(jax_distributed.global_state, name, None)
  except ImportError:
    return None


def join_timeout_message(timeout: int, address: str | None,
                         num_processes: int | None,
                         process_id: int | None) -> str:
  """The one-line message of a job that did not assemble in time."""
  where = address or "the detected coordinator"
  within = f"within initialization_timeout_seconds={timeout}"
  if process_id is not None and int(process_id) >= 0:
    within += f" (this is process {process_id})"
  if num_processes:
    head = (f"the job at {where} expected {num_processes} processes, but not "
            f"all of them joined {within}")
    last = f"0..{int(num_processes) - 1}"
  else:
    head = f"the job at {where} was not complete {within}"
    last = "0, 1, ..."
  return (
      f"{head}; start the same command on every host with process_id "
      f"{last}, make sure process 0 runs and its address is reachable from "
      "every host, or raise "
      "--config.distributed.initialization_timeout_seconds.")


def is_main_process() -> bool:
  """True on process 0 (the one that logs, plots and shows progress)."""
  return jax.process_index() == 0


def ordered_devices() -> list:
  """All devices ordered by (process index, device id): worker order."""
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def _device_counts() -> dict[int, int]:
  """Process index -> number of its devices."""
  counts = {}
  for d in jax.devices():
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  return counts


def host_local_size() -> int:
  """Devices (workers) per process; raises if processes differ."""
  counts = _device_counts()
  sizes = set(counts.values())
  if len(sizes) != 1:
    raise ValueError(f"processes have different device counts {counts}; "
                     "node-aware topologies need the same number per host.")
  return sizes.pop()


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


def initialize_from_config(config: config_dict.ConfigDict) -> bool:
  """Joins a multi-process job as ``config.distributed`` asks, if it asks.

  Must run before anything touches JAX devices (``experiments/train.py``
  calls it first). With ``config.distributed.enabled`` and
  ``coordinator_address``, ``num_processes`` and ``process_id`` set, this
  process joins that job; with the three left empty (``""``, 0, -1) they
  are detected from SLURM (``srun``; with one task per node each process
  uses all GPUs of its node, otherwise JAX gives each task one GPU). A job
  step started by ``srun`` with more than one task also joins automatically
  when ``enabled`` is False (every task would otherwise train alone). On CPU
  (``JAX_PLATFORMS=cpu``) JAX's gloo collectives are used, so several
  processes on one machine form one job.

  Args:
    config: a run config; reads ``config.distributed``.

  Returns:
    True if this process joined a multi-process job, False for a
    single-process run.

  Raises:
    ValueError: a bad ``config.distributed`` field, an incomplete explicit
      set-up, ``enabled`` without coordinator fields outside SLURM, or (on
      process 0) a coordinator port that is already in use. A job that is
      not complete within ``initialization_timeout_seconds`` ends this
      process with a one-line error (see :func:`initialize`).
  """
  validation.check_distributed(config)
  d = config.distributed
  explicit = bool(d.coordinator_address) or int(d.num_processes) > 0 or \
      int(d.process_id) >= 0
  auto = cluster_env_detected() and \
      int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1
  if not (d.enabled or auto):
    return False
  if d.enabled and not explicit and not cluster_env_detected():
    raise ValueError(
        "config.distributed.enabled=True but no SLURM job with several tasks "
        "was found to detect the set-up from; set --config.distributed."
        "coordinator_address=HOST:PORT, --config.distributed.num_processes=N "
        "and --config.distributed.process_id=I (0 on the coordinator's host).")
  try:
    joined = initialize(
        coordinator_address=str(d.coordinator_address),
        num_processes=int(d.num_processes), process_id=int(d.process_id),
        heartbeat_timeout_seconds=int(d.heartbeat_timeout_seconds),
        initialization_timeout_seconds=int(d.initialization_timeout_seconds))
  except ValueError as e:
    raise ValueError(f"config.distributed: {e}") from None
  if joined and not explicit and _slurm_one_task_per_node():
    # JAX's SLURM detection shows each process only the GPU numbered
    # SLURM_LOCALID (its one-process-per-GPU convention); with one task per
    # node the process drives every GPU of its node.
    jax.config.update("jax_cuda_visible_devices", "all")
    jax.config.update("jax_rocm_visible_devices", "all")
  return joined


def _slurm_one_task_per_node() -> bool:
  """True if SLURM runs one task on every node of this step (or job)."""
  spec = (os.environ.get("SLURM_STEP_TASKS_PER_NODE")
          or os.environ.get("SLURM_TASKS_PER_NODE") or "")
  counts = [part.split("(")[0] for part in spec.split(",") if part]
  return bool(counts) and all(c.strip() == "1" for c in counts)


def process_workers(mesh: jax.sharding.Mesh) -> np.ndarray:
  """This process's workers (int64 [k]) on a one-worker-per-device mesh.

  All workers in a single-process run. In a multi-process job they must be
  consecutive (worker ``i`` on process ``i // local_device_count``), which
  :func:`ordered_devices` guarantees.

  Raises:
    ValueError: a multi-process mesh whose workers on this process are not
      consecutive.
  """
  me = jax.process_index()
  workers = np.array([i for i, d in enumerate(mesh.devices.flat)
                      if d.process_index == me], np.int64)
  if jax.process_count() > 1 and (
      workers.size == 0 or
      np.any(workers != np.arange(workers[0], workers[0] + workers.size))):
    raise ValueError(
        "each process's workers must be consecutive (worker i on process "
        "i // local_device_count); pass devices=None to use "
        "decentral_jax.distributed.ordered_devices().")
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


# ----------------------------------------------------------------------------
# Start-up agreement of the processes of a job.
# ----------------------------------------------------------------------------

# Fields that may differ between the processes of one job: how each process
# joins (its process_id, timeouts, auto-detection on some hosts only), and
# config.workdir, which --workdir overrides and whose mount point may differ
# per host (that all hosts share the directory is not checked here).
PER_PROCESS_FIELDS = ("distributed", "workdir")
# Initial parameters agree if their sums and absolute sums (float64) differ
# by at most this fraction of the absolute sum: hosts whose CPUs round a
# transcendental function differently still agree, another seed does not.
INIT_RTOL = 1e-6
_MAX_LISTED = 6


def config_fields(config: config_dict.ConfigDict) -> dict[str, str]:
  """The compared fields of a config: dotted name -> canonical JSON value.

  Groups are flattened (``"schedule.peak_lr"``); the fields of
  :data:`PER_PROCESS_FIELDS` are left out.
  """
  tree = json.loads(config.to_json_best_effort(sort_keys=True))
  out = {}

  def walk(prefix, node):
    for key, value in node.items():
      name = f"{prefix}{key}"
      if isinstance(value, dict) and value:
        walk(name + ".", value)
      else:
        out[name] = json.dumps(value, sort_keys=True)

  walk("", {k: v for k, v in tree.items() if k not in PER_PROCESS_FIELDS})
  return out


def _short(value: str | None) -> str:
  if value is None:
    return "<missing>"
  return value if len(value) <= 40 else value[:37] + "..."


def _listed(items: list[str]) -> str:
  more = len(items) - _MAX_LISTED
  return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0
                                           else "")


def config_differences(fields: list[dict[str, str]]) -> str:
  """Names the fields that differ between processes; "" if none do.

  Args:
    fields: :func:`config_fields` of every process, in process order.

  Returns:
    A one-line description: each differing field with process 0's value and
    the first differing process's value, e.g.
    ``seed (process 0: 0, process 1: 1)``.
  """
  names = sorted(set().union(*fields))
  parts = []
  for name in names:
    values = [f.get(name) for f in fields]
    others = [p for p, v in enumerate(values) if v != values[0]]
    if others:
      p = others[0]
      more = (f"; {len(others)} processes differ from process 0"
              if len(others) > 1 else "")
      parts.append(f"{name} (process 0: {_short(values[0])}, process {p}: "
                   f"{_short(values[p])}{more})")
  return _listed(parts)


def init_fingerprint(params: PyTree) -> dict[str, list]:
  """Leaf path -> ``[dtype, shape, sum, sum of |x|]`` (sums in float64)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    x = np.asarray(leaf)
    out[jax.tree_util.keystr(path)] = [
        str(x.dtype), list(x.shape), float(x.sum(dtype=np.float64)),
        float(np.abs(x).sum(dtype=np.float64))]
  return out


def init_differences(prints: list[dict[str, list]]) -> str:
  """Names the parameter leaves whose fingerprints differ; "" if none do.

  Args:
    prints: :func:`init_fingerprint` of every process, in process order.

  Returns:
    A one-line description, e.g. ``process 1 differs from process 0 in 2
    of 9 leaves: ['wpe']['embedding'], ['wte']['embedding']``.
  """
  def same(a, b):
    if a is None or b is None or a[:2] != b[:2]:
      return False
    tol = INIT_RTOL * max(a[3], b[3])
    return abs(a[2] - b[2]) <= tol and abs(a[3] - b[3]) <= tol

  names = sorted(set().union(*prints))
  for p, fp in enumerate(prints[1:], start=1):
    bad = [n for n in names if not same(fp.get(n), prints[0].get(n))]
    if bad:
      return (f"process {p} differs from process 0 in {len(bad)} of "
              f"{len(names)} leaves: {_listed(bad)}")
  return ""


def _allgather_json(obj) -> list:
  """``obj`` of every process (JSON-serialisable), in process order.

  A collective: every process must call it, in the same order.

  Raises:
    ValueError: the processes have different numbers of devices (the
      exchange needs the same number on each).
  """
  counts = _device_counts()
  if len(set(counts.values())) > 1:
    raise ValueError(
        f"the processes of this job have different numbers of devices "
        f"{counts} (process: devices); every process must drive as many "
        "devices as the others (the same GPUs per host, or the same "
        "--cpu_devices).")
  data = json.dumps(obj, sort_keys=True).encode()
  lengths = multihost_utils.process_allgather(
      np.array([len(data)], np.int32))
  # Whole 4 KiB blocks: the same shape (one compiled gather) for most calls.
  size = -(-int(np.max(lengths)) // 4096) * 4096
  buf = np.zeros(size, np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  rows = multihost_utils.process_allgather(buf.view(np.int32))
  return [json.loads(np.asarray(row, np.int32).tobytes()[:int(n)])
          for row, n in zip(rows, np.asarray(lengths).reshape(-1))]


def check_same_config(config: config_dict.ConfigDict) -> None:
  """Refuses to start a job whose processes were given different configs.

  A collective: every process of a multi-process job calls it (the
  :class:`~decentral_jax.experiment.Experiment` does, before validating the
  config) and every process raises the same error, so none is left waiting
  in a collective. Does nothing in a single-process run. The fields of
  :data:`PER_PROCESS_FIELDS` are not compared.

  Raises:
    ValueError: some field differs between processes (named, with process
      0's and the differing process's values).
  """
  if jax.process_count() == 1:
    return
  diff = config_differences(_allgather_json(config_fields(config)))
  if diff:
    raise ValueError(
        f"the {jax.process_count()} processes of this job have different "
        f"configs: {diff}; start every process with the same config file and"
        " --config overrides (only config.distributed and --workdir may "
        "differ).")


def check_same_start(params: PyTree | None,
                     error: BaseException | None = None) -> None:
  """Refuses to train when a process failed to start or params differ.

  A collective, called by every process of a multi-process job once its
  task and initial parameters are built (or building them failed with
  ``error``): the processes exchange their error, if any, or a fingerprint
  of their initial parameters (:func:`init_fingerprint`), and all of them
  raise if one failed or if the fingerprints differ (to within
  :data:`INIT_RTOL`). Does nothing in a single-process run except
  re-raising ``error``.

  Args:
    params: this process's host copy of the initial parameters (None if
      ``error``).
    error: the exception that building them raised on this process.

  Raises:
    BaseException: ``error`` itself, on the process where it happened.
    ValueError: on the other processes, naming the process that failed and
      its message; on every process, when the initial parameters differ
      (the leaves are named).
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  mine = ({"error": f"{type(error).__name__}: {error}".splitlines()[0]}
          if error is not None else
          {"params": init_fingerprint(params), "jax": jax.__version__})
  everyone = _allgather_json(mine)
  if error is not None:
    raise error
  failed = [p for p, m in enumerate(everyone) if "error" in m]
  if failed:
    raise ValueError(
        f"process {failed[0]} of this job could not start "
        f"({everyone[failed[0]]['error']})"
        + (f"; {len(failed)} processes failed" if len(failed) > 1 else "")
        + "; fix it on that host and restart every process.")
  diff = init_differences([m["params"] for m in everyone])
  if diff:
    versions = sorted({m["jax"] for m in everyone})
    raise ValueError(
        "the processes of this job computed different initial parameters "
        f"from the same config ({diff}); every host must run the same JAX and "
        "decentral_jax versions with the same PRNG settings "
        "(jax_default_prng_impl, jax_threefry_partitionable); JAX versions "
        f"in this job: {', '.join(versions)}.")

