#!/usr/bin/env bash
# GPU check (BENCHMARKS.md section 11, docs/gpu_overlap.md): GPT-2 small step
# tokens/s and MFU on one GPU; the runner's train-step programs compiled for
# the GPUs present against the same programs compiled deviceless (overlap
# reports side by side); with 2 or more GPUs, ms/step with and without gossip.
# Needs JAX with CUDA (pip install "jax[cuda12]"). Without a GPU it runs a
# tiny CPU smoke version; for the deviceless report alone, on any machine:
#   JAX_PLATFORMS=cpu python benchmarks/gpu_check.py --deviceless h200
# Usage: bash benchmarks/gpu_check.sh [extra gpu_check.py flags]
# Finishes in under 5 minutes (hard limit 290 s).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  exec timeout 290 python benchmarks/gpu_check.py --programs none --json gpu_check.json "$@"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "nvidia-smi found but JAX has no GPU backend: pip install 'jax[cuda12]'" >&2
fi
echo "no GPU visible to JAX: CPU smoke run (tiny model, 8 simulated devices)"
XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8" \
  exec timeout 290 python benchmarks/gpu_check.py --smoke --programs none \
  --warm_steps 2 --timed_steps 3 "$@"
