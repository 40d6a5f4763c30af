"""The speed and memory levers change speed and memory, not results: bfloat16 activations,
rematerialisation, a scanned layer stack, gradient accumulation over microbatches, the loss
computed a slice of the sequence at a time and jax.nn.dot_product_attention all train like
the plain float32 path on an 8-device mesh."""

import dataclasses
import types

import jax
import numpy as np
import optax
import pytest

from mtrain.planning.hlo_cost import hlo_cost
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.errors import ConfigError
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.losses import LossConfig
from mtrain.training.trainer import Trainer
from mtrain.evaluation.translation import DecodingConfig, Translator

CONFIG = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                           num_layers=3, max_length=32)
LAYOUT = Layout("batch:4;model:2", "batch:batch;d_ff:model;heads:model;vocab:model")
BATCH, LENGTH = 16, 32


def packed_batch(seed=0, features=("targets",)):
    rng = np.random.default_rng(seed)
    segments = np.ones((BATCH, LENGTH), np.int32)
    segments[:, LENGTH // 2:] = 2  # two packed examples per row
    segments[::3, -5:] = 0  # and some padding
    positions = np.where(segments == 2, np.arange(LENGTH) - LENGTH // 2, np.arange(LENGTH))
    batch = {}
    for f in features:
        batch[f] = np.where(segments > 0, rng.integers(1, 256, (BATCH, LENGTH)), 0).astype(np.int32)
        batch[f"{f}_segment_ids"] = segments
        batch[f"{f}_positions"] = (positions * (segments > 0)).astype(np.int32)
    return batch


def trainer(config=CONFIG, model=DecoderLM, **kwargs):
    # Plain SGD, whose update is linear in the gradient: the compared programs sum the same
    # numbers in other orders (microbatches, chunks, remat, scan), and those float32
    # differences (~1e-7 relative) stay that small in the next steps' losses. Adam divides
    # each gradient by its own magnitude, which turns them into updates of up to the learning
    # rate where a gradient is near zero: after 3 steps, losses 5e-5 apart on some x86 CPUs.
    return Trainer(model=model(config), optimizer=optax.sgd(1.0), layout=LAYOUT,
                   mesh=LAYOUT.make_mesh(), batch_size=BATCH, sequence_length=LENGTH, **kwargs)


def train_losses(t, steps=4, params=None, features=("targets",)):
    state = t.init_state()
    if params is not None:
        state = state.replace(params=params, opt_state=t.optimizer.init(params))
    out = []
    for i in range(steps):
        state, metrics = t.train_step(state, t.place_batch(packed_batch(i, features)))
        out.append(float(metrics["loss"]))
    return out


@pytest.fixture(scope="module")
def reference():
    return train_losses(trainer())


@pytest.mark.slow  # (two trainings compared: about 15 s)
def test_bfloat16_activations_train_like_float32(reference):
    got = train_losses(trainer(dataclasses.replace(CONFIG, activation_dtype="bfloat16")))
    np.testing.assert_allclose(got, reference, rtol=2e-2)
    assert got != reference  # it did compute in bfloat16


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_gives_the_same_losses(reference, policy):
    got = train_losses(trainer(dataclasses.replace(CONFIG, remat_policy=policy)))
    np.testing.assert_allclose(got, reference, rtol=1e-5)


def stacked_params(plain, scanned, **stacks):
    """`plain`'s initial parameters in `scanned`'s structure: each ``name=[layer names]`` of
    `stacks` stacks those unrolled layers into the scanned stack `name`."""
    params = dict(plain.init_state().params)
    for name, layer_names in stacks.items():
        layers = [params.pop(k) for k in layer_names]
        params[name] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        scanned.abstract_state.params)
    return jax.device_put(params, scanned.state_shardings.params)


def test_scanned_layers_compute_what_the_unrolled_ones_do(reference):
    scanned = trainer(dataclasses.replace(CONFIG, scan_layers=True, remat_policy="full"))
    stacked = stacked_params(trainer(), scanned, layers=[f"layer_{i}" for i in range(3)])
    np.testing.assert_allclose(train_losses(scanned, params=stacked), reference, rtol=1e-5)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_scanned_encoder_decoder_computes_what_the_unrolled_one_does():
    both = ("inputs", "targets")
    config = dataclasses.replace(CONFIG, num_encoder_layers=2)  # 2 encoder, 3 decoder layers
    plain = trainer(config, EncoderDecoder)
    scanned = trainer(dataclasses.replace(config, scan_layers=True, remat_policy="full"),
                      EncoderDecoder)
    stacked = stacked_params(plain, scanned, encoder=[f"encoder_{i}" for i in range(2)],
                             decoder=[f"decoder_{i}" for i in range(3)])
    assert stacked["encoder"]["mlp"]["wi"].shape == (2, CONFIG.d_model, CONFIG.d_ff)
    assert stacked["decoder"]["encoder_decoder_attention"]["q"].shape[0] == 3
    # Incremental decoding with the key/value cache: greedy and beam search, sharded as in
    # translation (the scanned cache keeps its rows first for beam search to reorder).
    vocab = types.SimpleNamespace(vocab_size=CONFIG.vocab_size, eos_id=1)
    batch = packed_batch(1, both)
    inputs, segments = batch["inputs"], (batch["inputs_segment_ids"] > 0).astype(np.int32)
    for beam_size in (1, 2):
        decoding = DecodingConfig(beam_size=beam_size, max_decode_length=8)
        expected = Translator(plain, vocab, decoding)._decode(plain.init_state().params, inputs,
                                                              segments)
        got = Translator(scanned, vocab, decoding)._decode(stacked, inputs, segments)
        assert np.asarray(expected).any()
        np.testing.assert_array_equal(got, expected)
    # Training (last: a train step donates the parameters it is given).
    np.testing.assert_allclose(train_losses(scanned, params=stacked, features=both),
                               train_losses(plain, features=both), rtol=1e-5)


@pytest.mark.slow  # (six train steps lowered: about 10 s)
def test_scan_keeps_the_program_the_same_size_at_any_depth():
    def hlo_size(layers, scan, model=DecoderLM):
        config = dataclasses.replace(CONFIG, num_layers=layers, scan_layers=scan)
        t = trainer(config, model)
        return len(t.lower_train_step().as_text())

    assert hlo_size(12, True) < 1.1 * hlo_size(2, True)
    assert hlo_size(12, False) > 3 * hlo_size(2, False)
    assert hlo_size(12, True, EncoderDecoder) < 1.1 * hlo_size(2, True, EncoderDecoder)


@pytest.mark.parametrize("k", [4])  # (2 takes the same path: `gradients.mean_gradient`'s
def test_microbatches_give_the_same_update_with_less_memory(reference, k):  # scan of k > 1)
    t = trainer(num_microbatches=k)
    np.testing.assert_allclose(train_losses(t), reference, rtol=1e-5)
    # The planner's auto-layout relays a trainer out with its settings, microbatches too.
    other = t.with_layout(Layout("batch:8", "batch:batch"))
    assert (other.num_microbatches, other.seed, other.batch_shape) == (k, 0, (BATCH, LENGTH))
    if k == 4:
        full = trainer().compile_train_step().memory_analysis().temp_size_in_bytes
        micro = t.compile_train_step().memory_analysis().temp_size_in_bytes
        assert micro < 0.7 * full


@pytest.mark.slow
def test_chunked_loss_gives_the_same_losses_and_gradients(reference):
    chunked = trainer(objective=LanguageModeling(LossConfig(chunks=4)))
    assert (trainer().loss_chunks, chunked.loss_chunks) == (1, 4)
    np.testing.assert_allclose(train_losses(chunked), reference, rtol=1e-5)
    # The gradient itself, also for the encoder-decoder's shared embedding-softmax, with label
    # smoothing, and in bfloat16.
    both = ("inputs", "targets")
    for config, model, features, smoothing, tol in [
            (CONFIG, DecoderLM, ("targets",), 0.0, 1e-5),
            (dataclasses.replace(CONFIG, shared_embedding_and_softmax=True), EncoderDecoder, both,
             0.1, 1e-5),
            (dataclasses.replace(CONFIG, activation_dtype="bfloat16"), DecoderLM, ("targets",),
             0.1, 2e-2)]:
        out, params = [], None
        for chunks in (1, 8):
            loss = LossConfig(chunks=chunks, label_smoothing=smoothing)
            t = trainer(config, model, objective=LanguageModeling(loss))
            batch = t.place_batch(packed_batch(0, features))
            if params is None:  # (both on the same parameters: the same model and layout)
                params = t.init_state().params
            out.append(jax.jit(lambda p, b: t.gradients(p, b, t.dropout_key))(params, batch))
        (g1, loss1, xent1, n1, _), (g8, loss8, xent8, n8, _) = out
        np.testing.assert_allclose([loss8, xent8, n8], [loss1, xent1, n1], rtol=tol)
        for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g8)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(b, a, atol=tol * np.abs(a).max())


def test_chunked_loss_needs_less_memory():
    config = dataclasses.replace(CONFIG, vocab_size=4096)
    whole = trainer(config, objective=LanguageModeling(LossConfig(chunks=1))).compile_train_step()
    chunked = trainer(config, objective=LanguageModeling(LossConfig(chunks=8))).compile_train_step()
    assert (chunked.memory_analysis().temp_size_in_bytes
            < 0.6 * whole.memory_analysis().temp_size_in_bytes)
    # ... and sends no more: the softmax weights' gradient is summed over the batch's devices
    # once, after the last slice, not once per slice (8 x 384 KiB per device here).
    sent = [hlo_cost(c.as_text(), 8).collectives["all-reduce"].bytes_sent for c in (whole, chunked)]
    assert sent[1] < 1.1 * sent[0], sent


def test_automatic_loss_chunks():
    auto = LossConfig()
    # The throughput benchmark's reference model on one device: 8 slices of 2**21 logits.
    assert auto.num_chunks(128, 16 * 128 * 8192) == 8
    assert auto.num_chunks(128, 2**21) == 1  # small enough already
    assert auto.num_chunks(2048, 16 * 2048 * 32768) == 16  # at most 16
    assert auto.num_chunks(127, 2**30) == 1  # a prime length cannot be sliced
    assert LossConfig(chunks=4).num_chunks(32, 1) == 4
    with pytest.raises(ConfigError, match="loss.chunks=3 must be 0"):
        LossConfig(chunks=3).num_chunks(32, 2**30)


@pytest.mark.slow  # (the fast tier: test_model_families' dot_product path, grouped and biased)
def test_dot_product_attention_matches_the_einsum_path(reference):
    fused = dataclasses.replace(CONFIG, attention="dot_product")
    np.testing.assert_allclose(train_losses(trainer(fused)), reference, rtol=1e-5)
    both = ("inputs", "targets")
    plain_ed = train_losses(trainer(CONFIG, EncoderDecoder), features=both)
    fused_ed = train_losses(trainer(fused, EncoderDecoder), features=both)
    np.testing.assert_allclose(fused_ed, plain_ed, rtol=1e-5)


def test_bad_lever_settings_are_refused():
    with pytest.raises(ValueError, match="remat_policy must be one of"):
        TransformerConfig(remat_policy="some")
    with pytest.raises(ValueError, match="activation_dtype must be"):
        TransformerConfig(activation_dtype="float16")
    with pytest.raises(ValueError, match="attention must be"):
        TransformerConfig(attention="fast")
