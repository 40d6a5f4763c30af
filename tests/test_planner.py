"""--mode=plan: the train step compiled ahead of time for a mesh, and what it costs."""

import dataclasses
import io
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import optax
import pytest

from conftest import no_compilation_cache, split_import_times
from mtrain.planning import planner
from mtrain import run as run_lib
from mtrain.__main__ import main
from mtrain.modes.plan import plan
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.parallel.targets import TARGETS
from mtrain.training.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TransformerConfig(vocab_size=1024, d_model=64, d_ff=512, num_heads=8, d_kv=16,
                           num_layers=2, max_length=64)
RULES = "batch:batch;d_ff:model;heads:model;vocab:model"
V3 = TARGETS["tpu-v3"]


def make_plan(mesh_shape, rules=RULES, config=CONFIG, target=V3):
    layout = Layout(mesh_shape, rules, drop_unused_rules=True)
    trainer = Trainer(model=DecoderLM(config), optimizer=optax.adafactor(1e-3), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=16,
                      sequence_length=64)
    return trainer, planner.plan(trainer, target)


def test_collectives_are_parsed_from_hlo_text():
    hlo = "\n".join([
        "  %all-reduce.1 = f32[16,32,64]{2,1,0} all-reduce(%x), channel_id=2, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add",
        "  %all-reduce.2 = (f32[64,512]{1,0}, bf16[8]{0}, f32[]) all-reduce(%a, %b, %c), "
        "replica_groups=[2,4]<=[8], to_apply=%add",
        "  ROOT %all-gather.3 = f32[8,64]{1,0} all-gather(%y), dimensions={0}, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}",
        "  %reduce-scatter = f32[4,64]{1,0} reduce-scatter(%z), replica_groups={}, dimensions={0}",
        "  %collective-permute = s32[10]{0} collective-permute(%w), source_target_pairs={{0,1}}",
        "  %add = f32[16,32,64]{2,1,0} add(%all-reduce.1, %all-reduce.1)",
        "  %trivial = f32[8]{0} all-reduce(%v), replica_groups={{0},{1}}, to_apply=%add",
    ])
    stats = hlo_cost(hlo, num_devices=8, parameter_shapes={(64, 512)}).collectives
    ar, ag = stats["all-reduce"], stats["all-gather"]
    # Groups of 4: an all-reduce sends 2 x 3/4 of its bytes; groups of one are no collective.
    assert ar.count == 2
    assert ar.bytes_sent == 1.5 * (16 * 32 * 64 * 4 + 64 * 512 * 4 + 8 * 2 + 4)
    assert ar.parameter_shaped_bytes == 1.5 * 64 * 512 * 4
    assert (ag.count, ag.bytes_sent) == (1, 0.5 * 8 * 64 * 4)
    # Empty groups are all 8 devices: a reduce-scatter producing B bytes sends 7 B.
    assert stats["reduce-scatter"].bytes_sent == 7 * 4 * 64 * 4
    assert stats["collective-permute"].bytes_sent == 40 and stats["all-to-all"].count == 0


def test_loops_count_per_iteration_and_conditionals_once():
    hlo = "\n".join([
        "%fused_dot (param_0: f32[16,64], param_1: f32[64,32]) -> f32[16,32] {",
        "  %param_0 = f32[16,64]{1,0} parameter(0)",
        "  %param_1 = f32[64,32]{1,0} parameter(1)",
        "  ROOT %dot.1 = f32[16,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, "
        "rhs_contracting_dims={0}",
        "}",
        "%body (p: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {",
        "  %x = f32[16,64]{1,0} parameter(0)",
        "  %w = f32[64,32]{1,0} constant({...})",
        "  %f = f32[16,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot",
        "  %ar = f32[16,32]{1,0} all-reduce(%f), replica_groups=[4,2]<=[8], to_apply=%add",
        "}",
        "%hop_a (p: f32[10]) -> f32[10] {",
        "  ROOT %cp = f32[10]{0} collective-permute(%p), source_target_pairs={{0,1}}",
        "}",
        "%hop_b (p: f32[10]) -> f32[10] {",
        "  ROOT %cp.1 = f32[10]{0} collective-permute(%p), source_target_pairs={{0,2}}",
        "}",
        "ENTRY %main (a: f32[16,64]) -> f32[16,32] {",
        "  %while.1 = (s32[], f32[16,32]{1,0}) while(%t), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"3"}}',
        "  %c = f32[10]{0} conditional(%i, %p, %p), branch_computations={%hop_a, %hop_b}",
        "  ROOT %dot.2 = f32[16,16]{1,0} dot(f32[16,64]{1,0} %a, f32[64,16]{1,0} %b), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
    ])
    cost = hlo_cost(hlo, num_devices=8)
    ar = cost.collectives["all-reduce"]
    # The loop's all-reduce (groups of 2: sends its bytes once) runs 3 times; one hop runs.
    assert (ar.count, ar.bytes_sent) == (3, 3 * 16 * 32 * 4)
    assert cost.collectives["collective-permute"].count == 1
    # 2 x 16 x 32 x 64 per loop iteration, plus the entry's dot (operand shapes inline).
    assert cost.matmul_flops == 3 * 2 * 16 * 32 * 64 + 2 * 16 * 16 * 64


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_scanned_and_microbatched_steps_are_planned_per_iteration():
    _, plain = make_plan("batch:4;model:2")
    _, scanned = make_plan("batch:4;model:2", config=dataclasses.replace(
        CONFIG, scan_layers=True))
    # XLA's cost analysis sees the scanned layer once; the planner counts every layer.
    assert scanned.xla_flops < 0.8 * plain.xla_flops
    for p in (plain, scanned):
        assert p.matmul_flops == pytest.approx(p.analytic_flops / 8, rel=1e-6)
        assert p.compute_seconds >= p.matmul_flops / V3.peak_flops
    assert scanned.collectives["all-reduce"]["bytes_sent"] == pytest.approx(
        plain.collectives["all-reduce"]["bytes_sent"], rel=1e-3)
    # Four microbatches: the same matmuls, and no less gradient traffic than one batch.
    layout = Layout("batch:4;model:2", RULES, drop_unused_rules=True)
    trainer = Trainer(model=DecoderLM(CONFIG), optimizer=optax.adafactor(1e-3), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:8]), batch_size=16, sequence_length=64,
                      num_microbatches=4)
    micro = planner.plan(trainer, V3)
    assert micro.matmul_flops == pytest.approx(plain.matmul_flops, rel=1e-6)
    assert micro.collectives["all-reduce"]["parameter_shaped_bytes"] >= \
        plain.collectives["all-reduce"]["parameter_shaped_bytes"]


def test_data_parallel_plan_all_reduces_the_gradients():
    trainer, p = make_plan("batch:8")
    params = jax.tree_util.tree_leaves(trainer.abstract_state.params)
    assert p.parameters == sum(x.size for x in params)
    assert p.parameter_bytes == 4 * p.parameters  # every device holds every parameter
    ar = p.collectives["all-reduce"]
    # Each gradient is all-reduced over the 8 replicas: 2 x 7/8 of the parameter bytes, and
    # nothing else of size (only the loss and metric scalars).
    assert ar["parameter_shaped_bytes"] == pytest.approx(2 * 7 / 8 * p.parameter_bytes)
    assert ar["bytes_sent"] - ar["parameter_shaped_bytes"] < 100
    # XLA's count agrees with 6 x params x tokens + attention, per device.
    assert p.xla_flops == pytest.approx(p.analytic_flops / 8, rel=0.1)
    assert p.fits and p.step_seconds == pytest.approx(
        max(p.compute_seconds, p.memory_seconds) + p.communication_seconds)


def test_model_parallel_plan_all_reduces_activations_and_splits_parameters():
    trainer, dp = make_plan("batch:8")
    _, mp = make_plan("model:8")
    ar = mp.collectives["all-reduce"]
    # Mesh-TF's analysis: splitting d_ff and heads makes every layer all-reduce its
    # [batch, length, d_model] output, forward and backward; no gradient is all-reduced.
    activation = 16 * 64 * CONFIG.d_model * 4
    assert ar["parameter_shaped_bytes"] == 0
    assert ar["bytes_sent"] >= 2 * 7 / 8 * activation * CONFIG.num_layers * 2 * 2
    # Per-device parameter bytes shrink by the model-axis size, but for the parameters that
    # have no d_ff, heads or vocab dimension (position embedding, norm scales).
    names = nn.get_partition_spec(jax.eval_shape(trainer._init_variables, trainer.init_key))
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    replicated = sum(
        4 * leaf.size for spec, leaf in zip(
            jax.tree_util.tree_leaves(names["params"], is_leaf=is_spec),
            jax.tree_util.tree_leaves(trainer.abstract_state.params))
        if not {"d_ff", "heads", "vocab"} & set(spec))
    assert 0 < replicated < dp.parameter_bytes / 20
    assert mp.parameter_bytes == (dp.parameter_bytes - replicated) / 8 + replicated
    _, mp4 = make_plan("batch:2;model:4")
    assert mp4.parameter_bytes == (dp.parameter_bytes - replicated) / 4 + replicated
    # A mixed layout does both: gradients over `batch`, activations over `model`.
    ar4 = mp4.collectives["all-reduce"]
    assert 0 < ar4["parameter_shaped_bytes"] < ar4["bytes_sent"]


def test_a_step_too_big_for_the_target_does_not_fit():
    small = dataclasses.replace(V3, name="tpu-v3", hbm_bytes=4 * 2**20)
    _, p = make_plan("batch:8", target=small)
    assert p.total_bytes > small.hbm_bytes and not p.fits
    assert "DOES NOT FIT" in planner.format_plan(p)


def run_plan(*args, python_flags=()):
    # Programs no other test compiles: caching them would only cost time.
    proc = subprocess.run([sys.executable, *python_flags, "-m", "mtrain", "--mode=plan", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=no_compilation_cache(os.environ))
    return proc


@pytest.mark.slow  # (test_paper_configs compiles it on 512 devices too)
def test_cli_plans_the_largest_paper_lm_on_its_512_cores():
    # A process of its own: the plan simulates the 512 devices it needs.
    proc = run_plan("--gin_file=paper/lm_size_5.gin", "--target=tpu-v2", "--format=json",
                    python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    # A plan reads no data: it does not spend seconds importing the input pipeline's TensorFlow.
    imported, _ = split_import_times(proc.stderr)
    assert "jax" in imported and not imported & {"tensorflow", "tensorflow_datasets"}
    report = json.loads(proc.stdout)
    assert report["num_devices"] == 512 and report["mesh_shape"] == "batch:16;model:32"
    d, f, h, k, v = 1024, 262144, 256, 256, 32768
    assert report["analytic_parameters"] == 6 * (4 * d * h * k + 2 * d * f) + 2 * v * d
    assert 4.85e9 < report["parameters"] < 4.95e9
    # 1/32 of the parameters per device (plus the replicated position embedding and norms).
    assert report["parameter_bytes"] < 4 * report["parameters"] / 32 + 4 * 300 * d
    assert report["fits"] and report["total_bytes"] < 8 * 2**30  # a TPU v2 core's 8 GiB
    assert report["xla_flops"] == pytest.approx(report["analytic_flops"] / 512, rel=0.05)
    assert report["collectives"]["all-reduce"]["count"] > 0


@pytest.mark.slow  # (the step model's figures in the fast tier: test_step_model_*)
def test_the_1b_preset_fits_an_h100_at_16_x_2048():
    """Issue 17's target: at most 40 GiB on one device, bf16, remat dots, flash attention."""
    proc = run_plan("--gin_file=tasks/lm1b.gin", "--gin_file=models/lm_1b.gin",
                    "--target=h100", "--format=json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["batch_size"], report["sequence_length"]) == (16, 2048)
    assert report["memory_basis"] == "step model (GPU)"
    assert report["step_model"]["attention"] == "flash"
    assert report["fits"] and report["total_bytes"] < 40 * 2**30


@pytest.mark.slow
def test_lora_of_llama_1b_plans_its_optimizer_state_below_2_percent():
    """LoRA (rank 16 on every projection) against full fine-tuning of llama_1b with AdamW
    on an H100: optimizer state under 2% of the full run's, gradients of the adapters
    alone, and a shorter step (no weight-gradient matmul for a frozen weight)."""
    plans = {}
    for rank in (0, 16):
        proc = run_plan("--gin_file=tasks/lm1b.gin", "--gin_file=models/llama_1b.gin",
                        "--target=h100", "--format=json", f"--gin_param=lora.rank={rank}")
        assert proc.returncode == 0, proc.stderr
        plans[rank] = json.loads(proc.stdout)
    full, lora = plans[0], plans[16]
    assert lora["optimizer_bytes"] < 0.02 * full["optimizer_bytes"]
    assert lora["step_model"]["gradient_bytes"] < 0.02 * full["step_model"]["gradient_bytes"]
    assert lora["total_bytes"] < full["total_bytes"]
    assert lora["step_seconds"] < 0.8 * full["step_seconds"]


def test_cli_plan_text_report_and_bad_input(capsys):
    assert main(["--mode=plan", "--gin_file=quickstart.gin", "--target=h100"]) == 0
    out = capsys.readouterr().out
    assert "mesh batch:4;model:2 (8 devices)" in out and "verdict: FITS in h100 memory" in out
    assert "all-reduce" in out and "roofline on h100" in out
    assert main(["--mode=plan", "--gin_file=quickstart.gin", "--target=tpu-v9"]) == 2
    assert "unknown --target 'tpu-v9'; use one of tpu-v2, tpu-v3" in capsys.readouterr().err
    assert main(["--gin_file=quickstart.gin", "--auto_layout"]) == 2
    assert "--auto_layout and --devices go with --mode=plan" in capsys.readouterr().err


@pytest.mark.slow
def test_auto_layout_ranks_the_legal_layouts_that_fit(capsys):
    # One layer: every candidate lays out the same tensors as at full depth, compiled faster.
    run_lib.parse_config(["quickstart.gin"], ["transformer.num_layers=1"])
    exp = run_lib.build(model_dir="unused", mode="plan", mesh_shape="")
    out = io.StringIO()
    report = plan(exp, target="tpu-v3", output_format="json", auto_layout=True, devices=8,
                  out=out)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(report))
    candidates = report["candidates"]
    assert {c["mesh_shape"] for c in candidates} == {
        "batch:8", "model:8", "batch:2;model:4", "batch:4;model:2", "batch:2;model:2;embed:2"}
    # 4 heads cannot split 8 ways: that candidate is illegal, and says why.
    illegal = [c for c in candidates if c["mesh_shape"] == "model:8"]
    assert illegal[0]["plan"] is None and "'heads' of size 4 is not divisible" in illegal[0]["rejected"]
    fitting = [c["plan"] for c in candidates if c["plan"] and c["plan"]["fits"]]
    assert len(fitting) == len(candidates) - 1
    steps = [p["step_seconds"] for p in fitting]
    assert steps == sorted(steps) and candidates[0]["plan"] == fitting[0]
    # Every layout that leaves d_model whole is tried with FSDP as well: its plan stores an
    # eighth of the parameters per device, gathers them and reduce-scatters the gradients.
    def plan_of(mesh_shape, parameter_rules):
        return next(c["plan"] for c in candidates if c["mesh_shape"] == mesh_shape
                    and c["layout_rules"] == "batch:batch"
                    and c["parameter_layout_rules"] == parameter_rules)

    fsdp, dp = plan_of("batch:8", "d_model:batch"), plan_of("batch:8", "")
    assert len([c for c in candidates if c["parameter_layout_rules"] == "d_model:batch"]) == 5
    assert fsdp["parameter_bytes"] * 8 == dp["parameter_bytes"]
    assert fsdp["optimizer_bytes"] < dp["optimizer_bytes"] / 4
    shaped = {k: v["parameter_shaped_bytes"] for k, v in fsdp["collectives"].items()}
    assert shaped["all-gather"] > 0 and shaped["reduce-scatter"] > 0
    # (What is still all-reduced is vectors: Adafactor's statistics of the factored moments.)
    assert shaped["all-reduce"] < dp["collectives"]["all-reduce"]["parameter_shaped_bytes"] / 100
    Layout(candidates[0]["mesh_shape"], candidates[0]["layout_rules"],
           candidates[0]["parameter_layout_rules"])  # the best is legal
    # The command line prints the winners as gin lines (for 2 devices: batch:2, model:2,
    # and batch:2 with FSDP, which compile in a fraction of the time of the 8 above).
    assert main(["--mode=plan", "--gin_file=quickstart.gin", "--auto_layout", "--devices=2",
                 "--gin_param=transformer.num_layers=1"]) == 0
    printed, err = capsys.readouterr()
    started = next(line for line in err.splitlines() if "mtrain: task" in line)
    assert started.endswith("searching layouts for 2 devices"), started
    assert printed.startswith("auto-layout for 2 devices on tpu-v3: 3 candidates, 3 compiled")
    assert "#1  step ~" in printed and 'run.mesh_shape = "' in printed
    assert 'run.parameter_layout_rules = "d_model:batch"' in printed


def test_an_all_reduce_used_only_in_slices_is_a_reduce_scatter():
    """XLA:CPU reduces a gradient into the shards of a parameter stored split (FSDP) by an
    all-reduce whose users each keep their partition's slice; XLA's GPU and TPU pipelines
    make that one reduce-scatter, and the planner counts it as one."""
    hlo = "\n".join([
        "ENTRY %main (g: f32[64,32]) -> f32[8,32] {",
        "  %pid = u32[] partition-id()",
        "  %ar = (f32[], f32[64,32]{1,0}) all-reduce(%s, %g), replica_groups=[1,8]<=[8], "
        "to_apply=%add",
        "  %gte.0 = f32[] get-tuple-element(%ar), index=0",
        "  %gte.1 = f32[64,32]{1,0} get-tuple-element(%ar), index=1",
        "  %fused = f32[8,32]{1,0} fusion(%gte.1, %pid), kind=kLoop, calls=%fused_slice",
        "  %ds = f32[8,32]{1,0} dynamic-slice(%gte.1, %o, %z), dynamic_slice_sizes={8,32}",
        "  %full = f32[64,32]{1,0} all-reduce(%h), replica_groups=[1,8]<=[8], to_apply=%add",
        "  %use = f32[64,32]{1,0} add(%full, %full)",
        "  %half = f32[64,32]{1,0} all-reduce(%k), replica_groups=[1,8]<=[8], to_apply=%add",
        "  %slice = f32[8,32]{1,0} fusion(%half, %pid), kind=kLoop, calls=%fused_slice",
        "  ROOT %whole = f32[64,32]{1,0} negate(%half)",
        "}",
    ])
    stats = hlo_cost(hlo, num_devices=8, parameter_shapes={(64, 32)}).collectives
    rs, ar = stats["reduce-scatter"], stats["all-reduce"]
    # Only %ar's gradient is used in slices alone: a reduce-scatter that sends 7/8 of it.
    assert (rs.count, rs.bytes_sent, rs.parameter_shaped_bytes) == (1, 7 * 8 * 32 * 4,
                                                                   7 * 8 * 32 * 4)
    # Its scalar, %full and %half (also used whole) stay all-reduces.
    assert (ar.count, ar.bytes_sent) == (3, 1.75 * (4 + 2 * 64 * 32 * 4))


def test_the_peak_an_accelerator_is_measured_against():
    """MFU's denominator by the device's kind (no TPU or GPU here: fake devices say theirs);
    on a CPU, a float32 matmul measured now, shared by the simulated devices."""
    import types

    from mtrain.parallel.targets import device_peak_flops

    def device(kind, platform):
        return types.SimpleNamespace(device_kind=kind, platform=platform)

    assert device_peak_flops(device("TPU v4", "tpu")) == (TARGETS["tpu-v4"].peak_flops,
                                                          "tpu-v4 bf16 peak")
    assert device_peak_flops(device("TPU v5 lite", "tpu"))[1] == "tpu-v5e bf16 peak"
    assert device_peak_flops(device("NVIDIA H100 80GB HBM3", "gpu")) == (989e12, "h100 bf16 peak")
    assert device_peak_flops(device("NVIDIA A100-SXM4-80GB", "gpu")) == (
        0.0, "no peak known for NVIDIA A100-SXM4-80GB")
    flops, source = device_peak_flops()  # this CPU
    assert flops > 0 and source.startswith("measured float32 matmul, shared by 8 CPU devices")


@pytest.mark.slow
def test_the_26b_experts_preset_fits_256_tpu_v4_chips_with_expert_parallelism():
    """The README's plan: with `experts:batch` the 26.7B model fits (a 32nd of the experts
    per row of chips, all-to-all dispatch); with its experts replicated over `batch`, it
    does not."""
    proc = run_plan("--gin_file=experiments/moe_26b_lm.gin", "--target=tpu-v4", "--format=json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["num_devices"] == 256 and 26e9 < report["parameters"] < 27e9
    assert 1.6e9 < report["active_parameters"] < 1.8e9
    assert report["fits"] and report["collectives"]["all-to-all"]["count"] > 0
    # 64 experts over 32 x 8: a 256th of their 25.8B float32 weights on each chip
    assert report["expert_bytes"] == 12 * 64 * 2 * 2048 * 8192 * 4 // 256
    proc = run_plan("--gin_file=experiments/moe_26b_lm.gin", "--target=tpu-v4", "--format=json",
                    '--gin_param=run.layout_rules="batch:batch;d_ff:model;heads:model;vocab:model"')
    assert proc.returncode == 0, proc.stderr
    replicated = json.loads(proc.stdout)
    assert not replicated["fits"] and replicated["collectives"]["all-to-all"]["count"] == 0
