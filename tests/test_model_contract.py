"""Adding a model is a class and a gin reference: no edit of the library.

`BagOfWordsLM` below implements the model contract (`mtrain.models.base`) and nothing else
of mtrain's: each position predicts the next token from the mean embedding of the tokens
before it in its packed segment. `run` trains it from a gin string, writes its checkpoints
and evaluates it, and a second run resumes from them.
"""

import json

import flax.linen as nn
import gin
import jax.numpy as jnp
import pytest

from mtrain import run as run_lib
from mtrain.models.base import shape_field, shape_fields

from tiny_config import TINY


class BagOfWordsLM(nn.Module):
    config: object  # the run's TransformerConfig: this model uses vocab_size and d_model
    features = ("targets",)

    @nn.compact
    def __call__(self, targets, segment_ids, positions, deterministic=True, return_hidden=False):
        c = self.config
        embed = self.param("embed", nn.initializers.normal(1.0), (c.vocab_size, c.d_model))
        out = self.param("out", nn.initializers.normal(c.d_model**-0.5), (c.d_model, c.vocab_size))
        x = jnp.take(embed, targets, axis=0)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        before = jnp.arange(targets.shape[1])[:, None] >= jnp.arange(targets.shape[1])[None, :]
        weights = (same & before).astype(x.dtype)
        hidden = jnp.einsum("blm,bmd->bld", weights, x) / weights.sum(-1, keepdims=True)
        # Predict token t+1 from tokens <= t: shift the hidden states right.
        hidden = jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        return (hidden, out) if return_hidden else hidden @ out

    def analytic_parameters(self) -> int:
        return 2 * self.config.vocab_size * self.config.d_model

    def analytic_flops(self, batch_size: int, length: int) -> float:
        return 6 * self.config.vocab_size * self.config.d_model * batch_size * length


gin.external_configurable(BagOfWordsLM, "BagOfWordsLM")


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_a_model_defined_here_trains_through_run(data_dir, tmp_path):
    model_dir = tmp_path / "bow"
    params = [*TINY, "run.task='bible_lm'", "run.mesh_shape='batch:4;model:2'",
              "run.layout_rules='batch:batch'", "run.checkpoint_every=2",
              "run.model=@BagOfWordsLM", "run.eval_every=0"]
    for steps in (2, 4):  # trains, then resumes from its checkpoint
        run_lib.parse_config([], [*params, f"run.train_steps={steps}"])
        results = run_lib.run(model_dir=str(model_dir))
        assert jnp.isfinite(results["eval/loss"])
    lines = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "train/loss" in m] == [2, 4]
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["2", "4"]
    gin.clear_config()


def test_shape_fields_come_from_the_config():
    from mtrain.models.transformer import TransformerConfig

    fields = shape_fields(TransformerConfig())
    assert {"vocab_size", "d_model", "num_layers", "scan_layers", "max_length"} <= set(fields)
    assert not {"dropout_rate", "activation_dtype", "attention", "remat_policy"} & set(fields)

    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        width: int = shape_field(8)
        rate: float = 0.1

    assert shape_fields(Config()) == {"width": 8}


def test_a_model_for_the_wrong_task_is_one_clear_error(data_dir, tmp_path):
    run_lib.parse_config([], [*TINY, "run.task='bible_enfr'", "run.model=@BagOfWordsLM",
                              "run.mesh_shape='batch:8'", "run.layout_rules='batch:batch'"])
    with pytest.raises(run_lib.ConfigError, match="BagOfWordsLM takes .'targets',., but task "
                                                  "'bible_enfr' gives .'inputs', 'targets'."):
        run_lib.build(model_dir=str(tmp_path / "x"))
    gin.clear_config()
