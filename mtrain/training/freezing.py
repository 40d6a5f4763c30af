"""Which parameters train: ``run.trainable``, a regular expression matched against each
parameter's path ("layer_0/self_attention/q"); a LoRA model (`models.lora`) trains its
adapters alone unless it says otherwise. The others are frozen: the trainer differentiates
the loss with respect to the trainable ones only (no gradient is formed for a frozen one)
and keeps optimizer state for them alone (`Trainer`).

Trees here are the model's nested parameter dicts; a part of one (`select`) keeps the
same nesting with only some leaves, and `merge` puts a part back.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mtrain.errors import ConfigError
from mtrain.models.lora import is_adapter

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


def paths(tree, prefix: str = "") -> dict[str, object]:
    """{path: leaf} of a nested dict."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= paths(value, f"{path}/")
        else:
            out[path] = value
    return out


def leaf_paths(tree) -> list[str]:
    """The paths of a nested dict's leaves in jax's order (`jax.tree_util.tree_leaves`:
    keys sorted), to zip with its leaves."""
    import jax

    return ["/".join(str(k.key) for k in path)
            for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def select(tree, keep: Predicate, prefix: str = "") -> dict:
    """The part of `tree` whose leaves' paths `keep` takes (same nesting; empty dicts
    left out)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            part = select(value, keep, f"{path}/")
            if part:
                out[key] = part
        elif keep(path):
            out[key] = value
    return out


def split(tree, keep: Predicate) -> tuple[dict, dict]:
    """(the part of `tree` that `keep` takes, the rest)."""
    return select(tree, keep), select(tree, lambda path: not keep(path))


def merge(tree, part) -> dict:
    """`tree` with the leaves of `part` in place of its own (or beside them: the two
    parts of `select` make the whole again)."""
    out = dict(tree)
    for key, value in part.items():
        out[key] = merge(tree.get(key, {}), value) if isinstance(value, dict) else value
    return out

