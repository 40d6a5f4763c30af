"""Pipeline stages (`layers:stage`): step time and bubble of GPipe and the circular schedule
at 2 and 4 stages and 4, 8 and 16 microbatches, against the unsplit step in the same run,
with the planner's bubble beside each.

On simulated CPU devices that share a machine's few cores, the stages hardly run at once,
so the step time is near the work of every stage added up: each stage computes every one
of the R M + S - 1 iterations (the bubble's on zeros, discarded), R M of which are real,
so ``step / unsplit step`` measures about 1 / (1 - bubble) plus what the pipeline's
bookkeeping and its sends cost; the bubble is read as ``1 - unsplit / step``. Small models
are dominated by per-op overheads and the cores that do overlap devices (2 on the
development machine): read the columns as a check of the trend, not of the figure. On
real devices (one stage a device) the bubble is idle time instead.

    python benchmarks/pipeline.py                 # 8 CPU devices, a 8-layer d_model 256 LM
    python benchmarks/pipeline.py --steps 5 --layers 16 --rows 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtrain.models import pipeline  # noqa: E402
from mtrain.models.pipeline import PipelineConfig  # noqa: E402
from mtrain.models.transformer import DecoderLM, TransformerConfig  # noqa: E402
from mtrain.parallel.layout import Layout  # noqa: E402
from mtrain.training import optimizer  # noqa: E402
from mtrain.training.language_modeling import LanguageModeling  # noqa: E402
from mtrain.training.losses import LossConfig  # noqa: E402
from mtrain.training.trainer import Trainer  # noqa: E402


def trainer(args, mesh_shape="", rules="", config=PipelineConfig()):
    c = TransformerConfig(vocab_size=512, d_model=args.d_model, d_ff=4 * args.d_model,
                          num_heads=4, d_kv=args.d_model // 4, num_layers=args.layers,
                          max_length=args.length, position_encoding="rotary",
                          mlp_activations=("silu", "linear"), scan_layers=True,
                          pipeline=config)
    layout = Layout(mesh_shape, rules)
    return Trainer(model=DecoderLM(c), optimizer=optimizer.adafactor(
        optimizer.learning_rate_schedule(warmup_steps=5)), layout=layout,
        mesh=layout.make_mesh(jax.devices()[: layout.size]), batch_size=args.rows,
        sequence_length=args.length, seed=0, objective=LanguageModeling(LossConfig()))


def step_seconds(t: Trainer, steps: int) -> float:
    rng = np.random.default_rng(0)
    rows, length = t.batch_shape
    batch = t.place_batch({"targets": rng.integers(1, 512, (rows, length)).astype(np.int32),
                           "targets_segment_ids": np.ones((rows, length), np.int32),
                           "targets_positions": np.tile(np.arange(length, dtype=np.int32),
                                                        (rows, 1))})
    state = t.init_state()
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        state, metrics = t.train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    base = step_seconds(trainer(args), args.steps)
    print(f"unsplit (one device): {base * 1e3:.1f} ms a step; {args.layers} layers, d_model "
          f"{args.d_model}, {args.rows} x {args.length} tokens")
    print(f"{'schedule':<10} {'S':>2} {'R':>2} {'M':>3} {'step ms':>9} {'x unsplit':>10} "
          f"{'bubble':>8} {'planned':>8}")
    for schedule, repeats in (("gpipe", 1), ("circular", 2)):
        for stages in (2, 4):
            for m in (4, 8, 16):
                if m > args.rows or (repeats > 1 and m < stages):
                    continue
                config = PipelineConfig(schedule=schedule, repeats=max(repeats, 2),
                                        microbatches=m)
                t = trainer(args, f"stage:{stages}", "layers:stage", config)
                seconds = step_seconds(t, args.steps)
                print(f"{schedule:<10} {stages:>2} {repeats:>2} {m:>3} {seconds * 1e3:>9.1f} "
                      f"{seconds / base:>10.2f} {1 - base / seconds:>8.1%} "
                      f"{pipeline.bubble(stages, m, repeats):>8.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
