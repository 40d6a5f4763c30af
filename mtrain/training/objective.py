"""What a `Trainer` is given to minimise: an objective.

The trainer differentiates, steps, shards and loops; the objective says what a batch holds,
what is summed over it (for the gradient and for evaluation), what it needs besides the
parameters, and what evaluation reports. Two objectives today: `language_modeling`'s
`LanguageModeling` (the default: cross-entropy of every target token, with z-loss, label
smoothing and the masked loss of chats) and `dpo`'s `Preference` (DPO and IPO on preference
pairs, against a frozen reference model).

An objective is made from its settings (``LanguageModeling(LossConfig(...))``) and bound to
one trainer (`Objective.bind`), which tells it the trainer's `Setting`: the model, the
layout, the batch's shape, the parameters' shapes and shardings, which of them train, and
`apply`, the function that applies the model to a batch. The bound objective is the
trainer's `objective`; a new objective is a subclass of `Objective` in a file of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtrain.models.base import batch_keys
from mtrain.parallel.layout import Layout
from mtrain.training.losses import cross_entropy, loss_weights
from mtrain.training.state import with_shardings

# apply(params, batch, deterministic, rngs=None, return_hidden=False, stats=False,
#       model=None): the model's logits for a batch (`Trainer.apply_model`).
Apply = Callable[..., Any]


def classes(model: nn.Module) -> int:
    """The model's real vocabulary rows (its config's `real_vocab_size`; 0: all)."""
    return getattr(model.config, "real_vocab_size", 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """What an objective is told of the trainer it serves. `batch_shape` is the whole
    batch's (rows, length); a microbatch has ``rows // num_microbatches`` rows.
    `abstract_params` and `param_shardings`: every parameter's shape and sharding;
    `trainable(path)`: whether it trains."""

    model: nn.Module
    layout: Layout
    mesh: Mesh
    batch_shape: tuple[int, int]
    num_microbatches: int
    abstract_params: Any
    param_shardings: Any
    trainable: Callable[[tuple[str, ...]], bool]
    apply: Apply

    @property
    def classes(self) -> int:
        return classes(self.model)

    def sharded_params(self) -> Any:
        """The parameters as shapes with their shardings (for ahead-of-time lowering)."""
        return with_shardings(self.abstract_params, self.param_shardings)


def token_log_likelihoods(setting: Setting, params, batch, deterministic: bool = True,
                          rngs=None, model=None, stats: bool = False):
    """log p(target token) [batch, length] of every target that carries loss (0 elsewhere)
    under `params` (of `model`, default the trainer's); with `stats`, ``(that, the model's
    statistics)`` (`Trainer.apply_model`)."""
    out = setting.apply(params, batch, deterministic, rngs, stats=stats, model=model)
    logits, statistics = out if stats else (out, None)
    weights = loss_weights(batch)
    _, xent = cross_entropy(logits, batch["targets"], weights, classes=setting.classes)
    logps = jnp.where(weights, -xent, 0.0)
    return (logps, statistics) if stats else logps


class Objective:
    """The interface a `Trainer` calls (traced under the layout, inside its jitted steps,
    where it says so). A subclass writes `bind`, `loss_sums`, `eval_sums` and
    `eval_results`; the others have defaults for an objective that needs nothing but the
    model's features and the parameters.

    Class attributes: `token_metrics`, whether evaluation scores each target token (the
    task's word perplexity and BLEU then apply); `loss_chunks`, into how many slices of the
    length the training loss forms the logits (the planner's estimate)."""

    token_metrics: bool = False
    loss_chunks: int = 1
    float_keys: tuple[str, ...] = ()  # the batch keys it adds that hold floats, not ids
    setting: Setting  # (once bound)

    def bind(self, setting: Setting) -> "Objective":
        """This objective for the trainer of `setting`: a new instance, with what it derives
        from it (and any state of its own, fresh)."""
        raise NotImplementedError

    def batch_keys(self, features) -> list[str]:
        """The keys of a batch: the model's features' (`models.base.batch_keys`) and any
        the objective adds."""
        return batch_keys(features)

    # ---- what the steps take after the batch (state of the objective's own) ----

    def argument_shardings(self) -> tuple:
        """The shardings of the arguments the jitted steps take after the batch."""
        return ()

    def arguments(self) -> tuple:
        """Those arguments, for a step about to run."""
        return ()

    def abstract_arguments(self) -> tuple:
        """Those arguments as shapes with their shardings (ahead-of-time lowering)."""
        return ()

    @property
    def needs_start(self) -> bool:
        """Whether it keeps the parameters the run starts from (`set_start`)."""
        return False

    def set_start(self, params) -> None:
        """The parameters the run started from (before step 0, or those of its base)."""

    # ---- traced inside the steps ----

    def loss_sums(self, params, batch, rngs, *arguments) -> tuple:
        """(loss, cross-entropy, count, tokens, statistics) summed over the training
        `batch`, to add up over microbatches: the gradient is of loss / count; `count` is
        what a mean is over (tokens, pairs); statistics are means x count."""
        raise NotImplementedError

    def eval_sums(self, params, batch, *arguments) -> dict:
        """The sums over an evaluation `batch` that `eval_results` reads, once added up over
        the split."""
        raise NotImplementedError

    def token_log_likelihoods(self, params, batch) -> jax.Array:
        """log p(target token) at every position of `batch` (0 where no loss)."""
        return token_log_likelihoods(self.setting, params, batch)

    # ---- on the host ----

    def eval_results(self, totals: dict) -> dict:
        """The ``eval/...`` metrics of `eval_sums` added up over a split (`totals`; {} when
        the split had no batch)."""
        raise NotImplementedError
