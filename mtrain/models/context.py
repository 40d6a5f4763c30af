"""Context parallelism: self-attention with ``length`` split over a mesh dimension.

With a layout rule ``length:<mesh dim>`` every device holds 1/n of each row's positions.
Its queries stay there; the keys and values they need come to them in one of two ways:

- ``'gather'`` (MaxText's all-gathered context parallelism): each device all-gathers the
  keys and values (and their segment ids and positions) along the mesh dimension, then
  attends its queries to the whole row;
- ``'ring'`` (ring attention, Liu et al. 2023): the devices pass their blocks of keys and
  values around the ring with `jax.lax.ppermute`, one step per device, each adding the
  block's share of the softmax to its queries' running sums (the online softmax: running
  maximum, normaliser and weighted values, all in float32), so that no device ever holds
  more than two blocks of the row's keys and values.

Which key a query sees is decided on positions that travel with the tokens (`index`; the
model gives its packed positions, which within an example are the distance from its
start, so that same segment and causality are what they are unsplit), so that causality
and sliding windows hold however a row's positions were laid out. Causal attention is
load-balanced by that freedom: `balanced_order(length, n)` cuts a row into 2n chunks and
gives device i chunks i and 2n - 1 - i, so that every device has the same number of
unmasked query-key pairs (the reordering is applied once to the batch, not per layer). Packed segment ids travel with their positions.

`attend` runs either under `jax.shard_map` over the mesh dimensions that split ``batch``,
``heads`` and ``length`` in the active layout; without a ``length`` split it is plain
attention. Its float32 logits are a block [local queries, local keys] at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtrain.parallel import layout as layout_lib
from mtrain.parallel.layout_syntax import LayoutError
from mtrain.models.kernels import NEG_INF

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


def _block(q, k, v, mask, scale):
    """One block's share of the online softmax: (its maximum logit [b, h, lq], the sum of
    exp(logit - maximum) [b, h, lq], the weighted values [b, lq, h, d], all float32) for
    q [b, lq, h, d], k and v [b, lm, g, d] (g dividing h) and `mask` [b, lq, lm]."""
    (b, lq, h, d), g = q.shape, k.shape[2]
    grouped = q.reshape(b, lq, g, h // g, d)
    logits = jnp.einsum("blgrk,bmgk->bgrlm", grouped, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits * scale, NEG_INF)
    peak = logits.max(axis=-1)
    weights = jnp.where(mask[:, None, None], jnp.exp(logits - peak[..., None]), 0.0)
    values = jnp.einsum("bgrlm,bmgk->blgrk", weights, v.astype(jnp.float32))
    return (peak.reshape(b, h, lq), weights.sum(-1).reshape(b, h, lq),
            values.reshape(b, lq, h, d))


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
                    mode: str = "gather"):
    """Attention of this device's queries (inside `shard_map`, ``length`` split over mesh
    axis `axis`; None: not split) to the whole row's keys, by `mode` (module doc)."""
    def share(k, v, memory_ids, memory_index):
        mask = visible(query_ids, query_index, memory_ids, memory_index, causal, window)
        return _block(q, k, v, mask, scale)

    if axis is None:
        return _finish(share(k, v, memory_ids, memory_index), q.dtype)
    if mode == "gather":
        gathered = [jax.lax.all_gather(x, axis, axis=1, tiled=True)
                    for x in (k, v, memory_ids, memory_index)]
        return _finish(share(*gathered), q.dtype)
    if mode != "ring":
        raise ValueError(f"context parallelism must be one of {MODES}, got {mode!r}")
    n = jax.lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]
    block = (k, v, memory_ids, memory_index)
    total = share(*block)
    for _ in range(n - 1):  # (n is the mesh's: unrolled, each step's block then dropped)
        block = [jax.lax.ppermute(x, axis, ring) for x in block]
        total = _combine(total, share(*block))
    return _finish(total, q.dtype)


def attend(q, k, v, query_ids, memory_ids, query_index, memory_index, *, causal: bool,
           window: int = 0, scale: float = 1.0, mode: str = "gather"):
    """Self-attention (q [b, l, h, d], k and v [b, l, g, d], segment ids and indices [b, l])
    with ``length`` split as the active layout says, under `jax.shard_map` over the mesh
    axes that split ``batch``, ``heads`` and ``length``; directly without a layout."""
    args = (q, k, v, query_ids, memory_ids, query_index, memory_index)
    kwargs = dict(causal=causal, window=window, scale=scale, mode=mode)
    active = layout_lib.active()
    if active is None:
        return local_attention(*args, **kwargs)
    layout, mesh = active
    batch, heads, length = (layout.mesh_dim_for(n) for n in ("batch", "heads", "length"))
    kv_heads = heads if k.shape[2] == q.shape[2] else layout.mesh_dim_for("kv_heads")
    if kv_heads != heads:
        kv_heads = None  # (grouped heads split otherwise than the queries': whole here)

    def local(q, k, v, *ids):
        if kv_heads != heads and heads is not None:
            k, v = kv_heads_of_shard(q.shape[2], k, v, heads)
        return local_attention(q, k, v, *ids, axis=length, **kwargs)

    qkv, kv, ids = P(batch, length, heads, None), P(batch, length, kv_heads, None), P(batch,
                                                                                       length)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, kv, kv, ids, ids, ids, ids),
                         out_specs=qkv, check_vma=False)(*args)


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
