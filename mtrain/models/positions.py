"""Position information inside attention: rotary positions (RoPE) and T5's bucketed
relative position bias. (The learned position tables of the 2018 Transformer are added to
the embeddings: `transformer.py`.)

Packed rows need nothing special: each packed example's positions restart at 0, so RoPE
rotates by the example's own positions, and within one example the distance between two
row indices equals the distance between their positions, while attention across examples
is masked anyway: the relative bias is a function of row indices alone.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.parallel.layout import constrain, use_parameter


def rotate(x: jax.Array, positions: jax.Array, max_wavelength: float) -> jax.Array:
    """RoPE (Su et al. 2021) on `x` [batch, length, heads, d_kv] at `positions` [batch,
    length]: each pair (x[i], x[i + d/2]) turned by the angle position / max_wavelength^(2i/d),
    the half-split layout of Hugging Face's Llama (and of MaxText's and Levanter's defaults).
    Computed in float32, returned in x's dtype."""
    half = x.shape[-1] // 2
    inverse = max_wavelength ** -(jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, :, None, None] * inverse  # [b, l, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def relative_bucket(relative: jax.Array, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> jax.Array:
    """T5's bucket of each `relative` = memory position - query position: half the buckets
    (all of them when causal, where a later key is bucket 0) hold the exact distances 0 .. n/2
    - 1 (n the buckets of that direction); the other half distances up to `max_distance` on a
    log scale; farther ones share the last bucket. Bidirectional: keys after the query take the
    upper half of the buckets."""
    bucket = jnp.zeros_like(relative)
    distance = -relative  # how far back the key is
    if bidirectional:
        num_buckets //= 2
        bucket += (distance < 0).astype(relative.dtype) * num_buckets
        distance = jnp.abs(distance)
    else:
        distance = jnp.maximum(distance, 0)
    exact = num_buckets // 2
    scaled = jnp.log(distance.astype(jnp.float32) / exact + jnp.finfo(jnp.float32).eps)
    far = exact + (scaled / math.log(max_distance / exact) * (num_buckets - exact)).astype(
        relative.dtype)
    far = jnp.minimum(far, num_buckets - 1)
    return bucket + jnp.where(distance < exact, distance, far)


class RelativeBias(nn.Module):
    """T5's relative position bias: a learned scalar per head and bucket, ``relative_bias``
    [heads, relative_buckets], added to the attention logits of every layer of one stack.
    `__call__(query_index, memory_index)` ([length] and [memory_length] row indices, or
    positions) gives the bias [1, heads, length, memory_length] in float32."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    @nn.compact
    def __call__(self, query_index: jax.Array, memory_index: jax.Array) -> jax.Array:
        names = ("heads", "relative_buckets")
        table = self.param("relative_bias", nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), names), (self.num_heads, self.num_buckets),
            jnp.float32)
        table = use_parameter(table, names, "parameter relative_bias")
        buckets = relative_bucket(memory_index[None, :] - query_index[:, None],
                                  self.bidirectional, self.num_buckets, self.max_distance)
        bias = jnp.take(table, buckets, axis=1)  # [heads, length, memory_length]
        return constrain(bias[None], (None, "heads", "length", "memory_length"))
