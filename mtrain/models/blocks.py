"""The layers of a Transformer's stacks: `Block` (attention, [encoder-decoder attention,]
feed-forward or mixture of experts, each pre-RMSNorm with a residual), rematerialised by
a policy, and stacked one per layer or as one block (or group of blocks) scanned over the
layers."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax

from mtrain.errors import ConfigError
from mtrain.models import layers, pipeline, positions
from mtrain.models.feedforward import DenseReluDense, clamp_of
from mtrain.models.latent_attention import LatentAttention
from mtrain.models.moe import LOAD, STATS, MoeFeedForward, with_aux_loss
from mtrain.models.routing import COUNTS, MEAN_OVER
from mtrain.models.quantization import Quantization
from mtrain.models.remat import REMAT_POLICIES
from mtrain.parallel.layout import constrain


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
        attend = LatentAttention if c.latent_attention else layers.MultiHeadAttention
        y = attend.of(
            c, rotary_frequencies=rotary_frequencies(c, self.window), window=self.window,
            name="self_attention")(y, y, mask, deterministic, decode_index, positions, bias)
        x = x + drop(sublayer("attention", y), deterministic=deterministic)
        if self.cross_attention:
            y = norm("encoder_decoder_attention_norm")(x)
            y = layers.MultiHeadAttention.of(c, name="encoder_decoder_attention",
                                             self_attention=False)(
                y, memory, memory_mask, deterministic)
            x = x + drop(sublayer("encoder_decoder_attention", y), deterministic=deterministic)
        y = norm("mlp_norm")(x)
        if self.moe:
            real = None if mask is None or mask.query is None else mask.query > 0
            # decoding (a step or a prefill) drops no token: a step's group is its one
            # token, which no capacity binds, and a prefill must compute what steps would
            y = MoeFeedForward(config=c.moe, d_ff=c.moe.expert_d_ff,
                               dropout_rate=c.dropout_rate, dtype=c.dtype,
                               activations=c.mlp_activations, lora=c.lora, clamp=clamp_of(c),
                               quantization=Quantization.of(c), name="mlp")(
                y, deterministic, real, dropless=decode_index is not None)
        else:
            y = DenseReluDense(d_ff=c.d_ff, dropout_rate=c.dropout_rate, dtype=c.dtype,
                               activations=c.mlp_activations, lora=c.lora, clamp=clamp_of(c),
                               quantization=Quantization.of(c), name="mlp")(y, deterministic)
        x = x + drop(sublayer("mlp", y), deterministic=deterministic)
        return constrain(x, ("batch", "length", "d_model"))


def rotary_frequencies(c, window: int = 0) -> positions.Rotary | None:
    """The RoPE of a self-attention layer with sliding `window` (None without rotary
    positions): a windowed layer of a model with ``rotary_local_max_wavelength`` (Gemma 3's
    local layers) rotates by that wavelength unscaled, every other layer by
    ``rotary_max_wavelength`` and ``rope_scaling`` (YaRN's with its amplitude). Latent
    attention rotates its ``qk_rope_head_dim`` dimensions, interleaved where ``mla`` says."""
    if c.position_encoding != "rotary":
        return None
    d, interleaved = (c.mla.qk_rope_head_dim, c.mla.rope_interleaved) if c.latent_attention \
        else (c.d_kv, False)
    if window and c.rotary_local_max_wavelength:
        inverse, amplitude = positions.inverse_frequencies(d, c.rotary_local_max_wavelength), 1.0
    else:
        inverse = positions.inverse_frequencies(d, c.rotary_max_wavelength, c.rope_scaling)
        amplitude = c.rope_scaling.amplitude
    return positions.Rotary(tuple(float(f) for f in inverse), amplitude, interleaved)


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
    the body of `nn.scan` for a stack whose layers repeat in groups (`scanned_blocks`).
    `first`: the stack's layer the scan starts at; `dense`: the first_dense_layers' scan
    (`dense_period` Blocks, none with experts)."""

    config: Any
    cross_attention: bool = False
    first: int = 0
    dense: bool = False

    @nn.compact
    def __call__(self, x, *args):
        c = self.config
        for i in range(dense_period(c) if self.dense else period(c)):
            layer = self.first + i
            x = block_class(c)(c, self.cross_attention, moe=not self.dense and is_moe(c, layer),
                               window=layer_window(c, layer), name=f"layer_{i}")(x, *args)
        return x, None


def is_moe(c, layer: int) -> bool:
    """Whether a stack's layer `layer` (from 0) has experts: after the `first_dense_layers`
    k, the last of every `moe_every` counted from layer k."""
    k = getattr(c, "first_dense_layers", 0)
    return bool(c.moe_every) and layer >= k and (layer - k + 1) % c.moe_every == 0


def layer_window(c, layer: int) -> int:
    """The sliding window of a stack's layer `layer` (0: none): ``attention_windows``
    repeated over the layers."""
    windows = c.attention_windows
    return windows[layer % len(windows)] if windows else 0


def period(c) -> int:
    """After how many layers a stack's layers repeat (experts, windows): what one scanned
    step holds (after the `first_dense_layers`: `dense_period`)."""
    return math.lcm(max(c.moe_every, 1), max(len(c.attention_windows), 1))


def dense_period(c) -> int:
    """After how many of the `first_dense_layers` their layers repeat (windows)."""
    return max(len(c.attention_windows), 1)


def block_class(c, scanned: bool = False):
    """Block (or ScannedBlock), rematerialised by `c.remat_policy`."""
    cls = ScannedBlock if scanned else Block
    if c.remat_policy == "none":
        return cls
    # deterministic (argument 3, counting self) is a Python bool: static.
    return nn.remat(cls, policy=REMAT_POLICIES[c.remat_policy], static_argnums=(3,))


def scanned_blocks(c, num_layers: int, cross_attention: bool = False,
                   names: tuple[str | None, str | None] = (None, None)):
    """A stack of `num_layers` layers as one (remat) Block scanned `num_layers` times; run
    it with `run_layers`. With layers that repeat in groups (experts every `moe_every` > 1
    layers, sliding windows on some layers: `period`), one `ScannedGroup` of that many
    Blocks scanned num_layers / period times. With `first_dense_layers` k, two scans: the
    first k layers (dense), then the rest, as a list (named `names`: the dense scan's, the
    rest's; a setup names them by its attribute, ``encoder_0``, ``encoder_1``).

    Its parameters are stacked on a leading ``layers`` dimension (split over a mesh
    dimension, the stack runs as a pipeline: `pipelined_stack`). Its decoding cache is
    stacked on axis 1, after the rows: beam search reorders every cache leaf along axis 0.
    Every argument after `x` (masks, `deterministic`, memory, `decode_index`) is the same
    for all layers.
    """
    parts = scan_parts(c, num_layers)
    scans = [_scan(c, count, cross_attention, first, dense, names[0] if dense else names[1])
             for first, count, dense in parts]
    return scans if len(scans) > 1 else scans[0]


def scan_parts(c, num_layers: int) -> list[tuple[int, int, bool]]:
    """The scans of a stack of `num_layers` layers in order: (its first layer, its layers,
    whether they are the `first_dense_layers`)."""
    k = getattr(c, "first_dense_layers", 0)
    return ([(0, k, True)] if k else []) + [(k, num_layers - k, False)]


def _scan(c, num_layers: int, cross_attention: bool, first: int, dense: bool, name,
          bound: bool = True):
    """Layers `first` .. `first` + `num_layers` - 1 of a stack scanned (`scanned_blocks`);
    not `bound`: a module of its own (`pipelined_stack`'s chunks)."""
    size = dense_period(c) if dense else period(c)
    body = block_class(c, scanned=True)
    kwargs = {"moe": not dense and is_moe(c, first), "window": layer_window(c, first)}
    if size > 1:
        body, kwargs, num_layers = ScannedGroup, {"first": first, "dense": dense}, \
            num_layers // size
    scan = nn.scan(body, variable_axes={"params": 0, "cache": 1, STATS: 0},
                   split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                   length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    if not bound:
        kwargs["parent"] = None
    return scan(c, cross_attention, **kwargs, name=name)


def run_layers(stack, x, *args):
    """x through a sequence of Blocks, or through `scanned_blocks` (a scan, or a list of
    them: a scan's step returns a pair)."""
    for layer in stack if isinstance(stack, (list, tuple)) else [stack]:
        out = layer(x, *args)
        x = out[0] if isinstance(out, tuple) else out
    return x


def layer_stack(c, x, mask, deterministic: bool, decode_index=None, positions=None,
                bias=None, module: nn.Module | None = None):
    """The decoder-only LM's layers: `num_layers` Blocks ``layer_{i}``, or with `scan_layers`
    one Block ``layers`` scanned over a stacked ``layers`` parameter dimension (after the
    `first_dense_layers`, scanned as ``dense_layers``). Where the active layout splits
    ``layers`` (over stages), the scans of `module` (the model) run as a pipeline
    (`pipelined_stack`), but while the model is made or decodes a token at a time."""
    if pipeline.stages() > 1 and not c.scan_layers:
        raise pipeline.unscanned_refused()
    if c.scan_layers:
        if pipeline.stages() > 1 and decode_index is None and not module.is_initializing():
            return pipelined_stack(module, c, x, mask, deterministic, positions, bias)
        stack = scanned_blocks(c, c.num_layers, names=("dense_layers", "layers"))
    else:
        stack = [block_class(c)(c, moe=is_moe(c, i), window=layer_window(c, i),
                                name=f"layer_{i}") for i in range(c.num_layers)]
    return run_layers(stack, x, mask, deterministic, None, None, decode_index, positions, bias)


def check_stages(c, stages: int, rows: int, data_ways: int = 1,
                 encoder_decoder: bool = False) -> None:
    """Raises ConfigError (one line) where a stack cannot run over `stages` pipeline stages
    (a layout rule splitting ``layers``) with `rows` rows a trainer microbatch split
    `data_ways` ways inside a stage: the encoder-decoder's, an unscanned one's, a scan whose
    layers (groups of `period`) do not divide into the stages x `pipeline.repeats`, or a
    microbatch count that does not fit (`pipeline.microbatch_count`)."""
    if stages <= 1:
        return
    if encoder_decoder:
        raise pipeline.encoder_decoder_refused()
    if not c.scan_layers:
        raise pipeline.unscanned_refused()
    if (quantization := Quantization.of(c)) and quantization.delayed:
        raise ConfigError("transformer.quantization_scaling='delayed' keeps one amax history "
                          "per projection and step, and pipeline stages run each layer once "
                          "per microbatch: use 'tensorwise' or 'rowwise' with layers split "
                          "over stages")
    chunks = c.pipeline.chunks
    for _, count, dense in scan_parts(c, c.num_layers):
        steps = count // (dense_period(c) if dense else period(c))
        if steps % (stages * chunks):
            raise pipeline.split_refused(steps, stages, chunks, 1 if dense else period(c))
    pipeline.microbatch_count(c.pipeline, rows, stages, data_ways)


def pipelined_stack(module: nn.Module, c, x, mask, deterministic: bool, positions=None,
                    bias=None):
    """The decoder-only LM's scanned layers (`module`'s ``dense_layers`` and ``layers``,
    each in turn) run as a pipeline over the stages that split ``layers``
    (`pipeline.run`): each stage a scan of its chunk of the same Blocks, from the stack's
    parameters as they are stored. The experts' statistics, where the model keeps them,
    are the stack's (``moe_stats``), each layer's over the microbatches."""
    keep_stats = module.is_mutable_collection(STATS)
    train_dropout = not deterministic and c.dropout_rate > 0
    for first, count, dense in scan_parts(c, c.num_layers):
        name = "dense_layers" if dense else "layers"

        def chunk(params, x, rows, key, first=first, dense=dense):
            steps = jax.tree_util.tree_leaves(params)[0].shape[0]
            size = dense_period(c) if dense else period(c)
            scan = _scan(c, steps * size, False, first, dense, None, bound=False)
            out = scan.apply({"params": params}, x, rows[0], deterministic, None, None, None,
                             rows[1], bias, rngs={"dropout": key} if key is not None else None,
                             mutable=[STATS] if keep_stats else False)
            if not keep_stats:
                return out[0], {}
            (y, _), variables = out
            return y, variables.get(STATS, {})

        x, stats = pipeline.run(
            c.pipeline, chunk, module.variables["params"][name], x, (mask, positions),
            module.make_rng("dropout") if train_dropout else None, REDUCTIONS)
        if keep_stats and stats:
            module.put_variable(STATS, name, with_aux_loss(c.moe, stats))
    return x


# How the experts' statistics of a pipeline's microbatches add up (`moe.summary`'s): the
# means weighted by what they are means over, so that they are the batch's; the busiest
# expert's share (a metric) the most of any microbatch's.
REDUCTIONS = pipeline.Reductions(sums=(LOAD, *COUNTS), maxima=("busiest_expert_share",),
                                 weighted=tuple(MEAN_OVER.items()))
