"""Context parallelism: self-attention with ``length`` split over a mesh dimension.

With a layout rule ``length:<mesh dim>`` every device holds 1/n of each row's positions.
Its queries stay there; the keys and values they need come to them in one of two ways:

- ``'gather'`` (MaxText's all-gathered context parallelism): each device all-gathers the
  keys and values (and their segment ids and positions) along the mesh dimension, then
  attends its queries to the whole row;
- ``'ring'`` (ring attention, Liu et al. 2023): the devices pass their blocks of keys and
  values around the ring with `jax.lax.ppermute`, one step per device, each adding the
  block's share of the softmax to its queries' running sums (the online softmax: running
  maximum, normaliser and weighted values, all in float32). Its backward pass (`ring`, a
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

`attend` runs either under a shard_map over the mesh dimensions that split ``batch``,
``heads`` and ``length`` in the active layout (`manual.shard_map_by_names`); without a
``length`` split it is plain attention. On the einsum path its float32 logits are a block
[local queries, one device's keys] at a time in the ring, [local queries, the row's keys]
gathered. On the flash path
(`transformer.attention='flash'`) the gathered form runs the flash kernel on the device's
queries and the row's keys: splash with a mask of the row's global positions (`kernels.
splash`'s `shard`: the block mask of this device's query blocks, computed in the kernel,
where the device's length is a multiple of its 128 lanes; else the einsum block), cuDNN
and Triton given the mask on global positions. The ring's blocks are einsum on every
path (a kernel for each step would have to return and differentiate its log-sum-exp).
Attention sinks (gpt-oss) on every form but cuDNN's and Triton's (which take none): a
share of each query's online softmax (`ring.sink_share`), splash's own in the gathered
form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import kernels, ring
from mtrain.models.ring import Places, Ring, block, finish, relative_bias, visible, with_sinks
from mtrain.models.remat import KERNEL_OUTPUTS
from mtrain.parallel import layout as layout_lib
from mtrain.parallel import manual
from mtrain.parallel.layout_syntax import LayoutError

__all__ = ["MODES", "Options", "Places", "attend", "balanced_order", "kv_heads_of_shard",
           "length_order", "local_attention", "splits_length", "visible"]

MODES = ("gather", "ring")


@dataclasses.dataclass(frozen=True)
class Options:
    """How self-attention with ``length`` split runs: `causal`, a sliding `window` (0:
    none), the logits' `scale`, the `mode` keys come by (`MODES`), the gathered form's flash
    `kernel` (None: einsum) and whether the rows are in `balanced_order` (`balanced`, as
    splash's mask must know)."""

    causal: bool = False
    window: int = 0
    scale: float = 1.0
    mode: str = "gather"
    kernel: str | None = None
    balanced: bool = False


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


def local_attention(q, k, v, at: Places, options: Options, *, axis: str | None = None,
                    bias=None, sinks=None):
    """Attention of this device's queries (inside a shard_map, ``length`` split over mesh
    axis `axis`; None: not split) to the whole row's keys, by `options.mode` (module doc);
    the gathered form by flash `options.kernel` where one is named, else by einsum. `bias`:
    T5's relative bias (a `positions.RelativeTable`, its heads this device's) of each
    block's positions (einsum blocks only: no kernel takes it). `sinks` [h]: each head's
    sink logit (None: none)."""
    o, (query_ids, memory_ids, query_index, memory_index) = options, at
    causal, window, scale, kernel = o.causal, o.window, o.scale, o.kernel

    def share(k, v, memory_ids, memory_index):
        mask = visible(query_ids, query_index, memory_ids, memory_index, causal, window)
        return block(q, k, v, mask, scale, relative_bias(bias, query_index, memory_index))

    if axis is None:
        return finish(with_sinks(share(k, v, memory_ids, memory_index), sinks, q), q.dtype)
    if bias is not None:
        kernel = None
    if o.mode == "ring":
        return ring.attention(q, k, v, at, bias, sinks, Ring(axis, causal, window, scale))
    if o.mode != "gather":
        raise ValueError(f"context parallelism must be one of {MODES}, got {o.mode!r}")
    gather = lambda *xs: [jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
                          for x in xs]
    if kernel == "splash" and q.shape[1] % 128 == 0:
        shard = (jax.lax.axis_index(axis), jax.lax.axis_size(axis), o.balanced)

        # (the backward pass gathers the keys and values again rather than keep them: only
        # the kernel's residuals, named KERNEL_OUTPUTS, are saved)
        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
            KERNEL_OUTPUTS))
        def gathered(q, k, v, query_ids, memory_ids, sinks):
            k, v, memory_ids = gather(k, v, memory_ids)
            ids = kernels.seeing_query_ids(query_ids, memory_ids)  # (no empty rows)
            return kernels.splash(q, k, v, ids, memory_ids, causal, window, scale, shard=shard,
                                  sinks=sinks)

        return gathered(q, k, v, query_ids, memory_ids, sinks)
    k, v, memory_ids, memory_index = gather(k, v, memory_ids, memory_index)
    if kernel in kernels.GPU_KERNELS:
        mask = visible(query_ids, query_index, memory_ids, memory_index, causal, window)
        mask |= (query_ids == 0)[:, :, None]  # (padding queries: no empty rows)
        run = kernels.triton if kernel == "triton" else kernels.cudnn
        return run(q, k, v, query_ids, memory_ids, causal, window, scale, mask=mask)
    return finish(with_sinks(share(k, v, memory_ids, memory_index), sinks, q), q.dtype)


def attend(q, k, v, at: Places, options: Options, bias=None, sinks=None):
    """Self-attention (q [b, l, h, d], k and v [b, l, g, d], segment ids and indices [b, l]
    `at`) with ``length`` split as the active layout says, under a shard_map over the mesh
    axes that split ``batch``, ``heads`` and ``length`` (`manual.shard_map_by_names`);
    directly without a layout. `options`, `bias`, `sinks`: see `local_attention`."""
    if sinks is not None and options.kernel in kernels.GPU_KERNELS:
        raise ValueError(f"transformer.flash_kernel={options.kernel!r} takes no attention "
                         f"sinks (transformer.attention_sinks): only 'splash' does")
    heads, length = manual.axis("heads"), manual.axis("length")
    if k.shape[2] == q.shape[2] or manual.axis("kv_heads") == heads:
        kv_heads = "heads"
    else:
        kv_heads = None  # (grouped heads split otherwise than the queries': whole here)

    def local(q, k, v, at, extra):
        if kv_heads is None and heads is not None:
            k, v = kv_heads_of_shard(q.shape[2], k, v, heads)
        return local_attention(q, k, v, at, options, axis=length, **extra)

    qkv, kv = ("batch", "length", "heads", None), ("batch", "length", kv_heads, None)
    ids = ("batch", "length")
    extra = {k: x for k, x in (("bias", bias), ("sinks", sinks)) if x is not None}
    extra_names = {k: ("heads",) if k == "sinks" else  # (the queries' heads)
                   x.replace(table=("heads", None)) for k, x in extra.items()}
    names = (qkv, kv, kv, Places(ids, ids, ids, ids), extra_names)
    return manual.shard_map_by_names(local, in_names=names, out_names=qkv, always=True)(
        q, k, v, at, extra)


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
