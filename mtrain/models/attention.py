"""Attention over packed sequences: the einsum reference and the flash kernels.

Which positions a query sees is described by `AttentionMask`: the segment ids of the queries
and of the memory (0 is padding; each packed example has its own id) and whether attention
is causal. The einsum path (`reference`) turns it into a dense boolean mask [batch, 1,
length, memory_length]; the flash kernels take the segment ids themselves and never form
the [length, memory_length] logits:

- ``splash``: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
  the TPU kernel, with segment ids. On CPU it runs in Pallas' interpret mode: slow, and what
  the tests use to check it against the reference.
- ``triton``: the Pallas GPU (Triton) flash attention with segment ids
  (`jax.experimental.pallas.ops.gpu.attention.mha`); self-attention only (it takes one set
  of segment ids: encoder-decoder attention then uses the default kernel), and interpret
  mode on CPU as well.
- ``cudnn``: cuDNN's fused flash attention through `jax.nn.dot_product_attention`, given the
  packed mask (a [batch, 1, length, memory_length] boolean, not the float logits; cuDNN
  turns it into a bias). It needs a GPU, bfloat16 or float16 activations and a head size
  (d_kv) that is a multiple of 8, at most 128 (256 from Hopper on): jax's own checks, which
  `flash_refusal` states before anything is traced. Where they fail, ``attention='auto'``
  runs the einsum path (a float32 model on a GPU, say) and ``attention='flash'`` is a
  configuration error.

`flash` picks the kernel (``flash_kernel='auto'``: cudnn on GPU, splash elsewhere) and runs
it under `jax.shard_map` over the mesh dimensions that split ``batch`` and ``heads``, so a
kernel that XLA cannot partition sees only its own rows and heads.

A padding query (segment 0) of splash and cuDNN is given the segment of the first memory
position, so that no row of their mask is empty (in encoder-decoder attention a padded
target may have no padded input to see). What padding positions compute is never used (the
loss weighs them 0): only what real positions compute must agree with the reference.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtrain import layout as layout_lib

NEG_INF = -1e9
FLASH_KERNELS = ("auto", "cudnn", "splash", "triton")
CUDNN_NEEDS_A_GPU = "flash_kernel='cudnn' needs a GPU; use 'splash' or 'auto' here"


@flax.struct.dataclass
class AttentionMask:
    """Who sees whom: `query` [batch, length] and `memory` [batch, memory_length] segment ids
    (0 = padding), and `causal` (query i sees memory j <= i). `query` None: every query sees
    every real memory position (one decoding step's encoder-decoder attention).
    `self_attention`: query and memory are the same positions (`of_self`)."""

    query: jax.Array | None
    memory: jax.Array
    causal: bool = flax.struct.field(pytree_node=False, default=False)
    self_attention: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def of_self(cls, segment_ids: jax.Array, causal: bool) -> "AttentionMask":
        """Self-attention within the packed segments of `segment_ids`."""
        return cls(segment_ids, segment_ids, causal, self_attention=True)

    def dense(self) -> jax.Array:
        """[batch, 1, length, memory_length]: the real positions of the query's own segment
        (and with `causal` only those at or before it)."""
        real = (self.memory > 0)[:, None, :]
        if self.query is None:
            return real[:, None]
        mask = (self.query[:, :, None] == self.memory[:, None, :]) & real
        if self.causal:
            length, memory_length = self.query.shape[1], self.memory.shape[1]
            mask &= jnp.arange(length)[:, None] >= jnp.arange(memory_length)[None, :]
        return mask[:, None]

    def kernel_query_ids(self) -> jax.Array:
        """The query segment ids given to a flash kernel: padding (0) takes the segment of
        memory position 0, so that every row of the kernel's mask sees a position."""
        return jnp.where(self.query == 0, self.memory[:, :1], self.query)


def reference(q, k, v, mask: AttentionMask | jax.Array, dropout=None):
    """softmax(q k^T masked) v in float32 logits: q [b, l, h, d], k and v [b, m, h, d];
    `mask` an `AttentionMask` or a dense boolean [b, 1|h, l, m]; `dropout(weights)` is
    applied to the attention weights. No 1/sqrt(d) scale (the query initialiser has it)."""
    dense = mask.dense() if isinstance(mask, AttentionMask) else mask
    logits = jnp.einsum("blhk,bmhk->bhlm", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(dense, logits, NEG_INF)
    logits = layout_lib.constrain(logits, ("batch", "heads", "length", "memory_length"))
    weights = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhlm,bmhk->blhk", weights, v)


def default_kernel(backend: str | None = None) -> str:
    """The kernel of ``flash_kernel='auto'`` on `backend` (default: this process's)."""
    return "cudnn" if (backend or jax.default_backend()) == "gpu" else "splash"


def _cudnn_head_limit() -> int:
    """The largest head size cuDNN's flash attention takes here: 256 from Hopper (compute
    capability 9.0) on, 128 before (jax's `check_is_flash_attention`)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return 256 if float(capability) >= 9.0 else 128


def flash_refusal(kernel: str, backend: str, dtype, d_kv: int) -> str | None:
    """Why `flash` with `kernel` cannot run on `backend` for activations of `dtype` and heads
    of `d_kv` (None: it can). Only cuDNN refuses; the Pallas kernels take any."""
    if (kernel if kernel != "auto" else default_kernel(backend)) != "cudnn":
        return None
    if backend != "gpu":
        return CUDNN_NEEDS_A_GPU
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return (f"cuDNN's flash attention takes bfloat16 or float16 activations, not "
                f"{jnp.dtype(dtype).name}")
    limit = _cudnn_head_limit() if backend == jax.default_backend() else 128
    if d_kv % 8 or d_kv > limit:
        return f"cuDNN's flash attention takes d_kv a multiple of 8 up to {limit}, not {d_kv}"
    return None


def flash(q, k, v, mask: AttentionMask, kernel: str = "auto"):
    """The attention of `reference` by a flash kernel (see the module doc), split over the
    active layout's ``batch`` and ``heads`` mesh dimensions."""
    if kernel == "auto":
        kernel = default_kernel()
    if kernel not in KERNELS:
        raise ValueError(f"flash kernel must be one of {FLASH_KERNELS}, got {kernel!r}")
    if kernel == "triton" and not mask.self_attention:
        kernel = default_kernel()  # it takes one array of segment ids: self-attention only
    fn = functools.partial(KERNELS[kernel], causal=mask.causal)
    # triton takes one array of ids for queries and keys: padding there sees padding.
    query_ids = mask.query if kernel == "triton" else mask.kernel_query_ids()
    return _sharded(fn, q, k, v, query_ids, mask.memory)


def _sharded(fn, q, k, v, query_ids, memory_ids):
    """fn(q, k, v, query_ids, memory_ids) under `jax.shard_map` over the mesh axes that
    split ``batch`` and ``heads`` in the active layout (inside a replica, over the axes not
    already manual); called directly when no layout is active or nothing is split."""
    active = layout_lib.active()
    if active is None:
        return fn(q, k, v, query_ids, memory_ids)
    layout, mesh = active
    context = jax.sharding.get_abstract_mesh()
    manual = set(context.manual_axes) if not context.empty else set()
    if manual:
        mesh = context
    batch, heads = (layout.mesh_dim_for(n) for n in ("batch", "heads"))
    batch, heads = (None if a in manual else a for a in (batch, heads))
    if batch is None and heads is None:
        return fn(q, k, v, query_ids, memory_ids)
    qkv, ids = P(batch, None, heads, None), P(batch, None)
    free = frozenset(mesh.axis_names) - manual
    return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, ids, ids), out_specs=qkv,
                         axis_names=free, check_vma=False)(q, k, v, query_ids, memory_ids)


def _block(n: int, largest: int = 512) -> int:
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


def _splash(q, k, v, query_ids, memory_ids, causal):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    length = q.shape[1]
    q, k, v, query_ids, memory_ids = _pad(q, k, v, query_ids, memory_ids, 128)  # its lanes
    heads, shape = q.shape[2], (q.shape[1], k.shape[1])
    one = splash.CausalMask(shape) if causal else splash.FullMask(shape)
    bq, bkv = _block(shape[0]), _block(shape[1])
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                              block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                              block_q_dq=bq, block_kv_dq=bkv)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
        interpret=jax.default_backend() != "tpu")

    def one_row(q, k, v, qs, ks):  # [l, h, d] -> the kernel's [h, l, d]
        out = kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                     segment_ids=splash.SegmentIds(q=qs, kv=ks))
        return out.swapaxes(0, 1)

    return jax.vmap(one_row)(q, k, v, query_ids, memory_ids)[:, :length]


def _triton(q, k, v, query_ids, memory_ids, causal):
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    del memory_ids  # the same as query_ids for self-attention (checked by `flash`)
    length = q.shape[1]
    q, k, v, query_ids, _ = _pad(q, k, v, query_ids, query_ids, 64)
    b = _block(q.shape[1], largest=128) if q.shape[1] % 128 == 0 else 64
    sizes = pallas_gpu.BlockSizes(block_q=b, block_k=b, block_q_dkv=32, block_kv_dkv=32,
                                  block_q_dq=32, block_kv_dq=32)
    out = pallas_gpu.mha(q, k, v, query_ids, sm_scale=1.0, causal=causal, block_sizes=sizes,
                         interpret=jax.default_backend() != "gpu")
    return out[:, :length]


def _cudnn(q, k, v, query_ids, memory_ids, causal):
    if jax.default_backend() != "gpu":
        raise ValueError(f"transformer.{CUDNN_NEEDS_A_GPU}")
    length = q.shape[1]
    # cuDNN takes a mask (as a bias) in training only over even lengths.
    q, k, v, query_ids, memory_ids = _pad(q, k, v, query_ids, memory_ids, 2)
    mask = AttentionMask(query_ids, memory_ids, causal).dense()
    # is_causal as well: cuDNN then skips the blocks above the diagonal.
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=causal,
                                        implementation="cudnn")[:, :length]


KERNELS = {"splash": _splash, "triton": _triton, "cudnn": _cudnn}

