"""Delayed fp8 scaling (``transformer.quantization_scaling='delayed'``, flax's fp8 ops): a
projection uses the scales of its amax history and records this step's amaxes after; with
the tensors' own history its products are current scaling's, within the format's bounds
(test_quantization's, derived there); the trainer writes the state over itself every step
(the optimizer never sees it; microbatches take the largest); layouts change no loss; the
refusals are one line. The command line's journey is in test_quantization_runs.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantization import B, L, ROUNDOFF, SPLIT, TINY, bounds, config, losses, operands

from mtrain.errors import ConfigError
from mtrain.models import blocks, parameters
from mtrain.models.quantization import Quantization, fresh_meta, updated_meta
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer

FMAX = np.array([448.0, 448.0, 57344.0])  # e4m3 (input, weight), e5m2 (gradient)


def delayed_step(x, w, dy, meta):
    """(y, dx, dw, new meta) of one delayed-scaling projection ``x w`` from `meta`."""
    q = Quantization(mode="fp8", scaling="delayed", history=4)
    y, vjp = jax.vjp(lambda x, w, m: q.einsum("td,df->tf", x, w, meta=m),
                     jnp.asarray(x), jnp.asarray(w), meta)
    return (*(np.asarray(a) for a in (y, *vjp(jnp.asarray(dy)))),)


def test_a_step_uses_the_history_then_records_its_own_amaxes():
    """Step 1 from a fresh state (scale 1, an empty history) records the amaxes of x, w
    and the incoming gradient and keeps scale 1; step 2 on the same tensors quantizes with
    their amaxes / the formats' largest values, as current (tensorwise) scaling does: its
    products within the tensorwise bounds, the scales recorded, the history two deep."""
    x, w, dy = operands()
    amax = np.array([np.abs(x).max(), np.abs(w).max(), np.abs(dy).max()])
    *_, meta = delayed_step(x, w, dy, fresh_meta((3, 5)))
    np.testing.assert_array_equal(meta[:, 0], 1.0)
    np.testing.assert_array_equal(meta[:, 1], amax)  # (a max: exact in float32)
    np.testing.assert_array_equal(meta[:, 2:], 0.0)

    y, dx, dw, meta = delayed_step(x, w, dy, jnp.asarray(meta))
    np.testing.assert_allclose(meta[:, 0], amax / FMAX, rtol=4 * 2.0**-24)  # (1 / (fmax / a))
    assert sorted(meta[:, 1:].ravel())[-6:] == sorted([*amax, *amax])
    r = ROUNDOFF["float32"]
    for got, exact, bound in zip((y, dx, dw), (x @ w, dy @ w.T, x.T @ dy),
                                 bounds("fp8", False, x, w, dy, r)):
        assert np.all(np.abs(got - exact) <= bound)
        assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()


def test_a_state_is_written_over_only_where_a_finite_step_used_it():
    old = {"a": jnp.ones((2, 3, 5)), "b": jnp.ones((3, 5))}
    new = {"a": jnp.zeros((2, 3, 5)).at[1].set(7.0), "b": jnp.full((3, 5), 2.0)}
    got = updated_meta(old, new, jnp.asarray(True))
    np.testing.assert_array_equal(got["a"][0], 1.0)  # (a layer no product read: kept)
    np.testing.assert_array_equal(got["a"][1], 7.0)
    np.testing.assert_array_equal(got["b"], 2.0)
    kept = updated_meta(old, new, jnp.asarray(False))
    assert all(np.all(np.asarray(v) == 1.0) for v in jax.tree_util.tree_leaves(kept))


def trainer(num_microbatches=1, history=4, scan_layers=False):
    c = config("fp8", "delayed", activation_dtype="float32", quantization_history=history,
               scan_layers=scan_layers)
    layout = Layout("", "")
    return Trainer(model=DecoderLM(c), optimizer=optimizer.adamw(
        optimizer.learning_rate_schedule(warmup_steps=2)), layout=layout,
        mesh=layout.make_mesh(jax.devices()[:1]), batch_size=B, sequence_length=L, seed=3,
        num_microbatches=num_microbatches)


def batch(t, seed=0):
    targets = np.random.default_rng(seed).integers(1, TINY["vocab_size"], (B, L)).astype(
        np.int32)
    return t.place_batch({"targets": targets, "targets_segment_ids": np.ones_like(targets),
                          "targets_positions": np.broadcast_to(np.arange(L), (B, L)).astype(
                              np.int32)})


def states(params):
    return {p: np.asarray(v) for p, v in parameters.paths(params).items() if p.endswith("_fp8")}


@pytest.mark.parametrize("scan_layers, count, shape", [
    (False, 14, (3, 5)), pytest.param(True, 7, (2, 3, 5), marks=pytest.mark.slow)])
def test_the_trainer_writes_the_state_over_itself_every_step(scan_layers, count, shape):
    """Each quantized projection (2 layers x q, k, v, o, wi_0, wi_1, wo; a scanned stack's
    stacked by layer) has its state, float32 [3, 1 + history], none of it the optimizer's;
    after n steps each history holds the last min(n, history) amaxes and the scales come
    from them."""
    t = trainer(scan_layers=scan_layers)
    state = t.init_state()
    start = states(state.params)
    assert len(start) == count and all(v.shape == shape and v.dtype == np.float32
                                       for v in start.values())
    assert not any("_fp8" in jax.tree_util.keystr(p)
                   for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state))
    for n in range(1, 6):
        state, metrics = t.train_step(state, batch(t, n))
        assert float(metrics["finite"]) == 1.0
        for v in states(state.params).values():
            assert np.all(np.count_nonzero(v[..., 1:], axis=-1) == min(n, 4))
            assert np.all(v[..., 0] != 1.0) == (n >= 2)


@pytest.mark.slow  # (two trainers)
def test_microbatches_record_the_largest_amax():
    """Two microbatches record the larger amax of the two: the inputs' and weights' are
    the whole batch's, as one microbatch records them (the gradient's are of each
    microbatch's sum, not the batch's mean: another scale, as the trainer sums them)."""
    whole, two = trainer(), trainer(num_microbatches=2)  # (the same start: seed 3)
    one, _ = whole.train_step(whole.init_state(), batch(whole, 1))
    split, _ = two.train_step(two.init_state(), batch(two, 1))
    expected = states(one.params)
    for path, v in states(split.params).items():
        np.testing.assert_array_equal(v[:2], expected[path][:2])


@pytest.mark.slow  # (four trainers: one device's reference once for both layouts)
def test_layouts_change_no_delayed_loss():
    """As test_quantization's layouts test: the amaxes are maxes, the same over any split
    (model parallel; FSDP); three steps, so that the third quantizes with scales from the
    first two."""
    c = config("fp8", "delayed", activation_dtype="float32", quantization_history=4)
    _, params = losses(c, steps=0)
    reference, _ = losses(c, params=params, steps=3)
    for mesh_shape, rules, parameter_rules in [("batch:4;model:2", SPLIT, ""),
                                               ("batch:8", "batch:batch", "d_model:batch")]:
        got, trained = losses(c, mesh_shape, rules, parameter_rules, params=params, steps=3)
        np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=mesh_shape)
        assert len(states(trained)) == 14


def test_refusals_are_one_line():
    for settings, words in [
            (dict(quantization="int8", quantization_scaling="delayed"),
             "transformer.quantization_scaling='delayed' is fp8's (flax's fp8 ops), not "
             "int8's: use 'tensorwise' or 'rowwise'"),
            (dict(quantization="fp8", quantization_history=0),
             "transformer.quantization_history must be at least 1 step, got 0")]:
        with pytest.raises(ValueError) as error:
            TransformerConfig(**settings)
        assert str(error.value) == words
    c = TransformerConfig(**{**TINY, "scan_layers": True}, quantization="fp8",
                          quantization_scaling="delayed")
    with pytest.raises(ConfigError, match="pipeline stages run each layer once per "
                                          "microbatch: use 'tensorwise'"):
        blocks.check_stages(c, stages=2, rows=B)
