"""The frozen model an objective compares the policy with (DPO's reference, GRPO's KL
term): `Reference`, and `AgainstReference`, the objectives that keep one.

The reference is the model the run started from: where LoRA adapters alone train, the same
model without them on the policy's own parameters (no second copy, TRL's way with a PEFT
model); else a frozen copy of the starting parameters, laid out as the parameters and taken
by the jitted steps as an argument after the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtrain.models import parameters
from mtrain.models.lora import is_adapter
from mtrain.training.objective import Objective, Setting


class Reference:
    """The reference model of an objective: where LoRA adapters alone train, the model
    without them, on the same parameters (no second copy: `is_base`); else the model on a
    frozen copy of the parameters the run started from (`set`), laid out as the parameters
    (`shardings`: the steps take it as an argument after the batch)."""

    def __init__(self, model, abstract_params, trainable, param_shardings):
        paths = list(parameters.paths(abstract_params))
        trained = [p for p in paths if trainable(p)]
        self.is_base = bool(getattr(model.config, "lora", None)) and len(trained) < len(
            paths) and all(map(is_adapter, trained))
        self.model = (model.clone(config=dataclasses.replace(model.config, lora=None))
                      if self.is_base else model)
        self.shardings = () if self.is_base else (param_shardings,)
        self.copy = None

    @classmethod
    def of(cls, setting) -> "Reference":
        """The reference of the trainer an objective is bound to (its `Setting`)."""
        return cls(setting.model, setting.abstract_params, setting.trainable,
                   setting.param_shardings)

    @property
    def needs_copy(self) -> bool:
        return not self.is_base

    def set(self, params) -> None:
        """The copy: `params` (the run's start), copied and laid out as the parameters."""
        self.copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                            out_shardings=self.shardings[0])(params)

    def arguments(self) -> tuple:
        if self.is_base:
            return ()
        if self.copy is None:
            raise ValueError("the objective needs its reference model's parameters: "
                             "Reference.set")
        return (self.copy,)

    def params(self, params, copy):
        """The reference's parameters: the policy's `params` without adapters, or `copy`."""
        return parameters.select(params, lambda p: not is_adapter(p)) if self.is_base else copy


class AgainstReference(Objective):
    """An objective made from its settings (`config`) that compares the policy with its
    trainer's `Reference`, where `uses_reference` (default: always): bound with it, its
    steps take the reference's copy (if it keeps one) after the batch, and it keeps the
    parameters the run starts from (`set_start`)."""

    def __init__(self, config):
        self.config = config

    def bind(self, setting: Setting) -> "AgainstReference":
        bound = type(self)(self.config)
        bound.setting = setting
        bound.reference = Reference.of(setting)
        return bound

    @property
    def uses_reference(self) -> bool:
        return True

    def argument_shardings(self) -> tuple:
        return self.reference.shardings if self.uses_reference else ()

    def arguments(self) -> tuple:
        return self.reference.arguments() if self.uses_reference else ()

    def abstract_arguments(self) -> tuple:
        return (self.setting.sharded_params(),) if self.needs_start else ()

    @property
    def needs_start(self) -> bool:
        return self.uses_reference and self.reference.needs_copy

    def set_start(self, params) -> None:
        self.reference.set(params)
