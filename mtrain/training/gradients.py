"""The gradient of an objective's mean loss over a batch, accumulated over microbatches
(Mesh-TF's serialize_num_microbatches: the same update, a fraction of the activation
memory), laid out as the parameters are stored."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from mtrain.models import parameters
from mtrain.parallel.layout import constrain, is_names, logical_names
from mtrain.training.placement import BATCH_NAMES, PlacedBatch

# loss_sums(params, batch, rngs) -> (loss, cross-entropy, count, tokens, statistics), summed
# over the batch (`Objective.loss_sums`).
LossSums = Callable[..., tuple]


def of_sums(loss_sums: LossSums, params, batch, rngs, normalize: bool, names,
            frozen=None, meta=None) -> tuple:
    """(gradient, loss, cross-entropy, count, tokens, statistics, new meta) of `batch`: of
    the mean loss (per `count`: tokens, or pairs) with `normalize` (statistics: means),
    else of the sums (to add up). `params` are the trainable parameters (their logical
    `names`), `frozen` the others (none: `params` are all) but for `meta`, delayed fp8
    scaling's state (`models.quantization`), whose gradient is its new value."""
    def loss_fn(params, meta):
        if frozen or meta:
            params = parameters.merge(parameters.merge(frozen or {}, meta), params)
        loss, xent, count, tokens, stats = loss_sums(params, batch, rngs)
        scale = 1.0 / jnp.maximum(count, 1.0) if normalize else 1.0
        stats = {k: v * scale for k, v in stats.items()}
        return loss * scale, (xent * scale, count, tokens, stats)

    (loss, (xent, count, tokens, stats)), (grads, new_meta) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, meta or {})
    # Laid out as the parameters are stored: under parameter layout rules (FSDP) each
    # device keeps (and accumulates over microbatches) only its shard of the sum.
    grads = jax.tree_util.tree_map(
        lambda names, g: constrain(g, logical_names(names, g.ndim), "gradient", parameter=True),
        names, grads, is_leaf=is_names)
    return grads, loss, xent, count, tokens, stats, new_meta


def mean_gradient(loss_sums: LossSums, params, batch, dropout_key, num_microbatches: int,
                  names, frozen: Any = None, meta: Any = None) -> tuple:
    """(gradient, loss, cross-entropy, tokens, statistics, new meta) of the mean loss of
    `batch` (`of_sums`), accumulated over `num_microbatches` slices of it, one at a time
    (the new `meta`: the largest of the slices', as Transformer Engine reduces amaxes).
    Microbatch j holds rows j, j + k, j + 2k, ... so that every device keeps working on its
    own rows; each has its own dropout key."""
    k = num_microbatches
    if k == 1:
        grads, loss, xent, _, tokens, stats, new_meta = of_sums(
            loss_sums, params, batch, {"dropout": dropout_key}, True, names, frozen, meta)
        return grads, loss, xent, tokens, stats, new_meta
    micro = {name: constrain(x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                             (None, *BATCH_NAMES))
             for name, x in batch.items()}
    micro = batch.like(micro) if isinstance(batch, PlacedBatch) else micro

    def sums(params, microbatch, key):
        return of_sums(loss_sums, params, microbatch, {"dropout": key}, False, names, frozen,
                       meta)

    def step(total, inputs):
        i, microbatch = inputs
        out = sums(params, microbatch, jax.random.fold_in(dropout_key, i))
        added = jax.tree_util.tree_map(jnp.add, total[:-1], out[:-1])
        return (*added, jax.tree_util.tree_map(jnp.maximum, total[-1], out[-1])), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(  # (meta: never negative)
        lambda p, b: sums(p, b, dropout_key), params,
        jax.tree_util.tree_map(lambda x: x[0], micro)))
    (grads, loss, xent, count, tokens, stats, new_meta), _ = jax.lax.scan(
        step, zeros, (jnp.arange(k), micro))
    # The mean over the batch's tokens (pairs), however it was sliced.
    scale = 1.0 / jnp.maximum(count, 1.0)
    grads, stats = jax.tree_util.tree_map(lambda g: g * scale, (grads, stats))
    return grads, loss * scale, xent * scale, tokens, stats, new_meta
