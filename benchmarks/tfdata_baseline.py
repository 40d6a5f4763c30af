"""The tf.data input pipeline that Grain replaced (mtrain fc8be58), kept as the baseline of
benchmarks/input_pipeline.py only: the same lanes (row r of every batch is shard r of B of
the split, reshuffled every epoch), windows of examples tokenised by one SentencePiece call
and packed by the same numpy packer, each inside a `tf.numpy_function`, the lanes
interleaved one row each. Its shuffle is TensorFlow's, so its batches hold other examples
than Grain's; the work per token is the same.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mtrain.data import packing
from mtrain.data.lanes import lane_seed
from mtrain.data.sources import read
from mtrain.models.base import batch_keys

no_autograph = tf.autograph.experimental.do_not_convert


def train_dataset(source, vocab, split: str, features: dict[str, str], length: int,
                  batch_size: int, seed: int = 0, window: int = 256,
                  block: int = 256) -> tf.data.Dataset:
    """The training batches of one process (all rows), as fc8be58's `make_dataset` made them."""
    records, names = source.records(split), tuple(features.values())
    size = len(records)

    def gather(indices: np.ndarray) -> list[np.ndarray]:
        examples = read(records, indices.tolist())  # a block at once, as fc8be58 did
        return [np.array([x[name].encode() for x in examples], dtype=object) for name in names]

    def tokenize_and_pack(*columns: np.ndarray) -> list[np.ndarray]:
        arrays = []
        for column in columns:
            arrays += vocab.encode_batch([s.decode() for s in column], add_eos=True)
        return packing.pack_arrays(arrays, length)

    seeds = tf.constant([lane_seed(seed, lane) for lane in range(batch_size)], tf.int64)

    @no_autograph
    def lane_dataset(lane: tf.Tensor) -> tf.data.Dataset:
        indices = tf.range(lane, size, batch_size, dtype=tf.int64)

        @no_autograph
        def epoch(e):
            order = tf.random.experimental.stateless_shuffle(
                indices, seed=tf.stack([seeds[lane], e]), alg="philox")
            return tf.data.Dataset.from_tensor_slices(order)

        @no_autograph
        def fetch(block_indices):
            columns = tf.numpy_function(gather, [block_indices], [tf.string] * len(names),
                                        stateful=False)
            return tuple(tf.ensure_shape(c, [None]) for c in tf.nest.flatten(columns))

        @no_autograph
        def pack(*columns):
            packed = tf.numpy_function(tokenize_and_pack, columns, [tf.int32] * 3 * len(names),
                                       stateful=False)
            return {k: tf.ensure_shape(v, [None, length])
                    for k, v in zip(batch_keys(features), packed)}

        examples = (tf.data.Dataset.range(2**62).flat_map(epoch).batch(block).map(fetch)
                    .unbatch())
        return examples.batch(window).map(pack).unbatch()

    lanes = tf.data.Dataset.range(batch_size)
    dataset = lanes.interleave(lane_dataset, cycle_length=batch_size, block_length=1)
    options = tf.data.Options()
    options.deterministic = True
    return dataset.batch(batch_size).prefetch(2).with_options(options)
