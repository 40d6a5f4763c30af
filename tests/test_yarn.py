"""YaRN rotary positions (`positions.RopeScaling(kind='yarn')`): the inverse frequencies
and the attention factor that transformers' `_compute_yarn_parameters` gives (the numbers
of the two oracles' ORACLE.md, and the formula written again here), cos and sin scaled by
that factor in both attentions, DeepSeek's interleaved pairs; the older kinds unchanged.

Tolerances: the frequencies are float32 (as transformers computes them) against a float64
restatement: a few ulps, 1e-6 relative.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import blocks, layers
from mtrain.models import positions
from mtrain.models.attention import AttentionMask
from mtrain.models.positions import RopeScaling, Rotary
from mtrain.models.transformer import TransformerConfig

# (dim, theta, RopeScaling) of ../shared/oracles' configs
DEEPSEEK_V3 = (8, 10_000.0, RopeScaling(kind="yarn", factor=4.0, original_max_length=64,
                                         mscale=1.0, mscale_all_dim=1.0))
GPT_OSS = (16, 150_000.0, RopeScaling(kind="yarn", factor=32.0, original_max_length=64,
                                      truncate=False))


def hugging_face_yarn(dim, base, s: RopeScaling):
    """transformers' `_compute_yarn_parameters`, restated in float64: (inv_freq,
    attention_factor)."""
    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if s.attention_factor:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = get_mscale(s.factor)

    def correction_dim(rotations):
        return dim * math.log(s.original_max_length / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_factor = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor,
            attention_factor)


def test_deepseek_v3s_frequencies_and_scales():
    """ORACLE.md: of 10000^(-j/4) the first kept, the second half its own and half its
    quarter, the last two divided by 4; cos/sin times 1; the softmax scale 24^-0.5 x
    mscale(4, 1)^2 = 0.26464."""
    dim, theta, scaling = DEEPSEEK_V3
    own = 10_000.0 ** (-np.arange(4) / 4)
    expected = [own[0], 0.5 * own[1] + 0.5 * own[1] / 4, own[2] / 4, own[3] / 4]
    np.testing.assert_allclose(positions.inverse_frequencies(dim, theta, scaling), expected,
                               rtol=1e-6)
    assert scaling.amplitude == 1.0
    assert 24**-0.5 * positions.yarn_mscale(4.0, 1.0) ** 2 == pytest.approx(0.26464, abs=1e-5)


def test_gpt_osss_frequencies_and_amplitude():
    """ORACLE.md: truncate false, the range 0 .. 1.5579 unrounded: the first kept, the
    second 0.358 x its own + 0.642 x its 32nd, the other 6 divided by 32; cos and sin times
    1 + 0.1 ln 32 = 1.34657."""
    dim, theta, scaling = GPT_OSS
    own = 150_000.0 ** (-np.arange(0, 16, 2) / 16)
    ramp = 1 / (16 * math.log(64 / (2 * math.pi)) / (2 * math.log(150_000.0)))
    assert ramp == pytest.approx(0.642, abs=1e-3)
    expected = [own[0], (1 - ramp) * own[1] + ramp * own[1] / 32, *(own[2:] / 32)]
    np.testing.assert_allclose(positions.inverse_frequencies(dim, theta, scaling), expected,
                               rtol=1e-6)
    assert scaling.amplitude == pytest.approx(1.34657, abs=1e-5)


@pytest.mark.parametrize("dim,theta,scaling", [
    DEEPSEEK_V3, GPT_OSS,
    (64, 10_000.0, RopeScaling(kind="yarn", factor=40.0, original_max_length=4096,
                               mscale=1.0, mscale_all_dim=1.0)),  # DeepSeek-V3's own
    (64, 10_000.0, RopeScaling(kind="yarn", factor=40.0, original_max_length=4096,
                               mscale=0.707, mscale_all_dim=1.0, truncate=False)),
    (64, 150_000.0, RopeScaling(kind="yarn", factor=32.0, original_max_length=4096,
                                truncate=False)),  # gpt-oss's own
    (32, 1e6, RopeScaling(kind="yarn", factor=8.0, original_max_length=2048, beta_fast=16,
                          beta_slow=2, attention_factor=1.5)),
])
def test_yarn_is_transformers_formula(dim, theta, scaling):
    inverse, factor = hugging_face_yarn(dim, theta, scaling)
    ours = positions.inverse_frequencies(dim, theta, scaling)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, inverse, rtol=1e-6)
    assert scaling.amplitude == pytest.approx(factor, rel=1e-12)


def test_the_older_kinds_are_unchanged():
    """'none', 'linear' and 'llama3' as transformers computes them (float32), amplitude 1,
    and a `Rotary` of amplitude 1 rotating bit for bit as the bare frequencies did."""
    base = 1.0 / (np.float32(500_000.0) ** (np.arange(0, 64, 2, dtype=np.float32)
                                            / np.float32(64)))
    np.testing.assert_array_equal(positions.inverse_frequencies(64, 500_000.0), base)
    np.testing.assert_array_equal(positions.inverse_frequencies(
        64, 500_000.0, RopeScaling(kind="linear", factor=4.0)), base / np.float32(4))
    llama3 = RopeScaling(kind="llama3", factor=8.0, original_max_length=8192)
    wavelength = 2 * math.pi / base.astype(np.float64)
    smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelength < 8192 / 4, base,
                        np.where(wavelength > 8192, base / 8,
                                 (1 - smooth) * base / 8 + smooth * base))
    np.testing.assert_allclose(positions.inverse_frequencies(64, 500_000.0, llama3), expected,
                               rtol=1e-6)
    assert RopeScaling().amplitude == llama3.amplitude == 1.0
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 64))
    at = jnp.broadcast_to(jnp.arange(5), (2, 5))
    inverse = positions.inverse_frequencies(64, 500_000.0, llama3)
    np.testing.assert_array_equal(positions.rotate(x, at, Rotary(tuple(inverse.tolist()))),
                                  positions.rotate(x, at, inverse))
    c = TransformerConfig(position_encoding="rotary", d_kv=64, rope_scaling=llama3,
                          rotary_max_wavelength=500_000.0)
    assert blocks.rotary_frequencies(c) == Rotary(tuple(float(f) for f in inverse), 1.0, False)


def _hugging_face_rotate(x, at, inverse, amplitude, interleaved):
    """transformers' apply_rotary_pos_emb (and _interleave: de-interleaved first) on x [b,
    l, h, d] in float64."""
    freqs = at[..., None] * inverse  # [b, l, d/2]
    emb = np.concatenate([freqs, freqs], -1)[:, :, None]
    cos, sin = np.cos(emb) * amplitude, np.sin(emb) * amplitude
    if interleaved:
        b, l, h, d = x.shape
        x = x.reshape(b, l, h, d // 2, 2).swapaxes(-1, -2).reshape(b, l, h, d)
    half = x.shape[-1] // 2
    rotated_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


def test_amplitude_and_interleaved_pairs_are_transformers():
    """cos and sin times the amplitude; interleaved pairs turned in place give the q.k of
    transformers' de-interleaved rotation (and its output, interleaved back)."""
    dim, theta, scaling = GPT_OSS
    inverse = positions.inverse_frequencies(dim, theta, scaling)
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 2, 7, 3, dim)).astype(np.float32)
    at = np.broadcast_to(np.arange(7) * 5, (2, 7))
    for interleaved in (False, True):
        rotary = Rotary(tuple(inverse.tolist()), scaling.amplitude, interleaved)
        ours = [np.asarray(positions.rotate(jnp.asarray(x), jnp.asarray(at), rotary))
                for x in (q, k)]
        theirs = [_hugging_face_rotate(x.astype(np.float64), at, inverse.astype(np.float64),
                                       scaling.amplitude, interleaved) for x in (q, k)]
        np.testing.assert_allclose(np.einsum("blhd,bmhd->bhlm", *ours),
                                   np.einsum("blhd,bmhd->bhlm", *theirs), rtol=1e-5, atol=1e-5)
        if interleaved:  # (the same numbers, in transformers' de-interleaved order)
            theirs = [t.reshape(*t.shape[:-1], 2, dim // 2).swapaxes(-1, -2).reshape(t.shape)
                      for t in theirs]
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-5)


def test_multi_head_attention_takes_the_amplitude():
    """gpt-oss: YaRN with standard attention. The Block's rotary (`blocks.rotary_frequencies`)
    carries the amplitude, and q and k rotated by it are q.k times its square."""
    c = TransformerConfig(position_encoding="rotary", d_kv=16, num_heads=2, d_model=32,
                          rotary_max_wavelength=150_000.0, rope_scaling=GPT_OSS[2])
    rotary = blocks.rotary_frequencies(c)
    assert rotary.amplitude == pytest.approx(1.34657, abs=1e-5) and not rotary.interleaved
    x = jax.random.normal(jax.random.key(1), (2, 6, 32))
    ids = jnp.ones((2, 6), jnp.int32)
    at = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = AttentionMask.of_self(ids, causal=True)
    unit = Rotary(rotary.frequencies)

    def attend(rotary, scale):
        mha = layers.MultiHeadAttention(num_heads=2, d_kv=16, rotary_frequencies=rotary,
                                        options=layers.AttentionOptions(scale=scale))
        params = mha.init(jax.random.key(2), x, x, mask, True, positions=at)
        return mha.apply(params, x, x, mask, True, positions=at)

    np.testing.assert_allclose(attend(rotary, 0.25), attend(unit, 0.25 * rotary.amplitude**2),
                               rtol=1e-5, atol=1e-6)


def test_yarn_settings_are_checked():
    with pytest.raises(ValueError, match="yarn needs 0 < beta_slow < beta_fast"):
        RopeScaling(kind="yarn", factor=4.0, beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ValueError, match="rope_scaling.kind must be one of none, linear, "
                                         "llama3, yarn"):
        RopeScaling(kind="dynamic")
    assert RopeScaling(kind="yarn", factor=1.0).amplitude == 1.0  # (no scaling: mscale 1)
