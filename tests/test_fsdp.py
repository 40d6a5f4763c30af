"""Fully sharded data parallelism in the layout language (``run.parameter_layout_rules``):
parameters and optimizer state stored split over the data-parallel devices, gathered where
they are used, gradients reduce-scattered back. That it trains exactly as plain data
parallelism and as one device is test_trainer's layout-invariance test (its FSDP row) and,
for the encoder-decoder and beam search, test_encoder_decoder's."""

import dataclasses

import gin
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from mtrain.planning import planner
from mtrain import run as run_lib
from mtrain.io.checkpoints import Checkpoints
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.training.sgp import SGPTrainer
from mtrain.parallel.targets import TARGETS
from test_trainer import CONFIG, SPLIT_MODEL, make_trainer, packed_batches, train

FSDP = ("batch:8", "batch:batch")


def per_device_bytes(tree) -> dict:
    """Bytes each device holds of a tree of arrays, measured from their shards."""
    held = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def test_each_device_stores_an_eighth_of_the_parameters():
    state = make_trainer(*FSDP, parameter_rules="d_model:batch").init_state()
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.params))
    assert set(per_device_bytes(state.params).values()) == {total // 8}
    # Optimizer state: every statistic that keeps a d_model dimension is split too; the
    # factored ones that lost it (Adafactor's d_ff-long column factors) are small.
    opt_total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.opt_state))
    assert max(per_device_bytes(state.opt_state).values()) < opt_total / 6
    plain = make_trainer(*FSDP).init_state()
    assert set(per_device_bytes(plain.params).values()) == {total}


@pytest.mark.slow  # (two train steps compiled on 8 devices: about 15 s)
def test_the_step_gathers_parameters_and_reduces_gradients_into_shards():
    """Checked from the compiled step's HLO, as the SGP tests check theirs."""
    fsdp = make_trainer(*FSDP, parameter_rules="d_model:batch")
    params = jax.tree_util.tree_leaves(fsdp.abstract_state.params)
    shapes = {tuple(x.shape) for x in params} | {
        tuple(s.shard_shape(x.shape)) for x, s in
        zip(params, jax.tree_util.tree_leaves(fsdp.state_shardings.params))}
    param_bytes = sum(x.size * 4 for x in params)
    stats = hlo_cost(fsdp.compile_train_step().as_text(), 8, shapes).collectives
    # Every parameter gathered whole once (each device receives the 7/8 it lacks).
    assert stats["all-gather"].parameter_shaped_bytes == pytest.approx(7 / 8 * param_bytes)
    # Gradients reduced into shards, never all-reduced whole: what is all-reduced is
    # scalars (loss, token count, norms), where plain data parallelism all-reduces every
    # gradient (2 x 7/8 of the parameters' bytes). The tables' gradients (a scatter-add of
    # the tokens' rows) may be made from gathered token ids instead: at least half goes
    # through reduce-scatters.
    assert stats["all-reduce"].parameter_shaped_bytes == 0
    assert stats["all-reduce"].bytes_sent < 1024
    assert stats["reduce-scatter"].parameter_shaped_bytes > 0.5 * 7 / 8 * param_bytes
    plain = make_trainer(*FSDP)
    plain_stats = hlo_cost(plain.compile_train_step().as_text(), 8).collectives
    assert plain_stats["all-reduce"].bytes_sent == pytest.approx(2 * 7 / 8 * param_bytes,
                                                                 rel=0.01)
    assert plain_stats["reduce-scatter"].count == 0


@pytest.mark.slow  # (about 10 s)
def test_a_scanned_stack_gathers_and_reduces_a_layer_at_a_time_as_much_as_the_unrolled_one():
    """Inside the scan XLA:CPU fuses the slice of the reduced gradient with its write into
    the stacked gradient; the planner still sees the reduce-scatter."""
    plans = [planner.plan(make_trainer(*FSDP, config=dataclasses.replace(CONFIG, scan_layers=s),
                                       parameter_rules="d_model:batch"), TARGETS["tpu-v3"])
             for s in (False, True)]
    shaped = [{k: v["parameter_shaped_bytes"] for k, v in p.collectives.items()} for p in plans]
    assert shaped[1]["all-gather"] == shaped[0]["all-gather"] > 0
    assert shaped[1]["reduce-scatter"] == shaped[0]["reduce-scatter"] > 0
    assert shaped[1]["all-reduce"] == shaped[0]["all-reduce"] == 0


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_fsdp_with_scanned_rematerialised_layers_microbatches_and_flash_attention():
    """The speed levers under FSDP: parameters gathered inside the scanned (and
    rematerialised) layer, gradients accumulated in shards over microbatches, flash
    attention's shard_map beside the gathered weights. Tolerance: the invariance tests'."""
    config = dataclasses.replace(CONFIG, dropout_rate=0.0, scan_layers=True,
                                 remat_policy="dots", attention="flash")
    mesh, rules = "batch:4;model:2", "batch:batch;" + SPLIT_MODEL
    kwargs = dict(config=config, num_microbatches=2)
    reference, ref_params = train(mesh, rules, **kwargs)
    losses, params = train(mesh, rules, "d_model:batch", **kwargs)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                           params, ref_params)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_sgp_refuses_fsdp_over_its_gossip_dimension_and_keeps_it_over_another():
    with pytest.raises(ValueError, match="parameter layout rule 'd_model:batch' splits the "
                                         "parameters over the gossip mesh dimension 'batch'"):
        SGPTrainer(make_trainer(*FSDP, parameter_rules="d_model:batch"))
    mesh, rules = "batch:2;model:2;embed:2", "batch:batch;" + SPLIT_MODEL

    def losses(parameter_rules):
        trainer = make_trainer(mesh, rules, parameter_rules=parameter_rules)
        sgp = SGPTrainer(trainer)
        state, out = sgp.init_state(), []
        for batch in packed_batches(2):
            state, metrics = sgp.train_step(state, trainer.place_batch(batch))
            out.append(float(metrics["loss"]))
        return out, state

    reference, _ = losses("")
    fsdp, state = losses("d_model:embed")
    np.testing.assert_allclose(fsdp, reference, rtol=1e-5)
    # Each replica's parameters: stacked over the gossip dimension, d_model over embed.
    assert state.params["layer_0"]["mlp"]["wi"].sharding.spec == P("batch", "embed", "model")


def test_checkpoints_saved_under_fsdp_restore_without_it_and_back(tmp_path):
    fsdp = make_trainer(*FSDP, parameter_rules="d_model:batch")
    state, _ = fsdp.train_step(fsdp.init_state(), fsdp.place_batch(packed_batches(1)[0]))
    expected = jax.device_get(state)
    meta = {"model": {"d_model": CONFIG.d_model}}
    for i, target in enumerate([make_trainer("batch:4;model:2", "batch:batch;" + SPLIT_MODEL),
                                make_trainer(*FSDP, parameter_rules="d_model:batch")]):
        checkpoints = Checkpoints(tmp_path / str(i), async_save=False)
        checkpoints.manager.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        checkpoints.wait()
        state = checkpoints.read(1, target.sharded_abstract_state(), meta).state
        checkpoints.close()
        jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state), expected)
        wi = state.params["layer_0"]["mlp"]["wi"]
        assert wi.sharding == target.state_shardings.params["layer_0"]["mlp"]["wi"]


@pytest.mark.parametrize("name, mesh, stored", [("fsdp8", "batch:8", ("batch", None)),
                                                ("fsdp4_mp2", "batch:4;model:2", ("batch", "model"))])
def test_the_shipped_fsdp_layouts(name, mesh, stored):
    """configs/layouts/fsdp*.gin with the quickstart model (abstractly: nothing compiled).
    A run resuming under fsdp8.gin from a run without it: test_user_paths."""
    run_lib.parse_config(["quickstart.gin", f"layouts/{name}.gin"], [])
    exp = run_lib.build(model_dir="unused", mode="plan")
    assert exp.layout.mesh_text == mesh and exp.layout.parameter_rules_text == "d_model:batch"
    wi = exp.trainer.state_shardings.params["layer_0"]["mlp"]["wi"]
    assert wi.spec == P(*stored)
    gin.clear_config()
