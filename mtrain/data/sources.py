"""Text corpora: named splits of examples whose features are strings.

A source gives, for a split name ("train", "validation", "test") and optionally one shard of
it, a `tf.data.Dataset` of dicts of scalar `tf.string` features:

- language modelling sources have the single feature "text";
- translation sources have the features "inputs" and "targets".

`shuffled_dataset(split, seed, shard)` is the same examples endlessly, in a new random order
every epoch, for training. `texts(split)` yields the strings in plain Python, for training a
vocabulary.

The shipped corpus is the King James / Louis Segond Bible in `data/` (see data/README.md).
Its held-out splits are whole books, so no verse of a held-out book is ever trained on.
"""

import abc
import functools
import lzma
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import tensorflow as tf

from mtrain.errors import UserError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
BIBLE_FILE = DATA_DIR / "bible_kjv_lsg.tsv.xz"
BIBLE_LANGUAGES = ("en", "fr")

SPLITS = ("train", "validation", "test")

# The Bible's splits are disjoint sets of books (numbered 1..66 in the file). Each held-out
# split is about 3% of the 31,102 verses: three Old Testament books of different kinds
# (story, wisdom or poetry, prophecy) and one New Testament letter. "train" is the other 58.
VALIDATION_BOOKS = {8: "Ruth", 21: "Ecclesiastes", 27: "Daniel", 45: "Romans"}  # 1,097 verses
TEST_BOOKS = {17: "Esther", 22: "Song of Solomon", 28: "Hosea", 46: "1 Corinthians"}  # 918 verses


class DataError(UserError, ValueError):
    """A data request that cannot work: an unknown split or language, too little data, an
    input state saved by a different pipeline."""


class TextSource(abc.ABC):
    """A corpus with named splits; subclasses say how to read a split."""

    features: tuple[str, ...]  # names of the string features of every example
    splits: tuple[str, ...] = SPLITS
    shuffle_buffer: int = 10_000  # examples, for the default shuffled_dataset

    @abc.abstractmethod
    def dataset(self, split: str, shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        """The examples of `split` in a fixed order, as dicts of scalar tf.string features.

        `shard=(index, count)` keeps only the `index`-th of `count` disjoint parts that
        together make the split, reading only that part where the source can. Which part
        holds which example is up to the source (in-memory sources take every `count`-th
        example). `index` may be a scalar int64 tensor: the pipeline builds the dataset of
        each batch row inside one tf.data function.
        """

    def shuffled_dataset(self, split: str, seed: int | tf.Tensor,
                         shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        """The examples of `split` (or of one shard) endlessly, reshuffled every epoch.

        A deterministic function of `seed`, and checkpointable. This default shuffles with
        a buffer of `shuffle_buffer` examples, which an iterator checkpoint has to store;
        sources with random access override it to shuffle without one.
        """
        dataset = self.dataset(split, shard)
        dataset = dataset.shuffle(self.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        return dataset.repeat()

    @abc.abstractmethod
    def texts(self, split: str) -> Iterator[str]:
        """Every string of every feature of `split`, for training a vocabulary."""

    def check_split(self, split: str) -> str:
        """Returns `split`, or raises a DataError naming the valid splits."""
        if split not in self.splits:
            raise DataError(
                f"unknown split {split!r} for {type(self).__name__}; valid splits: "
                + ", ".join(self.splits)
            )
        return split


class InMemorySource(TextSource):
    """A source small enough to hold in memory: subclasses return each split's columns."""

    @abc.abstractmethod
    def columns(self, split: str) -> dict[str, Sequence[str]]:
        """For a valid split, one sequence of strings per feature, all of the same length."""

    def dataset(self, split: str, shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(self._shard_tensors(split, shard))

    def shuffled_dataset(self, split: str, seed: int | tf.Tensor,
                         shard: tuple[int, int] | None = None) -> tf.data.Dataset:
        """Epoch e is a permutation of the examples drawn from (seed, e) alone.

        No shuffle buffer: the state of an iterator is just the epoch and the position in
        it, so checkpoints are tiny and every epoch is a uniform shuffle.
        """
        tensors = self._shard_tensors(split, shard)
        size = tf.shape(next(iter(tensors.values())))[0]
        # An empty shard would make the endless stream below spin forever: fail instead.
        with tf.control_dependencies([tf.debugging.assert_positive(
                size, message=f"{type(self).__name__}: empty shard of split {split!r}")]):
            size = tf.identity(size)
        seed = tf.cast(seed, tf.int64)

        @tf.autograph.experimental.do_not_convert
        def epoch(e: tf.Tensor) -> tf.data.Dataset:
            order = tf.random.experimental.stateless_shuffle(
                tf.range(size), seed=tf.stack([seed, e]), alg="philox")
            return tf.data.Dataset.from_tensor_slices(
                {name: tf.gather(values, order) for name, values in tensors.items()})

        return tf.data.Dataset.range(2**62).flat_map(epoch)

    def _shard_tensors(self, split: str, shard: tuple[int, int] | None) -> dict[str, tf.Tensor]:
        """The columns of a split, or every `count`-th example from `index` on."""
        tensors = self._tensors(self.check_split(split))
        if shard is None:
            return tensors
        index, count = shard
        if isinstance(index, int) and not 0 <= index < count:
            raise ValueError(f"shard index {index} is not in [0, {count})")
        return {name: values[index::count] for name, values in tensors.items()}

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

    def texts(self, split: str) -> Iterator[str]:
        columns = self.columns(self.check_split(split))
        # Example by example, so that a vocabulary trained on the first N strings sees
        # every feature (both languages of a translation corpus).
        for strings in zip(*(columns[name] for name in self.features)):
            yield from strings


class Verse(NamedTuple):
    book: int
    chapter: int
    verse: int
    en: str
    fr: str


@functools.cache
def bible_verses() -> tuple[Verse, ...]:
    """Every verse of the shipped Bible in file order; the file is read once per process."""
    if not BIBLE_FILE.exists():
        raise DataError(f"the shipped corpus {BIBLE_FILE} is missing")
    with lzma.open(BIBLE_FILE, "rt", encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header != list(Verse._fields):
            raise DataError(f"{BIBLE_FILE}: unexpected header {header}")
        verses = []
        for line in f:
            book, chapter, verse, en, fr = line.rstrip("\n").split("\t")
            verses.append(Verse(int(book), int(chapter), int(verse), en, fr))
    return tuple(verses)


def bible_split(book: int) -> str:
    """The split that a Bible book (1..66) belongs to."""
    if book in VALIDATION_BOOKS:
        return "validation"
    if book in TEST_BOOKS:
        return "test"
    return "train"


@functools.cache
def bible_split_verses(split: str) -> tuple[Verse, ...]:
    """The verses of one split, in file order."""
    return tuple(v for v in bible_verses() if bible_split(v.book) == split)


@functools.cache
def bible_column(split: str, language: str) -> tuple[str, ...]:
    """The text of every verse of a split in one language, in file order."""
    return tuple(getattr(v, language) for v in bible_split_verses(split))


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
