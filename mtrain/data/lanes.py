"""Lanes: the endless streams of packed rows that training batches are made of.

Row r of every global batch of B rows is lane r: shard r of B of the split (every B-th
example from r on), shuffled anew every epoch by Grain (seed `lane_seed(seed, r)`, plus e in
epoch e), cut into windows of `window` examples, each window read at once, tokenised (one
SentencePiece call per packed key) and packed (packing.py) by a Grain map. So window w of
lane r is a pure function of (r, w), read by index: a lane's position is (window w, row k),
and the rows from there on can be made again from it alone. `LaneRows` takes one row of
each of several lanes per step (pipeline.py batches them).
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from mtrain.data import packing
from mtrain.data.sources import Example, read
from mtrain.data.vocabulary import Vocabulary
from mtrain.models.base import batch_keys

Rows = dict[str, np.ndarray]  # batch key -> [rows, sequence_length] int32


def lane_seed(seed: int, lane: int) -> int:
    """The shuffle seed of one lane: a hash of (seed, lane), the same for any process count."""
    return int(np.random.SeedSequence([seed, lane]).generate_state(1, np.uint32)[0])


class PackWindow:
    """The Grain map of a window of example indices to its packed rows: one read of the
    examples, one SentencePiece call per packed key, then packing.pack_arrays."""

    def __init__(self, records: Sequence[Example], vocab: Vocabulary,
                 features: dict[str, str], length: int):
        self.records, self.vocab = records, vocab
        self.features, self.length = dict(features), length

    def __call__(self, indices: np.ndarray) -> Rows:
        examples = read(self.records, indices.tolist())
        arrays = []
        for feature in self.features.values():
            arrays += self.vocab.encode_batch([x[feature] for x in examples], add_eos=True)
        return dict(zip(batch_keys(self.features), packing.pack_arrays(arrays, self.length)))


def lane_windows(size: int, lane: int, lanes: int, seed: int, window: int,
                 pack: PackWindow) -> grain.MapDataset:
    """Lane `lane` of `lanes` over a split of `size` examples as a Grain MapDataset: window
    w -> its packed rows. The lane's examples are every `lanes`-th from `lane` on, shuffled
    anew every epoch; Grain shuffles their indices, and each window reads its examples at
    once."""
    return (grain.MapDataset.range(lane, size, lanes)
            .shuffle(seed=lane_seed(seed, lane)).repeat()  # reshuffled every epoch
            .batch(window).map(pack))


class LaneRows(grain.IterDataset):
    """The rows of several lanes, one from each per step: each element is (lanes, their
    positions (window, row) when the rows were taken, the rows stacked [lanes, length]).

    `lanes` is [(lane, its windows)], `positions` {lane: (window, row)} where each starts.
    Grain's `mp_prefetch` gives each worker a slice of the lanes (`set_slice`).
    """

    def __init__(self, lanes: list[tuple[int, grain.MapDataset]],
                 positions: dict[int, tuple[int, int]]):
        super().__init__()
        self._lanes, self._positions = list(lanes), dict(positions)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice  # lanes are independent streams: any slice of them will do
        self._lanes = self._lanes[sl]

    def __iter__(self) -> "_LaneRowsIterator":
        return _LaneRowsIterator(self._lanes, self._positions)


class _LaneRowsIterator(grain.DatasetIterator):
    def __init__(self, lanes, positions):
        super().__init__()
        self._lanes = lanes
        self._positions = {lane: tuple(positions[lane]) for lane, _ in lanes}
        self._windows: dict[int, tuple[int, Rows]] = {}  # lane -> (w, rows of window w)

    def __next__(self):
        taken, rows = [], []
        for lane, windows in self._lanes:
            w, k = self._positions[lane]
            while True:
                if lane not in self._windows or self._windows[lane][0] != w:
                    self._windows[lane] = (w, windows[w])
                if k < num_rows(self._windows[lane][1]):
                    break
                w, k = w + 1, 0  # window w is used up
            self._positions[lane] = (w, k + 1)
            taken.append((w, k))
            rows.append(self._windows[lane][1])
        stacked = {key: np.stack([r[key][k] for r, (_, k) in zip(rows, taken)])
                   for key in rows[0]}
        return [lane for lane, _ in self._lanes], taken, stacked

    def get_state(self) -> dict:
        return {"positions": [self._positions[lane] for lane, _ in self._lanes]}

    def set_state(self, state: dict) -> None:
        self._positions = {lane: tuple(p) for (lane, _), p in zip(self._lanes, state["positions"])}


def num_rows(rows: Rows) -> int:
    """The number of rows."""
    return len(next(iter(rows.values())))
