"""Packed causal attention alone: is each kernel right, and how fast is it?

Each candidate computes causal self-attention over rows packed with several examples
(segment ids; padding at the end of a row), forward and backward. It is first checked
against the XLA float32 reference with the same packed mask (`mtrain.models.attention.
reference`) on inputs of the kernel's own precision (bfloat16 on a GPU, the reference
computing in float32 from the same values): the output on real positions and the gradients
of a random projection of it everywhere (the reference's are 0 at padding), as relative
errors |x - ref| / |ref| (norms). bfloat16 lands near 1e-2, float32 near 1e-6, a kernel that
mixes segments or leaves positions unwritten near 1 or NaN. Then the right ones are timed
in bfloat16 (median of --repeats runs of forward + backward). A kernel that is wrong is
reported and not timed.

Candidates: mtrain's flash kernels (`attention.flash` with 'cudnn' (cuDNN given the packed
mask), 'cudnn_segments' (cuDNN's packed-segment layout: a table of each segment's start and
length, `attention.CUDNN_MAX_SEGMENTS` per row; also timed with tables of other sizes, as
cuDNN runs every entry of the table, empty or not), 'triton' and 'splash'), on rows of
--segments examples and on rows of --many_segments short ones (sentence-length examples, as
LM1B packs); and cuDNN on unpacked rows (`is_causal=True`, for scale: it ignores segments,
so it is timed but not checked). 'triton' is tokamax's Pallas Triton kernel
(`tokamax.dot_product_attention`, given the packed mask): where tokamax is not installed it
is reported as one that cannot run.

    python benchmarks/attention.py [--batch 16 --length 2048 --heads 16 --d_kv 128]

On a CPU only splash runs (interpret mode) and sizes default small.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import attention, kernels


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


def candidates(ids, segments):
    """name -> fn(q, k, v) for causal self-attention over the packed rows of `ids`."""
    mask = attention.AttentionMask.of_self(ids, causal=True)
    backend = jax.default_backend()
    names = {"gpu": ("cudnn", "cudnn_segments"), "tpu": ("splash",)}.get(backend, ("splash",))
    out = {f"mtrain flash '{k}'": functools.partial(attention.flash, mask=mask, kernel=k)
           for k in names}
    if backend == "gpu":
        for table in sorted({segments, 256} - {attention.CUDNN_MAX_SEGMENTS}):
            out[f"  'cudnn_segments', table of {table}"] = functools.partial(
                kernels.cudnn_segments, query_ids=ids, memory_ids=ids, causal=True,
                max_segments=table)
    if backend == "gpu":  # last: Triton compiles slowly
        out["mtrain flash 'triton'"] = functools.partial(attention.flash, mask=mask,
                                                         kernel="triton")
    return out


def relative_errors(fn, ids, q, k, v):
    """|out - ref| / |ref| on real positions, and the largest such error of the gradients."""
    real = (ids > 0)[:, :, None, None]
    mask = attention.AttentionMask.of_self(ids, causal=True)
    cot = jax.random.normal(jax.random.key(1), q.shape, q.dtype) * real  # one draw for both

    def both(f, *args):
        out, vjp = jax.vjp(f, *args)
        grads = vjp(cot.astype(out.dtype))
        return (out * real).astype(jnp.float32), [g.astype(jnp.float32) for g in grads]

    out, grads = both(jax.jit(fn), q, k, v)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, ref_grads = both(lambda q, k, v: attention.reference(q, k, v, mask), *wide)
    rel = lambda x, r: float(jnp.linalg.norm(x - r) / jnp.linalg.norm(r))  # noqa: E731
    return rel(out, ref), max(rel(g, r) for g, r in zip(grads, ref_grads))


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
    p.add_argument("--many_segments", type=int, default=64 if gpu else 8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    dtype = jnp.bfloat16 if gpu else jnp.float32  # cuDNN takes no float32
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}: causal self-attention "
          f"over packed rows, forward + backward")

    def inputs(batch, length, heads, seed):
        keys = jax.random.split(jax.random.key(seed), 3)
        shape = (batch, length, heads, args.d_kv)
        return [(jax.random.normal(key, shape) / args.d_kv**0.25).astype(dtype) for key in keys]

    check = (4, min(1024, args.length), min(8, args.heads))
    tolerance = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    print(f"checked at {check[0]} x {check[1]}, {check[2]} heads, {jnp.dtype(dtype).name} "
          f"(right: relative errors under {tolerance:g}); timed at {args.batch} x {args.length}"
          f", {args.heads} heads x {args.d_kv}, bfloat16")
    q, k, v = inputs(args.batch, args.length, args.heads, 0)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    for segments in (args.segments, args.many_segments):
        check_ids = packed_ids(check[0], check[1], min(segments, check[1] // 8), seed=1)
        ids = packed_ids(args.batch, args.length, segments)
        print(f"\nrows of {segments} examples\n{'kernel':<40} {'out error':>10} "
              f"{'grad error':>10} {'ms':>9}")
        reference_ms = timing(lambda q, k, v: attention.reference(
            q, k, v, attention.AttentionMask.of_self(ids, causal=True)), q, k, v, args.repeats)
        print(f"{'XLA reference (dense packed mask)':<40} {'-':>10} {'-':>10} "
              f"{reference_ms * 1e3:>9.2f}", flush=True)
        checked = candidates(check_ids, segments)
        for name, fn in candidates(ids, segments).items():
            try:
                out_err, grad_err = relative_errors(checked[name], check_ids,
                                                    *inputs(*check, seed=1))
                right = out_err < tolerance and grad_err < tolerance  # NaN is not right
                ms = f"{timing(fn, q, k, v, args.repeats) * 1e3:>9.2f}" if right else "    wrong"
            except Exception as e:  # a kernel this jax or device cannot run
                print(f"{name:<40} cannot run: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80]}", flush=True)
                continue
            print(f"{name:<40} {out_err:>10.2e} {grad_err:>10.2e} {ms}", flush=True)
    if gpu:
        unpacked = timing(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=1.0, is_causal=True, implementation="cudnn"), q, k, v, args.repeats)
        print(f"\n{'cuDNN is_causal, unpacked (scale)':<40} {'-':>10} {'-':>10} "
              f"{unpacked * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
