"""Direct Preference Optimization (Rafailov et al. 2023), as TRL's `DPOTrainer` computes it.

A batch of preference pairs (`data.preference.Preference`) holds each pair's chosen and
rejected halves as segments 2k - 1 and 2k of one row, their completions' targets marked
`CHOSEN` and `REJECTED` in the loss weights. For each pair, the policy's and the reference
model's log-probabilities of the completions are summed (pi_c, pi_r, ref_c, ref_r), and

    h = (pi_c - pi_r) - (ref_c - ref_r)
    sigmoid loss = -(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h)   (s: label_smoothing)
    IPO loss     = (h - 1 / (2 beta))^2, of log-probabilities averaged over each completion

with rewards beta (pi_c - ref_c) and beta (pi_r - ref_r), the loss the mean over the
batch's pairs. The reference is the model the run started from, frozen
(`reference.Reference`). The objective a `Trainer` is given for a task of preference pairs:
`Preference`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtrain.data.preference import CHOSEN, REJECTED
from mtrain.errors import ConfigError
from mtrain.models.balancing import weighted
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS, batch_keys
from mtrain.training.losses import loss_weights
from mtrain.training.objective import token_log_likelihoods
from mtrain.training.reference import AgainstReference

LOSSES = ("sigmoid", "ipo")
# What a DPO step reports (TRL's names), each a mean over the batch's pairs.
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy",
           "logps_chosen", "logps_rejected")


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    """gin ``dpo.*``: `beta` (the KL penalty's weight), `label_smoothing` (conservative
    DPO: the share of pairs assumed mislabelled), `loss` ('sigmoid' or 'ipo'),
    `disable_dropout` (TRL's default: the policy's forward pass without dropout, as the
    reference's, so that a policy equal to its reference has loss log 2)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss: str = "sigmoid"
    disable_dropout: bool = True

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"dpo.loss={self.loss!r}; use one of {', '.join(LOSSES)}")
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta must be positive, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got "
                              f"{self.label_smoothing}")


def pair_sums(token_logps: jax.Array, batch) -> tuple[jax.Array, jax.Array]:
    """Each pair's summed log-probabilities of its chosen and of its rejected completion
    ([rows, pairs, 2]), and how many targets each completion has ([rows, pairs, 2]; 0: no
    pair there). `token_logps` [rows, length]: log p of each target."""
    weights, segments = batch[LOSS_WEIGHTS], batch["targets_segment_ids"]
    rows, length = segments.shape
    pairs = length // 2  # each half has a completion target at least

    def per_half(values):  # [rows, length] -> [rows, pairs, 2], by segment 2k - 1 and 2k
        sums = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=length + 1))(
            values, segments)
        return sums[:, 1:2 * pairs + 1].reshape(rows, pairs, 2)

    completion = (weights == CHOSEN) | (weights == REJECTED)
    return (per_half(jnp.where(completion, token_logps, 0.0)),
            per_half(completion.astype(jnp.float32)))


def losses(policy, reference, counts, config: DpoConfig) -> tuple[jax.Array, dict, jax.Array]:
    """(the summed loss, the summed `METRICS`, the number of pairs) over the pairs of
    `policy` and `reference` ([rows, pairs, 2] summed log-probabilities: `pair_sums`;
    `counts` their targets)."""
    present = (counts[..., 0] > 0).astype(jnp.float32)
    if config.loss == "ipo":  # IPO compares log-probabilities per token
        policy, reference = (x / jnp.maximum(counts, 1.0) for x in (policy, reference))
    ratio = policy - reference
    h = ratio[..., 0] - ratio[..., 1]
    if config.loss == "sigmoid":
        s = config.label_smoothing
        loss = (-(1 - s) * jax.nn.log_sigmoid(config.beta * h)
                - s * jax.nn.log_sigmoid(-config.beta * h))
    else:
        loss = jnp.square(h - 1.0 / (2.0 * config.beta))
    chosen, rejected = config.beta * ratio[..., 0], config.beta * ratio[..., 1]
    metrics = {"rewards_chosen": chosen, "rewards_rejected": rejected,
               "reward_margin": chosen - rejected,
               "reward_accuracy": (chosen > rejected).astype(jnp.float32),
               "logps_chosen": policy[..., 0], "logps_rejected": policy[..., 1]}
    total = lambda x: jnp.sum(x * present)  # noqa: E731
    return total(loss), {k: total(v) for k, v in metrics.items()}, jnp.sum(present)


class Preference(AgainstReference):
    """DPO or IPO (`DpoConfig`: gin ``dpo.*``) over a batch of preference pairs, against
    the `Reference`: (loss, minus the chosen completions' log-probability, pairs, tokens,
    statistics) summed over the pairs; the reference's log-probabilities carry no gradient.
    A mixture of experts' auxiliary losses count once per pair."""

    def __init__(self, config: DpoConfig | None = None):
        super().__init__(config or DpoConfig())

    def batch_keys(self, features) -> list[str]:
        return batch_keys(features) + [READ_INPUTS, LOSS_WEIGHTS]

    def loss_sums(self, params, batch, rngs, copy=None):
        s, reference = self.setting, self.reference
        policy_logps, stats = token_log_likelihoods(s, params, batch,
                                                    self.config.disable_dropout, rngs,
                                                    stats=True)
        reference_logps, _ = token_log_likelihoods(
            s, jax.lax.stop_gradient(reference.params(params, copy)), batch, True,
            model=reference.model, stats=True)
        policy, counts = pair_sums(policy_logps, batch)
        ref, _ = pair_sums(jax.lax.stop_gradient(reference_logps), batch)
        loss, metrics, pairs = losses(policy, ref, counts, self.config)
        if "aux_loss" in stats:
            loss = loss + pairs * stats.pop("aux_loss")
        tokens = loss_weights(batch).sum().astype(jnp.float32)
        stats = {**weighted(stats, pairs), **metrics}
        return loss, -metrics["logps_chosen"], pairs, tokens, stats

    def eval_sums(self, params, batch, copy=None) -> dict:
        loss, _, pairs, tokens, stats = self.loss_sums(params, batch, None, copy)
        return {"loss_sum": loss, "num_pairs": pairs, "num_tokens": tokens,
                **{k: stats[k] for k in METRICS}}

    def eval_results(self, totals: dict) -> dict:
        """The loss and the means of `METRICS` over the held-out pairs."""
        totals = {"loss_sum": 0.0, "num_pairs": 0.0, "num_tokens": 0.0, **totals}
        n = max(totals["num_pairs"], 1.0)
        return {"eval/loss": totals["loss_sum"] / n,
                **{f"eval/{k}": v / n for k, v in totals.items() if k in METRICS},
                "eval/num_pairs": totals["num_pairs"], "eval/num_tokens": totals["num_tokens"]}
