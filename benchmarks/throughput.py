"""Training throughput of mtrain against a plain `jax.jit` + optax version of the same model.

What it measures: tokens per second of one full training step (forward, backward, Adafactor
update) of the reference decoder-only LM (vocab 8192, d_model 256, d_ff 1024, 4 heads x d_kv 64,
2 layers, batch 16 x length 128) in two implementations:

* **mtrain**: `Trainer(model=DecoderLM(...), optimizer=optimizer.adafactor(...), ...)`, i.e.
  the Flax model with its logical names and sharding constraints, the cross-entropy with z-loss
  1e-4 and the step's metrics (loss, cross-entropy, token count, gradient norm), under the
  layout given by --mesh_shape/--layout_rules, with the default settings: here the loss is
  computed 8 slices of the sequence at a time (`loss.chunks`, automatic), so the
  [16, 128, 8192] logits are never formed whole.
* **plain**: the same maths as pure functions over a dict of arrays (benchmarks/plain_step.py:
  no Flax, no mtrain model code), `optax.adafactor` with the same settings, `jax.jit(...,
  donate_argnums=0)`, always on one device. It forms the logits whole, picks the target logit with a gather
  (`take_along_axis`) and returns only the loss: what one would write by hand, so the ratio
  is what the framework costs or saves.

Both start from the same parameters (mtrain's initial parameters are copied into the plain
dict), and the first two training losses are checked to agree before anything is timed, so the
comparison is of like with like. Each step is compiled first (compile time reported), then the
two are timed in alternating rounds (the order flips every round) with `block_until_ready` on
the loss after every step; the medians over all steps are reported, which keeps the comparison
fair on a shared, noisy machine. FLOPs per token are the usual 6 * (matmul parameters) plus
attention (12 * layers * length * heads * d_kv, full not causal), i.e. model FLOPs, not hardware.

Before the comparison, a table of mtrain alone on the models and settings of a preset
(`--preset cpu`: the reference model plain, in bfloat16, rematerialised, scanned, with 4
microbatches; `--preset gpu`: a ~1B-parameter decoder in bfloat16 with remat and
jax.nn.dot_product_attention): tokens/s, median step time over `--table_steps` steps after
compilation, model FLOP/s per device and MFU (against the device's peak: the table in
mtrain/parallel/targets.py, or on CPU a float32 matmul measured at start), compile time, and peak
memory per device (the device's own count where it keeps one, else XLA's memory analysis of
the compiled step), the seconds the parameter initialisation takes to compile and run
(``init``), and the attention kernel the step ran (with 'auto' on a Hopper GPU, cuDNN's
packed layout with a table fitted to the rows, or the masked kernel). A row may set
``transformer.quantization`` (the GPU preset's 'llama_1b fp8 (tensorwise)', its projections'
matmuls in fp8: MFU still against the bf16 peak), and ``--quantization`` sets it for every
row that does not; a row measured beside the row it quantizes prints the ratio of their
tokens/s as soon as both are in (``ratio llama_1b fp8/bf16 tokens/s: X.XX``).
``--table_budget`` bounds the isolated rows' time together: a row that would start with
under 30 s left says so instead.

    python benchmarks/throughput.py [--steps 10] [--rounds 5] [--dropout 0.1] [--preset cpu]
    python benchmarks/throughput.py --cpu_devices 8 --mesh_shape batch:8 --layout_rules batch:batch
    python benchmarks/throughput.py --preset cpu --rows 6 --quantization fp8 --compare none

The last line is ``ratio mtrain/plain: X.XX`` (> 1 means mtrain is faster).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from presets import AGAINST, COMPARE, PRESETS  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per round per implementation")
    p.add_argument("--rounds", type=int, default=5, help="rounds, alternating the implementations")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout rate (loss check skipped if > 0)")
    p.add_argument("--mesh_shape", default="", help='mtrain mesh, e.g. "batch:2;model:4" ("" = one device)')
    p.add_argument("--layout_rules", default="", help='e.g. "batch:batch;d_ff:model;heads:model"')
    p.add_argument("--cpu_devices", type=int, default=0, help="simulate N CPU devices (XLA_FLAGS)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--warmup_steps", type=int, default=10_000, help="learning-rate warmup")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS) + ["none"],
                   help="the table of models to measure first (default: cpu or gpu, by platform)")
    p.add_argument("--table_steps", type=int, default=20, help="timed steps per table row")
    p.add_argument("--rows", default="", help="the preset's rows to measure, e.g. 0,2 (default: all)")
    p.add_argument("--isolate", action="store_true",
                   help="measure each table row in a process of its own (its own peak memory, "
                        "and a row that fails or runs out of memory spares the others)")
    p.add_argument("--flash_kernel", default=None,
                   help="the comparison's mtrain flash kernel (default: the model's, 'auto')")
    p.add_argument("--flash_max_segments", type=int, default=None,
                   help="the comparison's table size for flash_kernel cudnn_segments")
    p.add_argument("--row_timeout", type=float, default=None, help="seconds per isolated row")
    p.add_argument("--table_budget", type=float, default=None,
                   help="seconds for all the isolated rows: a row gets at most what is left "
                        "(and --row_timeout); one with under 30 s left is skipped, saying so")
    p.add_argument("--quantization", default="none", choices=("none", "fp8", "int8"),
                   help="transformer.quantization of the table's rows that set none")
    p.add_argument("--quantization_scaling", default="tensorwise",
                   choices=("tensorwise", "rowwise"), help="with --quantization")
    p.add_argument("--compare", default=None, choices=sorted(COMPARE) + ["none"],
                   help="the comparison with the plain implementation: cpu (the reference "
                        "model, float32, packed) or gpu (the 1B model, bf16, unpacked, against "
                        "the fast plain baseline); default by platform")
    return p.parse_args()




if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.isolate:  # this process must not take the memory its rows' processes need
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if ARGS.cpu_devices:  # must happen before jax is imported
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(ARGS.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from plain_step import (make_plain_step, packed_batch, plain_optimizer,  # noqa: E402
                        unpacked_batch)


# ---------------------------------------------------------------- benchmark harness


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(label, settings, batch_size, length, microbatches, args, peak):
    """One table row: mtrain alone, compiled once, timed over args.table_steps steps."""
    from mtrain.training import optimizer
    from mtrain.parallel.layout import Layout
    from mtrain.models.transformer import DecoderLM, TransformerConfig
    from mtrain.training.trainer import Trainer

    settings = dict(settings)
    make_optimizer = getattr(optimizer, settings.pop("optimizer", "adafactor"))
    if args.quantization != "none" and "quantization" not in settings:
        settings.update(quantization=args.quantization,
                        quantization_scaling=args.quantization_scaling)
        label = f"{label} [{args.quantization} {args.quantization_scaling}]"
    config = TransformerConfig(**{"max_length": max(512, length), **settings})
    layout = Layout(args.mesh_shape, args.layout_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = make_optimizer(optimizer.learning_rate_schedule(warmup_steps=args.warmup_steps))
    trainer = Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=batch_size, sequence_length=length, num_microbatches=microbatches)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(8)))  # the device's first work
    t0 = time.perf_counter()
    state = jax.block_until_ready(trainer.init_state())  # compile and run the initialisation
    init_s = time.perf_counter() - t0
    phase(f"init {init_s:.1f} s")
    batch = trainer.place_batch(packed_batch(batch_size, length, config.vocab_size))
    t0 = time.perf_counter()
    compiled = trainer.compile_train_step(batch)  # for its attention table, if any
    compile_s = time.perf_counter() - t0
    phase(f"compile {compile_s:.1f} s")
    memory = compiled.memory_analysis()
    state, metrics = compiled(state, batch)  # the first run also warms up
    jax.block_until_ready(metrics)
    phase("first step")
    times = []
    for _ in range(args.table_steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        metrics["loss"].block_until_ready()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak_mem, how = stats["peak_bytes_in_use"], "device"
    else:
        peak_mem = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
        how = "XLA"
    flops = trainer.model.analytic_flops(batch_size, length) / step / jax.device_count()
    params = sum(x.size for x in jax.tree_util.tree_leaves(trainer.abstract_state.params))
    print(f"{label:<48} {params / 1e6:>7.1f}M {batch_size:>4}x{length:<5} "
          f"{batch_size * length / step:>10,.0f} {step * 1e3:>9.1f} {flops / 1e12:>8.3f} "
          f"{100 * flops / peak if peak else float('nan'):>5.1f}% {compile_s:>8.1f} "
          f"{init_s:>6.1f} {peak_mem / 2**30:>7.2f} GiB ({how}) {kernel_ran(trainer, batch)}",
          flush=True)
    del state, batch, compiled
    return batch_size * length / step


def phase(done: str) -> None:
    """Says on stderr that a row's `done` (its initialisation, compile, first step), so that
    a row out of time says how far it got (`isolated`)."""
    print(f"phase: {done}", file=sys.stderr, flush=True)


def kernel_ran(trainer, batch) -> str:
    """The attention kernel a train step of `trainer` on `batch` runs."""
    from mtrain.models import attention
    from mtrain.models.base import UNPACKED

    config = trainer.model.config
    if batch.packing == UNPACKED:
        return "cudnn_causal, no mask (auto: unpacked rows)"
    if batch.packing is not None and batch.packing <= attention.AUTO_TABLE_LIMIT:
        return f"cudnn_segments, table {batch.packing} (auto)"
    if not attention.uses_flash(config.attention, config.flash_kernel, jax.default_backend(),
                                config.dtype, config.attention_head_dim,
                                config.attention_sinks):
        return config.attention if config.attention != "auto" else "einsum (auto)"
    kernel = config.flash_kernel
    return kernel if kernel != "auto" else f"{attention.default_kernel()} (auto)"


def isolated(i, label, preset, args, timeout=None):
    """Row `i` of `preset` measured in a fresh process (`--rows i`) within `timeout` seconds
    (None: no limit), its line printed here."""
    import subprocess

    command = [sys.executable, __file__, f"--preset={preset}", f"--rows={i}", "--compare=none",
               f"--table_steps={args.table_steps}", f"--warmup_steps={args.warmup_steps}",
               f"--mesh_shape={args.mesh_shape}", f"--layout_rules={args.layout_rules}",
               f"--quantization={args.quantization}",
               f"--quantization_scaling={args.quantization_scaling}"]
    if args.cpu_devices:
        command.append(f"--cpu_devices={args.cpu_devices}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    try:
        run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        done = [line[len("phase: "):] for line in stderr.splitlines() if line.startswith("phase: ")]
        print(f"{label:<48} failed: not done in {timeout:.0f} s "
              f"({', '.join(done) if done else 'initialising'}; then out of time)", flush=True)
        return None
    lines = [line for line in run.stdout.splitlines() if line.startswith(label)]
    if lines:
        print(lines[-1], flush=True)
        tokens = re.search(r"M +\d+x\d+ +([\d,]+) ", lines[-1][len(label):])  # its tokens/s
        return float(tokens.group(1).replace(",", "")) if tokens else None
    why = (run.stderr.strip().splitlines() or ["no output"])[-1]  # died before reporting
    print(f"{label:<48} failed (exit {run.returncode}): {why[:160]}", flush=True)
    return None


def print_ratios(measured: dict, label: str, args) -> None:
    """The ratios of `AGAINST` that row `label`, just measured, completes: as soon as both
    of their rows are in (--quantization quantizes both: none)."""
    for row, (base, name) in AGAINST.items():
        if (label in (row, base) and measured.get(row) and measured.get(base)
                and args.quantization == "none"):
            print(f"ratio {name} tokens/s: {measured[row] / measured[base]:.2f}", flush=True)


def main(args):
    from mtrain.training import optimizer
    from mtrain.parallel import targets
    from mtrain.parallel.layout import Layout
    from mtrain.models.transformer import DecoderLM, TransformerConfig
    from mtrain.training.trainer import Trainer

    peak, source = targets.device_peak_flops()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices, "
          f"{jax.devices()[0].device_kind}); peak {peak / 1e12:.3f} TFLOP/s per device ({source})")
    preset = args.preset or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    if preset != "none":
        print(f"\n{'model (preset ' + preset + ')':<48} {'params':>8} {'batch':>10} "
              f"{'tokens/s':>10} {'step ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'compile':>8} "
              f"{'init':>6} {'peak memory':>11}  kernel", flush=True)
        rows = PRESETS[preset]
        chosen = [int(i) for i in args.rows.split(",")] if args.rows else range(len(rows))
        measured, start = {}, time.perf_counter()  # label -> tokens/s
        for i in chosen:
            label = rows[i][0]
            left = (args.table_budget - (time.perf_counter() - start)
                    if args.table_budget else None)
            if args.isolate and left is not None and left < 30:
                print(f"{label:<48} skipped: {max(left, 0):.0f} s left of the table's "
                      f"{args.table_budget:.0f}", flush=True)
                continue
            if args.isolate:
                limits = [x for x in (args.row_timeout, left) if x is not None]
                measured[label] = isolated(i, label, preset, args,
                                           timeout=min(limits) if limits else None)
            else:
                try:
                    measured[label] = measure(*rows[i], args, peak)
                except Exception as e:  # out of memory, a kernel this device lacks: say so
                    print(f"{label:<48} failed: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:160]}", flush=True)
            print_ratios(measured, label, args)
        print()
    if args.compare == "none":
        return
    settings, fast = COMPARE[args.compare or ("gpu" if jax.default_backend() == "gpu" else "cpu")]
    if fast and args.dropout:
        raise SystemExit("--dropout: the GPU comparison is without dropout (flash attention)")
    overrides = {k: getattr(args, k) for k in ("flash_kernel", "flash_max_segments")
                 if getattr(args, k) is not None}
    config = TransformerConfig(**{**settings, "dropout_rate": args.dropout,
                                  "max_length": max(512, args.length), **overrides})
    b, l = args.batch_size, args.length
    tokens_per_step = b * l
    layout = Layout(args.mesh_shape, args.layout_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=args.warmup_steps))
    trainer = Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=b, sequence_length=l, seed=0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices); "
          f"mesh {layout!r}")
    print(f"model: vocab {config.vocab_size} d_model {config.d_model} d_ff {config.d_ff} "
          f"heads {config.num_heads}x{config.d_kv} layers {config.num_layers} dropout "
          f"{config.dropout_rate} {config.activation_dtype} remat {config.remat_policy}; batch "
          f"{b} x length {l} = {tokens_per_step} tokens/step"
          + ("; one example per row (plain: bf16, is_causal flash attention, remat dots)"
             if fast else "; packed rows"))

    np_batch = (unpacked_batch if fast else packed_batch)(b, l, config.vocab_size)
    m_state = trainer.init_state()
    m_batch = trainer.place_batch(np_batch)
    print(f"mtrain's attention: {kernel_ran(trainer, m_batch)}")
    # Same initial parameters for the plain version: fresh copies on one device, as a plain dict.
    device = jax.devices()[0]
    p_params = jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), m_state.params)
    p_opt = plain_optimizer(args.warmup_steps)
    p_state = (p_params, p_opt.init(p_params), jnp.zeros((), jnp.int32))
    p_batch = {k: jax.device_put(v, device) for k, v in np_batch.items()}
    plain_step = make_plain_step(p_opt, config.dropout_rate, seed=1, fast=fast)

    leaves = jax.tree_util.tree_leaves_with_path(p_params)
    n_params = sum(x.size for _, x in leaves)
    lookup = sum(x.size for p, x in leaves if "embedding" in jax.tree_util.keystr(p))
    norms = sum(x.size for p, x in leaves if "norm" in jax.tree_util.keystr(p))
    matmul_params = n_params - lookup - norms
    attn_flops = 12 * config.num_layers * l * config.num_heads * config.d_kv
    flops_per_token = 6 * matmul_params + attn_flops
    if trainer.model.analytic_flops(b, l) != flops_per_token * tokens_per_step:
        raise AssertionError("the benchmark's FLOP count disagrees with the model's")
    print(f"parameters: {n_params:,} ({matmul_params:,} in matmuls); model FLOPs/token ~ "
          f"6*{matmul_params:,} + {attn_flops:,} attention = {flops_per_token / 1e6:.1f} MFLOP")

    # Compile (the first call: trace + compile + one step), then the second step; check losses.
    (m_state, m_metrics), m_compile = timed(
        lambda: jax.block_until_ready(trainer.train_step(m_state, m_batch)))
    (p_state, p_loss), p_compile = timed(lambda: jax.block_until_ready(plain_step(p_state, p_batch)))
    print(f"compile + first step: mtrain {m_compile:.2f} s, plain {p_compile:.2f} s")
    m_losses, p_losses = [float(m_metrics["loss"])], [float(p_loss)]
    m_state, m_metrics = trainer.train_step(m_state, m_batch)
    p_state, p_loss = plain_step(p_state, p_batch)
    m_losses.append(float(m_metrics["loss"]))
    p_losses.append(float(p_loss))
    diff = max(abs(a - c) for a, c in zip(m_losses, p_losses))
    # float32: the same sums in other orders. bfloat16 on both sides (fast): each rounds its
    # activations at other places (mtrain's norms compute in float32), ~1e-2 of a loss of ~10.
    verdict = "OK" if diff < (5e-2 if fast else 1e-4) else ("skipped (dropout masks differ)" if args.dropout else "MISMATCH")
    print(f"loss check: mtrain {m_losses[0]:.6f}, {m_losses[1]:.6f} | plain {p_losses[0]:.6f}, "
          f"{p_losses[1]:.6f} | max |diff| {diff:.2e} -> {verdict}")

    # Timed rounds: the two alternate step by step (so a burst of load from other jobs hits both
    # alike) and the one that goes first flips every round. Wall time is what tokens/s is
    # computed from; the process's CPU time per step is printed too, as it is less sensitive to
    # other jobs on a shared machine.
    def mtrain_step(state):
        state, metrics = trainer.train_step(state, m_batch)
        return state, metrics["loss"]

    states = {"mtrain": m_state, "plain": p_state}
    steps = {"mtrain": mtrain_step, "plain": lambda state: plain_step(state, p_batch)}
    wall = {"mtrain": [], "plain": []}
    cpu = {"mtrain": [], "plain": []}
    for r in range(args.rounds):
        order = ("mtrain", "plain") if r % 2 == 0 else ("plain", "mtrain")
        for name in [name for _ in range(args.steps) for name in order]:  # step by step
            t0, c0 = time.perf_counter(), time.process_time()
            states[name], loss = steps[name](states[name])
            loss.block_until_ready()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        m, p = (statistics.median(wall[k][-args.steps:]) for k in ("mtrain", "plain"))
        print(f"round {r + 1}/{args.rounds}: median step mtrain {m * 1e3:.0f} ms, plain "
              f"{p * 1e3:.0f} ms (this round's ratio {p / m:.2f})")

    tps = {}
    for name in ("mtrain", "plain"):
        step = statistics.median(wall[name])
        tps[name] = tokens_per_step / step
        per_device = tps[name] * flops_per_token / jax.device_count()
        print(f"{name:>6}: median step {step * 1e3:.0f} ms (min {min(wall[name]) * 1e3:.0f}, "
              f"CPU {statistics.median(cpu[name]) * 1e3:.0f} ms), {tps[name]:,.0f} tokens/s, "
              f"{tps[name] * flops_per_token / 1e9:.1f} GFLOP/s, MFU "
              f"{100 * per_device / peak if peak else float('nan'):.1f}%")
    paired = statistics.median(p / m for m, p in zip(wall["mtrain"], wall["plain"]))
    print(f"median of step-by-step paired ratios (plain time / mtrain time): {paired:.2f}")
    print(f"ratio mtrain/plain: {tps['mtrain'] / tps['plain']:.2f}")


if __name__ == "__main__":
    main(ARGS)
