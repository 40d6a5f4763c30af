"""Trim and pack: several short examples share one fixed-length row, as in Mesh-TF and T5.

Input: a dataset of dicts holding, for each key, a 1-D int32 token sequence (EOS already
appended). Output: dicts holding, for each key `k`, three int32 tensors of shape [length]:

    k               the tokens of the packed examples, one after the other, 0-padded
    k_segment_ids   1 for the first example of the row, 2 for the second, ...; 0 on padding
    k_positions     0, 1, 2, ... restarting at every example; 0 on padding

Example:  targets [7 8 1], [5 1], [9 9 9 1] with length 8 gives the rows
    targets              [7 8 1 5 1 0 0 0]   [9 9 9 1 0 0 0 0]
    targets_segment_ids  [1 1 1 2 2 0 0 0]   [1 1 1 1 0 0 0 0]
    targets_positions    [0 1 2 0 1 0 0 0]   [0 1 2 3 0 0 0 0]

Several keys are packed together (translation packs "inputs" and "targets"): example i of
a row is segment i in every key, and an example joins the current row only if all its
sequences fit. Examples longer than `length` are trimmed first.

Packing is greedy over windows of `window` consecutive examples: each example goes into
the current row if it fits, else starts a new row; the last row of a window is emitted even
if not full. A window is packed by one call of plain numpy (`pack_arrays`), a pure function
of the window: the pipeline (pipeline.py) maps it over windows as a Grain transform, so
the rows of window w of a stream can be made again from w alone (exact resume).
"""

import numpy as np


def pack_arrays(arrays: list[np.ndarray], length: int) -> list[np.ndarray]:
    """Trims and packs a window of examples given as flat token arrays.

    `arrays` is (values, row_splits) for each key: example i of that key is
    values[row_splits[i]:row_splits[i + 1]]. Returns (tokens, segment_ids, positions) for
    each key, each [rows, length].
    """
    values, row_splits = arrays[0::2], arrays[1::2]
    lengths = np.stack([np.minimum(np.diff(splits), length) for splits in row_splits], axis=1)
    row, start = next_fit(lengths, length)
    num_examples, num_rows = len(row), (row[-1] + 1 if len(row) else 0)
    # Segment id of an example: 1 + its index minus the index of its row's first example.
    starts_row = np.ones(num_examples, bool)
    starts_row[1:] = row[1:] != row[:-1]
    segment = np.arange(num_examples) - np.flatnonzero(starts_row)[row] + 1

    packed = []
    for k, (key_values, splits) in enumerate(zip(values, row_splits)):
        kept = lengths[:, k]  # tokens kept of each example after trimming
        example = np.repeat(np.arange(num_examples), kept)  # the example of each kept token
        position = np.arange(len(example)) - (np.cumsum(kept) - kept)[example]
        where = row[example], start[example, k] + position  # its (row, column) when packed
        tokens, segment_ids, positions = (np.zeros((num_rows, length), np.int32)
                                          for _ in range(3))
        tokens[where] = key_values[splits[example] + position]
        segment_ids[where] = segment[example]
        positions[where] = position
        packed += [tokens, segment_ids, positions]
    return packed


def next_fit(lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy next-fit of examples with lengths [n, keys] into rows of `length`.

    Each example joins the current row if all its keys fit, else starts a new row. Returns
    `row` [n] (0, 0, 1, 1, 1, 2, ...) and `start` [n, keys], the column where each of the
    example's sequences begins in its row.
    """
    row = np.zeros(len(lengths), np.int32)
    start = np.zeros(lengths.shape, np.int32)
    current, used = -1, None
    for i, example_lengths in enumerate(lengths.tolist()):
        if used is None or any(u + n > length for u, n in zip(used, example_lengths)):
            current, used = current + 1, [0] * len(example_lengths)
        row[i] = current
        start[i] = used
        used = [u + n for u, n in zip(used, example_lengths)]
    return row, start
