"""Stochastic Gradient Push on the tiny LM: trains like all-reduce data parallelism, with
model parallelism too, and averages back to the all-reduce layout."""

import jax
import numpy as np
import pytest

from mtrain.training import optimizer
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.training.sgp import SGPTrainer
from mtrain.training.trainer import Trainer

CONFIG = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                           num_layers=2, max_length=32)
RULES = "batch:batch;d_ff:model;heads:model;vocab:model"


def batch(i):
    """A small 'language': token t+1 follows token t (mod 64), from random starts."""
    rng = np.random.default_rng(i)
    starts = rng.integers(1, 64, (16, 1))
    tokens = (starts + np.arange(32)) % 64 + 1
    return {"targets": tokens.astype(np.int32),
            "targets_segment_ids": np.ones((16, 32), np.int32),
            "targets_positions": np.tile(np.arange(32, dtype=np.int32), (16, 1))}


def trainer(mesh_shape):
    layout = Layout(mesh_shape, RULES, drop_unused_rules=True)
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    return Trainer(model=DecoderLM(CONFIG), optimizer=opt, layout=layout, mesh=layout.make_mesh(),
                   batch_size=16, sequence_length=32)


def heldout_loss(t, params):
    sums = t.eval_step(params, t.place_batch(batch(1000)))
    return float(sums["xent_sum"] / sums["num_tokens"])


@pytest.mark.parametrize("mesh_shape", ["batch:8", "batch:4;model:2"])
@pytest.mark.slow
def test_sgp_trains_like_all_reduce(mesh_shape):
    steps = 40
    t = trainer(mesh_shape)
    state = t.init_state()
    start = heldout_loss(t, state.params)
    sgp = SGPTrainer(t)
    sgp_state = sgp.init_state(state)
    for i in range(steps):
        state, _ = t.train_step(state, t.place_batch(batch(i)))
        sgp_state, metrics = sgp.train_step(sgp_state, t.place_batch(batch(i)))
        jax.block_until_ready(metrics)
    all_reduce = heldout_loss(t, state.params)
    gossip = heldout_loss(t, sgp.average(sgp_state))
    assert all_reduce < 0.7 * start
    assert gossip == pytest.approx(all_reduce, rel=0.05), (gossip, all_reduce)
    # The replicas disagree, a little; PushSum weights stay 1 on this graph.
    distance = sgp.consensus_distance(sgp_state)
    assert 0 < float(distance["mean"]) <= float(distance["max"])
    np.testing.assert_allclose(np.asarray(sgp_state.weight), 1.0, rtol=1e-6)


def test_sgp_starts_in_consensus_and_averages_to_the_trainer_layout():
    t = trainer("batch:4;model:2")
    state = t.init_state()
    sgp = SGPTrainer(t)
    stacked = sgp.init_state(state)
    leaf = jax.tree_util.tree_leaves(stacked.params)[0]
    assert leaf.shape[0] == 4 and leaf.sharding.spec[0] == "batch"
    average = sgp.average(stacked)
    for a, b in zip(jax.tree_util.tree_leaves(average), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        assert a.sharding.spec == b.sharding.spec
    # Each replica sends one copy of its parameters per step (and its weight); at the
    # start every replica holds the same parameters.
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    assert sgp.bytes_sent_per_step() == 4 * params + 4
    assert float(sgp.consensus_distance(stacked)["max"]) == 0.0


@pytest.mark.slow  # (the fast tier trains SGP: test_overlap_sgp_converges and the state tests)
def test_the_sgp_step_all_reduces_no_parameters():
    # Its collectives: a collective-permute per hop (the planner counts the one that runs per
    # step) of the parameters, and all-reduces of scalars only, where data parallelism
    # all-reduces every gradient.

    t = trainer("batch:8")
    params = SGPTrainer(t).bytes_sent_per_step() - 4
    for sgp in (SGPTrainer(t), SGPTrainer(t, overlap=1)):
        stats = hlo_cost(sgp.compile_train_step().as_text(), 8).collectives
        assert stats["all-reduce"].bytes_sent < 100
        assert stats["collective-permute"].bytes_sent == pytest.approx(params + 4, rel=0.01)
    all_reduce = hlo_cost(t.compile_train_step().as_text(), 8).collectives
    assert all_reduce["all-reduce"].bytes_sent == pytest.approx(2 * 7 / 8 * params, rel=0.01)
    # Exact averaging every H steps: then (in a conditional) an all-reduce of the parameters.
    averaging = hlo_cost(SGPTrainer(t, average_every=4).compile_train_step().as_text(),
                         8).collectives
    assert averaging["all-reduce"].bytes_sent == pytest.approx(2 * 7 / 8 * params, rel=0.01)


def train_sgp(sgp, steps, state=None):
    t = sgp.trainer
    sgp_state = sgp.init_state(state)
    for i in range(steps):
        sgp_state, metrics = sgp.train_step(sgp_state, t.place_batch(batch(i)))
        jax.block_until_ready(metrics)
    return sgp_state, metrics


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_overlap_sgp_converges():
    t = trainer("batch:8")
    start = heldout_loss(t, t.init_state().params)
    state, metrics = train_sgp(SGPTrainer(t), 40)
    plain = heldout_loss(t, SGPTrainer(t).average(state))
    sgp = SGPTrainer(t, overlap=1)
    state, metrics = train_sgp(sgp, 40)
    overlap = heldout_loss(t, sgp.average(state))
    assert overlap < 0.7 * start
    assert overlap == pytest.approx(plain, rel=0.1), (overlap, plain)
    # One message per replica is in flight; the mass (params and weight) is all accounted.
    assert state.inflight[1].shape == (8, 1)
    total = np.asarray(state.weight).sum() + np.asarray(state.inflight[1]).sum()
    assert total == pytest.approx(8.0, rel=1e-6)
    assert set(metrics) == {"loss", "cross_entropy", "num_tokens", "grad_norm", "finite"}
    assert float(metrics["finite"]) == 1.0 and float(metrics["num_tokens"]) == 16 * 32


@pytest.mark.slow  # (about 20 s)
def test_exact_averaging_every_h_steps_restores_consensus():
    t = trainer("batch:8")
    sgp = SGPTrainer(t, average_every=5, overlap=1)
    state, _ = train_sgp(sgp, 5)  # step 5 averaged exactly
    assert float(sgp.consensus_distance(state)["max"]) < 1e-5
    np.testing.assert_allclose(np.asarray(state.weight), 1.0)
    assert float(np.abs(np.asarray(state.inflight[1])).max()) == 0.0
    state, _ = train_sgp(sgp, 3, sgp.train_state(state))
    assert float(sgp.consensus_distance(state)["max"]) > 1e-5  # gossip only since


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_sgp_state_converts_to_and_from_a_trainer_state():
    t = trainer("batch:4;model:2")
    sgp = SGPTrainer(t)
    state, _ = train_sgp(sgp, 3)
    saved = sgp.train_state(state)  # what a checkpoint holds
    assert int(saved.step) == 3
    for a, b in zip(jax.tree_util.tree_leaves(saved), jax.tree_util.tree_leaves(
            t.sharded_abstract_state())):
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec)
    average = [np.asarray(x) for x in jax.tree_util.tree_leaves(saved.params)]
    # An all-reduce run continues from it, and SGP restarts from it in consensus.
    t.train_step(saved, t.place_batch(batch(3)))
    again = sgp.init_state(sgp.train_state(state))
    assert float(sgp.consensus_distance(again)["max"]) == 0.0
    for a, b in zip(jax.tree_util.tree_leaves(sgp.average(again)), average):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)
