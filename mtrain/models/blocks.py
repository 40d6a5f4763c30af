"""The layers of a Transformer's stacks: `Block` (attention, [encoder-decoder attention,]
feed-forward or mixture of experts, each pre-RMSNorm with a residual), rematerialised by
a policy, and stacked one per layer or as one block (or group of blocks) scanned over the
layers."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax

from mtrain.models import layers, positions
from mtrain.models.feedforward import DenseReluDense
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
    relative position bias for self-attention. With ``transformer.post_norms`` (Gemma) each
    sublayer's output is normed again before the residual (``post_attention_norm``,
    ``post_mlp_norm``); `window` is this layer's sliding window (0: none), which also picks
    its rotary frequencies (`rotary_frequencies`)."""

    config: Any  # a TransformerConfig
    cross_attention: bool = False
    moe: bool = False  # the feed-forward layer is the config's experts (`moe.py`)
    window: int = 0

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None, positions=None, bias=None):
        c = self.config
        drop = nn.Dropout(c.dropout_rate)

        def norm(name):
            return layers.RMSNorm(epsilon=c.norm_epsilon, dtype=c.dtype,
                                  offset=c.norm_scale_offset, name=name)

        def sublayer(name, y):
            return norm(f"post_{name}_norm")(y) if c.post_norms else y

        y = norm("attention_norm")(x)
        y = layers.MultiHeadAttention.of(
            c, rotary_frequencies=rotary_frequencies(c, self.window), window=self.window,
            name="self_attention")(y, y, mask, deterministic, decode_index, positions, bias)
        x = x + drop(sublayer("attention", y), deterministic=deterministic)
        if self.cross_attention:
            y = norm("encoder_decoder_attention_norm")(x)
            y = layers.MultiHeadAttention.of(c, name="encoder_decoder_attention")(
                y, memory, memory_mask, deterministic)
            x = x + drop(sublayer("encoder_decoder_attention", y), deterministic=deterministic)
        y = norm("mlp_norm")(x)
        if self.moe:
            real = None if mask is None or mask.query is None else mask.query > 0
            # decoding (a step or a prefill) drops no token: a step's group is its one
            # token, which no capacity binds, and a prefill must compute what steps would
            y = MoeFeedForward(config=c.moe, d_ff=c.moe.expert_d_ff,
                               dropout_rate=c.dropout_rate, dtype=c.dtype,
                               activations=c.mlp_activations, lora=c.lora, name="mlp")(
                y, deterministic, real, dropless=decode_index is not None)
        else:
            y = DenseReluDense(d_ff=c.d_ff, dropout_rate=c.dropout_rate, dtype=c.dtype,
                               activations=c.mlp_activations, lora=c.lora,
                               name="mlp")(y, deterministic)
        x = x + drop(sublayer("mlp", y), deterministic=deterministic)
        return constrain(x, ("batch", "length", "d_model"))


def rotary_frequencies(c, window: int = 0) -> tuple[float, ...] | None:
    """The RoPE frequencies of a self-attention layer with sliding `window` (None without
    rotary positions): a windowed layer of a model with ``rotary_local_max_wavelength``
    (Gemma 3's local layers) rotates by that wavelength unscaled, every other layer by
    ``rotary_max_wavelength`` and ``rope_scaling``."""
    if c.position_encoding != "rotary":
        return None
    if window and c.rotary_local_max_wavelength:
        inverse = positions.inverse_frequencies(c.d_kv, c.rotary_local_max_wavelength)
    else:
        inverse = positions.inverse_frequencies(c.d_kv, c.rotary_max_wavelength, c.rope_scaling)
    return tuple(float(f) for f in inverse)


class ScannedBlock(Block):
    """A Block as the body of `nn.scan`: (carry, per-layer output)."""

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None, positions=None, bias=None):
        return super().__call__(x, mask, deterministic, memory, memory_mask, decode_index,
                                positions, bias), None


class ScannedGroup(nn.Module):
    """`period(c)` Blocks ``layer_0``, ``layer_1``, ..., each as its place in the stack's
    repeating pattern says (experts every `moe_every`, a window by `attention_windows`):
    the body of `nn.scan` for a stack whose layers repeat in groups (`scanned_blocks`)."""

    config: Any
    cross_attention: bool = False

    @nn.compact
    def __call__(self, x, *args):
        c = self.config
        for i in range(period(c)):
            x = block_class(c)(c, self.cross_attention, moe=is_moe(c, i),
                               window=layer_window(c, i), name=f"layer_{i}")(x, *args)
        return x, None


def is_moe(c, layer: int) -> bool:
    """Whether a stack's layer `layer` (from 0) has experts: the last of every `moe_every`."""
    return bool(c.moe_every) and (layer + 1) % c.moe_every == 0


def layer_window(c, layer: int) -> int:
    """The sliding window of a stack's layer `layer` (0: none): ``attention_windows``
    repeated over the layers."""
    windows = c.attention_windows
    return windows[layer % len(windows)] if windows else 0


def period(c) -> int:
    """After how many layers a stack's layers repeat (experts, windows): what one scanned
    step holds."""
    return math.lcm(max(c.moe_every, 1), max(len(c.attention_windows), 1))


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
    layers that repeat in groups (experts every `moe_every` > 1 layers, sliding windows on
    some layers: `period`), one `ScannedGroup` of that many Blocks scanned num_layers /
    period times.

    Its parameters are stacked on a leading ``layers`` dimension (a logical axis that the
    layout leaves whole). Its decoding cache is stacked on axis 1, after the rows: beam search
    reorders every cache leaf along axis 0. Every argument after `x` (masks, `deterministic`,
    memory, `decode_index`) is the same for all layers.
    """
    body = block_class(c, scanned=True)
    moe = {"moe": c.moe_every == 1, "window": layer_window(c, 0)}
    if period(c) > 1:
        body, moe, num_layers = ScannedGroup, {}, num_layers // period(c)
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
        stack = [block_class(c)(c, moe=is_moe(c, i), window=layer_window(c, i),
                                name=f"layer_{i}") for i in range(c.num_layers)]
    return run_layers(stack, x, mask, deterministic, None, None, decode_index, positions, bias)
