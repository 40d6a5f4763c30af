"""A model's parameters as the layers create them: float32, with their logical dimension
names, cast for use and laid out (gathered under parameter layout rules) where used; and
their nested dicts by path ("layer_0/self_attention/q"): all leaves (`paths`), a part
(`select`: the same nesting with some leaves) and a part put back (`merge`)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.parallel.layout import use_parameter


def normal(stddev: float):
    return nn.initializers.normal(stddev=stddev)


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], names: tuple[str, ...],
          dtype=jnp.float32):
    """A float32 parameter that carries its logical dimension names, as the computation
    uses it: cast to `dtype` and laid out by the layout rules. Where parameter layout rules
    store it split further (fully sharded data parallelism), this is where it is gathered,
    in `dtype`."""
    value = module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)
    return use_parameter(value.astype(dtype), tuple(names), f"parameter {name}")


def paths(tree) -> dict[str, object]:
    """{path: leaf} of a nested dict, in jax's order of its leaves (keys sorted), so that
    it zips with `jax.tree_util.tree_leaves` of the tree and of trees shaped like it."""
    return {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def select(tree, keep: Callable[[str], bool], prefix: str = "") -> dict:
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


def merge(tree, part) -> dict:
    """`tree` with the leaves of `part` in place of its own (or beside them: the two
    parts of `select` make the whole again)."""
    out = dict(tree)
    for key, value in part.items():
        out[key] = merge(tree.get(key, {}), value) if isinstance(value, dict) else value
    return out
