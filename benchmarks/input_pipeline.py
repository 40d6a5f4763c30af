"""Input-pipeline throughput beside what the train step consumes, on a gin config.

The pipeline must never be what a run waits for. This builds the run a gin config describes
(default: the quickstart, data x model parallel over 8 simulated CPU devices), then measures

* **tf.data** (the baseline): tokens/s of the tf.data pipeline that Grain replaced
  (benchmarks/tfdata_baseline.py: the same lanes, tokeniser and packer);
* **grain**: tokens/s of the training pipeline (Grain: read by index, shuffle, tokenise,
  pack, batch, this process's rows) in this process (`run.data_workers=0`) and with
  `--workers` worker processes (default: the run's default for this host);
* **train step**: tokens/s that the jitted train step consumes when fed batches that are
  already in memory (one batch placed on the mesh, stepped repeatedly);

each counting real (non-padding) tokens after a warm-up, also per host core (tokens/s over
the host's cores), and prints the ratios grain / tf.data and grain / train step (above 1
the pipeline keeps up, and the run is not input-bound; the target is 1.5).

    python benchmarks/input_pipeline.py [--gin_file quickstart.gin] [--gin_param ...]
        [--cpu_devices 8] [--batches 200] [--steps 30] [--workers N]
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
    p.add_argument("--workers", type=int, default=None,
                   help="Grain worker processes (default: the run's default for this host, "
                        "at least 1)")
    p.add_argument("--skip_tfdata", action="store_true", help="no tf.data baseline")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:  # before jax is imported
    from mtrain.parallel.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(ARGS.cpu_devices)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

from mtrain import run as run_lib  # noqa: E402
from mtrain.data import pipeline  # noqa: E402
from mtrain.io.metrics import setup_logging  # noqa: E402


def tokens(batch) -> int:
    return int(sum((batch[k] > 0).sum() for k in batch if k.endswith("_segment_ids")))


def main(args):
    setup_logging()
    run_lib.parse_config(args.gin_file or ["quickstart.gin"], args.gin_param)
    exp = run_lib.build(model_dir=tempfile.mkdtemp(prefix="mtrain-bench-"))
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, batch "
          f"{exp.batch_size} x {exp.sequence_length}, task {exp.task.name}")

    cores = os.cpu_count() or 1

    def measure(name, batches):
        t0 = time.perf_counter()
        first = next(batches)
        start_up = time.perf_counter() - t0
        for _ in range(20):  # warm-up: every lane started, prefetch buffers full
            next(batches)
        count, t0 = 0, time.perf_counter()
        for _ in range(args.batches):
            count += tokens(next(batches))
        rate = count / (time.perf_counter() - t0)
        print(f"{name:<22} {rate:>10,.0f} tokens/s  {rate / cores:>9,.0f} per host core "
              f"(first batch {start_up:.2f} s; {count / args.batches / first['targets'].size:.1%}"
              f" of positions are real tokens)")
        return rate, first

    print(f"{args.batches} batches timed after 20 of warm-up; {cores} host cores")
    rates = {}
    if not args.skip_tfdata:
        import tfdata_baseline  # beside this file

        dataset = tfdata_baseline.train_dataset(
            exp.source, exp.vocab, "train", exp.task.features, exp.sequence_length,
            exp.batch_size, exp.config.seed)
        numpy_batches = ({k: v.numpy() for k, v in b.items()} for b in dataset)
        rates["tf.data"], _ = measure("tf.data (fc8be58)", numpy_batches)
    workers = args.workers if args.workers is not None else max(1, pipeline.default_workers())
    for count in (0, workers):
        batches = pipeline.batches(exp.source, exp.vocab, "train", pipeline.BatchSettings(
            sequence_length=exp.sequence_length, batch_size=exp.batch_size,
            seed=exp.config.seed, train=True, workers=count))
        rates[f"grain {batches.workers}"], first = measure(
            f"grain, {batches.workers} workers", batches)
        batches.close()
    pipeline_rate = max(v for k, v in rates.items() if k.startswith("grain"))
    if "tf.data" in rates:
        print("ratio grain/tf.data: " + ", ".join(
            f"{k.split()[1]} workers {v / rates['tf.data']:.2f}"
            for k, v in rates.items() if k.startswith("grain")))

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
    ratio = pipeline_rate / consumed
    print(f"ratio grain/train_step: {ratio:.2f} "
          f"({'the pipeline keeps up' if ratio > 1.5 else 'INPUT-BOUND' if ratio < 1 else 'below the 1.5 target'})")


if __name__ == "__main__":
    main(ARGS)
