"""Which parameters train: ``run.trainable``, a regular expression matched against each
parameter's path ("layer_0/self_attention/q"); a LoRA model (`models.lora`) trains its
adapters alone unless it says otherwise. The others are frozen: the trainer differentiates
the loss with respect to the trainable ones only (no gradient is formed for a frozen one)
and keeps optimizer state for them alone (`Trainer`).

Trees here are the model's nested parameter dicts (`models.parameters`: `select` a part
of one, `merge` puts it back).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mtrain.errors import ConfigError
from mtrain.models.lora import is_adapter
from mtrain.models.parameters import select

Predicate = Callable[[str], bool]


def trainable(pattern: str | None, lora: bool) -> Predicate | None:
    """What trains: None (everything), or a predicate of a parameter's path."""
    if pattern:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"run.trainable={pattern!r} is not a regular expression: {e}") \
                from None
        return lambda path: compiled.fullmatch(path) is not None
    return is_adapter if lora else None


def split(tree, keep: Predicate) -> tuple[dict, dict]:
    """(the part of `tree` that `keep` takes, the rest)."""
    return select(tree, keep), select(tree, lambda path: not keep(path))
