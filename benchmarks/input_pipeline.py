"""Input-pipeline throughput beside what the train step consumes, on a gin config.

The pipeline must never be what a run waits for. This builds the run a gin config describes
(default: the quickstart, data x model parallel over 8 simulated CPU devices), then measures

* **pipeline**: tokens/s that the training input pipeline delivers on its own (tokenise,
  pack, batch, this process's rows), counting real (non-padding) tokens, after a warm-up;
* **train step**: tokens/s that the jitted train step consumes when fed batches that are
  already in memory (one batch placed on the mesh, stepped repeatedly);

and prints both and their ratio (pipeline / train step; above 1 the pipeline keeps up, and
the run is not input-bound). The pipeline runs in tf.data's own threads while the step runs,
so the ratio is the headroom when both share the same cores.

    python benchmarks/input_pipeline.py [--gin_file quickstart.gin] [--gin_param ...]
        [--cpu_devices 8] [--batches 200] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=None)
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--cpu_devices", type=int, default=8)
    p.add_argument("--batches", type=int, default=200, help="pipeline batches timed")
    p.add_argument("--steps", type=int, default=30, help="train steps timed")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:  # before jax is imported
    from mtrain.parallel.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(ARGS.cpu_devices)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

from mtrain import run as run_lib  # noqa: E402
from mtrain.io.metrics import setup_logging  # noqa: E402


def tokens(batch) -> int:
    return int(sum((batch[k] > 0).sum() for k in batch if k.endswith("_segment_ids")))


def main(args):
    setup_logging()
    run_lib.parse_config(args.gin_file or ["quickstart.gin"], args.gin_param)
    exp = run_lib.build(model_dir=tempfile.mkdtemp(prefix="mtrain-bench-"))
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, batch "
          f"{exp.batch_size} x {exp.sequence_length}, task {exp.task.name}")

    batches = exp.train_batches()
    t0 = time.perf_counter()
    first = next(batches)
    print(f"pipeline start-up (first batch): {time.perf_counter() - t0:.2f} s")
    for _ in range(20):  # warm-up: every lane started, prefetch buffers full
        next(batches)
    count, t0 = 0, time.perf_counter()
    for _ in range(args.batches):
        count += tokens(next(batches))
    pipeline = count / (time.perf_counter() - t0)
    print(f"pipeline: {pipeline:,.0f} tokens/s ({args.batches} batches, "
          f"{count / args.batches / first['targets'].size:.1%} of positions are real tokens)")

    trainer = exp.trainer
    state = trainer.init_state()
    batch = trainer.place_batch(first)
    state, metrics = trainer.train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    consumed = tokens(first) / step
    print(f"train step: {consumed:,.0f} tokens/s (median step {step * 1e3:.0f} ms over "
          f"{args.steps} steps)")
    print(f"ratio pipeline/train_step: {pipeline / consumed:.2f} "
          f"({'the pipeline keeps up' if pipeline > consumed else 'INPUT-BOUND'})")


if __name__ == "__main__":
    main(ARGS)
