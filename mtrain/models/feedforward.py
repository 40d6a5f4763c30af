"""The feed-forward layer: its activations by name, the names of its input projections, the
gated product of their activations (the same in the dense layer, every expert and the
dropless experts' grouped matmuls) and `DenseReluDense`, Mesh-TF's dense layer."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.models.lora import LoraConfig, project
from mtrain.models.quantization import Quantization
from mtrain.models.parameters import normal, param
from mtrain.parallel.layout import constrain


@dataclasses.dataclass(frozen=True)
class Clamp:
    """gpt-oss's clamped SwiGLU (``transformer.activation_limit``, ``transformer.swish_alpha``),
    what its two activations take: ``clamped_swish(g) = min(g, limit) sigmoid(alpha min(g,
    limit))`` and ``clamped_linear_plus_one(u) = clip(u, -limit, limit) + 1``, whose product
    is a gpt-oss expert's hidden layer. `limit` 0: no clamp."""

    limit: float = 0.0
    alpha: float = 1.702


def _clamped_swish(x, clamp: Clamp = Clamp()):
    x = jnp.minimum(x, clamp.limit) if clamp.limit else x
    return x * jax.nn.sigmoid(clamp.alpha * x)


def _clamped_linear_plus_one(x, clamp: Clamp = Clamp()):
    return (jnp.clip(x, -clamp.limit, clamp.limit) if clamp.limit else x) + 1


# The clamped activations (gpt-oss's), which take a `Clamp` (`activation`).
CLAMPED = {"clamped_swish": _clamped_swish, "clamped_linear_plus_one": _clamped_linear_plus_one}
# The feed-forward activations by name (T5X's and Mesh-TF's spelling); 'gelu' is the tanh
# approximation, as T5 trains with.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "linear": lambda x: x,
    **CLAMPED,
}


def activation(name: str, clamp: Clamp | None = None):
    """The activation `name` (`ACTIVATIONS`), a clamped one with `clamp`'s settings."""
    if name in CLAMPED:
        return functools.partial(CLAMPED[name], clamp=clamp or Clamp())
    return ACTIVATIONS[name]


def clamp_of(c) -> Clamp:
    """The clamp of a `TransformerConfig` `c` (``activation_limit``, ``swish_alpha``)."""
    return Clamp(limit=c.activation_limit, alpha=c.swish_alpha)


def input_names(count: int) -> tuple[str, ...]:
    """The input projections' parameter names of a feed-forward layer with `count`
    activations: ``wi`` alone, or ``wi_0``, ``wi_1``, ... (one per activation, T5X's)."""
    return ("wi",) if count == 1 else tuple(f"wi_{i}" for i in range(count))


def gated(activations: Sequence[str], inputs: Sequence[jax.Array],
          clamp: Clamp | None = None) -> jax.Array:
    """The product of each activation of its projection's output (`inputs`, one per
    activation, in order): the activation itself for one; GeGLU, SwiGLU (gpt-oss's clamped
    one with `clamp`) for two."""
    h = None
    for name, x in zip(activations, inputs, strict=True):
        a = activation(name, clamp)(x)
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
    clamp: Clamp | None = None  # the clamped activations' settings (None: `Clamp()`)
    quantization: Quantization | None = None  # low-precision projections (`quantization`)

    @nn.compact
    def __call__(self, x, deterministic: bool):
        d_model, dt = x.shape[-1], self.dtype
        names = ("d_model", "d_ff")

        def projected(wname):  # (each weight, then its adapter: the order of their keys)
            wi = param(self, wname, normal(d_model**-0.5), (d_model, self.d_ff), names, dt)
            return project(self, wname, "bld,df->blf", x, wi, names, self.lora, deterministic,
                           self.quantization)

        h = gated(self.activations,
                  [projected(w) for w in input_names(len(self.activations))], self.clamp)
        h = constrain(h, ("batch", "length", "d_ff"))
        wo = param(self, "wo", normal(self.d_ff**-0.5), (self.d_ff, d_model), ("d_ff", "d_model"),
                   dt)
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        y = project(self, "wo", "blf,fd->bld", h, wo, ("d_ff", "d_model"), self.lora,
                    deterministic, self.quantization)
        return constrain(y, ("batch", "length", "d_model"))
