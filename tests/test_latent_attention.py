"""Multi-head latent attention (`models.latent_attention`, ``transformer.latent_attention``):
the expanded form is transformers' DeepseekV3Attention (written again here in numpy), the
decoding cache holds the latent and the rotary key alone, generation from it (a token a
step, or prefilled) gives the teacher-forced logits, the flash paths and every layout
compute what einsum on one device does, and the planner counts it.

Tolerances: float32 throughout. The absorbed form of a decoding step sums the same products
in another order (q_nope (W_k latent) as (q_nope W_k) latent), as do the kernels, layouts
and a float64 reference: ~1e-6 on unit-scale activations of these sizes, checked at 1e-5.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.evaluation.translation import empty_cache
from mtrain.models import blocks, counts
from mtrain.models.attention import AttentionMask
from mtrain.models.latent_attention import LatentAttention, LatentConfig
from mtrain.models.lora import LoraConfig
from mtrain.models.positions import RopeScaling
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout, LayoutError

import test_trainer

TOL = dict(rtol=1e-5, atol=1e-5)
MLA = LatentConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=8, rope_interleaved=True)
YARN = RopeScaling(kind="yarn", factor=4.0, original_max_length=8, attention_factor=1.2)
CONFIG = TransformerConfig(vocab_size=64, d_model=32, d_ff=64, num_heads=4, num_layers=2,
                           max_length=16, position_encoding="rotary", latent_attention=True,
                           mla=MLA, rope_scaling=YARN, attention_scale=0.3,
                           attention="einsum", dropout_rate=0.0)


def _segments(batch=2, length=12):
    """Two packed examples in row 0 (positions restarting), one and padding in row 1."""
    seg = np.array([[1] * 7 + [2] * 5, [1] * 9 + [0] * 3])[:batch, :length]
    pos = np.array([list(range(7)) + list(range(5)), list(range(12))])[:batch, :length]
    return jnp.asarray(seg), jnp.asarray(pos)


def _hf_rotate(x, at, inverse, amplitude, interleaved):
    """transformers' apply_rotary_pos_emb(_interleave) on [b, l, h, d] (float64)."""
    emb = np.concatenate([at[..., None] * inverse] * 2, -1)[:, :, None]
    if interleaved:
        b, l, h, d = x.shape
        x = x.reshape(b, l, h, d // 2, 2).swapaxes(-1, -2).reshape(b, l, h, d)
    half = x.shape[-1] // 2
    return x * np.cos(emb) * amplitude + np.concatenate(
        [-x[..., half:], x[..., :half]], -1) * np.sin(emb) * amplitude


def hugging_face_mla(p, x, seg, at, c: TransformerConfig):
    """DeepseekV3Attention.forward (eager) on mtrain's parameters `p` (their Hugging Face
    layouts: kv_b [kv_lora, heads x (nope + v)], each head's key rows then value rows)."""
    m, h = c.mla, c.num_heads
    x, at = np.asarray(x, np.float64), np.asarray(at, np.float64)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    b, length, d = x.shape

    def rms(y, w):
        return y / np.sqrt(np.mean(y**2, -1, keepdims=True) + c.norm_epsilon) * w

    if m.q_lora_rank:
        q = rms(x @ p["q_a"], p["q_a_norm"]["scale"]) @ p["q_b"].reshape(m.q_lora_rank, -1)
    else:
        q = x @ p["q"].reshape(d, -1)
    q = q.reshape(b, length, h, m.qk_head_dim)
    q_pass, q_rot = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    compressed = x @ p["kv_a"]
    k_pass, k_rot = compressed[..., :m.kv_lora_rank], compressed[..., m.kv_lora_rank:]
    kv = (rms(k_pass, p["kv_a_norm"]["scale"]) @ p["kv_b"].reshape(m.kv_lora_rank, -1)
          ).reshape(b, length, h, m.qk_nope_head_dim + m.v_head_dim)
    k_pass, value = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
    rotary = blocks.rotary_frequencies(c)
    inverse = np.asarray(rotary.frequencies, np.float64)
    q_rot, k_rot = (_hf_rotate(y, at, inverse, rotary.amplitude, m.rope_interleaved)
                    for y in (q_rot, k_rot[:, :, None]))
    query = np.concatenate([q_pass, q_rot], -1)
    key = np.concatenate([k_pass, np.broadcast_to(k_rot, (*k_pass.shape[:3], k_rot.shape[-1]))],
                         -1)
    logits = np.einsum("blhd,bmhd->bhlm", query, key) * c.attention_scale
    seg = np.asarray(seg)
    visible = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0) & np.tril(
        np.ones((length, length), bool))
    logits = np.where(visible[:, None], logits, -1e30)  # (padding rows: uniform, unused)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhlm,bmhd->blhd", weights, value)
    return np.einsum("blhk,hkd->bld", out, p["o"])


def _randomised(params, seed=7):
    """`params` (unboxed) with every leaf redrawn, of unit-scale outputs: norm scales near
    1, weights of std fan-in^-0.5, adapters small (neither is at its start)."""
    paths = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
    keys = jax.random.split(jax.random.key(seed), len(paths))

    def draw(key, path, a):
        if a.ndim == 1:
            return 1 + 0.3 * jax.random.normal(key, a.shape)
        std = 0.05 if "_lora_" in jax.tree_util.keystr(path) else (a.size / a.shape[-1])**-0.5
        return std * jax.random.normal(key, a.shape)

    return jax.tree.unflatten(jax.tree.structure(nn.meta.unbox(params)),
                              [draw(k, p, a) for k, (p, a) in zip(keys, paths)])


@pytest.mark.parametrize("mla", [MLA, dataclasses.replace(MLA, q_lora_rank=0,
                                                          rope_interleaved=False)],
                         ids=["low-rank queries, interleaved", "direct queries, half split"])
def test_the_expanded_form_is_transformers(mla):
    c = dataclasses.replace(CONFIG, mla=mla)
    layer = LatentAttention.of(c, rotary_frequencies=blocks.rotary_frequencies(c))
    seg, at = _segments()
    x = jax.random.normal(jax.random.key(0), (2, 12, 32))
    mask = AttentionMask.of_self(seg, causal=True)
    params = _randomised(layer.init(jax.random.key(1), x, x, mask, True, positions=at)["params"])
    expected_names = {"kv_a", "kv_a_norm", "kv_b", "o"} | (
        {"q_a", "q_a_norm", "q_b"} if mla.q_lora_rank else {"q"})
    assert set(params) == expected_names
    out = layer.apply({"params": params}, x, x, mask, True, positions=at)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(out)[real],
                               hugging_face_mla(params, x, seg, at, c)[real], **TOL)


def _lm(config, seed=3):
    model = DecoderLM(config)
    ids = jnp.ones((2, 16), jnp.int32)
    params = model.init(jax.random.key(seed), ids, ids, jnp.broadcast_to(jnp.arange(16),
                                                                         ids.shape))["params"]
    return model, _randomised(params, seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cache_is_the_latent_and_the_rotary_key(dtype):
    """Bytes per token per layer = (kv_lora + rope) x the activations' size, asserted on
    the cache `init` of decode_step makes; nothing per head; scanned: the same, stacked."""
    for scanned in (False, True):
        model = DecoderLM(dataclasses.replace(CONFIG, activation_dtype=dtype,
                                              scan_layers=scanned))
        cache = empty_cache(model, (), 3, 16)
        layers = [cache["layers"]] if scanned else [cache[f"layer_{i}"] for i in range(2)]
        assert set(cache) == {"decode_index", *(["layers"] if scanned else
                                                ["layer_0", "layer_1"])}
        for layer in layers:
            held = layer["self_attention"]
            assert set(held) == {"cached_latent", "cached_rope_key"}
            leading = (3, 2, 16) if scanned else (3, 16)
            assert held["cached_latent"].shape == (*leading, 16)
            assert held["cached_rope_key"].shape == (*leading, 4)
            per_token = sum(a.dtype.itemsize * a.shape[-1] for a in held.values())
            assert per_token == (16 + 4) * jnp.dtype(dtype).itemsize
            assert all(a.dtype == jnp.dtype(dtype) for a in held.values())


def _teacher_forced(model, params, inputs):
    """Logits [n, l, vocab] of a pass reading `inputs` (a row each, no packing)."""
    at = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return model.apply({"params": params}, inputs, jnp.ones_like(inputs), at, inputs=inputs)


# (fp8 alone went: "fp8, adapters" runs the same quantized pair of `_absorbed` and its
# adapter's pair beside it; the unquantized pair, with and without an adapter: the first
# two cases)
@pytest.mark.parametrize("settings", [
    {}, pytest.param({"mla": dataclasses.replace(MLA, q_lora_rank=0, rope_interleaved=False),
                      "lora": LoraConfig(rank=2), "scan_layers": True}, marks=pytest.mark.slow),
    pytest.param({"quantization": "fp8", "lora": LoraConfig(rank=2)}, marks=pytest.mark.slow),
    pytest.param({"quantization": "fp8", "latent_attention": False, "mla": None, "d_kv": 8,
                  "num_kv_heads": 2}, marks=pytest.mark.slow)],
    ids=["low-rank queries", "direct queries, adapters, scanned", "fp8, adapters",
         "fp8, multi-head attention"])
def test_generation_from_the_cache_is_the_teacher_forced_pass(settings):
    """A token a step from an empty cache, and a prefill of each row's first 5 and 2
    tokens then steps from there (each row at its own position): the logits of the
    teacher-forced pass. With adapters (drawn nonzero), the absorbed form takes ``kv_b``'s
    merged. In fp8 (tensorwise in training) a pass without dropout scales per token, and the
    absorbed form multiplies ``kv_b`` and the latents as the expanded pass quantized them:
    the same logits (the two passes' float32 activations differ by ~1e-7 of their size,
    e4m3's rounding boundaries are 2^-4 apart: a value between them rounds the same)."""
    config = dataclasses.replace(CONFIG, **settings)
    model, params = _lm(config)
    if config.lora:
        assert any("kv_b_lora_b" in jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_leaves_with_path(params))
    inputs = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 16)), jnp.int32)
    expected = _teacher_forced(model, params, inputs)

    def step(ids, cache):
        logits, v = model.apply({"params": params, "cache": cache}, ids,
                                method=model.decode_step, mutable=["cache"])
        return logits, v["cache"]

    step = jax.jit(step)
    cache, loop = empty_cache(model, (), 2, 16), []
    for t in range(16):
        logits, cache = step(inputs[:, t:t + 1], cache)
        loop.append(logits)
    np.testing.assert_allclose(np.stack(loop, 1), expected, **TOL)
    filled = jnp.asarray([5, 2])
    _, v = model.apply({"params": params, "cache": empty_cache(model, (), 2, 16)}, inputs,
                       filled, method=model.prefill, mutable=["cache"])
    cache, rows = v["cache"], jnp.arange(2)
    for j in range(8):
        logits, cache = step(inputs[rows, filled + j][:, None], cache)
        np.testing.assert_allclose(logits, expected[rows, filled + j], **TOL)


def _loss_and_grads(model, params, batch):
    seg, at = batch["targets_segment_ids"], batch["targets_positions"]

    def loss(params):
        logits = model.apply({"params": params}, batch["targets"], seg, at)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                                   -1)[..., 0]
        return jnp.sum(nll * (seg > 0))

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("path", [pytest.param("dot_product", marks=pytest.mark.slow),
                                  pytest.param("splash", marks=pytest.mark.slow)])
def test_the_fused_paths_compute_einsums(path):
    """'dot_product' and splash (Pallas' interpreter; the values zero-padded to the q/k head
    width): a training loss and its gradients, evaluation's logits and a prefill's cache and
    hidden states, as the einsum path's."""
    settings = {"attention": "dot_product"} if path == "dot_product" else {
        "attention": "flash", "flash_kernel": "splash"}
    einsum, params = _lm(CONFIG)
    fused = DecoderLM(dataclasses.replace(CONFIG, **settings))
    batch = {k: jnp.asarray(v[:2]) % 64 if k == "targets" else jnp.asarray(v[:2])
             for k, v in test_trainer.packed_batches(1)[0].items()}
    (loss, grads), (fused_loss, fused_grads) = (_loss_and_grads(m, params, batch)
                                                for m in (einsum, fused))
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), fused_grads, grads)
    inputs = batch["targets"]
    np.testing.assert_allclose(_teacher_forced(fused, params, inputs),
                               _teacher_forced(einsum, params, inputs), **TOL)
    prefilled = [m.apply({"params": params, "cache": empty_cache(m, (), 2, 16)}, inputs,
                         jnp.asarray([9, 16]), method=m.prefill, mutable=["cache"])
                 for m in (einsum, fused)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), prefilled[1],
                 prefilled[0])


LAYOUT_CONFIG = dataclasses.replace(CONFIG, vocab_size=256)  # (test_trainer's batches)
LAYOUTS = [  # (model:8 over kv_lora, q_lora, d_ff, vocab went: each is split below)
    ("batch:4;model:2", "batch:batch;heads:model;d_ff:model;vocab:model"),
    ("batch:2;model:4", "batch:batch;kv_latent:model;kv_lora:model;q_lora:model"),
    ("batch:2;model:4", "batch:batch;length:model"),  # context parallel
]


def _train(mesh_shape, rules, config=LAYOUT_CONFIG, steps=2):
    trainer = test_trainer.make_trainer(mesh_shape, rules, config)
    state, losses = trainer.init_state(), []
    for batch in test_trainer.packed_batches(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def one_device():
    return _train("", "")


@pytest.mark.parametrize("mesh_shape,rules", [
    layout if i == 0 else pytest.param(*layout, marks=pytest.mark.slow)
    for i, layout in enumerate(LAYOUTS)])
def test_layouts_train_as_one_device(one_device, mesh_shape, rules):
    """Heads, the latents' ranks and the rows split, or ``length`` (context parallelism):
    the losses of one device (to the layout tests' tolerance, test_trainer's)."""
    np.testing.assert_allclose(_train(mesh_shape, rules), one_device, rtol=1e-5)


def test_a_latent_rank_that_does_not_divide_its_mesh_dimension_is_named():
    from mtrain.training import optimizer
    from mtrain.training.trainer import Trainer

    config = dataclasses.replace(CONFIG, mla=dataclasses.replace(MLA, kv_lora_rank=12))
    layout = Layout("model:8", "kv_lora:model")
    with pytest.raises(LayoutError, match=r"dimension 'kv_lora' of size 12 is not divisible "
                                          r"by mesh dimension 'model' of size 8"):
        Trainer(model=DecoderLM(config), optimizer=optimizer.adafactor(1e-3), layout=layout,
                mesh=layout.make_mesh(jax.devices()), batch_size=8, sequence_length=16)


@pytest.mark.parametrize("settings,message", [
    ({"attention_windows": (4, 0)}, "transformer.attention_windows=(4, 0) with "
                                    "transformer.latent_attention: no sliding window"),
    ({"attention_output_bias": True}, "attention_output_bias=True with"),
    ({"position_encoding": "relative_bias"}, "position_encoding='relative_bias' with"),
    ({"num_kv_heads": 2}, "num_kv_heads=2 with"),
    ({"qk_norm": True}, "qk_norm=True with"),
    ({"mla": {"qk_rope_head_dim": 3}}, "mla.qk_rope_head_dim is rotated in pairs"),
    ({"mla": {"kv_lora_rank": 0}}, "mla.kv_lora_rank must be at least 1, got 0"),
])
def test_what_latent_attention_does_not_combine_with(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        if "mla" in settings:
            settings = {"mla": dataclasses.replace(MLA, **settings["mla"])}
        TransformerConfig(**{**CONFIG.__dict__, **settings})
    assert TransformerConfig(latent_attention=True, position_encoding="rotary").mla == \
        LatentConfig()
    assert TransformerConfig(mla=MLA).mla is None  # (no latent attention: none)


def test_the_planner_counts_latent_attention():
    """The analytic parameters are the model's matmul weights; the generation figures'
    cache a token is (kv_lora + rope) x 4 bytes a layer against heads x (q/k + v head) x 4
    of multi-head attention (for which the two are one figure); the plan's text says both."""
    from mtrain.modes import plan as plan_mode
    from mtrain.parallel.targets import TARGETS
    from mtrain.planning import inference, planner

    model, params = _lm(CONFIG)
    weights = sum(a.size for p, a in jax.tree_util.tree_leaves_with_path(params)
                  if "norm" not in jax.tree_util.keystr(p))
    assert model.analytic_parameters() == weights
    layout, h100 = Layout("", ""), TARGETS["h100"]
    e = inference.estimate(CONFIG, layout, h100, 4, 16, 8, 4 * weights)
    assert e["cache_bytes_per_token"] == (16 + 4) * 4 * 2
    assert e["mha_cache_bytes_per_token"] == 4 * (12 + 8) * 4 * 2
    mha = TransformerConfig(**{**CONFIG.__dict__, "latent_attention": False, "d_kv": 8})
    e = inference.estimate(mha, layout, h100, 4, 16, 8, 4 * weights)
    assert e["cache_bytes_per_token"] == e["mha_cache_bytes_per_token"] == 2 * 4 * 8 * 4 * 2
    p = planner.plan(test_trainer.make_trainer("", "", LAYOUT_CONFIG), h100, prompt_length=8)
    text = plan_mode._with_cache_line(planner.format_plan(p), p.inference)
    assert "decoding cache 160 B a token, all layers (multi-head attention of the same " \
           "heads: 640 B)" in text
    flops = counts.analytic_flops(CONFIG, 0, 2, 1, 16, 2) - counts.analytic_flops(
        dataclasses.replace(CONFIG, latent_attention=False), 0, 2, 1, 16, 2)
    assert flops == 2 * 16 * (6 * 16 * 4 * (12 + 8) + 9 * 5 * 4) - 2 * 16 * (
        12 * 16 * 4 * CONFIG.d_kv + 9 * 8 * CONFIG.d_kv)


def test_which_gpu_kernels_take_deepseeks_heads():
    """DeepSeek-V3's fused head width (nope 128 + rope 64; the values padded to it) is 192:
    cuDNN takes it from Hopper on, not before (its limit 128), so a plan for an H100 counts
    flash attention and an A100's 'auto' runs einsum; tokamax's kernel takes any width (on
    a GPU, with tokamax: measured on an H200, benchmarks/frontier_attention.py)."""
    from mtrain.models import attention
    from mtrain.planning import step_model

    width = LatentConfig().head_width
    assert width == 192
    assert attention.flash_refusal("cudnn", "gpu", jnp.bfloat16, width, hopper=True) is None
    assert "up to 128" in attention.flash_refusal("cudnn", "gpu", jnp.bfloat16, width,
                                                  hopper=False)
    c = TransformerConfig(vocab_size=128, d_model=64, num_heads=2, num_layers=1,
                          position_encoding="rotary", latent_attention=True,
                          activation_dtype="bfloat16")
    assert c.attention_head_dim == 192
    assert step_model.attention_kernel(c, hopper=True) == "flash"
    assert step_model.attention_kernel(c, hopper=False) == "dense"
