"""Trim and pack: several short examples share one fixed-length row, as in Mesh-TF and T5.

Input: a dataset of dicts holding, for each key, a 1-D int32 token sequence (EOS already
appended). Output: dicts holding, for each key `k`, three int32 tensors of shape [length]:

    k               the tokens of the packed examples, one after the other, 0-padded
    k_segment_ids   1 for the first example of the row, 2 for the second, ...; 0 on padding
    k_positions     0, 1, 2, ... restarting at every example; 0 on padding

Example:  targets [7 8 1], [9 9 9 9 9 1], [5 1] with length 8 gives the rows
    targets              [7 8 1 5 1 0 0 0]   [9 9 9 9 9 1 0 0]
    targets_segment_ids  [1 1 1 2 2 0 0 0]   [1 1 1 1 1 1 0 0]
    targets_positions    [0 1 2 0 1 0 0 0]   [0 1 2 3 4 5 0 0]

Several keys are packed together (translation packs "inputs" and "targets"): example i of
a row is segment i in every key, and an example joins a row only if all its sequences fit.
Examples longer than `length` are trimmed first.

Packing is first-fit over windows of `window` consecutive examples: each example, in
order, goes into the first row of the window with room for it, else starts a new row; the
examples of a row keep their order. A window is packed by one call of plain numpy
(`pack_arrays`), a pure function of the window: the pipeline maps it over windows as a
Grain transform (lanes.py), so the rows of window w of a stream can be made again from w
alone (exact resume). On lm1b at length 128, windows of 256 are 95% real tokens where
next-fit (a new row whenever the current one is full) made 84%; Grain's own
FirstFitPackIterDataset packs as densely but ~50x slower per example, and its state is
that of a stream, not of a window (README, "Datasets").
"""

import numpy as np

from mtrain.data import ragged


def pack_arrays(arrays: list[np.ndarray], length: int,
                aligned: tuple[np.ndarray, ...] = ()) -> list[np.ndarray]:
    """Trims and packs a window of examples given as flat token arrays.

    `arrays` is (values, row_splits) for each key: example i of that key is
    values[row_splits[i]:row_splits[i + 1]]. Returns (tokens, segment_ids, positions) for
    each key, each [rows, length], then each of `aligned` (values that share the first key's
    row splits: a target's loss weight, the token read before it) packed as its tokens are.
    """
    values, row_splits = arrays[0::2], arrays[1::2]
    lengths = np.stack([np.minimum(np.diff(splits), length) for splits in row_splits], axis=1)
    row, start = first_fit(lengths, length)
    num_examples, num_rows = len(row), (int(row.max()) + 1 if len(row) else 0)
    # Segment id of an example: 1 + the number of earlier examples in its row.
    order = np.argsort(row, kind="stable")
    by_row = row[order]
    segment = np.empty(num_examples, np.int32)
    segment[order] = np.arange(num_examples) - np.searchsorted(by_row, by_row) + 1

    packed, packed_aligned = [], []
    for k, (key_values, splits) in enumerate(zip(values, row_splits)):
        kept = lengths[:, k]  # tokens kept of each example after trimming
        example = np.repeat(np.arange(num_examples), kept)  # the example of each kept token
        position = np.arange(len(example)) - ragged.row_splits(kept)[:-1][example]
        where = row[example], start[example, k] + position  # its (row, column) when packed
        tokens, segment_ids, positions = (np.zeros((num_rows, length), np.int32)
                                          for _ in range(3))
        tokens[where] = key_values[splits[example] + position]
        segment_ids[where] = segment[example]
        positions[where] = position
        packed += [tokens, segment_ids, positions]
        if k == 0:
            for extra in aligned:
                row_values = np.zeros((num_rows, length), np.int32)
                row_values[where] = extra[splits[example] + position]
                packed_aligned.append(row_values)
    return packed + packed_aligned


def first_fit(lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit of examples with lengths [n, keys] into rows of `length`.

    Each example, in order, joins the first row where all its keys fit, else starts a new
    row. Returns `row` [n] (the row of each example, numbered in the order they were
    started) and `start` [n, keys], the column where each of the example's sequences
    begins in its row.
    """
    row = np.zeros(len(lengths), np.int32)
    start = np.zeros(lengths.shape, np.int32)
    keys = lengths.shape[1]
    room: list[list[int]] = []  # the free room of each row, per key
    open_rows: list[int] = []  # the rows that may still take an example, in order
    shortest = lengths.min(axis=0).tolist() if len(lengths) else []
    for i, example in enumerate(lengths.tolist()):
        if keys == 1:  # (the language models': one comparison of ints per row)
            n = example[0]
            r = next((r for r in open_rows if room[r][0] >= n), None)
        else:
            r = next((r for r in open_rows
                      if all(f >= n for f, n in zip(room[r], example))), None)
        if r is None:
            r = len(room)
            room.append([length] * keys)
            open_rows.append(r)
        row[i] = r
        start[i] = [length - f for f in room[r]]
        room[r] = [f - n for f, n in zip(room[r], example)]
        if any(f < n for f, n in zip(room[r], shortest)):
            open_rows.remove(r)  # no example of the window fits it any more
    return row, start
