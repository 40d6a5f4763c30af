"""The layers of a Transformer's stacks: `Block` (attention, [encoder-decoder attention,]
feed-forward or mixture of experts, each pre-RMSNorm with a residual), rematerialised by
a policy, and stacked one per layer or as one block (or group of blocks) scanned over the
layers."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from mtrain.models import layers
from mtrain.models.moe import STATS, MoeFeedForward
from mtrain.parallel.layout import constrain

# What a rematerialised layer keeps for the backward pass; the rest is recomputed.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


class Block(nn.Module):
    """x + dropout(self_attention(norm(x))), [x + dropout(encoder_decoder_attention(norm(x),
    memory))], x + dropout(ffn(norm(x))): a layer of the LM, the encoder or the decoder.
    `positions` [batch, length] are what rotary positions rotate by; `bias` is the stack's
    relative position bias for self-attention."""

    config: Any  # a TransformerConfig
    cross_attention: bool = False
    moe: bool = False  # the feed-forward layer is the config's experts (`moe.py`)

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None, positions=None, bias=None):
        c = self.config
        drop = nn.Dropout(c.dropout_rate)

        def attend(name, rotary=False):
            return layers.MultiHeadAttention(
                c.num_heads, c.d_kv, c.dropout_rate, c.dtype, c.attention, c.flash_kernel,
                c.flash_max_segments, c.num_kv_heads,
                c.rotary_max_wavelength if rotary else None, name=name)

        y = layers.RMSNorm(c.norm_epsilon, c.dtype, name="attention_norm")(x)
        y = attend("self_attention", c.position_encoding == "rotary")(
            y, y, mask, deterministic, decode_index, positions, bias)
        x = x + drop(y, deterministic=deterministic)
        if self.cross_attention:
            y = layers.RMSNorm(c.norm_epsilon, c.dtype, name="encoder_decoder_attention_norm")(x)
            y = attend("encoder_decoder_attention")(y, memory, memory_mask, deterministic)
            x = x + drop(y, deterministic=deterministic)
        y = layers.RMSNorm(c.norm_epsilon, c.dtype, name="mlp_norm")(x)
        if self.moe:
            real = None if mask is None or mask.query is None else mask.query > 0
            y = MoeFeedForward(c.moe, c.moe.expert_d_ff, c.dropout_rate, c.dtype,
                               c.mlp_activations, name="mlp")(y, deterministic, real)
        else:
            y = layers.DenseReluDense(c.d_ff, c.dropout_rate, c.dtype, c.mlp_activations,
                                      name="mlp")(y, deterministic)
        x = x + drop(y, deterministic=deterministic)
        return constrain(x, ("batch", "length", "d_model"))


class ScannedBlock(Block):
    """A Block as the body of `nn.scan`: (carry, per-layer output)."""

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None, positions=None, bias=None):
        return super().__call__(x, mask, deterministic, memory, memory_mask, decode_index,
                                positions, bias), None


class ScannedGroup(nn.Module):
    """`moe_every` Blocks ``layer_0``, ``layer_1``, ..., the last with experts: the body of
    `nn.scan` for a stack whose layers repeat in groups (`scanned_blocks`)."""

    config: Any
    cross_attention: bool = False

    @nn.compact
    def __call__(self, x, *args):
        c = self.config
        for i in range(c.moe_every):
            x = block_class(c)(c, self.cross_attention, moe=is_moe(c, i), name=f"layer_{i}")(
                x, *args)
        return x, None


def is_moe(c, layer: int) -> bool:
    """Whether a stack's layer `layer` (from 0) has experts: the last of every `moe_every`."""
    return bool(c.moe_every) and (layer + 1) % c.moe_every == 0


def block_class(c, scanned: bool = False):
    """Block (or ScannedBlock), rematerialised by `c.remat_policy`."""
    cls = ScannedBlock if scanned else Block
    if c.remat_policy == "none":
        return cls
    # deterministic (argument 3, counting self) is a Python bool: static.
    return nn.remat(cls, policy=REMAT_POLICIES[c.remat_policy], static_argnums=(3,))


def scanned_blocks(c, num_layers: int, cross_attention: bool = False,
                   **kwargs):
    """One (remat) Block scanned `num_layers` times; run it with `run_layers`. With
    experts every `moe_every` > 1 layers, one `ScannedGroup` of that many Blocks scanned
    num_layers / moe_every times.

    Its parameters are stacked on a leading ``layers`` dimension (a logical axis that the
    layout leaves whole). Its decoding cache is stacked on axis 1, after the rows: beam search
    reorders every cache leaf along axis 0. Every argument after `x` (masks, `deterministic`,
    memory, `decode_index`) is the same for all layers.
    """
    body, moe = block_class(c, scanned=True), {"moe": c.moe_every == 1}
    if c.moe_every > 1:
        body, moe, num_layers = ScannedGroup, {}, num_layers // c.moe_every
    scan = nn.scan(body, variable_axes={"params": 0, "cache": 1, STATS: 0},
                   split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                   length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return scan(c, cross_attention, **moe, **kwargs)


def run_layers(stack, x, *args):
    """x through a sequence of Blocks, or through `scanned_blocks`."""
    if isinstance(stack, nn.Module):
        return stack(x, *args)[0]
    for layer in stack:
        x = layer(x, *args)
    return x


def layer_stack(c, x, mask, deterministic: bool, decode_index=None, positions=None,
                bias=None):
    """The decoder-only LM's layers: `num_layers` Blocks ``layer_{i}``, or with `scan_layers`
    one Block ``layers`` scanned over a stacked ``layers`` parameter dimension."""
    if c.scan_layers:
        stack = scanned_blocks(c, c.num_layers, name="layers")
    else:
        stack = [block_class(c)(c, moe=is_moe(c, i), name=f"layer_{i}")
                 for i in range(c.num_layers)]
    return run_layers(stack, x, mask, deterministic, None, None, decode_index, positions, bias)
