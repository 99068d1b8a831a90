"""Trains one configuration: ``python experiments/train.py --config CONFIG --workdir DIR``.

Any config field can be overridden, e.g.::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/x \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.steps=100

On a CPU-only machine the run needs ``config.n_workers`` x
``config.devices_per_worker`` devices; this script
simulates them (``jax_num_cpu_devices``) before JAX starts its CPU backend,
so the default 8-worker configs work out of the box. ``--cpu_devices=N``
sets the number explicitly. At most
``decentral_jax.runner.config.MAX_SIMULATED_CPU_DEVICES`` (1024) devices per
process are simulated; more is refused before JAX starts (set
``JAX_NUM_CPU_DEVICES`` yourself to go beyond). Re-running with the same
``--workdir`` resumes from the last checkpoint.

Bad input (a missing or broken config file, an unknown field, a value of the
wrong type or out of range, missing data, an unwritable work directory) is
one ``error: ...`` line on stderr and exit code 2; a diverged run exits with
3.

Multi-host: run the same command once per host (``srun`` does it on SLURM)
with ``--config.distributed.enabled=True``; on SLURM the coordinator and
process ids are detected, elsewhere also pass
``--config.distributed.coordinator_address=HOST:PORT``,
``--config.distributed.num_processes=N`` and
``--config.distributed.process_id=I``. Every process uses all of its local
devices (``n_workers / N`` simulated CPU devices per process on CPU); only
process 0 prints, logs and writes ``metrics.jsonl``. See
``experiments/slurm_example.sbatch``.
"""

from __future__ import annotations

import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax

from decentral_jax.runner import orbax_quiet
from decentral_jax.runner import config as config_lib
from decentral_jax.runner import launch as distributed
from decentral_jax.runner import train
from decentral_jax.runner import validation

_CONFIG = flags.DEFINE_string(
    "config", None, "Path to a config file (configs/*.py, or FILE.py:ARG); "
    "override its fields with --config.<field>=value.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (metrics.jsonl, checkpoints); defaults "
    "to config.workdir.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Number of simulated CPU devices per process; 0 = "
    "config.n_workers x config.devices_per_worker / "
    "config.workers_per_device / processes (only used "
    "when JAX runs on CPU).",
    lower_bound=0)
# The --config.<field>=value arguments, set aside by _parse_or_exit.
_OVERRIDES: list[str] = []


def simulate_cpu_devices(n: int, source: str = "--cpu_devices=N") -> None:
  """Asks JAX for ``n`` CPU devices; must run before any JAX computation.

  Raises:
    ValueError: ``n`` above ``config.MAX_SIMULATED_CPU_DEVICES`` (``source``
      names what set it); nothing is simulated then.
  """
  if os.environ.get("JAX_NUM_CPU_DEVICES"):
    return
  validation.check_simulated_devices(int(n), source)
  jax.config.update("jax_num_cpu_devices", int(n))


def _fail(message) -> None:
  """One ``error:`` line on stderr, exit code 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def expected_processes(config) -> int:
  """Processes of the job about to start (1 unless it is multi-process)."""
  d = config.distributed
  if int(d.num_processes) > 0:
    return int(d.num_processes)
  srun_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)
  if d.enabled or srun_tasks > 1:  # as initialize_from_config decides
    return max(int(os.environ.get("SLURM_NTASKS", "1") or 1), 1)
  return 1


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}")
  if not _CONFIG.value:
    _fail("--config is required, e.g. --config configs/gpt_tiny.py")
  orbax_quiet.quiet_orbax_logs()
  try:
    # Everything about the config is checked before JAX starts.
    config = config_lib.load_config(_CONFIG.value, _OVERRIDES)
    validation.check_config(config)
    workdir = _WORKDIR.value or config.workdir
    if not workdir:
      raise ValueError("--workdir is required (or set config.workdir).")
    procs = expected_processes(config)
    needed, source = validation.devices_needed(config)
    simulate_cpu_devices(
        _CPU_DEVICES.value or max(needed // procs, 1),
        f"--cpu_devices={_CPU_DEVICES.value}" if _CPU_DEVICES.value else
        source.replace("config.", "--config.")  # the flags typed
        + (f" over {procs} processes" if procs > 1 else ""))
    if distributed.initialize_from_config(config) and jax.process_index() > 0:
      logging.set_verbosity(logging.WARNING)  # process 0 reports
    if jax.process_index() == 0:
      for line in validation.config_warnings(config):
        print(f"warning: {line}", file=sys.stderr)
    logging.info("JAX %s, %d process(es), devices: %s", jax.__version__,
                 jax.process_count(), jax.devices())
    final = train.train_and_evaluate(config, workdir)
  except ValueError as e:  # bad config or data: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except FloatingPointError as e:  # diverged; the last good checkpoint stays
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
  except train.Preempted as e:  # SIGTERM/SIGINT: checkpoint saved, 143/130
    print(f"preempted: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
  if jax.process_index() > 0:
    return
  summary = ", ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in final.items())
  print(f"finished: {summary}")
  print(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}")


def _parse_or_exit(argv):
  """Parses the flags; a bad one is a one-line error (exit 2).

  The ``--config.<field>`` overrides are set aside for ``main``, which loads
  the config with them (``config.load_config``).
  """
  rest, _OVERRIDES[:] = config_lib.split_overrides(argv)
  try:
    return flags.FLAGS(rest)
  except flags.Error as e:
    _fail(config_lib.config_error_message(e))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_or_exit)
