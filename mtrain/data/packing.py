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
if not full. Deterministic; the only Python (a `tf.numpy_function` choosing each example's
row) is a pure function, so an iterator over a packed dataset can be checkpointed with
`tf.data.Options.experimental_external_state_policy = IGNORE` (see pipeline.py).
"""

import numpy as np
import tensorflow as tf


def trim_and_pack(dataset: tf.data.Dataset, keys: tuple[str, ...], length: int,
                  window: int = 256) -> tf.data.Dataset:
    """Trims every example's `keys` to `length` tokens and packs them into rows of `length`.

    Examples are packed `window` at a time; all the work is done on whole windows, so
    tf.data runs no function per example.
    """
    keys = tuple(keys)
    dataset = dataset.ragged_batch(window)
    dataset = dataset.map(no_autograph(lambda batch: pack_batch(batch, keys, length)))
    return dataset.unbatch()


# Functions given to tf.data are plain TensorFlow code: skipping AutoGraph's source
# rewriting saves about a second per function traced.
no_autograph = tf.autograph.experimental.do_not_convert


@no_autograph
def pack_batch(batch: dict[str, tf.RaggedTensor], keys: tuple[str, ...],
               length: int) -> dict[str, tf.Tensor]:
    """Trims and packs a batch of examples given as one ragged [n, (tokens)] tensor per key.

    Returns, per key, the three [rows, length] tensors described in the module docstring.
    """
    batch = {k: _as_ragged(batch[k])[:, :length] for k in keys}
    lengths = tf.stack([tf.cast(batch[k].row_lengths(), tf.int32) for k in keys], axis=1)
    row, start = _assign_rows(lengths, length)
    num_rows = tf.reduce_max(tf.concat([row + 1, [0]], axis=0))
    # Segment id of an example: 1 + its index minus the index of its row's first example.
    index = tf.range(tf.shape(row)[0])
    first_in_row = tf.math.unsorted_segment_min(index, row, num_rows)
    segment = index - tf.gather(first_in_row, row) + 1

    packed = {}
    for key_index, k in enumerate(keys):
        tokens = batch[k]
        example = tf.cast(tokens.value_rowids(), tf.int32)  # example of each token
        position = tf.range(tf.shape(tokens.values)[0]) - tf.gather(
            tf.cast(tokens.row_splits, tf.int32), example)
        column = tf.gather(start[:, key_index], example) + position
        where = tf.stack([tf.gather(row, example), column], axis=1)
        shape = tf.stack([num_rows, length])
        packed[k] = tf.scatter_nd(where, tf.cast(tokens.values, tf.int32), shape)
        packed[f"{k}_segment_ids"] = tf.scatter_nd(where, tf.gather(segment, example), shape)
        packed[f"{k}_positions"] = tf.scatter_nd(where, position, shape)
    for value in packed.values():
        value.set_shape([None, length])
    return packed


def _as_ragged(tokens: tf.Tensor | tf.RaggedTensor) -> tf.RaggedTensor:
    """ragged_batch gives a dense tensor when every example has the same static shape."""
    if isinstance(tokens, tf.RaggedTensor):
        return tokens
    return tf.RaggedTensor.from_tensor(tokens)


def _assign_rows(lengths: tf.Tensor, length: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Greedy next-fit: for example lengths [n, keys], each example's row and start columns.

    Returns `row` [n] (0, 0, 1, 1, 1, 2, ...) and `start` [n, keys], the column where each
    of the example's sequences begins in its row. The loop over examples is plain Python
    (a tf.while_loop costs ~100x more per step); it is a pure function of its input.
    """
    row, start = tf.numpy_function(
        lambda x: next_fit(x, length), [lengths], [tf.int32, tf.int32], stateful=False)
    row.set_shape([None])
    start.set_shape(lengths.shape)
    return row, start


def next_fit(lengths: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy side of `_assign_rows`: each example joins the current row if all its keys fit."""
    row = np.zeros(len(lengths), np.int32)
    start = np.zeros_like(lengths, dtype=np.int32)
    current, used = -1, None
    for i, example_lengths in enumerate(lengths.tolist()):
        if used is None or any(u + n > length for u, n in zip(used, example_lengths)):
            current, used = current + 1, [0] * len(example_lengths)
        row[i] = current
        start[i] = used
        used = [u + n for u, n in zip(used, example_lengths)]
    return row, start
