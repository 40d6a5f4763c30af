"""The flash kernels `attention.flash` dispatches to, each on one shard: q [b, l, h, d], k
and v [b, m, g, d] (g key/value heads dividing h), the query and memory segment ids,
`causal`, `window` (0: none; else a query sees only the keys less than `window` positions
away: itself and the window - 1 before it when causal, Hugging Face's ``sliding_window``)
and `scale` (the logits' factor). The module doc of `attention` says what each is for and
where it runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models.base import segment_starts
from mtrain.models.remat import KERNEL_OUTPUTS

NEG_INF = -1e9
# The default size of cudnn_segments' table: packed examples per row at most.
CUDNN_MAX_SEGMENTS = 64


def packed_mask(query_ids, memory_ids, causal: bool, window: int = 0) -> jax.Array:
    """[batch, 1, length, memory_length]: the real memory positions of each query's own
    segment (and with `causal` only those at or before it; with `window`, only those less
    than `window` positions away)."""
    real = (memory_ids > 0)[:, None, :]
    mask = (query_ids[:, :, None] == memory_ids[:, None, :]) & real
    return (mask & band(query_ids.shape[1], memory_ids.shape[1], causal, window))[:, None]


def band(length: int, memory_length: int, causal: bool, window: int = 0):
    """[length, memory_length] (True where nothing is excluded): memory position j is
    visible from query position i where j <= i (`causal`) and |i - j| < `window` (if any)."""
    if not causal and not window:
        return jnp.ones((length, memory_length), bool)
    distance = jnp.arange(length)[:, None] - jnp.arange(memory_length)[None, :]
    mask = distance >= 0 if causal else jnp.ones((length, memory_length), bool)
    if window:
        mask &= jnp.abs(distance) < window
    return mask


def seeing_query_ids(query_ids, memory_ids):
    """The query segment ids given to a flash kernel: padding (0) takes the segment of
    memory position 0, so that every row of the kernel's mask sees a position."""
    return jnp.where(query_ids == 0, memory_ids[:, :1], query_ids)


def needs_a_gpu(kernel: str) -> str:
    return f"flash_kernel={kernel!r} needs a GPU; use 'splash' or 'auto' here"


def block_size(n: int, largest: int = 512) -> int:
    """A kernel block size for a sequence of `n`: the largest of 512, 256, 128 (at most
    `largest`) dividing it, else `n` itself (short or odd lengths: one block)."""
    return next((b for b in (512, 256, 128) if b <= largest and n % b == 0), n)


def _pad(q, k, v, query_ids, memory_ids, multiple: int):
    """Pads the sequences to multiples of `multiple` for a blocked kernel. Padded keys get
    segment -1, which no real query has; padded queries get -1 too when there are padded
    keys to see, else the segment of memory position 0 (no empty rows either way)."""
    pad_q, pad_m = -q.shape[1] % multiple, -k.shape[1] % multiple
    if not (pad_q or pad_m):
        return q, k, v, query_ids, memory_ids
    widen = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))  # noqa: E731
    fill = jnp.full_like(memory_ids[:, :1], -1) if pad_m else memory_ids[:, :1]
    query_ids = jnp.concatenate([query_ids, jnp.broadcast_to(fill, (q.shape[0], pad_q))], 1)
    memory_ids = jnp.pad(memory_ids, ((0, 0), (0, pad_m)), constant_values=-1)
    return widen(q, pad_q), widen(k, pad_m), widen(v, pad_m), query_ids, memory_ids


def splash(q, k, v, query_ids, memory_ids, causal, window=0, scale=1.0, shard=None,
           sinks=None):
    """Splash attention (its own local mask for a window; the queries scaled first: the
    kernel's logits are unscaled; `sinks` [h], each head's sink logit, the kernel's own).
    `shard` (index, ways, balanced): the queries are shard `index` of a row split `ways`
    ways along ``length`` (the memory the whole row, gathered), in `context.balanced_order`
    where `balanced`: causality and the window are decided on the row's global positions
    (`_row_mask_class`), the kernel's block mask is that shard's."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib

    length = q.shape[1]
    if scale != 1.0:
        q = q * jnp.asarray(scale, q.dtype)
    if shard is None:
        q, k, v, query_ids, memory_ids = _pad(q, k, v, query_ids, memory_ids, 128)  # lanes
    elif not (causal or window):
        shard = None  # (every shard's mask the same: the whole row's segments alone)
    heads, g = q.shape[2], k.shape[2]
    shape = (k.shape[1] if shard else q.shape[1], k.shape[1])  # (sharded: the whole row's)
    if shard is not None:
        one = _row_mask_class()(shape, shard[1] if shard[2] else 1, causal, window)
    elif window:
        one = splash_lib.LocalMask(shape, (window - 1, 0 if causal else window - 1), 0)
    else:
        one = splash_lib.CausalMask(shape) if causal else splash_lib.FullMask(shape)
    bq, bkv = block_size(q.shape[1]), block_size(k.shape[1])
    sizes = splash_lib.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                              block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                              block_q_dq=bq, block_kv_dq=bkv)
    make = splash_lib.make_splash_mha if g == heads else splash_lib.make_splash_mqa
    kernel = make(splash_lib.MultiHeadMask([one] * (heads // g if g < heads else heads)),
                  block_sizes=sizes, head_shards=1, q_seq_shards=shard[1] if shard else 1,
                  # (its output and log-sum-exp: what remat 'dots' keeps, and with
                  # ``length`` split what `context.local_attention`'s checkpoint keeps)
                  residual_checkpoint_name=KERNEL_OUTPUTS,
                  interpret=jax.default_backend() != "tpu")
    if shard is not None:
        kernel = _shard_of(kernel, shard[0], shard[1])

    def one_row(q, k, v, qs, ks):  # [l, h, d] -> the kernel's [h, l, d]
        ids = splash_lib.SegmentIds(q=qs, kv=ks)
        if g == heads:
            return kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                          segment_ids=ids, sinks=sinks).swapaxes(0, 1)
        # grouped: the multi-query kernel for each key/value head and its query heads
        grouped = q.reshape(q.shape[0], g, heads // g, q.shape[2]).transpose(1, 2, 0, 3)
        per_group = None if sinks is None else sinks.reshape(g, heads // g)
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=ids, sinks=s),
                       in_axes=(0, 1, 1, None if sinks is None else 0))(
            grouped, k, v, per_group)  # [g, h / g, l, d]
        return out.transpose(2, 0, 1, 3).reshape(q.shape)

    return jax.vmap(one_row)(q, k, v, query_ids, memory_ids)[:, :length]


def _shard_of(kernel, index, ways: int):
    """A splash kernel made for `ways` query shards (`q_seq_shards`), cut to shard `index`
    (a traced value: `jax.lax.axis_index`) as `shard_map` would cut it by the kernel's
    `manual_sharding_spec`: its block masks along their query blocks, its `q_sequence`."""
    def cut(x, axis):
        if x is None:
            return None
        size = x.shape[axis] // ways
        return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)

    def of(info):
        return None if info is None else info._replace(
            data_next=cut(info.data_next, 1), mask_next=cut(info.mask_next, 1),
            block_mask=cut(info.block_mask, 1), q_sequence=cut(info.q_sequence, 0))

    return type(kernel)(of(kernel.fwd_mask_info), of(kernel.dq_mask_info),
                        of(kernel.dkv_mask_info), **kernel.kwargs)


@functools.cache
def _row_mask_class():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

    class RowMask(splash_attention_mask._ComputableMask):  # (splash's lazily computed kind)
        """Splash's mask of a whole row's attention whose positions are laid out in
        `context.balanced_order(length, ways)` (ways 1: in order), on both axes: query or
        key index p holds global position `position(p)`, causality and the window are
        decided on those (the kernel computes it per block, from integer arithmetic)."""

        def __init__(self, shape, ways: int, causal: bool, window: int):
            chunk = shape[0] // (2 * ways)

            def position(p):  # chunk d or 2 ways - 1 - d of device d = p // (2 chunk)
                d, r = p // (2 * chunk), p % (2 * chunk)
                return (d + (r // chunk) * (2 * ways - 1 - 2 * d)) * chunk + r % chunk

            def visible(q, k):  # q: global positions already (`q_sequence`)
                distance = q - position(k)
                seen = distance >= 0 if causal else distance == distance
                return seen & (distance < window) & (-distance < window) if window else seen

            super().__init__(shape, visible)
            self.q_sequence = position(np.arange(shape[0], dtype=np.int32)).astype(np.int32)
            self.key = (shape, ways, causal, window)

        def __eq__(self, other):
            return isinstance(other, RowMask) and self.key == other.key

        def __hash__(self):
            return hash(self.key)

    return RowMask


def triton(q, k, v, query_ids, memory_ids, causal, window=0, scale=1.0, mask=None):
    """tokamax's Triton kernel given the packed mask (as `_cudnn`, a window's band in it);
    with `causal` it also skips the blocks above the diagonal. `mask` [b, lq, lm]: who sees
    whom, given (context parallelism's, on global positions), in place of all that."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"transformer.{needs_a_gpu('triton')}")
    import tokamax

    if mask is not None:
        return tokamax.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                             implementation="triton")
    mask = packed_mask(query_ids, memory_ids, causal, window)
    return tokamax.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                         implementation="triton")


def cudnn(q, k, v, query_ids, memory_ids, causal, window=0, scale=1.0, mask=None):
    """cuDNN's flash attention given the packed mask; `is_causal` and its own
    `local_window_size` as well, so that it skips the blocks outside them. `mask` [b, lq,
    lm]: who sees whom, given (context parallelism's, on global positions; even lengths)."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"transformer.{needs_a_gpu('cudnn')}")
    if mask is not None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                            implementation="cudnn")
    length = q.shape[1]
    # cuDNN takes a mask (as a bias) in training only over even lengths.
    q, k, v, query_ids, memory_ids = _pad(q, k, v, query_ids, memory_ids, 2)
    mask = packed_mask(query_ids, memory_ids, causal, window)
    # (cuDNN's own window is causal's only: a bidirectional one is in the mask alone)
    local = (window - 1, 0) if window and causal else None
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                        local_window_size=local,
                                        implementation="cudnn")[:, :length]


def cudnn_causal(q, k, v, query_ids, memory_ids, causal, window=0, scale=1.0):
    """cuDNN's causal kernel and nothing else (`is_causal`; a window its own
    `local_window_size`), as a hand-written step calls it: for rows that each hold one
    example at most, from the row's first position (`base.UNPACKED`), where the causal band
    alone is each real query's mask, so no mask is formed or read and nothing is masked
    after. The padding after an example attends to it, and what padding computes is never
    used: its loss weight is 0, so its gradient is 0, and a real query sees no padding."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"transformer.{needs_a_gpu('cudnn')}")
    if not causal:
        raise ValueError("cudnn_causal is causal attention's: a bidirectional row's queries "
                         "would see its padding")
    del query_ids, memory_ids
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation="cudnn")


def segment_layout(ids, max_segments: int, tiled: bool = False):
    """cuDNN's packed layout of the segments of `ids` [batch, length] (each a run of equal
    ids > 0, as packing makes them): the length of each [batch, max_segments] and its start
    [batch, max_segments + 1], -1 after a row's last (the `q_seqlen` and `q_offsets` of jax's
    `fused_attention_stablehlo.dot_product_attention`); and the most entries of any row,
    which may exceed `max_segments` (the table then holds only the first ones).

    `tiled` (causal attention): the entries tile the row. Each example runs on to the next
    one's start or the row's end: a causal query never sees the padding after it. A row
    that starts with padding has that run as its first entry. So every position is in an
    entry and cuDNN writes it (`table_entries` counts the entries)."""
    starts = segment_starts(ids, jnp)
    if tiled:  # (an entry ends where the next starts, the last at the row's end)
        starts = starts.at[:, 0].set(True)
        ends = jnp.pad(starts, ((0, 0), (0, 1)), constant_values=True)[:, 1:]
    else:
        ends = (ids > 0) & (ids != jnp.pad(ids, ((0, 0), (0, 1)))[:, 1:])
    first = jax.vmap(lambda row, size: jnp.nonzero(row, size=size, fill_value=-1)[0],
                     in_axes=(0, None))
    offsets = first(starts, max_segments + 1).astype(jnp.int32)
    lengths = jnp.where(offsets[:, :-1] >= 0,
                        first(ends, max_segments) - offsets[:, :-1] + 1, -1).astype(jnp.int32)
    return lengths, offsets, starts.sum(axis=1).max()


def cudnn_segments(q, k, v, query_ids, memory_ids, causal, window=0, scale=1.0,
                   max_segments=CUDNN_MAX_SEGMENTS):
    """Self-attention by cuDNN's packed-segment layout: each segment attends within itself
    (causally or not), and no block outside the segments is computed. The table holds
    `max_segments` entries per row and cuDNN runs every entry, empty or not: on an H100
    (16 x 2048, 16 heads x 128, forward + backward) 2.2 ms with a table of 4, 5.4 ms of 64,
    15 ms of 256, where the masked kernel takes 4.7 ms however the rows are packed. So it
    pays only for rows of a few long examples, with a table to match. (A table of one is
    jax's padding mask, which takes no starts: the row's entry starts at position 0.)

    Causal attention takes the tiled layout (`segment_layout`): every position is in an
    entry, so cuDNN writes every output and gradient, and nothing is masked after. Its
    padding computes values that nothing reads; their loss weight 0 makes their gradient
    exactly 0. A row of more entries than the table is refused first, by `check_batch`
    (`table_entries`) or by 'auto' fitting the table to the batch: past the table cuDNN
    writes nothing. Bidirectional attention leaves the padding out of every entry. Its
    padding's outputs are set to 0 and no gradient leaves them. A row of more segments
    than the table gives NaN outputs."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"transformer.{needs_a_gpu('cudnn_segments')}")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # no public API for it

    del memory_ids  # the same as query_ids for self-attention (checked by `flash`)
    mode = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    lengths, offsets, most = segment_layout(query_ids, max_segments, tiled=causal)

    def attend(q, k, v):
        return cudnn.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths,
                                           q_offsets=offsets, kv_offsets=offsets, scale=scale,
                                           mask_type=mode, sliding_window_length=window or None)

    if causal:
        return attend(q, k, v)
    real = (query_ids > 0)[:, :, None, None]
    out = attend(*(jnp.where(real, x, jax.lax.stop_gradient(x)) for x in (q, k, v)))
    return jnp.where(real & (most <= max_segments), out, jnp.where(real, jnp.nan, 0))


KERNELS = {"splash": splash, "triton": triton, "cudnn": cudnn,
           "cudnn_segments": cudnn_segments, "cudnn_causal": cudnn_causal}
GPU_KERNELS = ("cudnn", "cudnn_segments", "triton")  # (the ones a config may name)

