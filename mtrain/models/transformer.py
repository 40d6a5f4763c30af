"""The Transformers: decoder-only LM (Mesh-TF's `Unitransformer`) and encoder-decoder
(`Bitransformer`).

token embedding + learned positions -> num_layers x [pre-RMSNorm self-attention,
(decoder: pre-RMSNorm encoder-decoder attention,) pre-RMSNorm DenseReluDense], each with
dropout on its residual branch -> final RMSNorm -> dropout -> softmax (unshared by default;
`shared_embedding_and_softmax=True` reuses the embedding table). Attention respects packed
segments; decoder self-attention is causal.

A model's `features` say which packed features its `__call__` takes: for each, the tokens,
segment ids and positions, in that order.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.parallel.layout import constrain
from mtrain.models import attention, layers
from mtrain.models.attention import CUDNN_MAX_SEGMENTS
from mtrain.models.base import shape_field


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model hyper-parameters (Mesh-TF names; gin: ``transformer.d_model = 512``). The
    vocabulary size comes from the task's vocabulary. The `shape_field`s change parameter
    shapes; the rest (dropout, dtype, remat, attention) may change between runs of a model."""

    vocab_size: int = shape_field(8192)
    d_model: int = shape_field(256)
    d_ff: int = shape_field(1024)
    num_heads: int = shape_field(4)
    d_kv: int = shape_field(64)
    num_layers: int = shape_field(2)
    num_encoder_layers: int = shape_field(0)  # encoder-decoder only; 0: as many as num_layers
    dropout_rate: float = 0.0
    shared_embedding_and_softmax: bool = shape_field(False)
    max_length: int = shape_field(512)
    activation_dtype: str = "float32"  # 'bfloat16': activations and matmuls (params stay f32)
    remat_policy: str = "none"  # per layer: 'none', 'full' (recompute all), 'dots' (keep matmuls)
    scan_layers: bool = shape_field(False)  # each layer stack one scanned Block: compile time flat in depth
    # 'einsum', 'dot_product' (jax.nn.dot_product_attention), 'flash' (packed flash
    # attention; no attention dropout) or 'auto' (flash on GPU and TPU where its kernel
    # takes the activations: cuDNN's, bfloat16; einsum on CPU and elsewhere).
    attention: str = "auto"
    # 'auto' (cudnn on GPU, splash elsewhere), 'cudnn' (cuDNN given the packed mask),
    # 'cudnn_segments' (cuDNN's packed-segment layout, Hopper on), 'splash', 'triton'.
    flash_kernel: str = "auto"
    # cudnn_segments' table: packed examples per row at most.
    flash_max_segments: int = CUDNN_MAX_SEGMENTS

    @property
    def dtype(self):
        return jnp.dtype(self.activation_dtype)

    def __post_init__(self):
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"transformer.remat_policy must be one of {sorted(REMAT_POLICIES)}, "
                             f"got {self.remat_policy!r}")
        if self.attention not in ("auto", "einsum", "dot_product", "flash"):
            raise ValueError(f"transformer.attention must be 'auto', 'einsum', 'dot_product' or "
                             f"'flash', got {self.attention!r}")
        if self.flash_kernel not in attention.FLASH_KERNELS:
            raise ValueError(f"transformer.flash_kernel must be one of "
                             f"{', '.join(attention.FLASH_KERNELS)}, got {self.flash_kernel!r}")
        if self.flash_max_segments < 1:
            raise ValueError(f"transformer.flash_max_segments must be at least 1, got "
                             f"{self.flash_max_segments}")
        if self.attention == "flash" and self.dropout_rate > 0:
            raise ValueError("transformer.attention='flash' has no attention dropout, and "
                             f"transformer.dropout_rate is {self.dropout_rate}: set it to 0, or "
                             "use attention 'auto' (flash where no dropout is applied)")
        if self.activation_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"activation_dtype must be 'float32' or 'bfloat16', got "
                             f"{self.activation_dtype!r}")
        if self.attention == "flash" and (why := attention.flash_refusal(
                self.flash_kernel, jax.default_backend(), self.dtype, self.d_kv)):
            raise ValueError(f"transformer.attention='flash': {why} (attention 'auto' uses "
                             "flash attention where it can run, einsum elsewhere)")


# What a rematerialised layer keeps for the backward pass; the rest is recomputed.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


class Block(nn.Module):
    """x + dropout(self_attention(norm(x))), [x + dropout(encoder_decoder_attention(norm(x),
    memory))], x + dropout(ffn(norm(x))): a layer of the LM, the encoder or the decoder."""

    config: TransformerConfig
    cross_attention: bool = False

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None):
        c = self.config
        drop = nn.Dropout(c.dropout_rate)

        def attend(name):
            return layers.MultiHeadAttention(c.num_heads, c.d_kv, c.dropout_rate, c.dtype,
                                             c.attention, c.flash_kernel,
                                             c.flash_max_segments, name=name)

        y = layers.RMSNorm(dtype=c.dtype, name="attention_norm")(x)
        y = attend("self_attention")(y, y, mask, deterministic, decode_index)
        x = x + drop(y, deterministic=deterministic)
        if self.cross_attention:
            y = layers.RMSNorm(dtype=c.dtype, name="encoder_decoder_attention_norm")(x)
            y = attend("encoder_decoder_attention")(y, memory, memory_mask, deterministic)
            x = x + drop(y, deterministic=deterministic)
        y = layers.RMSNorm(dtype=c.dtype, name="mlp_norm")(x)
        y = layers.DenseReluDense(c.d_ff, c.dropout_rate, c.dtype, name="mlp")(y, deterministic)
        x = x + drop(y, deterministic=deterministic)
        return constrain(x, ("batch", "length", "d_model"))


class ScannedBlock(Block):
    """A Block as the body of `nn.scan`: (carry, per-layer output)."""

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, memory=None, memory_mask=None,
                 decode_index=None):
        return super().__call__(x, mask, deterministic, memory, memory_mask, decode_index), None


def block_class(c: TransformerConfig, scanned: bool = False):
    """Block (or ScannedBlock), rematerialised by `c.remat_policy`."""
    cls = ScannedBlock if scanned else Block
    if c.remat_policy == "none":
        return cls
    # deterministic (argument 3, counting self) is a Python bool: static.
    return nn.remat(cls, policy=REMAT_POLICIES[c.remat_policy], static_argnums=(3,))


def scanned_blocks(c: TransformerConfig, num_layers: int, cross_attention: bool = False,
                   **kwargs):
    """One (remat) Block scanned `num_layers` times; run it with `run_layers`.

    Its parameters are stacked on a leading ``layers`` dimension (a logical axis that the
    layout leaves whole). Its decoding cache is stacked on axis 1, after the rows: beam search
    reorders every cache leaf along axis 0. Every argument after `x` (masks, `deterministic`,
    memory, `decode_index`) is the same for all layers.
    """
    scan = nn.scan(block_class(c, scanned=True), variable_axes={"params": 0, "cache": 1},
                   split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                   length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return scan(c, cross_attention, **kwargs)


def run_layers(stack, x, *args):
    """x through a sequence of Blocks, or through `scanned_blocks`."""
    if isinstance(stack, nn.Module):
        return stack(x, *args)[0]
    for layer in stack:
        x = layer(x, *args)
    return x


def layer_stack(c: TransformerConfig, x, mask, deterministic: bool):
    """The decoder-only LM's layers: `num_layers` Blocks ``layer_{i}``, or with `scan_layers`
    one Block ``layers`` scanned over a stacked ``layers`` parameter dimension."""
    if c.scan_layers:
        stack = scanned_blocks(c, c.num_layers, name="layers")
    else:
        stack = [block_class(c)(c, name=f"layer_{i}") for i in range(c.num_layers)]
    return run_layers(stack, x, mask, deterministic)


def _softmax_table(module: nn.Module, c: TransformerConfig):
    """The softmax weights [d_model, vocab] in the compute dtype (cast on their shards, as
    the layers' weights are), or None when the embedding table is shared. The tables read
    by token id stay float32 up to the lookup, so that their gradients (a scatter-add of
    the tokens' rows) add up in float32."""
    if c.shared_embedding_and_softmax:
        return None
    return layers.param(module, "softmax", layers.normal(c.d_model**-0.5),
                        (c.d_model, c.vocab_size), ("d_model", "vocab"), c.dtype)


def _logits(c: TransformerConfig, embed: layers.Embed, softmax, x, return_hidden: bool):
    """Next-token logits [b, l, vocab] from the shared embedding table or `softmax`; with
    `return_hidden`, ``(x, kernel)`` with logits = x @ kernel instead (for a loss that
    computes the logits a slice at a time: `losses.chunked_cross_entropy`)."""
    if return_hidden:
        if softmax is None:  # the shared table, with attend's scale
            kernel = (embed.embedding.astype(c.dtype) * c.d_model**-0.5).T
        else:
            kernel = softmax
        return x, constrain(kernel, ("d_model", "vocab"))
    if softmax is None:
        return embed.attend(x)
    logits = jnp.einsum("bld,dv->blv", x, softmax)
    return constrain(logits, ("batch", "length", "vocab"))


def _layer_parameters(c: TransformerConfig, encoder_layers: int, decoder_layers: int) -> int:
    """Matmul parameters of the layer stacks: an encoder (or LM) layer has attention (4 d h
    d_kv) and a feed-forward block (2 d d_ff); a decoder layer two attentions."""
    attention, ffn = 4 * c.d_model * c.num_heads * c.d_kv, 2 * c.d_model * c.d_ff
    return encoder_layers * (attention + ffn) + decoder_layers * (2 * attention + ffn)


def _analytic_flops(c: TransformerConfig, layer_parameters: int, attention_layers: int,
                    batch_size: int, length: int) -> float:
    """6 x matmul parameters x tokens (forward 2, backward 4) plus attention's scores and
    weighted sums, 12 x length x heads x d_kv per token and layer of attention. The
    embedding lookup is no matmul; the softmax is (shared or not)."""
    tokens = batch_size * length
    matmul = layer_parameters + c.vocab_size * c.d_model
    scores = 12 * length * c.num_heads * c.d_kv * tokens
    return 6 * matmul * tokens + attention_layers * scores


def _tables(c: TransformerConfig) -> int:
    """The embedding and softmax tables as the paper counts them (no position tables)."""
    return (1 if c.shared_embedding_and_softmax else 2) * c.vocab_size * c.d_model


class _PackingAware:
    """The optional model contract of `base` for the transformers: their attention's kernel
    on a Hopper GPU wants each batch's packing, and 'cudnn_segments' refuses a batch with a
    row of more examples than its table."""

    @property
    def uses_packing(self) -> bool:
        return attention.adapts_segment_table(self.config)

    def check_batch(self, batch: dict) -> None:
        attention.check_batch(self.config, batch)


class DecoderLM(_PackingAware, nn.Module):
    """Decoder-only LM. `__call__` maps packed targets to next-token logits [b, l, vocab]
    (with `return_hidden`: the final hidden states and the output kernel, see `_logits`)."""

    config: TransformerConfig
    features = ("targets",)  # the packed features __call__ takes, in order

    def analytic_parameters(self) -> int:
        """layers (4 d h d_kv + 2 d d_ff) + 2 V d (V d with a shared softmax)."""
        return _layer_parameters(self.config, self.config.num_layers, 0) + _tables(self.config)

    def analytic_flops(self, batch_size: int, length: int) -> float:
        c = self.config
        return _analytic_flops(c, _layer_parameters(c, c.num_layers, 0), c.num_layers,
                               batch_size, length)

    @nn.compact
    def __call__(self, targets, segment_ids, positions, deterministic: bool = True,
                 return_hidden: bool = False):
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
        mask = attention.AttentionMask.of_self(segment_ids, causal=True)
        x = layer_stack(c, x, mask, deterministic)
        x = layers.RMSNorm(dtype=c.dtype, name="final_norm")(x)
        x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)
        return _logits(c, embed, _softmax_table(self, c), x, return_hidden)


class DecodeIndex(nn.Module):
    """The position incremental decoding is at: a scalar in the "cache" collection, returned
    and then advanced by each decoding step (not by the `init` that creates the cache)."""

    @nn.compact
    def __call__(self):
        initialised = self.has_variable("cache", "index")
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        i = index.value
        if initialised:
            index.value = i + 1
        return i


class EncoderDecoder(_PackingAware, nn.Module):
    """The encoder-decoder Transformer (Mesh-TF's `Bitransformer`) for translation.

    One token embedding serves inputs and targets (the paper's setting for translation);
    `shared_embedding_and_softmax` also reuses it as the softmax. Encoder layers attend within
    their packed segment of the inputs; decoder layers attend causally within their segment
    of the targets and to the encoder positions of the same segment.

    - `__call__(inputs, inputs_segment_ids, inputs_positions, targets, targets_segment_ids,
      targets_positions)`: teacher-forced logits [b, l, vocab] (training and eval), or with
      `return_hidden` the final hidden states and the output kernel (see `_logits`).
    - `encode(...)` then `decode_step(encoded, inputs_segment_ids, ids)` one token at a time
      with a key/value cache (the "cache" collection; see `decoding.py`).

    Parameters: ``embed``, the two position tables, ``encoder_norm``, ``decoder_norm`` (and
    ``softmax``), and the layers ``encoder_0``, ``encoder_1``, ... and ``decoder_0``, ... (each
    a Block's ``attention_norm``, ``self_attention``, ..., ``mlp``). With `scan_layers` the
    encoder and the decoder are each one scanned Block, ``encoder`` and ``decoder``, with the
    same names inside and a leading ``layers`` dimension on every parameter
    (``params["decoder"]["self_attention"]["q"]`` is [layers, d_model, heads, d_kv]); the
    decoder's cache is then ``cache["decoder"]["self_attention"]["cached_key"]`` [batch,
    layers, max_length, heads, d_kv].
    """

    config: TransformerConfig
    features = ("inputs", "targets")

    def _stacks(self) -> tuple[int, int]:
        return self.config.num_encoder_layers or self.config.num_layers, self.config.num_layers

    def analytic_parameters(self) -> int:
        """encoder layers (4 d h d_kv + 2 d d_ff) + decoder layers (8 d h d_kv + 2 d d_ff) +
        2 V d: one embedding for inputs and targets, one softmax (V d less when shared)."""
        return _layer_parameters(self.config, *self._stacks()) + _tables(self.config)

    def analytic_flops(self, batch_size: int, length: int) -> float:
        encoder, decoder = self._stacks()
        return _analytic_flops(self.config, _layer_parameters(self.config, encoder, decoder),
                               encoder + 2 * decoder, batch_size, length)

    def setup(self):
        c = self.config
        self.embed = layers.Embed(c.vocab_size, c.d_model, c.dtype)
        names = ("length", "d_model")
        self.encoder_positions = layers.param(self, "encoder_position_embedding",
                                              layers.normal(1.0), (c.max_length, c.d_model), names)
        self.decoder_positions = layers.param(self, "decoder_position_embedding",
                                              layers.normal(1.0), (c.max_length, c.d_model), names)
        encoder_layers = c.num_encoder_layers or c.num_layers
        if c.scan_layers:
            self.encoder = scanned_blocks(c, encoder_layers)
            self.decoder = scanned_blocks(c, c.num_layers, cross_attention=True)
        else:
            self.encoder = [block_class(c)(c) for _ in range(encoder_layers)]
            self.decoder = [block_class(c)(c, cross_attention=True) for _ in range(c.num_layers)]
        self.encoder_norm = layers.RMSNorm(dtype=c.dtype)
        self.decoder_norm = layers.RMSNorm(dtype=c.dtype)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.softmax = _softmax_table(self, c)
        self.decode_index = DecodeIndex()

    def _embed(self, ids, table, positions, deterministic):
        x = self.embed(ids) + jnp.take(table, positions, axis=0).astype(self.config.dtype)
        x = constrain(x, ("batch", "length", "d_model"))
        return self.dropout(x, deterministic=deterministic)

    def encode(self, inputs, inputs_segment_ids, inputs_positions, deterministic: bool = True):
        """[b, m] packed inputs -> encoder outputs [b, m, d_model]."""
        x = self._embed(inputs, self.encoder_positions, inputs_positions, deterministic)
        mask = attention.AttentionMask.of_self(inputs_segment_ids, causal=False)
        x = run_layers(self.encoder, x, mask, deterministic)
        x = self.dropout(self.encoder_norm(x), deterministic=deterministic)
        return constrain(x, ("batch", "memory_length", "d_model"))

    def _decoder_stack(self, x, mask, encoded, memory_mask, deterministic, decode_index=None,
                       return_hidden=False):
        x = run_layers(self.decoder, x, mask, deterministic, encoded, memory_mask, decode_index)
        x = self.dropout(self.decoder_norm(x), deterministic=deterministic)
        return _logits(self.config, self.embed, self.softmax, x, return_hidden)

    def __call__(self, inputs, inputs_segment_ids, inputs_positions, targets,
                 targets_segment_ids, targets_positions, deterministic: bool = True,
                 return_hidden: bool = False):
        encoded = self.encode(inputs, inputs_segment_ids, inputs_positions, deterministic)
        decoder_inputs = layers.shift_right(targets, targets_segment_ids)
        x = self._embed(decoder_inputs, self.decoder_positions, targets_positions, deterministic)
        mask = attention.AttentionMask.of_self(targets_segment_ids, causal=True)
        memory_mask = attention.AttentionMask(targets_segment_ids, inputs_segment_ids)
        return self._decoder_stack(x, mask, encoded, memory_mask, deterministic,
                                   return_hidden=return_hidden)

    def decode_step(self, encoded, inputs_segment_ids, ids):
        """Logits [n, vocab] for the token after `ids` [n, 1] (the previous token; 0 first).

        Each call writes one position into the cache and advances its ``index``. The cache is
        made by `init` (or `jax.eval_shape` of it) of this method with `ids` [n, max_length]:
        that call only creates the cache, with room for max_length positions.
        """
        i = self.decode_index()
        positions = i + jnp.arange(ids.shape[1])[None, :]
        x = self._embed(ids, self.decoder_positions, positions, deterministic=True)
        memory_mask = attention.AttentionMask(None, inputs_segment_ids)
        logits = self._decoder_stack(x, None, encoded, memory_mask, True, decode_index=i)
        return logits[:, -1]
