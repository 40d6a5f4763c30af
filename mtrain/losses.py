"""Token-level cross-entropy with optional label smoothing and z-loss (Mesh-TF / T5X)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cross_entropy(logits, targets, weights, *, z_loss: float = 0.0, label_smoothing: float = 0.0):
    """Per-token losses [batch, length] in float32, zero where `weights` is 0.

    Returns ``(loss, xent)``: `loss` is what is minimised (cross-entropy against the smoothed
    labels, minus its constant minimum so that a perfect model scores 0, plus
    ``z_loss * log(Z)^2``); `xent` is the plain cross-entropy of the true token, which is what
    perplexity is computed from. A one-hot product rather than a gather picks the target
    logit, so the computation partitions cleanly when ``vocab`` is split over the mesh.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    log_probs = logits - log_z[..., None]
    one_hot = jax.nn.one_hot(targets, vocab, dtype=jnp.float32)
    xent = -jnp.sum(one_hot * log_probs, axis=-1)
    if label_smoothing:
        confidence = 1.0 - label_smoothing
        low = label_smoothing / (vocab - 1)
        soft = one_hot * (confidence - low) + low
        # The entropy of the smoothed labels: the loss's minimum, subtracted as T5X does.
        floor = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
        loss = -jnp.sum(soft * log_probs, axis=-1) - floor
    else:
        loss = xent
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    weights = weights.astype(jnp.float32)
    return loss * weights, xent * weights
