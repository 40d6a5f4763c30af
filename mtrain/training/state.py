"""The train state (step, parameters, optimizer state) and what a train step reports."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from mtrain.models import balancing


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """A tree of shapes (e.g. from `jax.eval_shape`) with each leaf's sharding attached."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def step_metrics(grads, loss, xent, tokens, extra=None) -> dict:
    """A train step's metrics: loss, cross-entropy, tokens, gradient norm, and `finite`: 0
    when the loss or a gradient is not finite (wrap the optimizer in optax.apply_if_finite
    to skip such updates, as run.py does); and `extra`, the model's own (a mixture of
    experts' statistics, `moe.summary`: scalars, its layers' loads left out)."""
    grad_norm = optax.tree.norm(grads)
    return {**balancing.scalars(extra or {}), "loss": loss, "cross_entropy": xent,
            "num_tokens": tokens, "grad_norm": grad_norm,
            "finite": (jnp.isfinite(loss) & jnp.isfinite(grad_norm)).astype(jnp.float32)}
