"""The paper's LM table in miniature: bigger models reach lower perplexity in equal steps.

Table 1 of the Mesh-TensorFlow paper trains LM sizes -1 ... 5 (d_model 1024, d_kv 256,
6 layers; each size doubles d_ff, 4096 ... 262144, and the heads, 4 ... 256) for the same
number of steps, and the held-out perplexity falls with every doubling. This trains sizes
-1, 0 and 1 scaled down by d_model (same ratios: d_kv = d_model / 4, d_ff = 4, 8, 16 x
d_model, heads 4, 8, 16; 6 layers, dropout 0.1) for the same number of steps on the offline
One Billion Word task (the real TFDS lm1b builder on raw files made from the shipped corpus,
as the quickstart), and prints the held-out perplexity of each.

The learning rate warms up over 1000 steps (rsqrt decay after), so that in a short run it
stays near the paper's small peak (10,000 warmup steps there): with the quickstart's 100
warmup steps the rate peaks at 0.1, and in 600 steps the larger models, which that high a
rate slows most, fall behind the smaller ones.

    python benchmarks/paper_trend.py [--d_model 64] [--steps 600] [--cpu_devices 1]
        [--gin_param ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--sizes", default="-1,0,1", help="paper sizes to train, comma-separated")
    p.add_argument("--cpu_devices", type=int, default=1)
    p.add_argument("--mesh_shape", default="", help="default: one device")
    p.add_argument("--gin_param", action="append", default=[],
                   help="more bindings, applied to every size")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:  # before jax is imported
    from mtrain.parallel.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(ARGS.cpu_devices)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

from mtrain import run as run_lib  # noqa: E402
from mtrain.modes.train import train  # noqa: E402
from mtrain.io.metrics import setup_logging  # noqa: E402


def size_bindings(size: int, d_model: int) -> list[str]:
    """The paper's size `size` with d_model scaled: d_ff 4 x d_model x 2^(size+1), as many
    heads of d_model / 4 as 4 x 2^(size+1)."""
    scale = 2 ** (size + 1)
    return [f"transformer.d_model={d_model}", f"transformer.d_kv={d_model // 4}",
            f"transformer.d_ff={4 * d_model * scale}", f"transformer.num_heads={4 * scale}",
            "transformer.num_layers=6", "transformer.dropout_rate=0.1"]


def main(args):
    setup_logging()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        params = [*size_bindings(size, args.d_model), f"run.train_steps={args.steps}",
                  "learning_rate_schedule.warmup_steps=1000",
                  f"run.mesh_shape='{args.mesh_shape}'", "run.eval_every=0",
                  f"run.log_every={max(args.steps // 5, 1)}",
                  f"run.checkpoint_every={args.steps}", *args.gin_param]
        run_lib.parse_config(["quickstart.gin"], params)
        exp = run_lib.build(model_dir=tempfile.mkdtemp(prefix=f"mtrain-trend-{size}-"))
        count = sum(x.size for x in jax.tree_util.tree_leaves(exp.trainer.abstract_state.params))
        t0 = time.time()
        results = train(exp)
        c = exp.model_config
        rows.append((size, c.d_ff, c.num_heads, count, results, time.time() - t0))
    print(f"\npaper LM sizes scaled to d_model {args.d_model}, {args.steps} steps each, "
          f"batch {exp.batch_size} x {exp.sequence_length}, {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s); held-out split of {exp.task.name}:")
    print(f"{'size':>4} {'d_ff':>6} {'heads':>5} {'params':>10} {'perplexity':>10} "
          f"{'word ppl':>9} {'seconds':>8}")
    for size, d_ff, heads, count, r, seconds in rows:
        print(f"{size:>4} {d_ff:>6} {heads:>5} {count:>10,} {r['eval/perplexity']:>10.2f} "
              f"{r.get('eval/word_perplexity', float('nan')):>9.1f} {seconds:>8.0f}")
    ppl = [r["eval/perplexity"] for *_, r, _ in rows]
    print("perplexity falls with size:", all(a > b for a, b in zip(ppl, ppl[1:])))


if __name__ == "__main__":
    main(ARGS)
