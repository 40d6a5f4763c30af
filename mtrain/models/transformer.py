"""The Transformers: decoder-only LM (Mesh-TF's `Unitransformer`) and encoder-decoder
(`Bitransformer`).

token embedding + learned positions -> num_layers x [pre-RMSNorm self-attention,
(decoder: pre-RMSNorm encoder-decoder attention,) pre-RMSNorm DenseReluDense], each with
dropout on its residual branch -> final RMSNorm -> dropout -> softmax (unshared by default;
`shared_embedding_and_softmax=True` reuses the embedding table). Attention respects packed
segments; decoder self-attention is causal.

The blocks of later models are settings of the same two (`TransformerConfig`): gated
feed-forward layers (`mlp_activations`), rotary positions or T5's relative position bias in
place of the position tables (`position_encoding`, `positions.py`), grouped-query or
multi-query attention (`num_kv_heads`), and mixture-of-experts feed-forward layers every
`moe_every` layers (`moe.py`); a decoder-only LM also DeepSeek-V3's multi-token
prediction modules (`mtp_depth`, `mtp.py`), which only its training pass runs.

A model's `features` say which packed features its `__call__` takes: for each, the tokens,
segment ids and positions, in that order.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.errors import ConfigError
from mtrain.parallel.layout import constrain
from mtrain.models import attention, context, counts, layers, mtp, pipeline
from mtrain.models import positions as positions_lib
from mtrain.models.blocks import (block_class, is_moe, layer_stack, layer_window, run_layers,
                                  scanned_blocks)
from mtrain.models.transformer_config import TransformerConfig


def _norm(c: TransformerConfig, name: str | None = None):
    return layers.RMSNorm(epsilon=c.norm_epsilon, dtype=c.dtype, offset=c.norm_scale_offset,
                          name=name)


def _embed(c: TransformerConfig, embed: layers.Embed, ids):
    """The tokens' embeddings, times `embedding_multiplier` (Gemma's sqrt(d_model), in the
    activations' dtype as Hugging Face multiplies it)."""
    x = embed(ids)
    if c.embedding_multiplier != 1.0:
        x = x * jnp.asarray(c.embedding_multiplier, x.dtype)
    return x


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
            kernel = embed.embedding.astype(c.dtype).T
            if c.shared_softmax_scaled:
                kernel = kernel * c.d_model**-0.5
        else:
            kernel = softmax
        return x, constrain(kernel, ("d_model", "vocab"))
    if softmax is None:
        return embed.attend(x, c.shared_softmax_scaled)
    logits = jnp.einsum("bld,dv->blv", x, softmax)
    return constrain(logits, ("batch", "length", "vocab"))


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
    (with `return_hidden`: the final hidden states and the output kernel, see `_logits`).
    `decode_step(ids)` continues a sequence one token at a time with a key/value cache (the
    "cache" collection, as `EncoderDecoder.decode_step`).

    With `mtp_outputs` (and `config.mtp_depth` > 0) `__call__` returns ``(that, what each
    multi-token prediction module gives the same way)``: the logits (or hidden states and
    kernel) of module k predicting the targets k + 1 positions later (`mtp.py`). Only the
    training objective asks (`training.language_modeling`): any other pass leaves the
    modules out (their parameters are made at `init`)."""

    config: TransformerConfig
    mtp_outputs: bool = False
    features = ("targets",)  # the packed features __call__ takes, in order

    def analytic_parameters(self) -> int:
        """layers (attention 4 d h d_kv + feed-forward 2 d d_ff, with all heads and one
        activation; see `counts.layer_parameters`) + 2 V d (V d with a shared softmax),
        and the multi-token prediction modules' (`counts.mtp_parameters`)."""
        c = self.config
        return counts.layer_parameters(c, c.num_layers, 0) + counts.tables(c) \
            + counts.mtp_parameters(c)

    def analytic_flops(self, batch_size: int, length: int) -> float:
        """With experts, of the active parameters (a token's top_k experts and the router);
        each multi-token prediction module a layer more, and a pass through the head."""
        c = self.config
        stacks = counts.layer_parameters(c, c.num_layers, 0, active=True) \
            + counts.mtp_parameters(c, active=True, heads=True)
        return counts.analytic_flops(c, stacks, c.num_layers + c.mtp_depth, batch_size, length,
                                     c.num_layers + c.mtp_depth)

    def active_parameters(self) -> int:
        """The parameters one token computes with: all but the experts it is not sent to."""
        c = self.config
        return counts.layer_parameters(c, c.num_layers, 0, active=True) + counts.tables(c) \
            + counts.mtp_parameters(c, active=True)

    @nn.compact
    def __call__(self, targets, segment_ids, positions, deterministic: bool = True,
                 return_hidden: bool = False, decode: bool = False, inputs=None,
                 prefill=None):
        """`inputs` (optional, [b, l]): the token read before each target, where the data
        says (a chat's first token is read, not predicted: `data.formats`); by default the
        targets shifted right within their segments, `start_id` first. `decode`: `targets`
        are the tokens to feed from each row's cache index on (`decode_step`); with
        `prefill` [b], into an empty cache, of which each row keeps its first `prefill`."""
        c = self.config
        decode_index = mask = None
        steps = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
        if decode and prefill is not None:  # one pass over the prompts (`prefill`)
            layers.DecodeIndex(rows=True, name="decode_index")(targets.shape[0], prefill)
            inputs, positions, decode_index = targets, steps, layers.Prefill(prefill)
            mask = attention.AttentionMask.of_self(jnp.ones_like(targets), causal=True)
        elif decode:  # `targets` are the tokens to feed, the index says where (decode_step)
            decode_index = layers.DecodeIndex(rows=True, name="decode_index")(targets.shape[0])
            inputs = targets
            positions = decode_index[:, None] + steps
        else:
            if inputs is None:
                inputs = layers.shift_right(targets, segment_ids, c.start_id)
            mask = attention.AttentionMask.of_self(segment_ids, causal=True, balanced=True)
        embed = layers.Embed(c.vocab_size, c.d_model, c.dtype, name="token_embedding")
        x = _embed(c, embed, inputs)
        if c.position_encoding == "learned":
            pos_table = layers.param(
                self, "position_embedding", layers.normal(1.0), (c.max_length, c.d_model),
                ("length", "d_model"),
            )
            x = x + jnp.take(pos_table, positions, axis=0).astype(c.dtype)
        x = constrain(x, ("batch", "length", "d_model"))
        x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)
        bias = None
        if c.position_encoding == "relative_bias":
            bias = _relative_bias(c, _relative_bias_table(c, False, "relative_bias"),
                                  inputs.shape[1], None if prefill is not None else decode_index)
        trunk = layer_stack(c, x, mask, deterministic, decode_index, positions, bias, self)
        x = _norm(c, "final_norm")(trunk)
        x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)
        softmax = _softmax_table(self, c)
        out = _logits(c, embed, softmax, x, return_hidden)
        if not c.mtp_depth or decode or not (self.mtp_outputs or self.is_initializing()):
            return out
        later = mtp.predict(c, trunk, lambda k: _embed(c, embed, mtp.ahead(inputs, k)), mask,
                            deterministic, positions, bias)
        later = tuple(_logits(c, embed, softmax, nn.Dropout(c.dropout_rate)(
            y, deterministic=deterministic), return_hidden) for y in later)
        return (out, later) if self.mtp_outputs else out

    def decode_step(self, ids):
        """Logits [n, vocab] for the token after `ids` [n, 1] (the previous token;
        `config.start_id` first), as `EncoderDecoder.decode_step`: the cache is made by
        `init` of this method with `ids` [n, max_length]."""
        return self(ids, None, None, deterministic=True, decode=True)[:, -1]

    def prefill(self, ids, counts):
        """Fills an empty cache (made as `decode_step`'s) in one pass: `ids` [n, length] the
        tokens each row reads first (`config.start_id`, then its prompt), of which row r
        keeps its first `counts` [n] (its cache index after); what `decode_step` feeds next
        is row r's id ``counts[r]``. Returns the hidden states (the caller wants the cache)."""
        return self(ids, None, None, deterministic=True, decode=True, prefill=counts,
                    return_hidden=True)


def _relative_bias(c: TransformerConfig, module: positions_lib.RelativeBias, length: int,
                   decode_index=None):
    """A stack's relative position bias [1, heads, length, memory_length] from `module`, for
    `length` queries: over themselves, or while decoding (from `decode_index` on) over every
    position up to max_length (the attention cuts it to its cache). With ``length`` split,
    its `RelativeTable`: attention makes each block's (`models.context`)."""
    queries = jnp.arange(length)
    if decode_index is None and context.splits_length():  # (each block makes its own)
        return module(None, None)
    if decode_index is None:
        return module(queries, queries)
    if jnp.ndim(decode_index):  # each row at its own position: [b, heads, length, max_length]
        table = module(None, None)
        bias = jax.vmap(lambda i: table.between(i + queries, jnp.arange(c.max_length)))(
            decode_index)
        return constrain(bias, ("batch", "heads", "length", "memory_length"))
    return module(decode_index + queries, jnp.arange(c.max_length))


def _relative_bias_table(c: TransformerConfig, bidirectional: bool, name: str | None = None):
    return positions_lib.RelativeBias(c.num_heads, c.relative_num_buckets,
                                      c.relative_max_distance, bidirectional, name=name)


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

    def __post_init__(self):
        if self.config.mtp_depth:
            raise ConfigError(f"transformer.mtp_depth={self.config.mtp_depth}: multi-token "
                              "prediction is a decoder-only LM's (DecoderLM), not EncoderDecoder's")
        super().__post_init__()

    def _stacks(self) -> tuple[int, int]:
        return self.config.num_encoder_layers or self.config.num_layers, self.config.num_layers

    def analytic_parameters(self) -> int:
        """encoder layers (4 d h d_kv + 2 d d_ff) + decoder layers (8 d h d_kv + 2 d d_ff) +
        2 V d: one embedding for inputs and targets, one softmax (V d less when shared)."""
        return counts.layer_parameters(self.config, *self._stacks()) + counts.tables(self.config)

    def analytic_flops(self, batch_size: int, length: int) -> float:
        """With experts, of the active parameters (a token's top_k experts and the router)."""
        encoder, decoder = self._stacks()
        stacks = counts.layer_parameters(self.config, encoder, decoder, active=True)
        return counts.analytic_flops(self.config, stacks, encoder + 2 * decoder, batch_size,
                                     length, encoder + decoder)

    def active_parameters(self) -> int:
        """The parameters one token computes with: all but the experts it is not sent to."""
        return counts.layer_parameters(self.config, *self._stacks(), active=True) \
            + counts.tables(self.config)

    def setup(self):
        c = self.config
        self.embed = layers.Embed(c.vocab_size, c.d_model, c.dtype)
        self.encoder_positions = self.decoder_positions = None
        if c.position_encoding == "learned":
            names = ("length", "d_model")
            self.encoder_positions = layers.param(
                self, "encoder_position_embedding", layers.normal(1.0),
                (c.max_length, c.d_model), names)
            self.decoder_positions = layers.param(
                self, "decoder_position_embedding", layers.normal(1.0),
                (c.max_length, c.d_model), names)
        encoder_layers = c.num_encoder_layers or c.num_layers
        if c.scan_layers:
            self.encoder = scanned_blocks(c, encoder_layers)
            self.decoder = scanned_blocks(c, c.num_layers, cross_attention=True)
        else:
            self.encoder = [block_class(c)(c, moe=is_moe(c, i), window=layer_window(c, i))
                            for i in range(encoder_layers)]
            self.decoder = [block_class(c)(c, cross_attention=True, moe=is_moe(c, i),
                                           window=layer_window(c, i))
                            for i in range(c.num_layers)]
        self.encoder_norm = _norm(c)
        self.decoder_norm = _norm(c)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.softmax = _softmax_table(self, c)
        self.decode_index = layers.DecodeIndex()
        if c.position_encoding == "relative_bias":
            self.encoder_relative_bias = _relative_bias_table(c, bidirectional=True)
            self.decoder_relative_bias = _relative_bias_table(c, bidirectional=False)

    def _embed(self, ids, table, positions, deterministic):
        x = _embed(self.config, self.embed, ids)
        if table is not None:
            x = x + jnp.take(table, positions, axis=0).astype(self.config.dtype)
        x = constrain(x, ("batch", "length", "d_model"))
        return self.dropout(x, deterministic=deterministic)

    def _bias(self, stack: str, length: int, decode_index=None):
        if self.config.position_encoding != "relative_bias":
            return None
        module = self.encoder_relative_bias if stack == "encoder" else self.decoder_relative_bias
        return _relative_bias(self.config, module, length, decode_index)

    def encode(self, inputs, inputs_segment_ids, inputs_positions, deterministic: bool = True):
        """[b, m] packed inputs -> encoder outputs [b, m, d_model]."""
        if pipeline.stages() > 1:
            raise pipeline.encoder_decoder_refused()
        x = self._embed(inputs, self.encoder_positions, inputs_positions, deterministic)
        mask = attention.AttentionMask.of_self(inputs_segment_ids, causal=False)
        x = run_layers(self.encoder, x, mask, deterministic, None, None, None, inputs_positions,
                       self._bias("encoder", inputs.shape[1]))
        x = self.dropout(self.encoder_norm(x), deterministic=deterministic)
        return constrain(x, ("batch", "memory_length", "d_model"))

    def _decoder_stack(self, x, mask, encoded, memory_mask, deterministic, positions,
                       decode_index=None, return_hidden=False):
        x = run_layers(self.decoder, x, mask, deterministic, encoded, memory_mask, decode_index,
                       positions, self._bias("decoder", x.shape[1], decode_index))
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
                                   targets_positions, return_hidden=return_hidden)

    def decode_step(self, encoded, inputs_segment_ids, ids):
        """Logits [n, vocab] for the token after `ids` [n, 1] (the previous token; 0 first).

        Each call writes one position into the cache and advances its ``index``. The cache is
        made by `init` (or `jax.eval_shape` of it) of this method with `ids` [n, max_length]:
        that call only creates the cache, with room for max_length positions.
        """
        i = self.decode_index()
        positions = i + jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = self._embed(ids, self.decoder_positions, positions, deterministic=True)
        memory_mask = attention.AttentionMask(None, inputs_segment_ids)
        logits = self._decoder_stack(x, None, encoded, memory_mask, True, positions,
                                     decode_index=i)
        return logits[:, -1]
