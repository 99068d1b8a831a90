"""Overlap of the train step's collectives with compute, compiled for GPUs.

A thin script over :mod:`decentral_jax.tools.overlap` (also the installed
``decentral-jax overlap``), which documents the cases, modes and output::

  JAX_PLATFORMS=cpu python benchmarks/bench_gpu_overlap.py \\
      --cases gpt_tiny,aer,virtual --targets h200,a100_sxm_80
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decentral_jax.tools import overlap  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  sys.exit(overlap.main(prog="python benchmarks/bench_gpu_overlap.py"))
