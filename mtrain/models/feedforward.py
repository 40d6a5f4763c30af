"""The feed-forward layer: its activations by name, the names of its input projections, the
gated product of their activations (the same in the dense layer, every expert and the
dropless experts' grouped matmuls) and `DenseReluDense`, Mesh-TF's dense layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.models.lora import LoraConfig, project
from mtrain.models.parameters import normal, param
from mtrain.parallel.layout import constrain

# The feed-forward activations by name (T5X's and Mesh-TF's spelling); 'gelu' is the tanh
# approximation, as T5 trains with.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "linear": lambda x: x,
}


def input_names(count: int) -> tuple[str, ...]:
    """The input projections' parameter names of a feed-forward layer with `count`
    activations: ``wi`` alone, or ``wi_0``, ``wi_1``, ... (one per activation, T5X's)."""
    return ("wi",) if count == 1 else tuple(f"wi_{i}" for i in range(count))


def gated(activations: Sequence[str], inputs: Sequence[jax.Array]) -> jax.Array:
    """The product of each activation of its projection's output (`inputs`, one per
    activation, in order): the activation itself for one; GeGLU, SwiGLU for two."""
    h = None
    for name, x in zip(activations, inputs, strict=True):
        a = ACTIVATIONS[name](x)
        h = a if h is None else h * a
    return h


class DenseReluDense(nn.Module):
    """The feed-forward layer: d_model -> d_ff -> d_model, Mesh-TF's `dense_relu_dense`.

    With one activation (default ``('relu',)``) one input projection ``wi``; with several
    (``('gelu', 'linear')``: GeGLU, ``('silu', 'linear')``: SwiGLU) one projection ``wi_<i>``
    per activation (`input_names`), their activations multiplied elementwise (`gated`), as
    T5X's `MlpBlock`. Then dropout and the output projection ``wo``."""

    d_ff: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    activations: tuple[str, ...] = ("relu",)
    lora: LoraConfig | None = None  # adapters on the projections it targets (`lora`)

    @nn.compact
    def __call__(self, x, deterministic: bool):
        d_model, dt = x.shape[-1], self.dtype
        names = ("d_model", "d_ff")

        def projected(wname):  # (each weight, then its adapter: the order of their keys)
            wi = param(self, wname, normal(d_model**-0.5), (d_model, self.d_ff), names, dt)
            return project(self, wname, "bld,df->blf", x, wi, names, self.lora, deterministic)

        h = gated(self.activations,
                  [projected(w) for w in input_names(len(self.activations))])
        h = constrain(h, ("batch", "length", "d_ff"))
        wo = param(self, "wo", normal(self.d_ff**-0.5), (self.d_ff, d_model), ("d_ff", "d_model"),
                   dt)
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        y = project(self, "wo", "blf,fd->bld", h, wo, ("d_ff", "d_model"), self.lora,
                    deterministic)
        return constrain(y, ("batch", "length", "d_model"))
