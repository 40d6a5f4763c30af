"""The real TFDS lm1b and wmt14_translate/fr-en builders, run offline on raw trees of the
shipped Bible written by make_offline (mtrain/data/make_offline.py, mtrain/data/tfds_prepare.py).
"""

import os
import shutil
import socket
import urllib.request

import pytest
import tensorflow_datasets as tfds

from mtrain.data import make_offline, tfds_prepare
from mtrain.data.bible import bible_split_verses
from mtrain.errors import DataError

MAX_TRAIN = 2000
WMT14 = "wmt14_translate/fr-en"

# Genesis 1:1 (train) and 1 Corinthians 16:24, the last verse of the test books.
GENESIS_1_1 = ("In the beginning God created the heaven and the earth.",
               "Au commencement, Dieu créa les cieux et la terre.")
CORINTHIANS_16_24 = ("My love be with you all in Christ Jesus. Amen.",
                     "Mon amour est avec vous tous en Jésus Christ.")


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """One raw directory holding both trees, as the real archives extracted side by side."""
    root = tmp_path_factory.mktemp("raw") / "raw"
    assert make_offline.write_lm1b_tree(root, max_train=MAX_TRAIN) == root
    assert make_offline.write_wmt14_tree(root, max_train=MAX_TRAIN) == root
    return root


@pytest.fixture(scope="module")
def data_dir(raw, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    for name in ("lm1b", WMT14):
        tfds_prepare.prepare(name, data_dir, data_source=raw)
    return data_dir


def _texts(builder, split):
    source = builder.as_data_source(split)
    return source.__getitems__(list(range(len(source))))


def _snapshot(root):
    return {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_corpus_strings_are_the_known_ones():
    train, test = bible_split_verses("train"), bible_split_verses("test")
    assert (train[0].en, train[0].fr) == GENESIS_1_1
    assert (test[-1].en, test[-1].fr) == CORINTHIANS_16_24


def test_make_offline_writes_what_the_builders_read(tmp_path):
    from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder as lm1b_module

    assert tfds_prepare.LM1B_GLOBS == (lm1b_module._TRAIN_FILE_FORMAT,
                                        lm1b_module._HELDOUT_FILE_FORMAT)
    wmt14 = tfds.builder(WMT14, data_dir=tmp_path)
    assert set(tfds_prepare.raw_files(wmt14)) == set(make_offline.wmt14_files())
    assert not list(tmp_path.iterdir())  # making a builder writes nothing


def test_lm1b_offline(raw, data_dir):
    builder = tfds.builder("lm1b", data_dir=data_dir)
    assert builder.is_prepared()
    test_verses = bible_split_verses("test")
    assert {s: i.num_examples for s, i in builder.info.splits.items()} == {
        "train": MAX_TRAIN, "test": len(test_verses)}
    assert set(builder.info.features.keys()) == {"text"}
    train = {ex["text"].decode() for ex in _texts(builder, "train")}
    test = {ex["text"].decode() for ex in _texts(builder, "test")}
    assert train == {v.en for v in bible_split_verses("train")[:MAX_TRAIN]}
    assert test == {v.en for v in test_verses}
    assert GENESIS_1_1[0] in train and CORINTHIANS_16_24[0] in test
    # Spread over a few train files, as the real archive spreads it over 99.
    train_files = list(raw.glob(tfds_prepare.LM1B_GLOBS[0]))
    assert len(train_files) == make_offline.LM1B_TRAIN_FILES


def test_wmt14_offline(raw, data_dir):
    builder = tfds.builder(WMT14, data_dir=data_dir)
    assert builder.is_prepared()
    # Every file ends with "\n"; the empty line after it is no example.
    subset_sizes = [len((raw / en).read_bytes().split(b"\n")) - 1
                    for fr, en in make_offline.WMT14_TRAIN_SUBSETS.values()
                    if not en.endswith(".gz")]
    assert len(subset_sizes) == 4 and all(subset_sizes)
    validation, test = bible_split_verses("validation"), bible_split_verses("test")
    assert {s: i.num_examples for s, i in builder.info.splits.items()} == {
        "train": MAX_TRAIN, "validation": len(validation), "test": len(test)}
    assert set(builder.info.features.keys()) == {"en", "fr"}
    assert builder.info.supervised_keys == ("fr", "en")

    def pairs(split):
        return {(ex["en"].decode(), ex["fr"].decode()) for ex in _texts(builder, split)}

    assert pairs("train") == {(v.en, v.fr) for v in bible_split_verses("train")[:MAX_TRAIN]}
    assert pairs("validation") == {(v.en, v.fr) for v in validation}
    assert pairs("test") == {(v.en, v.fr) for v in test}  # SGML, round trip exact
    assert GENESIS_1_1 in pairs("train") and CORINTHIANS_16_24 in pairs("test")
    # array_record datasets are read by index only: tf.data needs tfrecord (below).
    with pytest.raises(NotImplementedError, match="as_data_source"):
        builder.as_dataset(split="train")


def test_wmt14_tfrecord_as_supervised_is_fr_en(tmp_path):
    raw = make_offline.write_wmt14_tree(tmp_path / "raw", max_train=50)
    builder = tfds_prepare.prepare(WMT14, tmp_path / "data", data_source=raw,
                                   file_format="tfrecord")
    assert builder.info.file_format.value == "tfrecord"
    supervised = builder.as_dataset(split="train", as_supervised=True)
    fr_en = {(fr.decode(), en.decode()) for fr, en in tfds.as_numpy(supervised)}
    assert GENESIS_1_1[::-1] in fr_en and len(fr_en) == 50
    with pytest.raises(DataError, match="prepared as tfrecord, not array_record"):
        tfds_prepare.prepare(WMT14, tmp_path / "data", data_source=raw)
    with pytest.raises(DataError, match="not a valid FileFormat"):
        tfds_prepare.prepare(WMT14, tmp_path / "data", file_format="csv")


def test_random_access_by_index_batches(data_dir):
    source = tfds.data_source(WMT14, split="train", data_dir=data_dir, download=False)
    batch = source.__getitems__([5, 1, 5])
    assert batch[0] == batch[2] == source[5] and batch[1] == source[1]
    assert set(batch[0]) == {"en", "fr"} and isinstance(batch[0]["fr"], bytes)


def test_second_prepare_reuses_the_dataset(data_dir, tmp_path, capsys):
    before = _snapshot(data_dir)
    for name in ("lm1b", WMT14):
        # Not even the raw tree is looked at: it is gone here.
        builder = tfds_prepare.prepare(name, data_dir, data_source=tmp_path / "nothing")
        assert builder.is_prepared()
    assert _snapshot(data_dir) == before
    assert "preparing" not in capsys.readouterr().err


def test_prepare_prints_one_line(tmp_path, capsys):
    raw = make_offline.write_lm1b_tree(tmp_path / "raw", max_train=10)
    tfds_prepare.prepare("lm1b:1.1.0", tmp_path / "data", data_source=raw)
    captured = capsys.readouterr()
    # On stderr, with the logs: stdout is for results (translations with --mode=infer).
    assert captured.err == f"preparing lm1b:1.1.0 in {tmp_path / 'data'} from {raw}\n"
    assert captured.out == ""
    assert not list((tmp_path / "data").glob("downloads"))


@pytest.mark.parametrize("dataset, name, removed", [
    ("wmt14", WMT14, "dev/newstest2014-fren-ref.en.sgm"),
    ("wmt14", WMT14, "giga-fren.release2.fixed.fr.gz"),
    ("lm1b", "lm1b", "1-billion-word-language-modeling-benchmark-r13output/"
                     "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050"),
])
def test_missing_raw_file_is_a_data_error(tmp_path, dataset, name, removed):
    raw = make_offline.TREES[dataset].write(tmp_path / "raw", max_train=10)
    (raw / removed).unlink()
    with pytest.raises(DataError, match="make_offline") as e:
        tfds_prepare.prepare(name, tmp_path / "data", data_source=raw)
    message = str(e.value)
    assert "\n" not in message
    assert os.path.basename(removed).split("-0")[0] in message  # lm1b names the glob
    assert f"make_offline {dataset} {tmp_path / 'raw'}" in message
    assert not tfds.builder(name, data_dir=tmp_path / "data").is_prepared()


def test_failed_build_leaves_no_dataset(tmp_path):
    """A tree the check passes but the builder rejects (misaligned parallel files)."""
    raw = make_offline.write_wmt14_tree(tmp_path / "raw", max_train=10)
    with open(raw / "un/undoc.2000.fr-en.fr", "a", encoding="utf-8") as f:
        f.write("Une ligne de trop.\n")
    with pytest.raises(DataError, match="Sizes do not match"):
        tfds_prepare.prepare(WMT14, tmp_path / "data", data_source=raw)
    left = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert all(".config" in p.parts for p in left), left  # only the default-config note
    assert not tfds.builder(WMT14, data_dir=tmp_path / "data").is_prepared()
    # Repairing the tree and preparing again works.
    shutil.rmtree(raw)
    make_offline.write_wmt14_tree(raw, max_train=10)
    builder = tfds_prepare.prepare(WMT14, tmp_path / "data", data_source=raw)
    assert builder.info.splits["train"].num_examples == 10


def test_no_network_is_a_quick_data_error(tmp_path, monkeypatch):
    def no_dns(host, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(urllib.request, "getproxies", dict)
    with pytest.raises(DataError, match="no network.*make_offline"):
        tfds_prepare.prepare("lm1b", tmp_path / "data")
    assert not (tmp_path / "data" / "lm1b" / "1.1.0").exists()


def test_unknown_dataset_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="unknown TFDS dataset"):
        tfds_prepare.prepare("no_such_dataset_xyz", tmp_path)


def test_offline_download_manager_keeps_structures(tmp_path):
    dl = tfds_prepare.OfflineDownloadManager(tmp_path / "raw", download_dir=tmp_path / "dl")
    raw = tmp_path / "raw"
    assert dl.download_and_extract("http://a/x.tgz") == raw
    assert dl.download_and_extract([]) == []  # wmt asks for an empty list
    assert dl.download_and_extract({"a": ["http://a/x.tgz", "http://b/y.tgz"], "b": []}) == {
        "a": [raw, raw], "b": []}
    assert dl.extract({}) == {}
    assert dl.download([tfds.download.Resource(url="http://c/z.gz")]) == [raw]
    assert dl.requested == ["http://a/x.tgz", "http://a/x.tgz", "http://b/y.tgz",
                            "http://c/z.gz"]


def test_make_offline_refuses_to_overwrite(raw, capsys):
    before = _snapshot(raw)
    for dataset in ("lm1b", "wmt14"):
        assert make_offline.main([dataset, str(raw), "--max_train", "5"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("make_offline: error: ") and err.count("\n") == 1
        assert "already holds a " + dataset in err
    assert _snapshot(raw) == before
    assert not [p for p in raw.parent.iterdir() if p != raw]  # no temporary directory left


def test_make_offline_cli_writes_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "new" / "raw"
    assert make_offline.main(["lm1b", str(out), "--max_train", "3"]) == 0
    assert (f"python -m mtrain --gin_file=quickstart.gin --cpu_devices=8 --data_source={out} "
            f"--model_dir=runs/lm1b_raw") in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.joinpath("new").iterdir()) == ["raw"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        make_offline.lm1b_files())
    with pytest.raises(SystemExit) as e:
        make_offline.parse_args(["wmt15", str(out)])
    assert e.value.code == 2
