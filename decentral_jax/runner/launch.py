"""Multi-host start-up through JAX's multi-controller runtime.

One process per host (or per group of devices) calls :func:`initialize`
before anything touches devices; afterwards ``jax.devices()`` lists every
process's devices and one mesh spans them all. On SLURM the coordinator,
process count and ids are detected by ``jax.distributed.initialize()``
itself; elsewhere pass them explicitly. On CPU, JAX's gloo collectives let
several processes on one machine form one job (used by the tests).

Worker order, the devices of each process and arrays across processes are
in :mod:`decentral_jax.parallel.multiprocess`.

Start-up checks: :func:`initialize` refuses a coordinator port that is
already taken and ends a process whose job is not complete within the
initialization timeout with a one-line message. That the processes agree
on the run itself is checked by :mod:`decentral_jax.runner.agreement`.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from typing import Any

from absl import logging
import jax
from ml_collections import config_dict

from decentral_jax import checks
from decentral_jax.runner import devices

PyTree = Any

cluster_env_detected = devices.cluster_env_detected


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
    ValueError: ``address`` is not ``host:port`` with a port in 1..65535
      and a hostname, IPv4 address or bracketed IPv6 address as the host.
  """
  got = checks.host_port(address)
  if got is None:
    raise ValueError(f"coordinator_address={address!r} must be 'host:port' "
                     "with a port in 1..65535 and the host a hostname, an "
                     "IPv4 address or [IPv6], e.g. '10.0.0.1:12355'.")
  return got[1]


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
  devices.check_distributed(config)
  d = config.distributed
  explicit = bool(d.coordinator_address) or int(d.num_processes) > 0 or \
      int(d.process_id) >= 0
  auto = devices.srun_step_detected()
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
