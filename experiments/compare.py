"""The main job: which communication scheme on which cluster, and what quality.

A thin script over :mod:`decentral_jax.tools.compare`, which holds the job,
its flags and their documentation (``--help``); ``decentral-jax compare``
runs the same job from an installed package.

  python experiments/compare.py --outdir results/compare     # quick, ~2 min
  python experiments/compare.py --full --outdir results/full  # the study
"""

import sys

from decentral_jax.tools import cli

if cli.environment_error():  # before JAX reads it
  sys.exit(2)

from decentral_jax.tools import compare  # noqa: E402

if __name__ == "__main__":
  sys.exit(compare.main(sys.argv[1:], prog="python experiments/compare.py"))
