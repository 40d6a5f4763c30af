"""Models built of today's blocks (their formulas: test_blocks): a packed example computed
as if alone, incremental decoding equal to the teacher-forced pass, the presets alike on
every layout, and the other attention paths and speed levers taking the new blocks.

Tolerances: float32 throughout. Outputs that go through the same matmuls in another order
(a reshape of the heads, a rotation in complex numbers) agree to a few ulps of values of
order 1; 1e-5 relative and absolute leaves two orders of magnitude of room on any x86 CPU.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import layers
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.parallel.layout import Layout

from test_flash_attention import TOL


# --- whole models ---------------------------------------------------------------------------

TINY = dict(vocab_size=64, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_layers=2, max_length=24)
FAMILIES = {
    "rotary_gqa": dict(position_encoding="rotary", num_kv_heads=1,
                       mlp_activations=("silu", "linear")),
    "relative": dict(position_encoding="relative_bias", num_kv_heads=2,
                     mlp_activations=("gelu", "linear")),
}


def _row(*examples, length=24):
    """A packed row of `examples` (token lists): tokens, segment ids, positions [1, length]."""
    tokens, ids, pos = np.zeros((3, 1, length), np.int32)
    at = 0
    for s, example in enumerate(examples):
        n = len(example)
        tokens[0, at:at + n], ids[0, at:at + n], pos[0, at:at + n] = example, s + 1, range(n)
        at += n
    return jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(pos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("model_class", [DecoderLM, EncoderDecoder])
def test_a_packed_example_is_computed_as_if_alone(family, model_class):
    c = TransformerConfig(**TINY, **FAMILIES[family])
    rng = np.random.default_rng(6)
    first, second = rng.integers(1, 64, 9), rng.integers(1, 64, 11)
    packed, alone = _row(first, second), _row(second)
    model = model_class(c)
    args = (lambda row: row) if model_class is DecoderLM else (lambda row: (*row, *row))
    params = model.init(jax.random.key(0), *args(packed))
    assert not any("position_embedding" in k for k in params["params"])
    out_packed = model.apply(params, *args(packed))[0, 9:20]
    out_alone = model.apply(params, *args(alone))[0, :11]
    np.testing.assert_allclose(out_packed, out_alone, **TOL)


def _lm_decoded(model, params, tokens):
    """Logits of feeding `tokens` [n, l] one at a time through `decode_step`."""
    cache = model.init(jax.random.key(0), jnp.zeros((tokens.shape[0], 24), jnp.int32),
                       method=DecoderLM.decode_step)["cache"]
    out = []
    for i in range(tokens.shape[1]):
        logits, variables = model.apply({**params, "cache": cache}, tokens[:, i:i + 1],
                                        method=DecoderLM.decode_step, mutable=["cache"])
        cache = variables["cache"]
        out.append(logits)
    return jnp.stack(out, axis=1), cache


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lm_decoding_equals_the_teacher_forced_pass(scan):
    """A rotary, grouped-query decoder: the logits of incremental decoding at every position
    equal those of the full forward pass; its cache holds num_kv_heads = num_heads / 4
    heads, a quarter of full attention's."""
    c = TransformerConfig(**{**TINY, "num_heads": 8, "d_kv": 4}, scan_layers=scan,
                          position_encoding="rotary", num_kv_heads=2,
                          mlp_activations=("silu", "linear"))
    tokens, ids, pos = _row(np.random.default_rng(7).integers(1, 64, 24))
    model = DecoderLM(c)
    params = model.init(jax.random.key(1), tokens, ids, pos)
    forward = model.apply(params, tokens, ids, pos)
    decoded, cache = _lm_decoded(model, params, layers.shift_right(tokens, ids))
    np.testing.assert_allclose(decoded, forward, **TOL)
    keys = [x for path, x in jax.tree_util.tree_leaves_with_path(cache)
            if "cached_key" in jax.tree_util.keystr(path)]
    full = DecoderLM(c.__class__(**{**c.__dict__, "num_kv_heads": 8}))
    full_cache = jax.eval_shape(lambda: full.init(jax.random.key(0), jnp.zeros((1, 24), jnp.int32),
                                                  method=DecoderLM.decode_step)["cache"])
    size = sum(x.size for x in jax.tree.leaves(cache))
    full_size = sum(x.size for x in jax.tree.leaves(full_cache))
    assert keys and all(k.shape[-2] == 2 for k in keys)
    assert (size - 1) * 4 == full_size - 1  # (less the index, a scalar)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encoder_decoder_decoding_equals_the_teacher_forced_pass(family):
    c = TransformerConfig(**TINY, **FAMILIES[family])
    rng = np.random.default_rng(8)
    inputs, targets = _row(rng.integers(1, 64, 15)), _row(rng.integers(1, 64, 24))
    model = EncoderDecoder(c)
    params = model.init(jax.random.key(2), *inputs, *targets)
    forward = model.apply(params, *inputs, *targets)
    encoded = model.apply(params, *inputs, method=EncoderDecoder.encode)
    cache = model.init(jax.random.key(0), encoded, inputs[1], jnp.zeros((1, 24), jnp.int32),
                       method=EncoderDecoder.decode_step)["cache"]
    shifted = layers.shift_right(targets[0], targets[1])
    for i in range(24):
        logits, variables = model.apply({**params, "cache": cache}, encoded, inputs[1],
                                        shifted[:, i:i + 1], method=EncoderDecoder.decode_step,
                                        mutable=["cache"])
        cache = variables["cache"]
        np.testing.assert_allclose(logits, forward[:, i], **TOL, err_msg=f"position {i}")


def test_configuration_errors():
    for bad, says in ((dict(num_kv_heads=3), "must divide"),
                      (dict(mlp_activations=("swish",)), "mlp_activations"),
                      (dict(position_encoding="alibi"), "position_encoding"),
                      (dict(position_encoding="relative_bias", attention="flash"), "no flash")):
        with pytest.raises(ValueError, match=says):
            TransformerConfig(**{**TINY, **bad})


# --- the presets on every layout ------------------------------------------------------------

# (mesh shape, layout rules) per preset: one device and the splits whose paths differ for it
# (batch:8 alone is batch:4;model:2's batch split; GQA's kv heads whole under query heads over
# model:2 is model:8's path; T5.1.1's heads, bias, d_ff, vocab and batch split at once).
PRESET_LAYOUTS = {DecoderLM: [("", ""), ("model:8", "d_ff:model;heads:model;vocab:model"),
                              ("batch:4;model:2",
                               "batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model")],
                  EncoderDecoder: [("", ""), ("batch:4;model:2",
                                               "batch:batch;d_ff:model;heads:model;vocab:model")]}


def _preset(gin_file, vocab_size):
    """The preset's model (one layer, 16 positions) and optimizer."""
    from mtrain import config

    config.parse([gin_file], ["transformer.num_layers=1", "transformer.max_length=16",
                              "transformer.dropout_rate=0.0",
                              "learning_rate_schedule.warmup_steps=2"])
    model_config = config.transformer(vocab_size=vocab_size)
    schedule = config.learning_rate_schedule(train_steps=10)
    make = config.run_config().optimizer or config.adafactor
    return model_config, make(schedule)


@pytest.mark.parametrize("gin_file,model_class", [("models/llama_tiny.gin", DecoderLM),
                                                  ("models/t5_1_1_tiny.gin", EncoderDecoder)])
@pytest.mark.slow
def test_presets_train_alike_on_every_layout(gin_file, model_class):
    import test_encoder_decoder
    import test_trainer
    from mtrain.training.trainer import Trainer

    tests = test_trainer if model_class is DecoderLM else test_encoder_decoder
    model_config, opt = _preset(gin_file, tests.CONFIG.vocab_size)  # (the batches' ids)
    if model_class is DecoderLM:
        assert (model_config.num_kv_heads, model_config.position_encoding) == (2, "rotary")
        batches = test_trainer.packed_batches(1) * 3  # one batch, learned
    else:
        assert model_config.position_encoding == "relative_bias"
        batches = test_encoder_decoder.packed_pairs(1) * 3
    results = []
    grouped = model_config.num_kv_heads < model_config.num_heads
    layouts = PRESET_LAYOUTS[model_class]
    for mesh_shape, rules in layouts:
        # (a rule for a dimension the model does not have is a layout error)
        assert grouped or "kv_heads" not in rules
        layout = Layout(mesh_shape, rules)
        trainer = Trainer(model=model_class(model_config), optimizer=opt, layout=layout,
                          mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=8,
                          sequence_length=16, seed=1)
        state, losses = trainer.init_state(), []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.place_batch(batch))
            losses.append(float(metrics["loss"]))
        results.append(losses)
    assert results[0][-1] < results[0][0]
    for (mesh_shape, rules), losses in zip(layouts[1:], results[1:]):
        # (the layout-invariance tests' tolerance: test_trainer)
        np.testing.assert_allclose(losses, results[0], rtol=1e-5, err_msg=f"{mesh_shape} {rules}")


def test_analytic_parameters_count_the_matrices():
    """analytic_parameters() is the count of the matmul and embedding parameters: every leaf
    but the norms' scales and the relative bias tables."""
    for extra in (FAMILIES["rotary_gqa"], FAMILIES["relative"], {}):
        c = TransformerConfig(**TINY, **extra)
        for model_class in (DecoderLM, EncoderDecoder):
            model = model_class(c)
            row = _row([1, 2, 3])
            args = row if model_class is DecoderLM else (*row, *row)
            params = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
            counted = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(
                nn.unbox(params)) if not any(n in jax.tree_util.keystr(path) for n in
                                            ("scale", "relative_bias", "position_embedding")))
            assert counted == model.analytic_parameters(), (extra, model_class.__name__)


# --- the other attention paths take the new blocks -------------------------------------------

NEW_BLOCKS = dict(vocab_size=256, d_model=32, d_ff=64, num_heads=8, d_kv=4, num_layers=2,
                  max_length=16, position_encoding="rotary", num_kv_heads=2,
                  mlp_activations=("silu", "linear"))


@pytest.mark.slow
def test_flash_trains_the_new_blocks_like_einsum(model_class=EncoderDecoder):
    """Rotary positions and 2 of 8 key/value heads, on a mesh that splits the query heads and
    keeps the key/value heads whole: splash (interpreted on this CPU) and einsum train
    alike (the layout-invariance tests' tolerance); the encoder-decoder's self, causal and
    cross attention (the LM's: test_the_speed_levers_and_sgp_take_the_new_blocks)."""
    from test_flash_attention import _losses

    flash = TransformerConfig(**NEW_BLOCKS, attention="flash", flash_kernel="splash")
    einsum = TransformerConfig(**NEW_BLOCKS, attention="einsum")
    rules = "batch:batch;heads:model;d_ff:model;vocab:model"
    np.testing.assert_allclose(_losses(flash, "batch:4;model:2", rules, model=model_class),
                               _losses(einsum, "", "", model=model_class), rtol=1e-5)


@pytest.mark.parametrize("encoding", ["rotary", "relative_bias"])
def test_dot_product_path_takes_grouped_heads_and_the_bias(encoding):
    c = TransformerConfig(**{**NEW_BLOCKS, "position_encoding": encoding})
    row = _row(np.arange(1, 10), np.arange(20, 27), length=16)
    outputs = []
    for path in ("einsum", "dot_product"):
        model = DecoderLM(TransformerConfig(**{**c.__dict__, "attention": path}))
        params = model.init(jax.random.key(0), *row)
        outputs.append(model.apply(params, *row) * (row[1] > 0)[..., None])
    np.testing.assert_allclose(outputs[1], outputs[0], **TOL)


def test_a_kv_heads_split_that_does_not_divide_names_the_tensor():
    from mtrain.parallel.layout import LayoutError
    from mtrain.training import optimizer
    from mtrain.training.trainer import Trainer

    layout = Layout("model:8", "heads:model;kv_heads:model")
    with pytest.raises(LayoutError, match=r"parameter k \('d_model', 'kv_heads', 'd_kv'\): "
                                          r"dimension 'kv_heads' of size 2 is not divisible"):
        Trainer(model=DecoderLM(TransformerConfig(**NEW_BLOCKS)),
                optimizer=optimizer.adafactor(1e-3), layout=layout,
                mesh=layout.make_mesh(jax.devices()), batch_size=8, sequence_length=16)


@pytest.mark.slow
def test_the_speed_levers_and_sgp_take_the_new_blocks():
    """Rotary positions, 2 of 8 key/value heads and SwiGLU under the speed levers at once:
    scanned layers, remat 'dots', splash attention, 2 microbatches and FSDP parameter rules
    train as the plain einsum model does (the invariance tests' tolerance); in bfloat16
    within 2% (8 mantissa bits: ~0.4% per rounding, a loss of a 2-layer model after 3 steps
    stays within a few of them); SGP's replicas train as all-reduce does.""" 
    import dataclasses

    import test_trainer
    from mtrain.training.sgp import SGPTrainer

    plain = TransformerConfig(**NEW_BLOCKS, scan_layers=True)  # (scanning changes the init)
    levers = dataclasses.replace(plain, remat_policy="dots", attention="flash",
                                 flash_kernel="splash")
    mesh, rules = "batch:4;model:2", "batch:batch;heads:model;d_ff:model;vocab:model"
    reference, _ = test_trainer.train("", "", config=plain)
    losses, _ = test_trainer.train(mesh, rules, "d_model:batch", config=levers,
                                   num_microbatches=2)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    bf16, _ = test_trainer.train(mesh, rules, config=dataclasses.replace(
        plain, activation_dtype="bfloat16"))
    np.testing.assert_allclose(bf16, reference, rtol=2e-2)

    trainer = test_trainer.make_trainer("batch:8", "batch:batch", TransformerConfig(**NEW_BLOCKS))
    state = trainer.init_state()
    batch = trainer.place_batch(test_trainer.packed_batches(1)[0])
    sgp = SGPTrainer(trainer)
    sgp_state, gossip, all_reduce = sgp.init_state(state), [], []
    for _ in range(3):  # one batch, learned
        sgp_state, metrics = sgp.train_step(sgp_state, batch)
        gossip.append(float(metrics["loss"]))
        state, metrics = trainer.train_step(state, batch)
        all_reduce.append(float(metrics["loss"]))
    # The first step's loss, from the same parameters on every replica: each replica's is
    # the mean over its own rows' tokens and SGP reports the mean of those, not the mean
    # over all tokens (0.1% apart here); then the replicas step apart from all-reduce (their
    # own gradients, one peer's mixing) and learn the batch as it does.
    np.testing.assert_allclose(gossip[0], all_reduce[0], rtol=1e-2)
    assert gossip[2] < gossip[1] < gossip[0] and abs(gossip[2] / all_reduce[2] - 1) < 0.05
