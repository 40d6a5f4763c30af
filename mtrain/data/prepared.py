"""A user's own data: files named in gin, tokenised once into ArrayRecord, read by index.

    files.train = 'corpus/train-*.jsonl.gz'      # paths or globs, local or gs://
    files.validation = 0.01                      # files too, or a held-out fraction of train
    files.format = 'chat'                        # text | text_file | translation |
                                                 # pretokenized | chat | prompt_completion
                                                 # | preference (DPO's pairs)

`Files` names the data: each split's files (or a folder laid out as a Hugging Face dataset
saves it, read without the hub: `hub_layout`), the format of its records
(`formats`) and the columns to read. `prepare` makes it a `PreparedSource`: one streaming
pass over the files (never all in memory) encodes every record by its format (tokenised,
with its loss weights) and writes it to ``<split>.array_record``, which Grain then reads by
index like any source. The prepared copy lives in the data dir under a name that is a
digest of everything it was made from: every file's name and contents, the
tokenizer, the format and its settings, the held-out fraction. An edited file makes a new
one; nothing is served stale. A bad record (not a conversation the template renders, an
assistant mask of zeros, an id outside the vocabulary) stops the preparation with one line
naming the file and the line, and nothing is left behind.

Preparing is the default for every file source (random access by index needs it, and a
corpus is read once per epoch). A long text is read, tokenised and stored in pieces
(`formats.Format.cut`), each an example; a held-out fraction f takes example i of the
training files into "validation" when a hash of i falls below f: the same examples on every
machine (files.validation=0: none, and a run evaluates nothing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Sequence

import numpy as np
from etils import epath

from mtrain.data import files as files_lib
from mtrain.data import file_identity, formats, hub_layout, ragged
from mtrain.data import preference  # noqa: F401 (registers the 'preference' format)
from mtrain.errors import DataError
from mtrain.models.base import READ_INPUTS

log = logging.getLogger("mtrain")
VERSION = 2  # of the prepared files' layout (2: long texts stored cut)
BLOCK = 1024  # records encoded at once


@dataclasses.dataclass(frozen=True)
class Files:
    """A source of the user's files (gin ``files.*``; see the module doc). `columns`: the
    record fields the format reads, by its role: ``{"text": "content"}``, ``{"inputs": "en",
    "targets": "fr"}``, ``{"input_ids": "tokens"}``, ``{"messages": "conversation"}``,
    ``{"prompt": "question", "completion": "answer"}``. `file_kind` forces how the files are
    read (`files.FORMATS`; default: by their names). `chat_template`: a jinja file to
    render conversations with (default: the model dir's, which an import keeps)."""

    train: str | Sequence[str] | None = None
    validation: str | Sequence[str] | float | None = None
    test: str | Sequence[str] | None = None
    format: str = "text"
    columns: dict | None = None
    file_kind: str | None = None
    chat_template: str | None = None

    def __post_init__(self):  # a number is a fraction held out (0: none), whatever its type
        if isinstance(self.validation, (int, float)) and not isinstance(self.validation, bool):
            object.__setattr__(self, "validation", float(self.validation))

    @property
    def holdout(self) -> float | None:
        """The fraction of files.train held out, if any."""
        return self.validation if isinstance(self.validation, float) and self.validation else None

    @property
    def holds_out_nothing(self) -> bool:
        """files.validation=0: the user keeps no data apart (a run evaluates nothing)."""
        return self.validation == 0.0 and not isinstance(self.validation, bool)

    def splits(self) -> dict[str, list]:
        """The files of each split named (a Hugging Face dataset folder: its splits)."""
        named = {"train": self.train, "validation": self.validation, "test": self.test}
        out = {}
        for split, paths in named.items():
            if paths is None or isinstance(paths, float):
                continue
            if isinstance(paths, str) and epath.Path(paths).is_dir():
                layout = hub_layout.hf_dataset_splits(paths)
                if layout is None:
                    raise DataError(f"files.{split}={paths!r} is a folder that is not laid out "
                                    f"as a Hugging Face dataset: name its files or a glob")
                if split == "train":  # the folder's splits, unless named apart
                    out.update({k: v for k, v in layout.items() if named.get(k) is None
                                or k == "train"})
                    continue
                paths = layout.get(split) or sum(layout.values(), [])
            out[split] = files_lib.expand(paths)
        if "train" not in out and not out:
            raise DataError("files.train names no files: give paths, globs or a dataset folder")
        if self.holdout is not None:
            if not 0.0 < self.validation < 1.0 or "train" not in out:
                raise DataError(f"files.validation={self.validation}: a held-out fraction of "
                                f"files.train must be between 0 and 1")
        return out

    def make_format(self, template=None) -> formats.Format:
        """The `formats.Format` registered as files.format, reading `columns` (`template`:
        a chat's `ChatTemplate`, which only encoding needs: its texts are read without
        one)."""
        return formats.make(self.format, self.columns, template)

    def reader_kind(self) -> str | None:
        return "text_file" if self.format == "text_file" else self.file_kind

    def records(self, split: str):
        """(where, record) of a split's raw records in order (vocabulary training)."""
        return _located(self.splits().get(split, []), self.reader_kind())


def _held_out(ordinals: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each record (by its ordinal in the training files) is held out."""
    mixed = (ordinals.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def _key(spec: Files, splits: dict, fmt: formats.Format, vocab, piece: int,
         data_dir: str) -> str:
    described = json.dumps({
        "version": VERSION, "format": fmt.describe(), "reader": spec.reader_kind(),
        "vocabulary": vocab.digest, "holdout": spec.holdout, "piece": piece,
        "files": {split: file_identity.identity(paths, data_dir)
                  for split, paths in sorted(splits.items())},
    }, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def prepare(spec: Files, fmt: formats.Format, vocab, data_dir: str, name: str = "files",
            splits: dict | None = None, piece: int = formats.PIECE) -> "PreparedSource":
    """The prepared copy of `spec`'s files (made now if there is none: module doc);
    `splits`: their `Files.splits`, where the caller has them; `piece`: the ids a long
    text's stored examples hold (`formats.piece_size`)."""
    splits = splits or spec.splits()
    key = _key(spec, splits, fmt, vocab, piece, data_dir)
    directory = epath.Path(data_dir) / "prepared" / f"{name}-{key}"
    made = not (directory / "info.json").exists()
    if made:
        _write(spec, splits, fmt, vocab, directory, piece)
    info = json.loads((directory / "info.json").read_text())
    return PreparedSource(str(directory), info, fmt, spec, made)


def _write(spec: Files, splits: dict, fmt: formats.Format, vocab, directory,
           piece: int) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    work = epath.Path(f"{directory}.preparing")
    if work.exists():
        shutil.rmtree(work)  # an interrupted preparation's (the data dir's lock is held)
    work.mkdir(parents=True)
    names = list(splits) + (["validation"] if spec.holdout else [])
    writers = {s: ArrayRecordWriter(str(work / f"{s}.array_record"), "group_size:1")
               for s in names}
    counts = {s: {"examples": 0, "tokens": 0, "loss_tokens": 0} for s in names}
    log.info("preparing %s (%s) -> %s", ", ".join(f"{s}: {len(p)} files"
                                                 for s, p in splits.items()),
             fmt.describe(), directory)
    try:
        for split, paths in splits.items():
            examples = fmt.cut(_encoded(paths, spec.reader_kind(), fmt, vocab), piece)
            for ordinal, block in zip(itertools.count(0, BLOCK), itertools.batched(examples, BLOCK)):
                into = np.full(len(block), split, object)
                if split == "train" and spec.holdout:
                    held = _held_out(np.arange(ordinal, ordinal + len(block)), spec.holdout)
                    into[held] = "validation"
                for i, example in enumerate(block):
                    writers[into[i]].write(_serialise(example))
                    c = counts[into[i]]
                    c["examples"] += 1
                    c["tokens"] += len(example[0][-1])
                    c["loss_tokens"] += int((example[1] > 0).sum()) if example[1] is not None else \
                        len(example[0][-1])
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        for writer in writers.values():
            writer.close()
    info = {"format": fmt.describe(), "splits": counts}
    (work / "info.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    work.rename(directory)


def _encoded(paths, kind, fmt: formats.Format, vocab):
    """(example, whether its text goes on in the next) of every record of `paths`, encoded
    a block at a time."""
    for block in itertools.batched(_located(paths, kind), BLOCK):
        where, records = zip(*block)
        encoded = fmt.encode(list(records), vocab, list(where))
        yield from zip(_examples(encoded), (bool(r.get(files_lib.CONTINUED)) for r in records))


def _located(paths, kind):
    """(where, record) of every record of `paths` in order: where is "FILE line N" (or
    "row N" of a Parquet file), for messages."""
    for path in paths:
        unit = "row" if (kind or files_lib.file_kind(path)) == "parquet" else "line"
        for number, record in files_lib.read(path, kind):
            yield f"{path} {unit} {number}", record


def _examples(encoded: formats.Encoded):
    """Each example of a window: ([ids of each key], its weights or None)."""
    keys = list(encoded.keys.values())
    t = encoded.keys["targets"][1]
    for i in range(len(keys[0][1]) - 1):
        ids = [values[splits[i]:splits[i + 1]] for values, splits in keys]
        yield ids, (None if encoded.weights is None else encoded.weights[t[i]:t[i + 1]])


def _serialise(example) -> bytes:
    """[keys, has weights, length of each] then the ids of each key, then the weights."""
    ids, weights = example
    header = np.array([len(ids), weights is not None, *map(len, ids)], np.int32)
    parts = [header, *ids] + ([np.asarray(weights, np.int32)] if weights is not None else [])
    return np.concatenate(parts).astype(np.int32).tobytes()


def _deserialise(data: bytes):
    a = np.frombuffer(data, np.int32)
    n, weighted = int(a[0]), bool(a[1])
    sizes = a[2:2 + n]
    ends = 2 + n + np.cumsum(sizes)
    ids = [a[e - s:e] for s, e in zip(sizes, ends)]
    return ids, (a[ends[-1]:] if weighted else None)


class PreparedRecords(Sequence):
    """A prepared split, by index: each example ([ids of each key], weights or None)."""

    def __init__(self, path: str):
        from array_record.python.array_record_data_source import ArrayRecordDataSource

        self._path = path
        self._source = ArrayRecordDataSource([path])

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return _deserialise(self._source[index])

    def __getitems__(self, indices):
        return [_deserialise(d) for d in self._source.__getitems__(list(indices))]

    def __reduce__(self):  # Grain's worker processes open their own reader
        return PreparedRecords, (self._path,)


@dataclasses.dataclass
class Stored(formats.Format):
    """The format of prepared records: their ids as stored (`inner`'s kind), cut and packed
    as `inner` cuts and packs them."""

    inner: formats.Format = None

    kind = property(lambda self: self.inner.kind)
    reads_first = property(lambda self: self.inner.reads_first)
    paired = property(lambda self: self.inner.paired)

    def pieces(self, encoded, length, *, start_id, with_inputs):
        return self.inner.pieces(encoded, length, start_id=start_id, with_inputs=with_inputs)

    def rows(self, rows):
        return self.inner.rows(rows)

    def encode(self, records, vocab, where=()) -> formats.Encoded:
        keys = ["inputs", "targets"] if self.inner.kind == "translation" else ["targets"]
        keys += [READ_INPUTS] if self.inner.paired else []
        out = {k: ragged.flat([r[0][i] for r in records]) for i, k in enumerate(keys)}
        weights = None
        if records and records[0][1] is not None:
            weights = ragged.flat([r[1] for r in records])[0]
        return formats.Encoded(out, weights)

    def describe(self) -> str:
        return self.inner.describe()


class PreparedSource:
    """Prepared splits of a user's files (`prepare`), read by index. `spec`: the `Files`
    they were made of; `made`: whether this process made them now."""

    def __init__(self, directory: str, info: dict, fmt: formats.Format,
                 spec: Files | None = None, made: bool = False):
        self.directory, self.info, self.spec, self.made = directory, info, spec, made
        self.format = Stored(fmt)
        self.splits = tuple(s for s, c in info["splits"].items() if c["examples"])
        self._records = {}

    def check_split(self, split: str) -> str:
        if split == "validation" and self.spec and self.spec.holds_out_nothing:
            raise DataError("files.validation=0 holds out nothing: there is no 'validation' "
                            "split to evaluate (name its files, or a held-out fraction)")
        holdout = self.spec and self.spec.holdout
        if split == "validation" and holdout and split not in self.splits:
            train = self.info["splits"].get("train", {}).get("examples", 0)
            raise DataError(f"files.validation={holdout} held out none of the {train} "
                            f"examples of files.train: hold out a larger fraction, or name "
                            f"validation files")
        if split in self.info["splits"] and split not in self.splits:
            raise DataError(f"the {split!r} split of the files has no examples: files.{split} "
                            f"hold no records")
        if split not in self.splits:
            raise DataError(f"no {split!r} split in the files (they have "
                            f"{', '.join(self.splits) or 'none'}): name its files "
                            f"(files.{split}) or a held-out fraction (files.validation)")
        return split

    def records(self, split: str) -> PreparedRecords:
        if split not in self._records:
            path = os.path.join(self.directory, f"{self.check_split(split)}.array_record")
            self._records[split] = PreparedRecords(path)
        return self._records[split]

    def num_examples(self, split: str) -> int:
        return self.info["splits"][self.check_split(split)]["examples"]

    def loss_fraction(self, split: str) -> float:
        c = self.info["splits"][self.check_split(split)]
        return c["loss_tokens"] / max(c["tokens"], 1)

    def fingerprint(self) -> str:
        sizes = ", ".join(f"{s} {self.num_examples(s)}" for s in sorted(self.splits))
        return f"prepared {os.path.basename(self.directory)} ({sizes} examples)"

    def description(self) -> str:
        return f"PreparedSource({os.path.basename(self.directory)})"
