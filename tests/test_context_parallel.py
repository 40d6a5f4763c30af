"""Context parallelism (`models.context`): self-attention with ``length`` split 2, 4 and 8
ways, its keys and values all-gathered or passed around the ring, gives the unsplit einsum
reference's outputs and gradients, causal or not, windowed, grouped heads, packed rows whose
examples straddle the split points, in the load-balanced order; and that order gives every
device the same causal work. (Models trained with ``length`` split:
test_context_parallel_runs.)

Tolerance 2e-5 absolute on O(1) float32 outputs and gradients: the online softmax adds the
blocks' shares in another order than one softmax (float32 rounding of sums of <= 64 terms).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import context
from mtrain.models.attention import AttentionMask, reference
from mtrain.parallel.layout import Layout

B, L, H, G, D = 2, 32, 4, 2, 8


def packed_ids(seed=0, length=L):
    """Two rows of packed examples (lengths drawn at random, padding at the end)."""
    rng = np.random.default_rng(seed)
    rows, longest = [], max(12, length // 6)
    for _ in range(B):
        ids, segment = [], 1
        while len(ids) < length - 3:
            ids += [segment] * int(rng.integers(3, longest))
            segment += 1
        rows.append((ids[:length - 3] + [0, 0, 0]))
    return np.asarray(rows, np.int32)


def inputs(seed=0, length=L):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, length, H, D))
    k = jax.random.normal(keys[1], (B, length, G, D))
    v = jax.random.normal(keys[2], (B, length, G, D))
    cotangent = jax.random.normal(keys[3], (B, length, H, D))
    return q, k, v, cotangent


def expected(q, k, v, cotangent, ids, causal, window):
    mask = AttentionMask.of_self(jnp.asarray(ids), causal).windowed(window)
    fn = lambda q, k, v: (reference(q, k, v, mask, scale=0.5) * cotangent).sum()  # noqa: E731
    return reference(q, k, v, mask, scale=0.5), jax.grad(fn, argnums=(0, 1, 2))(q, k, v)


def split(ways, mode, q, k, v, cotangent, ids, causal, window, balanced=True, kernel=None):
    """`context.attend` over a mesh splitting ``length`` `ways` ways, in the balanced order
    (undone on the outputs and gradients), by `kernel` (None: einsum)."""
    layout = Layout(f"model:{ways}", "length:model")
    mesh = layout.make_mesh(jax.devices()[:ways])
    length = q.shape[1]
    order = context.balanced_order(length, ways) if balanced else np.arange(length)
    index = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, length))
    ids = jnp.asarray(ids)[:, order]

    def attention(q, k, v):
        with layout.activate(mesh):
            return context.attend(q, k, v, context.Places(ids, ids, index, index),
                                  context.Options(causal=causal, window=window, scale=0.5,
                                                  mode=mode, kernel=kernel, balanced=balanced))

    @jax.jit
    def run(q, k, v, cotangent):
        out = attention(q, k, v)
        grads = jax.grad(lambda *x: (attention(*x) * cotangent).sum(), argnums=(0, 1, 2))(q, k, v)
        return out, grads

    out, grads = run(*(x[:, order] for x in (q, k, v, cotangent)))
    undo = np.argsort(order)
    return out[:, undo], tuple(g[:, undo] for g in grads)


# Each mode with each mask and over 2, 4, 8 ways once (of 18 combinations): the code
# branches on the mode alone (`local_attention`; ways and mask: sizes, `visible`'s terms).
CASES = [(4, "gather", True, 0), (2, "gather", False, 0), (8, "gather", True, 5),
         (8, "ring", True, 0), (4, "ring", False, 0), (2, "ring", True, 5)]
FAST = {(4, "gather", True, 0)}


def check_split(ways, mode, causal, window, kernel=None, length=L, balanced=True):
    q, k, v, cotangent = inputs(length=length)
    ids = packed_ids(length=length)
    want, want_grads = expected(q, k, v, cotangent, ids, causal, window)
    got, got_grads = split(ways, mode, q, k, v, cotangent, ids, causal, window, balanced,
                           kernel)
    real = (ids > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-5)
    # (padding queries' outputs are never used: their cotangent is 0 in a model's loss)
    cotangent_real = np.where(real, 1.0, 0.0)
    want_grads = expected(q, k, v, cotangent * cotangent_real, ids, causal, window)[1]
    got_grads = split(ways, mode, q, k, v, cotangent * cotangent_real, ids, causal, window,
                      balanced, kernel)[1]
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("ways, mode, causal, window", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES])
def test_split_attention_is_the_reference(ways, mode, causal, window):
    check_split(ways, mode, causal, window)


@pytest.mark.slow
def test_the_ring_goes_through_a_block_a_sub_block_at_a_time():
    """A device's block of 384 keys: the ring's forward and backward take it 128 at a time
    (`kernels.block_size`), windowed across the sub-blocks' edges."""
    check_split(2, "ring", True, 130, length=768)


# The flash path: splash (Pallas' interpret mode here) on each device's queries, whose
# length must fill its 128 lanes (so 128 positions a device), its mask on global positions.
SPLASH = [(2, True, 0, True), (8, True, 5, True), (4, False, 0, True), (4, True, 0, False)]


@pytest.mark.slow  # (Pallas' interpreter: seconds a case; the einsum blocks' fast ones above)
@pytest.mark.parametrize("ways, causal, window, balanced", SPLASH)
def test_splash_with_length_split_is_the_reference(ways, causal, window, balanced):
    check_split(ways, "gather", causal, window, "splash", 128 * ways, balanced)


@pytest.mark.parametrize("kernel, ways, window", [
    pytest.param("cudnn", 4, 5, marks=pytest.mark.slow),
    pytest.param("triton", 2, 0, marks=pytest.mark.slow)])
def test_gpu_kernels_with_length_split_are_the_reference(monkeypatch, kernel, ways, window):
    """cuDNN (emulated by jax's XLA implementation of its call) and tokamax's Triton kernel
    (in Pallas' interpret mode) given the mask of global positions."""
    from accelerators import on_a_gpu_emulated, triton_interpreted

    calls = (on_a_gpu_emulated if kernel == "cudnn" else triton_interpreted)(monkeypatch)
    check_split(ways, "gather", True, window, kernel)
    assert calls and set(calls) == {"cudnn" if kernel == "cudnn" else "triton"}


def test_the_ring_holds_no_whole_row_of_keys():
    """The compiled forward and backward pass of ring attention (8 ways, per device) has no
    array as long as the whole row with the keys' heads and size; the gathered form does."""
    length, ways = 256, 8
    q, k, v, cotangent = inputs(length=length)
    ids = jnp.asarray(packed_ids(length=length))
    layout = Layout(f"model:{ways}", "length:model")
    mesh = layout.make_mesh(jax.devices()[:ways])

    def compiled(mode):
        def loss(q, k, v):
            with layout.activate(mesh):
                out = context.attend(q, k, v, context.Places(ids, ids, ids, ids),
                                     context.Options(causal=True, mode=mode))
            return (out * cotangent).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()

    whole = f"[{B},{length},{G},{D}]"
    assert whole in compiled("gather")
    assert whole not in compiled("ring") and f"[{B},{length // ways},{G},{D}]" in \
        compiled("ring")


@pytest.mark.parametrize("mode, causal", [
    pytest.param("gather", False, marks=pytest.mark.slow), ("ring", True)])
def test_t5_relative_bias_with_length_split_is_the_reference(mode, causal):
    """T5's relative position bias, made block by block from the positions (its table's
    gradient too), 4 ways: the reference's with the dense [heads, length, length] bias."""
    from mtrain.models.positions import RelativeTable

    ways, length = 4, 64  # (the ring's blocks of 16: a distance past max_distance 20)
    q, k, v, cotangent = inputs(2, length)
    ids = packed_ids(2, length)
    cotangent = cotangent * (ids > 0)[:, :, None, None]
    table = RelativeTable(jax.random.normal(jax.random.key(5), (H, 16)), not causal, 16, 20)
    mask = AttentionMask.of_self(jnp.asarray(ids), causal)
    rows = jnp.arange(length)

    def want(q, k, v, t):
        bias = table.replace(table=t).between(rows, rows)[None]
        return (reference(q, k, v, mask, bias=bias, scale=0.5) * cotangent).sum()

    layout = Layout(f"model:{ways}", "length:model")
    mesh = layout.make_mesh(jax.devices()[:ways])
    order = context.balanced_order(length, ways)
    index = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, length))
    placed = jnp.asarray(ids)[:, order]

    def got(q, k, v, t):
        with layout.activate(mesh):
            out = context.attend(q, k, v, context.Places(placed, placed, index, index),
                                 context.Options(causal=causal, scale=0.5, mode=mode),
                                 bias=table.replace(table=t))
        return (out * cotangent[:, order]).sum()

    expected = jax.value_and_grad(want, argnums=(0, 1, 2, 3))(q, k, v, table.table)
    split = jax.jit(jax.value_and_grad(got, argnums=(0, 1, 2, 3)))(
        *(x[:, order] for x in (q, k, v)), table.table)
    np.testing.assert_allclose(split[0], expected[0], rtol=2e-5)
    undo = np.argsort(order)
    for name, g, w in zip("qkv", split[1], expected[1]):
        np.testing.assert_allclose(g[:, undo], w, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(split[1][3], expected[1][3], atol=1e-4, err_msg="table")


def causal_pairs(order, ways):
    """The unmasked causal query-key pairs of each device's queries, in `order`."""
    per = len(order) // ways
    return [int(sum((order <= q).sum() for q in order[i * per:(i + 1) * per]))
            for i in range(ways)]


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_the_balanced_order_gives_every_device_the_same_causal_work(ways):
    balanced = causal_pairs(context.balanced_order(256, ways), ways)
    assert len(set(balanced)) == 1 and sum(balanced) == 256 * 257 // 2
    plain = causal_pairs(np.arange(256), ways)
    assert plain[-1] > 2 * plain[0]  # (unbalanced, the last device does most)
    with pytest.raises(ValueError, match="multiple of 16"):  # (a LayoutError)
        context.balanced_order(40, 8)


def test_without_a_layout_it_is_plain_attention():
    q, k, v, _ = inputs(1)
    ids = jnp.asarray(packed_ids(1))
    index = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    got = context.attend(q, k, v, context.Places(ids, ids, index, index),
                         context.Options(causal=True, scale=0.5))
    want = reference(q, k, v, AttentionMask.of_self(ids, True), scale=0.5)
    real = (np.asarray(ids) > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-5)
