"""mtrain.data.files: a user's own data files, found, identified and read as streams."""

import gzip
import inspect
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from mtrain.data import file_identity, files, hub_layout
from mtrain.errors import DataError

RECORDS = [{"text": "hello world", "n": 1}, {"text": "ça va ✓", "tags": ["a", "b"]},
           {"inputs": "x", "targets": "y"}]


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


@pytest.mark.parametrize("name,compress", [
    ("a.jsonl", lambda b: b),
    ("a.jsonl.gz", gzip.compress),
    ("a.jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_jsonl_plain_and_compressed(tmp_path, name, compress):
    path = tmp_path / name
    data = _jsonl(RECORDS[:2]) + b"\n   \n" + _jsonl(RECORDS[2:])  # blank lines: counted
    path.write_bytes(compress(data))
    assert files.file_kind(path) == "jsonl"
    got = files.read(path)
    assert inspect.isgenerator(got)
    assert list(got) == [(1, RECORDS[0]), (2, RECORDS[1]), (5, RECORDS[2])]


def test_text_and_text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\n\n  second, indented\r\nlast without newline")
    assert files.file_kind(path) == "text"
    assert list(files.read(path)) == [(1, {"text": "first line"}),
                                      (3, {"text": "  second, indented"}),
                                      (4, {"text": "last without newline"})]
    assert list(files.read(path, "text_file")) == [
        (1, {"text": "first line\n\n  second, indented\r\nlast without newline"})]
    zipped = tmp_path / "b.txt.gz"
    zipped.write_bytes(gzip.compress("un\ndeux\n".encode()))
    assert [r["text"] for _, r in files.read(zipped)] == ["un", "deux"]
    assert list(files.read(zipped, "text_file")) == [(1, {"text": "un\ndeux\n"})]


def test_parquet_rows_and_columns(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4], []], pa.list_(pa.int32())),
                      "text": ["a", "bé", "c"], "score": [0.5, 1.5, 2.5]})
    pq.write_table(table, path, row_group_size=2)
    assert files.file_kind(path) == "parquet"
    assert list(files.read(path)) == [(i, row) for i, row in enumerate(table.to_pylist())]
    got = list(files.read(path, columns=["input_ids", "text"]))
    assert got == [(0, {"input_ids": [1, 2, 3], "text": "a"}), (1, {"input_ids": [4], "text": "bé"}),
                   (2, {"input_ids": [], "text": "c"})]
    assert all(type(t) is int for t in got[0][1]["input_ids"])
    with pytest.raises(DataError, match=r"a\.parquet has no column 'labels'.*input_ids, text, score"):
        next(files.read(path, columns=["labels"]))


def test_parquet_is_read_lazily(tmp_path, monkeypatch):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"input_ids": [[i, i + 1] for i in range(50_000)]}), path,
                   row_group_size=10_000)
    sizes = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, batch_size=65536, **kw):
        sizes.append(batch_size)
        return iter_batches(self, batch_size=batch_size, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    rows = files.read(path)
    assert inspect.isgenerator(rows)
    assert next(rows) == (0, {"input_ids": [0, 1]})
    assert sizes and sizes[0] < 50_000  # one small batch read, not the whole file
    rows.close()


def test_arrayrecord_json_and_text(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = tmp_path / "a.array_record-00000-of-00001"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    stored = [json.dumps(RECORDS[0]).encode(), "plain text ✓".encode(), b"{not json",
              json.dumps(RECORDS[2]).encode()]
    for data in stored:
        writer.write(data)
    writer.close()
    assert files.file_kind(path) == "arrayrecord"
    assert files.file_kind("x.arrayrecord") == "arrayrecord"
    assert list(files.read(path)) == [(0, RECORDS[0]), (1, {"text": "plain text ✓"}),
                                      (2, {"text": "{not json"}), (3, RECORDS[2])]


def test_file_kinds():
    assert [files.file_kind(n) for n in ("a.JSONL", "b.json", "c.ndjson.bz2", "d.txt.gz",
                                          "e.csv", "f", "data/train-00000-of-00002.parquet")] == [
        "jsonl", "jsonl", "jsonl", "text", "text", "text", "parquet"]
    with pytest.raises(DataError, match=r"a\.jsonl\.zip: cannot read \.zip"):
        files.file_kind("a.jsonl.zip")
    with pytest.raises(DataError, match="gz-compressed .parquet"):
        files.file_kind("a.parquet.gz")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2,\n')
    rows = files.read(path)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: not a JSON object \(") as e:
        next(rows)
    assert "\n" not in str(e.value)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not a JSON object \(a JSON list\)"):
        list(files.read(path))


def test_expand_globs_in_order_without_duplicates(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt", "sub/d.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    got = files.expand([str(tmp_path / "c.txt"), str(tmp_path / "*.jsonl"),
                        str(tmp_path / "a.jsonl"), str(tmp_path / "**" / "*.jsonl")])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == [
        "c.txt", "a.jsonl", "b.jsonl", "sub/d.jsonl"]
    assert [p.name for p in files.expand(str(tmp_path / "?.jsonl"))] == ["a.jsonl", "b.jsonl"]
    for pattern in (str(tmp_path / "*.parquet"), str(tmp_path / "missing.jsonl")):
        with pytest.raises(DataError, match=pattern.replace(".", r"\.").replace("*", r"\*")):
            files.expand([str(tmp_path / "a.jsonl"), pattern])
    with pytest.raises(DataError, match="is a folder"):
        files.expand(str(tmp_path / "sub"))


def test_file_digests_are_kept_in_the_data_dir_for_the_next_run(tmp_path):
    """A file is read once: its digest is kept in the data dir by its stat once a run has
    prepared its data, and a later process takes it from there (shown by a digest tampered with there, which the next
    process believes while the file's stat stands)."""
    data = tmp_path / "data"
    a = tmp_path / "a.jsonl"
    a.write_text('{"x": 1}\n')
    first = file_identity.identity([a], str(data))
    store = data / file_identity.STORE
    assert not store.exists()  # (kept once a run has prepared its data: `remember`)
    file_identity.remember(str(data))
    kept = {k: v for k, v in json.loads(store.read_text()).items()
            if k.startswith(f"{a}\t")}  # (and those of other files this process read)
    assert len(kept) == 1 and list(kept.values())[0].startswith("9 ")  # its size, its digest
    store.write_text(json.dumps({k: "9 tampered" for k in kept}))
    code = ("import sys; from mtrain.data import file_identity as f; "
            "print(f.identity([sys.argv[1]], sys.argv[2]))")
    stored = subprocess.run([sys.executable, "-c", code, str(a), str(data)], check=True,
                            capture_output=True, text=True).stdout.strip()
    assert len(stored) == len(first) and stored != first
    a.write_text('{"x": 1}\n')  # rewritten: its stat changes, so it is read again
    assert file_identity.identity([a], str(data)) == first


def test_identity_follows_edits(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"x": 1}\n')
    b.write_text('{"x": 2}\n')
    first = file_identity.identity([a, b])
    assert len(first) >= 8 and int(first, 16) >= 0
    assert file_identity.identity([str(a), str(b)]) == first == file_identity.identity(files.expand([str(a), str(b)]))
    assert file_identity.identity([a]) != first  # a file removed
    stat = os.stat(a)
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # mtime only
    assert file_identity.identity([a, b]) == first  # the same contents: the same data
    a.write_text('{"x": 1}\n')  # rewritten with the same bytes (cp, git checkout)
    assert file_identity.identity([a, b]) == first
    a.write_text('{"x": 3}\n')  # the same size, other contents
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and its old modification time
    second = file_identity.identity([a, b])
    assert second != first and file_identity.identity([a, b]) == second
    a.write_text('{"x": 10}\n')  # size too
    assert file_identity.identity([a, b]) not in (first, second)


def test_hf_dataset_splits(tmp_path):
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    names = ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet",
             "test-00000-of-00001.parquet"]
    for i, name in enumerate(names):
        pq.write_table(pa.table({"text": [f"row {i}"]}), data / name)
    (tmp_path / "ds" / "README.md").write_text("# a dataset card without front matter\n")
    splits = hub_layout.hf_dataset_splits(tmp_path / "ds")
    assert {k: [p.name for p in v] for k, v in splits.items()} == {
        "test": names[2:], "train": names[:2]}
    assert [r["text"] for p in splits["train"] for _, r in files.read(p)] == ["row 0", "row 1"]

    (tmp_path / "ds" / "README.md").write_text(
        "---\nlicense: mit\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train\n    path: data/train-*\n  - split: validation\n    path: data/test-*\n"
        "---\n# card\n")
    splits = hub_layout.hf_dataset_splits(tmp_path / "ds")
    assert {k: [p.name for p in v] for k, v in splits.items()} == {
        "train": names[:2], "validation": names[2:]}

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi\n")
    (plain / "corpus.jsonl").write_text("{}\n")
    assert hub_layout.hf_dataset_splits(plain) is None
    assert hub_layout.hf_dataset_splits(tmp_path / "nothing") is None
    (plain / "train.jsonl").write_text("{}\n")
    (plain / "validation.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    assert {k: [p.name for p in v] for k, v in hub_layout.hf_dataset_splits(plain).items()} == {
        "train": ["train.jsonl"], "validation": ["validation.jsonl.gz"]}


def test_unreadable_files_are_one_line_errors(tmp_path):
    damaged = tmp_path / "a.jsonl.gz"
    damaged.write_bytes(gzip.compress(_jsonl(RECORDS))[:-20])
    missing = tmp_path / "missing.parquet"
    not_parquet = tmp_path / "b.parquet"
    not_parquet.write_text("hello\n")
    not_arrayrecord = tmp_path / "d.array_record"
    not_arrayrecord.write_text("hello\n")
    binary = tmp_path / "c.txt"
    binary.write_bytes(b"ok\n\xff\xfe\n")
    for path, kind, message in [(damaged, None, "a.jsonl.gz: cannot read it"),
                                (missing, None, "no such data file"),
                                (tmp_path / "missing.txt", None, "no such data file"),
                                (not_parquet, None, "b.parquet: not a Parquet file"),
                                (not_arrayrecord, None, "d.array_record: not a readable ArrayRecord"),
                                (binary, None, r"c\.txt line 2: not UTF-8 text"),
                                (binary, "csv", "unknown data format 'csv'")]:
        with pytest.raises(DataError, match=message) as e:
            list(files.read(path, kind))
        assert "\n" not in str(e.value)
