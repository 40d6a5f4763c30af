"""The model contract: what the trainer, the planner, the checkpoints and the run ask of a
model, so that a new model is a new class and a gin reference (``run.model = @MyModel``),
not an edit of them. `DecoderLM` and `EncoderDecoder` implement it.

A model is a flax `nn.Module`, built as ``model(config)`` from the run's `TransformerConfig`
(it uses what it needs of it), with:

- `features`: the packed features `__call__` takes, e.g. ``("inputs", "targets")``. A batch
  holds each as tokens, segment ids and positions under `batch_keys`; ``targets`` is what
  the loss predicts, and its segment ids > 0 mark the real tokens.
- `config`: a frozen dataclass with `vocab_size`. Its fields marked `shape_field()` change
  the parameters' shapes: a checkpoint must agree on all of them (`shape_fields`).
- ``__call__(*[batch[k] for k in batch_keys(features)], deterministic, return_hidden)``:
  next-token logits [batch, length, vocab], or with `return_hidden` the final hidden states
  [batch, length, d] and the output kernel [d, vocab] (logits = hidden @ kernel).
- `analytic_parameters()` and `analytic_flops(batch_size, length)`: its matmul and embedding
  parameters as the Mesh-TF paper counts them, and its training FLOPs per step (6 x matmul
  parameters x tokens + attention), for the planner and the MFU the run logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence


def shape_field(default: Any) -> Any:
    """A config field that changes parameter shapes (see `shape_fields`)."""
    return dataclasses.field(default=default, metadata={"shape": True})


def shape_fields(config: Any) -> dict[str, Any]:
    """The values of `config`'s shape fields, by name."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.metadata.get("shape")}


def batch_keys(features: Sequence[str]) -> list[str]:
    """The batch arrays of packed `features`, in order: for each, the tokens, its segment ids
    and its positions."""
    return [f"{f}{suffix}" for f in features for suffix in ("", "_segment_ids", "_positions")]


class Model(Protocol):
    features: tuple[str, ...]
    config: Any

    def analytic_parameters(self) -> int: ...

    def analytic_flops(self, batch_size: int, length: int) -> float: ...
