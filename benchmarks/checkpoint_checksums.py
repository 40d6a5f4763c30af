"""What checksummed checkpoints cost: saving and restoring the 1B preset's train state.

The state of `configs/models/lm_1b.gin` (943.8M parameters in float32 and Adafactor's
factored statistics, ~3.8 GB) is saved and restored twice in this process: by orbax alone
(the baseline, `StandardCheckpointer`), and by mtrain's `Checkpoints`, which adds the
checksum of every array to the meta before the save and checks the restored arrays against
it, and that they are finite, after the restore. Prints the times and the ratios.

    python benchmarks/checkpoint_checksums.py [--cpu_devices 8] [--model lm_1b]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {  # name -> (TransformerConfig settings, batch, length): configs/models/*.gin
    "lm_1b": (dict(vocab_size=32768, d_model=2048, d_ff=8192, num_heads=16, d_kv=128,
                   num_layers=16, max_length=2048), 16, 2048),
    "lm_tiny": (dict(vocab_size=2048, d_model=128, d_ff=512, num_heads=4, d_kv=32,
                     num_layers=2, max_length=128), 16, 128),
}


class _Position:
    """A stand-in for the input pipeline: a position file per process."""

    def save(self, directory):
        prefix = os.path.join(directory, "position.process-0-of-1")
        with open(prefix + ".json", "w") as f:
            f.write('{"position": 0}\n')
        return prefix

    def restore(self, directory):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="lm_1b", choices=sorted(MODELS))
    p.add_argument("--cpu_devices", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.cpu_devices:
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)

    import jax
    import orbax.checkpoint as ocp

    from mtrain.io import checksums
    from mtrain.training import optimizer
    from mtrain.io.checkpoints import Checkpoints
    from mtrain.parallel.layout import Layout
    from mtrain.models.transformer import DecoderLM, TransformerConfig
    from mtrain.training.trainer import Trainer

    settings, batch, length = MODELS[args.model]
    layout = Layout("batch:%d" % jax.device_count() if jax.device_count() > 1 else "",
                    "batch:batch" if jax.device_count() > 1 else "")
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    trainer = Trainer(model=DecoderLM(TransformerConfig(**settings)), optimizer=opt, layout=layout,
                      mesh=mesh, batch_size=batch, sequence_length=length)
    t0 = time.perf_counter()
    state = jax.block_until_ready(trainer.init_state())
    size = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"{args.model} train state {size / 2**30:.2f} GiB, initialised in "
          f"{time.perf_counter() - t0:.1f} s")
    checksums.of_arrays(state)  # compiled once, outside the timings
    abstract = trainer.sharded_abstract_state()
    root = tempfile.mkdtemp(prefix="mtrain-checksums-")
    rows = {"orbax save": [], "mtrain save (+ checksums)": [], "orbax restore": [],
            "mtrain restore (+ verification)": [], "checksums alone": []}
    try:
        for i in range(args.repeats):
            plain = os.path.join(root, f"plain-{i}")
            checkpointer = ocp.StandardCheckpointer()
            t0 = time.perf_counter()
            checkpointer.save(plain, state)
            checkpointer.wait_until_finished()
            rows["orbax save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(checkpointer.restore(plain, abstract))
            rows["orbax restore"].append(time.perf_counter() - t0)

            ours = Checkpoints(os.path.join(root, f"mtrain-{i}"), async_save=False)
            t0 = time.perf_counter()
            ours.save(1, state, _Position(), {})
            ours.wait()
            rows["mtrain save (+ checksums)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(ours.read(1, abstract, {}).state)
            rows["mtrain restore (+ verification)"].append(time.perf_counter() - t0)
            ours.close()
            t0 = time.perf_counter()
            checksums.of_arrays(state)
            rows["checksums alone"].append(time.perf_counter() - t0)
            shutil.rmtree(plain)
            shutil.rmtree(os.path.join(root, f"mtrain-{i}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {name: statistics.median(times) for name, times in rows.items()}
    print(f"\n{'':<34} {'median s':>9}  (of {args.repeats})")
    for name, seconds in median.items():
        print(f"{name:<34} {seconds:>9.2f}")
    print(f"\nratio mtrain/orbax: save {median['mtrain save (+ checksums)'] / median['orbax save']:.2f}, "
          f"restore {median['mtrain restore (+ verification)'] / median['orbax restore']:.2f}")


if __name__ == "__main__":
    main()
