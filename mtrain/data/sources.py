"""Text corpora: named splits of examples whose features are strings, read by index.

A source gives, for a split name ("train", "validation", "test"), the number of examples and
random access to them: `records(split)` is a sequence (``len``, ``[i]``) of examples, each a
dict of Python strings, one per feature. The input pipeline (pipeline.py) reads it through
Grain, which shuffles, shards and repeats by index; `examples(split)` and `texts(split)`
read it in order in plain Python (for evaluation references and training a vocabulary).

Features are named by the source: the Bible LM has "text", the Bible translation corpus
"inputs" and "targets", TFDS sources the dataset's own names (lm1b "text", wmt14 "en" and
"fr"). A task (tasks.py) says which feature is packed as inputs and which as targets.

The shipped corpus is the King James / Louis Segond Bible in `data/` (see data/README.md).
Its held-out splits are whole books, so no verse of a held-out book is ever trained on.
TFDS datasets (lm1b, wmt14) are `TfdsSource`s, prepared by the real TFDS builders
(tfds_prepare.py) and read by index from their array_record files (`tfds.data_source`),
which needs no TensorFlow.
"""

from __future__ import annotations

import abc
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator

from mtrain.data import file_identity, formats
from mtrain.data.bible import BIBLE_LANGUAGES, SPLITS, bible_column
from mtrain.data.streams import Stream
from mtrain.errors import DataError, first_line

Example = dict[str, str]


class TextSource(abc.ABC):
    """A corpus with named splits of string examples, read by index: a
    `streams.DataSource`."""

    features: tuple[str, ...]  # names of the string features of every example
    splits: tuple[str, ...] = SPLITS

    @abc.abstractmethod
    def records(self, split: str) -> Sequence[Example]:
        """The examples of a valid split, by index: a sequence of dicts {feature: string}
        that can be pickled (Grain's worker processes read it too). Deterministic."""

    def num_examples(self, split: str) -> int:
        """The number of examples of a valid split."""
        return len(self.records(self.check_split(split)))

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

    def packs(self, features: dict[str, str]) -> "TextSource":
        """This source, its `features` ({packed key: feature}, a task's) packed as one text
        (language modelling) or a translation pair; default: "text", else "inputs" and
        "targets"."""
        self._packed = dict(features)
        return self

    def streams(self, split: str) -> list[Stream]:
        """The split as one stream of the packed features (`packs`)."""
        packed = self.packed()
        fmt = (formats.Translation(packed["inputs"], packed["targets"]) if "inputs" in packed
               else formats.Text(packed["targets"]))
        return [Stream(self.description(), self.records(self.check_split(split)), fmt,
                       fingerprint=self.fingerprint())]

    def packed(self) -> dict[str, str]:
        return getattr(self, "_packed", None) or (
            {"targets": "text"} if "text" in self.features else
            {"inputs": "inputs", "targets": "targets"})

    def input_config(self, split: str) -> dict:
        return {"data": self.fingerprint(), "features": self.packed()}

    def holds_out_nothing(self, split: str) -> bool:
        """Whether the user left `split` out on purpose (a corpus never does)."""
        return False

    def check_loss_fraction(self, split: str = "train") -> None:
        """(Every token of a text carries loss.)"""

    def description(self) -> str:
        """The source's class and settings, e.g. "BibleLM(lang='en')"."""
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items())
                             if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"

    def fingerprint(self) -> str:
        """What decides the examples and their order, as plain text that is the same in
        every process and on every machine (saved with checkpoints, compared on resume)."""
        return self.description()

    def texts(self, split: str, limit: int | None = None) -> Iterator[str]:
        """Every string of every feature of the first `limit` examples of `split`, example by
        example (so a vocabulary trained on the first N strings sees every feature)."""
        for example in self.examples(split, limit):
            yield from example.values()

    def examples(self, split: str, limit: int | None = None) -> Iterator[Example]:
        """The first `limit` examples of `split` in order, as dicts of Python strings."""
        records = self.records(self.check_split(split))
        size = len(records) if limit is None else min(len(records), limit)
        for start in range(0, size, 4096):  # a block at a time where the source can
            yield from read(records, list(range(start, min(start + 4096, size))))


def read(records: Sequence[Example], indices: list[int]) -> list[Example]:
    """Examples `indices` of `records`, in one read where the source can (array_record)."""
    if hasattr(records, "__getitems__"):
        return records.__getitems__(indices)
    return [records[i] for i in indices]


class InMemorySource(TextSource):
    """A source small enough to hold in memory: subclasses return each split's columns."""

    @abc.abstractmethod
    def columns(self, split: str) -> dict[str, Sequence[str]]:
        """For a valid split, one sequence of strings per feature, all of the same length."""

    def records(self, split: str) -> Sequence[Example]:
        return Columns(self.columns(self.check_split(split)))

    def texts(self, split: str, limit: int | None = None) -> Iterator[str]:
        columns = self.columns(self.check_split(split))
        for strings in zip(*(columns[name][:limit] for name in self.features)):
            yield from strings


class Columns(Sequence):
    """Columns of strings {feature: [string, ...]} read as rows {feature: string}."""

    def __init__(self, columns: dict[str, Sequence[str]]):
        self._columns = {name: list(values) for name, values in columns.items()}
        self._length = len(next(iter(self._columns.values())))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Example:
        return {name: values[index] for name, values in self._columns.items()}


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
    that a dataset built from local files is never mistaken for the one from the web.

    A directory of local raw files is keyed by its path and by its files' identity
    (`raw_files_identity`), so that a raw file edited, added or removed is prepared again
    into a new dir, never served stale from the old one. The old prepared dir stays where
    it is: nothing is deleted (the older ``<data_dir>/tfds_local/<folder name>-*`` dirs
    may be deleted by hand to reclaim the space)."""
    if data_source is None:
        return Path(data_dir) / "tfds"
    if data_source == SHIPPED:
        return Path(data_dir) / "tfds_shipped"
    origin = Path(data_source).expanduser().resolve()
    digest = hashlib.sha1(str(origin).encode()).hexdigest()[:8]
    return Path(data_dir) / "tfds_local" / f"{origin.name}-{digest}-{raw_files_identity(origin)}"


def raw_files_identity(root: Path) -> str:
    """A short digest of every file under `root` (following links, as the builders read
    them; a dangling link, which they cannot read either, left out):
    `file_identity.stat_identity`, of each one's path, size and modification time. Any of
    them changed, a file added or removed, changes it; reading them costs one stat each (a
    rebuild, not a resume, is what a change costs here: raw trees keep this cheap kind)."""
    paths = []
    for directory, subdirs, names in os.walk(root, followlinks=True):
        subdirs.sort()
        paths += [p for p in (Path(directory) / name for name in sorted(names)) if p.exists()]
    return file_identity.stat_identity(paths)[:8]


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
        self._records = {}

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

    def records(self, split: str) -> Sequence[Example]:
        if split not in self._records:
            reader = self._builder.as_data_source(split=self.check_split(split))
            self._records[split] = TfdsRecords(reader, self.features, self._builder.data_dir)
        return self._records[split]


class TfdsRecords(Sequence):
    """A TFDS data source (array_record, read by index) with its string features decoded.
    A file that cannot be read (truncated, corrupt) is a DataError naming the dataset."""

    def __init__(self, reader, features: tuple[str, ...], where: str):
        self._reader, self._features, self._where = reader, features, where

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, index: int) -> Example:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Example]:
        try:
            examples = self._reader.__getitems__(list(indices))
        except Exception as e:  # array_record and TFDS raise RuntimeError, ValueError, ...
            raise DataError(f"cannot read the prepared dataset {self._where} "
                            f"({first_line(e)}): delete it, and the next run prepares it "
                            f"again") from None
        return [self._decode(example) for example in examples]

    def _decode(self, example: dict) -> Example:
        return {name: _as_str(example[name]) for name in self._features}


def _as_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
