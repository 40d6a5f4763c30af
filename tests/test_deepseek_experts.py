"""DeepSeek-V3's experts as settings of the mixture of experts (`moe`, `routing`, `balancing`):
sigmoid routing with a choice bias, groups and scaling against transformers' algorithm written
here in numpy; the layer (routed and shared experts) against a per-token reference by either
dispatch and each grouped kernel; every expert layout; the first dense layers, scanned and
not; and the auxiliary-loss-free balancing that moves the choice bias after each step and
nothing else does.

Tolerances: test_moe's (float32 against a float64 reference: 1e-5) and test_trainer's for
layouts (1e-5 relative).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrain.models import parameters, routing
from mtrain.models.moe import STATS, MoEConfig, MoeFeedForward, summary
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training.trainer import Trainer

TOL = dict(rtol=1e-5, atol=1e-5)
# 8 experts in 4 groups of 2, the best 2 groups kept, top-2 (the oracle's routing)
DEEPSEEK = MoEConfig(num_experts=8, top_k=2, group_size=8, capacity_factor_train=4.0,
                     capacity_factor_eval=4.0, router_scoring="sigmoid", choice_bias=True,
                     num_groups=4, top_groups=2, routed_scaling=2.5, normalize_top_k=True,
                     num_shared_experts=1)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hf_deepseek_route(logits, bias, n_group, topk_group, top_k, norm_topk_prob, scaling):
    """transformers' DeepseekV3 routing (noaux_tc) of `logits` [tokens, experts], in numpy:
    (indices, weights) [tokens, top_k]."""
    scores = sigmoid(np.asarray(logits, np.float64))
    choice = scores + bias
    t, e = choice.shape
    group_scores = np.sort(choice.reshape(t, n_group, e // n_group), -1)[..., -2:].sum(-1)
    groups = np.argsort(-group_scores, -1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), bool)
    mask[np.arange(t)[:, None], groups] = True
    masked = np.where(np.repeat(mask, e // n_group, -1), choice, 0.0)  # (masked_fill 0.0)
    index = np.argsort(-masked, -1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, index, -1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return index, weights * scaling


def by_expert(index, weights):
    """Each token's {expert: weight} (the order of a token's choices is no part of them)."""
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(index, weights)]


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_equals_transformers_algorithm(normalize):
    """Sigmoid scores, the bias for the choice alone, 4 groups of 2 (the best 2 kept), top-2,
    the weights the unbiased scores (renormalised or not) x 2.5: the choices and weights of
    transformers' algorithm; the bias and the groups each change some choices here."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    bias = (0.1 * rng.normal(size=8)).astype(np.float32)
    r = routing.Routing(top_k=2, normalize=normalize, scoring="sigmoid", num_groups=4,
                        top_groups=2, scaling=2.5)
    _, gates, index, _ = routing.choose(jnp.asarray(logits)[None], jnp.ones((1, 64)), r,
                                        jnp.asarray(bias))
    theirs = hf_deepseek_route(logits, bias, 4, 2, 2, normalize, 2.5)
    ours, expected = by_expert(index[0], gates[0]), by_expert(*theirs)
    for token, (a, b) in enumerate(zip(ours, expected)):
        assert a.keys() == b.keys(), token
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)],
                                   rtol=1e-6, err_msg=str(token))
    plain = hf_deepseek_route(logits, 0 * bias, 4, 2, 2, normalize, 2.5)[0]
    ungrouped = hf_deepseek_route(logits, bias, 1, 1, 2, normalize, 2.5)[0]
    assert any(set(a) != set(b) for a, b in zip(theirs[0], plain))
    assert any(set(a) != set(b) for a, b in zip(theirs[0], ungrouped))
    if normalize:  # (renormalised: the weights of each token sum to the scaling)
        np.testing.assert_allclose(np.asarray(gates).sum(-1), 2.5, rtol=1e-6)


def as_float64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


ACT = {"silu": lambda x: x * sigmoid(x), "linear": lambda x: x}


def expert_reference(p, token, expert, activations, act=ACT):
    """One expert's output of `token` (float64), with its biases where it has them."""
    h = 1.0
    for i, name in enumerate(activations):
        pre = token @ p[f"wi_{i}"][expert] + (p[f"wi_{i}_bias"][expert] if "wo_bias" in p else 0)
        h = h * act[name](pre)
    return h @ p["wo"][expert] + (p["wo_bias"][expert] if "wo_bias" in p else 0)


def shared_reference(p, x, activations, act=ACT):
    h = 1.0
    for i, name in enumerate(activations):
        h = h * act[name](x @ p["shared"][f"wi_{i}"])
    return h @ p["shared"]["wo"]


def deepseek_reference(params, x, m: MoEConfig, activations=("silu", "linear")):
    """Each token through its routed experts (transformers' routing) and the shared ones."""
    p = as_float64(params)
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    index, weights = hf_deepseek_route(tokens @ p["router"], p["choice_bias"], m.num_groups,
                                       m.top_groups, m.top_k, m.normalize_top_k,
                                       m.routed_scaling)
    out = shared_reference(p, tokens, activations)
    for t, token in enumerate(tokens):
        for expert, w in zip(index[t], weights[t]):
            out[t] += w * expert_reference(p, token, expert, activations)
    return out.reshape(x.shape)


def layer_and_params(m: MoEConfig, activations=("silu", "linear"), clamp=None, seed=0):
    """The layer over x [2, 8, 16] and its parameters, every bias drawn (not its zeros)."""
    layer = MoeFeedForward(m, d_ff=16, activations=activations, clamp=clamp)
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, 8, 16)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(1), x, True)["params"])
    rng = np.random.default_rng(seed + 1)
    params = {k: (jnp.asarray(0.5 * rng.normal(size=v.shape), jnp.float32)
                  if k.endswith("bias") else v) for k, v in params.items()}
    if "choice_bias" in params:  # (the oracle's: N(0, 0.1^2))
        params["choice_bias"] = params["choice_bias"] / 5
    return layer, params, x


def dispatches(m: MoEConfig, megablox_slow=True):
    """(config, decoding) of each path: capacity, its decoding (the dropless path whatever
    the dispatch), dropless on the CPU's kernel and on Megablox (in Pallas's interpreter)."""
    marks = [pytest.mark.slow] if megablox_slow else []
    return [pytest.param(m, False, id="capacity"), pytest.param(m, True, id="decoding"),
            pytest.param(dataclasses.replace(m, dispatch="dropless"), False, id="dropless"),
            pytest.param(dataclasses.replace(m, dispatch="dropless", grouped_kernel="megablox"),
                         False, marks=marks, id="megablox")]


@pytest.mark.parametrize("m,decoding", dispatches(DEEPSEEK))
def test_the_layer_equals_a_per_token_reference(m, decoding):
    """Routed experts (a slot for every token: nothing dropped) and the shared expert, by
    either dispatch, decoding's path and the dropless kernels; padding takes the shared
    expert alone; the loads count every real token's top_k choices."""
    layer, params, x = layer_and_params(m)
    assert params["shared"]["wi_0"].shape == (16, 16) and params["choice_bias"].shape == (8,)
    real = jnp.ones((2, 8)).at[1, 6:].set(0)
    y, stats = jax.jit(lambda p, x: layer.apply({"params": p}, x, True, real, decoding,
                                                mutable=[STATS]))(params, x)
    expected = deepseek_reference(params, x, m)
    np.testing.assert_allclose(y[0], expected[0], **TOL)
    np.testing.assert_allclose(y[1, :6], expected[1, :6], **TOL)
    p = as_float64(params)
    np.testing.assert_allclose(y[1, 6:], shared_reference(p, np.asarray(x[1, 6:], np.float64),
                                                          ("silu", "linear")), **TOL)
    metrics = summary(stats[STATS])
    assert float(metrics["dropped_fraction"]) == 0.0
    # each real token's top_k choices, counted (8 + 6 real tokens)
    np.testing.assert_allclose(float(metrics["expert_load/"].sum()), 14 * m.top_k, rtol=1e-6)


@pytest.mark.slow  # (the layer's decoding path: test_the_layer_equals_a_per_token_reference)
def test_decoding_equals_the_teacher_forced_pass():
    """The first dense layer, then experts with shared ones, decoded a token at a time
    (dropless, whatever the dispatch) as the full pass computes them (room for every token)."""
    c = config(num_layers=2)
    model = DecoderLM(c)
    tokens = jnp.asarray(np.random.default_rng(7).integers(1, 64, (2, 8)), jnp.int32)
    ids, pos = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(8), tokens.shape)
    params = {"params": jax.jit(model.init)(jax.random.key(1), tokens, ids, pos)["params"]}
    forward = jax.jit(model.apply)(params, tokens, ids, pos)
    cache = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32),
                                              method=DecoderLM.decode_step))["cache"]
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache)
    step_fn = jax.jit(lambda cache, ids: model.apply(
        {**params, "cache": cache}, ids, method=DecoderLM.decode_step, mutable=["cache"]))
    from mtrain.models import layers

    out = []
    for step in layers.shift_right(tokens, ids).T:
        logits, variables = step_fn(cache, step[:, None])
        cache = variables["cache"]
        out.append(logits)
    np.testing.assert_allclose(jnp.stack(out, axis=1), forward, **TOL)


# --- models: the first dense layers, layouts ----------------------------------------------

def config(moe=DEEPSEEK, **kwargs) -> TransformerConfig:
    """A tiny DeepSeek-V3: the first layer dense, experts in the others."""
    settings = dict(vocab_size=256, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_layers=3,
                    max_length=16, moe_every=1, first_dense_layers=1,
                    mlp_activations=("silu", "linear"), position_encoding="rotary",
                    moe=moe and dataclasses.replace(moe, expert_d_ff=16, group_size=16))
    return TransformerConfig(**{**settings, **kwargs})


def test_first_dense_layers_scanned_and_not():
    """The first k layers dense (d_ff), experts after them (every moe_every counted from
    k); scanned, ``dense_layers`` then ``layers`` stacked, the same logits; the checks."""
    c = config(num_layers=3, first_dense_layers=1, moe_every=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 256, (2, 16)), jnp.int32)
    ids, pos = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(16), tokens.shape)
    init = lambda model: nn.unbox(jax.jit(model.init)(  # noqa: E731
        jax.random.key(0), tokens, ids, pos)["params"])
    plain = init(DecoderLM(c))
    assert [("router" in plain[f"layer_{i}"]["mlp"]) for i in range(3)] == [False] * 2 + [True]
    assert plain["layer_0"]["mlp"]["wi_0"].shape == (32, 64)
    scanned_model = DecoderLM(dataclasses.replace(c, scan_layers=True))
    scanned = nn.unbox(jax.eval_shape(scanned_model.init, jax.random.key(0), tokens, ids,
                                      pos)["params"])
    assert scanned["dense_layers"]["mlp"]["wi_0"].shape == (1, 32, 64)
    assert scanned["layers"]["layer_0"]["mlp"]["wi_0"].shape == (1, 32, 64)
    assert scanned["layers"]["layer_1"]["mlp"]["wo"].shape == (1, 8, 16, 32)
    stack = lambda *layers: jax.tree.map(lambda *a: jnp.stack(a), *layers)  # noqa: E731
    restacked = {**{k: v for k, v in plain.items() if not k.startswith("layer_")},
                 "dense_layers": stack(plain["layer_0"]),
                 "layers": {"layer_0": stack(plain["layer_1"]),
                            "layer_1": stack(plain["layer_2"])}}
    assert jax.tree.map(jnp.shape, restacked) == jax.tree.map(jnp.shape, scanned)
    apply = lambda model, p: jax.jit(model.apply)({"params": p}, tokens, ids, pos)  # noqa: E731
    np.testing.assert_allclose(apply(scanned_model, restacked), apply(DecoderLM(c), plain),
                               **TOL)
    for kwargs, message in [
            (dict(moe_every=0, moe=None), "first_dense_layers=1 keeps the first layers dense"),
            (dict(first_dense_layers=3), "must be 0 or more and leave a layer"),
            (dict(num_layers=4, moe_every=2, scan_layers=True), "less first_dense_layers=1")]:
        with pytest.raises(ValueError, match=message):
            config(**kwargs)


def trainer(c, mesh="", rules="", parameter_rules="", opt=None, trainable=None):
    layout = Layout(mesh, rules, parameter_rules)
    return Trainer(model=DecoderLM(c), optimizer=opt or optax.adamw(1e-2, weight_decay=0.1),
                   layout=layout, mesh=layout.make_mesh(jax.devices()[:layout.size]),
                   batch_size=8, sequence_length=16, seed=1, trainable=trainable)


def losses_of(t, steps=2, state=None):
    import test_trainer

    state, out = state or t.init_state(), []
    for batch in test_trainer.packed_batches(steps):
        state, metrics = t.train_step(state, t.place_batch(batch))
        out.append(float(metrics["loss"]))
        assert all(np.ndim(v) == 0 for v in metrics.values())  # (metrics are scalars)
        assert float(metrics["dropped_fraction"]) == 0.0
    return out, state


LAYOUTS = [  # (mesh, layout rules, parameter layout rules): experts over the tokens' mesh
    # dimension beside d_ff:model under FSDP's rules, over model, over batch alone, replicated
    ("batch:4;model:2", "batch:batch;experts:batch;d_ff:model", "d_model:batch"),
    ("batch:2;model:4", "batch:batch;experts:model;d_ff:model;heads:model", ""),
    ("batch:8", "batch:batch;experts:batch", ""),
    ("batch:4;model:2", "batch:batch;d_ff:model", ""),
]


def layer_layouts_agree(m: MoEConfig, mesh, rules, parameter_rules, **kwargs):
    """The layer's values and gradients (parameters, input) in a layout, as on one device:
    x [8, 16, 16], some padding."""
    layer, params, _ = layer_and_params(m, **kwargs)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 16, 16)), jnp.float32)
    real = jnp.ones((8, 16)).at[1, 10:].set(0)

    def f(params, x):
        y = layer.apply({"params": params}, x, True, real, mutable=[STATS])[0]
        return jnp.sum(jnp.sin(y) * real[..., None])

    step = lambda: jax.jit(jax.value_and_grad(f, (0, 1)))  # noqa: E731 (one per layout:
    layout = Layout(mesh, rules, parameter_rules)           # jit's cache knows none)
    with layout.activate(layout.make_mesh(jax.devices()[:layout.size])):
        split = step()(params, x)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5),
                           split, step()(params, x))


@pytest.mark.parametrize("mesh,rules,parameter_rules,dispatch", [
    (*LAYOUTS[0], "dropless"), (*LAYOUTS[0], "capacity"),
    *(pytest.param(*layout, "dropless", marks=pytest.mark.slow) for layout in LAYOUTS[1:3])])
def test_every_layout_computes_one_devices_values_and_gradients(dispatch, mesh, rules,
                                                                parameter_rules):
    """Both dispatches under FSDP, experts over the tokens' dimension, d_ff split; dropless's
    other expert splits too (capacity's layouts are its constraints alone: GSPMD's)."""
    layer_layouts_agree(dataclasses.replace(DEEPSEEK, dispatch=dispatch, group_size=16),
                        mesh, rules, parameter_rules)


@pytest.mark.slow  # (the fast tier: the layer in the layouts above)
@pytest.mark.parametrize("mesh,rules,parameter_rules,dispatch", [  # (pairwise)
    (*LAYOUTS[0], "capacity"), (*LAYOUTS[1], "dropless"), (*LAYOUTS[2], "dropless"),
    (*LAYOUTS[3], "capacity")])
def test_layouts_never_change_a_train_step(dispatch, mesh, rules, parameter_rules):
    """Two AdamW steps with the choice bias moved after each: the losses and choice biases
    of one device on 8 in every layout of the experts, each by one dispatch (the bias moves
    by the routing's loads, before either dispatch; dropless in LAYOUTS[0]: the layer's)."""
    c = config(moe=dataclasses.replace(DEEPSEEK, dispatch=dispatch, bias_update_rate=0.01))
    reference, ref_biases = one_device_steps(dispatch)
    losses, state = losses_of(trainer(c, mesh, rules, parameter_rules))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for i, ref_bias in zip((1, 2), ref_biases):
        bias = jax.device_get(state.params[f"layer_{i}"]["mlp"]["choice_bias"])
        np.testing.assert_array_equal(bias, ref_bias)
        assert np.any(bias)


@functools.cache
def one_device_steps(dispatch):
    """One device's losses and choice biases (layers 1 and 2) in
    `test_layouts_never_change_a_train_step`, once for every layout."""
    c = config(moe=dataclasses.replace(DEEPSEEK, dispatch=dispatch, bias_update_rate=0.01))
    reference, state = losses_of(trainer(c))
    return reference, [jax.device_get(state.params[f"layer_{i}"]["mlp"]["choice_bias"])
                       for i in (1, 2)]


# --- the auxiliary-loss-free balancing -----------------------------------------------------

def skewed(rate: float, steps: int, opt=None, trainable=None):
    """A one-layer model whose router prefers experts 0 and 1 for every token (a router
    bias of 5 on them; at learning rate 0 unless `opt`), and its train step: (trainer,
    state, step) with ``step(state) -> (state, the busiest expert's share)``."""
    m = dataclasses.replace(DEEPSEEK, router_bias=True, num_groups=1, top_groups=1,
                            bias_update_rate=rate, load_balance_loss=0.0)
    t = trainer(config(moe=m, first_dense_layers=0, num_layers=1),
                opt=opt or optax.adamw(0.0), trainable=trainable)
    state = t.init_state()
    mlp = {**state.params["layer_0"]["mlp"], "router_bias": jnp.zeros(8).at[:2].set(5.0)}
    state = state.replace(params={**state.params, "layer_0": {**state.params["layer_0"],
                                                              "mlp": mlp}})
    import test_trainer

    batch = t.place_batch(test_trainer.packed_batches(1)[0])

    def step(state):
        state, metrics = t.train_step(state, batch)
        assert all(np.ndim(v) == 0 for v in metrics.values())  # (metrics are scalars)
        return state, float(metrics["busiest_expert_share"])

    return t, state, step


def test_the_choice_bias_evens_out_a_skewed_router(tmp_path):
    """At rate 0.03 the bias lowers the two preferred experts' scores step by step until the
    others take tokens: the busiest expert's share falls from 1/2 towards 1/8 (the sign
    keeps it moving about). A checkpoint keeps the bias: a run restored from it takes the
    next step as the run that went on."""
    import orbax.checkpoint as ocp

    from mtrain.io.checkpoints import Checkpoints

    t, state, step = skewed(0.03, 16)
    shares = []
    for _ in range(16):
        state, share = step(state)
        shares.append(share)
    assert shares[0] == pytest.approx(0.5) and max(shares[-4:]) < 0.25, shares
    bias = np.asarray(jax.device_get(state.params["layer_0"]["mlp"]["choice_bias"]))
    assert bias[:2].max() < bias[2:].mean(), bias
    meta = {"model": {"d_model": 32}}
    checkpoints = Checkpoints(tmp_path / "checkpoints", async_save=False)
    checkpoints.manager.save(16, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    checkpoints.wait()
    restored = checkpoints.read(16, t.sharded_abstract_state(), meta).state
    checkpoints.close()
    np.testing.assert_array_equal(restored.params["layer_0"]["mlp"]["choice_bias"], bias)
    went_on, resumed = step(state)[0], step(restored)[0]
    np.testing.assert_array_equal(resumed.params["layer_0"]["mlp"]["choice_bias"],
                                  went_on.params["layer_0"]["mlp"]["choice_bias"])


def test_the_optimizer_never_touches_the_choice_bias():
    """At rate 0, AdamW with weight decay: the skewed router stays skewed (the busiest share
    1/2), every other parameter moves, and the choice bias is bit for bit as it started,
    with no optimizer state kept for it, even where run.trainable names it."""
    t, state, step = skewed(0.0, 3, opt=optax.adamw(1e-2, weight_decay=0.1),
                            trainable=lambda path: True)
    state = state.replace(params=jax.tree_util.tree_map_with_path(
        lambda p, v: v + 1e-3 if "choice_bias" in jax.tree_util.keystr(p) else v, state.params))
    first = parameters.paths(jax.device_get(state.params))
    assert not any("choice_bias" in jax.tree_util.keystr(p)
                   for p, _ in jax.tree_util.tree_leaves_with_path(state.opt_state))
    for _ in range(3):
        state, share = step(state)
        assert share == pytest.approx(0.5)
    after = parameters.paths(jax.device_get(state.params))
    for path, value in first.items():
        assert np.array_equal(after[path], value) == path.endswith("choice_bias"), path
