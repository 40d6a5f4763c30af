"""Mixture of experts (`mtrain/models/moe.py`): routing against a per-token reference
written here, capacity and what it drops, the auxiliary losses against their formulas,
layouts that never change results, expert parallelism that is real (all-to-all in the
compiled step), decoding, and the counts the planner uses.

Tolerances: float32. The layer's one-hot dispatch and combine einsums add exact zeros to
each token's expert outputs, and the reference below sums the same few products in
float64: 1e-5 relative and absolute (values of order 1) leaves two orders of magnitude of
room on any x86 CPU. Layouts: the layout-invariance tests' 1e-5 relative (test_trainer).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import feedforward, layers
from mtrain.models.moe import STATS, MoEConfig, MoeFeedForward, route, summary
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.parallel.layout import Layout, LayoutError

TOL = dict(rtol=1e-5, atol=1e-5)


def _layer(top_k=2, capacity_factor=None, activations=("relu",), experts=4, group=8):
    """A layer of `experts` experts over x [2, 8, 12] (groups of `group`), its parameters
    and x. capacity_factor None: as many slots as a group has tokens (nothing dropped)."""
    m = MoEConfig(num_experts=experts, top_k=top_k, group_size=group,
                  capacity_factor_train=capacity_factor or experts / top_k,
                  capacity_factor_eval=capacity_factor or experts / top_k)
    layer = MoeFeedForward(m, d_ff=16, activations=activations)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 12)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(1), x, True)["params"])
    return layer, params, x


def _reference(params, x, top_k, activations, kept=lambda token, expert: True):
    """Each token through its top_k experts one at a time, weighted by the router's
    probabilities (renormalised over the top_k; top-1: the probability itself), in float64;
    `kept(token, expert)` says which choices capacity left."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    wis = [p["wi"]] if "wi" in p else [p[f"wi_{i}"] for i in range(len(activations))]
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.zeros_like(x)
    for t, token in enumerate(x):
        logits = token @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:top_k]
        gates = probs[top] / (probs[top].sum() if top_k > 1 else 1.0)
        for expert, gate in zip(top, gates):
            if not kept(t, expert):
                continue
            h = 1.0
            for wi, name in zip(wis, activations):
                h = h * np.asarray(feedforward.ACTIVATIONS[name](token @ wi[expert]))
            out[t] += gate * (h @ p["wo"][expert])
    return out.reshape(2, 8, -1)


@pytest.mark.parametrize("top_k,activations", [(1, ("relu",)), (2, ("relu",)),
                                               (2, ("silu", "linear"))])
def test_routing_equals_a_per_token_reference(top_k, activations):
    layer, params, x = _layer(top_k, activations=activations)
    y, stats = layer.apply({"params": params}, x, True, mutable=[STATS])
    np.testing.assert_allclose(y, _reference(params, x, top_k, activations), **TOL)
    assert float(summary(stats[STATS])["dropped_fraction"]) == 0.0


def test_capacity_drops_the_expected_tokens():
    """One slot per expert and group (a row of 8 tokens): each expert keeps the first of
    its choosers, first choices before second ones, then in token order; a token whose
    experts are all taken gets 0, and the dropped fraction counts the choices lost."""
    layer, params, x = _layer(top_k=2, capacity_factor=0.25)  # ceil(2 * 8 * 0.25 / 4) = 1
    logits = np.asarray(x).reshape(16, -1) @ np.asarray(params["router"])
    top = np.argsort(-logits, axis=-1)[:, :2]
    kept = set()
    for row in range(2):
        taken = set()
        for rank in range(2):
            for t in range(row * 8, row * 8 + 8):
                if top[t, rank] not in taken:
                    taken.add(top[t, rank])
                    kept.add((t, top[t, rank]))
    assert len(kept) == 8  # 4 experts x 1 slot x 2 groups
    y, stats = layer.apply({"params": params}, x, False, mutable=[STATS],
                           rngs={"dropout": jax.random.key(0)})
    np.testing.assert_allclose(
        y, _reference(params, x, 2, ("relu",), lambda t, e: (t, e) in kept), **TOL)
    nothing = {t for t in range(16) if not any((t, e) in kept for e in top[t])}
    assert nothing and {t for t in range(16) if not np.any(y.reshape(16, -1)[t])} == nothing
    np.testing.assert_allclose(float(summary(stats[STATS])["dropped_fraction"]),
                               1 - 8 / 32, rtol=1e-6)


def test_padding_is_routed_nowhere():
    layer, params, x = _layer(top_k=2)
    real = jnp.asarray(np.arange(8) < 5)[None].repeat(2, 0)
    y, stats = layer.apply({"params": params}, x, True, real, mutable=[STATS])
    assert not np.any(np.asarray(y)[:, 5:])
    np.testing.assert_allclose(np.asarray(y)[:, :5],
                               _reference(params, x, 2, ("relu",))[:, :5], **TOL)
    # the statistics count the real tokens only: their shares sum to 1
    _, _, alone = route(jnp.zeros((1, 3, 4)).at[0, 2].set(5.0), jnp.array([[1.0, 1, 0]]), 1, 3)
    np.testing.assert_allclose(float(alone["busiest_expert_share"]), 2 / 2)


def test_auxiliary_losses_equal_their_formulas():
    """Switch's load-balancing loss, num_experts x sum_i f_i P_i, and the router z-loss,
    mean(logsumexp(logits)^2), on a router whose numbers are known: three tokens prefer
    expert 0 with probability 3/4, one prefers expert 1 likewise."""
    l3 = np.log(3.0)
    logits = jnp.array([[[l3, 0.0], [l3, 0.0], [l3, 0.0], [0.0, l3]]], jnp.float32)
    _, _, stats = route(logits, jnp.ones((1, 4)), top_k=1, capacity=4)
    f = np.array([3 / 4, 1 / 4])  # the fraction of tokens sent to each expert
    p = np.array([(3 * 0.75 + 0.25) / 4, (3 * 0.25 + 0.75) / 4])  # the mean probabilities
    np.testing.assert_allclose(float(stats["load_balance_loss"]), 2 * np.sum(f * p), rtol=1e-6)
    # Its scale: 1 for a router as balanced in what it sends as in its probabilities (Switch's
    # minimum; lopsided as above, 2 x (3/4 x 5/8 + 1/4 x 3/8) = 1.125).
    even = jnp.array([[[l3, 0.0], [0.0, l3], [l3, 0.0], [0.0, l3]]], jnp.float32)
    _, _, balanced = route(even, jnp.ones((1, 4)), top_k=1, capacity=4)
    np.testing.assert_allclose(float(balanced["load_balance_loss"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(stats["router_z_loss"]), np.log(4.0) ** 2, rtol=1e-6)
    # Per group, averaged over the groups (Mesh-TF's, GShard's): the lopsided group beside
    # its mirror image (expert 1 preferred) is as lopsided as alone, 1.125, where f and P of
    # the whole batch would be even (1.0); a group of padding alone is not counted.
    mirror = logits[..., ::-1]
    padding = jnp.zeros((1, 4, 2))
    _, _, both = route(jnp.concatenate([logits, mirror, padding]),
                       jnp.array([[1.0] * 4, [1.0] * 4, [0.0] * 4]), top_k=1, capacity=4)
    np.testing.assert_allclose(float(both["load_balance_loss"]), 1.125, rtol=1e-6)
    np.testing.assert_allclose(float(stats["busiest_expert_share"]), 3 / 4, rtol=1e-6)
    assert float(stats["dropped_fraction"]) == 0.0
    _, _, tight = route(logits, jnp.ones((1, 4)), top_k=1, capacity=1)
    np.testing.assert_allclose(float(tight["dropped_fraction"]), 2 / 4, rtol=1e-6)


TINY = dict(vocab_size=64, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_layers=2,
            max_length=24, moe_every=2, mlp_activations=("silu", "linear"))


def _no_drops(**kwargs):
    return MoEConfig(num_experts=4, top_k=2, capacity_factor_train=2.0,
                     capacity_factor_eval=2.0, **kwargs)


@pytest.mark.slow  # (pairwise: each stack once, each dispatch once; decoding's own path is
@pytest.mark.parametrize("scan,dispatch", [(True, "capacity"), (False, "dropless")])  # one)
def test_lm_decoding_equals_the_teacher_forced_pass(scan, dispatch):
    """With room for every token (no drops), the experts' layers decode one token at a time
    as the full forward pass computes them (a scanned stack: a group of a dense and an
    expert layer, scanned), by either dispatch (decoding runs dropless whatever the
    dispatch; the layer by each: test_deepseek_experts' per-token reference)."""
    c = TransformerConfig(**{**TINY, "num_layers": 4}, scan_layers=scan,
                          moe=_no_drops(dispatch=dispatch), position_encoding="rotary")
    model = DecoderLM(c)
    tokens = jnp.asarray(np.random.default_rng(7).integers(1, 64, (2, 24)), jnp.int32)
    ids, pos = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(24), tokens.shape)
    params = {"params": model.init(jax.random.key(1), tokens, ids, pos)["params"]}
    forward = model.apply(params, tokens, ids, pos)
    cache = model.init(jax.random.key(0), jnp.zeros((2, 24), jnp.int32),
                       method=DecoderLM.decode_step)["cache"]
    step_fn = jax.jit(lambda cache, ids: model.apply(
        {**params, "cache": cache}, ids, method=DecoderLM.decode_step, mutable=["cache"]))
    out = []
    for step in layers.shift_right(tokens, ids).T:
        logits, variables = step_fn(cache, step[:, None])
        cache = variables["cache"]
        out.append(logits)
    np.testing.assert_allclose(jnp.stack(out, axis=1), forward, **TOL)


def test_configuration_and_counts():
    with pytest.raises(ValueError, match="moe.top_k=3 must be between 1 and moe.num_experts=2"):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"scans groups of 2 layers \(moe_every=2, 0 "
                       r"attention_windows\): that must divide"):
        TransformerConfig(**{**TINY, "num_layers": 3}, scan_layers=True)
    from mtrain import config

    config.parse([], ["moe.num_experts=4"])  # (gin at the edge: settings without experts)
    with pytest.raises(ValueError, match="moe.num_experts is set, but transformer.moe_every "
                                         "is 0: no layer has experts"):
        config.model_config(128)
    config.parse([], [])
    c = TransformerConfig(**TINY, moe=MoEConfig(num_experts=8, top_k=2, expert_d_ff=48))
    assert c.moe.expert_d_ff == 48 and TransformerConfig(**TINY).moe.expert_d_ff == 64
    assert TransformerConfig(**{**TINY, "moe_every": 0}, moe=MoEConfig()).moe is None
    from mtrain.models.base import shape_fields

    fields = shape_fields(c)
    assert fields["moe.num_experts"] == 8 and fields["moe_every"] == 2
    assert "moe.group_size" not in fields and "moe.num_experts" not in shape_fields(
        TransformerConfig())
    # parameters: all experts; FLOPs: the top_k a token goes through, and the router
    model = DecoderLM(c)
    ids = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))["params"])
    matmuls = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                  if x.ndim >= 2 and "position" not in jax.tree_util.keystr(path))
    assert model.analytic_parameters() == matmuls
    expert = 3 * 32 * 48
    assert model.analytic_parameters() - model.active_parameters() == 6 * expert
    dense = DecoderLM(TransformerConfig(**{**TINY, "moe_every": 0}))
    tokens = 8 * 16
    assert model.analytic_flops(8, 16) - dense.analytic_flops(8, 16) == pytest.approx(
        6 * tokens * (2 * expert + 32 * 8 - 3 * 32 * 64))
    # The encoder-decoder has experts in both stacks.
    ed = EncoderDecoder(TransformerConfig(**{**TINY, "moe_every": 1}, moe=MoEConfig(num_experts=2)))
    ids = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(jax.eval_shape(lambda: ed.init(jax.random.key(0), *[ids] * 6))["params"])
    assert params["encoder_0"]["mlp"]["wi_0"].shape == (2, 32, 64)
    assert params["decoder_1"]["mlp"]["wo"].shape == (2, 64, 32)


def test_experts_claim_their_mesh_dimension_and_must_divide_it():
    layout = Layout("batch:4;model:2", "batch:batch;experts:batch;d_ff:model")
    assert tuple(layout.partition_spec(("experts", "batch", "expert_capacity", "d_model"))) == (
        "batch", None, None, None)
    assert tuple(layout.partition_spec(("experts", "d_model", "d_ff"))) == ("batch", None, "model")
    layout = Layout("model:8", "experts:model;d_ff:model")
    assert tuple(layout.partition_spec(("experts", "d_model", "d_ff"))) == ("model", None, None)
    with pytest.raises(LayoutError, match="dimension 'experts' of size 8 is not divisible by "
                                          "mesh dimension 'batch' of size 16"):
        Layout("batch:16", "batch:batch;experts:batch").partition_spec(
            ("experts", "d_model", "d_ff"), (8, 32, 64), tensor="wi")
    # other tensors keep Mesh-TF's rule: two dimensions on one mesh dimension is an error
    with pytest.raises(LayoutError, match="both split over mesh dimension 'model'"):
        Layout("model:2", "d_ff:model;heads:model").partition_spec(("heads", "d_ff"))


# --- layouts never change results; expert parallelism is real --------------------------

MOE_LAYOUTS = [  # (mesh shape, layout rules, parameter layout rules); experts:batch alone
    ("", "", ""),  # ("batch:8"): FSDP's below has its all-to-all, and test_deepseek_experts's
    ("model:8", "experts:model;d_ff:model;heads:model", ""),  # train steps run it
    ("batch:4;model:2", "batch:batch;experts:batch;d_ff:model", "d_model:batch"),  # FSDP
    ("batch:8", "batch:batch", ""),  # experts replicated
]


@pytest.mark.slow
def test_moe_tiny_trains_alike_on_every_layout_and_dispatches_by_all_to_all():
    """`moe_tiny` (two layers, one with experts) trains 2 steps with the same losses on one
    device and on 8 with the experts split over `model`, and over `batch` beside `d_ff:model`
    under FSDP's parameter rules. With `experts:batch` the compiled step dispatches by
    all-to-all and never gathers an expert weight whole, FSDP's rules included (its
    `d_model:batch` yields to `experts:batch`); with the experts replicated it has no
    all-to-all. The
    training loss is the cross-entropy plus the weighted auxiliary losses."""
    import test_trainer
    from mtrain import config
    from mtrain.planning.hlo_cost import hlo_cost
    from mtrain.training.language_modeling import LanguageModeling
    from mtrain.training.losses import LossConfig
    from mtrain.training.trainer import Trainer

    config.parse(["models/moe_tiny.gin"], ["transformer.num_layers=2", "transformer.max_length=16",
                                           "learning_rate_schedule.warmup_steps=2",
                                           "moe.group_size=16"])
    model_config = config.model_config(test_trainer.CONFIG.vocab_size)
    assert (model_config.moe.num_experts, model_config.moe.top_k) == (8, 2)
    opt = config.adamw(config.learning_rate_schedule(train_steps=10))
    batches = test_trainer.packed_batches(1) * 2
    e, d, f = 8, model_config.d_model, model_config.moe.expert_d_ff
    whole = {(e, d, f), (e, f, d)}
    results = []
    for mesh_shape, rules, parameter_rules in MOE_LAYOUTS:
        layout = Layout(mesh_shape, rules, parameter_rules)
        trainer = Trainer(model=DecoderLM(model_config), optimizer=opt, layout=layout,
                          mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=8,
                          sequence_length=16, seed=1,
                          objective=LanguageModeling(LossConfig(z_loss=0.0)))
        state, losses = trainer.init_state(), []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.place_batch(batch))
            losses.append(float(metrics["loss"]))
        results.append(losses)
        m = {k: float(v) for k, v in metrics.items()}
        np.testing.assert_allclose(m["loss"] - m["cross_entropy"], 0.01 * m["load_balance_loss"]
                                   + 0.001 * m["router_z_loss"], rtol=1e-3)
        assert 0 <= m["dropped_fraction"] < 0.5 and 1 / 8 <= m["busiest_expert_share"] <= 1
        if mesh_shape.startswith("batch"):
            cost = hlo_cost(trainer.compile_train_step().as_text(), layout.size, whole)
            gathered = cost.collectives["all-gather"].parameter_shaped_bytes
            if "experts:batch" in rules:
                assert cost.collectives["all-to-all"].count >= 4, rules  # 2 forward, 2 back
                assert gathered == 0, rules
            else:
                assert cost.collectives["all-to-all"].count == 0
    assert results[0][-1] < results[0][0]
    for (mesh_shape, rules, parameter_rules), losses in zip(MOE_LAYOUTS[1:], results[1:]):
        np.testing.assert_allclose(losses, results[0], rtol=1e-5,
                                   err_msg=f"{mesh_shape} {rules} {parameter_rules}")


@pytest.mark.slow
def test_encoder_decoder_experts_decode_and_accumulate_microbatches():
    """Both stacks of the encoder-decoder have experts: with room for every token, decoding
    one token at a time gives the teacher-forced logits (packed inputs: the padding is
    routed nowhere); and a step accumulated over 2 microbatches computes the cross-entropy
    of the whole batch's (the same routing: groups lie in rows) and the experts' statistics
    (each microbatch's, weighted by its tokens)."""
    import test_encoder_decoder
    import optax
    from mtrain.training.trainer import Trainer

    c = TransformerConfig(**{**TINY, "moe_every": 1}, moe=_no_drops(), position_encoding="relative_bias")
    model = EncoderDecoder(c)
    rng = np.random.default_rng(8)
    inputs = [jnp.asarray(a)[None] for a in (np.r_[rng.integers(1, 64, 15), [0] * 9],
                                              np.r_[[1] * 15, [0] * 9], np.r_[np.arange(15), [0] * 9])]
    targets = [jnp.asarray(a)[None] for a in (rng.integers(1, 64, 24), np.ones(24, int),
                                               np.arange(24))]
    params = {"params": model.init(jax.random.key(2), *inputs, *targets)["params"]}
    forward = model.apply(params, *inputs, *targets)
    encoded = model.apply(params, *inputs, method=EncoderDecoder.encode)
    cache = model.init(jax.random.key(0), encoded, inputs[1], jnp.zeros((1, 24), jnp.int32),
                       method=EncoderDecoder.decode_step)["cache"]
    step_fn = jax.jit(lambda cache, ids: model.apply(
        {**params, "cache": cache}, encoded, inputs[1], ids, method=EncoderDecoder.decode_step,
        mutable=["cache"]))
    for i, ids in enumerate(layers.shift_right(targets[0], targets[1]).T):
        logits, variables = step_fn(cache, ids[:, None])
        cache = variables["cache"]
        np.testing.assert_allclose(logits, forward[:, i], **TOL, err_msg=f"position {i}")

    config = TransformerConfig(**{**TINY, "moe_every": 2, "vocab_size": 128},
                               moe=MoEConfig(num_experts=4, group_size=8))
    batch = test_encoder_decoder.packed_pairs(1)[0]
    metrics = []
    for k in (1, 2):
        layout = Layout()
        trainer = Trainer(model=EncoderDecoder(config), optimizer=optax.sgd(0.1), layout=layout,
                          mesh=layout.make_mesh( jax.devices()[:1]), batch_size=8,
                          sequence_length=16, num_microbatches=k)
        metrics.append(trainer.train_step(trainer.init_state(), trainer.place_batch(batch))[1])
    np.testing.assert_allclose(metrics[1]["cross_entropy"], metrics[0]["cross_entropy"],
                               rtol=1e-5)
    for m in metrics:
        assert 0 < float(m["dropped_fraction"]) < 1  # (the capacity of training: 1.25)
        assert float(m["loss"]) > float(m["cross_entropy"]) and float(m["router_z_loss"]) > 0
