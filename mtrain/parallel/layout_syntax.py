"""The layout language's syntax, as Mesh-TensorFlow parsed it: a mesh shape
(``"batch:16;model:32"``) and layout rules (``"batch:batch;d_ff:model"``), pairs separated by
``;``, ``,``, ``.`` or spaces (or given as Python pairs), into lists of (name, size) and
(tensor dimension, mesh dimension). What they mean is `mtrain.parallel.layout`'s."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mtrain.errors import UserError

MeshShape = list[tuple[str, int]]
LayoutRules = list[tuple[str, str]]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LayoutError(UserError, ValueError):
    """A mesh shape, layout rule or tensor layout that cannot work, with what to do about it."""


def _pairs(text: str, what: str, example: str) -> list[tuple[str, str]]:
    """Splits ``"a:b;c:d"`` into pairs; `;` `,` `.` and whitespace all separate pairs (Mesh-TF)."""
    if not isinstance(text, str):
        raise LayoutError(f"{what} must be a string like {example!r}, got {text!r}")
    pairs = []
    for item in re.sub(r"[,.;]", " ", text).split():
        parts = item.split(":")
        if len(parts) != 2 or not all(_NAME.match(p) or p.isdigit() for p in parts):
            raise LayoutError(
                f"malformed {what} {text!r}: {item!r} is not a 'name:value' pair "
                f"(write it like {example!r})"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


def _check_unique(names: Sequence[str], what: str, text: Any) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise LayoutError(f"{what} {text!r} names {name!r} twice")
        seen.add(name)


def _given_pairs(value: Any, what: str, example: str) -> list[tuple[Any, Any]]:
    """A sequence of (name, value) pairs given instead of a string, checked."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        raise LayoutError(f"{what} must be a string like {example!r}, got {value!r}")
    return list(value)


def parse_mesh_shape(mesh_shape: str | Sequence[tuple[str, int]]) -> MeshShape:
    """``"batch:16;model:32"`` -> ``[("batch", 16), ("model", 32)]``; ``""`` is one device."""
    if not isinstance(mesh_shape, str):
        pairs = [(str(n), s) for n, s in _given_pairs(mesh_shape, "run.mesh_shape",
                                                      "batch:4;model:2")]
    else:
        pairs = _pairs(mesh_shape, "mesh shape", "batch:4;model:2")
    result = []
    for name, raw in pairs:
        if not _NAME.match(name):
            raise LayoutError(f"mesh shape {mesh_shape!r}: {name!r} is not a dimension name")
        size = int(raw) if isinstance(raw, int) or str(raw).isdigit() else 0
        if size < 1:
            raise LayoutError(
                f"mesh shape {mesh_shape!r}: the size of mesh dimension {name!r} must be a "
                f"positive integer, got {raw!r}"
            )
        result.append((name, size))
    _check_unique([n for n, _ in result], "mesh shape", mesh_shape)
    return result


def parse_layout_rules(layout_rules: str | Sequence[tuple[str, str]],
                       what: str = "layout rules") -> LayoutRules:
    """``"batch:batch;d_ff:model"`` -> ``[("batch", "batch"), ("d_ff", "model")]``; `what`
    names the rule set in errors ("parameter layout rules")."""
    parameter = what.startswith("parameter")
    example = "d_model:batch" if parameter else "batch:batch;d_ff:model"
    if not isinstance(layout_rules, str):
        setting = "run.parameter_layout_rules" if parameter else "run.layout_rules"
        pairs = [(str(t), str(m)) for t, m in _given_pairs(layout_rules, setting, example)]
    else:
        pairs = _pairs(layout_rules, what, example)
    for tensor_dim, mesh_dim in pairs:
        for name in (tensor_dim, mesh_dim):
            if not _NAME.match(name):
                raise LayoutError(f"{what} {layout_rules!r}: {name!r} is not a dimension name")
    _check_unique([t for t, _ in pairs], what, layout_rules)
    return pairs
