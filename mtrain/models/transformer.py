"""The decoder-only Transformer language model (Mesh-TF's `Unitransformer`).

token embedding + learned positions -> num_layers x [pre-RMSNorm self-attention, pre-RMSNorm
DenseReluDense], each with dropout on its residual branch -> final RMSNorm -> dropout -> softmax
(unshared by default; `shared_embedding_and_softmax=True` reuses the embedding table).
Attention is causal and respects packed segments.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax.numpy as jnp

from mtrain.layout import constrain
from mtrain.models import layers


@gin.configurable("transformer", denylist=["vocab_size"])
@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model hyper-parameters (Mesh-TF names); gin binds them as ``transformer.d_model = 512``.

    The vocabulary size comes from the task's vocabulary, not from gin.
    """

    vocab_size: int = 8192
    d_model: int = 256
    d_ff: int = 1024
    num_heads: int = 4
    d_kv: int = 64
    num_layers: int = 2
    dropout_rate: float = 0.0
    shared_embedding_and_softmax: bool = False
    max_length: int = 512
    activation_dtype: str = "float32"

    @property
    def dtype(self):
        return jnp.dtype(self.activation_dtype)


class SelfAttentionBlock(nn.Module):
    """x + dropout(attention(norm(x))), then x + dropout(ffn(norm(x)))."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        c = self.config
        drop = nn.Dropout(c.dropout_rate)
        y = layers.RMSNorm(dtype=c.dtype, name="attention_norm")(x)
        y = layers.MultiHeadAttention(
            c.num_heads, c.d_kv, c.dropout_rate, c.dtype, name="self_attention"
        )(y, y, mask, deterministic)
        x = x + drop(y, deterministic=deterministic)
        y = layers.RMSNorm(dtype=c.dtype, name="mlp_norm")(x)
        y = layers.DenseReluDense(c.d_ff, c.dropout_rate, c.dtype, name="mlp")(y, deterministic)
        x = x + drop(y, deterministic=deterministic)
        return constrain(x, ("batch", "length", "d_model"))


class DecoderLM(nn.Module):
    """Decoder-only LM. `__call__` maps packed targets to next-token logits [b, l, vocab]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, targets, segment_ids, positions, deterministic: bool = True):
        c = self.config
        inputs = layers.shift_right(targets, segment_ids)
        embed = layers.Embed(c.vocab_size, c.d_model, c.dtype, name="token_embedding")
        pos_table = layers.param(
            self, "position_embedding", layers.normal(1.0), (c.max_length, c.d_model),
            ("length", "d_model"),
        )
        x = embed(inputs) + jnp.take(pos_table, positions, axis=0).astype(c.dtype)
        x = constrain(x, ("batch", "length", "d_model"))
        x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)
        mask = layers.causal_segment_mask(segment_ids)
        for i in range(c.num_layers):
            x = SelfAttentionBlock(c, name=f"layer_{i}")(x, mask, deterministic)
        x = layers.RMSNorm(dtype=c.dtype, name="final_norm")(x)
        x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)
        if c.shared_embedding_and_softmax:
            return embed.attend(x)
        softmax = layers.param(
            self, "softmax", layers.normal(c.d_model**-0.5), (c.d_model, c.vocab_size),
            ("d_model", "vocab"),
        )
        logits = jnp.einsum("bld,dv->blv", x, softmax.astype(c.dtype))
        return constrain(logits, ("batch", "length", "vocab"))
