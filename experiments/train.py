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
from decentral_jax import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (metrics.jsonl, checkpoints); defaults "
    "to config.workdir.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Number of simulated CPU devices; 0 = config.n_workers "
    "(only used when JAX runs on CPU).")


def simulate_cpu_devices(n: int) -> None:
  """Asks JAX for ``n`` CPU devices; must run before any JAX computation."""
  if os.environ.get("JAX_NUM_CPU_DEVICES"):
    return
  jax.config.update("jax_num_cpu_devices", int(n))


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
  simulate_cpu_devices(_CPU_DEVICES.value or max(int(config.n_workers), 1))
  logging.info("JAX %s, devices: %s", jax.__version__, jax.devices())
  try:
    final = train.train_and_evaluate(config, workdir)
  except ValueError as e:  # bad config or data: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except FloatingPointError as e:  # diverged; the last good checkpoint stays
    print(f"error: {e}", file=sys.stderr)
    sys.exit(3)
  summary = ", ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in final.items())
  print(f"finished: {summary}")
  print(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}")


if __name__ == "__main__":
  app.run(main)
