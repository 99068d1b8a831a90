#!/usr/bin/env bash
# GPU check (BENCHMARKS.md, "GPU check"): GPT-2 small step tokens/s and MFU on
# one GPU, and whether gossip collectives compile to async
# collective-permute-start/done. Needs JAX with CUDA (pip install
# "jax[cuda12]"); without a GPU it runs a tiny CPU smoke version.
# Usage: bash benchmarks/gpu_check.sh [extra gpu_check.py flags]
# Finishes in under 5 minutes (hard limit 290 s).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  exec timeout 290 python benchmarks/gpu_check.py "$@"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "nvidia-smi found but JAX has no GPU backend: pip install 'jax[cuda12]'" >&2
fi
echo "no GPU visible to JAX: CPU smoke run (tiny model, 8 simulated devices)"
XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8" \
  exec timeout 290 python benchmarks/gpu_check.py --smoke "$@"
