"""Fine-tuning is the home framework's training (issue 47): an update does not depend on
whether the layers are scanned (Adafactor's statistics are each layer's, weight decay
follows a parameter's role, not its rank), and an imported Llama fine-tuned by the Trainer
with AdamW takes torch's steps (../shared/oracles/llama_gqa/finetune.npz).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from test_oracles import ORACLES, import_folder, lm_logits, load
from test_trainer import packed_batches

from mtrain.models.blocks import period
from mtrain.models.moe import MoEConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.losses import LossConfig
from mtrain.training.trainer import Trainer

STEPS, B, L = 20, 8, 16
# Llama-like: SwiGLU, rotary positions, 2 key/value heads of 4.
TINY = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                         num_layers=2, max_length=L, mlp_activations=("silu", "linear"),
                         position_encoding="rotary", num_kv_heads=2)
# Experts every second layer: scanned as 2 groups of (layer_0, layer_1).
TINY_MOE = dataclasses.replace(TINY, num_layers=4, moe_every=2,
                               moe=MoEConfig(num_experts=4, top_k=2))
SPLIT = ("batch:2;model:2", "batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model")


def stacked(params: dict, config: TransformerConfig) -> dict:
    """An unscanned model's parameters as the scanned model holds them: ``layer_{i}``
    stacked on a leading ``layers`` axis under ``layers``; with a repeating group of
    p = `period` layers, ``layers/layer_{j}`` stacked over the groups (layer g p + j)."""
    p = period(config)
    out = {k: v for k, v in params.items() if not k.startswith("layer_")}
    groups = [{f"layer_{j}": params[f"layer_{g * p + j}"] for j in range(p)}
              for g in range(config.num_layers // p)]
    if p == 1:
        groups = [g["layer_0"] for g in groups]
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *groups)
    return out


def trainer(config, opt, mesh_shape="", rules=""):
    layout = Layout(mesh_shape, rules)
    return Trainer(model=DecoderLM(config), optimizer=opt, layout=layout,
                   mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=B,
                   sequence_length=L, seed=0, objective=LanguageModeling(LossConfig(z_loss=0.0)))


def run(trainer_, params, batches):
    """(losses, final parameters) of one step per batch from `params`."""
    state, out = trainer_.start_from(params), []
    for batch in batches:
        state, metrics = trainer_.train_step(state, trainer_.place_batch(batch))
        out.append(float(metrics["loss"]))
    return np.array(out), jax.device_get(state.params)


def adafactor(**kwargs):
    return optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=5, constant=0.1),
                               **kwargs)


OPTIMIZERS = {
    # A high rate, so that decaying what must not be (a scanned stack's [layers, d_model]
    # norm scales, under a rule by rank) shows in the loss.
    "adamw": lambda: optimizer.adamw(1e-2, weight_decay=0.1),
    # Every matrix factored (a stacked [layers, d_model] scale too, were the stack taken as
    # one tensor), the parameter scale and the update clipping: each layer's.
    "adafactor_factored": lambda: adafactor(min_dim_size_to_factor=2),
    # Mesh-TF's settings (the tiny matrices are not factored at 128).
    "adafactor": adafactor,
}
CASES = [  # (optimizer, model, the scanned run's layout)
    pytest.param("adamw", TINY, ("", ""), id="adamw", marks=pytest.mark.slow),  # (14 s; the
    # scanned and split fine-tuning below takes torch's steps, the unscanned one too)
    pytest.param("adafactor_factored", TINY, SPLIT, id="adafactor_factored-split",
                 marks=pytest.mark.slow),  # (7 s)
    pytest.param("adafactor", TINY, ("", ""), id="adafactor", marks=pytest.mark.slow),
    pytest.param("adafactor_factored", TINY_MOE, ("", ""), id="adafactor_factored-experts",
                 marks=pytest.mark.slow),
    pytest.param("adamw", TINY_MOE, SPLIT, id="adamw-experts-split", marks=pytest.mark.slow),
]


# The most elements of a parameter (a fraction; at least one) whose gradient is at rounding
# level: a sum of a batch's terms that cancel to within float32's eps of their magnitudes
# (a rare token's embedding row, an expert's weight that a few tokens pull both ways).
# AdamW divides each element's gradient by its own root mean square, so there rounding is
# the sign and size of a step of up to about the learning rate, and the two runs part by
# that much (measured: 1 to 3 elements of 16,384, by 2e-5 to 1e-4 at a rate of 1e-2, on an
# Intel Xeon; none on an AMD EPYC). A bug of the kind this file catches (decayed norm
# scales, a stack's statistics) moves every element of the parameters it touches.
ROUNDING_LEVEL = 1e-3


def same_update(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    """Whether `got` is `want` to `rtol` of its largest magnitude, but for at most
    `ROUNDING_LEVEL` of its elements (and at least one)."""
    far = np.abs(got - want) > rtol * np.abs(want).max()
    return far.sum() <= max(1, int(ROUNDING_LEVEL * far.size))


@pytest.mark.parametrize("name, config, layout", CASES)
def test_scanning_the_layers_changes_no_update(name, config, layout):
    """A scanned and an unscanned run (on one device) from the same parameters, the
    unscanned ones stacked, give the same losses for 20 steps and the same parameters.

    Tolerances: the two runs compute the same numbers in another order (a scan against
    unrolled layers, a vmapped update against one per layer, a split layout's partial
    sums), so they part only by float32 rounding (eps 1.2e-7) grown by 20 steps of
    normalised updates (measured: losses 2.4e-7 relative, parameters 6e-7 to 2e-5 of their
    largest magnitude). Statistics of the whole stack, or decayed scanned norm scales,
    move the losses by 8e-5 to 7e-4 and the parameters by 2e-2 to 9e-2 (measured with the
    code before this test), in every element: 1e-5 and 1e-4 sit between, with a margin
    both ways. `same_update` allows the few elements whose gradient is at rounding level
    (`ROUNDING_LEVEL`)."""
    opt = OPTIMIZERS[name]()
    plain = trainer(config, opt)
    scanned = trainer(dataclasses.replace(config, scan_layers=True), opt, *layout)
    params = jax.device_get(plain.init_state().params)
    batches = packed_batches(STEPS)
    want, want_params = run(plain, params, batches)
    got, got_params = run(scanned, stacked(params, config), batches)
    assert want[-1] < want[0] - 0.3, want  # it trains
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_params),
                            jax.tree.leaves(stacked(want_params, config))):
        assert same_update(a, b, 1e-4), jax.tree_util.keystr(path)
    if name == "adafactor_factored" and layout == SPLIT:
        # A stacked weight's per-layer factored moments keep `layers` and the dimension
        # they did not reduce: wi's column moments [layers, d_ff] are split as d_ff is.
        specs = {jax.tree_util.keystr(path): s.spec for path, s in
                 jax.tree_util.tree_leaves_with_path(scanned.state_shardings.opt_state)}
        columns = [k for k in specs if "v_col" in k and "['layers']['mlp']['wi_0']" in k]
        assert len(columns) == 1 and specs[columns[0]] == PartitionSpec(None, "model"), specs


def test_starting_from_parameters_of_another_shape_is_refused():
    plain = trainer(TINY, optimizer.adamw(1e-3))
    params = jax.device_get(plain.init_state().params)
    with pytest.raises(ValueError, match=r"\['layer_0'\]\['attention_norm'\]\['scale'\] is "
                                         r"missing, the model's is \(32,\)"):
        plain.start_from(stacked(params, TINY))  # a scanned model's
    params["final_norm"]["scale"] = np.ones(TINY.d_model + 1, np.float32)
    with pytest.raises(ValueError, match=r"\['final_norm'\]\['scale'\] is \(33,\), the "
                                         r"model's is \(32,\)"):
        plain.start_from(params)


def finetune_oracle() -> dict:
    """finetune.npz, and oracle.npz's `input_ids` (what `logits_after` are of)."""
    folder = os.path.join(ORACLES, "llama_gqa")
    return {**np.load(os.path.join(folder, "finetune.npz")),
            "input_ids": np.load(os.path.join(folder, "oracle.npz"))["input_ids"]}


# torch.optim.AdamW as ORACLE.md ran it, as a user configures the run (gin): a constant rate.
TORCH_ADAMW = ["run.optimizer=@adamw", "adamw.b1=0.9", "adamw.b2=0.95", "adamw.eps=1e-8",
               "adamw.weight_decay=0.1", "adamw.clip_norm=1.0",
               "learning_rate_schedule.shape='constant'", "learning_rate_schedule.warmup_steps=1",
               "learning_rate_schedule.constant=1e-3",
               "loss.z_loss=0.0", "loss.label_smoothing=0.0",  # the plain mean cross-entropy
               "run.batch_size=2", "run.sequence_length=23"]
ORACLE_LAYOUTS = {
    "one device": [],
    "batch:2;model:2": ["run.mesh_shape='batch:2;model:2'",
                        "run.layout_rules='batch:batch;d_ff:model;heads:model;kv_heads:model;"
                        "vocab:model'"],
}


@pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
@pytest.mark.parametrize("layout, scan", [  # (each layout once, scanning and not once: the
    # cross product's other two cases took no path of their own; test_scanning_the_layers_
    # changes_no_update compares scanned runs, split and not, with unscanned ones)
    pytest.param("one device", False, id="one_device-unscanned"),
    pytest.param("batch:2;model:2", True, id="split-scanned"),
])
def test_fine_tuning_an_import_takes_torchs_adamw_steps(tmp_path, layout, scan):
    """llama_gqa imported by ``--mode=import``, then three Trainer steps of AdamW on
    finetune.npz's batch: the losses, the gradient norms (before clipping) and the logits
    after are those of ``torch.optim.AdamW`` (ORACLE.md).

    The batch: ``targets`` as one packed row each (segment 1, positions 0..22); the model
    reads its start id (``transformer.start_id``: Llama's bos 1, from the import) and then
    the targets shifted right, which is ``[1] + targets`` without the last; the loss is the
    mean over the 46 target ids.

    Tolerances (the issue's): losses 1e-5 relative (float32 sums over 46 tokens of a
    reference that itself moves by ~2e-6 between torch's attention implementations);
    gradient norms 1e-4 relative (a norm of 151,872 float32 gradients, summed in another
    order); logits after 1e-3 absolute (logits O(1): three steps of size 1e-3 whose
    per-element direction, Adam's g / sqrt(v), is sensitive where a gradient is tiny)."""
    settings = [*ORACLE_LAYOUTS[layout], *(["transformer.scan_layers=True"] if scan else [])]
    import_folder(os.path.join(ORACLES, "llama_gqa"), tmp_path / "m",
                  *[f"--gin_param={p}" for p in settings])
    exp, params, _ = load(tmp_path / "m", *settings, *TORCH_ADAMW)
    trainer_, want = exp.trainer, finetune_oracle()
    assert trainer_.model.config.start_id == int(want["bos"])
    targets = want["targets"].astype(np.int32)
    batch = trainer_.place_batch({
        "targets": targets, "targets_segment_ids": np.ones_like(targets),
        "targets_positions": np.broadcast_to(np.arange(targets.shape[1], dtype=np.int32),
                                             targets.shape)})
    state, losses, norms = trainer_.start_from(params), [], []
    for _ in range(3):
        state, metrics = trainer_.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        assert float(metrics["num_tokens"]) == targets.size
    with trainer_.layout.activate(trainer_.mesh):
        logits = jax.jit(lambda p, ids: lm_logits(trainer_.model, {"params": p}, ids))(
            state.params, want["input_ids"].astype(np.int32))
    np.testing.assert_allclose(losses, want["losses"], rtol=1e-5)
    np.testing.assert_allclose(norms, want["grad_norms"], rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want["logits_after"], atol=1e-3, rtol=0)
