"""Mixture of experts: the feed-forward layer as `num_experts` feed-forward layers, each
token sent to its top-k of them (Mesh-TF's `moe.py` MoE1D, GShard, Switch Transformer).

The tokens of each row are routed in groups of `group_size` (a group never spans rows, so
that a layout never changes a group). Per group, in float32 whatever the activations:

    logits = x @ router            [groups, group, experts]
    probs = softmax(logits)        each token's top_k experts, with gates: the top_k
                                   probabilities renormalised to sum to 1 (GShard, Mixtral);
                                   with top_k = 1 the probability itself (Switch), so that
                                   the router learns from the loss (`normalize_top_k` says
                                   otherwise: Hugging Face's Mixtral always renormalises,
                                   Qwen3-MoE as its norm_topk_prob says)

Each expert takes at most `capacity` tokens of a group, ceil(top_k x group x
capacity_factor / experts): first choices before second choices, then in token order. A
token beyond its expert's capacity is dropped from that expert: it gets nothing from it and
passes on through the residual. Padding (segment id 0) is routed nowhere.

Dispatch and combine are one-hot einsums (as in Mesh-TF and GShard), so the layout language
expresses expert parallelism: the dispatched tokens are [experts, groups, capacity,
d_model], the expert weights [experts, d_model, d_ff] and [experts, d_ff, d_model]; with
``experts:batch`` the tokens move from the devices of their group to those of their expert
and back, which XLA's SPMD partitioner turns into two all-to-alls per layer. An ``experts``
dimension claims its mesh dimension first (`layout.LEADING`): under ``experts:batch`` the
groups of the expert side stay whole, under ``experts:model`` an expert's ``d_ff`` does.
The token-side scores over the experts lie on ``experts_unsplit`` (Mesh-TF's name), the
slots of an expert on ``expert_capacity``, the tokens of a group on ``group``.

The layer sows its statistics into the ``moe_stats`` collection (`STATS`), which the
trainer reads (`summary`): the Switch load-balancing loss ``num_experts x sum_i f_i P_i``
(f_i: the fraction of a group's tokens with expert i among their top_k choices; P_i: the
mean router probability of expert i over the group's tokens), per group and averaged over
the groups, as Mesh-TF and GShard compute it (a batch-wide f and P would not see two groups
imbalanced in opposite directions), the router z-loss (the mean of logsumexp(logits)^2), the
fraction of the tokens' expert choices dropped, the busiest expert's share of the choices,
and `aux_loss`, what the layer adds to the training loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.models import dropless, layers
from mtrain.models.feedforward import gated, input_names
from mtrain.models.grouped import GROUPED_KERNELS
from mtrain.models.lora import LoraConfig, Projection, projection
from mtrain.models.base import shape_field
from mtrain.parallel.layout import constrain

STATS = "moe_stats"  # the collection the layers sow their statistics into
DISPATCHES = ("capacity", "dropless")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The experts of `TransformerConfig.moe` (gin: ``moe.num_experts = 8``; the layers that
    have them: ``transformer.moe_every``)."""

    num_experts: int = shape_field(8)
    top_k: int = shape_field(2)  # 1: Switch; 2: GShard (Mesh-TF's MoE1D), Mixtral
    expert_d_ff: int = shape_field(0)  # each expert's d_ff; 0: transformer.d_ff
    capacity_factor_train: float = 1.25
    capacity_factor_eval: float = 2.0
    group_size: int = 1024  # tokens routed together (at most a row's length)
    load_balance_loss: float = 1e-2  # its weight in the training loss
    router_z_loss: float = 1e-3
    # Whether the top_k gates are renormalised to sum to 1: None, where top_k > 1 (GShard;
    # Switch's single gate stays the probability); True always (Hugging Face's Mixtral, a
    # Qwen3-MoE with norm_topk_prob); False never.
    normalize_top_k: bool | None = None
    # 'capacity': one-hot dispatch into each expert's slots (GShard, Switch, Mesh-TF; tokens
    # beyond an expert's capacity are dropped); 'dropless': every choice computed, tokens
    # sorted by expert into grouped matmuls (`dropless`), with `grouped_kernel` (`grouped`).
    dispatch: str = "capacity"
    grouped_kernel: str = "auto"
    ragged_all_to_all: bool | None = None  # under experts:batch; None: where the backend has it

    @property
    def renormalizes(self) -> bool:
        return self.top_k > 1 if self.normalize_top_k is None else bool(self.normalize_top_k)

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} must be between 1 and moe.num_experts="
                             f"{self.num_experts}")
        for name in ("capacity_factor_train", "capacity_factor_eval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"moe.{name} must be positive, got {getattr(self, name)}")
        if self.group_size < 1 or self.expert_d_ff < 0:
            raise ValueError(f"moe.group_size must be at least 1 and moe.expert_d_ff at least "
                             f"0, got {self.group_size} and {self.expert_d_ff}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"moe.dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.grouped_kernel not in GROUPED_KERNELS:
            raise ValueError(f"moe.grouped_kernel must be one of {GROUPED_KERNELS}, got "
                             f"{self.grouped_kernel!r}")
        if self.load_balance_loss < 0 or self.router_z_loss < 0:
            raise ValueError("moe.load_balance_loss and moe.router_z_loss must not be negative")

    def group_length(self, length: int) -> int:
        """Tokens per group for rows of `length`: the largest divisor of `length` that is at
        most `group_size`."""
        return max(s for s in range(1, min(self.group_size, length) + 1) if length % s == 0)

    def capacity(self, group: int, train: bool) -> int:
        """An expert's slots per group of `group` tokens (at least 1, at most `group`)."""
        factor = self.capacity_factor_train if train else self.capacity_factor_eval
        return max(1, min(group, math.ceil(self.top_k * group * factor / self.num_experts)))


def choose(logits, real, top_k: int, normalize: bool | None = None):
    """Each token's top_k experts from router `logits` [groups, group, experts] (float32)
    of tokens `real` [groups, group] (1.0, or 0.0 for padding): ``(probs, gates, index,
    choice)``, `gates` and `index` [groups, group, top_k] (the gates renormalised over the
    top_k when `normalize`; None: where top_k > 1), `choice` their one-hot [groups, group,
    top_k, experts] (int32, 0 for padding)."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    gates, index = jax.lax.top_k(probs, top_k)  # [g, s, k]
    if top_k > 1 if normalize is None else normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(index, e, dtype=jnp.int32) * real[..., None, None].astype(jnp.int32)
    return probs, gates, index, choice


def statistics(logits, probs, choice, real, kept_choices) -> dict:
    """The layer's statistics (module doc; not yet weighted) of a routing `choose` made,
    with `kept_choices` of the tokens' choices given a place."""
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
            "busiest_expert_share": per_expert.max() / choices}


def route(logits, real, top_k: int, capacity: int, normalize: bool | None = None):
    """Top-k routing with a capacity per expert, on router `logits` [groups, group, experts]
    (float32) of tokens `real` [groups, group] (1.0, or 0.0 for padding).

    Returns ``(dispatch, combine, stats)``: `dispatch` [groups, group, experts, capacity] is
    1 where a token takes an expert's slot, `combine` the same weighted by the token's gate
    (renormalised over its top_k when `normalize`; None: where top_k > 1), and `stats` the
    layer's statistics (`statistics`)."""
    g, s, e = logits.shape
    probs, gates, index, choice = choose(logits, real, top_k, normalize)
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


class MoeFeedForward(nn.Module):
    """The mixture-of-experts feed-forward layer (see the module doc): x [batch, length,
    d_model] -> [batch, length, d_model]. `activations` as `feedforward.DenseReluDense`'s
    (gated activations apply in every expert); parameters ``router`` [d_model, experts_unsplit],
    ``wi`` (or ``wi_0``, ``wi_1``, ...) [experts, d_model, d_ff] and ``wo`` [experts, d_ff,
    d_model]. `nonpadding` [batch, length]: the real tokens (None: all). `dropless`: so
    whatever `config.dispatch` (decoding: what a capacity would drop is no decoding step's)."""

    config: MoEConfig
    d_ff: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    activations: tuple[str, ...] = ("relu",)
    lora: LoraConfig | None = None  # each expert's adapters where it targets them (`lora`)

    @nn.compact
    def __call__(self, x, deterministic: bool, nonpadding=None, dropless: bool = False):
        m, dt = self.config, self.dtype
        b, length, d = x.shape
        e = m.num_experts
        s = m.group_length(length)
        g = b * length // s
        xg = constrain(x.reshape(g, s, d), ("batch", "group", "d_model"))
        real = (jnp.ones((g, s), jnp.float32) if nonpadding is None
                else nonpadding.reshape(g, s).astype(jnp.float32))
        router = layers.param(self, "router", layers.normal(d**-0.5), (d, e),
                              ("d_model", "experts_unsplit"))  # float32
        logits = jnp.einsum("gsd,de->gse", xg.astype(jnp.float32), router)
        logits = constrain(logits, ("batch", "group", "experts_unsplit"))
        if m.dispatch == "dropless" or dropless:
            return self._dropless(x, logits, real, deterministic)
        capacity = m.capacity(s, train=not deterministic)
        dispatch, combine, stats = route(logits, real, m.top_k, capacity, m.renormalizes)
        self._sow(stats)

        # Each token into its slots, on the devices of its group; then to those of its
        # expert (the all-to-all, where experts and groups split over the same mesh
        # dimension), and back after the experts.
        slots = ("experts", "batch", "expert_capacity")
        unsplit = ("experts_unsplit", "batch", "expert_capacity", "d_model")
        inputs = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dt), xg)
        inputs = constrain(constrain(inputs, unsplit), (*slots, "d_model"))
        wis, wo = self._experts(d)
        h = gated(self.activations, [wi(inputs, deterministic) for wi in wis])
        h = constrain(h, (*slots, "d_ff"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        out = constrain(wo(h, deterministic), (*slots, "d_model"))
        out = constrain(out, unsplit)
        y = jnp.einsum("gsec,egcd->gsd", combine.astype(dt), out)
        y = constrain(y, ("batch", "group", "d_model")).reshape(b, length, d)
        return constrain(y, ("batch", "length", "d_model"))

    def _sow(self, stats):
        m = self.config
        for name, value in {**stats, "aux_loss": m.load_balance_loss * stats["load_balance_loss"]
                            + m.router_z_loss * stats["router_z_loss"]}.items():
            self.sow(STATS, name, value, init_fn=lambda: 0.0, reduce_fn=lambda _, new: new)

    def _dropless(self, x, logits, real, deterministic: bool):
        """The experts with ``dispatch='dropless'`` (`dropless`): the same routing and
        statistics (none dropped), the same parameters."""
        m, dt = self.config, self.dtype
        b, length, d = x.shape
        e = m.num_experts
        probs, gates, index, choice = choose(logits, real, m.top_k, m.renormalizes)
        self._sow(statistics(logits, probs, choice, real, choice.sum()))
        index = jnp.where(real[..., None] > 0, index, e).reshape(b, length, m.top_k)
        gates = gates.reshape(b, length, m.top_k)
        wis, wo = self._experts(d)
        train_dropout = self.dropout_rate > 0 and not deterministic
        y = dropless.experts(x.astype(dt), index, gates, [wi.merged_weight() for wi in wis],
                             wo.merged_weight(), activations=self.activations,
                             kernel=m.grouped_kernel, ragged=m.ragged_all_to_all,
                             dropout_rate=self.dropout_rate,
                             key=self.make_rng("dropout") if train_dropout else None)
        return constrain(y, ("batch", "length", "d_model"))

    def _experts(self, d: int) -> tuple[list[Projection], Projection]:
        """The experts' weights ``wi`` (or ``wi_0``, ``wi_1``, ...: `input_names`) [experts,
        d_model, d_ff] and ``wo`` [experts, d_ff, d_model] of tokens of `d` = d_model, each
        made with its adapter where `lora` targets it, as projections of the dispatched
        tokens [experts, groups, capacity, d_model] (the dropless experts take them merged)."""
        e, f = self.config.num_experts, self.d_ff

        def weight(name, fan_in, shape, names, spec):
            w = layers.param(self, name, layers.normal(fan_in**-0.5), shape, names, self.dtype)
            return projection(self, name, spec, w, names, self.lora)

        into = ("experts", "d_model", "d_ff")
        wis = [weight(name, d, (e, d, f), into, "egcd,edf->egcf")
               for name in input_names(len(self.activations))]
        return wis, weight("wo", f, (e, f, d), ("experts", "d_ff", "d_model"), "egcf,efd->egcd")


def summary(stats) -> dict:
    """A step's mixture-of-experts metrics from the ``moe_stats`` collection of its layers
    (a scanned stack's as arrays over its layers): the mean over the layers of each
    statistic, but the busiest expert's share, the most of any layer; and `aux_loss`, what
    the layers add to the training loss (the mean of theirs, as MaxText). {} for a model
    without experts."""
    values: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        values.setdefault(path[-1].key, []).append(jnp.ravel(leaf))
    out = {}
    for name, parts in values.items():
        joined = jnp.concatenate(parts)
        out[name] = joined.max() if name == "busiest_expert_share" else joined.mean()
    return out
