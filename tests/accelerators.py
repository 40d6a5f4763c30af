"""The accelerators' attention kernels on this CPU, for tests (a seam the library does not
expose): tokamax's Triton kernel in Pallas' interpret mode, and cuDNN's two calls emulated
(the masked one by jax's XLA implementation, the packed-segment layout as jax documents it),
each behind a monkeypatched `jax.default_backend() == 'gpu'`."""

import jax
import jax.numpy as jnp

from mtrain.models import attention


def triton_interpreted(monkeypatch):
    """A 'gpu' backend on which tokamax's Triton kernel runs on this CPU: its forward in
    Pallas' interpret mode (the kernel's own code), its gradient that of the same call on
    XLA. The kernel's backward cannot run in the interpreter, which binds `program_id` only
    outside control flow, and that kernel calls it under `pl.when`: `benchmarks/attention.py`
    checks it against the reference on a GPU. Returns the implementations called."""
    import tokamax
    from jax.experimental.pallas import tpu as pltpu

    calls, original, backend = [], tokamax.dot_product_attention, jax.default_backend

    def on_cpu(q, k, v, mask, **kwargs):  # tokamax told 'gpu' would ask for TF32 products
        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", backend)
            return original(q, k, v, mask=mask, **kwargs)

    def interpreted(q, k, v, *, mask, implementation, **kwargs):
        calls.append(implementation)

        @jax.custom_vjp
        def attend(q, k, v, mask):
            # (pltpu's switch turns on the interpreter of every Pallas kernel: given True,
            # jax's own HLO one, which runs Triton kernels)
            with tokamax.config.cross_compile(True), pltpu.force_tpu_interpret_mode(True):
                return on_cpu(q, k, v, mask, implementation=implementation, **kwargs)

        def on_xla(q, k, v, mask):
            return on_cpu(q, k, v, mask, implementation="xla", **kwargs)

        def backward(saved, g):
            q, k, v, mask = saved
            return (*jax.vjp(lambda q, k, v: on_xla(q, k, v, mask), q, k, v)[1](g), None)

        attend.defvjp(lambda q, k, v, mask: (attend(q, k, v, mask), (q, k, v, mask)), backward)
        return attend(q, k, v, mask)

    monkeypatch.setattr(tokamax, "dot_product_attention", interpreted)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return calls


def softmax_attention(q, k, v, dense, scale=1.0):
    """`attention.reference` without its layout constraint (the emulated kernel runs inside
    the flash path's shard_map, on one shard); grouped key/value heads, as cuDNN takes them,
    each serving its query heads."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.where(dense, scale * jnp.einsum("blhk,bmhk->bhlm", q, k), attention.NEG_INF)
    return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(logits, axis=-1), v)


def emulated_cudnn_packed(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale,
                          mask_type, sliding_window_length=None, **unused):
    """cuDNN's packed-segment layout as jax documents it, on the CPU: segment s of a row holds
    positions [offset, offset + length); it attends within itself (causally under
    PADDING_CAUSAL; with `sliding_window_length` W, to the W positions up to itself), the
    logits times `scale`. Positions outside every segment are never written by cuDNN: here
    they come out NaN, forward and backward, so that a caller who used them would fail. A
    table of one entry is jax's padding mask, which passes cuDNN no starts: the entry starts
    at position 0 whatever its offset says."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    assert not unused, unused
    window = sliding_window_length or 0

    def labels(lengths, offsets, n):  # [b, n]: 1 + the segment holding each position, or 0
        pos = jnp.arange(n)[None, None]
        start = offsets[:, :-1, None] if offsets.shape[1] > 2 else 0  # (a table of one)
        inside = (lengths[..., None] >= 0) & (pos >= start) & (pos < start + lengths[..., None])
        return jnp.where(inside.any(1), jnp.argmax(inside, 1) + 1, 0)

    causal = mask_type == cudnn.MaskType.PADDING_CAUSAL

    def parts(query, memory):  # (custom_vjp's functions must not close over traced values)
        mask = attention.AttentionMask(query, memory, causal, window=window).dense()
        return mask, (query > 0)[..., None, None], (memory > 0)[..., None, None]

    @jax.custom_vjp
    def attend(q, k, v, query, memory):
        mask, written_q, _ = parts(query, memory)
        return jnp.where(written_q, softmax_attention(q, k, v, mask, scale), jnp.nan)

    def forward(q, k, v, query, memory):
        mask, written_q, _ = parts(query, memory)
        out, vjp = jax.vjp(lambda q, k, v: softmax_attention(q, k, v, mask, scale), q, k, v)
        return jnp.where(written_q, out, jnp.nan), (vjp, query, memory)

    def backward(saved, g):
        vjp, query, memory = saved
        _, written_q, written_k = parts(query, memory)
        dq, dk, dv = vjp(jnp.where(written_q, g, 0))
        return (jnp.where(written_q, dq, jnp.nan), jnp.where(written_k, dk, jnp.nan),
                jnp.where(written_k, dv, jnp.nan), None, None)

    attend.defvjp(forward, backward)
    return attend(q, k, v, labels(q_seqlen, q_offsets, q.shape[1]),
                  labels(kv_seqlen, kv_offsets, k.shape[1]))


def on_a_gpu_emulated(monkeypatch):
    """A 'gpu' backend whose cuDNN kernels run on the CPU: the masked one (and the causal
    one, given no mask: 'cudnn_causal') through jax's XLA implementation, the packed layout
    through `emulated_cudnn_packed`. Returns the calls."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    calls, original = [], jax.nn.dot_product_attention

    def masked(*args, implementation=None, **kwargs):
        calls.append("cudnn" if kwargs.get("mask") is not None else "cudnn_causal")
        return original(*args, implementation="xla", **kwargs)

    def packed(*args, **kwargs):
        calls.append(("cudnn_segments", kwargs["q_offsets"].shape))
        return emulated_cudnn_packed(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", masked)
    monkeypatch.setattr(cudnn, "dot_product_attention", packed)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return calls


def on_a_hopper_gpu_emulated(monkeypatch):
    """`on_a_gpu_emulated` with compute capability 9.0: what 'auto' picks on an H100 (cuDNN,
    and its packed layout with a table fitted to each batch). Returns the kernel calls."""
    monkeypatch.setattr(attention, "_compute_capability", lambda: 9.0)
    return on_a_gpu_emulated(monkeypatch)
