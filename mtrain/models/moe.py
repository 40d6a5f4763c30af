"""Mixture of experts: the feed-forward layer as `num_experts` feed-forward layers, each
token sent to its top-k of them (Mesh-TF's `moe.py` MoE1D, GShard, Switch Transformer).

The tokens of each row are routed in groups of `group_size` (a group never spans rows, so
that a layout never changes a group). Per group, in float32 whatever the activations:

    logits = x @ router (+ router_bias: gpt-oss)     [groups, group, experts]
    probs = softmax(logits)        each token's top_k experts, with gates: the top_k
                                   probabilities renormalised to sum to 1 (GShard, Mixtral);
                                   with top_k = 1 the probability itself (Switch), so that
                                   the router learns from the loss (`normalize_top_k` says
                                   otherwise: Hugging Face's Mixtral always renormalises,
                                   Qwen3-MoE as its norm_topk_prob says)

or DeepSeek-V3's sigmoid scores, chosen with a bias (`choice_bias`, which `balancing` moves
after each step), in groups, their weights scaled (`routing`, which routes). Each expert's
feed-forward layer is the model's (its activations, gpt-oss's clamped SwiGLU among them),
with gpt-oss's biases where `expert_bias`; `num_shared_experts` > 0 adds DeepSeek's shared
experts, one dense layer every token takes beside its routed ones (``shared``), unweighted.

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
and `aux_loss`, what the layer adds to the training loss (`aux_loss`); a layer with a
`choice_bias`, each expert's count of the choices too (``expert_load`` [experts], what
`balancing` evens out); and the counts of tokens and groups the means are over
(`routing.COUNTS`, not metrics).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtrain.models import dropless, grouped, layers
from mtrain.models.base import shape_field
from mtrain.models.feedforward import Clamp, DenseReluDense, gated, input_names
from mtrain.models.grouped import GROUPED_KERNELS
from mtrain.models.lora import LoraConfig, Projection, projection
from mtrain.models.quantization import Quantization
from mtrain.models.routing import COUNTS, SCORINGS, Routing, choose, route, statistics
from mtrain.parallel.layout import constrain

__all__ = ["DISPATCHES", "LOAD", "STATS", "MoEConfig", "MoeFeedForward", "choose", "route",
           "statistics", "summary"]

STATS = "moe_stats"  # the collection the layers sow their statistics into
LOAD = "expert_load"  # each expert's count of a layer's choices (`routing.statistics`)
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
    # The frontier's experts (`routing`'s module doc): 'softmax' or 'sigmoid' scores
    # (DeepSeek-V3); a trained bias on the router's logits (gpt-oss, ``router_bias``
    # [experts_unsplit]); DeepSeek's bias on the scores for the choice alone (``choice_bias``,
    # its e_score_correction_bias: never trained by the optimizer, moved after each train step
    # by bias_update_rate x sign(mean load - load): `balancing`; 0 leaves it); group-limited
    # routing (n_group, topk_group); the routed weights' factor (routed_scaling_factor).
    router_scoring: str = "softmax"
    router_bias: bool = shape_field(False)
    choice_bias: bool = shape_field(False)
    bias_update_rate: float = 0.0
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    # DeepSeek's shared experts: one dense layer of expert_d_ff x this many (``shared``);
    # gpt-oss's expert biases ``wi_0_bias``, ``wi_1_bias`` [experts, d_ff], ``wo_bias``
    # [experts, d_model] (the output's added before the gate weights it).
    num_shared_experts: int = shape_field(0)
    expert_bias: bool = shape_field(False)

    @property
    def renormalizes(self) -> bool:
        return self.routing.renormalizes

    @property
    def routing(self) -> Routing:
        return Routing(top_k=self.top_k, normalize=self.normalize_top_k,
                       scoring=self.router_scoring, num_groups=self.num_groups,
                       top_groups=self.top_groups, scaling=self.routed_scaling)

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
        if self.grouped_kernel == "tokamax" and grouped.tokamax_missing():
            raise ValueError(grouped.TOKAMAX_MISSING)
        if self.load_balance_loss < 0 or self.router_z_loss < 0:
            raise ValueError("moe.load_balance_loss and moe.router_z_loss must not be negative")
        self._check_frontier()

    def _check_frontier(self):
        e, g = self.num_experts, self.num_groups
        if self.router_scoring not in SCORINGS:
            raise ValueError(f"moe.router_scoring must be one of {SCORINGS}, got "
                             f"{self.router_scoring!r}")
        if g < 1 or e % g or not 1 <= self.top_groups <= g:
            raise ValueError(f"moe.num_groups={g} must divide moe.num_experts={e}, and "
                             f"moe.top_groups={self.top_groups} be between 1 and it")
        if self.top_groups * (e // g) < self.top_k:
            raise ValueError(f"moe.top_groups={self.top_groups} groups of {e // g} experts "
                             f"hold fewer than moe.top_k={self.top_k}")
        if self.routed_scaling <= 0 or self.num_shared_experts < 0 or self.bias_update_rate < 0:
            raise ValueError("moe.routed_scaling must be positive, moe.num_shared_experts and "
                             "moe.bias_update_rate not negative")
        if self.bias_update_rate and not self.choice_bias:
            raise ValueError(f"moe.bias_update_rate={self.bias_update_rate} moves the choice "
                             "bias, and moe.choice_bias is False: set it True")

    def group_length(self, length: int) -> int:
        """Tokens per group for rows of `length`: the largest divisor of `length` that is at
        most `group_size`."""
        return max(s for s in range(1, min(self.group_size, length) + 1) if length % s == 0)

    def capacity(self, group: int, train: bool) -> int:
        """An expert's slots per group of `group` tokens (at least 1, at most `group`)."""
        factor = self.capacity_factor_train if train else self.capacity_factor_eval
        return max(1, min(group, math.ceil(self.top_k * group * factor / self.num_experts)))


class MoeFeedForward(nn.Module):
    """The mixture-of-experts feed-forward layer (see the module doc): x [batch, length,
    d_model] -> [batch, length, d_model]. `activations` as `feedforward.DenseReluDense`'s
    (gated activations apply in every expert; `clamp`: gpt-oss's clamped ones'); parameters
    ``router`` [d_model, experts_unsplit] (and `MoEConfig`'s ``router_bias``,
    ``choice_bias``), ``wi`` (or ``wi_0``, ``wi_1``, ...) [experts, d_model, d_ff] and ``wo``
    [experts, d_ff, d_model] (and their ``_bias``), ``shared/...`` (the shared experts).
    `nonpadding` [batch, length]: the real tokens (None: all). `dropless`: so whatever
    `config.dispatch` (decoding: what a capacity would drop is no decoding step's)."""

    config: MoEConfig
    d_ff: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    activations: tuple[str, ...] = ("relu",)
    lora: LoraConfig | None = None  # each expert's adapters where it targets them (`lora`)
    clamp: Clamp | None = None  # the clamped activations' settings (`feedforward.Clamp`)
    quantization: Quantization | None = None  # low-precision projections (`quantization`)

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
        if m.router_bias:
            logits = logits + self._bias("router_bias", (e,), ("experts_unsplit",))
        logits = constrain(logits, ("batch", "group", "experts_unsplit"))
        choice_bias = (self._bias("choice_bias", (e,), ("experts_unsplit",))
                       if m.choice_bias else None)
        if m.dispatch == "dropless" or dropless:
            y = self._dropless(x, logits, real, choice_bias, deterministic)
        else:
            y = self._capacity(xg, logits, real, choice_bias, deterministic).reshape(b, length, d)
        if m.num_shared_experts:
            y = y + DenseReluDense(d_ff=self.d_ff * m.num_shared_experts,
                                   dropout_rate=self.dropout_rate, dtype=dt,
                                   activations=self.activations, lora=self.lora,
                                   clamp=self.clamp, quantization=self.quantization,
                                   name="shared")(x, deterministic)
        return constrain(y, ("batch", "length", "d_model"))

    def _bias(self, name, shape, names, dtype=jnp.float32):
        return layers.param(self, name, nn.initializers.zeros, shape, names, dtype)

    def _capacity(self, xg, logits, real, choice_bias, deterministic: bool):
        """The experts with ``dispatch='capacity'``: one-hot dispatch into their slots."""
        m, dt = self.config, self.dtype
        capacity = m.capacity(xg.shape[1], train=not deterministic)
        dispatch, combine, stats = route(logits, real, m.routing, capacity,
                                         choice_bias=choice_bias)
        self._sow(stats)
        # Each token into its slots, on the devices of its group; then to those of its
        # expert (the all-to-all, where experts and groups split over the same mesh
        # dimension), and back after the experts.
        slots = ("experts", "batch", "expert_capacity")
        unsplit = ("experts_unsplit", "batch", "expert_capacity", "d_model")
        inputs = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dt), xg)
        inputs = constrain(constrain(inputs, unsplit), (*slots, "d_model"))
        wis, wo, biases = self._experts(xg.shape[-1])
        hidden = [wi(inputs, deterministic) for wi in wis]
        if biases:
            hidden = [h + bias[:, None, None] for h, bias in zip(hidden, biases[0])]
        h = gated(self.activations, hidden, self.clamp)
        h = constrain(h, (*slots, "d_ff"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        out = wo(h, deterministic)
        if biases:  # (each choice's, before its gate weights it: gpt-oss)
            out = out + biases[1][:, None, None]
        out = constrain(constrain(out, (*slots, "d_model")), unsplit)
        y = jnp.einsum("gsec,egcd->gsd", combine.astype(dt), out)
        return constrain(y, ("batch", "group", "d_model"))

    def _sow(self, stats):
        m = self.config
        stats = {**stats, "aux_loss": aux_loss(m, stats)}
        if not m.choice_bias:  # (the load is what moves a choice bias)
            stats.pop(LOAD)
        for name, value in stats.items():
            self.sow(STATS, name, value, init_fn=lambda: 0.0, reduce_fn=lambda _, new: new)

    def _dropless(self, x, logits, real, choice_bias, deterministic: bool):
        """The experts with ``dispatch='dropless'`` (`dropless`): the same routing and
        statistics (none dropped), the same parameters."""
        m, dt = self.config, self.dtype
        b, length, d = x.shape
        e = m.num_experts
        probs, gates, index, choice = choose(logits, real, m.routing, choice_bias)
        self._sow(statistics(logits, probs, choice, real, choice.sum()))
        index = jnp.where(real[..., None] > 0, index, e).reshape(b, length, m.top_k)
        gates = gates.reshape(b, length, m.top_k)
        wis, wo, biases = self._experts(d)
        train_dropout = self.dropout_rate > 0 and not deterministic
        y = dropless.experts(x.astype(dt), index, gates, [wi.merged_weight() for wi in wis],
                             wo.merged_weight(), activations=self.activations,
                             kernel=m.grouped_kernel, ragged=m.ragged_all_to_all,
                             dropout_rate=self.dropout_rate,
                             key=self.make_rng("dropout") if train_dropout else None,
                             biases=biases, clamp=self.clamp)
        return constrain(y, ("batch", "length", "d_model"))

    def _experts(self, d: int) -> tuple[list[Projection], Projection, tuple | None]:
        """The experts' weights ``wi`` (or ``wi_0``, ``wi_1``, ...: `input_names`) [experts,
        d_model, d_ff] and ``wo`` [experts, d_ff, d_model] of tokens of `d` = d_model, each
        made with its adapter where `lora` targets it, as projections of the dispatched
        tokens [experts, groups, capacity, d_model] (the dropless experts take them merged);
        and their biases (``<name>_bias``: ([wi biases], wo bias); None without
        `expert_bias`)."""
        e, f = self.config.num_experts, self.d_ff

        def weight(name, fan_in, shape, names, spec):
            w = layers.param(self, name, layers.normal(fan_in**-0.5), shape, names, self.dtype)
            return projection(self, name, spec, w, names, self.lora, self.quantization)

        into = ("experts", "d_model", "d_ff")
        names = input_names(len(self.activations))
        wis = [weight(name, d, (e, d, f), into, "egcd,edf->egcf") for name in names]
        wo = weight("wo", f, (e, f, d), ("experts", "d_ff", "d_model"), "egcf,efd->egcd")
        if not self.config.expert_bias:
            return wis, wo, None
        dt = self.dtype
        biases = [self._bias(f"{name}_bias", (e, f), ("experts", "d_ff"), dt) for name in names]
        return wis, wo, (biases, self._bias("wo_bias", (e, d), ("experts", "d_model"), dt))


def aux_loss(config: MoEConfig, stats: dict):
    """What a layer of `stats` (`routing.statistics`) adds to the training loss."""
    return (config.load_balance_loss * stats["load_balance_loss"]
            + config.router_z_loss * stats["router_z_loss"])


def with_aux_loss(config: MoEConfig, stats):
    """The ``moe_stats`` collection `stats` with each layer's ``aux_loss`` made again from
    its other statistics (a pipeline's, whose parts' statistics it adds up by their counts:
    the sum of two means of different counts is not a mean of the parts' sums)."""
    if isinstance(stats, dict) and "aux_loss" in stats:
        return {**stats, "aux_loss": aux_loss(config, stats)}
    if isinstance(stats, dict):
        return {k: with_aux_loss(config, v) for k, v in stats.items()}
    return stats


def summary(stats) -> dict:
    """A step's mixture-of-experts metrics from the ``moe_stats`` collection of its layers
    (a scanned stack's as arrays over its layers): the mean over the layers of each
    statistic, but the busiest expert's share, the most of any layer; and `aux_loss`, what
    the layers add to the training loss (the mean of theirs, as MaxText). Each layer's
    ``expert_load`` stays its own, an array under ``expert_load/<the layer's module path>``
    (`balancing`). {} for a model without experts."""
    values: dict[str, list] = {}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        name = path[-1].key
        if name == LOAD:
            out[f"{LOAD}/" + "/".join(str(k.key) for k in path[:-1])] = leaf
        elif name not in COUNTS:
            values.setdefault(name, []).append(jnp.ravel(leaf))
    for name, parts in values.items():
        joined = jnp.concatenate(parts)
        out[name] = joined.max() if name == "busiest_expert_share" else joined.mean()
    return out
