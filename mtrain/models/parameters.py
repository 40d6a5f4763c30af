"""A model's parameters as the layers create them: float32, with their logical dimension
names, cast for use and laid out (gathered under parameter layout rules) where used."""

from __future__ import annotations

import flax.linen as nn
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
