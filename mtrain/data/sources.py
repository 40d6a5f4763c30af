"""Text corpora: named splits of examples whose features are strings, read by index.

A source gives, for a split name ("train", "validation", "test"), the number of examples and
random access to them (`gather`: a batch of indices -> one tf.string tensor per feature).
Everything else is built on those two:

- `dataset(split, shard)`: the examples (or every `count`-th from `index` on) in order, for
  evaluation;
- `shuffled_dataset(split, seed, shard)`: the same examples endlessly, epoch e a permutation
  drawn from (seed, e) alone, for training. No shuffle buffer, so the state of an iterator is
  an epoch and a position: checkpoints stay tiny and every epoch is a uniform shuffle;
- `texts(split)`: the strings in plain Python, for training a vocabulary.

Features are named by the source: the Bible LM has "text", the Bible translation corpus
"inputs" and "targets", TFDS sources the dataset's own names (lm1b "text", wmt14 "en" and
"fr"). A task (tasks.py) says which feature is packed as inputs and which as targets.

The shipped corpus is the King James / Louis Segond Bible in `data/` (see data/README.md).
Its held-out splits are whole books, so no verse of a held-out book is ever trained on.
TFDS datasets (lm1b, wmt14) are `TfdsSource`s, prepared by the real TFDS builders
(tfds_prepare.py) and read by index from their array_record files.
"""

from __future__ import annotations

import abc
import hashlib
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from etils import epy

with epy.lazy_imports():  # TensorFlow (~2 s) only when a pipeline is built: not for plans
    import tensorflow as tf

from mtrain.data.bible import BIBLE_LANGUAGES, SPLITS, bible_column
from mtrain.errors import DataError

class TextSource(abc.ABC):
    """A corpus with named splits of string examples, read by index."""

    features: tuple[str, ...]  # names of the string features of every example
    splits: tuple[str, ...] = SPLITS
    block: int = 256  # examples fetched per `gather` call inside tf.data

    @abc.abstractmethod
    def num_examples(self, split: str) -> int:
        """The number of examples of a valid split."""

    @abc.abstractmethod
    def gather(self, split: str, indices: tf.Tensor) -> dict[str, tf.Tensor]:
        """Examples `indices` (1-D int64) of a valid split: one 1-D tf.string per feature.

        Called inside tf.data functions; must be deterministic.
        """

    def cache_dir(self, data_dir: str) -> str:
        """Where files derived from this source (vocabularies) are cached."""
        return data_dir

    def check_split(self, split: str) -> str:
        """Returns `split`, or raises a DataError naming the valid splits."""
        if split not in self.splits:
            raise DataError(
                f"unknown split {split!r} for {self.description()}; valid splits: "
                + ", ".join(self.splits)
            )
        return split

    def description(self) -> str:
        """The source's class and settings, e.g. "BibleLM(lang='en')"."""
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items())
                             if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"

    def fingerprint(self) -> str:
        """What decides the examples and their order, as plain text that is the same in
        every process and on every machine (saved with checkpoints, compared on resume)."""
        return self.description()

    def _indices(self, split: str, shard: tuple[int, int] | None) -> tf.Tensor:
        """The example indices of a split, or of shard `index` of `count`: every `count`-th
        example from `index` on. `index` may be a scalar tensor (one shard per batch row)."""
        size = self.num_examples(self.check_split(split))
        if shard is None:
            return tf.range(size, dtype=tf.int64)
        index, count = shard
        if isinstance(index, int) and not 0 <= index < count:
            raise ValueError(f"shard index {index} is not in [0, {count})")
        return tf.range(tf.cast(index, tf.int64), size, count, dtype=tf.int64)

    def _examples(self, split: str, indices: tf.Tensor | tf.data.Dataset) -> tf.data.Dataset:
        """The examples at `indices`, in that order, fetched `block` at a time."""
        if not isinstance(indices, tf.data.Dataset):
            indices = tf.data.Dataset.from_tensor_slices(indices)
        gather = tf.autograph.experimental.do_not_convert(
            lambda block: self.gather(split, block))
        return indices.batch(self.block).map(gather).unbatch()

    def dataset(self, split: str, shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        """The examples of `split` (or of one shard) in order, as dicts of tf.string scalars."""
        return self._examples(split, self._indices(split, shard))

    def shuffled_dataset(self, split: str, seed: int | tf.Tensor,
                         shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        """The examples of `split` (or of one shard) endlessly; epoch e is a permutation of
        them drawn from (seed, e) alone."""
        indices = self._indices(split, shard)
        size = tf.size(indices, out_type=tf.int64)
        # An empty shard would make the endless stream below spin forever: fail instead.
        with tf.control_dependencies([tf.debugging.assert_positive(
                size, message=f"{type(self).__name__}: empty shard of split {split!r}")]):
            indices = tf.identity(indices)
        seed = tf.cast(seed, tf.int64)

        @tf.autograph.experimental.do_not_convert
        def epoch(e: tf.Tensor) -> tf.data.Dataset:
            order = tf.random.experimental.stateless_shuffle(
                indices, seed=tf.stack([seed, e]), alg="philox")
            return tf.data.Dataset.from_tensor_slices(order)

        return self._examples(split, tf.data.Dataset.range(2**62).flat_map(epoch))

    def texts(self, split: str, limit: int | None = None) -> Iterator[str]:
        """Every string of every feature of the first `limit` examples of `split`, example by
        example (so a vocabulary trained on the first N strings sees every feature)."""
        for example in self.examples(split, limit):
            yield from example.values()

    def examples(self, split: str, limit: int | None = None) -> Iterator[dict[str, str]]:
        """The first `limit` examples of `split` in order, as dicts of Python strings."""
        size = self.num_examples(self.check_split(split))
        size = size if limit is None else min(size, limit)
        for start in range(0, size, 4096):
            block = self.gather(split, tf.range(start, min(start + 4096, size), dtype=tf.int64))
            columns = {name: block[name].numpy() for name in self.features}
            for i in range(len(columns[self.features[0]])):
                yield {name: values[i].decode("utf-8") for name, values in columns.items()}


class InMemorySource(TextSource):
    """A source small enough to hold in memory: subclasses return each split's columns."""

    @abc.abstractmethod
    def columns(self, split: str) -> dict[str, Sequence[str]]:
        """For a valid split, one sequence of strings per feature, all of the same length."""

    def num_examples(self, split: str) -> int:
        return len(self.columns(self.check_split(split))[self.features[0]])

    def gather(self, split: str, indices: tf.Tensor) -> dict[str, tf.Tensor]:
        return {name: tf.gather(values, indices) for name, values in self._tensors(split).items()}

    def _tensors(self, split: str) -> dict[str, tf.Tensor]:
        """The split's columns as tf.string tensors, made once per source and split.

        They are eager tensors even when asked for while tf.data traces a function, so that
        functions capture them instead of holding a copy (which makes iterators slow to
        start).
        """
        cache = self.__dict__.setdefault("_tensor_cache", {})
        if split not in cache:
            with tf.init_scope():
                cache[split] = {name: tf.constant(values, tf.string, shape=[len(values)])
                                for name, values in self.columns(split).items()}
        return cache[split]

    def texts(self, split: str, limit: int | None = None) -> Iterator[str]:
        columns = self.columns(self.check_split(split))
        for strings in zip(*(columns[name][:limit] for name in self.features)):
            yield from strings


def _check_language(language: str) -> str:
    if language not in BIBLE_LANGUAGES:
        raise DataError(f"the Bible corpus has languages {BIBLE_LANGUAGES}, not {language!r}")
    return language


class BibleLM(InMemorySource):
    """Language modelling on one language of the shipped Bible: feature "text", one verse each."""

    features = ("text",)

    def __init__(self, lang: str = "en"):
        self.lang = _check_language(lang)

    def columns(self, split: str) -> dict[str, Sequence[str]]:
        return {"text": bible_column(split, self.lang)}


class BibleTranslation(InMemorySource):
    """Verse-by-verse translation on the shipped Bible: features "inputs" and "targets"."""

    features = ("inputs", "targets")

    def __init__(self, source: str = "en", target: str = "fr"):
        self.source = _check_language(source)
        self.target = _check_language(target)

    def columns(self, split: str) -> dict[str, Sequence[str]]:
        return {"inputs": bible_column(split, self.source),
                "targets": bible_column(split, self.target)}


SHIPPED = "shipped"  # run.data_source value: raw files made from the shipped corpus


def tfds_data_dir(data_dir: str, data_source: str | None) -> Path:
    """Where a TFDS dataset is prepared: one TFDS data dir per origin of the raw files, so
    that a dataset built from local files is never mistaken for the one from the web."""
    if data_source is None:
        return Path(data_dir) / "tfds"
    if data_source == SHIPPED:
        return Path(data_dir) / "tfds_shipped"
    origin = Path(data_source).expanduser().resolve()
    digest = hashlib.sha1(str(origin).encode()).hexdigest()[:8]
    return Path(data_dir) / "tfds_local" / f"{origin.name}-{digest}"


def _shipped_raw_tree(name: str, data_dir: str) -> str:
    """Raw files laid out as `name`'s official archives, made once from the shipped corpus."""
    from mtrain.data import make_offline

    tree = make_offline.tree_for(name)
    if tree is None:
        raise DataError(f"run.data_source='{SHIPPED}': no shipped raw files for {name}")
    dataset = name.split("/")[0].split(":")[0]
    root = Path(data_dir) / "raw" / dataset
    if not root.exists():
        print(f"writing {dataset} raw files from the shipped corpus -> {root}",
              file=sys.stderr, flush=True)
        make_offline.TREES[tree].write(root)
    return str(root)


class TfdsSource(TextSource):
    """A TFDS dataset prepared by its real builder (tfds_prepare.py), read by index.

    `data_source` None downloads as usual; a directory runs the builder on raw files laid
    out as the official archives; 'shipped' makes those from the shipped corpus first. The
    dataset is prepared once, as array_record files, which give random access.
    """

    def __init__(self, name: str, data_dir: str, data_source: str | None = None):
        from mtrain.data import tfds_prepare  # imports tensorflow_datasets only when needed

        self.name = name
        self.data_source = data_source
        self._dir = tfds_data_dir(data_dir, data_source)
        raw = _shipped_raw_tree(name, data_dir) if data_source == SHIPPED else data_source
        self._builder = tfds_prepare.prepare(name, str(self._dir), raw)
        self.features = tuple(self._builder.info.features.keys())
        self.splits = tuple(str(split) for split in self._builder.info.splits.keys())
        self._readers = {}

    def cache_dir(self, data_dir: str) -> str:
        return str(self._dir / "mtrain")  # beside the prepared dataset, as it depends on it

    def description(self) -> str:
        return f"TfdsSource(name={self.name!r}, data_source={self.data_source!r})"

    def fingerprint(self) -> str:
        """The dataset, where its raw files came from (the web, the shipped corpus, local
        files wherever they lie) and the size of each split."""
        origin = {None: "the web", SHIPPED: "the shipped corpus"}.get(self.data_source,
                                                                       "local raw files")
        sizes = ", ".join(f"{split} {self.num_examples(split)}" for split in sorted(self.splits))
        return f"TFDS {self.name} from {origin} ({sizes} examples)"

    def num_examples(self, split: str) -> int:
        return self._builder.info.splits[self.check_split(split)].num_examples

    def _reader(self, split: str):
        if split not in self._readers:
            self._readers[split] = self._builder.as_data_source(split=self.check_split(split))
        return self._readers[split]

    def gather(self, split: str, indices: tf.Tensor) -> dict[str, tf.Tensor]:
        reader, features = self._reader(split), self.features

        def fetch(index_array: np.ndarray) -> list[np.ndarray]:
            examples = reader.__getitems__(index_array.tolist())
            return [np.array([_as_bytes(example[name]) for example in examples], dtype=object)
                    for name in features]

        columns = tf.nest.flatten(  # one feature comes back as a tensor, not a list
            tf.numpy_function(fetch, [indices], [tf.string] * len(features), stateful=False))
        for column in columns:
            column.set_shape([None])
        return dict(zip(features, columns))


def _as_bytes(value) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)
