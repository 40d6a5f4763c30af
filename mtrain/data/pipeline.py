"""Batches for training and evaluation: tokenise, append EOS, trim, pack, batch.

    batches = lm_batches(BibleLM("en"), vocab, "train", sequence_length=128,
                         batch_size=32, seed=0, train=True)
    batch = next(batches)   # {"targets", "targets_segment_ids", "targets_positions"}

`batches(source, vocab, split, {"inputs": "en", "targets": "fr"}, ...)` packs translation
pairs: inputs and targets of an example are segment i of the same row in both keys.
    batches.save(directory); ...; batches.restore(directory)

Every batch is a dict of int32 numpy arrays of shape [batch_size // shard count,
sequence_length] (see packing.py for the three arrays of each key).

**The global batch does not depend on the number of processes.** Training uses "lanes":
row r of every global batch (r = 0 .. B-1) is its own endless stream, made from shard r of
B of the split (`source.shuffled_dataset`: reshuffled every epoch with a seed derived from
(seed, r)), tokenised and packed. The process feeding shard i of n of the batch (the
process whose devices hold those rows) builds only its lanes, rows [i*B/n, (i+1)*B/n), and
takes one row from each in turn, so it reads and tokenises only its share and yields
exactly its rows of the batch that a single process would have made.

Evaluation makes one deterministic pass over the split: examples in order, packed, batched
by batch_size, the last batch filled up with all-zero rows, so every held-out token is seen
exactly once. To give every process the same number of batches without talking to the
others, each process tokenises and packs the whole (small) held-out split and keeps its
rows of each global batch.

Cost: the tokenising, trimming and packing of a window of `window` examples of a lane is a
single tf.data map making two `tf.numpy_function` calls: one SentencePiece call over all
`window` strings, and the packer (packing.py). Nothing runs per example in a tf.data
function.

Resuming: `BatchIterator.save` / `restore` checkpoint the tf.data iterator. Lanes shuffle
without buffers, so a checkpoint holds positions and a few prefetched batches (~50 kB). A
run resumed with a different number of processes cannot use another process's tf.data
state; it fast-forwards instead: after n batches every lane has given exactly n rows, so
skipping n rows of each lane continues exactly where the saved run was.
"""

import functools
import json
import os
from typing import Iterator

import numpy as np
import tensorflow as tf
from etils import epath

from mtrain.data import packing
from mtrain.data.packing import no_autograph
from mtrain.data.sources import TextSource
from mtrain.errors import DataError, IncompatibleRun
from mtrain.io.textfiles import write_atomically
from mtrain.data.vocabulary import Vocabulary

LM_FEATURES = {"targets": "text"}  # packed key <- source feature


def batches(source: TextSource, vocab: Vocabulary, split: str, features: dict[str, str],
            sequence_length: int, batch_size: int, seed: int = 0, *, train: bool,
            shard: tuple[int, int] = (0, 1), process: tuple[int, int] | None = None,
            window: int = 256) -> "BatchIterator":
    """Packed batches: for each packed key k of `features` (e.g. {"inputs": "en", "targets":
    "fr"}), the arrays k, k_segment_ids and k_positions.

    train=True: endless, shuffled by `seed`. train=False: one pass in order, the last batch
    padded with all-zero rows. `shard` (i, n): yield rows [i*B/n, (i+1)*B/n) of each global
    batch of B rows. `process` (p, P) names the state this iterator saves (default: as
    `shard`). See `make_dataset` for the other arguments.
    """
    def make(skip: int) -> tf.data.Dataset:
        return make_dataset(source, vocab, split, features, sequence_length, batch_size,
                            seed, train=train, shard=shard, window=window, skip=skip)

    config = dict(data=source.fingerprint(), split=split, features=features,
                  vocabulary=vocab.digest,
                  sequence_length=sequence_length, batch_size=batch_size, seed=seed,
                  train=train, window=window)
    return BatchIterator(make, shard, process or shard, config)


def lm_batches(source: TextSource, vocab: Vocabulary, split: str, sequence_length: int,
               batch_size: int, seed: int = 0, **kwargs) -> "BatchIterator":
    """Language-model batches {"targets", "targets_segment_ids", "targets_positions"} of a
    source with the feature "text"."""
    return batches(source, vocab, split, LM_FEATURES, sequence_length, batch_size, seed,
                   **kwargs)


def make_dataset(source: TextSource, vocab: Vocabulary, split: str, features: dict[str, str],
                 sequence_length: int, batch_size: int, seed: int = 0, *, train: bool,
                 shard: tuple[int, int] = (0, 1), window: int = 256,
                 skip: int = 0) -> tf.data.Dataset:
    """Shard `shard` = (i, n) of the batches as a tf.data.Dataset (see the module
    docstring), starting after the first `skip` batches.

    `features` maps each packed key to the source feature it is made from, e.g.
    {"targets": "text"} for language modelling, {"inputs": "en", "targets": "fr"} for
    translation. `window` is how many examples are tokenised and packed together.
    """
    index, count = shard
    if batch_size % count:
        raise DataError(f"batch_size {batch_size} is not divisible into {count} shards "
                        f"(one per process feeding its own rows)")
    if not 0 <= index < count:
        raise ValueError(f"shard {index} is not in [0, {count})")
    source.check_split(split)
    rows = batch_size // count
    first_row = index * rows
    pack = _tokenize_and_pack_fn(vocab, tuple(features.items()), sequence_length)

    if train:
        _check_enough_examples(source, split, batch_size)
        seeds = tf.constant([lane_seed(seed, lane) for lane in range(batch_size)], tf.int64)

        @no_autograph
        def lane_dataset(lane: tf.Tensor) -> tf.data.Dataset:
            """The endless stream of packed rows for row `lane` of every global batch."""
            dataset = source.shuffled_dataset(split, seeds[lane], shard=(lane, batch_size))
            return dataset.batch(window).map(pack).unbatch().skip(skip)

        # Take one row from each of this process's lanes in turn: a batch is rows
        # first_row, first_row + 1, ... of the global batch.
        lanes = tf.data.Dataset.range(first_row, first_row + rows)
        dataset = lanes.interleave(lane_dataset, cycle_length=rows, block_length=1)
        dataset = dataset.batch(rows)
    else:
        dataset = source.dataset(split).batch(window).map(pack).unbatch()
        dataset = dataset.batch(batch_size).map(
            no_autograph(lambda batch: _rows_of(_pad_rows(batch, batch_size), first_row, rows)))
        dataset = dataset.skip(skip)

    options = tf.data.Options()
    options.deterministic = True
    # Tokenising and packing call tf.numpy_function, which tf.data cannot see inside and so
    # treats as external state, refusing to checkpoint the iterator. Ignoring that is safe:
    # both are pure functions of their inputs (the SentencePiece model is fixed), so nothing
    # outside the checkpoint affects what the pipeline produces.
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return dataset.prefetch(2).with_options(options)


def _check_enough_examples(source: TextSource, split: str, batch_size: int) -> None:
    """Every lane needs at least one example, or training would stop at once."""
    size = source.num_examples(split)
    if size < batch_size:
        raise DataError(f"split {split!r} has {size} examples, fewer than the batch size "
                         f"{batch_size}: some batch rows would have nothing to train on")


def lane_seed(seed: int, lane: int) -> int:
    """The shuffle seed of one lane: a hash of (seed, lane), the same for any process count."""
    return int(np.random.SeedSequence([seed, lane]).generate_state(1, np.uint32)[0])


@functools.lru_cache(maxsize=16)
def _tokenize_and_pack_fn(vocab: Vocabulary, features: tuple[tuple[str, str], ...], length: int):
    """A tf.data map function: a batch of string examples -> packed rows [rows, length].

    `features` holds (packed key, source feature) pairs. The function is a tf.function with
    a fixed signature, so it is traced once and shared by every lane (and every pipeline
    with the same arguments) instead of being traced by each `map`.
    """
    features = dict(features)
    keys = tuple(features)
    signature = {feature: tf.TensorSpec([None], tf.string) for feature in features.values()}

    @tf.function(input_signature=[signature], autograph=False)
    def tokenize_and_pack(examples: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        tokens = {key: vocab.encode_tf(examples[feature], add_eos=True)
                  for key, feature in features.items()}
        return packing.pack_batch(tokens, keys, length)

    @no_autograph
    def map_fn(examples: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return tokenize_and_pack({feature: examples[feature] for feature in signature})

    return map_fn


def _pad_rows(batch: dict[str, tf.Tensor], batch_size: int) -> dict[str, tf.Tensor]:
    """Fills a short final batch up to batch_size rows with zeros."""
    def pad(x):
        padded = tf.pad(x, [[0, batch_size - tf.shape(x)[0]], [0, 0]])
        return tf.ensure_shape(padded, [batch_size, x.shape[1]])
    return {key: pad(x) for key, x in batch.items()}


def _rows_of(batch: dict[str, tf.Tensor], first_row: int, rows: int) -> dict[str, tf.Tensor]:
    return {key: x[first_row:first_row + rows] for key, x in batch.items()}


class BatchIterator:
    """Numpy batches from a tf.data pipeline, whose position can be saved and restored.

    A restored iterator yields exactly the batches the saved one would have yielded next.
    The state of process p of P is written under `directory` with the process in its name,
    so every process of a run can save into the same (e.g. the trainer's checkpoint)
    directory. `config` (JSON-able) describes the pipeline; it is saved with the state and
    the position (batches yielded), and restoring into a pipeline with a different config is
    an error. `make(skip)` builds the dataset from batch `skip` on.
    """

    def __init__(self, make, shard: tuple[int, int] = (0, 1),
                 process: tuple[int, int] = (0, 1), config: dict | None = None):
        self._make = make
        self.shard, self.process = tuple(shard), tuple(process)
        self.config = dict(config or {})
        self._start(0)

    def _start(self, position: int) -> None:
        self.start = self.position = position  # the dataset begins after `start` batches
        self.dataset = self._make(position)
        self._iterator = iter(self.dataset)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = {key: value.numpy() for key, value in next(self._iterator).items()}
        self.position += 1
        return batch

    def state_prefix(self, directory: str | os.PathLike, process=None) -> str:
        """Where a process's state lives: `directory/input_pipeline.process-p-of-P.*`."""
        p, count = process or self.process
        return os.path.join(os.fspath(directory), f"input_pipeline.process-{p}-of-{count}")

    def _saved(self) -> dict:
        return dict(self.config, shard=list(self.shard), position=self.position,
                    start=self.start)

    def save(self, directory: str | os.PathLike) -> str:
        """Writes this process's iterator state under `directory` (local or a bucket): the
        tf.data state as a serialized tensor in ``<prefix>.state``, the position and config
        in ``<prefix>.json``; returns the prefix."""
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
        prefix = self.state_prefix(directory)
        # What tf.train.Checkpoint saves of an iterator, as bytes, so that it is written like
        # every other file of a model dir (epath), not by TensorFlow's file system.
        state = self._iterator._serialize_to_tensors()["_STATE"]
        write_atomically(prefix + ".state", tf.io.serialize_tensor(state).numpy())
        write_atomically(prefix + ".json", json.dumps(self._saved(), indent=1, sort_keys=True))
        return prefix

    def restore(self, directory: str | os.PathLike) -> None:
        """Moves the iterator to the position saved under `directory` by `save`: from this
        process's saved tf.data state, or, when the run was saved by a different number of
        processes, by fast-forwarding to the saved position."""
        prefix = self.state_prefix(directory)
        saved_files = sorted(os.fspath(p) for p in
                             epath.Path(directory).glob("input_pipeline.*.json"))
        if not saved_files:
            raise DataError(f"no input pipeline state under {directory}")
        own = prefix + ".json"
        saved = json.loads(epath.Path(own if own in saved_files else saved_files[0]).read_text())
        position, start = saved.pop("position", None), saved.pop("start", 0)
        saved_shard = tuple(saved.pop("shard", ()))
        config = dict(self.config)
        if "data" not in saved:  # saved by an older mtrain, whose "source" was not canonical
            saved.pop("source", None)
            config.pop("data", None)
        differences = [f"{key}={saved.get(key)!r} there, {config.get(key)!r} here"
                       for key in sorted(saved.keys() | config.keys())
                       if saved.get(key) != config.get(key)]
        if differences:
            raise IncompatibleRun(f"the input pipeline state under {directory} was saved by "
                                  f"another pipeline: {'; '.join(differences)}")
        if own in saved_files and saved_shard == self.shard:
            if start != self.start:
                self._start(start)  # the saved state is of a dataset built to start there
            try:
                if epath.Path(prefix + ".state").exists():
                    state = tf.io.parse_tensor(epath.Path(prefix + ".state").read_bytes(),
                                               out_type=tf.variant)
                    self._iterator._restore_from_tensors({"_STATE": state})
                else:  # saved by an older mtrain, as a tf.train.Checkpoint
                    tf.train.Checkpoint(iterator=self._iterator).read(prefix).assert_consumed()
            except (tf.errors.OpError, AssertionError) as e:
                raise DataError(f"cannot restore the input pipeline from {prefix}: "
                                f"{type(e).__name__}") from None
            self.position = position
            return
        if position is None:
            raise DataError(f"the input pipeline state under {directory} has no position to "
                            f"fast-forward to")
        self._start(position)  # saved by another number of processes: skip to the position
