"""--mode=plan with ``transformer.quantization``: the projections' FLOPs at the format's peak,
their casts through HBM, and the verdict against the same step in bf16."""

import dataclasses
import json
import re

import jax
import optax
import pytest

from mtrain.__main__ import main
from mtrain.models.latent_attention import LatentConfig
from mtrain.models.moe import MoEConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.parallel.targets import TARGETS, Target
from mtrain.planning import planner, quantized
from mtrain.training.trainer import Trainer

H100 = TARGETS["h100"]
TINY = TransformerConfig(vocab_size=1024, d_model=64, d_ff=512, num_heads=8, d_kv=16,
                         num_layers=2, max_length=64, activation_dtype="bfloat16",
                         quantization="fp8")
# configs/models/llama_1b.gin, its layers scanned: one layer's body to compile. A GPU plan's
# memory and step are the step model's, which plans a scanned stack as the unrolled one.
LLAMA_1B = ["--mode=plan", "--gin_file=tasks/lm1b.gin", "--gin_file=models/llama_1b.gin",
            "--gin_param=transformer.scan_layers=True", "--format=json"]


def cli_plan(capsys, *args) -> tuple[dict, str]:
    """``python -m mtrain --mode=plan ... --format=json`` in this process: (the report, the
    plan's text)."""
    assert main([*LLAMA_1B, *args]) == 0
    report = json.loads(capsys.readouterr().out)
    fields = {k: v for k, v in report.items() if k != "model"}
    return report, planner.format_plan(planner.Plan(**fields))


def make_plan(config, target, mesh_shape="", rules="", batch=16, length=64, compiled=None):
    layout = Layout(mesh_shape, rules, drop_unused_rules=True)
    trainer = Trainer(model=DecoderLM(config), optimizer=optax.adafactor(1e-3), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=batch,
                      sequence_length=length)
    compiled = compiled or trainer.compile_train_step()
    return planner.plan(trainer, target, compiled=compiled), compiled


def test_each_target_has_the_low_precision_peaks_of_its_data_sheet():
    assert H100.peak_of("fp8") == H100.peak_of("int8") == (1979e12, True)
    assert TARGETS["h200"].peak_of("fp8") == (1979e12, True)
    assert TARGETS["tpu-v5e"].peak_of("int8") == (393e12, True)
    assert TARGETS["tpu-v5p"].peak_of("int8") == (918e12, True)
    # no rate of their own: v5p's fp8 (459, its bf16 rate), v4's int8 (275, its bf16 rate)
    for name, fmt in (("tpu-v5p", "fp8"), ("tpu-v4", "int8"), ("tpu-v3", "int8"),
                      ("tpu-v5e", "fp8"), ("h100", "none")):
        assert TARGETS[name].peak_of(fmt) == (TARGETS[name].peak_flops, False)
    # a target made as before the formats' peaks: everything at its bf16 peak
    plain = Target("x", "GPU", 100e12, 1e9, 1e9, 1e9)
    assert plain.peak_of("fp8") == plain.peak_of("int8") == (100e12, False)


def test_the_quantized_projections_are_counted_by_hand():
    """Attention's q, k, v, o and the feed-forward projections, not the logits nor the
    attention's own products; experts only where dispatched by capacity (and the shared)."""
    d, f, h, k, layers, v = 64, 512, 8, 16, 2, 1024
    config = dataclasses.replace(TINY, activation_dtype="float32")
    per_layer = 2 * d * (h + h) * k + 2 * d * f
    assert quantized.projection_parameters(config, "lm") == layers * per_layer
    parts = quantized.flops(config, "lm", 16, 64)
    tokens = 16 * 64
    assert parts == {"projections": 6 * layers * per_layer * tokens,
                     "the logits": 6 * v * d * tokens}
    # what is left of the model's count is attention's scores and sums
    scores = layers * 12 * 64 * h * k * tokens
    assert sum(parts.values()) + scores == DecoderLM(config).analytic_flops(16, 64)
    # casts: per token a projection [i, o] casts its input (i: q's, which k and v read too)
    # and its output's gradient twice (2 o), and the weights once; a float32 operand read
    # twice and written as a byte
    widths = layers * ((d + 3 * 2 * h * k) + (h * k + 2 * d) + (d + 2 * f) + (f + 2 * d))
    casts = (tokens * widths + layers * per_layer) * (2 * 4 + 1)
    assert quantized.cast_bytes(config, "lm", 16, 64) == casts
    rowwise = dataclasses.replace(config, quantization_scaling="rowwise")
    assert quantized.cast_bytes(rowwise, "lm", 16, 64) == casts
    # SwiGLU and 2 of 8 key/value heads: three feed-forward matrices, smaller k and v
    llama = dataclasses.replace(config, num_kv_heads=2, mlp_activations=("silu", "linear"))
    assert quantized.projection_parameters(llama, "lm") == layers * (
        2 * d * (h + 2) * k + 3 * d * f)
    # (wi_0 and wi_1 read one input, cast once)
    widths = layers * ((d + 2 * h * k) + 2 * 2 * 2 * k + (h * k + 2 * d) + (d + 2 * f) + 2 * f
                       + (f + 2 * d))
    assert quantized.cast_bytes(llama, "lm", 16, 64) == (
        tokens * widths + quantized.projection_parameters(llama, "lm", False)) * 9
    # experts every other layer, 4 of d_ff 128, top-2, one shared: capacity dispatch
    # quantizes a token's two experts and the shared one; dropless only the shared one
    moe = MoEConfig(num_experts=4, top_k=2, expert_d_ff=128, num_shared_experts=1)
    capacity = dataclasses.replace(config, moe_every=2, moe=moe)
    dropless = dataclasses.replace(capacity, moe=dataclasses.replace(moe, dispatch="dropless"))
    attention, dense = 2 * d * (h + h) * k, 2 * d * f
    assert quantized.projection_parameters(capacity, "lm") == (
        2 * attention + dense + 3 * 2 * d * 128)
    assert quantized.projection_parameters(dropless, "lm") == 2 * attention + dense + 2 * d * 128
    assert quantized.flops(dropless, "lm", 16, 64)["the experts (bf16)"] == 6 * tokens * (
        2 * 2 * d * 128 + d * 4)  # two routed experts and the router
    # all the weights cast: the capacity-dispatched layer casts its 4 experts' and the shared
    assert quantized.projection_parameters(capacity, "lm", active=False) == (
        2 * attention + dense + 5 * 2 * d * 128)
    # casts of the capacity-dispatched layer: a token's top_k x capacity factor slots in
    # the experts, and its pass through the shared one, in place of the dense block
    slots = 2 * moe.capacity_factor_train
    expert = (d + 2 * 128) + (128 + 2 * d)
    widths = (2 * ((d + 3 * 2 * h * k) + (h * k + 2 * d)) + (d + 2 * f) + (f + 2 * d)
              + (1 + slots) * expert)
    assert quantized.cast_bytes(capacity, "lm", 16, 64) == (
        tokens * widths + quantized.projection_parameters(capacity, "lm", False)) * 9
    # latent attention: q_a [d, 16], q_b [16, h (8 + 4)], kv_a [d, 16 + 4], kv_b [16,
    # h (8 + 8)], o [h 8, d]
    mla = LatentConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8)
    latent = dataclasses.replace(config, latent_attention=True, mla=mla,
                                 position_encoding="rotary")
    weights = (d * 16 + 16 * h * 12) + d * 20 + 16 * h * 16 + h * 8 * d
    assert quantized.projection_parameters(latent, "lm") == layers * (weights + 2 * d * f)
    widths = layers * ((d + 2 * 16) + (16 + 2 * h * 12) + 2 * 20 + (16 + 2 * h * 16)
                       + (h * 8 + 2 * d) + (d + 2 * f) + (f + 2 * d))  # (kv_a reads q_a's x)
    assert quantized.cast_bytes(latent, "lm", 16, 64) == (
        tokens * widths + layers * (weights + 2 * d * f)) * (2 * 4 + 1)
    # every weight the casts count is a quantized projection's, each once
    for c in (config, llama, capacity, dropless, latent):
        assert sum(p[3] * p[0] * p[1] for p in quantized.projections(c, "lm")) == (
            quantized.projection_parameters(c, "lm", active=False))


def test_each_device_casts_what_it_holds_and_remat_casts_the_forward_again():
    """Per device: an operand divided by the devices that split it, a replicated one whole
    (data parallelism's weights on every replica); remat 'dots' and 'full' recompute the
    forward's casts (the inputs' and the weights') in the backward pass."""
    d, f, h, k, layers, tokens = 64, 512, 8, 16, 2, 16 * 64
    config = dataclasses.replace(TINY, activation_dtype="float32")
    hk = h * k
    inputs, gradients = layers * tokens * (d + hk + d + f), layers * tokens * 2 * (
        3 * hk + d + f + d)
    weights = layers * (4 * d * hk + 2 * d * f)
    assert quantized.cast_bytes(config, "lm", 16, 64) == (inputs + gradients + weights) * 9
    # batch:8: a device's tokens an eighth, its weights all of them
    data = Layout("batch:8", "batch:batch")
    assert quantized.cast_bytes(config, "lm", 16, 64, layout=data) == (
        (inputs + gradients) / 8 + weights) * 9
    # batch:2, heads and d_ff 4 ways: q, k, v's input and wi's whole on each of the 4, their
    # outputs' gradients a quarter; o's and wo's inputs a quarter, their gradients whole
    model = Layout("batch:2;model:4", "batch:batch;d_ff:model;heads:model")
    half = tokens / 2
    per_layer = (half * (d + hk / 4 + d + f / 4) + 2 * half * (3 * hk / 4 + d + f / 4 + d)
                 + weights / layers / 4)
    assert quantized.cast_bytes(config, "lm", 16, 64, layout=model) == layers * per_layer * 9
    # two microbatches: the weights twice; remat: the inputs and weights twice
    assert quantized.cast_bytes(config, "lm", 16, 64, 2) == (
        inputs + gradients + 2 * weights) * 9
    for policy in ("dots", "full"):
        again = dataclasses.replace(config, remat_policy=policy)
        assert quantized.cast_bytes(again, "lm", 16, 64) == (
            2 * inputs + gradients + 2 * weights) * 9


@pytest.mark.slow  # (about 10 s: two plans compiled; the fast tier keeps llama_tiny's verdict)
def test_llama_1b_in_fp8_on_an_h100_pays_against_bf16(capsys):
    """The projections (78% of llama_1b's FLOPs) at twice the bf16 rate, plus their casts:
    faster than bf16, by less than 2x; the memory unchanged."""
    bf16, _ = cli_plan(capsys, "--target=h100")
    fp8, text = cli_plan(capsys, "--target=h100", "--gin_param=transformer.quantization='fp8'")
    assert bf16["quantization"] == {}
    q = fp8["quantization"]
    layers, d, f, tokens = 16, 2048, 5504, 16 * 2048
    projections = layers * (2 * d * (16 + 4) * 128 + 3 * d * f)
    share = 6 * projections * tokens / fp8["analytic_flops"]
    assert q["projection_share"] == pytest.approx(share, rel=1e-12) and 0.7 < share < 0.85
    assert fp8["compute_seconds"] == pytest.approx(
        bf16["compute_seconds"] * (1 - share + share * 989 / 1979), rel=1e-12)
    # remat 'dots': the inputs and weights cast twice; k and v read q's input, wi_1 wi_0's
    inputs = layers * (d + 16 * 128 + d + f)
    gradients = layers * 2 * ((16 + 4 + 4) * 128 + d + 2 * f + d)
    casts = (tokens * (2 * inputs + gradients) + 2 * projections) * (2 * 2 + 1) / (
        H100.hbm_bandwidth)
    assert q["cast_seconds"] == pytest.approx(casts, rel=1e-12)
    # one device, flash attention: the step is its matmuls (and casts)
    assert q["bf16_step_seconds"] == pytest.approx(bf16["step_seconds"], rel=1e-12)
    assert fp8["step_seconds"] == pytest.approx(fp8["compute_seconds"] + casts, rel=1e-12)
    assert 1.1 < bf16["step_seconds"] / fp8["step_seconds"] < 2
    assert q["pays"] and q["speedup"] == pytest.approx(bf16["step_seconds"] / fp8["step_seconds"])
    assert fp8["total_bytes"] == bf16["total_bytes"]
    assert (f"  fp8 pays: {q['speedup']:.2f}x on the step (step "
            f"~{planner.seconds_text(fp8['step_seconds'])} against bf16's "
            f"{planner.seconds_text(bf16['step_seconds'])}") in text
    assert "quantization fp8 (tensorwise): fp8 at 1979 TFLOP/s against bf16's 989" in text


@pytest.mark.slow  # (8 s: two plans compiled; the verdicts' own tests stay fast)
def test_the_verdicts_bf16_step_is_the_bf16_plans(capsys):
    """The step the verdict weighs the quantized one against is what `--mode=plan` prints for
    the same run in bf16 on a TPU, whose time comes from the compiled program: the bf16
    program is compiled too (on a GPU: llama_1b's test above). llama_tiny's step is
    memory-bound on a v5e: int8's casts add to its memory traffic and make it slower."""
    run = ["--mode=plan", "--gin_file=tasks/lm1b.gin", "--gin_file=models/llama_tiny.gin",
           "--target=tpu-v5e"]
    assert main(run) == 0
    step = re.search(r"^  step ~(.+?), ([\d,]+) tokens/s", capsys.readouterr().out, re.M)
    assert main([*run, "--gin_param=transformer.quantization='int8'", "--format=json"]) == 0
    report = json.loads(capsys.readouterr().out)
    q = report["quantization"]
    text = planner.format_plan(planner.Plan(**{k: v for k, v in report.items() if k != "model"}))
    assert f"against bf16's {step.group(1)}, " in text
    assert f" tokens/s against {step.group(2)})" in text
    assert planner.seconds_text(q["bf16_step_seconds"]) == step.group(1)
    # memory above the compute: the casts on top of it
    assert q["bound"] == "memory traffic" and not q["pays"]
    assert q["step_seconds"] == pytest.approx(
        report["memory_seconds"] + q["cast_seconds"], rel=1e-12)
    assert q["speedup"] < 1 and report["memory_seconds"] > report["compute_seconds"]


@pytest.mark.slow  # (about 10 s: two plans compiled; the fast tier keeps llama_tiny's verdict)
def test_fp8_does_not_pay_where_the_collectives_bound_the_step():
    """A tiny model data-parallel over 8 GPUs: the gradients' all-reduce takes longer than
    its matmuls, which fp8 speeds up; the step barely moves. Tensorwise scaling all-reduces
    each split operand's absolute maximum: more all-reduces than bf16, which the plan
    counts and names."""
    p, _ = make_plan(TINY, H100, "batch:8", "batch:batch")
    bf16, _ = make_plan(dataclasses.replace(TINY, quantization="none"), H100, "batch:8",
                        "batch:batch")
    q = p.quantization
    assert p.communication_seconds > 10 * p.compute_seconds
    assert not q["pays"] and q["bound"] == "collectives" and q["speedup"] < quantized.PAYS
    assert q["bf16_step_seconds"] == bf16.step_seconds
    more = p.collectives["all-reduce"]["count"] - bf16.collectives["all-reduce"]["count"]
    assert q["scale_all_reduces"] == more > 0
    assert p.communication_seconds > bf16.communication_seconds
    text = planner.format_plan(p)
    assert "  fp8 does not pay here: the step is bound by collectives, " in text
    assert f"  tensorwise scaling: {more} all-reduces more than bf16 " in text
    # each replica casts all its weights: more than an eighth of all of them
    assert q["cast_seconds"] == quantized.cast_bytes(
        TINY, "lm", 16, 64, layout=Layout("batch:8", "batch:batch")) / H100.hbm_bandwidth
    assert q["cast_seconds"] > quantized.cast_bytes(TINY, "lm", 16, 64) / 8 / H100.hbm_bandwidth


@pytest.mark.slow  # (about 10 s: two plans compiled; the fast tier keeps llama_tiny's verdict)
def test_int8_pays_on_a_tpu_v5e_and_has_no_rate_on_a_tpu_v4():
    """One compiled step planned for both: v5e's 393 TOPS int8 against its 197 bf16 speed up
    the projections; a v4 runs int8 at its bf16 rate, and the casts make it slower."""
    config = TransformerConfig(vocab_size=8192, d_model=2048, d_ff=8192, num_heads=16,
                               d_kv=128, num_layers=2, max_length=512,
                               activation_dtype="bfloat16", quantization="int8")
    v5e, compiled = make_plan(config, TARGETS["tpu-v5e"], batch=8, length=512)
    v4, _ = make_plan(config, TARGETS["tpu-v4"], batch=8, length=512, compiled=compiled)
    bf16, _ = make_plan(dataclasses.replace(config, quantization="none"), TARGETS["tpu-v4"],
                        batch=8, length=512)
    q = v5e.quantization
    assert q["own_rate"] and q["pays"] and quantized.PAYS <= q["speedup"] < 2
    assert q["peak_flops"] == 393e12 and v5e.step_seconds == q["step_seconds"]
    assert "int8 pays: " in planner.format_plan(v5e)
    q = v4.quantization
    assert not q["own_rate"] and not q["pays"] and q["peak_flops"] == 275e12
    # the bf16 program's compute, memory and step; the casts on top
    assert q["compute_seconds"] == bf16.compute_seconds == pytest.approx(
        max(bf16.xla_flops, bf16.matmul_flops) / 275e12)
    assert q["bf16_step_seconds"] == bf16.step_seconds and v4.memory_seconds == bf16.memory_seconds
    assert q["step_seconds"] == pytest.approx(bf16.step_seconds + q["cast_seconds"], rel=1e-12)
    text = planner.format_plan(v4)
    assert "tpu-v4 has no int8 rate above its bf16 peak: int8 runs at the bf16 rate" in text
    assert "  int8 does not pay here: no int8 rate on tpu-v4, " in text
