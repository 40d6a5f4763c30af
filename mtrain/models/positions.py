"""Position information inside attention: rotary positions (RoPE) and T5's bucketed
relative position bias. (The learned position tables of the 2018 Transformer are added to
the embeddings: `transformer.py`.)

Packed rows need nothing special: each packed example's positions restart at 0, so RoPE
rotates by the example's own positions, and within one example the distance between two
row indices equals the distance between their positions, while attention across examples
is masked anyway: the relative bias is a function of row indices alone.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtrain.parallel.layout import constrain, use_parameter


ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for contexts longer than a model was pre-trained
    on (gin: ``rope_scaling.kind = 'llama3'``), as Hugging Face's ``rope_type``:

    - ``'none'``: the frequencies max_wavelength^(-2i/d) as they are.
    - ``'linear'``: every frequency divided by `factor` (position interpolation).
    - ``'llama3'``: Llama 3.1's: frequencies whose wavelength exceeds
      `original_max_length` / `low_freq_factor` divided by `factor`, those shorter than
      `original_max_length` / `high_freq_factor` kept, and the ones between interpolated
      smoothly between the two.
    - ``'yarn'``: YaRN's (Peng et al. 2023; DeepSeek-V3, gpt-oss): the frequencies that turn
      more than `beta_fast` times over `original_max_length` positions kept, those turning
      fewer than `beta_slow` times divided by `factor`, a linear ramp between (its ends
      floored and ceiled with `truncate`, as transformers); cos and sin are multiplied by
      `amplitude` (`attention_factor`, or where 0 as transformers computes it:
      mscale(factor, `mscale`) / mscale(factor, `mscale_all_dim`) where both are given, else
      0.1 ln(factor) + 1). DeepSeek's softmax scale (its mscale_all_dim squared) is
      ``transformer.attention_scale``, not computed here.
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_length: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float = 0.0

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling.kind must be one of {', '.join(ROPE_SCALINGS)}, "
                             f"got {self.kind!r}")
        if self.kind != "none" and self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor, "
                             f"got {self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError("rope_scaling: yarn needs 0 < beta_slow < beta_fast, got "
                             f"{self.beta_slow} and {self.beta_fast}")
        if self.kind == "yarn" and (self.attention_factor < 0 or self.original_max_length < 1):
            raise ValueError("rope_scaling: yarn needs attention_factor >= 0 (0: computed) and "
                             f"original_max_length >= 1, got {self.attention_factor} and "
                             f"{self.original_max_length}")

    @property
    def amplitude(self) -> float:
        """What cos and sin are multiplied by (transformers' attention_factor: YaRN's, 1 for
        the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale)
                         / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1), as
    transformers' get_mscale: DeepSeek's softmax scale is d^-0.5 x yarn_mscale(factor,
    mscale_all_dim)^2."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Rotary:
    """A layer's RoPE, as `rotate` takes it: its inverse `frequencies`
    (`inverse_frequencies`), the `amplitude` cos and sin are multiplied by (YaRN's
    attention factor; 1 otherwise) and whether the rotated pairs are `interleaved`:
    (x0, x1), (x2, x3), ... (DeepSeek's layout, transformers' rope_interleave) in place of
    the half split (x_i, x_{i + d/2}) of Llama."""

    frequencies: tuple[float, ...]
    amplitude: float = 1.0
    interleaved: bool = False


def inverse_frequencies(d_kv: int, max_wavelength: float,
                        scaling: RopeScaling | None = None) -> np.ndarray:
    """The d_kv / 2 rotation frequencies (radians per position) of RoPE, float32, computed
    as Hugging Face computes them (`_compute_default_rope_parameters` and the scaled forms)."""
    half = d_kv // 2
    inverse = 1.0 / (np.float32(max_wavelength) ** (
        np.arange(0, d_kv, 2, dtype=np.float32) / np.float32(d_kv)))
    inverse = inverse.astype(np.float32)
    if scaling is None or scaling.kind == "none":
        return inverse
    factor = np.float32(scaling.factor)
    if scaling.kind == "linear":
        return (inverse / factor).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn(d_kv, max_wavelength, scaling)
    old = np.float32(scaling.original_max_length)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    wavelength = np.float32(2 * math.pi) / inverse
    scaled = np.where(wavelength > old / low, inverse / factor, inverse)
    smooth = (old / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < old / high) & ~(wavelength > old / low)
    assert len(inverse) == half
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(d_kv: int, max_wavelength: float, s: RopeScaling) -> np.ndarray:
    """YaRN's frequencies (`RopeScaling`), float32, as transformers'
    `_compute_yarn_parameters` computes them."""
    base, factor = float(max_wavelength), np.float32(s.factor)

    def dimension(rotations):  # the dimension that turns `rotations` times over the context
        return d_kv * math.log(s.original_max_length / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_kv - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    powers = np.float32(base) ** (np.arange(0, d_kv, 2, dtype=np.float32) / np.float32(d_kv))
    extrapolation, interpolation = 1.0 / powers, 1.0 / (factor * powers)
    ramp = np.clip((np.arange(d_kv // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    kept = np.float32(1) - ramp
    return (interpolation * (1 - kept) + extrapolation * kept).astype(np.float32)


def rotate(x: jax.Array, positions: jax.Array,
           inverse: Rotary | np.ndarray | tuple | float) -> jax.Array:
    """RoPE (Su et al. 2021) on `x` [batch, length, heads, d_kv] at `positions` [batch,
    length]: each pair (x[i], x[i + d/2]) turned by the angle position x inverse[i]
    (`inverse_frequencies`; a number is the max wavelength of unscaled frequencies), the
    half-split layout of Hugging Face's Llama (and of MaxText's and Levanter's defaults).
    A `Rotary` says the frequencies, the amplitude cos and sin are multiplied by, and
    whether the pairs are interleaved ((x[2i], x[2i + 1]) turned in place: the q.k products
    of transformers' apply_rotary_pos_emb_interleave, which de-interleaves them first).
    Computed in float32, returned in x's dtype."""
    amplitude, interleaved = 1.0, False
    if isinstance(inverse, Rotary):
        amplitude, interleaved = inverse.amplitude, inverse.interleaved
        inverse = np.asarray(inverse.frequencies, np.float32)
    elif isinstance(inverse, tuple):
        inverse = np.asarray(inverse, np.float32)
    elif not isinstance(inverse, np.ndarray):
        inverse = inverse_frequencies(x.shape[-1], inverse)
    angle = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inverse)
    sin, cos = jnp.sin(angle), jnp.cos(angle)  # [b, l, 1, half]
    if amplitude != 1.0:
        sin, cos = sin * amplitude, cos * amplitude
    if interleaved:
        pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        first, second = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)
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


@flax.struct.dataclass
class RelativeTable:
    """A stack's relative position bias as its table [heads, buckets] and bucketing, for
    attention that makes the bias of each block of query and key positions itself
    (`models.context`, with ``length`` split: no [length, length] bias exists whole)."""

    table: jax.Array
    bidirectional: bool = flax.struct.field(pytree_node=False, default=True)
    num_buckets: int = flax.struct.field(pytree_node=False, default=32)
    max_distance: int = flax.struct.field(pytree_node=False, default=128)

    def between(self, query_index: jax.Array, memory_index: jax.Array) -> jax.Array:
        """The bias [..., heads, lq, lm] (float32) between positions [..., lq] and
        [..., lm] (row indices, or positions within packed examples: the same distances)."""
        return jnp.moveaxis(jnp.take(self.table, self.buckets(query_index, memory_index),
                                     axis=1), 0, -3)

    def buckets(self, query_index: jax.Array, memory_index: jax.Array) -> jax.Array:
        return relative_bucket(memory_index[..., None, :] - query_index[..., :, None],
                               self.bidirectional, self.num_buckets, self.max_distance)


class RelativeBias(nn.Module):
    """T5's relative position bias: a learned scalar per head and bucket, ``relative_bias``
    [heads, relative_buckets], added to the attention logits of every layer of one stack.
    `__call__(query_index, memory_index)` ([length] and [memory_length] row indices, or
    positions) gives the bias [1, heads, length, memory_length] in float32; with both None,
    the `RelativeTable` to make it from block by block."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    @nn.compact
    def __call__(self, query_index: jax.Array | None,
                 memory_index: jax.Array | None) -> jax.Array | RelativeTable:
        names = ("heads", "relative_buckets")
        table = self.param("relative_bias", nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), names), (self.num_heads, self.num_buckets),
            jnp.float32)
        table = RelativeTable(use_parameter(table, names, "parameter relative_bias"),
                              self.bidirectional, self.num_buckets, self.max_distance)
        if query_index is None:
            return table
        bias = table.between(query_index, memory_index)  # [heads, length, memory_length]
        return constrain(bias[None], (None, "heads", "length", "memory_length"))
