"""Adafactor with Mesh-TF's defaults, the `linear_warmup * rsqrt_decay` schedule, and the
logical names of an optimizer state's leaves (for its sharding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec


def learning_rate_schedule(
    warmup_steps: int = 10_000,
    train_steps: int | None = None,
    linear_decay_steps: int = 0,
    constant: float = 1.0,
) -> optax.Schedule:
    """Mesh-TF/T2T's ``linear_warmup * rsqrt_decay [* linear_decay]`` (times `constant`).

    ``lr(s) = constant * min(1, s / warmup) / sqrt(max(s, warmup))``, and, when
    `linear_decay_steps` > 0, times ``clip((train_steps - s) / linear_decay_steps, 0, 1)`` so
    that the rate falls linearly to zero over the last `linear_decay_steps` steps. `s` counts
    from 1 (the rate for the update that produces step s), so the first update is not wasted.
    """
    if warmup_steps < 1:
        raise ValueError(f"learning_rate_schedule.warmup_steps must be >= 1, got {warmup_steps}")
    if linear_decay_steps and not train_steps:
        raise ValueError("learning_rate_schedule.linear_decay_steps needs train_steps")

    def schedule(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        lr = constant * jnp.minimum(1.0, s / warmup_steps) * jnp.sqrt(1.0 / jnp.maximum(s, warmup_steps))
        if linear_decay_steps:
            lr = lr * jnp.clip((train_steps - s) / linear_decay_steps, 0.0, 1.0)
        return lr

    return schedule


def adafactor(
    learning_rate: optax.ScalarOrSchedule,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = True,
    momentum: float | None = None,
    factored: bool = True,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> optax.GradientTransformation:
    """optax's Adafactor with Mesh-TF's defaults.

    Factored second moments for matrices whose two largest dimensions are >= 128, second-moment
    decay ``1 - (step + 1)^-0.8``, updates scaled by the parameter's RMS (at least 1e-3), update
    clipping at RMS 1.0, and no momentum.
    """
    return optax.adafactor(
        learning_rate=learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        factored=factored,
        eps=epsilon,
    )


def state_names(opt_state, params, param_names):
    """Logical names for every optimizer-state leaf, taken from the parameter it belongs to.

    optax states hold trees shaped like the parameters (Adafactor: row/column second-moment
    factors and full second moments). A leaf with the parameter's shape gets its names; a
    factored statistic (one dimension reduced away) gets the names of the dimensions it kept;
    anything else (step counters) is replicated.
    """
    params_def = jax.tree_util.tree_structure(params)

    def match(leaf, p, names):
        if leaf.shape == p.shape:
            return PartitionSpec(*names)
        if len(leaf.shape) == len(p.shape) - 1:
            kept = {
                tuple(n for j, n in enumerate(names) if j != i)
                for i in range(len(p.shape))
                if tuple(d for j, d in enumerate(p.shape) if j != i) == tuple(leaf.shape)
            }
            if len(kept) == 1:
                return PartitionSpec(*kept.pop())
        return PartitionSpec()

    def walk(node):
        if jax.tree_util.tree_structure(node) == params_def:
            return jax.tree_util.tree_map(match, node, params, param_names)
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if not children:
            return node  # an empty container (optax's EmptyState)
        if len(children) == 1 and children[0] is node:
            return PartitionSpec()  # a leaf that does not belong to a parameter
        return treedef.unflatten([walk(c) for c in children])

    return walk(opt_state)
