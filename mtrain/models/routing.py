"""How a mixture of experts (`moe`) routes its tokens: each token's top_k experts and their
weights from the router's logits, the slots of a capacity, and the statistics of a routing.

Per group of tokens, in float32 whatever the activations, as `Routing` says:

    scores = softmax(logits)        GShard, Switch, Mixtral, gpt-oss (whose logits have the
                                    router's bias); or sigmoid(logits): DeepSeek-V3
    choice = scores + choice_bias   DeepSeek-V3's auxiliary-loss-free balancing: the bias
                                    (moved between steps by `balancing`) changes which
                                    experts a token takes, never their weights
    num_groups > 1: the experts lie in num_groups consecutive groups, a group's score is the
        sum of its two best choice scores, and only the top_groups best groups' experts may
        be chosen (DeepSeek-V3's n_group, topk_group; the others' choice scores are set to
        0, as transformers sets them: DeepSeek's reference sets -inf, the same choice
        wherever top_k of the kept experts score above 0)
    the top_k experts by choice score, weighted by their scores, renormalised to sum to 1
        where `Routing.renormalizes` says (softmax: GShard, Mixtral, and gpt-oss's softmax
        over the chosen logits; sigmoid: DeepSeek's norm_topk_prob), times `scaling`
        (DeepSeek's routed_scaling_factor).

Padding (segment id 0) is routed nowhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class Routing:
    """What `choose` does (module doc); `MoEConfig.routing` makes it from the settings."""

    top_k: int
    # Whether the top_k weights are renormalised to sum to 1; None: where top_k > 1 (GShard;
    # Switch's single weight stays the probability, so that the router learns from the loss).
    normalize: bool | None = None
    scoring: str = "softmax"
    num_groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0

    @property
    def renormalizes(self) -> bool:
        return self.top_k > 1 if self.normalize is None else bool(self.normalize)


def _in_best_groups(choice, routing: Routing):
    """`choice` [..., experts] with the experts outside each token's top_groups groups at 0."""
    *lead, e = choice.shape
    g = routing.num_groups
    best_two = jax.lax.top_k(choice.reshape(*lead, g, e // g), min(2, e // g))[0].sum(-1)
    _, kept = jax.lax.top_k(best_two, routing.top_groups)
    keep = jax.nn.one_hot(kept, g, dtype=jnp.int32).sum(-2) > 0  # [..., g]
    return jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, 0.0)


def choose(logits, real, routing: Routing, choice_bias=None):
    """Each token's top_k experts from router `logits` [groups, group, experts] (float32)
    of tokens `real` [groups, group] (1.0, or 0.0 for padding), as `routing` says, the
    choice by the scores plus `choice_bias` [experts] where given: ``(probs, gates, index,
    choice)``, `probs` the scores normalised to sum to 1 over the experts (the statistics'),
    `gates` and `index` [groups, group, top_k], `choice` their one-hot [groups, group,
    top_k, experts] (int32, 0 for padding)."""
    e = logits.shape[-1]
    if routing.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    choice = scores if choice_bias is None else scores + choice_bias.astype(jnp.float32)
    if routing.num_groups > 1:
        choice = _in_best_groups(choice, routing)
    _, index = jax.lax.top_k(choice, routing.top_k)  # [g, s, k]
    gates = jnp.take_along_axis(scores, index, axis=-1)
    if routing.renormalizes:  # (transformers' 1e-20: for sigmoid scores that underflow)
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    if routing.scaling != 1.0:
        gates = gates * routing.scaling
    choice = jax.nn.one_hot(index, e, dtype=jnp.int32) * real[..., None, None].astype(jnp.int32)
    return probs, gates, index, choice


def statistics(logits, probs, choice, real, kept_choices) -> dict:
    """A layer's statistics (`moe`'s module doc; not yet weighted) of a routing `choose`
    made, with `kept_choices` of the tokens' choices given a place; ``expert_load`` [experts]
    counts each expert's choices by real tokens (what `balancing` evens out); the counts
    the means are over (`COUNTS`: ``real_tokens``, and ``routed_groups``, those that hold
    real tokens), with which a pipeline's microbatches add up to the batch's."""
    real = real.astype(jnp.float32)
    e, top_k = logits.shape[-1], choice.shape[2]
    tokens = jnp.maximum(real.sum(), 1.0)
    chosen = choice.sum(2).astype(jnp.float32)  # [g, s, e]: 1 where e is among the choices
    per_expert = chosen.sum((0, 1))
    # the load-balancing loss of each group (f and P of its own tokens: the imbalance that
    # makes a group drop tokens), averaged over the groups that hold real tokens
    in_group = real.sum(1)  # [g]
    f = chosen.sum(1) / jnp.maximum(in_group, 1.0)[:, None]  # [g, e]
    p = jnp.einsum("gse,gs->ge", probs, real) / jnp.maximum(in_group, 1.0)[:, None]
    routed = (in_group > 0).astype(jnp.float32)
    balance = e * jnp.sum(routed * jnp.sum(f * p, -1)) / jnp.maximum(routed.sum(), 1.0)
    z = jnp.sum(real * jnp.square(jax.nn.logsumexp(logits, axis=-1))) / tokens
    choices = jnp.maximum(top_k * real.sum(), 1.0)
    return {"load_balance_loss": balance, "router_z_loss": z,
            "dropped_fraction": 1.0 - kept_choices / choices,
            "busiest_expert_share": per_expert.max() / choices,
            "expert_load": per_expert, "real_tokens": real.sum(), "routed_groups": routed.sum()}


# The counts a layer's statistics are means over (`statistics`): each mean with the count
# it is of, so that the means of parts (a pipeline's microbatches) weighted by their counts
# are the whole's.
COUNTS = ("real_tokens", "routed_groups")
MEAN_OVER = {"load_balance_loss": "routed_groups", "router_z_loss": "real_tokens",
             "dropped_fraction": "real_tokens"}


def route(logits, real, top_k: int | Routing, capacity: int, normalize: bool | None = None,
          choice_bias=None):
    """Top-k routing (`choose`) with a capacity per expert, on router `logits` [groups,
    group, experts] (float32) of tokens `real` [groups, group] (1.0, or 0.0 for padding);
    `top_k` the experts per token (softmax scores, renormalised as `normalize` says: see
    `Routing`) or the whole `Routing`.

    Returns ``(dispatch, combine, stats)``: `dispatch` [groups, group, experts, capacity] is
    1 where a token takes an expert's slot, `combine` the same weighted by the token's gate,
    and `stats` the layer's statistics (`statistics`). Slots go first choices before second
    choices, then in token order."""
    g, s, e = logits.shape
    routing = top_k if isinstance(top_k, Routing) else Routing(top_k=top_k, normalize=normalize)
    top_k = routing.top_k
    probs, gates, index, choice = choose(logits, real, routing, choice_bias)
    # Slots in priority order: every token's first choice, then every second choice, ...
    ranked = choice.transpose(0, 2, 1, 3).reshape(g, top_k * s, e)
    position = (jnp.cumsum(ranked, axis=1) - 1).reshape(g, top_k, s, e).transpose(0, 2, 1, 3)
    slot = jnp.sum(position * choice, axis=-1)  # [g, s, k]: the slot each choice would take
    kept = (choice.sum(-1) > 0) & (slot < capacity)  # [g, s, k]
    expert = jax.nn.one_hot(index, e, dtype=jnp.float32) * kept[..., None]
    place = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)  # out of range: all 0
    dispatch = jnp.einsum("gske,gskc->gsec", expert, place)
    combine = jnp.einsum("gske,gskc->gsec", expert * gates[..., None], place)
    return dispatch, combine, statistics(logits, probs, choice, real, kept.sum())
