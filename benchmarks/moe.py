"""One-hot (capacity) dispatch against dropless grouped matmuls: step time and compiled
matmul FLOPs at equal results.

1. A layer of 64 experts, top-8 (d_model and each expert's d_ff --d_model, tokens
   --tokens in groups of --group): forward and backward of the layer alone (jitted,
   median of --steps after a warm-up). The baseline is one-hot dispatch with a slot for
   every token of a group (capacity factor experts / top_k: nothing dropped, the same
   outputs as dropless), then the train default (capacity factor 1.25, which drops); the
   dropless rows run each grouped kernel (`moe.grouped_kernel`) this backend can run in
   reasonable time: 'tiles' everywhere, 'ragged_dot' on a GPU or TPU (XLA:CPU expands it
   into a dense matmul per expert: 64x the FLOPs; add it with --ragged_dot_on_cpu),
   'tokamax' on a GPU or TPU (on a Hopper GPU in bfloat16 its Mosaic kernel; on the CPU it
   is XLA's ragged_dot again, not timed twice), and 'megablox' on a TPU.
2. `moe_tiny` (configs/models/moe_tiny.gin: Llama-style, 4 layers, 8 experts of d_ff 256,
   top-2 every other layer) trained with AdamW on batch --batch x 128 of one device, the
   same two dispatches (capacity with a slot for every token; then its default, 1.25,
   which drops), and the dense model of the same active size (`llama_tiny` at 4 layers)
   beside them.

--dtype: the activations' and the experts' matmuls' (parameters stay float32); default
bfloat16 on a GPU (what tokamax's Mosaic kernel takes), float32 elsewhere. The header names
the kernel 'auto' picks here (`grouped.SELECTION`). Each row prints, as soon as it is
measured, the outputs' (or loss's) largest difference from the baseline, and the ratios; a
row that fails (a kernel's lowering at this shape, memory) says why in one line and spares
the others. Compiled FLOPs: the HLO's
matmuls, loops counted per iteration (a grouped kernel's tiles at balanced routing:
`mtrain.planning.hlo_cost`; a custom kernel's, tokamax's on a GPU, are not counted).

    python benchmarks/moe.py [--tokens 4096] [--group 256] [--d_model 512] [--steps 5]
                             [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import grouped
from mtrain.models.moe import STATS, MoEConfig, MoeFeedForward
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--group", type=int, default=256)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ragged_dot_on_cpu", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    return args


def timed(fn, *args, steps: int):
    """(the result, the median seconds of `steps` calls after a warm-up, matmul FLOPs)."""
    jitted = jax.jit(fn)
    flops = hlo_cost(jitted.lower(*args).compile().as_text(), 1).matmul_flops
    out = jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times), flops


def kernels(cpu_ragged: bool) -> list[str]:
    backend = jax.default_backend()
    return ["tiles"] + (["ragged_dot"] if backend != "cpu" or cpu_ragged else []) + (
        ["tokamax"] if backend != "cpu" else []) + (["megablox"] if backend == "tpu" else [])


def layer_rows(args):
    e, k, d = 64, 8, args.d_model
    config = MoEConfig(num_experts=e, top_k=k, group_size=args.group,
                       capacity_factor_train=e / k, capacity_factor_eval=e / k)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(args.tokens // args.group,
                                                           args.group, d)), args.dtype)
    params = nn.unbox(MoeFeedForward(config, d, activations=("silu", "linear")).init(
        jax.random.key(1), x, True)["params"])
    rows = [("one-hot, no drops", config),
            ("one-hot, capacity 1.25", dataclasses.replace(config, capacity_factor_eval=1.25))]
    rows += [(f"dropless, {kernel}", dataclasses.replace(config, dispatch="dropless",
                                                         grouped_kernel=kernel))
             for kernel in kernels(args.ragged_dot_on_cpu)]
    for name, c in rows:  # (a row that fails, a kernel's lowering at this shape: its error)
        layer = MoeFeedForward(c, d, activations=("silu", "linear"), dtype=args.dtype)

        def step(params, x):
            def f(params, x):
                y, stats = layer.apply({"params": params}, x, True, mutable=[STATS])
                return jnp.sum(jnp.sin(y)), y
            return jax.value_and_grad(f, (0, 1), has_aux=True)(params, x)

        try:
            ((_, y), _), seconds, flops = timed(step, params, x, steps=args.steps)
        except Exception as e:  # each row on its own: say why, go on
            yield name, e
            continue
        yield name, (y, seconds, flops)


def tiny_config(dispatch: str | None, kernel: str = "tiles", capacity: float = 4.0,
                dtype: str = "float32") -> TransformerConfig:
    moe = None if dispatch is None else MoEConfig(
        num_experts=8, top_k=2, expert_d_ff=256, group_size=128,
        capacity_factor_train=capacity, dispatch=dispatch, grouped_kernel=kernel)
    return TransformerConfig(vocab_size=2048, d_model=128, d_ff=384, num_heads=8,
                             num_kv_heads=2, d_kv=16, num_layers=4, max_length=128,
                             mlp_activations=("silu", "linear"), position_encoding="rotary",
                             activation_dtype=dtype,
                             shared_embedding_and_softmax=False, moe_every=2 if moe else 0,
                             moe=moe)


def model_rows(args):
    rng = np.random.default_rng(0)
    shape = (args.batch, 128)
    batch = {"targets": rng.integers(1, 2048, shape).astype(np.int32),
             "targets_segment_ids": np.ones(shape, np.int32),
             "targets_positions": np.broadcast_to(np.arange(128), shape).astype(np.int32)}
    dt = dict(dtype=args.dtype)
    rows = [("moe_tiny one-hot, no drops", tiny_config("capacity", **dt)),
            ("moe_tiny one-hot, 1.25", tiny_config("capacity", capacity=1.25, **dt))]
    rows += [(f"moe_tiny dropless, {k}", tiny_config("dropless", k, **dt))
             for k in kernels(True)]  # (8 experts: ragged_dot's dense expansion is bearable)
    rows.append(("dense, the same active size", tiny_config(None, **dt)))
    layout = Layout("", "")
    for name, c in rows:  # (a row that fails: its error)
        try:
            trainer = Trainer(model=DecoderLM(c), optimizer=optimizer.adamw(1e-3),
                              layout=layout, mesh=layout.make_mesh(jax.devices()[:1]),
                              batch_size=shape[0], sequence_length=shape[1], seed=1)
            state, placed = trainer.init_state(), trainer.place_batch(batch)
            flops = hlo_cost(trainer.compile_train_step(placed).as_text(), 1).matmul_flops
            state, metrics = trainer.train_step(state, placed)
            loss = float(metrics["loss"])
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                state, metrics = trainer.train_step(state, placed)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        except Exception as e:  # each row on its own: say why, go on
            yield name, e
            continue
        yield name, (loss, statistics.median(times), flops)


def failure(e: Exception) -> str:
    """An error in one line."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"failed: {type(e).__name__}: {first[:160]}"


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:10.3f}" if b else f"{'-':>10s}"


def print_rows(rows, third):
    """Print each ``(name, (value, seconds, flops))`` of `rows` as it comes (`third(value,
    base)`: its third column; ratios to the first row's, if it ran), or its failure;
    returns the names of the rows that failed."""
    failed, base = [], None
    for i, (name, row) in enumerate(rows):
        if isinstance(row, Exception):
            failed.append(name)
            print(f"{name:28s} {failure(row)}", flush=True)
            continue
        value, seconds, flops = row
        base = row if i == 0 else base
        print(f"{name:28s} {1e3 * seconds:9.1f} {flops / 1e9:9.2f} {third(value, base)} "
              f"{ratio(seconds, base and base[1])} {ratio(flops, base and base[2])}",
              flush=True)
    return failed


def main():
    args = parse_args()
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}, {args.dtype}; "
          f"moe.grouped_kernel='auto' runs {grouped.default_kernel(None, args.dtype)!r}")
    print(f"1. a layer of 64 experts, top-8: d_model {args.d_model}, expert d_ff "
          f"{args.d_model} (SwiGLU), {args.tokens} tokens in groups of {args.group}; "
          f"forward and backward")
    print(f"{'':28s} {'ms':>9s} {'GFLOPs':>9s} {'max |dy|':>10s} {'time/base':>10s} "
          f"{'FLOPs/base':>10s}", flush=True)
    failed = print_rows(layer_rows(args), lambda y, base: (
        f"{float(jnp.abs(y - base[0]).max()):10.2e}" if base else f"{'-':>10s}"))
    print(f"2. moe_tiny train step (AdamW), batch {args.batch} x 128, one device")
    print(f"{'':28s} {'ms':>9s} {'GFLOPs':>9s} {'loss':>10s} {'time/base':>10s} "
          f"{'FLOPs/base':>10s}", flush=True)
    failed += print_rows(model_rows(args), lambda loss, base: f"{loss:10.5f}")
    if failed:
        print(f"{len(failed)} rows failed (why: on their lines above): {'; '.join(failed)}",
              flush=True)


if __name__ == "__main__":
    main()
