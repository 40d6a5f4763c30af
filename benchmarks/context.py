"""Context parallelism: a long-sequence train step's per-device memory and time with
``length`` split 1, 2, 4 and 8 ways, the keys and values all-gathered or passed around the
ring (`models.context`), against the unsplit step in the same run.

A Llama-style decoder (default d_model 256, 2 layers, 8 heads x 32 sharing 2 key/value
heads, SwiGLU, rotary) at --length tokens (default 8,192) a row, batch 1, on simulated CPU
devices (mesh ``seq:n``, rule ``length:seq``), einsum attention (the CPU's path; the flash
path's figures: `--mode=plan --gin_param=transformer.attention='flash'`). For each: XLA's
temporaries per device (its buffer assignment of the compiled step: activations, gradients,
scratch), the median of --steps steps after a warm-up, and the ratios to the unsplit step.
The simulated devices share this machine's cores: time here is the work a step does in all,
not a cluster's wall time. The plan of the 1B preset at 32k tokens on 8 H100s is in the
README ("Long sequences").

    python benchmarks/context.py [--length 8192] [--d_model 256] [--layers 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from lora import timed_steps  # noqa: E402

from mtrain.models.transformer import DecoderLM, TransformerConfig  # noqa: E402
from mtrain.parallel.layout import Layout  # noqa: E402
from mtrain.training import optimizer  # noqa: E402
from mtrain.training.trainer import Trainer  # noqa: E402


def measure(config, ways: int, batch, steps: int):
    """(temporaries per device in bytes, median step seconds) of the step split `ways` ways."""
    layout = Layout(f"seq:{ways}", "length:seq") if ways > 1 else Layout("", "")
    trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adamw(1e-4), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:ways]),
                      batch_size=batch["targets"].shape[0],
                      sequence_length=batch["targets"].shape[1])
    state, placed = trainer.init_state(), trainer.place_batch(batch)
    temp = trainer.compile_train_step(placed).memory_analysis().temp_size_in_bytes
    _, seconds, metrics = timed_steps(trainer, state, placed, steps, metrics_too=True)
    return temp, seconds, float(metrics["loss"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    d = args.d_model
    config = TransformerConfig(vocab_size=8192, d_model=d, d_ff=int(d * 2.6875) // 64 * 64,
                               num_heads=d // 32, num_kv_heads=2, d_kv=32,
                               num_layers=args.layers, max_length=args.length,
                               mlp_activations=("silu", "linear"), position_encoding="rotary",
                               dropout_rate=0.0)
    rng = np.random.default_rng(0)
    shape = (1, args.length)
    batch = {"targets": rng.integers(1, 8192, shape).astype(np.int32),
             "targets_segment_ids": np.ones(shape, np.int32),
             "targets_positions": np.arange(args.length, dtype=np.int32)[None]}
    print(f"model: d_model {d}, {args.layers} layers, {d // 32} heads x 32 (2 key/value), "
          f"batch 1 x {args.length}, AdamW, einsum attention; {jax.devices()[0].platform}, "
          f"{args.steps} steps after a warm-up")
    print(f"{'split':>5s} {'mode':>7s} {'temporaries/device':>19s} {'step s':>8s} "
          f"{'loss':>8s} {'memory vs 1':>12s} {'time vs 1':>10s}")
    base = None
    for ways in (1, 2, 4, 8):
        for mode in ("gather", "ring") if ways > 1 else ("-",):
            c = dataclasses.replace(config, context_parallel=mode if ways > 1 else "gather")
            temp, seconds, loss = measure(c, ways, batch, args.steps)
            base = base or (temp, seconds)
            print(f"{ways:5d} {mode:>7s} {temp / 2**20:15.1f} MiB {seconds:8.2f} {loss:8.4f} "
                  f"{temp / base[0]:12.3f} {seconds / base[1]:10.2f}")


if __name__ == "__main__":
    main()
