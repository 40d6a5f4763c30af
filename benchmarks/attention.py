"""Packed causal attention alone: is each kernel right, and how fast is it?

Each candidate computes causal self-attention over rows packed with several examples
(segment ids, positions restarting), forward and backward. It is first checked against the
XLA float32 reference with the same packed mask (`mtrain.models.attention.reference`), on
the real positions only (what padding computes is never used): output and the gradients of
a random projection of it. Then the correct ones are timed in bfloat16 (median of
--repeats runs of forward + backward). A kernel that is wrong is reported and not timed.

Candidates: mtrain's flash kernels (`attention.flash` with 'cudnn', 'triton', 'splash'),
cuDNN's packed-segment layout (jax's private `fused_attention_stablehlo` with per-segment
lengths and offsets: the fastest if it is right), and cuDNN on unpacked rows
(`is_causal=True`, for scale: it ignores segments, so it is timed but not checked).
tokamax 0.0.12 (`tokamax.dot_product_attention`) takes no segment ids, only a dense mask,
so it adds nothing over 'cudnn' here and is not a candidate.

    python benchmarks/attention.py [--batch 16 --length 2048 --heads 16 --d_kv 128]

On a CPU only the Pallas kernels run (interpret mode) and sizes default small.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import attention


def packed_ids(batch, length, segments, seed=0):
    """Segment ids with `segments` examples per row and a little padding at the end."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for r in range(batch):
        end = length - int(rng.integers(0, length // 16))
        cuts = sorted(rng.choice(np.arange(1, end), size=segments - 1, replace=False))
        for s, (a, b) in enumerate(zip([0, *cuts], [*cuts, end])):
            ids[r, a:b] = s + 1
    return jnp.asarray(ids)


def segment_table(ids: np.ndarray, max_segments: int):
    """cuDNN's packed layout: per row the length of each segment [batch, max_segments] and
    its start [batch, max_segments + 1], -1 after the last (jax's
    `fused_attention_stablehlo.dot_product_attention` `q_seqlen`/`q_offsets`)."""
    ids = np.asarray(ids)
    lengths = -np.ones((ids.shape[0], max_segments), np.int32)
    offsets = -np.ones((ids.shape[0], max_segments + 1), np.int32)
    for r, row in enumerate(ids):
        starts = [i for i in range(len(row)) if row[i] > 0 and (i == 0 or row[i] != row[i - 1])]
        for s, start in enumerate(starts):
            offsets[r, s] = start
            lengths[r, s] = int((row == row[start]).sum())
    return jnp.asarray(lengths), jnp.asarray(offsets)


def cudnn_packed(ids, max_segments):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    lengths, offsets = segment_table(ids, max_segments)

    def fn(q, k, v):
        return cudnn.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
            kv_offsets=offsets, scale=1.0, mask_type=cudnn.MaskType.PADDING_CAUSAL)
    return fn


def candidates(ids, segments):
    mask = attention.AttentionMask.of_self(ids, causal=True)
    out = {f"mtrain flash '{k}'": (lambda q, k_, v, k=k: attention.flash(q, k_, v, mask, k))
           for k in ("cudnn", "triton", "splash")}
    if jax.default_backend() != "gpu":
        del out["mtrain flash 'cudnn'"]
        return out
    if jax.default_backend() != "tpu":
        del out["mtrain flash 'splash'"]
    out["cuDNN packed layout (q_offsets)"] = cudnn_packed(ids, segments)
    return out


def error(fn, ids, q, k, v):
    """Max |difference| from the float32 reference on real positions: output, gradients."""
    real = (ids > 0)[:, :, None, None]
    mask = attention.AttentionMask.of_self(ids, causal=True)
    cot = jax.random.normal(jax.random.key(1), q.shape) * real

    def both(f):
        out, vjp = jax.vjp(f, q, k, v)
        return out * real, vjp(cot)

    out, grads = both(fn)
    ref, ref_grads = both(lambda q, k, v: attention.reference(q, k, v, mask))
    return (float(jnp.abs(out - ref).max()),
            max(float(jnp.abs(g - r).max()) for g, r in zip(grads, ref_grads)))


def timing(fn, q, k, v, repeats):
    step = jax.jit(jax.value_and_grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(),
                                      argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16 if gpu else 2)
    p.add_argument("--length", type=int, default=2048 if gpu else 256)
    p.add_argument("--heads", type=int, default=16 if gpu else 2)
    p.add_argument("--d_kv", type=int, default=128 if gpu else 64)
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; causal attention over rows "
          f"packed with {args.segments} examples")

    def inputs(batch, length, heads, dtype, seed):
        keys = jax.random.split(jax.random.key(seed), 3)
        shape = (batch, length, heads, args.d_kv)
        return [(jax.random.normal(key, shape) / args.d_kv**0.25).astype(dtype) for key in keys]

    check = (4, min(1024, args.length), min(8, args.heads))
    check_ids = packed_ids(check[0], check[1], args.segments, seed=1)
    q32 = inputs(*check, jnp.float32, 1)
    ids = packed_ids(args.batch, args.length, args.segments)
    q, k, v = inputs(args.batch, args.length, args.heads, jnp.bfloat16, 0)
    print(f"checked at {check[0]} x {check[1]}, {check[2]} heads, float32; timed at {args.batch} "
          f"x {args.length}, {args.heads} heads x {args.d_kv}, bfloat16, forward + backward")
    print(f"{'kernel':<36} {'max |out diff|':>14} {'max |grad diff|':>15} {'ms':>9}")
    reference_ms = timing(lambda q, k, v: attention.reference(
        q, k, v, attention.AttentionMask.of_self(ids, causal=True)), q, k, v, args.repeats)
    print(f"{'XLA reference (dense packed mask)':<36} {'-':>14} {'-':>15} {reference_ms * 1e3:>9.2f}")
    for name, fn in candidates(check_ids, args.segments).items():
        try:
            out_err, grad_err = error(fn, check_ids, *q32)
        except Exception as e:  # a kernel this jax or device cannot run
            print(f"{name:<36} cannot run: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        right = out_err < 1e-3 and grad_err < 1e-2  # float32: ~1e-6 when right, ~1 when not
        timed_fn = candidates(ids, args.segments)[name]
        ms = f"{timing(timed_fn, q, k, v, args.repeats) * 1e3:>9.2f}" if right else "    wrong"
        print(f"{name:<36} {out_err:>14.2e} {grad_err:>15.2e} {ms}")
    if gpu:
        unpacked = timing(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=1.0, is_causal=True, implementation="cudnn"), q, k, v, args.repeats)
        print(f"{'cuDNN is_causal, unpacked (scale)':<36} {'-':>14} {'-':>15} {unpacked * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
