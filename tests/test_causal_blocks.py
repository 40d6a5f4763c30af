"""`attention.reference` splits long causal self-attention into blocks of queries, each
against the keys up to its last (`attention.causal_blocks`): the same values and gradients
as the whole [l, l] at once, for packed segments, grouped heads, a bias, sinks and a window,
and never forming the whole logits; and it keeps the whole where blocks would not apply."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import attention
from mtrain.models.attention import CAUSAL_BLOCK, MOST_BLOCKS, AttentionMask, causal_blocks
from mtrain.parallel.layout import Layout

L = 2 * CAUSAL_BLOCK  # two blocks
B, H, D = 2, 4, 8


def inputs(g, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, L, g, D)), jnp.float32) for _ in range(2))
    # two packed examples in the first row, one and padding in the second
    seg = np.ones((B, L), np.int32)
    seg[0, 100:] = 2
    seg[1, 200:] = 0
    return q, k, v, jnp.asarray(seg)


@pytest.mark.parametrize("g, window, bias, sinks", [
    (H, 0, False, False), (2, 0, True, False), (1, 40, False, True)])
def test_blocks_compute_the_whole_attention(g, window, bias, sinks):
    """Values and the gradients of q, k, v to float32 rounding of sums over at most L keys
    (the masked logits add exactly 0 to a softmax: only the order of the sums differs,
    relative error below L x 2^-24 ~ 1.5e-5)."""
    q, k, v, seg = inputs(g)
    mask = AttentionMask.of_self(seg, causal=True).windowed(window)
    table = (jnp.asarray(np.random.default_rng(1).normal(size=(1, H, L, L)), jnp.float32)
             if bias else None)
    sink = jnp.linspace(-1.0, 1.0, H) if sinks else None
    assert causal_blocks(mask, L, L) == 2

    def blocked(q, k, v):
        return attention.reference(q, k, v, mask, bias=table, scale=D**-0.5, sinks=sink)

    def whole(q, k, v):
        return attention._attend(q, k, v, mask.dense(), None, table, D**-0.5, sink)

    real = (seg > 0)[:, :, None, None]  # (what padding computes is never used)
    np.testing.assert_allclose(jnp.where(real, blocked(q, k, v), 0),
                               jnp.where(real, whole(q, k, v), 0), rtol=1.5e-5, atol=1e-6)
    cotangent = jnp.where(real, jnp.asarray(np.random.default_rng(2).normal(size=q.shape),
                                            jnp.float32), 0)
    grads = [jax.vjp(f, q, k, v)[1](cotangent) for f in (blocked, whole)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1.5e-5, atol=1e-5 * np.abs(want).max())


def test_blocks_never_form_the_whole_logits():
    """The compiled attention's largest float array is the last block's logits, half the
    whole [b, h, l, l]."""
    q, k, v, seg = inputs(2)
    mask = AttentionMask.of_self(seg, causal=True)
    text = jax.jit(lambda q, k, v: attention.reference(q, k, v, mask)).lower(
        q, k, v).compile().as_text()
    sizes = [np.prod([int(n) for n in dims.split(",")])
             for dims in re.findall(r"f32\[([\d,]+)\]", text)]
    assert max(sizes) == B * H * CAUSAL_BLOCK * L


def test_where_blocks_do_not_apply_the_whole_runs():
    """Not causal, not self-attention (a cross-attention mask), dropout (its random numbers
    are drawn for the whole), rows shorter than two blocks or not a multiple of one, a
    dense mask, or a layout that splits the length."""
    seg = jnp.ones((B, L), jnp.int32)
    causal = AttentionMask.of_self(seg, causal=True)
    assert causal_blocks(AttentionMask.of_self(seg, causal=False), L, L) == 1
    assert causal_blocks(AttentionMask(seg, seg, causal=True), L, L) == 1
    assert causal_blocks(causal, L, L, dropout=lambda w: w) == 1
    assert causal_blocks(causal, CAUSAL_BLOCK, CAUSAL_BLOCK) == 1
    assert causal_blocks(causal, L + 8, L + 8) == 1
    assert causal_blocks(causal.dense(), L, L) == 1
    # longer rows, longer blocks: at most MOST_BLOCKS (8 of 512 positions for 4096)
    assert causal_blocks(causal, 32 * CAUSAL_BLOCK, 32 * CAUSAL_BLOCK) == MOST_BLOCKS
    layout = Layout("batch:2;model:4", "batch:batch;length:model")
    with layout.activate(layout.make_mesh(jax.devices())):
        assert causal_blocks(causal, L, L) == 1
