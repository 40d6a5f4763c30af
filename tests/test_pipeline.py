"""Pipeline stages as a split of ``layers`` (`models.pipeline`): the schedules compute what
the stack computes; a tiny Llama (and a mixture of experts) trains over 2 and 4 stages,
GPipe and circular, beside batch and model splits, to the one-device losses; each
stage holds its share of the layers; evaluation and scoring run through the stages; the
settings that cannot pipeline say so in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mtp import B, L, make_trainer, packed_batch

from mtrain.errors import ConfigError
from mtrain.models import pipeline
from mtrain.models.moe import MoEConfig
from mtrain.models.pipeline import PipelineConfig
from mtrain.models.transformer import EncoderDecoder, TransformerConfig
from mtrain.parallel.layout import Layout, LayoutError

# A Llama-like stack of 8 scanned layers: 4 stages of 2, or 2 stages x 2 runs of 2.
LLAMA = dict(vocab_size=64, d_model=16, d_ff=32, num_heads=2, num_kv_heads=1, d_kv=8,
             num_layers=8, max_length=L, position_encoding="rotary",
             mlp_activations=("silu", "linear"), dropout_rate=0.0, scan_layers=True)
MOE = dict(LLAMA, moe_every=2, moe=MoEConfig(num_experts=4, top_k=2, group_size=L))
SPLIT = "layers:stage;batch:batch;heads:model;d_ff:model"
GPIPE, CIRCULAR = PipelineConfig(), PipelineConfig(schedule="circular", repeats=2)


# ---- the schedules, on a stack of plain functions ----

def _toy(layers, d=8):
    return jax.random.normal(jax.random.key(0), (layers, d, d)) * 0.5


def _chunk(w, x, rows, key):
    """A chunk of layers x <- tanh(x w + row bias), as a scan: its statistic each layer's
    mean activation."""
    def layer(x, wl):
        y = jnp.tanh(x @ wl + rows[:, None, None])
        return y, {"mean": y.mean(), "top": y.max()}
    return jax.lax.scan(layer, x, w)


def _stack(w, x, bias):
    stats = []
    for wl in w:
        x = jnp.tanh(x @ wl + bias[:, None, None])
        stats.append(x)
    return x, stats


@pytest.mark.parametrize("mesh_shape, config, microbatches", [
    ("stage:4;batch:2", GPIPE, 4), ("stage:2;batch:4", CIRCULAR, 2),
    ("stage:4;batch:2", PipelineConfig(schedule="circular", repeats=3), 4)])
def test_the_schedules_compute_the_stack(mesh_shape, config, microbatches):
    """Outputs, statistics (per layer: the mean over microbatches, the most) and gradients
    of a pipelined stack of 12 layers equal the plain loop's (float32: outputs within a few
    ulps of values near 1; a gradient sums 48 rows' products through 12 layers in another
    order, within 2e-5 of its largest entry)."""
    layout = Layout(mesh_shape, "layers:stage;batch:batch")
    mesh = layout.make_mesh()
    config = PipelineConfig(config.schedule, config.repeats, microbatches)
    w, x = _toy(12), jax.random.normal(jax.random.key(1), (16, 3, 8))
    bias = jnp.linspace(-1, 1, 16)
    reductions = pipeline.Reductions(maxima=("top",))

    def piped(w, x):
        with layout.activate(mesh):
            return pipeline.run(config, _chunk, w, x, bias, None, reductions)

    def loss(f):
        return lambda w, x: jnp.sum(f(w, x)[0] ** 2)

    out, stats = jax.jit(piped)(w, x)
    want, layers = _stack(w, x, bias)
    np.testing.assert_allclose(out, want, atol=2e-6)
    mb = np.asarray(pipeline.microbatched(jnp.stack(layers, 1), microbatches))  # [M, b/M, n..]
    np.testing.assert_allclose(stats["mean"], mb.mean((1, 3, 4)).mean(0), atol=2e-6)
    np.testing.assert_allclose(stats["top"], np.stack(layers).max((1, 2, 3)), atol=2e-6)
    got = jax.jit(jax.grad(loss(piped), argnums=(0, 1)))(w, x)
    for a, b in zip(got, jax.grad(loss(lambda w, x: _stack(w, x, bias)), argnums=(0, 1))(w, x)):
        np.testing.assert_allclose(a, b, atol=2e-5 * np.abs(b).max())
    text = jax.jit(jax.grad(loss(piped))).lower(w, x).compile().as_text()
    assert "collective-permute" in text


def test_microbatches_and_the_bubble():
    assert pipeline.bubble(4, 13) == pytest.approx(3 / 16)
    assert pipeline.bubble(4, 8, 2) == pytest.approx(3 / 19)
    # the fewest that keep the bubble at most a fifth, rows that split as the batch's do
    assert pipeline.microbatch_count(GPIPE, 64, 4) == 12 + 4  # (12 does not divide 64)
    assert pipeline.microbatch_count(GPIPE, 32, 2, data_ways=2) == 4
    assert pipeline.microbatch_count(CIRCULAR, 32, 4) == 8  # 2 x 8 >= 4 x 3
    assert pipeline.microbatch_count(GPIPE, 8, 4) == 8  # (none keeps it: the most)
    assert pipeline.microbatch_count(PipelineConfig(microbatches=2), 8, 4) == 2
    with pytest.raises(ConfigError, match="pipeline.microbatches=3 does not fit a batch of 8"):
        pipeline.microbatch_count(PipelineConfig(microbatches=3), 8, 4)
    with pytest.raises(ConfigError, match="at least 4 microbatches"):
        pipeline.microbatch_count(CIRCULAR, 8, 4, data_ways=4)
    with pytest.raises(ValueError, match="pipeline.schedule must be one of"):
        PipelineConfig(schedule="1f1b")
    with pytest.raises(ValueError, match="pipeline.repeats must be at least 2"):
        PipelineConfig(schedule="circular", repeats=1)


# ---- the model ----

def losses_of(trainer, state, steps):
    out = []
    for seed in range(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(packed_batch(seed)))
        out.append(float(metrics["loss"]))
    return out, state


_ONE_DEVICE = {}  # (settings, steps) -> (parameters, losses): the cases share them


def one_device_losses(settings, steps, rate=1.0):
    """(the initial parameters, the losses of `steps` steps at learning rate x `rate`) of
    the model `settings` on one device, trained once for every case that asks (a pipeline
    config changes neither)."""
    key = (repr(sorted(settings.items())), steps, rate)
    if key not in _ONE_DEVICE:
        one = make_trainer(TransformerConfig(**settings), rate=rate)
        state = one.init_state()
        _ONE_DEVICE[key] = jax.device_get(state.params), losses_of(one, state, steps)[0]
    return _ONE_DEVICE[key]


def stage_losses(settings, mesh_shape, rules, config, steps=10, rate=1.0):
    """(the one-device losses of `steps` steps, those with `mesh_shape`/`rules` and the
    pipeline `config`, the split run's final state) from the same parameters."""
    params, reference = one_device_losses(settings, steps, rate)
    split = make_trainer(TransformerConfig(**settings, pipeline=config), mesh_shape, rules,
                         rate=rate)
    got, final = losses_of(split, split.start_from(params), steps)
    return reference, got, final


@pytest.mark.parametrize("settings, mesh_shape, rules, config, steps, rate", [
    pytest.param(LLAMA, "stage:4;batch:2", "layers:stage;batch:batch", GPIPE, 10, 1.0,
                 marks=pytest.mark.slow),  # (each about 20 s; the fast tier: the schedules)
    # (the stage dimension by another name, pp, beside dp: any name will do)
    pytest.param(LLAMA, "pp:2;dp:2;model:2", "layers:pp;batch:dp;heads:model;d_ff:model",
                 CIRCULAR, 10, 1.0, marks=pytest.mark.slow),
    # (5 steps: with 4 heads this model's runs part at 3x a step after the 7th under any
    # layout, model:2 without stages by 1.4e-5 at the 10th)
    pytest.param(dict(LLAMA, num_heads=4, num_kv_heads=2), "stage:4;model:2",
                 "layers:stage;heads:model;kv_heads:model",
                 PipelineConfig(schedule="circular", repeats=2, microbatches=4), 5, 1.0,
                 marks=pytest.mark.slow),
    # (the experts at 0.3 times the rate: at the full rate this model's 10th step parts
    # by 3e-5 under any layout, batch:4;model:2 without stages too)
    pytest.param(MOE, "stage:2;batch:2;model:2", SPLIT + ";experts:batch", GPIPE, 10, 0.3,
                 marks=pytest.mark.slow),
    pytest.param(MOE, "stage:4;batch:2", "layers:stage;batch:batch", GPIPE, 10, 0.3,
                 marks=pytest.mark.slow)])
def test_stages_train_as_one_device(settings, mesh_shape, rules, config, steps, rate):
    """From the same parameters, the losses of the one-device run within 1e-5 relative
    (float32 sums in another order; observed <= 5e-7). With experts the routing is
    discontinuous: a token whose top-2 experts tie to a float's last bit may choose
    another under any other layout, and a run at the full rate amplifies that past 1e-5
    by the 10th step whatever the layout; at 0.3 of it the loss still falls (4.63 to
    4.24) and no step parts. The experts' statistics add up over the microbatches to the
    batch's (`test_the_experts_statistics_are_the_batchs`). The stacked layers lie over the
    stage dimension, whatever its name. (Pairwise, no longer run: stages alone, 'stage:2',
    whose rows no data axis splits, as in 'stage:4;model:2'; the experts in the circular
    schedule, which reorders the stacked leaves whatever a layer holds: the Llama's; the
    experts' statistics through it are the next test's.)"""
    reference, got, final = stage_losses(settings, mesh_shape, rules, config, steps, rate)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    spec = jax.tree_util.tree_leaves(final.params["layers"])[0].sharding.spec
    assert spec[0] == mesh_shape.split(":")[0]


@pytest.mark.slow  # (11 s)
def test_the_experts_statistics_are_the_batchs():
    """Through 2 stages, circular (4 microbatches whose padding differs, each through the
    stages twice; the experts' training runs above are GPipe's) the experts' load-balancing
    loss (a mean over the groups that hold real tokens), router z-loss and dropped
    fraction (means over real tokens), and the auxiliary loss they add up to, are the
    unsplit pass's: each microbatch's mean weighted by what it is a mean over (float32
    sums in another order: 1e-5); the load-balancing loss's gradients are the unsplit
    pass's (within 1e-4 of their largest)."""
    settings = dict(MOE, moe=MoEConfig(num_experts=4, top_k=2, group_size=L))
    one = make_trainer(TransformerConfig(**settings))
    two = make_trainer(TransformerConfig(**settings, pipeline=CIRCULAR), "stage:2",
                       "layers:stage")
    params, batch = jax.device_get(one.init_state().params), packed_batch(0)

    def aux(trainer):
        def of(p):
            with trainer.layout.activate(trainer.mesh):
                _, stats = trainer.apply_model(p, batch, True, stats=True)
            return stats["load_balance_loss"], stats
        return jax.jit(jax.value_and_grad(of, has_aux=True))(params)

    (_, want), want_grads = aux(one)
    (_, got), got_grads = aux(two)
    assert got.keys() == want.keys()
    for name in ("load_balance_loss", "router_z_loss", "dropped_fraction", "aux_loss"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max() + 1e-12)


def test_a_stage_holds_its_share_of_the_layers():
    """Over 4 stages each device holds a quarter of every stacked parameter and of its
    optimizer state, and the step sends activations between stages (collective-permutes),
    gathering no stacked parameter. Beside the pipeline the stages share the rows: each
    device's logits are 1/8 of the batch's (2-way batch x 4 stages), not the 1/2 of a
    device that only the batch split shares them with."""
    trainer = make_trainer(TransformerConfig(**LLAMA), "stage:4;batch:2",
                           "layers:stage;batch:batch")
    state = trainer.init_state()
    for tree in (state.params["layers"], state.opt_state):
        for leaf in jax.tree_util.tree_leaves(tree):  # (not a count or placeholder a layer)
            if leaf.ndim and leaf.size > leaf.shape[0] == LLAMA["num_layers"]:
                assert leaf.addressable_shards[0].data.shape[0] == LLAMA["num_layers"] // 4
    stacked = sum(x.size for x in jax.tree_util.tree_leaves(state.params["layers"]))
    held = sum(x.addressable_shards[0].data.size
               for x in jax.tree_util.tree_leaves(state.params["layers"]))
    assert held * 4 == stacked
    text = trainer.compile_train_step().as_text()
    assert "collective-permute" in text
    shapes = {f"f32[{','.join(map(str, x.shape))}]"
              for x in jax.tree_util.tree_leaves(state.params["layers"])}
    gathered = [line for line in text.splitlines() if "all-gather" in line
                and any(s in line.split("all-gather")[0] for s in shapes)]
    assert not gathered, gathered[:3]
    logits = set(re.findall(rf"f32\[(\d+),{L},{LLAMA['vocab_size']}\]", text))
    assert logits == {str(B // 8)}


def test_evaluation_and_scoring_run_through_the_stages():
    """The eval sums and each token's log-likelihood over 4 stages are the one device's."""
    one = make_trainer(TransformerConfig(**LLAMA))
    split = make_trainer(TransformerConfig(**LLAMA), "stage:4;batch:2",
                         "layers:stage;batch:batch")
    params = jax.device_get(one.init_state().params)
    state = split.start_from(params)
    batch = packed_batch(5)
    want = one.eval_step(one.start_from(params).params, one.place_batch(batch))
    got = split.eval_step(state.params, split.place_batch(batch))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5)


def test_settings_that_cannot_pipeline_say_so():
    def step(settings, mesh_shape="stage:4", rules="layers:stage"):
        trainer = make_trainer(TransformerConfig(**settings), mesh_shape, rules)
        return trainer.train_step(trainer.init_state(), trainer.place_batch(packed_batch(0)))

    with pytest.raises(ConfigError, match="needs transformer.scan_layers=True"):
        step(dict(LLAMA, scan_layers=False))
    with pytest.raises(LayoutError, match="dimension 'layers' of size 6 is not divisible by "
                                          "mesh dimension 'stage' of size 4"):
        step(dict(LLAMA, num_layers=6))
    with pytest.raises(ConfigError, match="a stack of 4 scanned layers does not split into "
                                          "4 stages x 2 runs"):
        make_trainer(TransformerConfig(**dict(LLAMA, num_layers=4), pipeline=CIRCULAR),
                     "stage:4", "layers:stage").compile_train_step()
    with pytest.raises(ConfigError, match="the encoder-decoder runs no pipeline"):
        layout = Layout("stage:2", "layers:stage")
        mesh = layout.make_mesh(jax.devices()[:2])
        model = EncoderDecoder(TransformerConfig(**dict(LLAMA, num_layers=2)))
        ids = jnp.ones((2, 4), jnp.int32)
        params = model.init(jax.random.key(0), ids, ids, ids, ids, ids, ids)
        with layout.activate(mesh):
            model.apply(params, ids, ids, ids, ids, ids, ids)


def test_with_several_hosts_the_stages_lie_across_them():
    """With several processes (`data_major`) the mesh dimension that splits ``layers`` is
    laid out outermost, before ``batch``'s: with 2 hosts of 4 devices each, a stage a host."""
    mesh = Layout("batch:4;stage:2", "layers:stage;batch:batch").make_mesh(data_major=True)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    stage = mesh.axis_names.index("stage")
    assert sorted(np.take(ids, 0, axis=stage).ravel()) == [0, 1, 2, 3]
    assert sorted(np.take(ids, 1, axis=stage).ravel()) == [4, 5, 6, 7]


def test_slices_lie_along_the_outermost_dimension():
    """TPU multislice: devices of 2 slices (their slice_index) make a grid whose outermost
    dimension (the stages) spans the slices; one that does not divide into them is one
    line; devices of one slice are left to jax.make_mesh."""
    from types import SimpleNamespace

    from mtrain.parallel.slices import sliced_grid

    devices = [SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 2,
                               platform="cpu", device_kind="cpu", coords=None)
               for i in range(8)]
    grid = sliced_grid(devices, (2, 4), ("stage", "batch"))
    assert [[d.id for d in row] for row in grid] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(LayoutError, match="'stage' of size 1 does not divide into them"):
        sliced_grid(devices[:4] + devices[4:5], (1, 5), ("stage", "batch"))
    assert sliced_grid(jax.devices(), (2, 4), ("stage", "batch")) is None
