"""Trains one configuration: ``python experiments/train.py --config CONFIG --workdir DIR``.

Any config field can be overridden, e.g.::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/x \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.steps=100

On a CPU-only machine the run needs ``config.n_workers`` devices; this script
simulates them (``jax_num_cpu_devices``) before JAX starts its CPU backend,
so the default 8-worker configs work out of the box. ``--cpu_devices=N``
sets the number explicitly. Re-running with the same ``--workdir`` resumes
from the last checkpoint.

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
from ml_collections import config_flags

from decentral_jax import checkpoint
from decentral_jax import config as config_lib
from decentral_jax import distributed
from decentral_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (metrics.jsonl, checkpoints); defaults "
    "to config.workdir.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Number of simulated CPU devices per process; 0 = "
    "config.n_workers / processes (only used when JAX runs on CPU).")


def simulate_cpu_devices(n: int) -> None:
  """Asks JAX for ``n`` CPU devices; must run before any JAX computation."""
  if os.environ.get("JAX_NUM_CPU_DEVICES"):
    return
  jax.config.update("jax_num_cpu_devices", int(n))


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
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config "
                         "configs/gpt_tiny.py")
  workdir = _WORKDIR.value or config.workdir
  if not workdir:
    raise app.UsageError("--workdir is required (or set config.workdir).")
  checkpoint.quiet_orbax_logs()
  try:
    procs = expected_processes(config)
    simulate_cpu_devices(_CPU_DEVICES.value or
                         max(int(config.n_workers) // procs, 1))
    if distributed.initialize_from_config(config) and jax.process_index() > 0:
      logging.set_verbosity(logging.WARNING)  # process 0 reports
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
  """Parses flags; a bad --config.<field> override is a one-line error."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError, TypeError, ValueError,
          flags.Error) as e:
    message = config_lib.config_error_message(e)
    print(f"error: bad --config override: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_or_exit)
