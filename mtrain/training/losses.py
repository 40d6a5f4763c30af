"""Token-level cross-entropy with optional label smoothing and z-loss (Mesh-TF / T5X)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.parallel import layout as layout_lib
from mtrain.errors import ConfigError
from mtrain.models.base import LOSS_WEIGHTS
from mtrain.parallel.layout import constrain


def loss_weights(batch) -> jax.Array:
    """Which targets of `batch` carry loss (bool [batch, length]): the real ones (segment id
    > 0), and of those the ones its `base.LOSS_WEIGHTS` mark, where it has them."""
    real = batch["targets_segment_ids"] > 0
    return real & (batch[LOSS_WEIGHTS] > 0) if LOSS_WEIGHTS in batch else real


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The loss: `z_loss` (Mesh-TF's default 1e-4), `label_smoothing` and `chunks` (gin:
    ``loss.z_loss``, ...).

    `chunks` > 1 computes the training loss and its gradient that many slices of the
    sequence at a time (`chunked_cross_entropy`): the [batch, length, vocab] logits
    never exist whole. 1 forms them whole; 0 (default) picks: the most slices, at most 16,
    that keep a slice's logits at 2**21 or more elements per device (8 MiB in float32).
    Evaluation always forms the logits (it needs them for accuracy).
    """

    z_loss: float = 1e-4
    label_smoothing: float = 0.0
    chunks: int = 0

    def num_chunks(self, length: int, logits_per_device: int) -> int:
        """The number of slices for sequences of `length` whose logits have
        `logits_per_device` elements on each device."""
        if self.chunks < 0 or (self.chunks and length % self.chunks):
            raise ConfigError(f"loss.chunks={self.chunks} must be 0 (automatic) or divide the "
                              f"sequence length {length}")
        if self.chunks:
            return self.chunks
        return max(c for c in range(1, min(16, length) + 1)
                   if length % c == 0 and (c == 1 or logits_per_device // c >= 2**21))


def cross_entropy(logits, targets, weights, *, z_loss: float = 0.0, label_smoothing: float = 0.0,
                  classes: int = 0):
    """Per-token losses [batch, length] in float32, zero where `weights` is 0.

    `classes` (0: all): the vocabulary rows that are real; the logits past them (mtrain's
    padding of the vocabulary to a multiple of 128) take no part in the softmax, nor in
    the smoothed labels, as in a model with exactly that many rows.

    Returns ``(loss, xent)``: `loss` is what is minimised (cross-entropy against the smoothed
    labels, minus its constant minimum so that a perfect model scores 0, plus
    ``z_loss * log(Z)^2``); `xent` is the plain cross-entropy of the true token, which is what
    perplexity is computed from. No [batch, length, vocab] log-probabilities are formed: the
    target logit is gathered, which XLA's SPMD partitioner splits cleanly when ``vocab`` is
    split over the mesh (a masked local gather and an all-reduce of [batch, length] values,
    never an all-gather of the logits), and which on CPU costs a sixth of the step less than
    a one-hot product.

    The gradient is written out (`_token_losses`), not traced: d/d(logits) is
    ``softmax * (g_loss (1 + 2 z_loss log Z) + g_xent) - onehot(target) (g_loss (c - l) +
    g_xent) - g_loss l`` (c, l: the smoothed labels' weights on the target and elsewhere),
    times the weights: one pass over the logits as they came (bfloat16 in, bfloat16 out),
    where autodiff keeps float32 exponentials for the backward pass, scatters the target's
    term into a zeroed float32 buffer of the logits' size and adds the two. The loss's passes
    over the logits of the lm_1b-shaped step move 18 bytes per logit instead of 42 (XLA:CPU's
    program, `benchmarks/dense_step.py`); the values are autodiff's up to the order of a few
    float32 roundings (tests/test_losses_optimizer.py).
    """
    classes = classes if 0 < classes < logits.shape[-1] else 0
    return _token_losses(logits, targets, weights.astype(jnp.float32), z_loss, label_smoothing,
                         classes)


def _smoothing(label_smoothing: float, vocab: int) -> tuple[float, float]:
    """The smoothed labels' weights: (on the target, on each other class)."""
    if not label_smoothing:
        return 1.0, 0.0
    return 1.0 - label_smoothing, label_smoothing / (vocab - 1)


def _forward(logits, targets, z_loss, label_smoothing, classes):
    """Unweighted ``(loss, xent)`` per token and ``(max, sum of exp)``, the pieces of log Z
    (`jax.nn.logsumexp`'s steps) that the gradient reuses."""
    vocab = logits.shape[-1]
    if classes:
        real = jnp.arange(vocab) < classes
        logits, vocab = jnp.where(real, logits, -jnp.inf), classes
    # (the max of the logits as they came: exact, and a pass that reads them, not a float32
    # copy, where XLA would otherwise write one for its reductions to read, as on CPU)
    amax = jnp.max(logits, axis=-1).astype(jnp.float32)
    amax = jax.lax.stop_gradient(jnp.where(jnp.isfinite(amax), amax, 0.0))
    logits = logits.astype(jnp.float32)
    sumexp = jnp.sum(jnp.exp(logits - amax[..., None]), axis=-1)
    log_z = jnp.log(sumexp) + amax
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    xent = log_z - target_logit
    if label_smoothing:
        confidence, low = _smoothing(label_smoothing, vocab)
        # -sum(soft * log_probs) with soft = low everywhere and `confidence` on the target;
        # as the soft labels sum to 1 this is log_z - sum(soft * logits).
        total = jnp.sum(jnp.where(real, logits, 0.0) if classes else logits, axis=-1)
        loss = log_z - (confidence - low) * target_logit - low * total
        # The entropy of the smoothed labels: the loss's minimum, subtracted as T5X does.
        loss = loss + (confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
    else:
        loss = xent
    if z_loss:
        loss = loss + z_loss * jnp.square(log_z)
    return (loss, xent), (amax, sumexp, log_z)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _token_losses(logits, targets, weights, z_loss, label_smoothing, classes):
    (loss, xent), _ = _forward(logits, targets, z_loss, label_smoothing, classes)
    return loss * weights, xent * weights


def _token_losses_fwd(logits, targets, weights, z_loss, label_smoothing, classes):
    (loss, xent), pieces = _forward(logits, targets, z_loss, label_smoothing, classes)
    return (loss * weights, xent * weights), (logits, targets, weights, loss, xent, pieces)


def _token_losses_bwd(z_loss, label_smoothing, classes, residuals, cotangents):
    logits, targets, weights, loss, xent, (amax, sumexp, log_z) = residuals
    g_loss, g_xent = cotangents
    vocab = logits.shape[-1]
    confidence, low = _smoothing(label_smoothing, classes or vocab)
    on_loss, on_xent = g_loss * weights, g_xent * weights
    # d log Z = softmax = exp(logits - max) / sum: per row, the cotangent over the sum.
    on_log_z = on_loss * (1.0 + 2.0 * z_loss * log_z) if z_loss else on_loss
    per_exp = (on_log_z + on_xent) / sumexp
    on_target = on_loss * (confidence - low) + on_xent if low else on_loss + on_xent
    x = logits.astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    if classes:
        x = jnp.where(ids < classes, x, -jnp.inf)
    grad = jnp.exp(x - amax[..., None]) * per_exp[..., None] \
        - jnp.where(ids == targets[..., None], on_target[..., None], 0.0)
    if low:
        grad = grad - (on_loss * low)[..., None]
    if classes:
        grad = jnp.where(ids < classes, grad, 0.0)
    return grad.astype(logits.dtype), None, g_loss * loss + g_xent * xent


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def chunked_cross_entropy(hidden, kernel, targets, weights, *, chunks: int,
                          z_loss: float = 0.0, label_smoothing: float = 0.0, classes: int = 0):
    """Summed ``(loss, xent)`` of `cross_entropy` over the logits ``hidden @ kernel``, never
    forming the [batch, length, vocab] logits: `chunks` slices of the length, one at a time.

    `hidden` [b, l, d_model] are the final hidden states, `kernel` [d_model, vocab] the output
    projection. The gradient is computed slice by slice in the forward pass (each slice's
    logits are used and dropped at once), so the largest float32 buffer is a slice's logits
    instead of the whole batch's: less memory, and on CPU less time, since the logits and
    their gradient are written to and read from memory once less. `xent` is a metric and
    carries no gradient. `classes` as `cross_entropy`'s.
    """
    b, l = targets.shape
    if l % chunks:
        raise ValueError(f"loss chunks: length {l} does not split into {chunks} chunks")
    loss, xent = _chunked_sums(hidden, kernel, targets, weights.astype(jnp.float32),
                               chunks, z_loss, label_smoothing, classes)
    return loss, jax.lax.stop_gradient(xent)


def _slices(x, chunks):
    """[b, l, ...] -> [chunks, b, l / chunks, ...] (slices of the length, batch kept whole so
    that every device of a data-parallel mesh works on every slice)."""
    b, l = x.shape[:2]
    x = jnp.moveaxis(x.reshape(b, chunks, l // chunks, *x.shape[2:]), 1, 0)
    return constrain(x, (None, "batch", "length", "d_model")[:x.ndim])


def _scan_slices(hidden, kernel, targets, weights, chunks, z_loss, label_smoothing, classes,
                 grad):
    """Sums of the loss and xent over the slices; with `grad` also d(loss sum)/d(hidden)
    [b, l, d] and /d(kernel) [d, vocab] (accumulated in float32).

    d/d(kernel) is a sum over the batch's rows, which a data-parallel mesh splits into n
    blocks: it is accumulated as n partial sums [n, d, vocab] (one per device along
    ``batch``) and summed once after the last slice, so that the devices reduce it once
    (all-reduce, or reduce-scatter into a parameter stored split), not once per slice."""
    active = layout_lib.active()
    n = active[0].ways("batch") if active else 1
    partial_names = ("batch", "d_model", "vocab")

    def blocks(x):  # [b, ...] -> [n, b / n, ...]: device i's rows are block i
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    def step(dkernel, inputs):
        h, t, w = inputs
        # (cross_entropy takes them as they are and computes in float32)
        logits = constrain(jnp.einsum("bld,dv->blv", h, kernel), ("batch", "length", "vocab"))

        def sums(logits):
            loss, xent = cross_entropy(logits, t, w, z_loss=z_loss,
                                       label_smoothing=label_smoothing, classes=classes)
            return loss.sum(), xent.sum()

        if not grad:
            return dkernel, sums(logits)
        (loss, xent), vjp = jax.vjp(sums, logits)
        dlogits = vjp((jnp.ones_like(loss), jnp.zeros_like(xent)))[0].astype(h.dtype)
        dh = jnp.einsum("blv,dv->bld", dlogits, kernel)
        dkernel = dkernel + jnp.einsum("nbld,nblv->ndv", blocks(h), blocks(dlogits),
                                       preferred_element_type=jnp.float32)
        return constrain(dkernel, partial_names), ((loss, xent), dh)

    zeros = constrain(jnp.zeros((n, *kernel.shape), jnp.float32), partial_names)
    xs = (_slices(hidden, chunks), _slices(targets, chunks), _slices(weights, chunks))
    dkernel, out = jax.lax.scan(step, zeros, xs)
    dkernel = constrain(dkernel.sum(0), ("d_model", "vocab"))
    if not grad:
        loss, xent = out
        return loss.sum(), xent.sum()
    (loss, xent), dh = out
    b, l = targets.shape
    dh = jnp.moveaxis(dh, 0, 1).reshape(b, l, -1)
    return (loss.sum(), xent.sum()), (constrain(dh, ("batch", "length", "d_model")), dkernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _chunked_sums(hidden, kernel, targets, weights, chunks, z_loss, label_smoothing, classes):
    return _scan_slices(hidden, kernel, targets, weights, chunks, z_loss, label_smoothing,
                        classes, grad=False)


def _chunked_sums_fwd(hidden, kernel, targets, weights, chunks, z_loss, label_smoothing,
                      classes):
    sums, (dh, dkernel) = _scan_slices(hidden, kernel, targets, weights, chunks, z_loss,
                                       label_smoothing, classes, grad=True)
    return sums, (dh.astype(hidden.dtype), dkernel.astype(kernel.dtype))


def _chunked_sums_bwd(chunks, z_loss, label_smoothing, classes, residuals, cotangents):
    dh, dkernel = residuals
    g = cotangents[0]  # of the loss sum; xent is stop_gradient'ed by the caller
    return (g * dh).astype(dh.dtype), (g * dkernel).astype(dkernel.dtype), None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
