#!/usr/bin/env bash
# The GPU benchmark set (issue 17), within 10 minutes on one H100:
#   1. attention alone: each flash kernel on packed rows, checked against the XLA reference
#      and timed (benchmarks/attention.py);
#   2. the 1B decoder of configs/models/lm_1b.gin (bf16, remat dots) on packed rows with
#      'auto' (on Hopper: cuDNN's packed layout with a table fitted to the rows) and each
#      flash kernel, each row in a process of its own: tokens/s, MFU, compile time, peak
#      memory, and the kernel that ran; and the Llama-style 1B of configs/models/llama_1b.gin
#      (SwiGLU, rotary positions, 4 of 16 key/value heads, AdamW) with 'auto';
#   3. the same model on unpacked rows against the plain jax.jit + optax baseline (bf16,
#      cuDNN is_causal flash attention, remat dots, Adafactor) in the same process, mtrain
#      with its defaults ('auto': a table of one example per row): 'ratio mtrain/plain'.
# Run it on a machine with a GPU whose Python has jax with CUDA, flax and optax: it measures
# this checkout's mtrain (put first on PYTHONPATH; nothing needs installing) and imports
# neither gin nor TensorFlow. Elsewhere it says so and exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "benchmarks/gpu.sh: no NVIDIA GPU here; nothing to run"
  exit 0
fi
nvidia-smi -L
"$PYTHON" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()'
# Rows of one model share their parameter initialisation: compile it once.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d)}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
timeout 180 "$PYTHON" benchmarks/attention.py || echo "benchmarks/attention.py: failed or out of time (exit $?)"
# Each row of the table in a process of its own (its own peak memory; a row that fails
# spares the others), then the comparison.
"$PYTHON" benchmarks/throughput.py --preset=gpu --isolate --row_timeout=150 --compare=gpu \
  --batch_size=16 --length=2048 --steps=5 --rounds=3 --table_steps=10 "$@"
