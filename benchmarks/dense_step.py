"""What mtrain's dense train step does beyond the plain `jax.jit` + optax step, read from the
compiled programs: bytes each step moves to and from memory, by what they are for.

The plain step is benchmarks/plain_step.py's fast GPU baseline (throughput.py's
``--compare=gpu``: bf16 compute from float32 parameters, `jax.nn.dot_product_attention(
is_causal=True)`, each layer under `jax.checkpoint` keeping its matmuls, the loss and z-loss
of the whole logits in float32, `optax.adafactor`); mtrain's is `Trainer(model=DecoderLM(
lm_1b's settings), optimizer=optimizer.adafactor(...))` on one device, unpacked rows, with its defaults (the loss a slice
of the length at a time, `loss.chunks`; the step's metrics; the batch's packing, which picks
the attention kernel). Both are compiled ahead of time from shapes and their optimized HLO is
walked (`hlo_bytes.account`: each instruction reads its operands and writes its result once,
a loop's body as many times as its trip count; XLA's own `cost_analysis`, which counts it
once, is printed too), and each instruction's bytes go to one item, told apart by the shapes
of the arrays it touches:

- logits, elementwise: the loss's passes over [batch, length, vocab] (or a slice's) values;
- logits, matmuls: the output projection and its two gradients;
- d(kernel) over the slices: adding each slice's gradient of the output projection into a
  float32 accumulator (and zeroing it), which the whole-logits step does not do;
- attention scores ([.., length, length]: XLA's attention on a CPU) or attention (cuDNN's, on a
  GPU, for both);
- vocab tables: the embedding's and output projection's gradients and optimizer (with the
  gradient norm of the step's metrics);
- the rest: the layers, their gradients and optimizer.

Variants of mtrain's step show what each part costs: ``autodiff-loss`` (the cross-entropy as
it was before issue 61, its gradient traced by autodiff, instead of `losses`' written out),
``chunks=N`` (`loss.chunks`), ``no-grad-norm`` (the step's metrics without the gradient
norm), ``jax-dots`` (remat 'dots' as jax's `checkpoint_dots`, which the plain step keeps: the
backward pass runs attention's forward again, `mtrain/models/remat.py`), ``table-1`` (on a
Hopper GPU, the unpacked rows through cuDNN's packed layout with a table of one, as before
they ran its causal kernel with no mask, `kernels.cudnn_causal`). With ``--steps`` > 0
each step is also timed (median of that many, after two).

    python benchmarks/dense_step.py                      # CPU: d_model 256, 2 layers, 4 x 512
    python benchmarks/dense_step.py --shape 1b --steps 10  # a GPU: lm_1b, 16 x 2048
    python benchmarks/dense_step.py --variants mtrain,chunks=1,chunks=4 --top 20
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import plain_step  # noqa: E402  (the plain step)
from presets import ONE_B  # noqa: E402
from hlo_bytes import account  # noqa: E402

# lm_1b (configs/models/lm_1b.gin) and a CPU-sized model of the same structure, in which the
# logits dominate as they do at 1B (vocab 32768 against d_model 256).
SHAPES = {"1b": (ONE_B, 16, 2048),
          "small": ({**ONE_B, "d_model": 256, "d_ff": 1024, "num_heads": 4,
                     "d_kv": 64, "num_layers": 2, "max_length": 512}, 4, 512)}
ITEMS = ("logits, elementwise", "logits, matmuls", "d(kernel) over the slices",
         "attention scores", "attention", "vocab tables", "the rest")


def classifier(batch, length, vocab, d_model, chunks):
    """The item of an instruction, from the sizes of the arrays it touches (None where they
    cannot tell the items apart)."""
    logits = {batch * length * vocab, batch * length * vocab // chunks}
    table = d_model * vocab
    if table in logits or vocab in (length, d_model):
        return None  # (lm_1b: a slice's 2048 x vocab logits are the output kernel's size)

    def classify(op, touched, in_loop, flops):
        sizes = [math.prod(dims) for _, dims in touched]
        with_vocab = [s for (_, dims), s in zip(touched, sizes) if vocab in dims]
        if in_loop and not flops and table in with_vocab:
            return "d(kernel) over the slices"
        if any(list(dims[-2:]) == [length, length] or dims.count(length) >= 2
               for _, dims in touched):
            return "attention scores"
        if logits & set(with_vocab):
            return "logits, matmuls" if flops else "logits, elementwise"
        if table in with_vocab or vocab in sizes:
            return "vocab tables"
        return "the rest"

    return classify


# ---------------------------------------------------------------- the two steps


def autodiff_cross_entropy(logits, targets, weights, *, z_loss=0.0, label_smoothing=0.0,
                           classes=0):
    """`losses.cross_entropy` as it was before issue 61: the same loss, its gradient traced."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    real = None
    if 0 < classes < vocab:
        real = jnp.arange(vocab) < classes
        logits, vocab = jnp.where(real, logits, -jnp.inf), classes
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    xent = log_z - target_logit
    if label_smoothing:
        confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
        total = jnp.sum(logits if real is None else jnp.where(real, logits, 0.0), axis=-1)
        loss = log_z - (confidence - low) * target_logit - low * total
        loss = loss + (confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
    else:
        loss = xent
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    weights = weights.astype(jnp.float32)
    return loss * weights, xent * weights


def build(variant, settings, batch, length):
    """(the step lowered from shapes, a function making real arguments, its loss chunks)."""
    from mtrain.models import blocks, remat
    from mtrain.models.transformer import DecoderLM, TransformerConfig
    from mtrain.parallel.layout import Layout
    from mtrain.training import language_modeling, losses, optimizer, state
    from mtrain.training import trainer as trainer_lib

    config = TransformerConfig(**settings, dropout_rate=0.0)
    layout = Layout("", "")
    chunks = int(variant.split("=")[1]) if variant.startswith("chunks=") else 0
    np_batch = plain_step.unpacked_batch(batch, length, config.vocab_size)
    # The variants swap a part of mtrain (public names) while the step is traced.
    swaps = {"autodiff-loss": [(losses, "cross_entropy", autodiff_cross_entropy),
                               (language_modeling, "cross_entropy", autodiff_cross_entropy)],
             "no-grad-norm": [(trainer_lib, "step_metrics", lambda g, *a: {
                 **state.step_metrics({}, *a), "grad_norm": 0.0})],
             "jax-dots": [(blocks, "REMAT_POLICIES", {
                 **remat.REMAT_POLICIES, "dots": jax.checkpoint_policies.checkpoint_dots})],
             "table-1": [(trainer_lib, "packing_of", lambda batch: 1)],
             }.get(variant, [])
    originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, value in swaps:
        setattr(module, name, value)
    try:
        trainer = trainer_lib.Trainer(
            model=DecoderLM(config), layout=layout, mesh=layout.make_mesh(jax.devices()[:1]),
            optimizer=optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10_000)),
            objective=language_modeling.LanguageModeling(losses.LossConfig(chunks=chunks)),
            batch_size=batch, sequence_length=length, seed=0)
        # (placed: its packing picks the attention kernel, as in a run, `attention.flash`)
        placed = trainer.place_batch(np_batch)
        lowered = trainer.lower_train_step(placed) if variant != "plain" else None
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
    if variant != "plain":
        return lowered, lambda: (trainer.init_state(), placed), trainer.loss_chunks
    opt = plain_step.plain_optimizer(10_000)
    step = plain_step.make_plain_step(opt, 0.0, seed=1, fast=True)
    params = trainer.abstract_state.params
    shapes = (params, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((), jnp.int32))

    def real():
        p = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), trainer.init_state().params)
        return (p, opt.init(p), jnp.zeros((), jnp.int32)), jax.device_put(np_batch)

    batch_shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in np_batch.items()}
    return step.lower(shapes, batch_shapes), real, trainer.loss_chunks


def timed(step, real, steps):
    """The median time of `steps` steps, after two."""
    (state, batch), times = real(), []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times += [time.perf_counter() - t0] if i >= 2 else []
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = jax.default_backend() == "gpu"
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b" if gpu else "small")
    p.add_argument("--variants",
                   default="plain,mtrain,jax-dots,table-1,autodiff-loss,chunks=4,chunks=1,"
                           "no-grad-norm")
    p.add_argument("--steps", type=int, default=10 if gpu else 0, help="timed steps (0: none)")
    p.add_argument("--top", type=int, default=0, help="print each step's largest instructions")
    args = p.parse_args()
    settings, b, l = SHAPES[args.shape]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; vocab "
          f"{settings['vocab_size']} d_model {settings['d_model']} d_ff {settings['d_ff']} "
          f"layers {settings['num_layers']}, {b} x {l} tokens, bf16, remat dots")
    results = {}
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        lowered, real, chunks = build(variant, settings, b, l)
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        xla = compiled.cost_analysis()
        xla = xla[0] if isinstance(xla, list) else xla
        label = variant if variant == "plain" else f"{variant} (loss chunks {chunks})"
        classify = classifier(b, l, settings["vocab_size"], settings["d_model"], chunks) or (
            lambda *a: "all (items: --shape small)")
        items, rows = account(compiled.as_text(), classify)
        memory = compiled.memory_analysis().temp_size_in_bytes
        ms = timed(compiled, real, args.steps) * 1e3 if args.steps and real else None
        results[variant] = (items, ms)
        total = sum(v[0] for v in items.values())
        print(f"\n{label}: {total / 1e9:.3f} GB moved, "
              f"{sum(v[1] for v in items.values()) / 1e9:.1f} GFLOP in dots; XLA's "
              f"cost_analysis {xla.get('bytes accessed', 0) / 1e9:.3f} GB, "
              f"{xla.get('flops', 0) / 1e9:.1f} GFLOP (loop bodies once); temporaries "
              f"{memory / 2**20:.0f} MiB; compiled in {seconds:.1f} s"
              + (f"; step {ms:.1f} ms" if ms else ""))
        for item in (*ITEMS, "all (items: --shape small)"):
            if item in items:
                print(f"  {item:<28} {items[item][0] / 1e9:8.3f} GB {items[item][1] / 1e9:8.1f} GF")
        for r in sorted(rows, reverse=True)[:args.top]:
            print(f"    {r[0] / 1e6:9.1f} MB {r[1] / 1e9:7.2f} GF {r[2]:<26} {r[3]:<10} "
                  f"{r[4][:48]} {r[5]}")
    if "plain" in results:
        plain_bytes = sum(v[0] for v in results["plain"][0].values())
        print()
        for variant, (items, ms) in results.items():
            if variant != "plain":
                extra = sum(v[0] for v in items.values()) - plain_bytes
                print(f"ratio bytes {variant}/plain: "
                      f"{sum(v[0] for v in items.values()) / plain_bytes:.3f} "
                      f"({extra / 1e9:+.3f} GB)"
                      + (f"; time plain/{variant}: {results['plain'][1] / ms:.3f}"
                         if ms and results["plain"][1] else ""))


if __name__ == "__main__":
    main()
