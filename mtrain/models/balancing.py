"""DeepSeek-V3's auxiliary-loss-free load balancing: each expert layer's ``choice_bias``
(`moe.MoEConfig.choice_bias`, added to the router's scores for the choice alone) moved after
every train step by ``moe.bias_update_rate`` x sign(mean load - load_i), so that an expert
chosen more than the mean is chosen less at the next step, and one chosen less, more (the
DeepSeek-V3 paper's gamma; transformers keeps the bias as the checkpoint's
``e_score_correction_bias``).

The load is each expert's count of the layer's choices of real tokens over the whole step
(``expert_load``: the layers sow it, `moe.summary` keeps it per layer under
``expert_load/<module path>``, and the objectives add it up over microbatches as it is:
`weighted`, where the statistics that are means are weighted by their tokens). The bias is a parameter (a checkpoint keeps it) that no
optimizer is given (`optimized`): it has no gradient (it changes which experts are chosen,
not what they compute), and weight decay or an optimizer's state would move it otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtrain.models.moe import LOAD

BIAS = "choice_bias"  # the parameter's name in each expert layer (`moe.MoeFeedForward`)


def update_rate(model) -> float:
    """The model's ``moe.bias_update_rate`` (0 without experts)."""
    return float(getattr(getattr(model.config, "moe", None), "bias_update_rate", 0.0))


def is_bias(path: str) -> bool:
    """Whether the parameter at `path` ("layer_1/mlp/choice_bias") is a choice bias."""
    return path.rsplit("/", 1)[-1] == BIAS


def optimized(trainable, rate: float):
    """``(trains, optimized)`` of a run whose parameters train where `trainable` says:
    what changes in training (`trainable`'s, and the choice biases where `rate` moves them:
    what a checkpoint must keep) and what the optimizer takes (those, less the choice
    biases)."""
    def trains(path: str) -> bool:
        return trainable(path) or bool(rate) and is_bias(path)

    return trains, lambda path: trainable(path) and not is_bias(path)


def loads(stats: dict) -> dict:
    """{layer's module path: its load [..., experts]} of a step's statistics."""
    prefix = f"{LOAD}/"
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}


def is_load(name: str) -> bool:
    """Whether a statistic is a layer's load: its experts' choices counted, summed over
    microbatches as they are (not weighted by tokens as the statistics that are means)."""
    return name.startswith(f"{LOAD}/")


def weighted(stats: dict, weight) -> dict:
    """`stats` as sums over what `weight` counts (tokens, pairs) to be added up over
    microbatches: the means times it, the loads (counts already) as they are."""
    return {k: v if is_load(k) else v * weight for k, v in stats.items()}


def scalars(stats: dict) -> dict:
    """`stats` less the loads (metrics are scalars; the busiest expert's share of the
    choices is ``busiest_expert_share``)."""
    return {k: v for k, v in stats.items() if not k.startswith(f"{LOAD}/")}


def balance(params, stats: dict, rate: float, finite=True):
    """`params` with each choice bias moved by `rate` x sign(mean load - load) of its layer
    (a scanned stack's [layers, experts] per layer), the loads of a step's `stats`; as
    they are where `rate` is 0, where the step is not `finite` (a step the optimizer skips
    moves nothing), and for a layer the step did not run (no load: a multi-token prediction
    module's under an objective that runs the trunk alone)."""
    if not rate:
        return params
    layer_loads = loads(stats)

    def move(path, leaf):
        names = "/".join(str(k.key) for k in path)
        load = layer_loads.get(names.rsplit("/", 1)[0])
        if not is_bias(names) or load is None:
            return leaf
        load = load.astype(jnp.float32)
        step = jnp.where(finite, rate * jnp.sign(load.mean(-1, keepdims=True) - load), 0.0)
        return (leaf + step).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(move, params)
