"""What a run reads: a `DataSource` gives, for each split it has, the `Stream`s of its
examples, read by index (several streams: a mixture, drawn by their weights: `lanes`).

Every kind of data is one: a text corpus (`sources.TextSource`, its features packed as the
task says), a user's prepared files (`user_data.UserData`), or streams given as they are
(`Streams`: tests, benchmarks). The input pipeline (`pipeline.batches`), the modes and the
checkpoints see nothing else of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from mtrain.data import formats
from mtrain.errors import DataError


@dataclasses.dataclass
class Stream:
    """One source of a run's data: its split's records (by index) and their format."""

    name: str
    records: Sequence
    format: formats.Format
    weight: float = 1.0
    fingerprint: str = ""  # what decides the examples (saved with the input's state)


@runtime_checkable
class DataSource(Protocol):
    """Named splits of examples, each given as streams."""

    splits: tuple[str, ...]

    def check_split(self, split: str) -> str:
        """Returns `split`, or raises a DataError that says what the source has."""

    def num_examples(self, split: str) -> int:
        """The examples of a split (a long text's pieces each one)."""

    def streams(self, split: str) -> list[Stream]:
        """The split's examples: one stream, or a mixture's."""

    def fingerprint(self) -> str:
        """What decides the examples and their order, as text that is the same in every
        process and on every machine (saved with checkpoints, compared on resume)."""

    def description(self) -> str:
        """The source's kind and settings, for messages."""

    def input_config(self, split: str) -> dict:
        """What the input pipeline's saved position records of the source ("data",
        "features"), which a restored pipeline must share."""

    def holds_out_nothing(self, split: str) -> bool:
        """Whether the user left `split` out on purpose (files.validation=0): a run then
        evaluates nothing."""

    def check_loss_fraction(self, split: str = "train") -> None:
        """Says when a run starts with an implausible share of tokens carrying loss."""


class Streams:
    """Given streams as a source: every split is them (tests and benchmarks)."""

    splits = ("train", "validation", "test")

    def __init__(self, streams: list[Stream]):
        self._streams = list(streams)

    def check_split(self, split: str) -> str:
        if split not in self.splits:
            raise DataError(f"unknown split {split!r}; valid splits: {', '.join(self.splits)}")
        return split

    def num_examples(self, split: str) -> int:
        return sum(len(s.records) for s in self.streams(split))

    def streams(self, split: str) -> list[Stream]:
        self.check_split(split)
        return self._streams

    def fingerprint(self) -> str:
        return "; ".join(s.fingerprint or s.name for s in self._streams)

    def description(self) -> str:
        return f"Streams({', '.join(s.name for s in self._streams)})"

    def input_config(self, split: str) -> dict:
        return stream_config(self.streams(split))

    def holds_out_nothing(self, split: str) -> bool:
        return False

    def check_loss_fraction(self, split: str = "train") -> None:
        pass


def stream_config(streams: list[Stream]) -> dict:
    """`DataSource.input_config` of a source of streams: each one's fingerprint and format."""
    return {"data": [s.fingerprint or s.name for s in streams],
            "features": [s.format.describe() for s in streams]}
