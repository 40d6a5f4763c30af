"""Context parallelism (`models.context`): self-attention with ``length`` split 2, 4 and 8
ways, its keys and values all-gathered or passed around the ring, gives the unsplit einsum
reference's outputs and gradients, causal or not, windowed, grouped heads, packed rows whose
examples straddle the split points, in the load-balanced order; and that order gives every
device the same causal work.

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


def packed_ids(seed=0):
    """Two rows of packed examples (lengths drawn at random, padding at the end)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        ids, segment = [], 1
        while len(ids) < L - 3:
            ids += [segment] * int(rng.integers(3, 12))
            segment += 1
        rows.append((ids[:L - 3] + [0, 0, 0]))
    return np.asarray(rows, np.int32)


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, L, H, D))
    k = jax.random.normal(keys[1], (B, L, G, D))
    v = jax.random.normal(keys[2], (B, L, G, D))
    cotangent = jax.random.normal(keys[3], (B, L, H, D))
    return q, k, v, cotangent


def expected(q, k, v, cotangent, ids, causal, window):
    mask = AttentionMask.of_self(jnp.asarray(ids), causal).windowed(window)
    fn = lambda q, k, v: (reference(q, k, v, mask, scale=0.5) * cotangent).sum()  # noqa: E731
    return reference(q, k, v, mask, scale=0.5), jax.grad(fn, argnums=(0, 1, 2))(q, k, v)


def split(ways, mode, q, k, v, cotangent, ids, causal, window, balanced=True):
    """`context.attend` over a mesh splitting ``length`` `ways` ways, in the balanced order
    (undone on the outputs and gradients)."""
    layout = Layout(f"model:{ways}", "length:model")
    mesh = layout.make_mesh(jax.devices()[:ways])
    order = context.balanced_order(L, ways) if balanced else np.arange(L)
    index = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, L))
    ids = jnp.asarray(ids)[:, order]

    def attention(q, k, v):
        with layout.activate(mesh):
            return context.attend(q, k, v, ids, ids, index, index, causal=causal, window=window,
                                  scale=0.5, mode=mode)

    @jax.jit
    def run(q, k, v, cotangent):
        out = attention(q, k, v)
        grads = jax.grad(lambda *x: (attention(*x) * cotangent).sum(), argnums=(0, 1, 2))(q, k, v)
        return out, grads

    out, grads = run(*(x[:, order] for x in (q, k, v, cotangent)))
    undo = np.argsort(order)
    return out[:, undo], tuple(g[:, undo] for g in grads)


CASES = [(ways, mode, causal, window) for ways in (2, 4, 8) for mode in context.MODES
         for causal, window in ((True, 0), (False, 0), (True, 5))]
FAST = {(4, "gather", True, 0)}


@pytest.mark.parametrize("ways, mode, causal, window", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES])
def test_split_attention_is_the_reference(ways, mode, causal, window):
    q, k, v, cotangent = inputs()
    ids = packed_ids()
    want, want_grads = expected(q, k, v, cotangent, ids, causal, window)
    got, got_grads = split(ways, mode, q, k, v, cotangent, ids, causal, window)
    real = (ids > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-5)
    # (padding queries' outputs are never used: their cotangent is 0 in a model's loss)
    cotangent_real = np.where(real, 1.0, 0.0)
    want_grads = expected(q, k, v, cotangent * cotangent_real, ids, causal, window)[1]
    got_grads = split(ways, mode, q, k, v, cotangent * cotangent_real, ids, causal, window)[1]
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)


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
    got = context.attend(q, k, v, ids, ids, index, index, causal=True, scale=0.5)
    want = reference(q, k, v, AttentionMask.of_self(ids, True), scale=0.5)
    real = (np.asarray(ids) > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-5)


@pytest.mark.parametrize("mesh, mode", [
    pytest.param("batch:1;model:8", "gather", marks=pytest.mark.slow),
    pytest.param("batch:1;model:8", "ring", marks=pytest.mark.slow),
    ("batch:4;model:2", "ring"),
])
def test_training_with_length_split_is_training_on_one_device(mesh, mode):
    """The language model's training losses and its scores (in the rows' own order) with
    ``length`` split equal one device's: packed rows, rotary positions, grouped heads."""
    import dataclasses

    from test_trainer import CONFIG, make_trainer, packed_batches

    config = dataclasses.replace(CONFIG, dropout_rate=0.0, position_encoding="rotary",
                                 num_kv_heads=2, context_parallel=mode)
    rules = "batch:batch;length:model"

    def run(mesh, rules):
        trainer = make_trainer(mesh, rules, config=config)
        state, losses = trainer.init_state(), []
        for batch in packed_batches(3):
            placed = trainer.place_batch(batch)
            state, metrics = trainer.train_step(state, placed)
            losses.append(float(metrics["loss"]))
        scores = trainer.token_log_likelihoods(state.params, trainer.place_batch(batch))
        return losses, np.asarray(scores), trainer

    want, want_scores, _ = run("", "")
    got, got_scores, trainer = run(mesh, rules)
    assert trainer.length_order is not None
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_scores, want_scores, atol=1e-4)


@pytest.mark.slow
def test_a_run_with_length_split_trains_resumes_and_refuses_what_cannot_split(tmp_path, capsys):
    """Through the command line: ``length`` split over its own mesh dimension beside
    ``batch`` and ``model``, 2 steps, then resumed to 4 (the same losses as 4 at once); a
    sequence that does not cut into 2n chunks and ``length`` with ``d_ff`` on one mesh
    dimension are one line each, nothing written."""
    import json
    import os

    from tiny_config import TINY

    from mtrain.__main__ import main

    def argv(model_dir, *params):
        return ["--gin_file=tasks/bible_lm.gin", f"--model_dir={model_dir}",
                *(f"--gin_param={p}" for p in [
                    *TINY, "run.mesh_shape='batch:2;seq:2;model:2'",
                    "run.layout_rules='batch:batch;length:seq;d_ff:model;heads:model'",
                    "run.log_every=1", "run.checkpoint_every=2",
                    f"run.data_dir='{tmp_path / 'data'}'", *params])]

    def losses(model_dir):
        with open(model_dir / "metrics.jsonl") as f:
            return [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]

    assert main(argv(tmp_path / "once", "run.train_steps=4")) == 0
    assert main(argv(tmp_path / "twice", "run.train_steps=2")) == 0
    assert main(argv(tmp_path / "twice", "run.train_steps=4")) == 0
    assert losses(tmp_path / "twice")[-2:] == losses(tmp_path / "once")[-2:]
    for bad, message in (("run.sequence_length=30", "multiple of 4"),
                         ("run.layout_rules='batch:batch;length:model;d_ff:model'",
                          "are both split over mesh dimension 'model'")):
        capsys.readouterr()
        assert main(argv(tmp_path / "bad", "run.train_steps=2", bad)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and message in lines[-1], lines
        assert not os.path.exists(tmp_path / "bad" / "checkpoints")
