"""Adafactor with Mesh-TF's defaults and the `linear_warmup * rsqrt_decay` schedule."""

from __future__ import annotations

import jax.numpy as jnp
import optax


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
