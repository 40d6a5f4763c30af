"""Compile time of a train step against depth, with and without a scanned layer stack.

With `transformer.scan_layers`, XLA compiles one layer and loops over it, so compile time
stays flat as the model deepens; unrolled, it grows with every layer. This compiles the
train step of a paper config (default: LM size 0 on its batch:32 mesh, 32 simulated CPU
devices, as --mode=plan does) at each depth, both ways, and prints the seconds.

    python benchmarks/compile_time.py [--gin_file paper/lm_size_0.gin] [--depths 6,24]
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", default="paper/lm_size_0.gin")
    p.add_argument("--depths", default="6,24")
    p.add_argument("--devices", type=int, default=32)
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", ARGS.devices)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(args):
    from mtrain import run as run_lib
    from mtrain.io.metrics import setup_logging

    setup_logging()
    print(f"{args.gin_file} on {args.devices} simulated CPU devices")
    print(f"{'layers':>6} {'scan':>5} {'trace+compile s':>16} {'HLO chars':>10}")
    for depth in [int(d) for d in args.depths.split(",")]:
        for scan in (False, True):
            run_lib.parse_config([args.gin_file], [f"transformer.num_layers={depth}",
                                                   f"transformer.scan_layers={scan}"])
            exp = run_lib.build(model_dir="unused", mode="plan")
            t0 = time.perf_counter()
            compiled = exp.trainer.compile_train_step()
            seconds = time.perf_counter() - t0
            print(f"{depth:>6} {str(scan):>5} {seconds:>16.1f} {len(compiled.as_text()):>10,}",
                  flush=True)


if __name__ == "__main__":
    main(ARGS)
