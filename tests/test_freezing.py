"""Frozen parameters and LoRA adapters in the trainer (`training.freezing`, `models.lora`):
only what trains moves and keeps optimizer state, no gradient is formed for the rest, and
layouts (the adapters' ``lora_rank`` split among them) never change the losses."""

import dataclasses

import jax
import numpy as np
import pytest

from test_trainer import B, CONFIG, L, packed_batches

from mtrain.models.lora import LoraConfig, is_adapter
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.models import parameters
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer

LORA = dataclasses.replace(CONFIG, lora=LoraConfig(rank=4, alpha=8.0, dropout=0.1))
SPLIT = "d_ff:model;heads:model;vocab:model"


def trainer_of(mesh_shape="", rules="", parameter_rules="", config=LORA, trainable=is_adapter,
               opt=None, num_microbatches=1, batch_size=B):
    layout = Layout(mesh_shape, rules, parameter_rules)
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    opt = opt or optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=1))
    return Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                   batch_size=batch_size, sequence_length=L, seed=3, trainable=trainable,
                   num_microbatches=num_microbatches)


def train(trainer, steps=3):
    state = trainer.init_state()
    first = jax.device_get(state.params)
    losses = []
    for batch in packed_batches(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, first, jax.device_get(state)


@pytest.mark.slow  # (about 30 s)
def test_lora_layouts_and_microbatches_never_change_the_losses():
    """Adapters with dropout train alone (the base unmoved); on data and model parallel
    layouts, with ``lora_rank`` split, under FSDP and in two microbatches, the losses of one
    device within test_trainer's tolerance (float32 sums in another order)."""
    reference, first, state = train(trainer_of())  # (3 steps on one device)
    assert reference[-1] < reference[0]
    for path, value in parameters.paths(first).items():  # the base as it was; adapters moved
        assert np.array_equal(parameters.paths(state.params)[path], value) != is_adapter(path), \
            path
    for args in [("batch:4;model:2", "batch:batch;" + SPLIT),
                 ("batch:4;model:2", "batch:batch;lora_rank:model"),
                 ("batch:8", "batch:batch", "d_model:batch")]:
        losses, _, _ = train(trainer_of(*args))
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=str(args))
    # Microbatches draw each slice's dropout apart: compared without dropout.
    quiet = dataclasses.replace(LORA, dropout_rate=0.0, lora=LoraConfig(rank=4, alpha=8.0))
    reference, _, _ = train(trainer_of(config=quiet))
    losses, _, _ = train(trainer_of("batch:4;model:2", "batch:batch;" + SPLIT, config=quiet,
                                    num_microbatches=2))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_frozen_parameters_keep_their_values_and_have_no_optimizer_state():
    keep = lambda path: path in ("softmax", "final_norm/scale")  # noqa: E731
    trainer = trainer_of(config=CONFIG, trainable=keep)
    _, first, state = train(trainer)
    before, after = parameters.paths(first), parameters.paths(state.params)
    for path, value in before.items():
        moved = not np.array_equal(after[path], value)
        assert moved == keep(path), path
    stats = [jax.tree_util.keystr(p) for p, leaf in
             jax.tree_util.tree_leaves_with_path(state.opt_state) if np.ndim(leaf)]
    assert stats and all("softmax" in p or "final_norm" in p for p in stats), stats
    # No weight gradient is formed for a frozen parameter: the step has fewer matmuls.
    full = trainer_of(config=CONFIG, trainable=None)
    dots = lambda t: t.lower_train_step().as_text().count("dot_general")  # noqa: E731
    assert dots(trainer) < dots(full)


@pytest.mark.slow  # (about 11 s)
def test_lora_optimizer_state_is_below_2_percent_of_full_fine_tuning():
    """AdamW's two moments per trained parameter, measured on the devices: rank 8 adapters
    on every projection of a d_model 512 model against all of its parameters."""
    config = TransformerConfig(vocab_size=1024, d_model=512, d_ff=2048, num_heads=8, d_kv=64,
                               num_layers=2, max_length=16, mlp_activations=("silu", "linear"),
                               position_encoding="rotary")
    adamw = optimizer.adamw(1e-4)

    def state_bytes(trainer):
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(trainer.init_state().opt_state))

    full = state_bytes(trainer_of(config=config, trainable=None, opt=adamw))
    lora = state_bytes(trainer_of(config=dataclasses.replace(config, lora=LoraConfig(rank=8)),
                                  opt=adamw))
    assert lora < 0.02 * full, (lora, full)
