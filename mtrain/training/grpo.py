"""Group Relative Policy Optimization (Shao et al. 2024), as TRL's `GRPOTrainer` computes it.

Each prompt's `num_generations` completions form a group; a completion's advantage is its
reward less its group's mean, over the group's standard deviation (Bessel's, plus 1e-4: a
group of equal rewards gets 0). A batch row holds one prompt and one completion (a
`rollouts.Rollout` laid out by `rollout_rows`), the completion's targets marked in the loss
weights, its advantage and the generating policy's log-probabilities on each of its tokens.
Per completion token t, with logp the policy's log-probability of logits / temperature:

    rho_t = exp(logp_t - old_t)          (old: the generating policy's; with one iteration
                                          per generation, logp itself, detached: rho = 1)
    l_t   = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A)
          + beta rho_t (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)    (k3, times rho)

summed over the completion tokens and divided by (`GrpoConfig.loss`):

    'dapo'    the batch's completion tokens (TRL 1.16's default: every token weighs the same)
    'grpo'    each completion's tokens, then the number of completions (the paper's mean)
    'dr_grpo' completions x max_completion_length (Dr. GRPO: no length bias)

The reference is the run's starting model, frozen (`reference.Reference`: with LoRA, the base
without adapters). The objective a `Trainer` is given for a task of prompts or rollouts:
`Grpo`; what samples the completions and scores them is `evaluation.rollouts`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.errors import ConfigError
from mtrain.models.balancing import weighted
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS, batch_keys
from mtrain.training.losses import loss_weights
from mtrain.training.objective import Setting
from mtrain.training.reference import AgainstReference

LOSSES = ("dapo", "grpo", "dr_grpo")
ADVANTAGES, OLD_LOGPS = "advantages", "old_logps"  # the batch keys GRPO adds (per token)
# The sums a step reports per completion token (`Grpo.loss_sums`), made into means by the
# stepper (`token_means`): TRL's names.
TOKEN_SUMS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
              "clip_ratio/region_mean")
ACTIVE = "completion_tokens"


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """gin ``grpo.*``. Sampling: `num_generations` completions per prompt (a group), of at
    most `max_completion_length` tokens, at `temperature` with `top_p` and `top_k` (0: all).
    The update: `num_iterations` optimizer steps per batch of generations, the loss's
    normalisation `loss` (module doc), the KL weight `beta` (0: no reference model),
    the ratio's clipping `epsilon` and `epsilon_high` (DAPO's asymmetric upper bound; None:
    `epsilon`), `scale_rewards` ('group': advantages over the group's std; 'none': not
    scaled, Dr. GRPO), `disable_dropout`. Rewards: `rewards`, functions
    ``f(record, completions) -> floats`` or their names (`evaluation.rewards.resolve`),
    summed with `reward_weights` (None: 1 each). The defaults are TRL 1.16's."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_iterations: int = 1
    loss: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: str = "group"
    disable_dropout: bool = False
    rewards: Sequence[Callable[..., Any]] = ()
    reward_weights: Sequence[float] | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"grpo.loss={self.loss!r}; use one of {', '.join(LOSSES)}")
        if self.scale_rewards not in ("group", "none"):
            raise ConfigError(f"grpo.scale_rewards={self.scale_rewards!r}; use 'group' or "
                              f"'none'")
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"grpo.{name} must be a positive integer, got "
                                  f"{getattr(self, name)!r}")
        if self.num_generations < 2:
            raise ConfigError("grpo.num_generations must be at least 2: an advantage compares "
                              "a completion with the others of its group")
        if self.beta < 0 or self.epsilon < 0 or self.epsilon_high_value < 0:
            raise ConfigError(f"grpo.beta, grpo.epsilon and grpo.epsilon_high must be >= 0, "
                              f"got {self.beta}, {self.epsilon}, {self.epsilon_high}")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"grpo.temperature must be > 0, grpo.top_p in (0, 1] and "
                              f"grpo.top_k >= 0, got {self.temperature}, {self.top_p}, "
                              f"{self.top_k}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                              f"{len(self.rewards)} grpo.rewards")

    @property
    def epsilon_high_value(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights or [1.0] * len(self.rewards))


def advantages(rewards: np.ndarray, group: int, scale: str = "group") -> np.ndarray:
    """Each completion's advantage ([n] float32) from its reward ([n], groups of `group`
    consecutive ones): the reward less its group's mean, over the group's std (Bessel's) +
    1e-4 where `scale` is 'group' (TRL's `scale_rewards`)."""
    r = np.asarray(rewards, np.float32).reshape(-1, group)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + np.float32(1e-4))
    return centred.reshape(-1).astype(np.float32)


def token_losses(logps, old, ref, adv, config: GrpoConfig):
    """(l_t, rho_t, k3_t) per token of the module doc ([rows, length] each; `ref` None:
    beta 0, k3 0)."""
    rho = jnp.exp(logps - old)
    clipped = jnp.clip(rho, 1.0 - config.epsilon, 1.0 + config.epsilon_high_value)
    loss = -jnp.minimum(rho * adv, clipped * adv)
    k3 = jnp.zeros_like(loss)
    if ref is not None:
        k3 = (jnp.exp(ref - logps) - (ref - logps) - 1.0) * rho
        loss = loss + config.beta * k3
    return loss, rho, k3


def aggregate(loss, mask, config: GrpoConfig) -> tuple[jax.Array, jax.Array]:
    """(the summed loss, what it is a mean over) of per-token `loss` on the completion tokens
    `mask` (float [rows, length]), by `config.loss` (module doc)."""
    per_row = (loss * mask).sum(axis=1)
    rows = (mask.sum(axis=1) > 0).astype(jnp.float32)
    if config.loss == "grpo":
        return jnp.sum(per_row / jnp.maximum(mask.sum(axis=1), 1.0)), rows.sum()
    if config.loss == "dr_grpo":
        return per_row.sum(), rows.sum() * config.max_completion_length
    return per_row.sum(), mask.sum()


def token_statistics(rho, k3, entropy, adv, mask, config: GrpoConfig) -> dict:
    """The `TOKEN_SUMS` (sums over the completion tokens) and their count, `ACTIVE`."""
    low = (rho < 1.0 - config.epsilon) & (adv < 0)
    high = (rho > 1.0 + config.epsilon_high_value) & (adv > 0)
    total = lambda x: jnp.sum(x.astype(jnp.float32) * mask)  # noqa: E731
    return {"kl": total(k3), "entropy": total(entropy), "clip_ratio/low_mean": total(low),
            "clip_ratio/high_mean": total(high), "clip_ratio/region_mean": total(low | high),
            ACTIVE: mask.sum()}


def token_means(metrics: dict) -> dict:
    """A step's metrics with each of `TOKEN_SUMS` made a mean per completion token (both
    were scaled alike by the trainer: the ratio is exact over microbatches)."""
    active = jnp.maximum(metrics[ACTIVE], 1e-30)
    return {**{k: v for k, v in metrics.items() if k != ACTIVE},
            **{k: metrics[k] / active for k in TOKEN_SUMS}}


def completion_log_probs(setting: Setting, params, batch, temperature: float,
                         deterministic: bool = True, rngs=None, model=None):
    """(log p of each target [rows, length] under softmax(logits / temperature) over the
    model's classes, 0 where no loss; the entropy of that distribution; the model's
    statistics)."""
    logits, stats = setting.apply(params, batch, deterministic, rngs, stats=True, model=model)
    logits = logits.astype(jnp.float32) / temperature
    if 0 < setting.classes < logits.shape[-1]:
        logits = logits[..., :setting.classes]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    weights = loss_weights(batch)
    picked = jnp.take_along_axis(logp_all, batch["targets"][..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return jnp.where(weights, picked, 0.0), entropy, stats


class Grpo(AgainstReference):
    """GRPO's clipped surrogate with its KL penalty (`GrpoConfig`: gin ``grpo.*``) over a
    batch of rollout rows: (loss, the completions' negative log-likelihood, the count the
    loss is a mean over, tokens, statistics). Evaluation is of rewards (the stepper's), not
    of held-out sums."""

    float_keys = (ADVANTAGES, OLD_LOGPS)

    def __init__(self, config: GrpoConfig | None = None):
        super().__init__(config or GrpoConfig())

    def batch_keys(self, features) -> list[str]:
        return batch_keys(features) + [READ_INPUTS, LOSS_WEIGHTS, ADVANTAGES, OLD_LOGPS]

    @property
    def uses_reference(self) -> bool:  # (beta 0: no KL, no reference held)
        return self.config.beta > 0

    def loss_sums(self, params, batch, rngs, copy=None):
        s, c = self.setting, self.config
        logps, entropy, stats = completion_log_probs(s, params, batch, c.temperature,
                                                     c.disable_dropout, rngs)
        mask = loss_weights(batch).astype(jnp.float32)
        old = batch[OLD_LOGPS] if c.num_iterations > 1 else jax.lax.stop_gradient(logps)
        ref = None
        if self.uses_reference:
            ref, _, _ = completion_log_probs(
                s, jax.lax.stop_gradient(self.reference.params(params, copy)), batch,
                c.temperature, True, model=self.reference.model)
            ref = jax.lax.stop_gradient(ref)
        adv = batch[ADVANTAGES]
        per_token, rho, k3 = token_losses(logps, old, ref, adv, c)
        loss, count = aggregate(per_token, mask, c)
        if "aux_loss" in stats:
            loss = loss + count * stats.pop("aux_loss")
        sums = token_statistics(rho, k3, jax.lax.stop_gradient(entropy), adv, mask, c)
        nll = -jnp.sum(logps * mask)
        return loss, nll, count, mask.sum(), {**weighted(stats, count), **sums}

    def token_log_likelihoods(self, params, batch) -> jax.Array:
        """log p of each completion token at the sampling temperature (the generating
        policy's log-probabilities, `OLD_LOGPS`)."""
        return completion_log_probs(self.setting, params, batch, self.config.temperature)[0]

    def eval_sums(self, params, batch, *arguments) -> dict:
        raise ConfigError("a GRPO run evaluates no held-out sums: its rewards are logged "
                          "each step")

    def eval_results(self, totals: dict) -> dict:
        return {}
