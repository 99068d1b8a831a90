"""Device and process counts of a run config.

:func:`devices_needed` counts the devices a run needs,
:func:`check_simulated_devices` bounds the CPU devices an entry point
simulates, :func:`check_asked_devices` refuses a ``--cpu_devices`` below
what the config needs and :func:`check_distributed` checks the ``distributed`` group
alone (before a multi-process job is joined).
"""

from __future__ import annotations

import os

import numpy as np
from ml_collections import config_dict

from decentral_jax import checks
from decentral_jax.runner.config import MAX_SIMULATED_CPU_DEVICES
from decentral_jax.runner.config_groups import distributed_group
from decentral_jax.runner.field_rules import field

_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")


def cluster_env_detected() -> bool:
  """True if the usual SLURM variables of a multi-task job are present."""
  return all(v in os.environ for v in _SLURM_VARS) and \
      int(os.environ.get("SLURM_NTASKS", "1")) > 1


def srun_step_detected() -> bool:
  """True inside an ``srun`` step with several tasks: the job is joined
  even with ``config.distributed.enabled=False``."""
  return cluster_env_detected() and \
      int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def _int_field(config, name: str, minimum: int) -> int:
  value = field(config, name)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < minimum:
    raise ValueError(f"config.{name} must be an integer >= {minimum}, got "
                     f"{value!r}; set --config.{name}=<int>.")
  return int(value)



def devices_needed(c: config_dict.ConfigDict) -> tuple[int, str]:
  """Devices a (validated) config runs on, and the fields that set it.

  ``n_workers x devices_per_worker / workers_per_device`` (all processes
  together).
  """
  n, d, k = (int(c.n_workers), int(c.devices_per_worker),
             int(c.workers_per_device))
  source = f"config.n_workers={n}"
  if d > 1:
    source += f" x config.devices_per_worker={d}"
  if k > 1:
    source += f" / config.workers_per_device={k}"
  return n * d // k, source


def check_simulated_devices(n: int, source: str) -> int:
  """Refuses to simulate more than ``MAX_SIMULATED_CPU_DEVICES`` CPU devices.

  Args:
    n: CPU devices an entry point is about to ask JAX for (per process).
    source: the setting that asks for them, for the message (e.g.
      ``"config.n_workers=2048"``, ``"--cpu_devices=2048"``).

  Returns:
    ``n``.

  Raises:
    ValueError: ``n`` above the limit, which the environment variables
      share (says how to lower it: ``config.workers_per_device`` > 1, or
      real devices).
  """
  if n > MAX_SIMULATED_CPU_DEVICES:
    raise ValueError(
        f"{source} asks for {n} simulated CPU devices in this process, more "
        f"than the {MAX_SIMULATED_CPU_DEVICES} the entry points simulate "
        "(start-up time and memory grow with the count; JAX_NUM_CPU_DEVICES "
        "and XLA_FLAGS' device count have the same limit); lower it (config."
        "workers_per_device > 1 puts several workers on one device), or run "
        "on that many real devices.")
  return n


def check_asked_devices(asked: int, available: int, needed: int,
                        source: str, flag: str = "--cpu_devices") -> None:
  """Refuses a device-count flag that set the limit a run hits: ``flag=
  asked`` made the CPU backend simulate ``available`` devices in this
  process, fewer than the ``needed`` per process that ``source`` (e.g.
  ``"--config.n_workers=8"``) asks for.

  Raises:
    ValueError: naming ``flag`` and the count to raise it to (or 0, as
      many as the config needs).
  """
  if asked and available < needed:
    raise ValueError(
        f"{flag}={asked} simulates {available} CPU devices in this process, "
        f"but {source} needs {needed}; raise {flag} to {needed} or drop it "
        "(0: as many as the config needs).")


def environment_cpu_devices() -> int | None:
  """The CPU device count the environment sets, or None if it sets none:
  ``JAX_NUM_CPU_DEVICES``, else (JAX reads that variable over it)
  ``XLA_FLAGS``' ``--xla_force_host_platform_device_count``.

  Raises:
    ValueError: ``JAX_NUM_CPU_DEVICES`` not a whole number in ``[1,
      MAX_SIMULATED_CPU_DEVICES]`` (:func:`decentral_jax.checks.
      environment_count`), or the ``XLA_FLAGS`` count not a whole number
      ``>= 1`` (:func:`decentral_jax.checks.xla_flags_device_count`),
      naming it.
  """
  env = checks.environment_count("JAX_NUM_CPU_DEVICES",
                                 MAX_SIMULATED_CPU_DEVICES)
  return env if env is not None else checks.xla_flags_device_count(
      MAX_SIMULATED_CPU_DEVICES)


def check_environment_devices(env: int, available: int, needed: int,
                              source: str) -> None:
  """Refuses a run whose devices the environment set too few (``available
  < needed``): ``JAX_NUM_CPU_DEVICES=env``, or without it ``XLA_FLAGS``'
  ``--xla_force_host_platform_device_count=env``, naming it and
  ``--cpu_devices``, which wins over both.

  Raises:
    ValueError: one line naming both and the count to give; a ``needed``
      above ``MAX_SIMULATED_CPU_DEVICES`` (which ``--cpu_devices`` cannot
      give) is named as :func:`check_simulated_devices` names it.
  """
  if available >= needed:
    return
  check_simulated_devices(needed, source)
  if "JAX_NUM_CPU_DEVICES" in os.environ:
    what, drop = f"the environment variable JAX_NUM_CPU_DEVICES={env}", \
        "unset it"
  else:
    what = f"XLA_FLAGS' --{checks.XLA_DEVICE_COUNT_OPTION}={env}"
    drop = "drop it from XLA_FLAGS"
  raise ValueError(
      f"{what} simulates {available} CPU devices in this process, but "
      f"{source} needs {needed}; raise it to {needed}, {drop}, or give "
      f"--cpu_devices={needed} (which wins over it).")


def check_distributed(c: config_dict.ConfigDict) -> None:
  """Checks the ``config.distributed`` group: types and ranges, and that
  its other fields keep their defaults when no job is joined
  (``enabled=False`` outside an ``srun`` step with several tasks: they
  would have no effect).

  Raises:
    ValueError: a field of the wrong type or range, or set without effect
      (named, with the fix).
  """
  d = c.distributed
  if not isinstance(d.enabled, bool):
    raise ValueError(f"config.distributed.enabled must be True or False, got "
                     f"{d.enabled!r}.")
  if not isinstance(d.coordinator_address, str):
    raise ValueError("config.distributed.coordinator_address must be a "
                     f"'host:port' string, got {d.coordinator_address!r}.")
  _int_field(c, "distributed.num_processes", 0)
  if isinstance(d.process_id, bool) or not isinstance(
      d.process_id, (int, np.integer)) or d.process_id < -1:
    raise ValueError(f"config.distributed.process_id must be an integer >= -1 "
                     f"(-1: auto-detect), got {d.process_id!r}.")
  _int_field(c, "distributed.heartbeat_timeout_seconds", 1)
  _int_field(c, "distributed.initialization_timeout_seconds", 1)
  if d.enabled or srun_step_detected():
    return
  default = distributed_group()
  for name in default:
    if name != "enabled" and d[name] != default[name]:
      raise ValueError(
          f"config.distributed.{name}={d[name]!r} has no effect with "
          "config.distributed.enabled=False (no multi-process job is joined "
          "outside an srun step with several tasks); set --config."
          "distributed.enabled=True to join one, or leave it at its "
          f"default: --config.distributed.{name}={default[name]!r}.")

