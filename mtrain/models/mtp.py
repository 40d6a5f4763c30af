"""Multi-token prediction (DeepSeek-V3, section 2.2): `transformer.mtp_depth` D modules
beside a decoder-only LM's layers, module k (from 0) predicting the token k + 2 ahead of
each position, as the trunk predicts the next one.

Module k at position i combines the previous module's hidden state h_i (module 0: the
trunk's last layer's, before the final norm) with the embedding of the token read k + 1
positions later, e_i (the shared embedding table): ``projection(concat(embedding_norm(e_i),
hidden_norm(h_i)))`` (DeepSeek's ``eh_proj(cat(enorm(emb), hnorm(h)))``), then one Block
(``layer``: a layer as layer num_layers + k of the stack would be, experts included),
causal within its packed segment like the layers; its hidden state feeds module k + 1, and
through ``output_norm`` and the shared output head (the softmax table or tied embedding)
gives its logits. The training objective (`training.language_modeling`) takes the
cross-entropy of each depth's targets and adds ``mtp_loss_weight`` x their mean over the
depths; evaluation, scoring and decoding never run the modules (the trunk's logits only,
no cache for them).

`ahead` shifts a [batch, length] array k positions to the left in sequence order, also
where context parallelism lays a row out in `context.balanced_order`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import context, layers
from mtrain.models.blocks import block_class, is_moe, layer_window
from mtrain.parallel import layout as layout_lib
from mtrain.parallel.layout import constrain


def ahead(x: jax.Array, k: int) -> jax.Array:
    """``x[:, i + k]`` at each position i of a row (0 past its end): the value k positions
    later in the sequence. Where the active layout splits ``length``, the rows are in
    `context.balanced_order` (placed so by the trainer), and so is the result."""
    length = x.shape[1]
    if not context.splits_length():
        return jnp.pad(x[:, k:], ((0, 0), (0, min(k, length))) + ((0, 0),) * (x.ndim - 2))
    order = context.balanced_order(length, layout_lib.active()[0].ways("length"))
    later = order + k  # the sequence position each laid-out position wants
    where = np.argsort(order)[np.minimum(later, length - 1)]
    taken = jnp.take(x, jnp.asarray(where), axis=1)
    inside = jnp.asarray(later < length).reshape((1, length) + (1,) * (x.ndim - 2))
    return jnp.where(inside, taken, jnp.zeros_like(taken))


class MultiTokenPrediction(nn.Module):
    """Module `depth` (from 0): (hidden state [b, l, d_model] it passes on, the same through
    its ``output_norm``) from the previous hidden state and the embeddings of the tokens
    `depth` + 1 positions later (see the module doc). Parameters: ``embedding_norm``,
    ``hidden_norm``, ``projection`` [2 d_model, d_model] (``mtp_inputs``, ``d_model``),
    ``layer`` (a Block), ``output_norm``."""

    config: Any  # a TransformerConfig
    depth: int = 0

    @nn.compact
    def __call__(self, hidden, embedded, mask, deterministic: bool, positions=None, bias=None):
        c = self.config

        def norm(name):
            return layers.RMSNorm(epsilon=c.norm_epsilon, dtype=c.dtype,
                                  offset=c.norm_scale_offset, name=name)

        x = jnp.concatenate([norm("embedding_norm")(embedded), norm("hidden_norm")(hidden)],
                            axis=-1)
        x = constrain(x, ("batch", "length", "mtp_inputs"))
        kernel = layers.param(self, "projection", layers.normal((2 * c.d_model) ** -0.5),
                              (2 * c.d_model, c.d_model), ("mtp_inputs", "d_model"), c.dtype)
        x = constrain(jnp.einsum("blm,md->bld", x, kernel), ("batch", "length", "d_model"))
        layer = c.num_layers + self.depth  # (where the stack's next layer would be)
        x = block_class(c)(c, moe=is_moe(c, layer), window=layer_window(c, layer),
                           name="layer")(x, mask, deterministic, None, None, None, positions,
                                         bias)
        return x, norm("output_norm")(x)


def predict(c, hidden, embed_ahead, mask, deterministic: bool, positions=None, bias=None):
    """The `c.mtp_depth` modules ``mtp_0``, ``mtp_1``, ... (not scanned: D is small) on the
    trunk's last hidden state `hidden`; `embed_ahead(k)` embeds the tokens read k positions
    later. Returns each module's normed hidden state [b, l, d_model], for the shared head."""
    outs = []
    for k in range(c.mtp_depth):
        hidden, normed = MultiTokenPrediction(c, depth=k, name=f"mtp_{k}")(
            hidden, embed_ahead(k + 1), mask, deterministic, positions, bias)
        outs.append(normed)
    return outs
