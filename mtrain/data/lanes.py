"""Lanes: the endless streams of packed rows that training batches are made of.

Row r of every global batch of B rows is lane r. With one source, lane r is shard r of B of
the split (every B-th example from r on), shuffled anew every epoch by Grain (seed
`lane_seed(seed, r)`, plus e in epoch e), cut into windows of `window` examples, each window
read at once, encoded by its format (one tokenizer call per packed key: `formats`), cut to
the sequence length and packed (packing.py) by a Grain map. So window w of lane r is a pure
function of (r, w), read by index: a lane's position is (window w, row k), and the rows from
there on can be made again from it alone. `LaneRows` takes one row of each of several lanes
per step (pipeline.py batches them).

A mixture of several sources with weights (seqio's and Grain's sense: each example drawn
from a source by weight) keeps that property. Lane r has one stream per source (its shard r
of B, shuffled every epoch, as above), and the slots of the lane's examples follow a fixed
pattern of `PERIOD` slots in which source s has round(PERIOD x weight) slots, spread evenly
(`Mixture`): slot j takes the next example of source ``pattern[j % PERIOD]``, whose
position in that source's stream is known in closed form. So window w (slots [wW, (w+1)W),
in an order shuffled by (seed, r, w)) is still a pure function of (r, w): the position of
every source at any lane position is computed, saved with the input state for the record,
and the realised proportions are the weights to within 1/PERIOD.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from mtrain.data import packing, ragged
from mtrain.data.sources import read
from mtrain.data.streams import Stream
from mtrain.data.vocabulary import Vocabulary
from mtrain.errors import DataError
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS, batch_keys

Rows = dict[str, np.ndarray]  # batch key -> [rows, sequence_length] int32
PERIOD = 1000  # slots in a mixture's pattern: weights count in thousandths
_HUGE = 2**62  # the number of windows of an endless lane


def lane_seed(seed: int, lane: int, *more: int) -> int:
    """The shuffle seed of one lane: a hash of (seed, lane), the same for any process count
    (`more`: of one source of a mixture, and of a window's order)."""
    return int(np.random.SeedSequence([seed, lane, *more]).generate_state(1, np.uint32)[0])


class PackWindow:
    """The Grain map of a window of example indices to its packed rows. The indices count
    through the streams one after the other (those of stream s start at `offsets[s]`); each
    stream's examples are read at once and encoded by its format, then cut and packed.
    `with_inputs`: the rows carry the fine-tuning keys (`formats.pieces`)."""

    def __init__(self, streams: list[Stream], vocab: Vocabulary, length: int, *,
                 start_id: int = 0, with_inputs: bool = False):
        self.streams, self.vocab, self.length = list(streams), vocab, length
        self.start_id, self.with_inputs = start_id, with_inputs
        self.offsets = ragged.row_splits([len(s.records) for s in self.streams])
        self.keys = ["targets"] if self.streams[0].format.kind == "lm" else ["inputs", "targets"]
        # (a task's sources are all of one kind: `tasks.task`; their rows as the first's)
        self.format = self.streams[0].format

    @property
    def size(self) -> int:
        return int(self.offsets[-1])

    def __call__(self, indices: np.ndarray) -> Rows:
        indices = np.asarray(indices, np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        parts, where = [], []
        for s in np.unique(which):
            stream, mine = self.streams[s], np.flatnonzero(which == s)
            examples = read(stream.records, (indices[mine] - self.offsets[s]).tolist())
            encoded = stream.format.encode(examples, self.vocab)
            keys, example = stream.format.pieces(encoded, self.length, start_id=self.start_id,
                                                 with_inputs=self.with_inputs)
            parts.append(keys)
            where.append(mine[example])
        keys = ragged.concat(parts) if len(parts) > 1 else parts[0]
        if len(parts) > 1:  # the pieces in the window's order
            keys = ragged.take(keys, np.argsort(np.concatenate(where), kind="stable"))
        arrays = [a for key in self.keys for a in keys[key]]
        aligned = [k for k in (READ_INPUTS, LOSS_WEIGHTS) if k in keys]
        packed = packing.pack_arrays(arrays, self.length, tuple(keys[k][0] for k in aligned))
        return self.format.rows(dict(zip(batch_keys(self.keys) + aligned, packed)))


class Mixture:
    """The pattern of a mixture's slots (module doc): `weights` normalised, each source's
    slots per `PERIOD`, and how many of each come before any slot."""

    def __init__(self, weights: Sequence[float]):
        total = float(sum(weights))
        quotas = np.asarray(weights, np.float64) / total * PERIOD
        counts = np.floor(quotas).astype(np.int64)
        for s in np.argsort(-(quotas - counts), kind="stable")[:PERIOD - counts.sum()]:
            counts[s] += 1  # largest remainders
        if (counts == 0).any():
            raise DataError(f"a mixture weight is below 1/{PERIOD} of the total: "
                            f"{list(weights)}")
        self.counts = counts
        keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts])
        sources = np.concatenate([np.full(c, s) for s, c in enumerate(counts)])
        self.pattern = sources[np.argsort(keys, kind="stable")]
        self.before = np.zeros((PERIOD + 1, len(counts)), np.int64)
        np.cumsum(np.eye(len(counts), dtype=np.int64)[self.pattern], axis=0, out=self.before[1:])

    def taken(self, slots: np.ndarray | int) -> np.ndarray:
        """How many examples of each source the first `slots` slots take ([..., sources])."""
        slots = np.asarray(slots, np.int64)
        return (slots // PERIOD)[..., None] * self.counts + self.before[slots % PERIOD]


class MixedWindow:
    """Window w of one lane of a mixture -> the global indices (`PackWindow`) of its
    examples: slot j takes example taken_s(j) of source s = pattern[j % PERIOD]."""

    def __init__(self, mixture: Mixture, streams: list[grain.MapDataset], offsets,
                 window: int, seed: int):
        self.mixture, self.streams, self.offsets = mixture, streams, offsets
        self.window, self.seed = window, seed

    def __call__(self, w: int) -> np.ndarray:
        slots = np.arange(w * self.window, (w + 1) * self.window)
        source = self.mixture.pattern[slots % PERIOD]
        k = self.mixture.taken(slots)[np.arange(len(slots)), source]
        indices = np.array([self.offsets[s] + self.streams[s][int(i)]
                            for s, i in zip(source, k)], np.int64)
        return np.random.default_rng(lane_seed(self.seed, w)).permutation(indices)


def lane_windows(sizes: Sequence[int], lane: int, lanes: int, seed: int, window: int,
                 pack: PackWindow, mixture: Mixture | None = None) -> grain.MapDataset:
    """Lane `lane` of `lanes` over streams of `sizes` examples as a Grain MapDataset: window
    w -> its packed rows. A stream's examples in the lane are every `lanes`-th from `lane`
    on, shuffled anew every epoch; with one stream Grain shuffles their indices, and each
    window reads its examples at once; a `mixture` takes them by its pattern. (Every
    stream has an example for every lane: `pipeline.batches` checks it.)"""
    def stream(s: int, size: int) -> grain.MapDataset:
        more = () if mixture is None else (s + 1,)
        return (grain.MapDataset.range(lane, size, lanes)
                .shuffle(seed=lane_seed(seed, lane, *more)).repeat())  # reshuffled every epoch

    if mixture is None:
        return stream(0, sizes[0]).batch(window).map(pack)
    streams = [stream(s, size) for s, size in enumerate(sizes)]
    return grain.MapDataset.range(_HUGE).map(
        MixedWindow(mixture, streams, pack.offsets, window, lane_seed(seed, lane, 0))).map(pack)


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
