"""The blocks of today's Transformers, each against a formula written out here: rotary
positions (RoPE), T5's relative position buckets, gated feed-forward layers, and
grouped-query attention (on the einsum path, the flash kernels and cuDNN's two calls).
Models built of them: test_model_families.

Tolerances: float32 throughout. Outputs that go through the same matmuls in another order
(a reshape of the heads, a rotation in complex numbers) agree to a few ulps of values of
order 1; 1e-5 relative and absolute leaves two orders of magnitude of room on any x86 CPU.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import attention, feedforward, layers, positions
from mtrain.parallel.layout import Layout

from accelerators import triton_interpreted
from test_flash_attention import TOL, assert_same, packed_ids


# --- RoPE ---------------------------------------------------------------------------------


def rope_in_complex_numbers(x, pos, wavelength):
    """Each pair (x[i], x[i + d/2]) as the complex number x[i] + j x[i + d/2], times
    e^(j pos theta_i), theta_i = wavelength^(-2i/d)."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = wavelength ** (-2.0 * np.arange(half) / x.shape[-1])
    z = z * np.exp(1j * pos[:, :, None, None] * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def test_rotary_equals_a_rotation_in_complex_numbers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 3, 8))
    pos = rng.integers(0, 500, size=(2, 9))
    # The angles (up to 500 radians) are float32 products, as Hugging Face's: each is off by
    # up to half an ulp of 500 (3e-5) and the frequencies by an ulp of theirs (x 500: 3e-5
    # more), so an element of |x| <= 4 moves by up to ~2.4e-4.
    for wavelength in (10_000.0, 500.0):
        np.testing.assert_allclose(positions.rotate(jnp.asarray(x, jnp.float32),
                                                    jnp.asarray(pos), wavelength),
                                   rope_in_complex_numbers(x, pos, wavelength),
                                   atol=3e-4, rtol=0)


def test_rotary_scores_depend_only_on_the_distance():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

    def score(p, r):
        rq = positions.rotate(q, jnp.array([[p]]), 10_000.0)
        rk = positions.rotate(k, jnp.array([[r]]), 10_000.0)
        return float(jnp.sum(rq * rk))

    for p, r in ((5, 2), (40, 1), (7, 7)):
        np.testing.assert_allclose(score(p + 100, r + 100), score(p, r), rtol=1e-4, atol=1e-5)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # and the distance does matter


# --- relative position buckets ------------------------------------------------------------


def t5_bucket(relative: int, bidirectional: bool, num_buckets: int = 32,
              max_distance: int = 128) -> int:
    """T5's bucket (mesh_tensorflow.transformer.attention._relative_position_bucket),
    written out for one number in plain Python."""
    n = -relative
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            bucket += num_buckets
            n = -n
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact)
                      * (num_buckets - exact))
    return bucket + min(far, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_are_t5s(bidirectional):
    relative = np.arange(-300, 301)
    got = positions.relative_bucket(jnp.asarray(relative), bidirectional, 32, 128)
    want = [t5_bucket(int(r), bidirectional) for r in relative]
    np.testing.assert_array_equal(got, want)
    assert min(want) == 0 and max(want) == 31  # every distance in one of the 32 buckets


# --- gated feed-forward layers --------------------------------------------------------------


@pytest.mark.parametrize("activations", [("relu",), ("gelu", "linear"), ("silu", "linear"),
                                         ("gelu_exact", "relu")])
def test_gated_feed_forward_equals_its_formula(activations):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    mlp = feedforward.DenseReluDense(d_ff=16, activations=activations)
    params = nn.unbox(mlp.init(jax.random.key(0), x, True)["params"])
    f = {"relu": lambda a: np.maximum(a, 0), "linear": lambda a: a,
         "silu": lambda a: a / (1 + np.exp(-a)),
         "gelu": lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3))),
         "gelu_exact": lambda a: 0.5 * a * (1 + np.vectorize(math.erf)(a / np.sqrt(2)))}
    xn = np.asarray(x, np.float64)
    names = ["wi"] if len(activations) == 1 else [f"wi_{i}" for i in range(len(activations))]
    assert sorted(params) == sorted([*names, "wo"])
    h = np.prod([f[a](xn @ np.asarray(params[n])) for a, n in zip(activations, names)], axis=0)
    np.testing.assert_allclose(mlp.apply({"params": params}, x, True), h @ params["wo"], **TOL)


# --- grouped-query attention ----------------------------------------------------------------


def _attention_inputs(seed=3, length=12):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(2, length, 16)), jnp.float32)
    ids = jnp.asarray([[1] * 7 + [2] * (length - 7), [1] * (length - 2) + [0] * 2])
    return x, attention.AttentionMask.of_self(ids, causal=True)


def test_one_kv_head_is_full_attention_with_copied_heads():
    x, mask = _attention_inputs()
    mqa = layers.MultiHeadAttention(4, 8, num_kv_heads=1)
    mha = layers.MultiHeadAttention(4, 8)
    p = nn.unbox(mqa.init(jax.random.key(0), x, x, mask, True)["params"])
    assert p["k"].shape == (16, 1, 8)
    copied = {**p, "k": jnp.repeat(p["k"], 4, axis=1), "v": jnp.repeat(p["v"], 4, axis=1)}
    np.testing.assert_allclose(mqa.apply({"params": p}, x, x, mask, True),
                               mha.apply({"params": copied}, x, x, mask, True), **TOL)


def test_as_many_kv_heads_as_heads_is_todays_attention():
    x, mask = _attention_inputs()
    full = layers.MultiHeadAttention(4, 8, num_kv_heads=4)
    today = layers.MultiHeadAttention(4, 8)
    p = today.init(jax.random.key(0), x, x, mask, True)
    assert jax.tree.map(jnp.shape, full.init(jax.random.key(0), x, x, mask, True)) == \
        jax.tree.map(jnp.shape, p)
    np.testing.assert_array_equal(full.apply(p, x, x, mask, True), today.apply(p, x, x, mask, True))


def _grouped_qkv(g, heads=4, length=128, d=16, seed=5):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (2, length, heads, d)) / d**0.25
    k = jax.random.normal(keys[1], (2, length, g, d)) / d**0.25
    v = jax.random.normal(keys[2], (2, length, g, d))
    return q, k, v


def test_grouped_reference_is_full_attention_with_copied_heads():
    ids = packed_ids(2, 128, segments=3)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    q, k, v = _grouped_qkv(2)
    np.testing.assert_allclose(
        attention.reference(q, k, v, mask),
        attention.reference(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask), **TOL)


# (splash: 4 of 4 heads its multi-head kernel, 1 and 2 its multi-query one per group; Triton
# takes them as they are, no branch of mtrain's: 2 groups of 2; ungrouped: test_flash_attention)
@pytest.mark.parametrize("kernel, g", [  # (the fast tier: each of splash's two kernels)
    pytest.param("splash", 1, marks=pytest.mark.slow), ("splash", 2), ("splash", 4),
    pytest.param("triton", 2, marks=pytest.mark.slow)])
def test_flash_kernels_take_grouped_heads(monkeypatch, kernel, g):
    if kernel == "triton":
        triton_interpreted(monkeypatch)
    ids = packed_ids(2, 128, segments=3)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    q, k, v = _grouped_qkv(g)
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, kernel),
                lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)


@pytest.mark.parametrize("mesh_shape,rules,heads,groups", [
    ("model:4", "heads:model;kv_heads:model", 8, (4,)),  # (a split must divide them)
    ("model:4", "heads:model", 8, (1, 2, 4)),
    ("model:2", "heads:model", 6, (3,)),  # a shard's 3 query heads use parts of 2 groups
])
def test_flash_on_a_mesh_with_grouped_heads(mesh_shape, rules, heads, groups):
    """Query heads split over the devices, key/value heads split with them or whole (each
    shard then takes the key/value heads its query heads use)."""
    layout = Layout(mesh_shape, rules)
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    ids = packed_ids(2, 128, segments=3)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    real = (ids > 0)[..., None, None]
    for g in groups:
        q, k, v = _grouped_qkv(g, heads=heads)
        with layout.activate(mesh):
            flash = jax.jit(lambda q, k, v: attention.flash(q, k, v, mask, "splash"))(q, k, v)
        np.testing.assert_allclose(flash * real, attention.reference(q, k, v, mask) * real,
                                   **TOL, err_msg=f"{g} kv heads, {rules}")


@pytest.mark.parametrize("kernel", ["cudnn", "cudnn_segments"])
@pytest.mark.parametrize("g", [1, 2])
def test_cudnn_takes_grouped_heads(monkeypatch, kernel, g):
    """cuDNN's kernels take fewer key/value heads than query heads (jax checks only that keys
    and values have as many): both calls, emulated on this CPU (tests/accelerators.py), are
    given the grouped heads as they are and equal the reference."""
    from accelerators import on_a_gpu_emulated

    calls = on_a_gpu_emulated(monkeypatch)
    ids = packed_ids(2, 128, segments=3)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    q, k, v = _grouped_qkv(g)
    real = (ids > 0)[..., None, None]
    out = attention.flash(q, k, v, mask, kernel, max_segments=4)
    np.testing.assert_allclose(out * real, attention.reference(q, k, v, mask) * real, **TOL)
    assert calls and calls[0][0] == kernel if kernel == "cudnn_segments" else calls == ["cudnn"]
