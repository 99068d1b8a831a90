"""Trains one configuration: ``python experiments/train.py --config CONFIG --workdir DIR``.

A thin script over :mod:`decentral_jax.tools.train` (also the installed
``decentral-jax train``), which documents the flags, the exit codes and
multi-host runs; e.g.::

  python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/x \\
    --config.algorithm=all_reduce --config.optimizer.name=adamw \\
    --config.optimizer.accum_steps=1 --config.steps=100
"""

import sys

from decentral_jax.tools import cli

if cli.environment_error():  # before JAX reads it
  sys.exit(2)

from decentral_jax.tools import train  # noqa: E402

if __name__ == "__main__":
  sys.exit(train.main(sys.argv[1:], prog="python experiments/train.py"))
