"""Ring attention (Liu et al. 2023) and the online softmax it and `context` share.

Inside a shard_map with ``length`` split over mesh axis `Ring.axis`, the devices pass
their blocks of keys and values around the ring with `jax.lax.ppermute`, one step per
device, each adding the block's share of the softmax to its queries' running sums
(`block`, `combine`, `finish`: running maximum, normaliser and weighted values, all in
float32), a sub-block of `kernels.block_size` keys at a time. The backward pass
(`attention` is a custom VJP: flash attention's, with the forward pass's log-sum-exp)
passes the blocks around again with their gradients' running sums, so that no device ever
holds more than two blocks of the row's keys and values, forward or backward. Which key a
query sees is decided on the positions that travel with the tokens (`Places`, `visible`);
T5's relative bias is made for each block from them (its table's gradient summed here).
Attention sinks (gpt-oss) join each query's sums once, as a share of their own
(`sink_share`: its logit the maximum, its weight 1, its value 0).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtrain.models import kernels
from mtrain.models.kernels import NEG_INF
from mtrain.models.remat import KERNEL_OUTPUTS


class Places(NamedTuple):
    """Where each query and key is, travelling with it: its packed example (segment ids, 0:
    padding) and its position (`context.balanced_order`'s, or within its example), queries' [b, lq]
    and keys' [b, lm]."""

    query_ids: jax.Array
    memory_ids: jax.Array
    query_index: jax.Array
    memory_index: jax.Array


@dataclasses.dataclass(frozen=True)
class Ring:
    """What the ring's custom VJP keeps static: the mesh `axis` of the ring and the mask's
    and logits' settings."""

    axis: str
    causal: bool
    window: int
    scale: float


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


def block(q, k, v, mask, scale, bias=None):
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


def relative_bias(table, query_index, memory_index):
    """The relative bias [b, h, lq, lm] of `table` (a `positions.RelativeTable`, or None)."""
    return None if table is None else table.between(query_index, memory_index)


def combine(a, b):
    """Two blocks' shares of the online softmax as one."""
    (peak_a, sum_a, values_a), (peak_b, sum_b, values_b) = a, b
    peak = jnp.maximum(peak_a, peak_b)
    wa, wb = jnp.exp(peak_a - peak), jnp.exp(peak_b - peak)
    per_query = lambda w: jnp.moveaxis(w, 1, 2)[..., None]  # noqa: E731  [b, lq, h, 1]
    return (peak, sum_a * wa + sum_b * wb,
            values_a * per_query(wa) + values_b * per_query(wb))


def sink_share(sinks, q):
    """The online softmax's share of each head's sink logit (`sinks` [h]) for queries `q`
    [b, lq, h, d]: a column of value 0 that only adds to the normaliser."""
    b, lq, h, d = q.shape
    peak = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (b, h, lq))
    return peak, jnp.ones((b, h, lq), jnp.float32), jnp.zeros((b, lq, h, d), jnp.float32)


def with_sinks(share, sinks, q):
    """`share` with the sinks' (None: none) combined in."""
    return share if sinks is None else combine(sink_share(sinks, q), share)


def finish(share, dtype):
    _, total, values = share
    return (values / jnp.moveaxis(jnp.maximum(total, 1e-30), 1, 2)[..., None]).astype(dtype)


def _cut(x, j, size: int):
    """Sub-block `j` of `size` positions of `x` [b, l, ...]."""
    return jax.lax.dynamic_slice_in_dim(x, j * size, size, 1)


def _next(axis: str, blocks):
    """`blocks` passed one device on along the ring of mesh axis `axis` (`ppermute`)."""
    n = jax.lax.axis_size(axis)
    return tuple(jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])
                 for x in blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def attention(q, k, v, at: Places, bias, sinks, ring: Ring):
    """Ring attention, whose backward pass passes the keys and values (and their gradients'
    running sums) around the ring again rather than keeping every step's block: no device
    holds more than two blocks of the row's keys and values, forward or backward. `sinks`
    [h] (None: none): each head's sink logit."""
    return _forward(q, k, v, at, bias, sinks, ring)[0]


def _forward(q, k, v, at: Places, bias, sinks, ring: Ring):
    query_ids, memory_ids, query_index, memory_index = at
    axis, causal, window, scale = ring.axis, ring.causal, ring.window, ring.scale

    def share(blocks):  # a ring block's share, a sub-block of its keys at a time
        size = kernels.block_size(blocks[0].shape[1])

        def part(j, total=None):
            k, v, ids, index = (_cut(x, j, size) for x in blocks)
            mask = visible(query_ids, query_index, ids, index, causal, window)
            share = block(q, k, v, mask, scale, relative_bias(bias, query_index, index))
            return share if total is None else combine(total, share)

        return jax.lax.fori_loop(1, blocks[0].shape[1] // size, part, part(0))

    def step(_, carry):  # (a loop, not unrolled: one step's temporaries at a time)
        total, blocks = carry
        blocks = _next(axis, blocks)
        return combine(total, share(blocks)), blocks

    blocks = (k, v, memory_ids, memory_index)
    first = with_sinks(share(blocks), sinks, q)
    total, _ = jax.lax.fori_loop(1, jax.lax.axis_size(axis), step, (first, blocks))
    peak, norm, _ = total
    # (named: remat 'dots' keeps them, rather than run the ring again in the backward pass)
    out = checkpoint_name(finish(total, q.dtype), KERNEL_OUTPUTS)
    logsumexp = checkpoint_name(peak + jnp.log(jnp.maximum(norm, 1e-30)),  # [b, h, lq]
                                KERNEL_OUTPUTS)
    return out, (q, k, v, at, bias, sinks, out, logsumexp)


def _backward(ring: Ring, saved, d_out):
    """Flash attention's backward pass, a ring block at a time: with the softmax's
    log-sum-exp of the forward pass, each block's probabilities are recomputed exactly (a
    sink's share in it: the keys' gradients are as without, the sink's its own column's)."""
    q, k, v, at, bias, sinks, out, logsumexp = saved
    query_ids, memory_ids, query_index, memory_index = at
    axis, causal, window, scale = ring.axis, ring.causal, ring.window, ring.scale
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
                relative_bias(bias, query_index, index_), g)
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
    d_sinks = None
    if sinks is not None:  # its column's value is 0: d sink = -p(sink) sum(d_out * out)
        p_sink = jnp.exp(sinks.astype(f32).reshape(1, g, h // g, 1) - lse)
        d_sinks = -(p_sink * delta).sum(axis=(0, 3)).reshape(h).astype(sinks.dtype)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), \
        None, d_bias, d_sinks


attention.defvjp(_forward, _backward)
