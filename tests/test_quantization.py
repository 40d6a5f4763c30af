"""Low-precision matmuls (`transformer.quantization`, `models.quantization`): a quantized
projection and its gradients within the format's rounding error of float32 (bounds derived
below, not tuned), each projection quantized and nothing else, layouts change no loss,
the settings checked in one line. The command line's journey (fp8 trains llama_tiny as
bf16 does, checkpoints keep float32, resume bit for bit, every mode) is
test_quantization_runs.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models.quantization import Quantization
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.losses import LossConfig
from mtrain.training.trainer import Trainer

# What rounding one value to a format can cost, as (u, h, qmax): |q(x) - x| <= u |x| + h s,
# where s = absmax / qmax is the scale of the values x shares it with (the whole tensor, or
# its row). A float with m mantissa bits rounds a normal number to within half a spacing,
# 2^-(m+1) of its magnitude (u); below the smallest normal the spacing is fixed: e4m3's
# subnormals are 2^-9 apart (h = 2^-10), e5m2's 2^-16 (h = 2^-17). int8 rounds x / s to an
# integer: within half a unit (h = 1/2), no relative term.
ROUNDING = {"e4m3": (2.0**-4, 2.0**-10, 448.0), "e5m2": (2.0**-3, 2.0**-17, 57344.0),
            "int8": (0.0, 0.5, 127.0)}
FORWARD = {"fp8": "e4m3", "int8": "int8"}
BACKWARD = {"fp8": "e5m2", "int8": "int8"}
# The unit roundoff of the dtype the quantization computes in: float32's, or bf16's for fp8
# of bf16 operands (int8 computes in float32 whatever they are: `Quantization.einsum`).
ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-9}


def scale(x, fmt, axis):
    """The scale of `x` in `fmt` (absmax / qmax) over `axis` (None: the whole tensor)."""
    return np.abs(x).max(axis=axis, keepdims=axis is not None) / ROUNDING[fmt][2]


def rounding_error(x, fmt, axis, r=0.0):
    """The bound on |q(x) - x| elementwise, `x`'s scale over `axis`; `r`: the unit roundoff
    of the arithmetic before the format's rounding (the division by the scale, and a product
    by another operand's scale: (1 + u)(1 + r)^2 - 1 relative, the scale itself within r)."""
    u, h, _ = ROUNDING[fmt]
    return ((1 + u) * (1 + r) ** 2 - 1) * np.abs(x) + h * (1 + r) * scale(x, fmt, axis)


def accumulation(a, b):
    """float32's rounding of sums of K products of |a| [., K] and |b| [K, .]."""
    return 2 * a.shape[1] * ROUNDOFF["float32"] * (np.abs(a) @ np.abs(b))


def bounds(mode, rows, x, w, dy, r):
    """Bounds on the errors of y = x w, dx = dy w^T and dw = x^T dy as qwix computes them:
    x and w quantized per row and per column (rowwise; else one scale each); dx from the
    quantized product g = dy s_w (w's scales folded into the gradient, g per row) times the
    quantized weight's values ŵ / s_w; dw from g = s_x dy (x's scales folded in, g per
    column) times x̂ / s_x."""
    fwd, bwd = FORWARD[mode], BACKWARD[mode]
    sx, sw = scale(x, fwd, 1 if rows else None), scale(w, fwd, 0 if rows else None)
    ex, ew = rounding_error(x, fwd, 1 if rows else None, r), rounding_error(
        w, fwd, 0 if rows else None, r)
    big_x, big_w = np.abs(x) + ex, np.abs(w) + ew
    y = ex @ np.abs(w) + big_x @ ew + accumulation(big_x, big_w)
    g = dy * sw
    qw = big_w / sw
    dx = rounding_error(g, bwd, 1 if rows else None, r) @ qw.T + np.abs(dy) @ ew.T
    dx += accumulation(g, qw.T)
    g = sx * dy
    qx = big_x / sx
    dw = qx.T @ rounding_error(g, bwd, 0 if rows else None, r) + ex.T @ np.abs(dy)
    dw += accumulation(qx.T, g)
    return y, dx, dw


def operands(outlier=1.0, dtype=np.float32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 96)).astype(np.float32)
    w = (rng.standard_normal((96, 48)) * 0.1).astype(np.float32)
    x[3] *= outlier  # one token's activations larger than the rest's
    dy = rng.standard_normal((32, 48)).astype(np.float32)
    # (bf16 operands: their values, exactly, in float32 for the references)
    return (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (x, w, dy))


def quantized(mode, scaling, x, w, dy, dtype=jnp.float32):
    quantization = Quantization(mode=mode, scaling=scaling)
    y, vjp = jax.vjp(lambda x, w: quantization.einsum("td,df->tf", x, w),
                     jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    return (np.asarray(jnp.asarray(a, jnp.float32)) for a in (y, *vjp(jnp.asarray(dy, dtype))))


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_projection_and_its_gradients_are_within_the_formats_error(mode, scaling, dtype):
    """y = x w in the forward format; dx = dy w^T and dw = x^T dy with the gradient in the
    backward format and x, w as the forward pass quantized them: each within the bound of
    its operands' rounding (`bounds`; bf16 operands: their arithmetic's rounding before the
    format's, and the result's rounding to bf16), and not exact (the matmuls are quantized)."""
    x, w, dy = operands(dtype=dtype)
    y, dx, dw = quantized(mode, scaling, x, w, dy, dtype)
    r = ROUNDOFF[dtype if mode == "fp8" else "float32"]
    out = ROUNDOFF[dtype] if dtype == "bfloat16" else 0.0  # (the results rounded to bf16)
    for got, exact, bound in zip((y, dx, dw), (x @ w, dy @ w.T, x.T @ dy),
                                 bounds(mode, scaling == "rowwise", x, w, dy, r)):
        assert np.all(np.abs(got - exact) <= bound + out * (np.abs(exact) + bound))
        assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("mode, outlier", [("fp8", 1e5), ("int8", 1e3)])
def test_rowwise_scales_each_token_on_its_own(mode, outlier):
    """One token far larger than the others: rowwise keeps the others within their own
    rows' bound; one scale for the tensor spends the format's range on the outlier and does
    not. (int8's range is 127 steps: 1000x leaves the others a few; e4m3's exponent spans
    448 / 2^-6 ~ 3e4 before its subnormals: 1e5x pushes the others below its normals.)"""
    x, w, dy = operands(outlier)
    row_bound = bounds(mode, True, x, w, dy, ROUNDOFF["float32"])[0]
    others = np.arange(len(x)) != 3
    for scaling, within in [("rowwise", True), ("tensorwise", False)]:
        y, _, _ = quantized(mode, scaling, x, w, dy)
        assert np.all(np.abs(y - x @ w)[others] <= row_bound[others]) == within, scaling


TINY = dict(vocab_size=64, d_model=16, d_ff=32, num_heads=2, d_kv=8, num_layers=2,
            max_length=16, position_encoding="rotary", mlp_activations=("silu", "linear"))
MOE = dict(moe_every=2, moe={"num_experts": 4, "dispatch": "capacity"})
MLA = dict(latent_attention=True, mla={"q_lora_rank": 8, "kv_lora_rank": 8,
                                       "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                                       "v_head_dim": 8})


def config(quantization="fp8", scaling="tensorwise", **settings):
    from mtrain.models.latent_attention import LatentConfig
    from mtrain.models.moe import MoEConfig

    settings = {**TINY, **settings}
    if "moe" in settings:
        settings["moe"] = MoEConfig(**settings["moe"])
    if "mla" in settings:
        settings["mla"] = LatentConfig(**settings["mla"])
    return TransformerConfig(**settings, quantization=quantization,
                             quantization_scaling=scaling)


@pytest.mark.parametrize("settings, projections", [
    ({}, 2 * 7),  # q, k, v, o, wi_0, wi_1, wo per layer
    (MOE, 2 * 7),  # the experts' wi_0, wi_1, wo (capacity: einsums); not the router
    (MLA, 2 * 8)])  # q_a, q_b, kv_a, kv_b, o and the feed-forward layer's three
def test_each_projection_is_quantized_and_nothing_else(settings, projections):
    """The forward pass quantizes two operands per projection (the activations and the
    weight) and nothing more: not the embeddings, the logits, q.k or p.v, the router."""
    targets = jnp.ones((2, 16), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))

    def converts(c, dtype):
        model = DecoderLM(c)
        variables = jax.eval_shape(lambda: model.init(jax.random.key(0), targets, targets,
                                                      positions))
        text = str(jax.make_jaxpr(lambda v: model.apply(v, targets, targets, positions))(
            variables))
        return text.count(f"new_dtype={dtype}")

    assert converts(config("fp8", **settings), "float8_e4m3fn") == 2 * projections
    assert converts(config("int8", "rowwise", **settings), "int8") == 2 * projections
    assert converts(config("none", **settings), "float8_e4m3fn") == 0


B, L = 8, 16
SPLIT = "batch:batch;heads:model;d_ff:model;vocab:model"


def losses(c, mesh_shape="", rules="", parameter_rules="", params=None, steps=2):
    layout = Layout(mesh_shape, rules, parameter_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=2))
    trainer = Trainer(model=DecoderLM(c), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=B, sequence_length=L, seed=3,
                      objective=LanguageModeling(LossConfig(z_loss=0.0)))
    state = trainer.init_state() if params is None else trainer.start_from(params)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        targets = rng.integers(1, TINY["vocab_size"], (B, L)).astype(np.int32)
        batch = {"targets": targets, "targets_segment_ids": np.ones_like(targets),
                 "targets_positions": np.broadcast_to(np.arange(L), (B, L)).astype(np.int32)}
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        out.append(float(metrics["loss"]))
    return out, jax.device_get(state.params)


@pytest.mark.slow  # (about 12 s each: two trainers)
@pytest.mark.parametrize("scaling, mesh_shape, rules, parameter_rules", [  # (pairwise; a
    ("rowwise", "batch:4;model:2", SPLIT, ""),  # tensor-wide amax over SPLIT: delayed's
    ("tensorwise", "batch:8", "batch:batch", "d_model:batch")])  # (FSDP: d_model over batch)
def test_layouts_change_no_loss(scaling, mesh_shape, rules, parameter_rules):
    """fp8 from the same parameters: the same losses over 2 steps on one device and split
    (a tensor's absmax is a max: the same over any split; the sums in another order move
    float32's last bits, which may move a value across a rounding boundary of the format,
    one quantum of one element of a sum: the layout-invariance tests' 1e-5 holds the loss).
    Parameters stay float32."""
    c = config("fp8", scaling, activation_dtype="float32")
    params, reference, dtypes = one_device_fp8(scaling)
    got, _ = losses(c, mesh_shape, rules, parameter_rules, params=params)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    assert dtypes == {np.dtype(np.float32)}


@functools.cache
def one_device_fp8(scaling):
    """(the initial parameters, the losses of 2 steps, the trained parameters' dtypes) of
    `test_layouts_change_no_loss`'s model on one device, once for every layout."""
    c = config("fp8", scaling, activation_dtype="float32")
    _, params = losses(c, steps=0)
    reference, trained = losses(c, params=params)
    return params, reference, {x.dtype for x in jax.tree_util.tree_leaves(trained)}


def test_settings_are_checked_in_one_line():
    for settings, words in [(dict(quantization="fp4"), "transformer.quantization must be one "
                             "of none, fp8, int8, got 'fp4'"),
                            (dict(quantization_scaling="columnwise"),
                             "transformer.quantization_scaling must be one of tensorwise, "
                             "rowwise, delayed, got 'columnwise'")]:
        with pytest.raises(ValueError) as error:
            TransformerConfig(**settings)
        assert str(error.value) == words
