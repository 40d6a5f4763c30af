"""Context parallelism: self-attention with ``length`` split over a mesh dimension.

With a layout rule ``length:<mesh dim>`` every device holds 1/n of each row's positions.
Its queries stay there; the keys and values they need come to them in one of two ways:

- ``'gather'`` (MaxText's all-gathered context parallelism): each device all-gathers the
  keys and values (and their segment ids and positions) along the mesh dimension, then
  attends its queries to the whole row;
- ``'ring'`` (ring attention, Liu et al. 2023): the devices pass their blocks of keys and
  values around the ring with `jax.lax.ppermute`, one step per device, each adding the
  block's share of the softmax to its queries' running sums (the online softmax: running
  maximum, normaliser and weighted values, all in float32). Its backward pass (`_ring`, a
  custom VJP: flash attention's, with the forward pass's log-sum-exp) passes the blocks
  around again with their gradients' running sums, so that no device ever holds more than
  two blocks of the row's keys and values, forward or backward.

Which key a query sees is decided on positions that travel with the tokens (`index`; the
model gives its packed positions, which within an example are the distance from its
start, so that same segment and causality are what they are unsplit), so that causality
and sliding windows hold however a row's positions were laid out. Causal attention is
load-balanced by that freedom: `balanced_order(length, n)` cuts a row into 2n chunks and
gives device i chunks i and 2n - 1 - i, so that every device has the same number of
unmasked query-key pairs (the reordering is applied once to the batch, not per layer).
Packed segment ids travel with their positions, and T5's relative position bias is made for
each block from them (`positions.RelativeTable`; its table's gradient summed in the ring's
backward pass).

`attend` runs either under `jax.shard_map` over the mesh dimensions that split ``batch``,
``heads`` and ``length`` in the active layout; without a ``length`` split it is plain
attention. On the einsum path its float32 logits are a block [local queries, one device's
keys] at a time in the ring, [local queries, the row's keys] gathered. On the flash path
(`transformer.attention='flash'`) the gathered form runs the flash kernel on the device's
queries and the row's keys: splash with a mask of the row's global positions (`kernels.
splash`'s `shard`: the block mask of this device's query blocks, computed in the kernel,
where the device's length is a multiple of its 128 lanes; else the einsum block), cuDNN
and Triton given the mask on global positions. The ring's blocks are einsum on every
path (a kernel for each step would have to return and differentiate its log-sum-exp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtrain.models import kernels
from mtrain.models.kernels import NEG_INF
from mtrain.parallel import layout as layout_lib
from mtrain.parallel.layout_syntax import LayoutError

MODES = ("gather", "ring")


def splits_length() -> bool:
    """Whether the active layout splits ``length``."""
    active = layout_lib.active()
    return active is not None and active[0].ways("length") > 1


def length_order(length: int, layout, features=("targets",)) -> np.ndarray | None:
    """The order a batch's rows are laid out in under `layout` (None: as they are):
    `balanced_order` where it splits ``length``, for a decoder-only model (`features`);
    an encoder-decoder's rows stay as they are (its decoder shifts its own inputs)."""
    ways = layout.ways("length")
    return balanced_order(length, ways) if ways > 1 and tuple(features) == ("targets",) \
        else None


def balanced_order(length: int, ways: int) -> np.ndarray:
    """The order of a row's positions that balances causal attention over `ways` devices
    along ``length``: chunks i and 2 ways - 1 - i (of 2 ways) on device i. ``x[:, order]``
    lays a row out so; `index` of the result is `order` itself."""
    if ways == 1:
        return np.arange(length)
    if length % (2 * ways):
        raise LayoutError(f"length split {ways} ways (load-balanced: {2 * ways} chunks) needs "
                          f"run.sequence_length ({length}) to be a multiple of {2 * ways}")
    chunks = np.arange(length).reshape(2 * ways, length // (2 * ways))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]])
                           for i in range(ways)])


def visible(query_ids, query_index, memory_ids, memory_index, causal: bool, window: int = 0):
    """[b, lq, lm] whether each query sees each memory position: same segment, real, and
    (`causal`) not after it, (`window`) less than `window` positions apart, by index."""
    mask = (query_ids[:, :, None] == memory_ids[:, None, :]) & (memory_ids > 0)[:, None, :]
    distance = query_index[:, :, None] - memory_index[:, None, :]
    if causal:
        mask &= distance >= 0
    if window:
        mask &= jnp.abs(distance) < window
    return mask


def _block(q, k, v, mask, scale, bias=None):
    """One block's share of the online softmax: (its maximum logit [b, h, lq], the sum of
    exp(logit - maximum) [b, h, lq], the weighted values [b, lq, h, d], all float32) for
    q [b, lq, h, d], k and v [b, lm, g, d] (g dividing h), `mask` [b, lq, lm] and `bias`
    (None, or [b, h, lq, lm] float32 added to the scaled logits)."""
    (b, lq, h, d), g = q.shape, k.shape[2]
    grouped = q.reshape(b, lq, g, h // g, d)
    logits = jnp.einsum("blgrk,bmgk->bgrlm", grouped, k, preferred_element_type=jnp.float32)
    logits = logits * scale + _grouped_bias(bias, g)
    logits = jnp.where(mask[:, None, None], logits, NEG_INF)
    peak = logits.max(axis=-1)
    weights = jnp.where(mask[:, None, None], jnp.exp(logits - peak[..., None]), 0.0)
    values = jnp.einsum("bgrlm,bmgk->blgrk", weights, v.astype(jnp.float32))
    return (peak.reshape(b, h, lq), weights.sum(-1).reshape(b, h, lq),
            values.reshape(b, lq, h, d))


def _grouped_bias(bias, g: int):
    """`bias` [b, h, lq, lm] as [b, g, h / g, lq, lm] (0 for None)."""
    if bias is None:
        return 0.0
    b, h, lq, lm = bias.shape
    return bias.reshape(b, g, h // g, lq, lm)


def _bias(table, query_index, memory_index):
    """The relative bias [b, h, lq, lm] of `table` (a `positions.RelativeTable`, or None)."""
    return None if table is None else table.between(query_index, memory_index)


def _combine(a, b):
    """Two blocks' shares of the online softmax as one."""
    (peak_a, sum_a, values_a), (peak_b, sum_b, values_b) = a, b
    peak = jnp.maximum(peak_a, peak_b)
    wa, wb = jnp.exp(peak_a - peak), jnp.exp(peak_b - peak)
    per_query = lambda w: jnp.moveaxis(w, 1, 2)[..., None]  # noqa: E731  [b, lq, h, 1]
    return (peak, sum_a * wa + sum_b * wb,
            values_a * per_query(wa) + values_b * per_query(wb))


def _finish(share, dtype):
    _, total, values = share
    return (values / jnp.moveaxis(jnp.maximum(total, 1e-30), 1, 2)[..., None]).astype(dtype)


def local_attention(q, k, v, query_ids, memory_ids, query_index, memory_index, *,
                    causal: bool, window: int = 0, scale: float = 1.0, axis: str | None = None,
                    mode: str = "gather", kernel: str | None = None, balanced: bool = False,
                    bias=None):
    """Attention of this device's queries (inside `shard_map`, ``length`` split over mesh
    axis `axis`; None: not split) to the whole row's keys, by `mode` (module doc); the
    gathered form by flash `kernel` where one is named (rows in `balanced_order` where
    `balanced`, as splash's mask must know), else by einsum. `bias`: T5's relative bias (a
    `positions.RelativeTable`, its heads this device's) of each block's positions (einsum
    blocks only: no kernel takes it)."""
    def share(k, v, memory_ids, memory_index):
        mask = visible(query_ids, query_index, memory_ids, memory_index, causal, window)
        return _block(q, k, v, mask, scale, _bias(bias, query_index, memory_index))

    if axis is None:
        return _finish(share(k, v, memory_ids, memory_index), q.dtype)
    if bias is not None:
        kernel = None
    if mode == "ring":
        return _ring(q, k, v, query_ids, memory_ids, query_index, memory_index, bias, axis,
                     causal, window, scale)
    if mode != "gather":
        raise ValueError(f"context parallelism must be one of {MODES}, got {mode!r}")
    gather = lambda *xs: [jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
                          for x in xs]
    if kernel == "splash" and q.shape[1] % 128 == 0:
        shard = (jax.lax.axis_index(axis), jax.lax.axis_size(axis), balanced)

        # (the backward pass gathers the keys and values again rather than keep them: only
        # the kernel's residuals, named RESIDUALS, are saved)
        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
            kernels.RESIDUALS))
        def gathered(q, k, v, query_ids, memory_ids):
            k, v, memory_ids = gather(k, v, memory_ids)
            ids = kernels.seeing_query_ids(query_ids, memory_ids)  # (no empty rows)
            return kernels.splash(q, k, v, ids, memory_ids, causal, window, scale, shard=shard)

        return gathered(q, k, v, query_ids, memory_ids)
    k, v, memory_ids, memory_index = gather(k, v, memory_ids, memory_index)
    if kernel in kernels.GPU_KERNELS:
        mask = visible(query_ids, query_index, memory_ids, memory_index, causal, window)
        mask |= (query_ids == 0)[:, :, None]  # (padding queries: no empty rows)
        run = kernels.triton if kernel == "triton" else kernels.cudnn
        return run(q, k, v, query_ids, memory_ids, causal, window, scale, mask=mask)
    return _finish(share(k, v, memory_ids, memory_index), q.dtype)


def _cut(x, j, size: int):
    """Sub-block `j` of `size` positions of `x` [b, l, ...]."""
    return jax.lax.dynamic_slice_in_dim(x, j * size, size, 1)


def _next(axis: str, blocks):
    """`blocks` passed one device on along the ring of mesh axis `axis` (`ppermute`)."""
    n = jax.lax.axis_size(axis)
    return tuple(jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
                 for x in blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _ring(q, k, v, query_ids, memory_ids, query_index, memory_index, bias, axis, causal,
          window, scale):
    """Ring attention, whose backward pass passes the keys and values (and their gradients'
    running sums) around the ring again rather than keeping every step's block: no device
    holds more than two blocks of the row's keys and values, forward or backward."""
    return _ring_forward(q, k, v, query_ids, memory_ids, query_index, memory_index, bias,
                         axis, causal, window, scale)[0]


def _ring_forward(q, k, v, query_ids, memory_ids, query_index, memory_index, bias, axis,
                  causal, window, scale):
    def share(blocks):  # a ring block's share, a sub-block of its keys at a time
        size = kernels.block_size(blocks[0].shape[1])

        def part(j, total=None):
            k, v, ids, index = (_cut(x, j, size) for x in blocks)
            share = _block(q, k, v, visible(query_ids, query_index, ids, index, causal,
                                            window), scale, _bias(bias, query_index, index))
            return share if total is None else _combine(total, share)

        return jax.lax.fori_loop(1, blocks[0].shape[1] // size, part, part(0))

    def step(_, carry):  # (a loop, not unrolled: one step's temporaries at a time)
        total, blocks = carry
        blocks = _next(axis, blocks)
        return _combine(total, share(blocks)), blocks

    blocks = (k, v, memory_ids, memory_index)
    total, _ = jax.lax.fori_loop(1, jax.lax.axis_size(axis), step, (share(blocks), blocks))
    peak, norm, _ = total
    out = _finish(total, q.dtype)
    logsumexp = peak + jnp.log(jnp.maximum(norm, 1e-30))  # [b, h, lq]
    return out, (q, k, v, query_ids, memory_ids, query_index, memory_index, bias, out,
                 logsumexp)


def _ring_backward(axis, causal, window, scale, saved, d_out):
    """Flash attention's backward pass, a ring block at a time: with the softmax's
    log-sum-exp of the forward pass, each block's probabilities are recomputed exactly."""
    q, k, v, query_ids, memory_ids, query_index, memory_index, bias, out, logsumexp = saved
    (b, lq, h, d), g = q.shape, k.shape[2]
    f32 = jnp.float32
    grouped = lambda x: x.astype(f32).reshape(b, lq, g, h // g, d)  # noqa: E731
    qg, dog = grouped(q), grouped(d_out)
    delta = jnp.einsum("blgrk,blgrk->bgrl", dog, grouped(out))  # sum(d_out * out)
    lse = logsumexp.reshape(b, g, h // g, lq)

    def add(dq, d_table, blocks):  # a ring block's share, a sub-block of its keys at a
        k, v, ids, index, dk, dv = blocks  # time (the gradients' sums travel with it)
        size = kernels.block_size(k.shape[1])

        def part(j, carry):
            dq, d_table, dk, dv = carry
            k_, v_, index_ = (_cut(x, j, size) for x in (k, v, index))
            k_, v_ = k_.astype(f32), v_.astype(f32)
            mask = visible(query_ids, query_index, _cut(ids, j, size), index_, causal,
                           window)[:, None, None]
            logits = jnp.einsum("blgrk,bmgk->bgrlm", qg, k_) * scale + _grouped_bias(
                _bias(bias, query_index, index_), g)
            p = jnp.where(mask, jnp.exp(logits - lse[..., None]), 0.0)
            d_logits = p * (jnp.einsum("blgrk,bmgk->bgrlm", dog, v_) - delta[..., None])
            if bias is not None:  # each bucket's share: a sum over the positions it holds
                buckets = bias.buckets(query_index, index_).reshape(-1)
                d_table += jax.ops.segment_sum(
                    jnp.moveaxis(d_logits.reshape(b, h, -1), 1, 2).reshape(-1, h), buckets,
                    bias.num_buckets).T
            ds = d_logits * scale
            dq += jnp.einsum("bgrlm,bmgk->blgrk", ds, k_)
            add = lambda x, y: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                x, _cut(x, j, size) + y, j * size, 1)
            return (dq, d_table, add(dk, jnp.einsum("bgrlm,blgrk->bmgk", ds, qg)),
                    add(dv, jnp.einsum("bgrlm,blgrk->bmgk", p, dog)))

        dq, d_table, dk, dv = jax.lax.fori_loop(0, k.shape[1] // size, part,
                                                (dq, d_table, dk, dv))
        return dq, d_table, (k, v, ids, index, dk, dv)

    zeros = (jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    d_table = jnp.zeros((h, bias.num_buckets), f32) if bias is not None else jnp.zeros(())
    first = add(jnp.zeros_like(qg), d_table, (k, v, memory_ids, memory_index, *zeros))
    dq, d_table, blocks = jax.lax.fori_loop(
        1, jax.lax.axis_size(axis), lambda _, c: add(c[0], c[1], _next(axis, c[2])), first)
    dk, dv = _next(axis, blocks[4:])  # (one step on: back on their own device)
    d_bias = None if bias is None else bias.replace(table=d_table.astype(bias.table.dtype))
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), \
        None, None, None, None, d_bias


_ring.defvjp(_ring_forward, _ring_backward)


def attend(q, k, v, query_ids, memory_ids, query_index, memory_index, *, causal: bool,
           window: int = 0, scale: float = 1.0, mode: str = "gather", kernel: str | None = None,
           balanced: bool = False, bias=None):
    """Self-attention (q [b, l, h, d], k and v [b, l, g, d], segment ids and indices [b, l])
    with ``length`` split as the active layout says, under `jax.shard_map` over the mesh
    axes that split ``batch``, ``heads`` and ``length``; directly without a layout.
    `kernel`, `balanced`, `bias`: see `local_attention`."""
    args = (q, k, v, query_ids, memory_ids, query_index, memory_index)
    kwargs = dict(causal=causal, window=window, scale=scale, mode=mode, kernel=kernel,
                  balanced=balanced)
    active = layout_lib.active()
    if active is None:
        return local_attention(*args, bias=bias, **kwargs)
    layout, mesh = active
    batch, heads, length = (layout.mesh_dim_for(n) for n in ("batch", "heads", "length"))
    kv_heads = heads if k.shape[2] == q.shape[2] else layout.mesh_dim_for("kv_heads")
    if kv_heads != heads:
        kv_heads = None  # (grouped heads split otherwise than the queries': whole here)

    def local(q, k, v, *ids_and_bias):
        if kv_heads != heads and heads is not None:
            k, v = kv_heads_of_shard(q.shape[2], k, v, heads)
        ids, table = ids_and_bias[:4], ids_and_bias[4:]
        return local_attention(q, k, v, *ids, axis=length, bias=table[0] if table else None,
                               **kwargs)

    qkv, kv, ids = P(batch, length, heads, None), P(batch, length, kv_heads, None), P(batch,
                                                                                       length)
    table = () if bias is None else (bias,)  # (its heads, as the queries')
    specs = (qkv, kv, kv, ids, ids, ids, ids) + (
        () if bias is None else (bias.replace(table=P(heads, None)),))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv,
                         check_vma=False)(*args, *table)


def kv_heads_of_shard(local_heads: int, k, v, heads_axis: str | None):
    """The key/value heads [b, m, g', d] that this shard's `local_heads` query heads use,
    out of all g: a slice where the shard holds whole groups of query heads or part of one
    (the usual case); else, the heads repeated per query head (a copy, in this shard only)."""
    g = k.shape[2]
    if heads_axis is None:
        return k, v
    index = jax.lax.axis_index(heads_axis)
    per_group = local_heads * jax.lax.axis_size(heads_axis) // g  # query heads per kv head
    first = index * local_heads // per_group
    if local_heads % per_group == 0:
        count = local_heads // per_group
    elif per_group % local_heads == 0:
        count = 1
    else:
        which = (index * local_heads + jnp.arange(local_heads)) // per_group
        return jnp.take(k, which, axis=2), jnp.take(v, which, axis=2)
    return (jax.lax.dynamic_slice_in_dim(k, first, count, 2),
            jax.lax.dynamic_slice_in_dim(v, first, count, 2))
