"""Attention over packed sequences: the einsum reference and the flash kernels.

Which positions a query sees is described by `AttentionMask`: the segment ids of the queries
and of the memory (0 is padding; each packed example has its own id) and whether attention
is causal. The einsum path (`reference`) turns it into a dense boolean mask [batch, 1,
length, memory_length]; the flash kernels take the segment ids themselves and never form
the [length, memory_length] logits:

- ``splash``: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
  the TPU kernel, with segment ids. On CPU it runs in Pallas' interpret mode: slow, and what
  the tests use to check it against the reference.
- ``triton``: tokamax's Pallas Triton flash attention (`tokamax.dot_product_attention`,
  which the JAX team points to in place of `jax.experimental.pallas.ops.gpu.attention`),
  given the packed mask as cuDNN is; a GPU kernel for what cuDNN refuses (float32
  activations, other head sizes). It needs a GPU and tokamax (`pip install 'mtrain[gpu]'`):
  `flash_refusal` says so before anything is traced.
- ``cudnn``: cuDNN's fused flash attention through `jax.nn.dot_product_attention`, given the
  packed mask (a [batch, 1, length, memory_length] boolean, not the float logits; cuDNN
  turns it into a bias). It needs a GPU, bfloat16 or float16 activations and a head size
  (d_kv) that is a multiple of 8, at most 128 (256 from Hopper on): jax's own checks, which
  `flash_refusal` states before anything is traced. Where they fail, ``attention='auto'``
  runs the einsum path (a float32 model on a GPU, say) and ``attention='flash'`` is a
  configuration error.
- ``cudnn_segments``: cuDNN's packed-segment layout (a table of each segment's start and
  length; Hopper on, self-attention only), which computes no block outside the segments
  but runs every entry of its table: faster than ``cudnn`` only for rows of a few long
  examples with a table to match (`kernels.cudnn_segments` has the H100 figures).

`flash` picks the kernel (``flash_kernel='auto'``: cudnn on GPU, splash elsewhere) and runs
it under `jax.shard_map` over the mesh dimensions that split ``batch`` and ``heads``, so a
kernel that XLA cannot partition sees only its own rows and heads.

On a Hopper GPU, ``'auto'`` goes one step further in training, evaluation and scoring
(`adapts_segment_table`): the model then asks for each batch's packing (`base.uses_packing`:
the most examples in one row, rounded up to a power of two, `base.packing_of`), which the
trainer computes on the host and makes `base.current_packing()` while the step is traced;
where cuDNN's packed layout with a table of that size is faster than the masked kernel (up
to `AUTO_TABLE_LIMIT` entries), self-attention runs ``cudnn_segments`` with that table. Each
table size is compiled once, when a batch first needs it. Nothing else knows of the table.
Rows of one example each, from their first position (`base.UNPACKED`: evaluation's, scoring's,
unpacked training data), need no table for causal self-attention: it runs cuDNN's causal
kernel with no mask (`kernels.cudnn_causal`), as a hand-written step does.

Decoding runs one query per row at a time (self-attention to the key/value cache, and
encoder-decoder attention to the encoder's outputs, whose mask then has no query ids): that
single-query attention runs the einsum path on every backend, whatever
`transformer.attention` says (`layers.MultiHeadAttention`). The flash kernels tile queries
in blocks of 64 to 512 positions, so one query would fill a block with padding, and their
saving, never forming the [length, memory_length] logits, is nothing when length is 1: the
logits of one query are [memory_length] per head, a matrix-vector product that XLA fuses on
any backend. The encoder of a translation still runs the configured path over its whole
inputs, and so do training, evaluation and scoring.

Attention sinks (gpt-oss, `transformer.attention_sinks`): a learned logit per head that joins
each query's softmax as one more column whose value is 0 (softmax over [logits..., sink],
the sink's share dropped: a head's weights sum to less than 1, and a query that sees
nothing gives 0, not NaN). The einsum path (`reference`, every decoding step) and splash
take them; cuDNN's kernels, tokamax's Triton kernel and `jax.nn.dot_product_attention` do
not (`flash_refusal`: 'auto' runs einsum on a GPU for a model with sinks, and naming
such a kernel, or 'dot_product', is a configuration error).

A padding query (segment 0) of splash and cuDNN is given the segment of the first memory
position, so that no row of their mask is empty (in encoder-decoder attention a padded
target may have no padded input to see). What padding positions compute is never used (the
loss weighs them 0): only what real positions compute must agree with the reference.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from mtrain.parallel import layout as layout_lib
from mtrain.parallel import manual
from mtrain.errors import DataError
from mtrain.models import base, kernels
from mtrain.models.context import kv_heads_of_shard
from mtrain.models.kernels import CUDNN_MAX_SEGMENTS, NEG_INF

FLASH_KERNELS = ("auto", "cudnn", "cudnn_segments", "splash", "triton")


@flax.struct.dataclass
class AttentionMask:
    """Who sees whom: `query` [batch, length] and `memory` [batch, memory_length] segment ids
    (0 = padding), and `causal` (query i sees memory j <= i). `query` None: every query sees
    every real memory position (one decoding step's encoder-decoder attention).
    `self_attention`: query and memory are the same positions (`of_self`). `window` (0:
    none): a sliding window, query i sees only memory j with |i - j| < window (with
    `causal`: itself and the window - 1 positions before it)."""

    query: jax.Array | None
    memory: jax.Array
    causal: bool = flax.struct.field(pytree_node=False, default=False)
    self_attention: bool = flax.struct.field(pytree_node=False, default=False)
    window: int = flax.struct.field(pytree_node=False, default=0)
    balanced: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def of_self(cls, segment_ids: jax.Array, causal: bool,
                balanced: bool = False) -> "AttentionMask":
        """Self-attention within the packed segments of `segment_ids`; `balanced`: where a
        layout splits ``length``, the rows are in `context.balanced_order` (a decoder-only
        model's, placed so by the trainer: `context.length_order`)."""
        return cls(segment_ids, segment_ids, causal, self_attention=True, balanced=balanced)

    def windowed(self, window: int) -> "AttentionMask":
        """This mask with a sliding `window` (0: none)."""
        return self.replace(window=window)

    def dense(self) -> jax.Array:
        """[batch, 1, length, memory_length]: the real positions of the query's own segment
        (and with `causal` only those at or before it, with `window` only those inside it)."""
        if self.query is None:
            return (self.memory > 0)[:, None, None, :]
        return kernels.packed_mask(self.query, self.memory, self.causal, self.window)

    def kernel_query_ids(self) -> jax.Array:
        """The query segment ids given to a flash kernel (`kernels.seeing_query_ids`)."""
        return kernels.seeing_query_ids(self.query, self.memory)


def reference(q, k, v, mask: AttentionMask | jax.Array, dropout=None, bias=None,
              scale: float = 1.0, sinks=None):
    """softmax(scale q k^T + bias, masked) v in float32 logits: q [b, l, h, d], k and v [b,
    m, g, d] with g key/value heads dividing h (query head i uses key/value head i // (h /
    g)); `mask` an `AttentionMask` or a dense boolean [b, 1|h, l, m]; `bias` (float32, [1|b,
    h, l, m]) added to the logits; `dropout(weights)` applied to the attention weights.
    `scale` 1 by default: Mesh-TF's unscaled logits (the query initialiser has 1/sqrt(d));
    Llama's d^-0.5 where a published model was trained so. `sinks` [h] (None: none): each
    head's sink logit in the softmax (`softmax_with_sinks`).

    Causal self-attention of long rows goes a block of `CAUSAL_BLOCK` queries at a time,
    each against the keys up to its last (`causal_blocks`): the logits past them, all
    masked, are never formed, so about half the work and memory traffic of the whole
    [l, l], and each block's logits stay small enough for a CPU's caches."""
    dense = mask.dense() if isinstance(mask, AttentionMask) else mask
    blocks = causal_blocks(mask, q.shape[1], k.shape[1], dropout)
    if blocks == 1:
        return _attend(q, k, v, dense, dropout, bias, scale, sinks)
    size, out = q.shape[1] // blocks, []
    for i in range(blocks):
        rows, end = slice(i * size, (i + 1) * size), (i + 1) * size
        out.append(_attend(q[:, rows], k[:, :end], v[:, :end], dense[..., rows, :end], None,
                           None if bias is None else bias[..., rows, :end], scale, sinks))
    return jnp.concatenate(out, axis=1)


# The queries a block of `reference`'s causal attention holds (at least), the shortest rows
# it splits being two blocks; and the most blocks a row makes (longer rows: longer blocks,
# so that a program's attention stays a few operations).
CAUSAL_BLOCK = 128
MOST_BLOCKS = 8


def causal_blocks(mask, length: int, memory_length: int, dropout=None) -> int:
    """Into how many blocks of queries `reference` splits its attention (1: none): rows of
    at least two `CAUSAL_BLOCK`s, a multiple of it, of causal self-attention (an
    `AttentionMask`), without dropout (whose random numbers are drawn for the whole), where
    the active layout splits neither ``length`` nor ``memory_length``; `MOST_BLOCKS` at
    most."""
    if (dropout is not None or not isinstance(mask, AttentionMask) or not mask.causal
            or not mask.self_attention or length != memory_length
            or length < 2 * CAUSAL_BLOCK or length % CAUSAL_BLOCK):
        return 1
    active = layout_lib.active()
    if active is not None and max(active[0].ways("length"), active[0].ways("memory_length")) > 1:
        return 1
    return min(length // CAUSAL_BLOCK, MOST_BLOCKS)


def _attend(q, k, v, dense, dropout, bias, scale, sinks):
    """`reference` of one block of queries, given its dense mask."""
    (b, length, h, d), g = q.shape, k.shape[2]
    if g == h:
        logits = jnp.einsum("blhk,bmhk->bhlm", q, k, preferred_element_type=jnp.float32)
    else:  # grouped: each key/value head serves h / g query heads, never copied; the
        # query laid out [b, g, h / g, l, d] first, so that the product comes out in the
        # order of the logits (a transpose of the small query, not of the [l, m] logits)
        grouped = q.reshape(b, length, g, h // g, d).transpose(0, 2, 3, 1, 4)
        logits = jnp.einsum("bgrlk,bmgk->bgrlm", grouped, k, preferred_element_type=jnp.float32)
        logits = logits.reshape(b, h, length, k.shape[1])
    if scale != 1.0:
        logits = logits * scale
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(dense, logits, NEG_INF)
    logits = layout_lib.constrain(logits, ("batch", "heads", "length", "memory_length"))
    weights = jax.nn.softmax(logits, axis=-1) if sinks is None else \
        softmax_with_sinks(logits, sinks)
    weights = weights.astype(q.dtype)
    if dropout is not None:
        weights = dropout(weights)
    if g == h:
        return jnp.einsum("bhlm,bmhk->blhk", weights, v)
    weights = weights.reshape(b, g, h // g, length, k.shape[1])
    out = jnp.einsum("bgrlm,bmgk->bgrlk", weights, v)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, length, h, d)


def weights_dropout(rate: float, deterministic: bool):
    """`reference`'s `dropout` for an attention module (call it inside one: it makes the
    module's `nn.Dropout`): None where no dropout is drawn (deterministic, or `rate` 0), so
    that `reference` may split the queries into blocks (`causal_blocks`)."""
    drop = nn.Dropout(rate)
    return None if deterministic or rate == 0 else (lambda w: drop(w, deterministic=False))


def softmax_with_sinks(logits, sinks):
    """The softmax of float32 `logits` [b, h, l, m] over [logits..., sink] per head (`sinks`
    [h]), the sink's column dropped (Hugging Face's gpt-oss, its maximum taken over both)."""
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    peak = jax.lax.stop_gradient(jnp.maximum(logits.max(axis=-1, keepdims=True), sink))
    e = jnp.exp(logits - peak)
    return e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - peak))


def default_kernel(backend: str | None = None) -> str:
    """The kernel of ``flash_kernel='auto'`` on `backend` (default: this process's): the
    masked cuDNN kernel on a GPU (correct for any packing; `Trainer` swaps in cuDNN's packed
    layout per batch where that is faster, see `flash`), splash elsewhere."""
    return "cudnn" if (backend or jax.default_backend()) == "gpu" else "splash"


def _compute_capability() -> float:
    """This process's first device's CUDA compute capability (0 off NVIDIA GPUs)."""
    return float(getattr(jax.devices()[0], "compute_capability", "0"))


def _tokamax_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("tokamax") is None


def flash_refusal(kernel: str, backend: str, dtype, d_kv: int,
                  sinks: bool = False, hopper: bool | None = None) -> str | None:
    """Why `flash` with `kernel` cannot run on `backend` for activations of `dtype` and heads
    of `d_kv` (None: it can), with attention `sinks` or not. The GPU kernels need a GPU,
    triton tokamax as well, and take no sinks; splash takes any model. cuDNN's are jax's
    own checks (`check_is_flash_attention`): bfloat16 or float16, heads up to 256 from
    Hopper (compute capability 9.0) on, 128 before, and the packed layout from Hopper on.
    `hopper`: whether the GPU is one (None: this process's, where it runs on `backend`; for
    another backend, a plan for a GPU target made on a CPU, no, unless the plan says)."""
    kernel = kernel if kernel != "auto" else default_kernel(backend)
    if kernel not in kernels.GPU_KERNELS:
        return None
    if sinks:
        return sinks_refusal(kernel)
    if backend != "gpu":
        return kernels.needs_a_gpu(kernel)
    if kernel == "triton":
        return ("flash_kernel='triton' needs tokamax: pip install 'mtrain[gpu]'"
                if _tokamax_missing() else None)
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return (f"cuDNN's flash attention takes bfloat16 or float16 activations, not "
                f"{jnp.dtype(dtype).name}")
    here = backend == jax.default_backend()
    if hopper is None:
        hopper = here and _compute_capability() >= 9.0
    limit = 256 if hopper else 128
    if d_kv % 8 or d_kv > limit:
        return f"cuDNN's flash attention takes d_kv a multiple of 8 up to {limit}, not {d_kv}"
    if kernel == "cudnn_segments" and here and not hopper:
        return "flash_kernel='cudnn_segments' (cuDNN's packed layout) needs a Hopper GPU or later"
    return None


def sinks_refusal(kernel: str) -> str:
    return (f"flash_kernel={kernel!r} takes no attention sinks (transformer.attention_sinks): "
            f"only 'splash' does")


def uses_flash(implementation: str, kernel: str, backend: str, dtype, d_kv: int,
               sinks: bool = False, hopper: bool | None = None) -> bool:
    """Whether attention `implementation` ('flash', 'auto', ...) runs the flash kernels on
    `backend` (for a model with attention `sinks` or not): 'flash' always, 'auto' off the
    CPU where `kernel` takes the model (attention dropout in training aside, see
    `layers.MultiHeadAttention`)."""
    return implementation == "flash" or (
        implementation == "auto" and backend != "cpu" and
        flash_refusal(kernel, backend, dtype, d_kv, sinks, hopper) is None)


def flash(q, k, v, mask: AttentionMask, kernel: str = "auto",
          max_segments: int = CUDNN_MAX_SEGMENTS, scale: float = 1.0, sinks=None):
    """The attention of `reference` by a flash kernel (see the module doc), split over the
    active layout's ``batch`` and ``heads`` mesh dimensions. `max_segments`: the size of
    cudnn_segments' table (packed examples per row at most); the mask's window is each
    kernel's own local-window support; `sinks` [h] (splash alone takes them)."""
    if kernel == "auto":
        kernel = default_kernel()
        packing = base.current_packing()  # (known only where adapts_segment_table says)
        if kernel == "cudnn" and mask.self_attention and packing is not None:
            if packing == base.UNPACKED and mask.causal:
                kernel = "cudnn_causal"  # (no mask needed: `kernels.cudnn_causal`)
            elif packing <= AUTO_TABLE_LIMIT:
                kernel, max_segments = "cudnn_segments", max(packing, 1)
    if kernel not in kernels.KERNELS:
        raise ValueError(f"flash kernel must be one of {FLASH_KERNELS}, got {kernel!r}")
    if kernel == "cudnn_segments" and (not mask.self_attention
                                       or (mask.window and not mask.causal)):
        kernel = "cudnn"  # (the packed layout is self-attention's, its window causal's)
    if sinks is not None and kernel != "splash":
        raise ValueError(f"transformer.{sinks_refusal(kernel)}")
    fn = functools.partial(kernels.KERNELS[kernel], causal=mask.causal, window=mask.window,
                           scale=scale)
    if kernel == "cudnn_segments":
        fn = functools.partial(fn, max_segments=max_segments)
    # cudnn_segments leaves padding (segment 0) out of every segment.
    query_ids = mask.query if kernel == "cudnn_segments" else mask.kernel_query_ids()
    return _sharded(fn, q, k, v, query_ids, mask.memory, sinks)


def _sharded(fn, q, k, v, query_ids, memory_ids, sinks=None):
    """fn(q, k, v, query_ids, memory_ids) (and `sinks=`, their heads', where given) under a
    shard_map over the mesh axes that split ``batch`` and ``heads`` in the active layout
    (`manual.shard_map_by_names`: inside a replica, over the axes not already manual);
    called directly when no layout is active or nothing is split.

    Grouped key/value heads (fewer than the query heads, on ``kv_heads``) go in split as
    ``kv_heads`` is; where that is not as ``heads`` is, each shard cuts the key/value heads
    its query heads use out of the whole ones (`context.kv_heads_of_shard`)."""
    qkv, ids = ("batch", None, "heads", None), ("batch", None)
    heads = manual.axis("heads")
    whole = k.shape[2] == q.shape[2] or manual.axis("kv_heads") == heads
    # (full multi-head attention: keys and values on ``heads``)
    kv = qkv if whole else ("batch", None, None, None)

    def local(q, k, v, query_ids, memory_ids, *sinks):
        if not whole:
            k, v = kv_heads_of_shard(q.shape[2], k, v, heads)
        return fn(q, k, v, query_ids, memory_ids, **({"sinks": sinks[0]} if sinks else {}))

    extra = () if sinks is None else (sinks,)
    return manual.shard_map_by_names(
        local, in_names=(qkv, kv, kv, ids, ids) + (("heads",),) * len(extra),
        out_names=qkv)(q, k, v, query_ids, memory_ids, *extra)


# The largest table 'auto' gives cudnn_segments; a batch whose rows need more runs the masked
# kernel. On an H100 (16 x 2048, 16 heads x 128, forward + backward) the packed layout took
# 2.17 ms with a table of 4, 5.36 ms of 64 and 15.18 ms of 256 (about 1.96 ms + 0.052 ms per
# entry), the masked kernel 4.7 ms: they cross at about 53 entries.
AUTO_TABLE_LIMIT = 32


def adapts_segment_table(config) -> bool:
    """Whether a `TransformerConfig`'s attention runs cudnn_segments with a table fitted to
    each batch (its packing, `base.packing_of`), here: ``flash_kernel='auto'`` on a GPU that
    takes the packed
    layout (Hopper on), attention that is flash in training (no attention dropout), and one
    process (the processes of a multi-host run would each fit their own rows and compile
    different steps: they run the masked kernel)."""
    if config is None or config.flash_kernel != "auto" or config.dropout_rate > 0:
        return False
    backend = jax.default_backend()
    return (default_kernel(backend) == "cudnn" and jax.process_count() == 1 and
            uses_flash(config.attention, "cudnn_segments", backend, config.dtype,
                       config.attention_head_dim, config.attention_sinks))


def check_batch(config, batch: dict) -> None:
    """Refuses a host batch (numpy) with a row of more entries (`base.table_entries`) than
    the table of a `TransformerConfig` whose self-attention runs flash_kernel
    'cudnn_segments' here: past its table the kernel computes nothing."""
    if config.flash_kernel != "cudnn_segments" or not uses_flash(
            config.attention, config.flash_kernel, jax.default_backend(), config.dtype,
            config.attention_head_dim, config.attention_sinks):
        return
    table = config.flash_max_segments
    for key, ids in batch.items():
        if not key.endswith("_segment_ids"):
            continue
        most = int(base.table_entries(ids).max(initial=0))
        if most > table:
            raise DataError(f"a row of the batch takes {most} entries of cuDNN's segment "
                            f"table ({key}: its packed examples, and padding before the "
                            f"first), and flash_kernel='cudnn_segments' takes at most "
                            f"transformer.flash_max_segments={table}: raise it, or use "
                            f"flash_kernel 'cudnn'")


