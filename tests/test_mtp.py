"""DeepSeek-V3's multi-token prediction (`transformer.mtp_depth`, `models.mtp`): its loss is
the paper's formula (checked against a hand-written one on the same parameters, packed
rows, chat masks), a decoder with it trains and logs ``train/mtp_loss``, scanning and
layouts change no loss, and evaluation, scoring and decoding never see the modules."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import attention
from mtrain.models.blocks import Block
from mtrain.models.context import balanced_order
from mtrain.models.mtp import ahead
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.losses import LossConfig
from mtrain.training.trainer import Trainer

B, L = 8, 16
TINY = dict(vocab_size=64, d_model=16, d_ff=32, num_heads=2, d_kv=8, num_layers=2,
            max_length=L, position_encoding="rotary", dropout_rate=0.0, mtp_depth=1)
SPLIT = "batch:batch;heads:model;d_ff:model;vocab:model"


def packed_batch(seed=0, weights=False):
    """Rows of two packed segments and some padding (with `weights`, a chat-like mask: the
    first three targets of each segment carry no loss)."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
    for r in range(B):
        cut, end = int(rng.integers(4, L - 5)), L - int(rng.integers(0, 3))
        for s, (a, b) in enumerate([(0, cut), (cut, end)]):
            seg[r, a:b], pos[r, a:b] = s + 1, np.arange(b - a)
    batch = {"targets": rng.integers(1, TINY["vocab_size"], (B, L)).astype(np.int32) * (seg > 0),
             "targets_segment_ids": seg, "targets_positions": pos}
    if weights:
        batch["targets_weights"] = ((pos >= 3) & (seg > 0)).astype(np.int32)
    return batch


def make_trainer(config, mesh_shape="", rules="", chunks=0, microbatches=1, rate=1.0):
    layout = Layout(mesh_shape, rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=5,
                                                               constant=rate))
    return Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                   batch_size=B, sequence_length=L, seed=3, num_microbatches=microbatches,
                   objective=LanguageModeling(LossConfig(z_loss=0.0, chunks=chunks)))


def rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def reference_mtp_loss(c, params, batch):
    """The paper's L_MTP / lambda, by hand: module k (from 1) at position i reads the
    trunk's (or module k - 1's) hidden state and the embedding of t_{i+k} (the target k - 1
    later), projects [enorm(emb); hnorm(h)], runs its Block (the library's: the layers'
    own tests check it), and predicts t_{i+1+k} (the target k later) through its output
    norm and the shared softmax; cross-entropy over the positions whose target is in the
    same segment and carries loss, summed per module and divided by the tokens that carry
    loss (as the trunk's: `language_modeling.mtp_loss_sum`), then meant over the modules."""
    targets, seg, pos = (jnp.asarray(batch[k]) for k in
                         ("targets", "targets_segment_ids", "targets_positions"))
    carries = (seg > 0) & (jnp.asarray(batch.get("targets_weights", seg)) > 0)
    mask = attention.AttentionMask.of_self(seg, causal=True, balanced=True)
    table, eps = params["token_embedding"]["embedding"], c.norm_epsilon
    inputs = jnp.where(seg == jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1],
                       jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1], 0)
    h = table[inputs]
    for i in range(c.num_layers):
        h = Block(c).apply({"params": params[f"layer_{i}"]}, h, mask, True, positions=pos)
    losses = []
    for k in range(1, c.mtp_depth + 1):
        p = params[f"mtp_{k - 1}"]
        same = np.zeros((B, L), bool)
        same[:, :L - k] = np.asarray(seg[:, k:] == seg[:, :L - k])
        ids = np.where(same, np.pad(np.asarray(targets), ((0, 0), (0, k)))[:, k - 1:L + k - 1], 0)
        x = jnp.concatenate([rms(table[ids], p["embedding_norm"]["scale"], eps),
                             rms(h, p["hidden_norm"]["scale"], eps)], -1) @ p["projection"]
        h = Block(c).apply({"params": p["layer"]}, x, mask, True, positions=pos)
        logits = rms(h, p["output_norm"]["scale"], eps) @ params["softmax"]
        xent = jax.nn.logsumexp(logits, -1)
        total = 0.0
        for r in range(B):
            for i in range(L - k):
                if same[r, i] and carries[r, i + k]:
                    total += xent[r, i] - logits[r, i, targets[r, i + k]]
        losses.append(total / int(carries.sum()))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("depth, weights, chunks", [
    pytest.param(1, False, 1, marks=pytest.mark.slow), (2, True, 2)])
def test_the_loss_is_the_papers_formula(depth, weights, chunks):
    """Depth 1, and depth 2 with a chat's loss mask and the logits formed in 2 slices
    (`losses.chunked_cross_entropy`)."""
    c = TransformerConfig(**{**TINY, "mtp_depth": depth, "mtp_loss_weight": 0.25})
    trainer = make_trainer(c, chunks=chunks)
    assert trainer.loss_chunks == chunks
    params = nn.unbox(jax.device_get(trainer.init_state().params))
    batch = packed_batch(1, weights)
    loss, xent, count, tokens, stats = trainer.objective.loss_sums(
        params, batch, {"dropout": jax.random.key(0)})
    expected = reference_mtp_loss(c, params, batch)
    np.testing.assert_allclose(stats["mtp_loss"] / tokens, expected, rtol=1e-5)
    # the training loss: the trunk's (z-loss 0: its cross-entropy) + lambda x L_MTP / lambda
    np.testing.assert_allclose(loss / tokens, xent / tokens + 0.25 * expected, rtol=1e-5)
    assert tokens == (batch.get("targets_weights", batch["targets_segment_ids"]) > 0).sum()


def test_a_decoder_with_mtp_trains():
    """20 steps on one repeating batch: both losses fall."""
    trainer = make_trainer(TransformerConfig(**TINY))
    state, batch = trainer.init_state(), trainer.place_batch(packed_batch(2))
    history = []
    for _ in range(20):
        state, metrics = trainer.train_step(state, batch)
        history.append((float(metrics["cross_entropy"]), float(metrics["mtp_loss"])))
    (xent0, mtp0), (xent, mtp) = history[0], history[-1]
    assert xent < 0.8 * xent0 and mtp < 0.8 * mtp0, history


def losses_of(trainer, state, steps=3):
    out = []
    for seed in range(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(packed_batch(seed)))
        out.append((float(metrics["loss"]), float(metrics["mtp_loss"])))
    return out


def scanned(params):
    """Unscanned parameters as a scanned stack's (``layers``: layer_0, layer_1 stacked)."""
    params = dict(params)
    layers = [params.pop(f"layer_{i}") for i in range(TINY["num_layers"])]
    return {**params, "layers": jax.tree_util.tree_map(lambda *x: np.stack(x), *layers)}


@pytest.mark.slow  # (about 14 s; in the extended tier)
def test_microbatches_change_no_loss():
    """The MTP loss is a sum over tokens divided by the batch's tokens, as the trunk's: the
    same step losses in 1 and 4 microbatches (a mean per microbatch would move them)."""
    c = TransformerConfig(**{**TINY, "mtp_loss_weight": 0.5})
    one, four = make_trainer(c), make_trainer(c, microbatches=4)
    state = one.init_state()
    params = jax.device_get(state.params)
    np.testing.assert_allclose(losses_of(four, four.start_from(params)), losses_of(one, state),
                               rtol=1e-5)


@pytest.fixture(scope="module")
def unscanned_on_one_device():
    """(parameters, their losses over 3 steps) unscanned on one device: the reference of
    each case below, compiled once for the module."""
    one = make_trainer(TransformerConfig(**TINY))
    state = one.init_state()
    params = jax.device_get(state.params)
    return params, losses_of(one, state)


@pytest.mark.parametrize("scan, mesh_shape, rules", [
    pytest.param(True, "", "", marks=pytest.mark.slow),
    pytest.param(False, "batch:4;model:2", SPLIT, marks=pytest.mark.slow),
    pytest.param(True, "batch:4;model:2", SPLIT, marks=pytest.mark.slow)])
def test_scanning_and_layouts_change_no_loss(unscanned_on_one_device, scan, mesh_shape, rules):
    """From the same parameters, the same losses and MTP losses over 3 steps as unscanned
    on one device, to the layout-invariance tests' tolerance (test_trainer: float32 sums
    in another order)."""
    c = TransformerConfig(**TINY)
    params, reference = unscanned_on_one_device
    if scan:
        c, params = TransformerConfig(**TINY, scan_layers=True), scanned(params)
    other = make_trainer(c, mesh_shape, rules)
    got = losses_of(other, other.start_from(params))
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    assert all(m > 0 for _, m in got)


@pytest.mark.slow  # (about 6 s; the fast tier trains and checks the loss)
def test_weight_zero_eval_scoring_and_decoding_ignore_the_modules():
    """mtp_loss_weight 0 trains as the model without MTP (same steps, same losses); its
    evaluation sums and token scores (of the trunk's logits) are those of its parameters
    without the ``mtp_`` modules; the decoding cache holds none of theirs."""
    with_mtp = make_trainer(TransformerConfig(**TINY, mtp_loss_weight=0.0))
    plain = make_trainer(TransformerConfig(**{**TINY, "mtp_depth": 0}))
    state = with_mtp.init_state()
    params = nn.unbox(jax.device_get(state.params))
    trunk = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    assert set(params) - set(trunk) == {"mtp_0"}
    other = plain.start_from(trunk)
    batch = packed_batch(3, weights=True)
    results = [[t.eval_step(s.params, t.place_batch(batch)),
                t.token_log_likelihoods(s.params, t.place_batch(batch))]
               for t, s in ((with_mtp, state), (plain, other))]
    jax.tree_util.tree_map(np.testing.assert_array_equal, *results)
    for seed in range(2):  # (two programs: the trunk's sums may fuse differently)
        state, ours = with_mtp.train_step(state, with_mtp.place_batch(packed_batch(seed)))
        other, theirs = plain.train_step(other, plain.place_batch(packed_batch(seed)))
        np.testing.assert_allclose(float(ours["loss"]), float(theirs["loss"]), rtol=1e-6)
        assert float(ours["mtp_loss"]) > 0
    model = DecoderLM(TransformerConfig(**TINY))
    cache = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, L), jnp.int32),
                                              method=model.decode_step))["cache"]
    assert set(cache) == {"decode_index", "layer_0", "layer_1"}


def test_ahead_follows_the_sequence_under_context_parallelism():
    """With ``length`` split, rows lie in `balanced_order`: the value k positions later in
    the sequence is still what `ahead` gives, laid out the same way."""
    x = jnp.arange(2 * L).reshape(2, L) + 1
    order = balanced_order(L, 2)
    layout = Layout("seq:2", "length:seq")
    with layout.activate(layout.make_mesh(jax.devices()[:2])):
        got = ahead(x[:, order], 3)
    np.testing.assert_array_equal(got, ahead(x, 3)[:, order])
    np.testing.assert_array_equal(ahead(x, 3)[:, :L - 3], x[:, 3:])
    assert not ahead(x, 3)[:, L - 3:].any()


def test_settings_are_checked_in_one_line():
    for bad, match in [(dict(mtp_depth=-1), "mtp_depth must be 0"),
                       (dict(mtp_loss_weight=-0.1), "mtp_loss_weight must be 0 or more"),
                       (dict(num_encoder_layers=2), "decoder-only")]:
        with pytest.raises(ValueError, match=match):
            TransformerConfig(**{**TINY, **bad})
    with pytest.raises(ValueError, match="decoder-only LM's"):
        EncoderDecoder(TransformerConfig(**TINY))


def test_the_counts_take_the_modules():
    """analytic_parameters counts every matmul parameter (the modules' too); the FLOPs grow
    by a layer and a head per module."""
    model = DecoderLM(TransformerConfig(**TINY))
    plain = DecoderLM(TransformerConfig(**{**TINY, "mtp_depth": 0}))
    ids = jnp.ones((1, L), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))["params"]
    counted = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(nn.unbox(params))
                  if "scale" not in jax.tree_util.keystr(path))
    assert counted == model.analytic_parameters()
    c, tokens = model.config, B * L
    layer = (plain.analytic_parameters() - 2 * c.vocab_size * c.d_model) // c.num_layers
    extra = 6 * tokens * (2 * c.d_model ** 2 + layer + c.vocab_size * c.d_model) \
        + 12 * L * c.num_heads * c.d_kv * tokens \
        + 9 * (c.num_heads + c.num_kv_heads) * c.d_kv * tokens  # (a rotary layer)
    assert model.analytic_flops(B, L) - plain.analytic_flops(B, L) == pytest.approx(extra)


@pytest.mark.slow  # (about 15 s: the corpus's vocabulary, then two steps)
def test_the_command_line_logs_the_mtp_loss(tmp_path):
    """In-process `main` on the shipped Bible corpus: ``train/mtp_loss`` is logged."""
    from tiny_config import TINY as RUN

    from mtrain.__main__ import main

    model_dir = tmp_path / "mtp"
    assert main(["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin",
                 f"--model_dir={model_dir}",
                 *(f"--gin_param={p}" for p in [
                     *RUN, "transformer.mtp_depth=1", "transformer.mtp_loss_weight=0.5",
                     "run.train_steps=2", "run.log_every=1", "run.eval_every=0",
                     f"run.data_dir='{tmp_path / 'data'}'"])]) == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train/loss" in r]
    assert len(logged) == 2 and all(
        r["train/loss"] > r["train/cross_entropy"] and r["train/mtp_loss"] > 0 for r in logged)
