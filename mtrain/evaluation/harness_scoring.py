"""Scoring rows of ids with a trainer's model in its layout, for lm-evaluation-harness's
loglikelihood requests (`harness`): each row's sum of log-probabilities over its scored
targets, and whether every one of them is the model's most likely id.

    scorer = Scorer(trainer, rows=8, max_length=2048)
    [(log_likelihood, is_greedy), ...] = scorer(params, [Row(...), ...])

Rows go `rows` at a time (padded up to a multiple of the ``batch`` split), sorted longest
first (lm-eval's `Collator`, as its backends batch) and padded to a length bucket: four a
doubling (48, 56, 64, 80, 96, ...; at least 16, at most `max_length`), so that a task
compiles a few programs, not one per request, and pads a row by a quarter at most.
`scores_per_call` caps the attention scores a call computes per ``batch`` shard (rows x
length^2; None: no cap): a batch of long rows goes in several calls of fewer rows. The
einsum attention of a CPU holds them all at once, and past a few MiB it runs at the speed
of fresh memory pages (`MtrainLM` sets the cap on CPU; the flash kernels of a GPU or TPU
hold none). The batch is laid out as a
training batch is (``batch`` split, ``length`` split with context parallelism's order), the
parameters stay where the layout keeps them, and the log-softmax runs over every row of
the model's vocabulary that it may emit (`Trainer.classes`: a published model's padding
rows too, as Hugging Face scores them).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from lm_eval.models.utils import Collator

from mtrain.evaluation.harness_requests import Row
from mtrain.models import context
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS, packing_of
from mtrain.training.placement import BATCH_NAMES, local_rows, place
from mtrain.training.trainer import Trainer

SHORTEST = 16  # the smallest length bucket


class Scorer:
    """Log-likelihoods of `Row`s with the model and layout of `trainer` (module doc)."""

    def __init__(self, trainer: Trainer, *, rows: int, max_length: int,
                 scores_per_call: int | None = None):
        self.trainer, self.max_length = trainer, max_length
        self.ways = ways = trainer.layout.ways("batch")
        self.rows = -(-max(rows, 1) // ways) * ways  # (padded rows score nothing)
        self.scores_per_call = scores_per_call
        self.classes = trainer.classes or trainer.model.config.vocab_size
        self._score = jax.jit(self._score_fn, out_shardings=NamedSharding(trainer.mesh,
                                                                           PartitionSpec()))

    def _score_fn(self, params, batch):
        trainer = self.trainer
        with trainer.layout.activate(trainer.mesh):
            logits = trainer.apply_model(params, batch, deterministic=True)
        logits = logits[..., :self.classes].astype(jnp.float32)
        targets, scored = batch["targets"], batch[LOSS_WEIGHTS] > 0
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        greedy = (jnp.argmax(logits, axis=-1) == targets) | ~scored
        return jnp.where(scored, picked, 0.0).sum(axis=1), greedy.all(axis=1)

    def bucket(self, longest: int) -> int:
        """The length a batch whose longest row is `longest` is padded to (module doc); a
        multiple of what context parallelism's order needs where ``length`` is split."""
        multiple = 2 * self.trainer.layout.ways("length")
        longest = max(longest, SHORTEST)
        step = max(8, 1 << (longest.bit_length() - 3))  # (a quarter of the octave)
        length = -(-longest // step) * step
        length = -(-length // multiple) * multiple
        return length if length <= self.max_length else self.max_length

    def per_call(self, length: int) -> int:
        """The rows a call of rows of `length` takes (`scores_per_call`)."""
        if self.scores_per_call is None:
            return self.rows
        return min(self.rows, max(1, self.scores_per_call // length ** 2) * self.ways)

    def batch(self, rows: Sequence[Row], length: int) -> dict[str, np.ndarray]:
        """The host batch of `rows` padded to `length` ([`per_call`, length]; the rows past
        them empty: every call of a length has one shape)."""
        shape = (self.per_call(length), length)
        out = {k: np.zeros(shape, np.int32) for k in ("targets", "targets_segment_ids",
                                                      READ_INPUTS, LOSS_WEIGHTS)}
        for i, row in enumerate(rows):
            n = len(row)
            out["targets"][i, :n], out[READ_INPUTS][i, :n] = row.targets, row.inputs
            out["targets_segment_ids"][i, :n] = 1
            out[LOSS_WEIGHTS][i, n - row.scored:n] = 1
        out["targets_positions"] = np.where(out["targets_segment_ids"] > 0,
                                            np.arange(shape[1]), 0).astype(np.int32)
        return out

    def _place(self, batch: dict[str, np.ndarray]):
        trainer, shape = self.trainer, batch["targets"].shape
        sharding = trainer.layout.sharding(trainer.mesh, BATCH_NAMES, shape,
                                           tensor="lm-eval's batch of rows")
        start, stop = local_rows(sharding, shape)
        return place({k: v[start:stop] for k, v in batch.items()}, sharding, shape,
                     packing_of(batch) if trainer.uses_packing else None,
                     context.length_order(shape[1], trainer.layout, trainer.model.features))

    def __call__(self, params, rows: Sequence[Row]) -> list[tuple[float, bool]]:
        """(sum of log p over each row's scored targets, whether all are greedy), in order."""
        order = Collator(list(rows), sort_fn=lambda row: (-len(row), row.inputs))
        out = []
        for chunk in order.get_batched(n=self.rows):
            length = self.bucket(max(len(r) for r in chunk))
            step = self.per_call(length)
            for first in range(0, len(chunk), step):
                part = chunk[first:first + step]
                sums, greedy = jax.device_get(self._score(
                    params, self._place(self.batch(part, length))))
                out += [(float(s), bool(g)) for s, g in zip(sums[:len(part)], greedy)]
        return order.get_original(out)
