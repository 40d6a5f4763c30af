"""A user's own data files, read as a stream of records.

`expand` turns paths and globs (local, or gs://... through etils.epath, as the model dir is)
into a list of files; `read` streams the records of one file, never holding the whole file in
memory; `identity` is a short digest of which files, of what size and age, a run reads (saved
with the input state so a resumed run notices edited data); `hf_dataset_splits` finds the
files of each split of a folder laid out as a Hugging Face dataset on the Hub.

Formats (`file_kind` tells them by name):

- jsonl: one JSON object per line (.jsonl, .ndjson, .json), each a record as it is.
- text: one record {"text": line} per non-blank line (.txt and any other name).
- text_file: the whole file as one record {"text": content} (a document per file; never
  chosen by name).
- parquet: one record per row, {column: Python value} (.parquet), read by record batches.
- arrayrecord: one record per stored record (.array_record, .arrayrecord, and sharded names
  such as x.array_record-00000-of-00004): a JSON object if it is one, else {"text": string}.

jsonl and text files may be compressed: .gz, .bz2, .xz (standard library), .zst (zstandard).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import re
from collections.abc import Sequence
from typing import Iterator

from etils import epath

from mtrain.errors import DataError, first_line

Record = dict  # one example as read: a JSON object, {"text": str}, or a Parquet row

FORMATS = ("jsonl", "text", "text_file", "parquet", "arrayrecord")

_OPENERS = {
    ".gz": lambda f: gzip.GzipFile(fileobj=f, mode="rb"),
    ".bz2": lambda f: bz2.BZ2File(f, mode="rb"),
    ".xz": lambda f: lzma.LZMAFile(f, mode="rb"),
    ".zst": lambda f: _zstd_reader(f),
}
_UNREADABLE = (".zip", ".7z", ".rar", ".tar", ".tgz", ".lz4", ".br", ".lz", ".lzo", ".snappy", ".z")
_SHARD = re.compile(r"-\d+-of-\d+$")  # x.array_record-00000-of-00004
_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_GLOB = re.compile(r"[*?\[]")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors write first
_BLOCK = 1024  # records read at a time (Parquet batches, ArrayRecord blocks)


def _zstd_reader(f):
    import zstandard  # only for .zst files

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True))


def _is_local(path) -> bool:
    return not _URI.match(str(path))


def expand(paths: str | Sequence[str]) -> list[epath.Path]:
    """The files named by `paths` (a path or glob, or a sequence of them; local, or gs://...),
    each pattern expanded sorted, in the order given, duplicates removed. A pattern that
    matches no file, or names a folder, is a DataError naming it."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = {}  # by name, in order
    for pattern in paths:
        pattern = os.path.expanduser(str(pattern)) if _is_local(pattern) else str(pattern)
        for path in _matches(pattern):
            files.setdefault(str(path), path)
    return list(files.values())


def _matches(pattern: str) -> list[epath.Path]:
    if not _GLOB.search(pattern):
        path = epath.Path(pattern)
        if path.is_dir():
            raise DataError(f"{pattern} is a folder, not a file: name its files or a glob "
                            f"such as {pattern.rstrip('/')}/*.jsonl")
        if not path.exists():
            raise DataError(f"no such data file: {pattern}")
        return [path]
    if _is_local(pattern):
        import glob

        found = [epath.Path(p) for p in glob.glob(pattern, recursive=True)]
    else:
        root, _, rest = pattern.partition("://")
        bucket, _, rest = rest.partition("/")
        try:
            found = list(epath.Path(f"{root}://{bucket}").glob(rest))
        except NotImplementedError as e:  # epath refuses ** in a bucket
            raise DataError(f"{pattern}: {first_line(e)}") from None
    files = sorted((p for p in found if p.is_file()), key=str)
    if not files:
        raise DataError(f"no data file matches {pattern}")
    return files


def _name_parts(path) -> tuple[str, str, str]:
    """(name without shard and compression suffixes, data suffix, compression suffix), lower
    case; DataError for a compression that cannot be read."""
    name = _SHARD.sub("", epath.Path(path).name.lower()).replace(".zstd", ".zst")
    stem, suffix = os.path.splitext(name)
    compression = ""
    if suffix in _OPENERS:
        compression = suffix
        stem, suffix = os.path.splitext(stem)
    elif suffix in _UNREADABLE:
        raise DataError(f"{path}: cannot read {suffix} files: decompress it, or compress it "
                        f"as {', '.join(_OPENERS)}")
    return stem, suffix, compression


def file_kind(path) -> str:
    """The format of a file by its name: 'jsonl' (.jsonl, .ndjson, .json, compressed or not),
    'parquet', 'arrayrecord' (also sharded names like x.array_record-00000-of-00004), else
    'text'. DataError for a compressed suffix that cannot be read (.zip, .7z, ...)."""
    _, suffix, compression = _name_parts(path)
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".array_record", ".arrayrecord"):
        if compression:
            raise DataError(f"{path}: cannot read a {compression}-compressed {suffix} file: "
                            f"decompress it")
        return "parquet" if suffix == ".parquet" else "arrayrecord"
    return "text"


def identity(paths: Sequence) -> str:
    """A short hex digest of the files: each one's full path, size and modification time, in
    the order given. It changes when a file is edited, added or removed, and is the same in
    every process and run otherwise."""
    digest = hashlib.sha256()
    for path in paths:
        if _is_local(path):
            name = os.path.abspath(os.path.expanduser(str(path)))
            stat = os.stat(name)
            size, mtime = stat.st_size, stat.st_mtime_ns
        else:
            name = str(path)
            stat = epath.Path(path).stat()
            size, mtime = stat.length, stat.mtime
        digest.update(f"{name}\t{size}\t{mtime}\n".encode())
    return digest.hexdigest()[:16]


def read(path, kind: str | None = None, *,
         columns: Sequence[str] | None = None) -> Iterator[tuple[int, Record]]:
    """Streams the records of one file as (number, record): number is the 1-based line number
    for jsonl and text (blank lines are skipped but counted), the 0-based record index for
    parquet and arrayrecord, 1 for text_file. `kind` None: file_kind(path). `columns` selects
    Parquet columns (a missing one is a DataError naming the columns the file has)."""
    kind = file_kind(path) if kind is None else kind
    if kind not in FORMATS:
        raise DataError(f"unknown data format {kind!r} for {path}; formats: {', '.join(FORMATS)}")
    if columns is not None and kind != "parquet":
        raise DataError(f"{path}: columns can only be chosen in Parquet files, not {kind}")
    if kind == "parquet":
        return _read_parquet(epath.Path(path), columns)
    return {"jsonl": _read_jsonl, "text": _read_text, "text_file": _read_text_file,
            "arrayrecord": _read_arrayrecord}[kind](epath.Path(path))


@contextlib.contextmanager
def _open(path: epath.Path, compressed: bool = True):
    """The file's bytes, decompressed by its suffix if `compressed`, read by lines or whole."""
    try:
        raw = path.open("rb")
    except FileNotFoundError:
        raise DataError(f"no such data file: {path}") from None
    except OSError as e:
        raise DataError(f"cannot open {path}: {first_line(e)}") from None
    with raw:
        compression = _name_parts(path)[2] if compressed else ""
        if not compression:
            yield raw
            return
        with _OPENERS[compression](raw) as stream:
            yield stream


def _lines(path: epath.Path) -> Iterator[tuple[int, bytes]]:
    """(1-based number, line without its line ending) for each line of a file."""
    with _open(path) as f:
        try:
            for number, line in enumerate(f, 1):
                yield number, (line.removeprefix(_BOM) if number == 1 else line).rstrip(b"\r\n")
        except Exception as e:  # a damaged compressed file (each library has its errors)
            raise DataError(f"{path}: cannot read it ({first_line(e)})") from None


def _read_jsonl(path: epath.Path) -> Iterator[tuple[int, Record]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            if number == 1 and line.lstrip().startswith(b"["):
                raise DataError(f"{path} is a JSON array, not JSON lines: write one object "
                                f"per line") from None
            raise DataError(f"{path} line {number}: not a JSON object ({first_line(e)})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {number}: not a JSON object (a JSON "
                            f"{type(record).__name__})")
        yield number, record


def _decode(path, line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} {where}: not UTF-8 text ({first_line(e)})") from None


def _read_text(path: epath.Path) -> Iterator[tuple[int, Record]]:
    for number, line in _lines(path):
        if line.strip():
            yield number, {"text": _decode(path, line, f"line {number}")}


def _read_text_file(path: epath.Path) -> Iterator[tuple[int, Record]]:
    with _open(path) as f:
        try:
            content = f.read()
        except Exception as e:  # a damaged compressed file
            raise DataError(f"{path}: cannot read it ({first_line(e)})") from None
    yield 1, {"text": _decode(path, content.removeprefix(_BOM), "(the whole file)")}


def _read_parquet(path: epath.Path, columns) -> Iterator[tuple[int, Record]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with contextlib.ExitStack() as stack:  # a local file read by Arrow, others by epath
        source = str(path) if _is_local(path) else stack.enter_context(_open(path, False))
        try:
            parquet = pq.ParquetFile(source)
        except FileNotFoundError:
            raise DataError(f"no such data file: {path}") from None
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a Parquet file ({first_line(e)})") from None
        stack.callback(parquet.close)
        names = parquet.schema_arrow.names
        missing = [c for c in columns or () if c not in names]
        if missing:
            raise DataError(f"{path} has no column {missing[0]!r}; its columns: "
                            f"{', '.join(names)}")
        rows = (row for batch in parquet.iter_batches(_BLOCK, columns=columns and list(columns))
                for row in batch.to_pylist())
        yield from enumerate(rows)


def _read_arrayrecord(path: epath.Path) -> Iterator[tuple[int, Record]]:
    from array_record.python.array_record_module import ArrayRecordReader

    if _is_local(path) and not path.exists():
        raise DataError(f"no such data file: {path}")
    try:  # the library raises RuntimeError for a damaged file, at the latest when closing it
        reader = ArrayRecordReader(str(path))
        if not reader.ok():
            reader.close()  # raises the reason
        for start in range(0, total := reader.num_records(), _BLOCK):
            for index, data in enumerate(reader.read(list(range(start, min(total, start + _BLOCK)))),
                                         start):
                yield index, _record_of(path, index, data)
        reader.close()
    except (RuntimeError, ValueError, OSError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: not a readable ArrayRecord file ({first_line(e)})") from None


def _record_of(path, index: int, data: bytes) -> Record:
    """A JSON object if the bytes are one, else {"text": the bytes as UTF-8}."""
    with contextlib.suppress(ValueError):
        if data.lstrip()[:1] == b"{" and isinstance(record := json.loads(data), dict):
            return record
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        raise DataError(f"{path} record {index}: neither a JSON object nor UTF-8 text "
                        f"(a serialized proto?)") from None


# Split names a file or folder may start with, outside the Hub's sharded names.
_SPLIT_WORDS = ("train", "training", "validation", "valid", "val", "dev", "test", "testing",
                "eval", "evaluation")
_HUB_SHARD = re.compile(r"^(\w+(?:\.\w+)*)-\d+-of-\d+(?:-[0-9a-f]+)?\.")
_WORD = re.compile(r"^(" + "|".join(_SPLIT_WORDS) + r")(?:[-_.].*)?$")
_DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".txt", ".array_record",
                  ".arrayrecord")


def hf_dataset_splits(folder) -> dict[str, list[epath.Path]] | None:
    """The files of each split of a folder laid out as a Hugging Face dataset on the Hub, by
    split name as the files name it (e.g. {"train": [...], "test": [...]}), or None if the
    folder is not laid out so. A README.md whose YAML front matter has `configs:` with
    `data_files` decides; else data/ (or the folder itself) holds `<split>-00000-of-00002.ext`,
    `<split>.ext`, `<split>-*.ext` or (under data/) `<split>/*.ext`. Read without the Hub."""
    folder = epath.Path(folder)
    if not folder.is_dir():
        return None
    splits = _readme_splits(folder)
    if splits is None and (folder / "data").is_dir():
        splits = _layout_splits(folder / "data", any_name=True)
    return splits or _layout_splits(folder, any_name=False) or None


def _is_data_file(path: epath.Path) -> bool:
    try:
        return path.is_file() and _name_parts(path)[1] in _DATA_SUFFIXES
    except DataError:
        return False


def _layout_splits(where: epath.Path, any_name: bool) -> dict[str, list[epath.Path]]:
    splits: dict[str, list[epath.Path]] = {}
    for path in sorted(where.iterdir(), key=str):
        if path.name.startswith((".", "_")):
            continue
        if path.is_dir():
            if any_name or _WORD.match(path.name):
                files = [p for p in sorted(path.iterdir(), key=str) if _is_data_file(p)]
                if files:
                    splits.setdefault(path.name, []).extend(files)
            continue
        if not _is_data_file(path):
            continue
        match = _HUB_SHARD.match(path.name) or _WORD.match(path.name)
        if match:
            splits.setdefault(match[1], []).append(path)
    return splits


def _readme_splits(folder: epath.Path) -> dict[str, list[epath.Path]] | None:
    """The splits a README.md's `configs:` names (the config marked default, else the one
    named "default", else the first), or None if it names none."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", readme.read_text(), re.S)
    if not match:
        return None
    import yaml

    try:
        meta = yaml.safe_load(match[1])
    except yaml.YAMLError:
        return None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    configs = [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []
    if not configs:
        return None
    defaults = [c for c in configs if c.get("default")] or [
        c for c in configs if c.get("config_name") == "default"]
    if (data_files := (defaults or configs)[0].get("data_files")) is None:
        return None
    if isinstance(data_files, list) and all(isinstance(d, dict) for d in data_files):
        data_files = {d.get("split", "train"): d.get("path") for d in data_files}
    elif not isinstance(data_files, dict):
        data_files = {"train": data_files}
    if not data_files or not all(data_files.values()):
        raise DataError(f"{readme}: cannot read its configs' data_files ({data_files!r})")
    splits = {}
    for split, globs in data_files.items():
        globs = [globs] if isinstance(globs, str) else list(globs)
        splits[str(split)] = expand([str(folder / g) for g in globs])
    return splits
