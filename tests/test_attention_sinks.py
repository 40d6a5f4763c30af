"""gpt-oss's attention as settings (`transformer.attention_sinks`, `attention_output_bias`):
a learned sink logit per head in each self-attention softmax, and a bias on the output
projection, on every attention path that can take them.

- the einsum reference is Hugging Face's eager formula (written here in numpy: the sink a
  column of the softmax, dropped after), with grouped heads, a window, packing, padding;
- splash (Pallas' interpreter here) gives einsum's loss and gradients (the sinks' too),
  evaluation logits and prefilled cache;
- decoding (the token loop over ring caches, per-row indices, prefill) gives the teacher-
  forced logits; the sinks learn; GPU kernels that take no sinks are refused (by 'auto'
  quietly, by name in one line);
- a train step's losses are one device's under heads and kv heads split and with
  ``length`` split (context parallelism: the ring; gathered and ring at the attention).

Tolerances: float32; sums of a few dozen O(1) terms in another order (kernel blocks, the
online softmax, a step against a pass) move values by ~1e-6.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.evaluation.translation import empty_cache
from mtrain.models import attention, layers
from mtrain.models.attention import AttentionMask, reference
from mtrain.models.transformer import DecoderLM, TransformerConfig

from test_trainer import make_trainer, packed_batches

CONFIG = TransformerConfig(
    vocab_size=256, d_model=32, d_ff=64, num_heads=8, num_kv_heads=2, d_kv=8, num_layers=2,
    position_encoding="rotary", attention_windows=(8, 0), attention_bias=True,
    attention_scale=8**-0.5, attention_sinks=True, attention_output_bias=True,
    dropout_rate=0.0, attention="einsum")
SPLASH = dict(attention="flash", flash_kernel="splash")
TOL = dict(rtol=2e-5, atol=2e-5)


def hugging_faces_eager(q, k, v, sinks, segment_ids, window, scale):
    """transformers' `GptOssAttention` eager path (repeat_kv, the mask added as the float32
    minimum, the sinks concatenated, their column dropped after the softmax), on packed
    rows: q [b, l, h, d], k and v [b, l, g, d], in float64."""
    q, k, v, sinks = (np.asarray(x, np.float64) for x in (q, k, v, sinks))
    (b, length, h, _), g = q.shape, k.shape[2]
    k, v = np.repeat(k, h // g, axis=2), np.repeat(v, h // g, axis=2)
    logits = np.einsum("blhd,bmhd->bhlm", q, k) * scale
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    ids = np.asarray(segment_ids)
    allowed = (j <= i) & (i - j < window) & (ids[:, :, None] == ids[:, None, :]) & \
        (ids[:, None, :] > 0)
    logits = logits + np.where(allowed[:, None], 0.0, np.finfo(np.float32).min)
    combined = np.concatenate([logits, np.broadcast_to(sinks[None, :, None, None],
                                                       (b, h, length, 1))], axis=-1)
    combined = combined - combined.max(axis=-1, keepdims=True)
    probs = np.exp(combined) / np.exp(combined).sum(axis=-1, keepdims=True)
    scores = probs[..., :-1]
    assert (scores.sum(-1) < 1).all()  # (the sink takes a share of every query)
    return np.einsum("bhlm,bmhd->blhd", scores, v)


def test_the_reference_is_hugging_faces_eager_formula():
    keys = jax.random.split(jax.random.key(0), 4)
    b, length, h, g, d = 3, 20, 8, 2, 8
    q = jax.random.normal(keys[0], (b, length, h, d))
    k = jax.random.normal(keys[1], (b, length, g, d))
    v = jax.random.normal(keys[2], (b, length, g, d))
    sinks = 1 + 1.5 * jax.random.normal(keys[3], (h,))
    ids = np.ones((b, length), np.int32)
    ids[1, 12:] = 2  # (two packed examples)
    ids[2, 15:] = 0  # (padding: its queries see nothing, and give 0)
    mask = AttentionMask.of_self(jnp.asarray(ids), causal=True).windowed(6)
    got = reference(q, k, v, mask, scale=d**-0.5, sinks=sinks)
    want = hugging_faces_eager(q, k, v, sinks, ids, 6, d**-0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got)[2, 15:].any()
    grads = jax.grad(lambda *x: reference(*x[:3], mask, scale=0.3, sinks=x[3]).sum(),
                     argnums=(0, 1, 2, 3))(q, k, v, sinks)
    assert all(np.isfinite(x).all() for x in grads) and np.abs(grads[3]).min() > 0
    # without sinks: the softmax as before
    np.testing.assert_array_equal(reference(q, k, v, mask), reference(q, k, v, mask, sinks=None))


def _model(config, **settings):
    return DecoderLM(dataclasses.replace(config, **settings))


@pytest.fixture(scope="module")
def params():
    """The model's parameters with sinks (1 + 1.5 N(0, 1), gpt-oss's oracle's draw) and
    biases (0.2 N(0, 1)) away from their zeros."""
    ids = jnp.ones((2, 16), jnp.int32)
    tree = nn.meta.unbox(DecoderLM(CONFIG).init(jax.random.key(1), ids, ids, ids)["params"])
    rng = np.random.default_rng(0)

    def draw(path, x):
        name = path[-1].key
        if name == "sinks":
            return jnp.asarray(1 + 1.5 * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) \
            if name.endswith("bias") else x

    tree = jax.tree_util.tree_map_with_path(draw, tree)
    assert tree["layer_0"]["self_attention"]["sinks"].shape == (8,)
    assert tree["layer_1"]["self_attention"]["o_bias"].shape == (32,)
    return {"params": tree}


def _loss(model, params, batch):
    logits = model.apply(params, batch["targets"], batch["targets_segment_ids"],
                         batch["targets_positions"])
    weights = batch["targets_segment_ids"] > 0
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)
    return (ce[..., 0] * weights).sum() / weights.sum(), logits


@pytest.mark.slow  # (splash with sinks under context parallelism: the fast tier)
def test_splash_gives_einsums_loss_gradients_logits_and_prefill(params):
    batch = {k: jnp.asarray(v) for k, v in packed_batches(1)[0].items()}
    real = batch["targets_segment_ids"][..., None] > 0
    runs = {}
    for name, settings in (("einsum", {}), ("splash", SPLASH)):
        model = _model(CONFIG, **settings)
        (loss, logits), grads = jax.jit(jax.value_and_grad(
            lambda p: _loss(model, p, batch), has_aux=True))(params)
        runs[name] = loss, jnp.where(real, logits, 0), grads, _prefilled(model, params)
    (loss, logits, grads, prefill), want = runs["splash"], runs["einsum"]
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    np.testing.assert_allclose(logits, want[1], **TOL)
    sinks = [grads["params"][f"layer_{i}"]["self_attention"]["sinks"] for i in (0, 1)]
    assert all(np.abs(s).min() > 0 for s in sinks)
    flat, flat_want = (jax.tree_util.tree_leaves_with_path(x) for x in (grads, want[2]))
    for (path, g), (_, w) in zip(flat, flat_want):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))
    for got, expected in zip(prefill, want[3]):  # (the cache and the next step's logits)
        np.testing.assert_allclose(got, expected, **TOL)


ROWS, LENGTH = 4, 24
COUNTS = np.array([9, 3, 0, 20])  # (prompts past the window of 8: a ring that wraps)


def _ids():
    return jnp.asarray(np.random.default_rng(2).integers(1, 256, (ROWS, LENGTH)), jnp.int32)


def _prefilled(model, params):
    """The cache after prefilling _ids' first COUNTS and the logits of the next step."""
    cache = empty_cache(model, (), ROWS, LENGTH)
    ids = _ids()

    @jax.jit
    def run(cache):
        _, v = model.apply({**params, "cache": cache}, ids, jnp.asarray(COUNTS),
                           method=model.prefill, mutable=["cache"])
        nxt = ids[jnp.arange(ROWS), jnp.asarray(COUNTS)][:, None]
        logits, v = model.apply({**params, "cache": v["cache"]}, nxt,
                                method=model.decode_step, mutable=["cache"])
        return jax.tree_util.tree_leaves(v["cache"]) + [logits]

    return run(cache)


@pytest.mark.slow  # (about 13 s)
def test_decoding_gives_the_teacher_forced_logits(params):
    """The token loop over the whole rows (one index), and a prefill of COUNTS then steps
    (each row at its own position), with sinks, an output bias and a window's ring cache."""
    model = DecoderLM(CONFIG)
    ids = _ids()
    ones = jnp.ones_like(ids)
    forced = model.apply(params, ids, ones, jnp.broadcast_to(jnp.arange(LENGTH), ids.shape),
                         inputs=ids)
    step = jax.jit(lambda ids, cache: model.apply({**params, "cache": cache}, ids,
                                                  method=model.decode_step, mutable=["cache"]))
    cache = empty_cache(model, (), ROWS, LENGTH)
    assert cache["layer_0"]["self_attention"]["cached_key"].shape[1] == 8  # (the ring)
    for t in range(LENGTH):
        logits, v = step(ids[:, t:t + 1], cache)
        cache = v["cache"]
        np.testing.assert_allclose(logits, forced[:, t], **TOL, err_msg=f"step {t}")
    prefill = jax.jit(lambda cache: model.apply({**params, "cache": cache}, ids,
                                                jnp.asarray(COUNTS), method=model.prefill,
                                                mutable=["cache"])[1]["cache"])
    cache, rows = prefill(empty_cache(model, (), ROWS, LENGTH)), np.arange(ROWS)
    for s in range(4):
        at = COUNTS + s
        logits, v = step(ids[rows, at][:, None], cache)
        cache = v["cache"]
        np.testing.assert_allclose(logits, forced[rows, at], **TOL, err_msg=f"step {s}")


def test_gpu_kernels_that_take_no_sinks_are_refused():
    bf16 = jnp.bfloat16
    for kernel in ("cudnn", "cudnn_segments", "triton", "auto"):
        why = attention.flash_refusal(kernel, "gpu", bf16, 64, sinks=True)
        assert why and "sinks" in why and "\n" not in why, kernel
        assert not attention.uses_flash("auto", kernel, "gpu", bf16, 64, sinks=True)
    assert attention.uses_flash("auto", "cudnn", "gpu", bf16, 64)  # (without: flash)
    assert attention.flash_refusal("splash", "gpu", bf16, 64, sinks=True) is None
    assert attention.uses_flash("auto", "splash", "tpu", bf16, 64, sinks=True)
    for settings in (dict(attention="flash", flash_kernel="cudnn"),
                     dict(attention="flash", flash_kernel="triton"),
                     dict(attention="dot_product")):
        with pytest.raises(ValueError, match="sinks") as error:
            dataclasses.replace(CONFIG, **settings)
        assert "\n" not in str(error.value)
    dataclasses.replace(CONFIG, **SPLASH)  # (splash takes them)


def test_auto_runs_einsum_on_a_gpu_for_a_model_with_sinks(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    of = lambda sinks, use="auto": layers.MultiHeadAttention(  # noqa: E731
        num_heads=8, d_kv=16, dtype=jnp.bfloat16, implementation=use,
        options=layers.AttentionOptions(sinks=sinks))
    assert of(False)._path(True) == "flash" and of(True)._path(True) == "einsum"
    assert of(True, "dot_product")._path(True) == "einsum"


def _train(mesh, rules, steps=2, **settings):
    trainer = make_trainer(mesh, rules, config=dataclasses.replace(CONFIG, **settings))
    state = trainer.init_state()
    first, losses = jax.device_get(state.params), []
    for batch in packed_batches(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, first, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    return _train("", "")


def test_the_sinks_and_the_output_bias_train(one_device):
    losses, first, last = one_device
    for name in ("sinks", "o_bias"):
        before = nn.meta.unbox(first)["layer_1"]["self_attention"][name]
        after = nn.meta.unbox(last)["layer_1"]["self_attention"][name]
        assert not np.any(before) and np.abs(after).min() > 0, name


LAYOUTS = {
    "heads and kv heads split": ("batch:4;model:2", "batch:batch;heads:model;kv_heads:model",
                                 {}),
    # (the ring: the gathered form with sinks differs from it only inside
    # `context.local_attention`, which test_context_parallel_attention_with_sinks_is_the_
    # reference checks in both modes; a second model run of the same layout went)
    "length split, ring": ("batch:2;model:4", "batch:batch;length:model",
                           {"context_parallel": "ring"}),
    # (8 ways: each shard one query head, its kv head cut out of the whole ones)
    "splash, heads split 8 ways": ("model:8", "heads:model", SPLASH),
}
FAST_LAYOUTS = ("heads and kv heads split",)  # (the fast tier; the rest in the full suite)


@pytest.mark.parametrize("name", [
    n if n in FAST_LAYOUTS else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_layouts_give_one_devices_losses(one_device, name):
    mesh, rules, settings = LAYOUTS[name]
    losses = _train(mesh, rules, **settings)[0]
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)


@pytest.mark.parametrize("mode, kernel, length", [
    ("gather", None, 32), ("ring", None, 32),
    pytest.param("gather", "splash", 256, marks=pytest.mark.slow)])
def test_context_parallel_attention_with_sinks_is_the_reference(mode, kernel, length):
    """``length`` split 2 ways (splash: its 128 lanes a device), packed rows, grouped heads,
    causal with a window: the outputs' and the sinks' gradients are the reference's."""
    from mtrain.models import context
    from mtrain.parallel.layout import Layout
    from test_context_parallel import B, inputs, packed_ids

    q, k, v, cotangent = inputs(length=length)
    ids = packed_ids(length=length)
    cotangent = cotangent * (ids > 0)[:, :, None, None]
    sinks = 1 + 1.5 * jax.random.normal(jax.random.key(7), (q.shape[2],))
    mask = AttentionMask.of_self(jnp.asarray(ids), True).windowed(5)
    want = jax.value_and_grad(lambda *x: (reference(*x[:3], mask, scale=0.5, sinks=x[3])
                                          * cotangent).sum(), argnums=(0, 1, 2, 3))(
        q, k, v, sinks)
    layout = Layout("model:2", "length:model")
    mesh = layout.make_mesh(jax.devices()[:2])
    order = context.balanced_order(length, 2)
    index = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, length))
    placed = jnp.asarray(ids)[:, order]
    options = context.Options(causal=True, window=5, scale=0.5, mode=mode, kernel=kernel,
                              balanced=True)

    def split(q, k, v, sinks):
        with layout.activate(mesh):
            out = context.attend(q, k, v, context.Places(placed, placed, index, index),
                                 options, sinks=sinks)
        return (out * cotangent[:, order]).sum()

    got = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2, 3)))(
        *(x[:, order] for x in (q, k, v)), sinks)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    undo = np.argsort(order)
    for name, g, w in zip("qkv", got[1], want[1]):
        np.testing.assert_allclose(g[:, undo], w, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(got[1][3], want[1][3], atol=2e-5, err_msg="sinks")
