"""The model contract: what the trainer, the planner, the checkpoints and the run ask of a
model, so that a new model is a new class and a gin reference (``run.model = @MyModel``),
not an edit of them. `DecoderLM` and `EncoderDecoder` implement it.

A model is a flax `nn.Module`, built as ``model(config)`` from the run's `TransformerConfig`
(it uses what it needs of it), with:

- `features`: the packed features `__call__` takes, e.g. ``("inputs", "targets")``. A batch
  holds each as tokens, segment ids and positions under `batch_keys`; ``targets`` is what
  the loss predicts, and its segment ids > 0 mark the real tokens. A language model's batch
  may also hold `LOSS_WEIGHTS` (which real targets carry loss: a chat's loss is on what the
  assistant says) and `READ_INPUTS` (the token read before each target, passed to
  ``__call__`` as `inputs`), as the fine-tuning formats make them (`data.formats`).
- `config`: a frozen dataclass with `vocab_size`. Its fields marked `shape_field()` change
  the parameters' shapes: a checkpoint must agree on all of them (`shape_fields`).
- ``__call__(*[batch[k] for k in batch_keys(features)], deterministic, return_hidden)``:
  next-token logits [batch, length, vocab], or with `return_hidden` the final hidden states
  [batch, length, d] and the output kernel [d, vocab] (logits = hidden @ kernel).
- `analytic_parameters()` and `analytic_flops(batch_size, length)`: its matmul and embedding
  parameters as the Mesh-TF paper counts them, and its training FLOPs per step (6 x matmul
  parameters x tokens + attention), for the planner and the MFU the run logs.

and, optionally (`uses_packing`, `check_batch`, `active_parameters`, statistics):

- `uses_packing`: True if a kernel of the model wants to know how the examples of each batch
  are packed. The trainer then computes `packing_of` each host batch, carries it with the
  placed batch (each value compiles the step once, like a shape) and makes it
  `current_packing()` while the model is traced (`packed_rows`). A model's attention on a
  Hopper GPU runs cuDNN's packed-segment layout with a table of that size, or for rows of
  one example each (`UNPACKED`) cuDNN's causal kernel with no mask.
- ``check_batch(batch)``: raises `errors.DataError` for a host batch it cannot compute.
- ``active_parameters()``: the parameters one token computes with, where fewer than all (a
  mixture of experts); the planner reports both.
- what it sows into the ``moe_stats`` collection while training (`moe.summary`): logged as
  ``train/<name>``, its ``aux_loss`` added to the training loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Protocol, Sequence

import numpy as np


def shape_field(default: Any, when: Callable[[Any], bool] | None = None) -> Any:
    """A config field that changes parameter shapes (see `shape_fields`); with `when`, only
    in a config for which `when(config)` holds (``max_length``: a learned position table's)."""
    return dataclasses.field(default=default, metadata={"shape": True, "when": when})


def shape_fields(config: Any) -> dict[str, Any]:
    """The values of `config`'s shape fields, by name; a shape field that is itself a
    config gives its own shape fields as ``field.name`` (``moe.num_experts``), none while
    it is None."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        when = f.metadata.get("when")
        if not f.metadata.get("shape") or (when is not None and not when(config)):
            continue
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in shape_fields(value).items()})
        elif value is not None:
            out[f.name] = value
    return out


LOSS_WEIGHTS, READ_INPUTS = "targets_weights", "targets_inputs"  # optional batch keys


def batch_keys(features: Sequence[str]) -> list[str]:
    """The batch arrays of packed `features`, in order: for each, the tokens, its segment ids
    and its positions."""
    return [f"{f}{suffix}" for f in features for suffix in ("", "_segment_ids", "_positions")]


class Model(Protocol):
    features: tuple[str, ...]
    config: Any

    def analytic_parameters(self) -> int: ...

    def analytic_flops(self, batch_size: int, length: int) -> float: ...


# --- how the examples of a batch are packed ------------------------------------------------

_PACKING: contextvars.ContextVar[int | None] = contextvars.ContextVar("packing", default=None)


# `packing_of` a batch whose rows each hold one example at most, from the row's first
# position (its padding, if any, after it): rows as they come unpacked. Causal attention
# needs no mask for them (the causal band is each real query's own example).
UNPACKED = 0


def segment_starts(ids, xp=np):
    """Where an example of segment ids [batch, length] starts (an id > 0 unlike the one
    before it), by `xp` (numpy on the host, jax.numpy in the step)."""
    return (ids > 0) & (ids != xp.pad(ids, ((0, 0), (1, 0)))[:, :-1])


def table_entries(ids) -> np.ndarray:
    """The entries each row of segment ids [batch, length] (numpy) takes in cuDNN's segment
    table (`kernels.segment_layout`, tiled): its examples (runs of one id > 0), and the run
    of padding it starts with, if any (so a row of padding alone takes one)."""
    ids = np.asarray(ids)
    return segment_starts(ids).sum(axis=1) + (ids[:, 0] <= 0)


def packing_of(batch: dict) -> int:
    """`UNPACKED` (0) where every row of a host batch (numpy), in each of its
    ``*_segment_ids`` features, holds one example at most, from its first position (an
    example: a run of one segment id > 0); else the most `table_entries` of any row,
    rounded up to a power of two (so that few values compile)."""
    most, unpacked = 0, True
    for key, ids in batch.items():
        if key.endswith("_segment_ids"):
            entries = table_entries(ids)
            most = max(most, int(entries.max(initial=0)))
            unpacked &= bool(np.all(entries == 1))
    return UNPACKED if unpacked else 1 << max(most - 1, 0).bit_length()


@contextlib.contextmanager
def packed_rows(packing: int | None):
    """Makes `packing` (a batch's `packing_of`, or None: unknown) `current_packing()` while a
    model is traced in the block."""
    token = _PACKING.set(packing)
    try:
        yield
    finally:
        _PACKING.reset(token)


def current_packing() -> int | None:
    return _PACKING.get()
