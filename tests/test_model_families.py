"""The blocks of today's Transformers, each against a formula written out here: rotary
positions (RoPE), T5's relative position buckets, grouped-query attention (on the einsum
path and on the flash kernels), gated feed-forward layers, and incremental decoding of
models built from them.

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
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
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
@pytest.mark.parametrize("kernel, g", [("splash", 1), ("splash", 2), ("splash", 4),
                                       ("triton", 2)])
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
