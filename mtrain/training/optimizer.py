"""The optimizers and learning-rate schedules: Adafactor with Mesh-TF's defaults and its
`linear_warmup * rsqrt_decay` schedule; AdamW with gradient clipping and the warmup + cosine
schedule Llama-style models train with; and the logical names of an optimizer state's
leaves (for its sharding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec


SCHEDULE_SHAPES = ("rsqrt", "cosine")


def learning_rate_schedule(
    warmup_steps: int = 10_000,
    train_steps: int | None = None,
    linear_decay_steps: int = 0,
    constant: float = 1.0,
    shape: str = "rsqrt",
    final_fraction: float = 0.1,
    decay_steps: int = 0,
) -> optax.Schedule:
    """The learning rate at each step, by `shape`. `s` counts from 1 (the rate for the update
    that produces step s), so the first update is not wasted.

    - ``'rsqrt'``: Mesh-TF/T2T's ``linear_warmup * rsqrt_decay [* linear_decay]`` (times
      `constant`): ``lr(s) = constant * min(1, s / warmup) / sqrt(max(s, warmup))``, and,
      when `linear_decay_steps` > 0, times ``clip((train_steps - s) / linear_decay_steps, 0,
      1)`` so that the rate falls linearly to zero over the last `linear_decay_steps` steps.
    - ``'cosine'``: linear warmup to `constant` (the peak rate), then a cosine decay to
      ``final_fraction * constant`` at step T, `decay_steps` or else `train_steps`: ``lr(s) =
      constant * s / warmup`` up to warmup, then ``constant * (f + (1 - f) * (1 + cos(pi *
      p)) / 2)`` with ``p = (s - warmup) / (T - warmup)``, held at its end value after T.
      (With `decay_steps`, a run given more steps keeps the rates it trained with.)
    """
    if warmup_steps < 1:
        raise ValueError(f"learning_rate_schedule.warmup_steps must be >= 1, got {warmup_steps}")
    if shape not in SCHEDULE_SHAPES:
        raise ValueError(f"learning_rate_schedule.shape must be one of "
                         f"{', '.join(SCHEDULE_SHAPES)}, got {shape!r}")
    if linear_decay_steps and not train_steps:
        raise ValueError("learning_rate_schedule.linear_decay_steps needs train_steps")
    horizon = decay_steps or train_steps
    if shape == "cosine":
        if not horizon or horizon <= warmup_steps:
            which = (f"learning_rate_schedule.decay_steps={decay_steps}" if decay_steps else
                     f"run.train_steps={train_steps}")
            raise ValueError(f"learning_rate_schedule.shape='cosine' decays after the warmup: "
                             f"{which} must exceed learning_rate_schedule.warmup_steps="
                             f"{warmup_steps}")
        if not 0.0 <= final_fraction <= 1.0:
            raise ValueError(f"learning_rate_schedule.final_fraction must be in [0, 1], got "
                             f"{final_fraction}")

    def rsqrt(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        lr = constant * jnp.minimum(1.0, s / warmup_steps) * jnp.sqrt(1.0 / jnp.maximum(s, warmup_steps))
        if linear_decay_steps:
            lr = lr * jnp.clip((train_steps - s) / linear_decay_steps, 0.0, 1.0)
        return lr

    def cosine(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        progress = jnp.clip((s - warmup_steps) / (horizon - warmup_steps), 0.0, 1.0)
        decay = final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return constant * jnp.where(s < warmup_steps, s / warmup_steps, decay)

    return rsqrt if shape == "rsqrt" else cosine


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
) -> optax.GradientTransformation:
    """optax's AdamW after clipping the gradients to global norm `clip_norm` (None: no
    clipping), with Llama's settings as defaults. Weight decay (decoupled, times the
    learning rate) applies to parameters of two or more dimensions, not to the norms'
    scales, as nanoGPT and many Llama recipes do."""
    decay = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if clip_norm is None:
        return decay
    return optax.chain(optax.clip_by_global_norm(clip_norm), decay)


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
