"""Dropless experts (`mtrain/models/dropless.py`) on grouped matmuls (`grouped.py`): each
kernel against a per-group reference written here, the layer against the per-token
reference of test_moe and against capacity dispatch with room for every token (values,
gradients, statistics, adapters), every layout of the experts (all-to-all padded and ragged,
`experts:model`, `d_ff:model`), and the planner's count of the tiles loop.

Tolerances: float32 sums of a few products of O(1) values; the reference in float64:
1e-5 relative and absolute (test_moe's). Where two float32 computations are compared that
sum in another order (grouped against one-hot dispatch, layouts), 1e-5 relative and 2e-5
absolute on gradients of O(10) (a few ulps of the largest).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_moe
from mtrain.models import grouped
from mtrain.models.lora import LoraConfig
from mtrain.models.moe import STATS, MoEConfig, MoeFeedForward, summary
from mtrain.parallel.layout import Layout
from mtrain.planning.hlo_cost import hlo_cost

TOL = dict(rtol=1e-5, atol=1e-5)
CLOSE = dict(rtol=1e-5, atol=2e-5)
KERNELS = ("tiles", "ragged_dot", "megablox")


def _grouped_reference(x, w, sizes, dy):
    """y, dx, dw of y = grouped x w, in float64, and the gradients for cotangent `dy`."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_matmul_kernels_equal_a_per_group_reference(kernel):
    """Groups of 13, 0 (empty), 22 and 1 rows, 4 rows past the groups (0, no gradient)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(40, 5)), jnp.float32)
    sizes = [13, 0, 22, 1]
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_matmul(x, w, jnp.asarray(sizes), kernel), x, w)
    dx, dw = vjp(dy)
    for ours, theirs in zip((y, dx, dw), _grouped_reference(x, w, sizes, dy)):
        np.testing.assert_allclose(ours, theirs, **TOL)
    assert not np.any(np.asarray(y[36:])) and not np.any(np.asarray(dx[36:]))


def test_the_tiles_loop_runs_the_tiles_routing_fills_and_the_planner_counts_them():
    """Padding per group below a tile; the loop's trip count is the data's, and the planner
    counts its matmuls at the balanced count the loop is named for."""
    assert grouped.tile_rows(4096, 8) == 128 and grouped.tile_rows(64, 8) == 8
    assert grouped.balanced_trips(4096, 8, 128) == 32 and grouped.balanced_trips(100, 8, 8) == 16
    m, k, n, e = 512, 16, 32, 4
    x, w = jnp.ones((m, k)), jnp.ones((e, k, n))
    sizes = jnp.full((e,), m // e, jnp.int32)
    text = jax.jit(lambda x, w, s: grouped.grouped_matmul(x, w, s, "tiles")).lower(
        x, w, sizes).compile().as_text()
    t = grouped.tile_rows(m, e)
    assert f"balanced_trips_{m // t}" in text
    assert hlo_cost(text, 1).matmul_flops == 2 * m * k * n  # = the analytic count
    # an unbalanced routing runs more tiles (each group's last one partly filled) and is right
    lopsided = jnp.asarray([1, 0, 3 * t + 1, 5], jnp.int32)
    y = grouped.grouped_matmul(x, w, lopsided, "tiles")
    np.testing.assert_array_equal(y[:3 * t + 7], k)
    assert not np.any(np.asarray(y[3 * t + 7:]))


def _dropless(config: MoEConfig, **kwargs) -> MoEConfig:
    return dataclasses.replace(config, dispatch="dropless", **kwargs)


@pytest.mark.parametrize("kernel", ["tiles", "ragged_dot", "tokamax",  # (megablox: above)
                                    pytest.param("megablox", marks=pytest.mark.slow)])
def test_dropless_layer_equals_the_reference_and_capacity_without_drops(kernel):
    """The per-token reference; capacity dispatch with a slot for every token: the same
    values, gradients (parameters and input) and statistics, padding routed nowhere."""
    layer, params, x = test_moe._layer(2, activations=("silu", "linear"))
    fast = MoeFeedForward(_dropless(layer.config, grouped_kernel=kernel), d_ff=16,
                          activations=("silu", "linear"))
    y, _ = jax.jit(lambda p, x: fast.apply({"params": p}, x, True, mutable=[STATS]))(params, x)
    np.testing.assert_allclose(y, test_moe._reference(params, x, 2, ("silu", "linear")), **TOL)
    real = jnp.ones((2, 8)).at[1, 5:].set(0)

    def loss(module):
        def f(params, x):
            y, stats = module.apply({"params": params}, x, True, real, mutable=[STATS])
            return jnp.sum(jnp.sin(y) * real[..., None]), (y, summary(stats[STATS]))
        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(params, x)

    (value, (y, stats)), grads = loss(fast)
    (value_c, (y_c, stats_c)), grads_c = loss(layer)
    np.testing.assert_allclose(value, value_c, **TOL)
    np.testing.assert_allclose(y, y_c, **TOL)
    assert not np.any(np.asarray(y[1, 5:]))  # padding: nothing from any expert
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **CLOSE), grads, grads_c)
    assert stats.keys() == stats_c.keys() and float(stats["dropped_fraction"]) == 0.0
    for name in stats:
        np.testing.assert_allclose(stats[name], stats_c[name], **TOL, err_msg=name)


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_dropless_adapters_equal_capacitys():
    """LoRA on the experts' weights: the dropless layer merges each adapter into its weight
    (`lora.adapted`), capacity applies it factored: the same outputs and adapter
    gradients; adapter dropout is refused in one line."""
    lora = LoraConfig(rank=2, alpha=4.0)
    m = MoEConfig(num_experts=4, top_k=2, group_size=8, capacity_factor_train=2.0,
                  capacity_factor_eval=2.0)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 12)), jnp.float32)
    capacity = MoeFeedForward(m, d_ff=16, lora=lora)
    params = nn.unbox(capacity.init(jax.random.key(1), x, True)["params"])
    params = {k: v + 0.1 if k.endswith("_lora_b") else v for k, v in params.items()}
    assert {"wi_lora_a", "wi_lora_b", "wo_lora_a", "wo_lora_b"} <= set(params)

    def run(module):
        f = lambda p: jnp.sum(jnp.sin(module.apply({"params": p}, x, True,  # noqa: E731
                                                   mutable=[STATS])[0]))
        return jax.value_and_grad(f)(params)

    (value, grads), (value_c, grads_c) = run(MoeFeedForward(_dropless(m), 16, lora=lora)), \
        run(capacity)
    np.testing.assert_allclose(value, value_c, **TOL)
    for name in ("wi_lora_a", "wi_lora_b", "wo_lora_a", "wo_lora_b"):
        np.testing.assert_allclose(grads[name], grads_c[name], **CLOSE, err_msg=name)
    dropout = MoeFeedForward(_dropless(m), 16, lora=dataclasses.replace(lora, dropout=0.1))
    with pytest.raises(ValueError, match="lora.dropout applies to the input of 'wi'"):
        dropout.apply({"params": params}, x, True, mutable=[STATS])


# (mesh, rules, ragged all-to-all): the experts over the tokens' mesh dimension (all-to-all,
# padded and ragged), beside d_ff:model, over model with d_ff (a sum over model), and whole
# (the fast tier: the experts split with d_ff; the ragged all-to-all is in the full suite)
EXPERT_LAYOUTS = [
    pytest.param("batch:8", "batch:batch;experts:batch", False, marks=pytest.mark.slow),
    pytest.param("batch:8", "batch:batch;experts:batch", True, marks=pytest.mark.slow),
    pytest.param("batch:4;model:2", "batch:batch;experts:batch;d_ff:model", True,
                 marks=pytest.mark.slow),
    ("batch:2;model:4", "batch:batch;experts:model;d_ff:model", None),
    pytest.param("batch:4;model:2", "batch:batch;d_ff:model", None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh,rules,ragged", EXPERT_LAYOUTS)
def test_every_layout_of_the_experts_computes_one_devices_values_and_gradients(mesh, rules,
                                                                             ragged):
    m = MoEConfig(num_experts=8, top_k=2, group_size=16, dispatch="dropless")
    x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 16, 32)), jnp.float32)
    real = jnp.ones((8, 16)).at[1, 10:].set(0)
    params = nn.unbox(MoeFeedForward(m, 64, activations=("silu", "linear")).init(
        jax.random.key(1), x, True, real)["params"])

    def run(ragged=None, layout=None):
        module = MoeFeedForward(dataclasses.replace(m, ragged_all_to_all=ragged), 64,
                                activations=("silu", "linear"))

        def f(params, x):
            y = module.apply({"params": params}, x, True, real, mutable=[STATS])[0]
            return jnp.sum(jnp.sin(y) * real[..., None])

        step = jax.jit(jax.value_and_grad(f, (0, 1)))
        if layout is None:
            return step(params, x)
        with layout.activate(layout.make_mesh()):
            return step(params, x)

    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **CLOSE),
                           run(ragged, Layout(mesh, rules)), run())


# --- a model trains, decodes and plans alike ------------------------------------------

TRAIN_LAYOUTS = [("", "", ""), ("batch:8", "batch:batch;experts:batch", ""),
                 ("batch:2;model:4", "batch:batch;experts:model;d_ff:model;heads:model", ""),
                 ("batch:4;model:2", "batch:batch;experts:batch;d_ff:model", "d_model:batch")]


def moe_tiny_losses(settings, runs):
    """{key: (losses, dropped fractions)} of 3 steps of `moe_tiny` (with gin `settings`) on
    the same packed batches from the same seed, for each ``(key, moe settings, mesh_shape,
    rules, parameter_rules)`` of `runs`."""
    import test_trainer
    from mtrain import config
    from mtrain.models.transformer import DecoderLM
    from mtrain.training.language_modeling import LanguageModeling
    from mtrain.training.losses import LossConfig
    from mtrain.training.trainer import Trainer

    config.parse(["models/moe_tiny.gin"], ["transformer.max_length=16", "moe.group_size=16",
                                           "learning_rate_schedule.warmup_steps=2", *settings])
    model_config = config.model_config(test_trainer.CONFIG.vocab_size)
    opt = config.adamw(config.learning_rate_schedule(train_steps=10))
    batches = test_trainer.packed_batches(3)
    out = {}
    for key, moe, mesh_shape, rules, parameter_rules in runs:
        c = dataclasses.replace(model_config, moe=dataclasses.replace(model_config.moe, **moe))
        layout = Layout(mesh_shape, rules, parameter_rules)
        trainer = Trainer(model=DecoderLM(c), optimizer=opt, layout=layout,
                          mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=8,
                          sequence_length=16, seed=1,
                          objective=LanguageModeling(LossConfig(z_loss=0.0)))
        state, losses, dropped = trainer.init_state(), [], []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.place_batch(batch))
            losses.append(float(metrics["loss"]))
            dropped.append(float(metrics["dropped_fraction"]))
        out[key] = losses, dropped
    return out


@pytest.mark.slow  # (the fast tier: the layer in every layout above)
@pytest.mark.extended
@pytest.mark.parametrize("scan", [False, True])
def test_moe_tiny_trains_dropless_as_capacity_with_room_for_every_token(scan):
    """`moe_tiny` (4 layers, experts in 2; scanned: a dense and an expert layer per step)
    trains 3 steps dropless with the losses of capacity on one device (a slot for every
    token): unscanned on one device, with the experts over `model` beside `d_ff:model` and
    over `batch` (all-to-all) under FSDP's parameter rules; scanned with the experts over
    `batch`; nothing dropped. (Capacity in the other layouts: test_moe's layouts test;
    `batch:8` alone, unscanned: test_deepseek_experts' train steps, dropless.)"""
    layouts = [TRAIN_LAYOUTS[1]] if scan else [TRAIN_LAYOUTS[0], *TRAIN_LAYOUTS[2:]]
    runs = [(("capacity", "", ""), {"dispatch": "capacity"}, "", "", "")] + [
        (("dropless", mesh_shape, parameter_rules), {"dispatch": "dropless"}, mesh_shape,
         rules, parameter_rules) for mesh_shape, rules, parameter_rules in layouts]
    trained = moe_tiny_losses([f"transformer.scan_layers={scan}",
                               "moe.capacity_factor_train=4.0"], runs)
    assert all(d == 0.0 for _, dropped in trained.values() for d in dropped)
    losses = {key: run for key, (run, _) in trained.items()}
    first = losses["capacity", "", ""]
    assert len(set(first)) == 3  # (the steps change the model)
    for key, run in losses.items():
        np.testing.assert_allclose(run, first, rtol=1e-5, err_msg=str(key))


@pytest.mark.slow  # (20 s of compiling a 26.7B-parameter step for 256 devices)
@pytest.mark.extended  # (the planner's figures: test_planner's)
def test_the_26b_plan_counts_the_matmuls_dropless_runs():
    """`experiments/moe_26b_lm.gin` on 256 TPU v4 chips without recomputation: one-hot
    dispatch compiles 1.25x the analytic matmul FLOPs, dropless within 1.15x (the tiles at
    balanced routing); its padded all-to-all's padding is counted apart and left out of
    the step time (a TPU's all-to-all is ragged)."""
    import json

    from test_planner import run_plan

    def planned(dispatch):
        proc = run_plan("--gin_file=experiments/moe_26b_lm.gin", "--target=tpu-v4",
                        "--format=json", "--gin_param=transformer.remat_policy='none'",
                        f"--gin_param=moe.dispatch='{dispatch}'")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    for dispatch, low, high in (("capacity", 1.2, 1.3), ("dropless", 0.99, 1.15)):
        p = planned(dispatch)
        ratio = p["matmul_flops"] / (p["analytic_flops"] / p["num_devices"])
        assert low < ratio < high, (dispatch, ratio)
    a2a = p["collectives"]["all-to-all"]
    assert 0.9 * a2a["bytes_sent"] < a2a["padding_bytes"] < a2a["bytes_sent"]
    sent = sum(s["bytes_sent"] - s["padding_bytes"] for s in p["collectives"].values())
    from mtrain.parallel.targets import TARGETS

    bandwidth = TARGETS["tpu-v4"].interconnect_bandwidth
    assert p["communication_seconds"] * bandwidth == pytest.approx(sent)


@pytest.mark.slow  # (about two minutes: a fresh HOME's data, then every mode with each kernel)
def test_the_accelerator_kernels_run_every_mode_from_a_fresh_home(tmp_path, monkeypatch, capsys):
    """`experiments/moe_tiny_lm.gin` dropless with what a TPU runs (the Megablox kernel, in
    Pallas's interpreter here) and a GPU (tokamax's, its reference implementation here
    through the same call), and the ragged all-to-all (as XLA:CPU emulates it) from an
    empty HOME: train with Megablox, resume with tokamax's, then switch to capacity
    dispatch; then with each kernel eval, infer, score (the scores of the CPU's kernel and
    padded all-to-all) and plan. (One model dir for both kernels: each run of it compiles
    for 10-30 s. The same command again, nothing left to train: test_model_family_runs.)"""
    import json

    from mtrain.__main__ import main
    from test_model_family_runs import common_modes

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MTRAIN_DATA_DIR", raising=False)
    model_dir = tmp_path / "moe"

    def accelerator(kernel):
        return ["--gin_param=moe.dispatch='dropless'",
                f"--gin_param=moe.grouped_kernel='{kernel}'",
                "--gin_param=moe.ragged_all_to_all=True"]

    def dropped():
        lines = (model_dir / "metrics.jsonl").read_text().splitlines()
        return [r["train/dropped_fraction"] for r in map(json.loads, lines) if "train/loss" in r]

    argv = ["--gin_file=experiments/moe_tiny_lm.gin", f"--model_dir={model_dir}",
            "--gin_param=vocabulary.size=512", "--gin_param=run.sequence_length=64",
            "--gin_param=run.batch_size=8",  # (the kernels' paths, not their tokens' count)
            "--gin_param=run.eval_every=-1", "--gin_param=run.checkpoint_every=2",
            "--gin_param=run.log_every=1", "--gin_param=decoding.max_decode_length=4",
            "--gin_param=learning_rate_schedule.warmup_steps=1",
            "--gin_param=learning_rate_schedule.decay_steps=10"]
    assert main(argv + accelerator("megablox") + ["--gin_param=run.train_steps=2"]) == 0
    assert dropped() == [0.0, 0.0]
    capsys.readouterr()
    assert main(argv + accelerator("tokamax") + ["--gin_param=run.train_steps=3"]) == 0
    assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
    assert dropped() == [0.0, 0.0, 0.0]
    assert main(argv + ["--gin_param=run.train_steps=4"]) == 0  # capacity from here on
    assert "resuming from the checkpoint of step 3" in capsys.readouterr().err

    trained = argv + ["--gin_param=run.train_steps=4"]
    scores = {}
    for kernel in ("megablox", "tokamax"):
        assert main(trained + accelerator(kernel) + ["--mode=eval"]) == 0
        (tmp_path / kernel).mkdir()
        common_modes(capsys, trained + accelerator(kernel), tmp_path / kernel,
                     ["And God said, Let there be light.", "Amen."], "lm")
        scores[kernel] = (tmp_path / kernel / "scores.jsonl").read_text().splitlines()
    assert main(trained + ["--gin_param=moe.dispatch='dropless'", "--mode=score",
                           f"--input_file={tmp_path / 'tokamax' / 'score.txt'}",
                           f"--output_file={tmp_path / 'cpu.jsonl'}"]) == 0
    theirs = [json.loads(x)["log_likelihood"]
              for x in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    for kernel, ours in scores.items():
        np.testing.assert_allclose([json.loads(x)["log_likelihood"] for x in ours], theirs,
                                   rtol=1e-5, err_msg=kernel)
