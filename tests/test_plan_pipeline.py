"""--mode=plan for a layout that splits ``layers`` over a stage mesh dimension (pipeline
parallelism), and for slices joined by the data-centre network (``--slices``)."""

import dataclasses
import math

import jax
import optax
import pytest

from mtrain.__main__ import main
from mtrain.models.pipeline import PipelineConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.parallel.targets import TARGETS
from mtrain.planning import auto_layout, planner
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.planning.slices import Topology
from mtrain.training.trainer import Trainer

V4 = TARGETS["tpu-v4"]
# A tiny Llama (SwiGLU, rotary, grouped-query attention), its 4 layers scanned.
LLAMA = TransformerConfig(vocab_size=256, d_model=64, d_ff=128, num_heads=4, num_kv_heads=2,
                          d_kv=16, num_layers=4, max_length=32, scan_layers=True,
                          mlp_activations=("silu", "linear"), position_encoding="rotary",
                          shared_embedding_and_softmax=False)
STAGES = ("stage:4;batch:2", "layers:stage;batch:batch")


def make_trainer(mesh_shape, rules, config=LLAMA, batch=16, length=32):
    layout = Layout(mesh_shape, rules, drop_unused_rules=True)
    return Trainer(model=DecoderLM(config), optimizer=optax.adamw(1e-3), layout=layout,
                   mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=batch,
                   sequence_length=length)


@pytest.fixture(scope="module")
def gpipe():
    trainer = make_trainer(*STAGES)
    compiled = trainer.compile_train_step()
    return trainer, compiled, planner.plan(trainer, V4, compiled=compiled)


def test_a_tiny_llama_over_four_stages(gpipe):
    trainer, _, p = gpipe
    e = p.pipeline
    # 16 rows over a 2-way batch split: M divides them into slices of even rows (1, 2, 4, 8);
    # none keeps the bubble under a fifth at 4 stages, so the most: 8.
    assert (e["stages"], e["stage_dim"], e["schedule"], e["repeats"]) == (4, "stage", "gpipe", 1)
    assert e["microbatches"] == 8 and e["iterations"] == 8 + 4 - 1
    assert e["bubble"] == pytest.approx(3 / (8 + 3))
    # Each device holds a quarter of the stacked layers' parameters (adamw: two moments).
    stacked = sum(4 * leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(
        trainer.abstract_state.params) if "'layers'" in jax.tree_util.keystr(path))
    assert e["stacked_parameter_bytes"] == stacked / 4
    assert e["unsplit_parameter_bytes"] == stacked
    assert e["stacked_optimizer_bytes"] == 2 * stacked / 4
    assert p.parameter_bytes == stacked / 4 + e["other_parameter_bytes"]
    # Sent between stages: each iteration a device's shard of one microbatch's activation,
    # [16 / 8 rows / 2-way batch, 32, 64] floats, forward and (its gradient) backward.
    shard = 16 // 8 // 2 * 32 * 64 * 4
    assert e["activation_bytes"] == shard
    assert e["bytes_sent"] == e["activation_bytes_sent"] == 2 * 11 * shard
    assert e["reorder_bytes_sent"] == 0 and e["link"] == "ICI"
    assert e["seconds"] == pytest.approx(e["bytes_sent"] / V4.interconnect_bandwidth)
    # The compiled step's collective-permutes over `stage` move that shard, a whole number
    # of times an iteration: at least the schedule's two.
    permuted = p.collectives["collective-permute"]
    assert permuted["over"] == {"stage": permuted["bytes_sent"]}
    sends = permuted["bytes_sent"] / (11 * shard)
    assert sends == int(sends) and sends >= 2
    assert e["compiled"]["collective-permute"] == permuted["bytes_sent"]
    text = planner.format_plan(p)
    assert "pipeline: 4 stages over mesh dimension 'stage' (gpipe)" in text
    assert "bubble 27.3%" in text
    # 16 rows split 2 ways by batch and 4 by stage beside the pipeline: the head's share
    assert e["head_split"] and "1/4 on each stage" in text


@pytest.mark.slow  # (about 10 s)
def test_circular_has_the_smaller_bubble_and_moves_its_chunks(gpipe):
    _, _, g = gpipe
    config = dataclasses.replace(LLAMA, num_layers=8,
                                 pipeline=PipelineConfig(schedule="circular", repeats=2))
    trainer = make_trainer(*STAGES, config=config)
    e = planner.plan(trainer, V4).pipeline
    assert (e["repeats"], e["microbatches"]) == (2, 8)
    assert e["bubble"] == pytest.approx(3 / (2 * 8 + 3)) and e["bubble"] < g.pipeline["bubble"]
    assert e["iterations"] == 2 * 8 + 3
    # Stage s stores chunks 2s, 2s+1 and runs chunks s, 4+s: stages 1..3 move both of theirs
    # (stage 0 keeps chunk 0): the busiest sends all it stores, and gets the gradients back.
    assert e["reorder_bytes_sent"] == 2 * e["stacked_parameter_bytes"]
    assert e["bytes_sent"] == e["reorder_bytes_sent"] + 2 * 19 * e["activation_bytes"]


def test_the_stage_dimension_over_slices_goes_at_dcn_bandwidth(gpipe):
    trainer, compiled, one = gpipe
    two = planner.plan(trainer, V4, compiled=compiled, slices=2)
    e = two.pipeline
    assert two.slices == 2 and e["link"] == "DCN"
    assert e["seconds"] == pytest.approx(e["bytes_sent"] / V4.dcn_bandwidth)
    # Stages 0-1 on one slice, 2-3 on the other: every permute has a pair that crosses.
    permuted = two.collectives["collective-permute"]
    assert permuted["dcn_bytes"] == permuted["bytes_sent"] > 0
    assert two.dcn_seconds > 0 and two.step_seconds > one.step_seconds
    assert two.communication_seconds > one.communication_seconds
    text = planner.format_plan(two)
    assert "2 slices joined by the data-centre network" in text and "over DCN" in text
    assert two.to_dict()["pipeline"]["link"] == "DCN"


def test_collectives_split_into_ici_and_dcn_by_their_groups():
    # batch:4;model:2 over 2 slices: devices 0-3 on one, 4-7 on the other (the first mesh
    # dimension spans them); an all-reduce over `batch` (groups {0,2,4,6}, {1,3,5,7}) joins
    # 2 devices in each slice: ICI reduce-scatter and all-gather inside, and the slice's
    # half-sized shard all-reduced across: 2 B (1/2) / 2 over DCN.
    mesh = (("batch", 4), ("model", 2))
    size = 64 * 64 * 4
    forms = ["replica_groups={{0,2,4,6},{1,3,5,7}}", "replica_groups=[2,4]<=[4,2]T(1,0)",
             "replica_groups=mesh['batch'=4,'model'=2] {'batch'}"]
    for form in forms:
        hlo = f"  %ar = f32[64,64]{{1,0}} all-reduce(%g), {form}, to_apply=%add"
        stats = hlo_cost(hlo, 8, topology=Topology(mesh, 2)).collectives["all-reduce"]
        assert stats.dcn_bytes == pytest.approx(2 * size / 2 / 2), form
        assert stats.bytes_sent == pytest.approx(2 * size / 2 + stats.dcn_bytes)
        assert stats.over == {"batch": stats.bytes_sent}
        flat = hlo_cost(hlo, 8, topology=Topology(mesh, 1)).collectives["all-reduce"]
        assert flat.dcn_bytes == 0 and flat.bytes_sent == 2 * 3 / 4 * size
    # Over `model` (pairs inside a slice): all ICI. A permute that crosses: all DCN; one
    # whose pairs stay on their devices sends nothing.
    inside = hlo_cost("  %ar = f32[64,64]{1,0} all-reduce(%g), replica_groups=[4,2]<=[8], "
                      "to_apply=%add", 8, topology=Topology(mesh, 2)).collectives["all-reduce"]
    assert inside.dcn_bytes == 0 and inside.over == {"model": size}
    permutes = hlo_cost("\n".join([
        "  %a = f32[64,64]{1,0} collective-permute(%x), source_target_pairs={{0,4},{4,0}}",
        "  %b = f32[64,64]{1,0} collective-permute(%x), source_target_pairs={{0,0},{1,1}}",
    ]), 8, topology=Topology(mesh, 2)).collectives["collective-permute"]
    assert (permutes.count, permutes.dcn_bytes, permutes.over) == (1, size, {"batch": size})


def test_slices_errors_are_one_line(capsys):
    assert main(["--mode=plan", "--gin_file=quickstart.gin", "--slices=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the run's log line)
    assert err == ("mtrain: error: --slices=3: the first mesh dimension spans the slices, so "
                   "its size must be a multiple of 3 (it is batch:4)")
    assert main(["--gin_file=quickstart.gin", "--slices=2"]) == 2
    assert capsys.readouterr().err.strip() == \
        "mtrain: error: --slices (at least 1) goes with --mode=plan"
    assert main(["--mode=plan", "--gin_file=quickstart.gin", "--slices=0"]) == 2
    assert capsys.readouterr().err.strip() == \
        "mtrain: error: --slices (at least 1) goes with --mode=plan"


@pytest.mark.slow  # (9 s: three stage splits compiled; the candidates' test stays fast)
def test_auto_layout_splits_the_stages_when_nothing_else_fits():
    # Odd d_model, d_ff, heads and vocabulary: no model, FSDP or 3-D split is legal, and a
    # target of 0.55 x the replicated state holds the step only split over 8 stages (XLA:
    # CPU's temporaries are twice the state: 4 stages need 0.86).
    config = dataclasses.replace(LLAMA, vocab_size=255, d_model=63, d_ff=1023, num_heads=3,
                                 num_kv_heads=3, num_layers=8, max_length=8)

    def trainer_of(layout):
        return Trainer(model=DecoderLM(config), optimizer=optax.adamw(1e-3), layout=layout,
                       mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=16,
                       sequence_length=8)

    replicated = planner.sharded_bytes(*(lambda t: (t.abstract_state, t.state_shardings))(
        trainer_of(Layout("batch:8", "batch:batch"))))
    small = dataclasses.replace(V4, hbm_bytes=0.55 * replicated)
    results = auto_layout.auto_layout(trainer_of, 8, small, pipelines=config.num_layers)
    best = results[0]
    assert best.plan and best.plan.fits and best.layout_rules.startswith("layers:stage")
    assert best.mesh_shape == "stage:8" and best.plan.pipeline["stages"] == 8
    tried = {c.mesh_shape: c for c in results if not c.parameter_layout_rules}
    assert tried["stage:4;batch:2"].rejected.startswith("does not fit")
    assert "parameters and optimizer state alone" in tried["batch:8"].rejected
    assert not any(
        c.plan and c.plan.fits for c in results if "stage" not in c.mesh_shape)
    # Without a model that can pipeline, no stage split is tried.
    assert not any("stage" in c.mesh_shape for c in auto_layout.auto_layout(
        trainer_of, 8, small))


def test_stage_candidates_over_slices_put_either_dimension_first():
    staged = auto_layout.stage_layouts(8, 4, slices=2)
    meshes = [m for m, _, _ in staged]
    assert "stage:2;batch:4" in meshes and "batch:4;stage:2" in meshes
    assert "stage:4;batch:2" in meshes and "batch:2;stage:4" in meshes
    assert "stage:2;batch:2;model:2" in meshes and "batch:2;stage:2;model:2" in meshes
    assert all(r.startswith("layers:stage") for _, r, _ in staged)
    assert all(math.prod(int(x.split(":")[1]) for x in m.split(";")) == 8 for m in meshes)
    assert not auto_layout.stage_layouts(8, 3)  # 3 layers: no stage count divides both
