#!/usr/bin/env bash
# The GPU benchmark set (issues 17 and 61), under 9 minutes on one H100 (it must fit a
# 10-minute slot on a borrowed GPU): each step runs under `timeout` for its share of the
# budget, in seconds (520 in all, and ~10 to start), and one that fails or runs out of time
# spares the others:
#   1. attention alone (70): each flash kernel on packed rows, checked against the XLA
#      reference and timed (benchmarks/attention.py);
#   2. the experts (100): a layer of 64 experts, top-8, one-hot dispatch against dropless
#      grouped matmuls with each kernel this GPU runs ('tiles', 'ragged_dot', 'tokamax'),
#      then `moe_tiny` trained with each (benchmarks/moe.py, its GPU defaults: bfloat16);
#   3. the table (250), each row in a process of its own (its own peak memory): the
#      Llama-style 1B of configs/models/llama_1b.gin (SwiGLU, rotary positions, 4 of 16
#      key/value heads, AdamW) with 'auto' in bf16, then with its projections in fp8
#      (`transformer.quantization='fp8'`, tensorwise scaling), and the ratio of their
#      tokens/s ('ratio llama_1b fp8/bf16'); then the 1B decoder of configs/models/lm_1b.gin
#      (bf16, remat dots) on packed rows with 'auto' (on Hopper: cuDNN's packed layout with a
#      table fitted to the rows): tokens/s, MFU, compile time, peak memory, the kernel that
#      ran. GPU_TABLE_ROWS picks other rows of throughput.py's gpu preset (each flash kernel,
#      rows of 4 x 2048, the scanned stack: "all" for every one, beyond this budget);
#   4. the comparison (100): the 1B on unpacked rows against the plain jax.jit + optax
#      baseline (bf16, cuDNN is_causal flash attention, remat dots, Adafactor) in the same
#      process, mtrain with its defaults ('auto': a table of one example per row): 'ratio
#      mtrain/plain'.
# Arguments go to both benchmarks/throughput.py runs (the table's flags to the table, the
# comparison's to the comparison). Run it on a machine with a GPU whose Python has jax with
# CUDA, flax and optax: it measures this checkout's mtrain (put first on PYTHONPATH; nothing
# needs installing) and imports neither gin nor TensorFlow. Elsewhere it says so and exits 0.
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
# throughput.py's gpu preset: 6 llama_1b bf16, 7 llama_1b fp8, 0 the 1B with 'auto'
ROWS="${GPU_TABLE_ROWS:-6,7,0}"
if [ "$ROWS" = all ]; then ROWS=""; fi

step() {  # step SECONDS NAME COMMAND...: COMMAND within SECONDS, or say why not
  local seconds=$1 name=$2
  shift 2
  echo
  echo "== $name (at most ${seconds} s; ${SECONDS} s in)"
  timeout "$seconds" "$@" || echo "$name: failed or out of time (exit $?)"
}

step 70 "attention" "$PYTHON" benchmarks/attention.py
step 100 "experts" "$PYTHON" benchmarks/moe.py
step 250 "table" "$PYTHON" benchmarks/throughput.py --preset=gpu --isolate --row_timeout=130 \
  --compare=none --rows="$ROWS" --table_steps=10 "$@"
step 100 "comparison" "$PYTHON" benchmarks/throughput.py --preset=none --compare=gpu \
  --batch_size=16 --length=2048 --steps=5 --rounds=3 "$@"
echo
echo "benchmarks/gpu.sh: ${SECONDS} s in all"
