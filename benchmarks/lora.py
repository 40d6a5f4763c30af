"""Full fine-tuning against LoRA: a train step's time and the train state's memory, measured.

Builds a Llama-style decoder (SwiGLU, rotary, grouped-query attention; default d_model 512,
4 layers, batch 8 x 256) twice with AdamW: every parameter trained (the baseline), and
LoRA adapters of rank --rank on every projection with the base frozen (`lora.rank`); runs
--steps jitted train steps of each after a warm-up on the same batch, and prints the median
step time, the optimizer state and the gradient-bearing parameters' bytes as the devices hold
them, and the ratios. The planner's figures for `llama_1b` on an H100 are
`python -m mtrain --mode=plan --target=h100 --gin_file=configs/tasks/lm1b.gin
--gin_file=configs/models/llama_1b.gin [--gin_param=lora.rank=16]`.

    python benchmarks/lora.py [--d_model 512] [--layers 4] [--rank 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from mtrain.models.lora import LoraConfig, is_adapter
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer


def parse_args(doc: str = __doc__):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args()


def llama_config(args) -> TransformerConfig:
    """The benchmarks' Llama-style decoder of `args.d_model` and `args.layers`."""
    d = args.d_model
    return TransformerConfig(vocab_size=8192, d_model=d, d_ff=int(d * 2.6875) // 64 * 64,
                             num_heads=d // 64, num_kv_heads=max(1, d // 256), d_kv=64,
                             num_layers=args.layers, max_length=args.length,
                             mlp_activations=("silu", "linear"), position_encoding="rotary")


def timed_steps(trainer, state, placed, steps, metrics_too: bool = False):
    """(the state after, the median seconds) of `steps` train steps after a warm-up one;
    with `metrics_too`, the last step's metrics as well."""
    state, metrics = trainer.train_step(state, placed)  # compile and warm up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, placed)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return (state, statistics.median(times)) + ((metrics,) if metrics_too else ())


def measure(config, trainable, batch, steps):
    layout = Layout("", "")
    trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adamw(1e-4), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:1]),
                      batch_size=batch["targets"].shape[0],
                      sequence_length=batch["targets"].shape[1], trainable=trainable)
    state = trainer.init_state()
    placed = trainer.place_batch(batch)
    state, median = timed_steps(trainer, state, placed, steps)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    trained = trainer.split(state.params)[0]
    cost = trainer.compile_train_step(placed).cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)
    return median, nbytes(state.opt_state), nbytes(trained), nbytes(
        state.params), flops


def main():
    args = parse_args()
    d = args.d_model
    config = llama_config(args)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.length)
    batch = {"targets": rng.integers(1, 8192, shape).astype(np.int32),
             "targets_segment_ids": np.ones(shape, np.int32),
             "targets_positions": np.broadcast_to(np.arange(args.length), shape).astype(np.int32)}
    full = measure(config, None, batch, args.steps)
    lora = measure(dataclasses.replace(config, lora=LoraConfig(rank=args.rank)), is_adapter,
                   batch, args.steps)
    print(f"model: d_model {d}, {args.layers} layers, batch {args.batch} x {args.length}, "
          f"AdamW; LoRA rank {args.rank} on every projection; {jax.devices()[0].platform}")
    print(f"{'':24s} {'step ms':>9s} {'XLA GFLOPs':>11s} {'optimizer state':>16s} "
          f"{'trained params':>15s} {'all params':>11s}")
    for name, (t, opt, trained, params, flops) in (("full fine-tuning", full), ("LoRA", lora)):
        print(f"{name:24s} {1e3 * t:9.1f} {flops / 1e9:11.1f} {opt / 2**20:12.2f} MiB "
              f"{trained / 2**20:11.2f} MiB {params / 2**20:7.2f} MiB")
    print(f"LoRA / full: step time {lora[0] / full[0]:.2f}, FLOPs {lora[4] / full[4]:.2f}, "
          f"optimizer state {lora[1] / full[1]:.4f}, trained parameters {lora[2] / full[2]:.4f}")


if __name__ == "__main__":
    main()
