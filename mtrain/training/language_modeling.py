"""Language modelling: the cross-entropy of every target token that carries loss (Mesh-TF /
T5X), with z-loss and label smoothing (`losses.LossConfig`, gin ``loss.*``). A chat's or a
prompt's tokens that are not to be learned carry none (`losses.loss_weights`). The objective
a `Trainer` is given unless told otherwise (`objective`).

A decoder-only LM with multi-token prediction modules (`transformer.mtp_depth` D,
`models.mtp`) is asked for their outputs in the training pass (its ``mtp_outputs``, through
`Setting.apply`'s `model`): here, not in the model, because their targets' weights are the
batch's (a chat's tokens that carry no loss carry none ahead either) and their logits are
formed as the trunk's (whole or in chunks). Module k's loss L_k is the cross-entropy of the
targets k + 1 positions later in the same packed segment (no z-loss, no smoothing: the
paper's), summed and divided by the tokens that carry loss as the trunk's is (the paper
means it over its own targets, a few fewer: one per packed example and module; this way a
step's loss does not depend on its microbatches); ``mtp_loss_weight`` x the mean of the L_k
is added to the loss, and the unweighted mean is logged as ``train/mtp_loss``. Evaluation
and scoring use the trunk's logits only."""

from __future__ import annotations

import math

import jax.numpy as jnp

from mtrain.models.balancing import weighted
from mtrain.models.mtp import ahead
from mtrain.training.losses import (LossConfig, chunked_cross_entropy, cross_entropy,
                                    loss_weights)
from mtrain.training.objective import Objective, Setting


def token_losses(logits, batch, config: LossConfig, classes: int = 0):
    """(loss, xent, weights, logits) per token of `batch` (`cross_entropy`); the logits past
    the real vocabulary (`classes`) set to -inf: no prediction either."""
    weights = loss_weights(batch)
    loss, xent = cross_entropy(logits, batch["targets"], weights, z_loss=config.z_loss,
                               label_smoothing=config.label_smoothing, classes=classes)
    if classes:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < classes, logits, -jnp.inf)
    return loss, xent, weights, logits


def token_sums(out, stats: dict, batch, config: LossConfig, chunks: int, classes: int = 0):
    """A train step's (loss, xent, tokens, tokens, statistics) summed over `batch`'s tokens
    (the count to take means by, then the tokens): `out` the model's logits, or with
    `chunks` > 1 its (final hidden states, output kernel) (`chunked_cross_entropy`). A
    mixture of experts' auxiliary losses (``aux_loss`` in its `stats`, a mean) count once
    per token, and its statistics are summed x tokens too, so that all add up over
    microbatches."""
    weights = loss_weights(batch)
    tokens = weights.sum().astype(jnp.float32)
    if chunks == 1:
        loss, xent = (x.sum() for x in cross_entropy(
            out, batch["targets"], weights, z_loss=config.z_loss,
            label_smoothing=config.label_smoothing, classes=classes))
    else:
        loss, xent = chunked_cross_entropy(
            *out, batch["targets"], weights, chunks=chunks, z_loss=config.z_loss,
            label_smoothing=config.label_smoothing, classes=classes)
    if "aux_loss" in stats:
        loss = loss + tokens * stats.pop("aux_loss")
    return loss, xent, tokens, tokens, weighted(stats, tokens)


def mtp_loss_sum(outs, batch, chunks: int, classes: int = 0):
    """The multi-token prediction modules' cross-entropy summed over the batch's tokens and
    meant over the modules (`models.mtp`): `outs` their logits, or with `chunks` > 1 their
    (hidden states, output kernel); module k's targets are `batch`'s k + 1 positions later,
    where those are in the same packed segment and carry loss. A sum, divided as the trunk's
    is by the tokens that carry loss (a position with no target k + 1 ahead adds 0): so the
    step's loss is the same however the batch is cut into microbatches."""
    weights, segments = loss_weights(batch), batch["targets_segment_ids"]
    totals = []
    for k, out in enumerate(outs, 1):
        targets = ahead(batch["targets"], k)
        carried = ahead(weights, k) & (ahead(segments, k) == segments)
        if chunks == 1:
            totals.append(cross_entropy(out, targets, carried, classes=classes)[0].sum())
        else:
            totals.append(chunked_cross_entropy(*out, targets, carried, chunks=chunks,
                                                classes=classes)[0])
    return sum(totals) / len(totals)


class LanguageModeling(Objective):
    """The mean token loss (`token_sums`); evaluation's loss, perplexity and accuracy per
    token. `loss_chunks`: the slices of the length the training loss forms the logits in
    (`LossConfig.num_chunks`, for a microbatch's logits on each device)."""

    token_metrics = True

    def __init__(self, config: LossConfig | None = None):
        self.config = config or LossConfig()

    def bind(self, setting: Setting) -> "LanguageModeling":
        bound = LanguageModeling(self.config)
        bound.setting = setting
        rows, length = setting.batch_shape
        logits_per_device = math.prod(  # of one microbatch
            -(-size // setting.layout.ways(name)) for name, size in
            [("batch", rows // setting.num_microbatches), ("length", length),
             ("vocab", setting.model.config.vocab_size)])
        bound.loss_chunks = self.config.num_chunks(length, logits_per_device)
        model = setting.model  # (with multi-token prediction: the one that returns its outputs)
        bound.mtp_model = model.clone(mtp_outputs=True) \
            if getattr(model.config, "mtp_depth", 0) and hasattr(model, "mtp_outputs") else None
        return bound

    def loss_sums(self, params, batch, rngs):
        s, chunks, model = self.setting, self.loss_chunks, self.mtp_model
        out, stats = s.apply(params, batch, False, rngs, chunks > 1, stats=True, model=model)
        if model is None:
            return token_sums(out, stats, batch, self.config, chunks, s.classes)
        out, later = out
        loss, xent, count, tokens, stats = token_sums(out, stats, batch, self.config, chunks,
                                                      s.classes)
        stats["mtp_loss"] = mtp_loss_sum(later, batch, chunks, s.classes)  # (a sum, as stats)
        loss = loss + model.config.mtp_loss_weight * stats["mtp_loss"]
        return loss, xent, count, tokens, stats

    def eval_sums(self, params, batch) -> dict:
        s = self.setting
        _, xent, weights, logits = token_losses(s.apply(params, batch, True), batch,
                                                self.config, s.classes)
        correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) & weights
        return {
            "xent_sum": xent.sum(),
            "correct": correct.sum().astype(jnp.float32),
            "num_tokens": weights.sum().astype(jnp.float32),
        }

    def eval_results(self, totals: dict) -> dict:
        totals = {"xent_sum": 0.0, "correct": 0.0, "num_tokens": 0.0, **totals}
        n = max(totals["num_tokens"], 1.0)
        loss = totals["xent_sum"] / n
        return {
            "eval/loss": loss,
            "eval/perplexity": math.exp(min(loss, 50.0)),
            "eval/accuracy": totals["correct"] / n,
            "eval/num_tokens": totals["num_tokens"],
        }
