"""Sharded state and train step: layouts change placement, never results."""

import jax
import numpy as np
import pytest

from mtrain.training import optimizer
from mtrain.parallel.layout import Layout, LayoutError
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.training.trainer import Trainer

SPLIT_MODEL = "d_ff:model;heads:model;vocab:model"
LAYOUTS = [  # (mesh shape, layout rules, parameter layout rules)
    ("", "", ""),
    ("batch:8", "batch:batch", ""),
    ("model:8", SPLIT_MODEL, ""),
    ("batch:4;model:2", "batch:batch;" + SPLIT_MODEL, ""),
    ("batch:2;model:4", "batch:batch;" + SPLIT_MODEL, ""),
    # Fully sharded data parallelism (beside model parallelism: test_fsdp, test_encoder_decoder).
    ("batch:8", "batch:batch", "d_model:batch"),
]
CONFIG = TransformerConfig(
    vocab_size=256, d_model=32, d_ff=64, num_heads=8, d_kv=4, num_layers=2,
    dropout_rate=0.1, max_length=16,
)
B, L = 8, 16


def packed_batches(n, seed=0):
    """Random token batches with 2-3 packed segments per row and some padding."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seg = np.zeros((B, L), np.int32)
        pos = np.zeros((B, L), np.int32)
        for r in range(B):
            cuts = sorted(rng.choice(np.arange(2, L - 2), size=2, replace=False))
            bounds = [0, *cuts, L - rng.integers(0, 3)]
            for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                seg[r, a:b], pos[r, a:b] = s + 1, np.arange(b - a)
        tokens = rng.integers(1, CONFIG.vocab_size, (B, L)).astype(np.int32) * (seg > 0)
        out.append({"targets": tokens, "targets_segment_ids": seg, "targets_positions": pos})
    return out


def make_trainer(mesh_shape, rules, config=CONFIG, batch_size=B, parameter_rules="",
                 num_microbatches=1, objective=None):
    layout = Layout(mesh_shape, rules, parameter_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    return Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                   batch_size=batch_size, sequence_length=L, seed=3,
                   num_microbatches=num_microbatches, objective=objective)


def train(mesh_shape, rules, parameter_rules="", steps=3, **kwargs):
    trainer = make_trainer(mesh_shape, rules, parameter_rules=parameter_rules, **kwargs)
    state = trainer.init_state()
    losses = []
    for batch in packed_batches(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
    """The losses and parameters of 3 steps on one device (each layout's reference)."""
    losses, params = train(*LAYOUTS[0])
    assert losses[-1] < losses[0]
    return losses, params


# (one test per layout: the test processes share them out; the fast tier keeps the layout
# that splits both the batch and the model, the full suite each)
@pytest.mark.parametrize("mesh_shape, rules, parameter_rules", [
    layout if layout[0] == "batch:4;model:2" else pytest.param(*layout, marks=pytest.mark.slow)
    for layout in LAYOUTS[1:]], ids=[f"{m} {p}".strip() for m, _, p in LAYOUTS[1:]])
def test_layouts_never_change_results(one_device, mesh_shape, rules, parameter_rules):
    ref_losses, ref_params = one_device
    losses, params = train(mesh_shape, rules, parameter_rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, ref_params)


def test_each_device_holds_only_its_shard():
    config = TransformerConfig(vocab_size=256, d_model=128, d_ff=256, num_heads=8, d_kv=16,
                               num_layers=1, max_length=16)
    trainer = make_trainer("model:8", SPLIT_MODEL, config)
    state = trainer.init_state()
    wi = state.params["layer_0"]["mlp"]["wi"]
    assert wi.shape == (128, 256)
    assert {s.data.shape for s in wi.addressable_shards} == {(128, 32)}
    assert len(wi.addressable_shards) == 8
    q = state.params["layer_0"]["self_attention"]["q"]
    assert {s.data.shape for s in q.addressable_shards} == {(128, 1, 16)}
    softmax = state.params["softmax"]
    assert {s.data.shape for s in softmax.addressable_shards} == {(128, 32)}
    # Adafactor's factored statistics for wi: the d_ff-long one is split 8 ways as well.
    factored = state.opt_state[0]
    for stat in (factored.v_row, factored.v_col):
        leaf = stat["layer_0"]["mlp"]["wi"]
        expected = (32,) if leaf.shape == (256,) else leaf.shape
        assert {s.data.shape for s in leaf.addressable_shards} == {expected}


def test_batch_not_divisible_by_mesh_is_a_layout_error():
    with pytest.raises(LayoutError, match="'batch' of size 6 is not divisible by mesh dimension 'batch' of size 4"):
        make_trainer("batch:4;model:2", "batch:batch", batch_size=6)


def test_eval_step_counts_tokens():
    trainer = make_trainer("batch:4;model:2", "batch:batch;" + SPLIT_MODEL)
    state = trainer.init_state()
    batch = packed_batches(1)[0]
    sums = trainer.eval_step(state.params, trainer.place_batch(batch))
    assert float(sums["num_tokens"]) == (batch["targets_segment_ids"] > 0).sum()
    mean = float(sums["xent_sum"]) / float(sums["num_tokens"])
    assert abs(mean - np.log(CONFIG.vocab_size)) < 1.0  # an untrained model is near uniform


def test_initialisation_equals_the_models_own_init():
    """`init_state` runs the model's forward pass on one token, with the key as an argument
    (so that compiling it stays cheap): the parameters are exactly those of `model.init` on
    a whole batch under the layout."""
    import flax.linen as nn

    trainer = make_trainer("batch:4;model:2", "batch:batch;" + SPLIT_MODEL)
    full = jax.jit(lambda: nn.unbox(trainer._init_variables(trainer.init_key))["params"])()
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           jax.device_get(trainer.init_state().params), jax.device_get(full))


@pytest.mark.slow  # (a custom objective through the trainer's steps: about 20 s)
def test_an_objective_is_what_the_trainer_is_given():
    """A new objective is a subclass of `objective.Objective`, with state of its own that the
    steps take after the batch (here a weight of the loss): the trainer steps, evaluates and
    lowers it without knowing it. Weighted 1, its loss is the language model's without
    z-loss; `trainer.py` names no objective but its default."""
    import inspect

    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from mtrain.training import trainer as trainer_module
    from mtrain.training.language_modeling import LanguageModeling
    from mtrain.training.losses import LossConfig, loss_weights
    from mtrain.training.objective import Objective, token_log_likelihoods

    class Weighted(Objective):
        def __init__(self, weight):
            self.weight = weight

        def bind(self, setting):
            bound = Weighted(self.weight)
            bound.setting = setting
            bound.sharding = NamedSharding(setting.mesh, PartitionSpec())
            return bound

        def argument_shardings(self):
            return (self.sharding,)

        def arguments(self):
            return (jax.device_put(jnp.float32(self.weight), self.sharding),)

        def abstract_arguments(self):
            return (jax.ShapeDtypeStruct((), jnp.float32, sharding=self.sharding),)

        def loss_sums(self, params, batch, rngs, weight):
            nll = -token_log_likelihoods(self.setting, params, batch, False, rngs).sum()
            tokens = loss_weights(batch).sum().astype(jnp.float32)
            return weight * nll, nll, tokens, tokens, {}

        def eval_sums(self, params, batch, weight):
            return {"nll": -token_log_likelihoods(self.setting, params, batch).sum()}

        def eval_results(self, totals):
            return {"eval/nll": totals.get("nll", 0.0)}

    mesh, rules = "batch:4;model:2", "batch:batch;" + SPLIT_MODEL
    batch = packed_batches(1)[0]
    out = {}
    for name, objective in [("lm", LanguageModeling(LossConfig(z_loss=0.0))),
                            ("weighted", Weighted(1.0)), ("double", Weighted(2.0))]:
        trainer = make_trainer(mesh, rules, objective=objective)
        trainer.lower_train_step()
        state = trainer.init_state()
        sums = trainer.eval_step(state.params, trainer.place_batch(batch))
        _, metrics = trainer.train_step(state, trainer.place_batch(batch))
        out[name] = float(metrics["loss"]), float(metrics["cross_entropy"]), sums
    assert out["weighted"][:2] == pytest.approx(out["lm"][:2], rel=1e-5)
    assert out["double"][0] == pytest.approx(2 * out["lm"][0], rel=1e-5)
    assert float(out["weighted"][2]["nll"]) == pytest.approx(float(out["lm"][2]["xent_sum"]),
                                                              rel=1e-5)
    assert trainer.objective.eval_results({"nll": 3.0}) == {"eval/nll": 3.0}
    source = inspect.getsource(trainer_module)
    for name in ("dpo", "Preference", "isinstance(", ".reference"):
        assert name not in source, name
