"""Transformer building blocks with named dimensions (Flax linen).

Every parameter is created with its logical dimension names (``("d_model", "d_ff")``) via
`nn.with_logical_partitioning`, and every large activation passes through `constrain` with its
names (``("batch", "length", "d_model")``). The names are the whole contract with the layout:
this file never sees a mesh.

Initialisers follow Mesh-TF/T5: weights are drawn so that activations keep unit scale, which is
why attention logits are not divided by sqrt(d_kv) (the query initialiser absorbs it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.parallel.layout import constrain
from mtrain.models import attention, context, kernels
from mtrain.models.lora import LoraConfig, project
from mtrain.models.quantization import Quantization
from mtrain.models.parameters import normal, param  # noqa: F401 (layers.param, layers.normal)
from mtrain.models import positions as positions_lib

Dtype = Any


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction) over
    the last dimension, named `names` (``d_model``; a head's ``d_kv`` for q/k norms).
    `offset`: the scale is offset + w (Gemma's 1 + w, w starting at 0), else w (from 1)."""

    epsilon: float = 1e-6
    dtype: Dtype = jnp.float32
    offset: float = 0.0
    names: tuple[str, ...] = ("d_model",)

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.constant(1.0 - self.offset)
        scale = param(self, "scale", init, (x.shape[-1],), self.names)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        if self.offset:
            scale = self.offset + scale
        return (y * scale).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The settings of `MultiHeadAttention` that published families add (see its doc):
    the logits' `scale`, q/k/v biases, per-head q/k RMSNorms (with their epsilon and scale
    offset), a sliding `window` (0: none), how self-attention with ``length`` split gets its
    keys (`context_parallel`, `models.context`), attention `sinks` and a bias on the output
    projection (`output_bias`)."""

    scale: float = 1.0
    bias: bool = False
    qk_norm: bool = False
    norm_epsilon: float = 1e-6
    norm_offset: float = 0.0
    window: int = 0
    context_parallel: str = "gather"
    sinks: bool = False
    output_bias: bool = False

    @classmethod
    def of(cls, c, window: int = 0, self_attention: bool = True) -> "AttentionOptions":
        """The options of a `TransformerConfig` `c`'s attention with sliding `window` (sinks
        in `self_attention` only)."""
        return cls(scale=c.attention_scale, bias=c.attention_bias, qk_norm=c.qk_norm,
                   norm_epsilon=c.norm_epsilon, norm_offset=c.norm_scale_offset,
                   window=window, context_parallel=c.context_parallel,
                   sinks=c.attention_sinks and self_attention,
                   output_bias=c.attention_output_bias)


class MultiHeadAttention(nn.Module):
    """Multi-head attention of `x` [batch, length, d_model] to `memory` [batch,
    memory_length, d_model] (itself for self-attention), where `mask` (an
    `attention.AttentionMask`) says which memory positions each position sees.

    Keys and values live on the ``memory_length`` dimension (Mesh-TF's name), so that query
    and key positions never collide in the layout even when ``length`` is split.

    `implementation`: 'einsum' (the plain path, `attention.reference`), 'dot_product'
    (`jax.nn.dot_product_attention` with the dense mask: cuDNN on GPU where it applies, XLA
    elsewhere), 'flash' (`attention.flash` with `flash_kernel`: segment ids, no [length,
    memory_length] logits; `flash_max_segments`: the table of 'cudnn_segments') or 'auto'
    (flash on GPU and TPU where its kernel takes the activations, see
    `attention.flash_refusal`; else einsum). The fused paths have no
    attention dropout: while training with dropout, 'auto' keeps the einsum path. A query of
    one position (a decoding step: self-attention to the cache, and encoder-decoder
    attention whose `mask` has no query ids) runs the einsum path whatever `implementation`
    says (see `attention`'s module doc).

    Incremental decoding (`decode_index` given, self-attention only): `x` is one position
    [batch, 1, d_model]; its key and value are written at `decode_index` into the "cache"
    collection (``cached_key``/``cached_value`` [batch, max_length, kv heads, d_kv], made by
    an `init` with the full decoding length), and the query attends to the cached positions
    <= `decode_index` by the einsum path. `mask` is then ignored.

    `num_kv_heads` key/value heads (0: `num_heads`): fewer is grouped-query attention (1:
    multi-query), each key/value head serving num_heads / num_kv_heads query heads; their
    parameters and activations then lie on ``kv_heads`` (with as many as the queries, on
    ``heads``: the full multi-head attention of the 2018 Transformer, laid out as before).
    `rotary_frequencies` (self-attention; `positions.inverse_frequencies`): RoPE on queries
    and keys at `positions` [batch, length] (the decoding step's, while decoding; the cache
    holds rotated keys). `bias` [1|batch, heads, length, memory_length] (float32) is added
    to the logits: T5's relative position bias, which no flash kernel takes ('auto' then
    runs einsum).

    What published families add, each a setting (`AttentionOptions`): the logits' `scale`
    (1: Mesh-TF's, the query initialiser has d_kv^-0.5; Llama's d_kv^-0.5 and Gemma's
    query_pre_attn_scalar^-0.5 kept as settings so that an optimizer step on an import is
    the step its home framework takes), biases on the query, key and value projections
    (Qwen2: ``q_bias`` [heads, d_kv], ``k_bias`` and ``v_bias`` [kv heads, d_kv]), an
    RMSNorm of each query and key head before the rotation (Qwen3, Gemma 3: ``q_norm`` and
    ``k_norm``, scale [d_kv]) and a sliding `window` (Mistral, Gemma 3's local layers: each
    position sees itself and the window - 1 before it). A windowed layer's decoding cache
    holds only the window, a ring of `window` positions. gpt-oss adds attention sinks (a
    logit per head, ``sinks`` [heads], float32, from 0, in each query's softmax:
    `attention.softmax_with_sinks`; einsum and splash take them, and 'auto' and
    'dot_product' run einsum where no kernel does) and a bias on the output projection
    (``o_bias`` [d_model], after any adapter of ``o``).
    """

    num_heads: int
    d_kv: int
    dropout_rate: float = 0.0
    dtype: Dtype = jnp.float32
    implementation: str = "einsum"
    flash_kernel: str = "auto"
    flash_max_segments: int = attention.CUDNN_MAX_SEGMENTS
    num_kv_heads: int = 0
    rotary_frequencies: positions_lib.Rotary | tuple[float, ...] | None = None
    options: AttentionOptions = None  # None: AttentionOptions()
    lora: LoraConfig | None = None  # adapters on the projections it targets (`lora`)
    quantization: Quantization | None = None  # low-precision projections (`quantization`)

    @classmethod
    def of(cls, c, *, rotary_frequencies=None, window: int = 0, name: str | None = None,
           self_attention: bool = True):
        """The attention of a `TransformerConfig` `c` (its heads, kernels, options and
        adapters), with `rotary_frequencies` and a sliding `window` (`self_attention`, or
        attention to an encoder's outputs: no sinks)."""
        return cls(num_heads=c.num_heads, d_kv=c.d_kv, dropout_rate=c.dropout_rate,
                   dtype=c.dtype, implementation=c.attention, flash_kernel=c.flash_kernel,
                   flash_max_segments=c.flash_max_segments, num_kv_heads=c.num_kv_heads,
                   rotary_frequencies=rotary_frequencies,
                   options=AttentionOptions.of(c, window, self_attention), lora=c.lora,
                   quantization=Quantization.of(c), name=name)

    def _path(self, deterministic: bool, single_query: bool = False,
              bias: bool = False) -> str:
        """'einsum', 'dot_product' or 'flash' for this call (`single_query`: a decoding
        step's; `bias`: with an additive bias)."""
        use, sinks = self.implementation, (self.options or AttentionOptions()).sinks
        if use == "auto":
            use = "flash" if not bias and attention.uses_flash(
                use, self.flash_kernel, jax.default_backend(), self.dtype, self.d_kv,
                sinks) else "einsum"
        if single_query or (self.dropout_rate > 0.0 and not deterministic) or (
                sinks and use == "dot_product"):  # (jax.nn.dot_product_attention: no sinks)
            return "einsum"
        return use

    @nn.compact
    def __call__(self, x, memory, mask: attention.AttentionMask, deterministic: bool,
                 decode_index=None, positions=None, bias=None):
        d_model = x.shape[-1]
        h, k = self.num_heads, self.d_kv
        g = self.num_kv_heads or h
        kv_heads = "heads" if g == h else "kv_heads"
        dt, o = self.dtype, self.options or AttentionOptions()
        wq = param(self, "q", normal((d_model * k) ** -0.5), (d_model, h, k),
                   ("d_model", "heads", "d_kv"), dt)
        kv_weights = ("d_model", kv_heads, "d_kv")
        wk = param(self, "k", normal(d_model**-0.5), (d_model, g, k), kv_weights, dt)
        wv = param(self, "v", normal(d_model**-0.5), (d_model, g, k), kv_weights, dt)
        wo = param(self, "o", normal((h * k) ** -0.5), (h, k, d_model),
                   ("heads", "d_kv", "d_model"), dt)

        def proj(name, spec, x, w, names):
            return project(self, name, spec, x, w, names, self.lora, deterministic,
                           self.quantization)

        q = proj("q", "bld,dhk->blhk", x, wq, ("d_model", "heads", "d_kv"))
        key = proj("k", "bmd,dhk->bmhk", memory, wk, kv_weights)
        value = proj("v", "bmd,dhk->bmhk", memory, wv, kv_weights)
        if o.bias:
            zeros = nn.initializers.zeros
            q = q + param(self, "q_bias", zeros, (h, k), ("heads", "d_kv"), dt)
            key = key + param(self, "k_bias", zeros, (g, k), (kv_heads, "d_kv"), dt)
            value = value + param(self, "v_bias", zeros, (g, k), (kv_heads, "d_kv"), dt)
        # (float32, as the logits they join)
        sinks = param(self, "sinks", nn.initializers.zeros, (h,), ("heads",)) if o.sinks \
            else None
        q = constrain(q, ("batch", "length", "heads", "d_kv"))
        kv_names = ("batch", "memory_length", kv_heads, "d_kv")
        key, value = constrain(key, kv_names), constrain(value, kv_names)
        if o.qk_norm:
            norm = dict(epsilon=o.norm_epsilon, dtype=dt, offset=o.norm_offset, names=("d_kv",))
            q = RMSNorm(**norm, name="q_norm")(q)
            key = RMSNorm(**norm, name="k_norm")(key)
        if self.rotary_frequencies is not None:  # (a `positions.Rotary`, or frequencies)
            q = positions_lib.rotate(q, positions, self.rotary_frequencies)
            key = positions_lib.rotate(key, positions, self.rotary_frequencies)
        if isinstance(decode_index, Prefill):  # the cache's first positions, then as a pass
            self._fill(key, value, decode_index.count, o.window)
            decode_index = None
        single_query = decode_index is not None or mask.query is None
        if decode_index is not None:
            key, value, mask = self._cached(key, value, decode_index, o.window)
            if bias is not None:  # (made for max_length positions: cut to the cache's)
                bias = bias[..., :key.shape[1]]
        elif o.window:
            mask = mask.windowed(o.window)
        path = self._path(deterministic, single_query, bias is not None)
        table = bias if isinstance(bias, positions_lib.RelativeTable) else None
        if (not single_query and isinstance(mask, attention.AttentionMask)
                and mask.self_attention and positions is not None
                and (bias is None or table is not None) and context.splits_length()):
            # ``length`` split: queries stay, keys come to them (causality by positions,
            # which restart per packed example as the segment ids do: the same mask)
            kernel = self.flash_kernel if self.flash_kernel != "auto" else \
                attention.default_kernel()
            options = context.Options(
                causal=mask.causal, window=mask.window, scale=o.scale, mode=o.context_parallel,
                kernel=(kernel if kernel != "cudnn_segments" else "cudnn")
                if path == "flash" else None, balanced=mask.balanced)
            at = context.Places(mask.query, mask.memory, positions, positions)
            out = context.attend(q, key, value, at, options, bias=table, sinks=sinks)
        elif path == "flash":
            out = attention.flash(q, key, value, mask, self.flash_kernel,
                                  self.flash_max_segments, o.scale, sinks)
        elif path == "dot_product":
            dense = mask.dense()
            out = jax.nn.dot_product_attention(
                q, key, value, mask=jnp.broadcast_to(dense, (q.shape[0], h, *dense.shape[2:])),
                bias=None if bias is None else bias.astype(q.dtype), scale=o.scale)
        else:
            dropout = attention.weights_dropout(self.dropout_rate, deterministic)
            out = attention.reference(q, key, value, mask, dropout, bias, o.scale, sinks)
        out = constrain(out, ("batch", "length", "heads", "d_kv"))
        y = proj("o", "blhk,hkd->bld", out, wo, ("heads", "d_kv", "d_model"))
        if o.output_bias:
            y = y + param(self, "o_bias", nn.initializers.zeros, (d_model,), ("d_model",), dt)
        return constrain(y, ("batch", "length", "d_model"))

    def _cached(self, key, value, index, window: int = 0):
        """Writes this position's key and value into the cache; returns all cached keys and
        values and the mask of the positions written so far. With a `window`, the cache is a
        ring of min(window, length) positions: position p is written at p mod its size, so
        that it holds exactly the window that the next query sees. `index`: a scalar, or
        one per row ([batch]: each row at its own position)."""
        initialised = self.has_variable("cache", "cached_key")
        length = key.shape[1]
        size = min(window, length) if window and not initialised else None
        shape = lambda x: (x.shape[0], size or x.shape[1], *x.shape[2:])  # noqa: E731
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape(key), key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape(value),
                                     value.dtype)
        if not initialised:  # the init call that creates the cache with the full length
            return key, value, kernels.band(length, length, True, window)[None, None]
        slots = cached_key.value.shape[1]
        at = index % slots if window else index
        if jnp.ndim(index):  # a position per row (past the cache: written nowhere)
            rows = jnp.arange(key.shape[0])
            cached_key.value = cached_key.value.at[rows, at].set(key[:, 0], mode="drop")
            cached_value.value = cached_value.value.at[rows, at].set(value[:, 0], mode="drop")
            mask = jnp.arange(slots)[None, :] <= index[:, None]
            return cached_key.value, cached_value.value, mask[:, None, None, :]
        cached_key.value = jax.lax.dynamic_update_slice_in_dim(cached_key.value, key, at, 1)
        cached_value.value = jax.lax.dynamic_update_slice_in_dim(cached_value.value, value, at, 1)
        mask = jnp.arange(slots) <= index  # (a full ring: every slot is inside the window)
        return cached_key.value, cached_value.value, mask[None, None, None, :]

    def _fill(self, key, value, count, window: int = 0):
        """A prefill's write into the empty cache: of the prompt's keys and values [b, n,
        ...], each row's first `count` [b] positions, position p at slot p (in a window's
        ring, p mod its size: each slot holds the last position written there)."""
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape,
                                     value.dtype)
        slots, n = cached_key.value.shape[1], key.shape[1]
        s = jnp.arange(slots)[None, :]
        position = s + slots * ((count[:, None] - 1 - s) // slots)  # [b, slots]
        written = s < count[:, None]
        take = jnp.clip(position, 0, n - 1)[:, :, None, None]
        for variable, new in ((cached_key, key), (cached_value, value)):
            variable.value = jnp.where(written[:, :, None, None],
                                       jnp.take_along_axis(new, take, axis=1), variable.value)


class Embed(nn.Module):
    """Token embedding [vocab, d_model]; `attend` gives logits against the same table."""

    vocab_size: int
    d_model: int
    dtype: Dtype = jnp.float32

    def setup(self):
        self.embedding = param(
            self, "embedding", normal(1.0), (self.vocab_size, self.d_model), ("vocab", "d_model")
        )

    def __call__(self, ids):
        x = jnp.take(self.embedding, ids, axis=0).astype(self.dtype)
        return constrain(x, ("batch", "length", "d_model"))

    def attend(self, x, scaled: bool = True):
        """Logits of a shared softmax, scaled by d_model^-0.5 as in Mesh-TF (`scaled`; a tied
        Llama's, Qwen's and Gemma's are not)."""
        logits = jnp.einsum("bld,vd->blv", x, self.embedding.astype(self.dtype))
        if scaled:
            logits = logits * self.d_model**-0.5
        return constrain(logits, ("batch", "length", "vocab"))


def shift_right(targets: jax.Array, segment_ids: jax.Array, start_id: int = 0) -> jax.Array:
    """Autoregressive decoder inputs: targets shifted right, `start_id` at the start of every
    segment (padding stays 0)."""
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    prev_segment = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    starts = jnp.where(segment_ids > 0, start_id, 0).astype(targets.dtype)
    return jnp.where(segment_ids == prev_segment, shifted, starts)


class DecodeIndex(nn.Module):
    """The position incremental decoding is at: in the "cache" collection, returned and then
    advanced by each decoding step (not by the `init` that creates the cache): a scalar
    shared by the rows, or with `rows` one per row of `batch` (a decoder-only LM's: its rows'
    prompts are prefilled to their own lengths). `advance`: by how many (a prefill: [batch],
    each row's prompt)."""

    rows: bool = False

    @nn.compact
    def __call__(self, batch: int = 1, advance=1):
        initialised = self.has_variable("cache", "index")
        index = self.variable("cache", "index",
                              lambda: jnp.zeros((batch,) if self.rows else (), jnp.int32))
        i = index.value
        if initialised:
            index.value = i + advance
        return i


class Prefill(NamedTuple):
    """In place of a decoding index: the layers see a prompt's positions from 0 in one pass
    (a causal mask, the flash kernels where configured) and write each row's first `count`
    [batch] keys and values into an empty cache (`MultiHeadAttention`)."""

    count: jax.Array
