"""gpt-oss's experts as settings of the mixture of experts (`moe`): a router with a bias, the
softmax over the chosen logits, experts with biases and the clamped SwiGLU (`feedforward`),
against a per-token reference written here (transformers' GptOssExperts, in numpy) by either
dispatch, decoding's path and each dropless kernel, in every layout of the experts; and the
counts of the frontier's experts (test_deepseek_experts has the helpers and tolerances).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_deepseek_experts import (LAYOUTS, TOL, as_float64, by_expert, dispatches,
                                   expert_reference, layer_and_params, layer_layouts_agree,
                                   sigmoid)

from mtrain.models import routing
from mtrain.models.feedforward import Clamp, DenseReluDense
from mtrain.models.moe import STATS, MoEConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig

LIMIT, ALPHA = 1.5, 1.702  # (the oracle's limit: it clips; gpt-oss ships 7.0)
ACTIVATIONS = ("clamped_swish", "clamped_linear_plus_one")
GPT_OSS = MoEConfig(num_experts=8, top_k=2, group_size=8, capacity_factor_train=4.0,
                    capacity_factor_eval=4.0, normalize_top_k=True, router_bias=True,
                    expert_bias=True)


def clamped(limit=LIMIT):
    """transformers' gpt-oss activations, in numpy: the gate clamped above, the up
    projection both ways and plus one."""
    def swish(g):
        g = np.minimum(g, limit)
        return g * sigmoid(ALPHA * g)

    return {"clamped_swish": swish,
            "clamped_linear_plus_one": lambda u: np.clip(u, -limit, limit) + 1}


def hf_gpt_oss_route(logits, top_k):
    """transformers' GptOssTopKRouter after its linear layer: the top_k logits, their
    weights the softmax over them."""
    index = np.argsort(-logits, -1, kind="stable")[:, :top_k]
    chosen = np.take_along_axis(logits, index, -1)
    weights = np.exp(chosen - chosen.max(-1, keepdims=True))
    return index, weights / weights.sum(-1, keepdims=True)


def gpt_oss_reference(params, x, top_k=2):
    p = as_float64(params)
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    index, weights = hf_gpt_oss_route(tokens @ p["router"] + p["router_bias"], top_k)
    out = np.zeros_like(tokens)
    for t, token in enumerate(tokens):
        for expert, w in zip(index[t], weights[t]):
            out[t] += w * expert_reference(p, token, expert, ACTIVATIONS, clamped())
    return out.reshape(x.shape)


@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_equals_transformers_algorithm(top_k):
    """The top_k of the logits (with the router's bias), weighted by the softmax over them
    (one chosen: weight 1)."""
    logits = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    r = routing.Routing(top_k=top_k, normalize=True)
    _, gates, index, _ = routing.choose(jnp.asarray(logits)[None], jnp.ones((1, 64)), r)
    ours, theirs = by_expert(index[0], gates[0]), by_expert(*hf_gpt_oss_route(logits, top_k))
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)],
                                   rtol=1e-6)


@pytest.mark.parametrize("m,decoding", dispatches(GPT_OSS, megablox_slow=False))
def test_the_layer_equals_a_per_token_reference(m, decoding):
    """The router's bias, each expert's biases (the output's before the gate weights it)
    and the clamped SwiGLU at a limit that clips (about a tenth of the gates and a fifth of
    the up projections here), by either dispatch, decoding's path and the dropless kernels
    (the CPU's, Megablox's in Pallas's interpreter); padding gets nothing."""
    layer, params, x = layer_and_params(m, ACTIVATIONS, Clamp(LIMIT, ALPHA))
    assert params["wi_0_bias"].shape == (8, 16) and params["wo_bias"].shape == (8, 16)
    p = as_float64(params)
    gates = np.einsum("bld,edf->blef", np.asarray(x, np.float64), p["wi_0"]) + p["wi_0_bias"]
    ups = np.einsum("bld,edf->blef", np.asarray(x, np.float64), p["wi_1"]) + p["wi_1_bias"]
    assert np.mean(gates > LIMIT) > 0.05 and np.mean(np.abs(ups) > LIMIT) > 0.05
    real = jnp.ones((2, 8)).at[1, 6:].set(0)
    y, _ = jax.jit(lambda p, x: layer.apply({"params": p}, x, True, real, decoding,
                                            mutable=[STATS]))(params, x)
    expected = gpt_oss_reference(params, x)
    np.testing.assert_allclose(y[0], expected[0], **TOL)
    np.testing.assert_allclose(y[1, :6], expected[1, :6], **TOL)
    assert not np.any(np.asarray(y[1, 6:]))


@pytest.mark.parametrize("mesh,rules,parameter_rules,dispatch", [  # (the fast tier: d_ff
    (*LAYOUTS[3], "dropless"), (*LAYOUTS[3], "capacity"),  # split; FSDP with experts split in
    *(pytest.param(*layout, "dropless", marks=pytest.mark.slow)  # the fast tier:
      for layout in LAYOUTS[:3])])                               # test_deepseek_experts')
def test_every_layout_computes_one_devices_values_and_gradients(dispatch, mesh, rules,
                                                                parameter_rules):
    """The biases split with their experts (and ``d_ff``): the output's added once where
    ``d_ff`` is split, whose partial outputs are summed. Every expert split by dropless,
    whose biases go by row (`dropless._biases_by_row`); capacity adds them by broadcasting
    under GSPMD's constraints, in the d_ff split here (its experts split: test_deepseek's)."""
    layer_layouts_agree(dataclasses.replace(GPT_OSS, dispatch=dispatch, group_size=16),
                        mesh, rules, parameter_rules, activations=ACTIVATIONS,
                        clamp=Clamp(LIMIT, ALPHA))


def test_the_dense_layer_takes_the_clamp_and_the_config_checks_it():
    layer = DenseReluDense(d_ff=16, activations=ACTIVATIONS, clamp=Clamp(LIMIT, ALPHA))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4, 8)) * 2, jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x, True)["params"])
    p, act = as_float64(params), clamped()
    xs = np.asarray(x, np.float64)
    expected = (act["clamped_swish"](xs @ p["wi_0"])
                * act["clamped_linear_plus_one"](xs @ p["wi_1"])) @ p["wo"]
    np.testing.assert_allclose(layer.apply({"params": params}, x, True), expected, **TOL)
    unclamped = DenseReluDense(d_ff=16, activations=ACTIVATIONS)  # (limit 0: no clamp)
    expected = ((xs @ p["wi_0"]) * sigmoid(ALPHA * (xs @ p["wi_0"])) * (xs @ p["wi_1"] + 1)
                ) @ p["wo"]
    np.testing.assert_allclose(unclamped.apply({"params": params}, x, True), expected, **TOL)
    with pytest.raises(ValueError, match="activation_limit=7.0 must be 0 .* clamps only "
                                         "clamped_swish and clamped_linear_plus_one"):
        TransformerConfig(activation_limit=7.0)
    TransformerConfig(mlp_activations=ACTIVATIONS, activation_limit=7.0)


def test_the_counts_take_the_frontiers_experts():
    """Parameters: every leaf but the norms' scales, whatever experts a layer has (shared,
    biased, dense first); active parameters: those less the experts a token skips."""
    m = dataclasses.replace(GPT_OSS, router_scoring="sigmoid", choice_bias=True,
                            num_shared_experts=2, expert_d_ff=16)
    c = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                          num_layers=4, moe_every=2, first_dense_layers=1,
                          mlp_activations=ACTIVATIONS, position_encoding="rotary", moe=m)
    model = DecoderLM(c)
    ids = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))[
        "params"])
    assert "router" in params["layer_2"]["mlp"] and "router" not in params["layer_3"]["mlp"]
    counted = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                  if "scale" not in jax.tree_util.keystr(path))
    assert model.analytic_parameters() == counted
    per_expert = 3 * 32 * 16 + 2 * 16 + 32  # (wi_0, wi_1, wo, and their biases)
    assert model.analytic_parameters() - model.active_parameters() == 6 * per_expert
