#!/usr/bin/env bash
# The GPU benchmark set: the ~1B-parameter decoder in bfloat16 with remat and
# jax.nn.dot_product_attention (cuDNN flash attention), then the reference comparison with
# the plain jax.jit + optax baseline. Run from the repository root on a machine with a GPU
# and mtrain installed (pip install -e . 'jax[cuda12]'); elsewhere it says so and exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "benchmarks/gpu.sh: no NVIDIA GPU here; nothing to run"
  exit 0
fi
nvidia-smi -L
"$PYTHON" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()'
XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}" \
  "$PYTHON" benchmarks/throughput.py --preset=gpu --batch_size=64 --length=512 "$@"
