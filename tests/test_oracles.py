"""The new blocks against Hugging Face's own numbers (../shared/oracles): the tiny Llama
(RMSNorm, SwiGLU, RoPE, 2 of 4 key/value heads) and T5.1.1 (gated GELU, relative position
bias) with their published-layout weights mapped onto mtrain's parameters, here in the test
(importing checkpoints is issue 39's). The logits must match what `transformers` computed,
teacher forced and on the long inputs (rotary angles far from 0; distances past T5's last
bucket), and greedy decoding must give its tokens.

Tolerance: the README of the oracles: within about 1e-4 absolute in float32 (logits of
O(1); the reference itself moves by ~2e-6 between torch's attention implementations).
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig

ORACLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                       "shared", "oracles")
safetensors = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
ATOL = 1e-4


def load(family):
    folder = os.path.join(ORACLES, family)
    return (safetensors.load_file(os.path.join(folder, "model.safetensors")),
            dict(np.load(os.path.join(folder, "oracle.npz"))))


def filled(model, example_args, weights: dict):
    """mtrain's parameters of `model`, each taken from `weights` (path -> array), checked to
    cover every parameter with its shape."""
    shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), *example_args)))
    flat = {"/".join(str(k.key) for k in path): leaf for path, leaf in
            jax.tree_util.tree_leaves_with_path(shapes["params"])}
    assert sorted(flat) == sorted(weights)
    for name, leaf in flat.items():
        assert weights[name].shape == leaf.shape, name
    tree = {}
    for name, value in weights.items():
        node = tree
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jnp.asarray(value, jnp.float32)
    return {"params": tree}


def attention(w, prefix, heads, kv_heads, d_kv, scale):
    """Hugging Face's [out, in] projections as mtrain's [d_model, heads, d_kv] ones (the
    queries times `scale`: mtrain's logits are not scaled, Llama's are by d_kv^-0.5)."""
    d = w[f"{prefix}q"].shape[1]
    return {"q": w[f"{prefix}q"].T.reshape(d, heads, d_kv) * scale,
            "k": w[f"{prefix}k"].T.reshape(d, kv_heads, d_kv),
            "v": w[f"{prefix}v"].T.reshape(d, kv_heads, d_kv),
            "o": w[f"{prefix}o"].T.reshape(heads, d_kv, d)}


def llama():
    w, oracle = load("llama_gqa")
    config = TransformerConfig(vocab_size=512, d_model=64, d_ff=160, num_heads=4, num_kv_heads=2,
                               d_kv=16, num_layers=2, max_length=256, position_encoding="rotary",
                               mlp_activations=("silu", "linear"))
    ours = {"token_embedding/embedding": w["model.embed_tokens.weight"],
            "softmax": w["lm_head.weight"].T, "final_norm/scale": w["model.norm.weight"]}
    for i in range(2):
        hf = f"model.layers.{i}."
        proj = {n: w[f"{hf}self_attn.{n}_proj.weight"] for n in "qkvo"}
        for name, value in attention(proj, "", 4, 2, 16, 16**-0.5).items():
            ours[f"layer_{i}/self_attention/{name}"] = value
        ours |= {f"layer_{i}/attention_norm/scale": w[f"{hf}input_layernorm.weight"],
                 f"layer_{i}/mlp_norm/scale": w[f"{hf}post_attention_layernorm.weight"],
                 f"layer_{i}/mlp/wi_0": w[f"{hf}mlp.gate_proj.weight"].T,
                 f"layer_{i}/mlp/wi_1": w[f"{hf}mlp.up_proj.weight"].T,
                 f"layer_{i}/mlp/wo": w[f"{hf}mlp.down_proj.weight"].T}
    model = DecoderLM(config)
    ids = jnp.zeros((1, 8), jnp.int32)
    return model, filled(model, (ids, ids, ids), ours), oracle


def lm_logits(model, params, ids):
    """Logits of every position of `ids` as the model's inputs (no start token: the oracle's
    input_ids are what the model reads): the decoding path's call over the whole sequence."""
    logits, _ = model.apply(params, jnp.asarray(ids), None, None, decode=True, mutable=["cache"])
    return logits


def test_llama_logits_are_hugging_faces():
    model, params, oracle = llama()
    np.testing.assert_allclose(lm_logits(model, params, oracle["input_ids"]), oracle["logits"],
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(lm_logits(model, params, oracle["long_input_ids"]),
                               oracle["long_logits"], atol=ATOL, rtol=0)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_llama_greedy_tokens_are_hugging_faces():
    """By the incremental decoding path (`decode_step`: the prompt fed a token at a time
    into the cache of 2 key/value heads and rotated keys, then its own argmax)."""
    model, params, oracle = llama()
    prompt, total = list(oracle["prompt_ids"]), len(oracle["greedy_ids"])
    cache = model.init(jax.random.key(0), jnp.zeros((1, total), jnp.int32),
                       method=DecoderLM.decode_step)["cache"]
    ids = prompt[:1]
    for i in range(total - 1):
        logits, variables = model.apply({**params, "cache": cache}, jnp.asarray([[ids[i]]]),
                                        method=DecoderLM.decode_step, mutable=["cache"])
        cache = variables["cache"]
        ids.append(prompt[i + 1] if i + 1 < len(prompt) else int(jnp.argmax(logits[0])))
    assert ids == list(oracle["greedy_ids"])


def t5():
    w, oracle = load("t5_1_1")
    config = TransformerConfig(vocab_size=512, d_model=64, d_ff=160, num_heads=4, d_kv=16,
                               num_layers=2, max_length=256, position_encoding="relative_bias",
                               mlp_activations=("gelu", "linear"))
    ours = {"embed/embedding": w["shared.weight"], "softmax": w["lm_head.weight"].T,
            "encoder_norm/scale": w["encoder.final_layer_norm.weight"],
            "decoder_norm/scale": w["decoder.final_layer_norm.weight"],
            "encoder_relative_bias/relative_bias":
                w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].T,
            "decoder_relative_bias/relative_bias":
                w["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].T}
    for stack in ("encoder", "decoder"):
        for i in range(2):
            hf, me = f"{stack}.block.{i}.layer.", f"{stack}_{i}/"
            parts = [("0.SelfAttention.", "self_attention", "attention_norm")]
            if stack == "decoder":
                parts.append(("1.EncDecAttention.", "encoder_decoder_attention",
                              "encoder_decoder_attention_norm"))
            for at, name, norm in parts:
                proj = {n: w[f"{hf}{at}{n}.weight"] for n in "qkvo"}
                for p, value in attention(proj, "", 4, 4, 16, 1.0).items():
                    ours[f"{me}{name}/{p}"] = value
                ours[f"{me}{norm}/scale"] = w[f"{hf}{at.split('.')[0]}.layer_norm.weight"]
            ff = f"{hf}{len(parts)}."
            ours |= {f"{me}mlp_norm/scale": w[f"{ff}layer_norm.weight"],
                     f"{me}mlp/wi_0": w[f"{ff}DenseReluDense.wi_0.weight"].T,
                     f"{me}mlp/wi_1": w[f"{ff}DenseReluDense.wi_1.weight"].T,
                     f"{me}mlp/wo": w[f"{ff}DenseReluDense.wo.weight"].T}
    model = EncoderDecoder(config)
    ids = jnp.ones((1, 8), jnp.int32)
    return model, filled(model, (ids,) * 6, ours), oracle


def t5_logits(model, params, encoder_ids, decoder_input_ids):
    """Teacher-forced logits: mtrain's targets are the decoder inputs shifted left (it
    shifts them right again, after the start id 0)."""
    inputs = jnp.asarray(encoder_ids)
    targets = jnp.pad(jnp.asarray(decoder_input_ids)[:, 1:], ((0, 0), (0, 1)), constant_values=3)
    rows = lambda x: (x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape))  # noqa: E731
    return model.apply(params, *rows(inputs), *rows(targets))


def test_t5_1_1_logits_are_hugging_faces():
    model, params, oracle = t5()
    np.testing.assert_allclose(
        t5_logits(model, params, oracle["encoder_ids"], oracle["decoder_input_ids"]),
        oracle["logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        t5_logits(model, params, oracle["long_encoder_ids"], oracle["long_decoder_input_ids"]),
        oracle["long_logits"], atol=ATOL, rtol=0)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_t5_1_1_greedy_tokens_are_hugging_faces():
    """By the incremental decoding path (`decode_step`, its cache and the relative bias of
    each decoded position)."""
    model, params, oracle = t5()
    inputs = jnp.asarray(oracle["encoder_ids"][:1])
    segments = jnp.ones_like(inputs)
    positions = jnp.arange(inputs.shape[1])[None]
    encoded = model.apply(params, inputs, segments, positions, method=EncoderDecoder.encode)
    cache = model.init(jax.random.key(0), encoded, segments, jnp.zeros((1, 16), jnp.int32),
                       method=EncoderDecoder.decode_step)["cache"]
    ids = [0]
    while len(ids) < len(oracle["greedy_ids"]):
        logits, variables = model.apply({**params, "cache": cache}, encoded, segments,
                                        jnp.asarray([[ids[-1]]]),
                                        method=EncoderDecoder.decode_step, mutable=["cache"])
        cache = variables["cache"]
        ids.append(int(jnp.argmax(logits[0])))
    assert ids == list(oracle["greedy_ids"])
