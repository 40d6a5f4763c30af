"""A user's own data files, read as a stream of records.

`expand` turns paths and globs (local, or gs://... through etils.epath, as the model dir is)
into a list of files; `read` streams the records of one file, never holding the whole file in
memory, a long line in parts; `identity` is a short digest of the contents of the files a
run reads (`data.file_identity`). (A folder laid out as a Hugging Face dataset on the Hub:
`data.hub_layout`.)

Formats (`file_kind` tells them by name):

- jsonl: one JSON object per line (.jsonl, .ndjson, .json), each a record as it is.
- text: one record {"text": line} per non-blank line (.txt and any other name).
- text_file: the whole file as one record {"text": content} (a document per file; never
  chosen by name).
  A text longer than `PART` bytes comes as several records, each but the last marked
  `CONTINUED` (`_parts`): a document of any size is read in bounded memory.
- parquet: one record per row, {column: Python value} (.parquet), read by record batches.
- arrayrecord: one record per stored record (.array_record, .arrayrecord, and sharded names
  such as x.array_record-00000-of-00004): a JSON object if it is one, else {"text": string}.

jsonl and text files may be compressed: .gz, .bz2, .xz (standard library), .zst (zstandard).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
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
PART = 1 << 18  # bytes of a long line (a text_file) read at a time
CONTINUED = "_continued"  # in a record that is a part of a longer text, whose next follows


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


def name_parts(path) -> tuple[str, str, str]:
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
    _, suffix, compression = name_parts(path)
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".array_record", ".arrayrecord"):
        if compression:
            raise DataError(f"{path}: cannot read a {compression}-compressed {suffix} file: "
                            f"decompress it")
        return "parquet" if suffix == ".parquet" else "arrayrecord"
    return "text"


def read(path, kind: str | None = None, *,
         columns: Sequence[str] | None = None) -> Iterator[tuple[int, Record]]:
    """Streams the records of one file as (number, record): number is the 1-based line number
    for jsonl and text (blank lines are skipped but counted), the 0-based record index for
    parquet and arrayrecord, 1 for text_file (a long text in parts: each a record, all but
    the last marked `CONTINUED`). `kind` None: file_kind(path). `columns` selects Parquet
    columns (a missing one is a DataError naming the columns the file has)."""
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
        compression = name_parts(path)[2] if compressed else ""
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


def _parts(path: epath.Path, whole: bool = False) -> Iterator[tuple[int, bytes, bool]]:
    """(1-based line number, a part of the line without its line ending, whether more of
    the line follows) for each line of a file (`whole`: the file as one line), never more
    than about 2 x `PART` bytes at a time: a longer line comes in parts, each cut before a
    space (a line break in a whole file) in its second half, else before its last
    character."""
    with _open(path) as f:
        number, carry, follows, given = 1, b"", False, False
        try:
            while chunk := (f.read(PART) if whole else f.readline(PART)):
                part = carry + (chunk.removeprefix(_BOM) if number == 1 and not follows else chunk)
                if len(chunk) < PART or (not whole and part.endswith(b"\n")):  # its end
                    yield number, part if whole else part.rstrip(b"\r\n"), False
                    number, carry, follows, given = number + 1, b"", False, True
                    continue
                cut = max(part.rfind(b" "), part.rfind(b"\n") if whole else -1)
                if cut <= len(part) // 2:
                    cut = len(part) - 1
                    while cut > 0 and part[cut] & 0xC0 == 0x80:  # inside a UTF-8 character
                        cut -= 1
                part, carry, follows = part[:cut], part[cut:], True
                yield number, part, True
        except Exception as e:  # a damaged compressed file (each library has its errors)
            raise DataError(f"{path}: cannot read it ({first_line(e)})") from None
        if carry or follows or (whole and not given):
            yield number, carry, False


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


def _read_text(path: epath.Path, whole: bool = False) -> Iterator[tuple[int, Record]]:
    """Its lines (`whole`: the file) as {"text": ...}; one too long to hold at once in
    parts, each but the last marked `CONTINUED` (`_parts`)."""
    after_part = False
    for number, part, more in _parts(path, whole):
        if whole or part.strip() or after_part:
            where = "(the whole file)" if whole else f"line {number}"
            yield number, {"text": _decode(path, part, where), **({CONTINUED: True} if more else {})}
        after_part = more


def _read_text_file(path: epath.Path) -> Iterator[tuple[int, Record]]:
    return _read_text(path, whole=True)


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
