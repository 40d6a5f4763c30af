"""Multi-head latent attention (DeepSeek-V2 and V3): queries through a low rank, keys and
values from one compressed latent per position and a rotary key shared by the heads; a
decoding cache of the latent and the rotary key alone.

Per position, ``kv_a`` makes a latent of `kv_lora_rank` (normed: ``kv_a_norm``) and a
rotary key of `qk_rope_head_dim` that every head shares; ``kv_b`` expands the latent into
each head's key without position (`qk_nope_head_dim`) and its value (`v_head_dim`). A
query head is [its nope part, its rotated rope part] (from ``q`` or, with a `q_lora_rank`,
``q_a``, ``q_a_norm``, ``q_b``); a key head [its nope key, the shared rotated key].

Training, evaluation, scoring and a prefill attend in that expanded form, by the paths of
`layers.MultiHeadAttention` (einsum, 'dot_product', the flash kernels, context
parallelism). A decoding step attends in the absorbed form instead: its query's nope part
taken into the latent space through ``kv_b``'s key rows, its logits the latent's and the
rotary key's dot products with the cached ones, its output the weighted latents through
``kv_b``'s value rows. The cache is ``cached_latent`` [batch, max_length, kv_lora] and
``cached_rope_key`` [batch, max_length, qk_rope]: (kv_lora_rank + qk_rope_head_dim) values
a position and layer, nothing per head (DeepSeek-V3's 576 against the 40960 of multi-head
attention with its 128 heads of 128 + 64 keys and 128 values).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.models import attention, context, kernels
from mtrain.models import positions as positions_lib
from mtrain.models.base import shape_field
from mtrain.models.kernels import NEG_INF
from mtrain.models.layers import Prefill, RMSNorm
from mtrain.models.lora import LoraConfig, merged, project, projection
from mtrain.models.quantization import Quantization
from mtrain.models.parameters import normal, param
from mtrain.parallel.layout import constrain

HEADS = ("batch", "length", "heads", "d_kv")


@dataclasses.dataclass(frozen=True)
class LatentConfig:
    """The latent attention of `TransformerConfig.mla` (gin ``mla.*``; the layers that have
    it: ``transformer.latent_attention``). DeepSeek-V3's sizes by default."""

    q_lora_rank: int = shape_field(1536)  # 0: queries projected directly from d_model
    kv_lora_rank: int = shape_field(512)
    qk_nope_head_dim: int = shape_field(128)
    qk_rope_head_dim: int = shape_field(64)
    v_head_dim: int = shape_field(128)
    # Hugging Face's rope_interleave: rotary pairs (x0, x1), (x2, x3), ... (DeepSeek's own
    # layout) instead of the half split (x_i, x_{i + d/2}) of Llama.
    rope_interleaved: bool = False

    def __post_init__(self):
        for name in ("kv_lora_rank", "v_head_dim", "qk_rope_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"mla.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("q_lora_rank", "qk_nope_head_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"mla.{name} must be 0 or more, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim is rotated in pairs: it must be even, got "
                             f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """A query's and a key's head width: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_width(self) -> int:
        """The head width the fused paths see: the query/key head's, the value heads
        zero-padded to it (or the value head's where that is the wider)."""
        return max(self.qk_head_dim, self.v_head_dim)


class LatentAttention(nn.Module):
    """Multi-head latent attention of `x` [batch, length, d_model] (module doc), called as
    `layers.MultiHeadAttention` (self-attention: `memory` is `x`).

    Parameters (``q_lora_rank`` > 0): ``q_a`` [d_model, q_lora], ``q_a_norm/scale``,
    ``q_b`` [q_lora, heads, nope + rope]; (0) ``q`` [d_model, heads, nope + rope]; ``kv_a``
    [d_model, kv_lora + rope] (the latent's outputs, then the rotary key's), ``kv_a_norm/
    scale`` [kv_lora], ``kv_b`` [kv_lora, heads, nope + v] (each head's key rows, then its
    value rows), ``o`` [heads, v, d_model]; adapters on those `lora` targets. The latents'
    RMSNorms have `norm_epsilon`; the logits are multiplied by `scale` (DeepSeek's
    (nope + rope)^-0.5 x YaRN's mscale squared on import; Mesh-TF's 1 by default, the query
    initialiser then has the head's -0.5 power).

    Kernels (`implementation` and `flash_kernel` as `MultiHeadAttention`'s): the einsum
    path takes any head sizes as they are; the fused ones ('dot_product', every flash
    kernel, context parallelism) get the values zero-padded to the query/key head width
    and their output cut back (`LatentConfig.head_width`). splash (TPU; Pallas' interpreter
    on a CPU) and triton (tokamax) take any width; cudnn and cudnn_segments a multiple of 8
    up to 256 on Hopper (128 before): DeepSeek-V3's 192 on an H100, not on an A100, where
    'auto' runs einsum (`attention.flash_refusal` of the width). No sliding window, sinks or
    output bias (no published model has them with latent attention).
    """

    num_heads: int
    config: LatentConfig
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    implementation: str = "einsum"
    flash_kernel: str = "auto"
    flash_max_segments: int = attention.CUDNN_MAX_SEGMENTS
    rotary_frequencies: positions_lib.Rotary | None = None
    scale: float = 1.0
    norm_epsilon: float = 1e-6
    context_parallel: str = "gather"
    lora: LoraConfig | None = None
    quantization: Quantization | None = None  # low-precision projections (`quantization`)

    @classmethod
    def of(cls, c, *, rotary_frequencies=None, window: int = 0, name: str | None = None):
        """The latent attention of a `TransformerConfig` `c` (`c.mla`) with
        `rotary_frequencies` (`blocks.rotary_frequencies`: over its rope dimensions)."""
        if window:
            raise ValueError("latent attention has no sliding window: set "
                             "transformer.attention_windows to full layers (0)")
        return cls(num_heads=c.num_heads, config=c.mla, dropout_rate=c.dropout_rate,
                   dtype=c.dtype, implementation=c.attention, flash_kernel=c.flash_kernel,
                   flash_max_segments=c.flash_max_segments,
                   rotary_frequencies=rotary_frequencies, scale=c.attention_scale,
                   norm_epsilon=c.norm_epsilon, context_parallel=c.context_parallel,
                   lora=c.lora, quantization=Quantization.of(c), name=name)

    def _path(self, deterministic: bool, single_query: bool = False) -> str:
        """'einsum', 'dot_product' or 'flash' for an expanded call (as
        `MultiHeadAttention`'s, with the padded head width)."""
        use = self.implementation
        if use == "auto":
            use = "flash" if attention.uses_flash(
                use, self.flash_kernel, jax.default_backend(), self.dtype,
                self.config.head_width) else "einsum"
        if single_query or (self.dropout_rate > 0.0 and not deterministic):
            return "einsum"
        return use

    def _norm(self, names, name):
        return RMSNorm(epsilon=self.norm_epsilon, dtype=self.dtype, names=names, name=name)

    def _queries(self, x, deterministic):
        """[b, l, heads, nope + rope]: directly, or through the normed low rank."""
        m, dt, lora = self.config, self.dtype, self.lora
        d_model, shape = x.shape[-1], (self.num_heads, m.qk_head_dim)
        if not m.q_lora_rank:
            names = ("d_model", "heads", "d_kv")
            w = param(self, "q", normal((d_model * m.qk_head_dim) ** -0.5), (d_model, *shape),
                      names, dt)
            return project(self, "q", "bld,dhk->blhk", x, w, names, lora, deterministic,
                    self.quantization)
        names = ("d_model", "q_lora")
        w = param(self, "q_a", normal(d_model**-0.5), (d_model, m.q_lora_rank), names, dt)
        low = project(self, "q_a", "bld,dc->blc", x, w, names, lora, deterministic,
                    self.quantization)
        low = self._norm(("q_lora",), "q_a_norm")(constrain(low, ("batch", "length", "q_lora")))
        names = ("q_lora", "heads", "d_kv")
        w = param(self, "q_b", normal((m.q_lora_rank * m.qk_head_dim) ** -0.5),
                  (m.q_lora_rank, *shape), names, dt)
        return project(self, "q_b", "blc,chk->blhk", low, w, names, lora, deterministic,
                    self.quantization)

    @nn.compact
    def __call__(self, x, memory, mask: attention.AttentionMask, deterministic: bool,
                 decode_index=None, positions=None, bias=None):
        if bias is not None:
            raise ValueError("latent attention takes no additive bias (T5's relative "
                             "positions): its positions are rotary")
        m, h, dt, lora = self.config, self.num_heads, self.dtype, self.lora
        d_model, nope, rope = x.shape[-1], m.qk_nope_head_dim, m.qk_rope_head_dim
        q = constrain(self._queries(x, deterministic), HEADS)
        names = ("d_model", "kv_latent")
        w = param(self, "kv_a", normal(d_model**-0.5), (d_model, m.kv_lora_rank + rope),
                  names, dt)
        compressed = project(self, "kv_a", "bmd,dc->bmc", memory, w, names, lora,
                             deterministic, self.quantization)
        latent = self._norm(("kv_lora",), "kv_a_norm")(compressed[..., :m.kv_lora_rank])
        latent = constrain(latent, ("batch", "memory_length", "kv_lora"))
        rope_key = compressed[..., m.kv_lora_rank:][:, :, None]  # [b, m, 1, rope]
        names = ("kv_lora", "heads", "d_kv")
        w = param(self, "kv_b", normal(m.kv_lora_rank**-0.5),
                  (m.kv_lora_rank, h, nope + m.v_head_dim), names, dt)
        kv_b = projection(self, "kv_b", "bmc,chk->bmhk", w, names, lora, self.quantization)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        if self.rotary_frequencies is not None:
            q_rope = positions_lib.rotate(q_rope, positions, self.rotary_frequencies)
            rope_key = positions_lib.rotate(rope_key, positions, self.rotary_frequencies)
        rope_key = constrain(rope_key[:, :, 0], ("batch", "memory_length", "d_rope"))
        if isinstance(decode_index, Prefill):  # the cache's first positions, then as a pass
            self._fill(latent, rope_key, decode_index.count)
            decode_index = None
        if decode_index is not None:
            latents, rope_keys, visible = self._cached(latent, rope_key, decode_index)
            out = self._absorbed(q_nope, q_rope, latents, rope_keys, visible, kv_b)
        else:
            kv = constrain(kv_b(latent, deterministic), ("batch", "memory_length", "heads",
                                                         "d_kv"))
            shared = jnp.broadcast_to(rope_key[:, :, None], (*kv.shape[:3], rope))
            key = jnp.concatenate([kv[..., :nope], shared], axis=-1)
            query = jnp.concatenate([q_nope, q_rope], axis=-1)
            out = self._attend(query, key, kv[..., nope:], mask, deterministic, positions)
        out = constrain(out, HEADS)
        names = ("heads", "d_kv", "d_model")
        w = param(self, "o", normal((h * m.v_head_dim) ** -0.5), (h, m.v_head_dim, d_model),
                  names, dt)
        y = project(self, "o", "blhk,hkd->bld", out, w, names, lora, deterministic,
                    self.quantization)
        return constrain(y, ("batch", "length", "d_model"))

    def _attend(self, q, k, v, mask: attention.AttentionMask, deterministic: bool, positions):
        """The expanded form's attention (q, k [b, l, h, nope + rope], v [b, l, h, v]) by
        the configured path, as `MultiHeadAttention` runs it."""
        path = self._path(deterministic, mask.query is None)
        v_dim, width = v.shape[-1], self.config.head_width

        def padded(x):
            return jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])

        if (mask.query is not None and mask.self_attention and positions is not None
                and context.splits_length()):
            kernel = self.flash_kernel if self.flash_kernel != "auto" else \
                attention.default_kernel()
            options = context.Options(
                causal=mask.causal, window=mask.window, scale=self.scale,
                mode=self.context_parallel, balanced=mask.balanced,
                kernel=(kernel if kernel != "cudnn_segments" else "cudnn")
                if path == "flash" else None)
            at = context.Places(mask.query, mask.memory, positions, positions)
            out = context.attend(padded(q), padded(k), padded(v), at, options)
        elif path == "flash":
            out = attention.flash(padded(q), padded(k), padded(v), mask, self.flash_kernel,
                                  self.flash_max_segments, self.scale)
        elif path == "dot_product":
            dense = mask.dense()
            out = jax.nn.dot_product_attention(
                padded(q), padded(k), padded(v), scale=self.scale,
                mask=jnp.broadcast_to(dense, (q.shape[0], q.shape[2], *dense.shape[2:])))
        else:
            dropout = attention.weights_dropout(self.dropout_rate, deterministic)
            return attention.reference(q, k, v, mask, dropout, None, self.scale)
        return out[..., :v_dim]

    def _absorbed(self, q_nope, q_rope, latents, rope_keys, visible, kv_b):
        """A decoding step's attention to the cache (`latents` [b, m, kv_lora], `rope_keys`
        [b, m, rope], `visible` [1|b, 1, 1|l, m]) with ``kv_b`` (its adapter merged)
        absorbed into the query and the output: never a key or value per head."""
        nope = q_nope.shape[-1]
        latents = constrain(latents, ("batch", "memory_length", "kv_lora"))
        rope_keys = constrain(rope_keys, ("batch", "memory_length", "d_rope"))
        # (weight, latents) pairs: ``kv_b`` with its adapter merged; quantized (`quantization`),
        # the weight and latents as the expanded pass's quantized matmul sees them, and the
        # adapter's share (unquantized there) beside it
        a, q = kv_b.adapter, kv_b.quantization
        if q is None:
            pairs = [(kv_b.w if a is None else merged(kv_b.w, a.a, a.b, kv_b.lora.scale),
                      latents)]
        else:
            pairs = [(q.rounded(kv_b.w, (0,)), q.rounded(latents, (2,)))]
            if a is not None:
                pairs.append((merged(jnp.zeros_like(kv_b.w), a.a, a.b, kv_b.lora.scale),
                              latents))
        logits = jnp.einsum("blhr,bmr->bhlm", q_rope, rope_keys,
                            preferred_element_type=jnp.float32)
        for w, held in pairs:
            q_latent = jnp.einsum("blhn,chn->blhc", q_nope, w[..., :nope])
            logits += jnp.einsum("blhc,bmc->bhlm", q_latent, held,
                                 preferred_element_type=jnp.float32)
        if self.scale != 1.0:
            logits = logits * self.scale
        logits = constrain(jnp.where(visible, logits, NEG_INF),
                           ("batch", "heads", "length", "memory_length"))
        weights = jax.nn.softmax(logits, axis=-1).astype(latents.dtype)
        return sum(jnp.einsum("blhc,chk->blhk", jnp.einsum("bhlm,bmc->blhc", weights, held),
                              w[..., nope:]) for w, held in pairs)

    def _cached(self, latent, rope_key, index):
        """Writes this position's latent and rotary key into the cache; returns all cached
        ones and the mask [1|b, 1, 1, max_length] of the positions written so far. `index`:
        a scalar, or one per row ([batch]). The `init` that makes the cache (with the full
        decoding length) only makes it, and attends causally over its inputs."""
        initialised = self.has_variable("cache", "cached_latent")
        caches = [self.variable("cache", name, jnp.zeros, new.shape, new.dtype)
                  for name, new in (("cached_latent", latent), ("cached_rope_key", rope_key))]
        length = latent.shape[1]
        if not initialised:
            return latent, rope_key, kernels.band(length, length, True)[None, None]
        slots = caches[0].value.shape[1]
        if jnp.ndim(index):  # a position per row (past the cache: written nowhere)
            rows = jnp.arange(latent.shape[0])
            for cache, new in zip(caches, (latent, rope_key)):
                cache.value = cache.value.at[rows, index].set(new[:, 0], mode="drop")
            visible = (jnp.arange(slots)[None, :] <= index[:, None])[:, None, None, :]
        else:
            for cache, new in zip(caches, (latent, rope_key)):
                cache.value = jax.lax.dynamic_update_slice_in_dim(cache.value, new, index, 1)
            visible = (jnp.arange(slots) <= index)[None, None, None, :]
        return caches[0].value, caches[1].value, visible

    def _fill(self, latent, rope_key, count):
        """A prefill's write into the empty cache: of the prompt's latents and rotary keys
        [b, n, ...], each row's first `count` [b] positions."""
        for name, new in (("cached_latent", latent), ("cached_rope_key", rope_key)):
            cache = self.variable("cache", name, jnp.zeros, new.shape, new.dtype)
            slots = jnp.arange(cache.value.shape[1])
            taken = jnp.take(new, jnp.clip(slots, 0, new.shape[1] - 1), axis=1)
            written = (slots[None, :] < count[:, None])[:, :, None]
            cache.value = jnp.where(written, taken, cache.value)
