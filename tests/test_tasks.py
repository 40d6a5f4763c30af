"""Tasks on TFDS sources (built offline by the real builders): reading by index, packed
translation pairs, host sharding, resume, word-level perplexity, and a CLI run of lm1b."""

import json
import os
import shutil
import types

import numpy as np
import pytest

from mtrain.evaluation import heldout as evaluation
from mtrain.data import tasks
from mtrain.data import bible, make_offline, sources
from mtrain.data.pipeline import BatchSettings, batches
from mtrain.errors import ConfigError, DataError
from mtrain.data.vocabulary import EOS_ID, UNK_ID, train_vocabulary

MAX_TRAIN = 1500
LENGTH, BATCH, WINDOW = 64, 4, 16


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw")
    make_offline.write_lm1b_tree(root, max_train=MAX_TRAIN)
    make_offline.write_wmt14_tree(root, max_train=MAX_TRAIN)
    return str(root)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def lm1b(raw, data_dir):
    return tasks.get_task("lm1b").source(data_dir, raw)


@pytest.fixture(scope="module")
def wmt(raw, data_dir):
    return tasks.get_task("wmt14_enfr").source(data_dir, raw)


@pytest.fixture(scope="module")
def en_vocab(lm1b, tmp_path_factory):
    return train_vocabulary(lm1b.texts("train"), 400, tmp_path_factory.mktemp("v") / "en.model")


def test_tfds_sources_read_the_prepared_splits_by_index(lm1b, wmt, data_dir, raw):
    assert lm1b.features == ("text",) and set(lm1b.splits) == {"train", "test"}
    # The source that built the dataset and one that loads it describe it alike, in plain
    # strings (a checkpoint's input fingerprint is compared across processes and machines).
    loaded = tasks.get_task("lm1b").source(data_dir, raw)
    assert all(type(split) is str for split in (*lm1b.splits, *loaded.splits))
    assert loaded.fingerprint() == lm1b.fingerprint() == (
        f"TFDS lm1b:1.1.0 from local raw files (test {lm1b.num_examples('test')}, train "
        f"{MAX_TRAIN} examples)")
    assert lm1b.num_examples("train") == MAX_TRAIN
    assert lm1b.num_examples("test") == len(bible.bible_split_verses("test"))
    assert sorted(lm1b.texts("train")) == sorted(v.en for v in bible.bible_split_verses("train")[:MAX_TRAIN])
    assert set(wmt.features) == {"en", "fr"}
    assert set(wmt.splits) == {"train", "validation", "test"}
    assert wmt.num_examples("validation") == len(bible.bible_split_verses("validation"))
    # records read exactly the examples asked for, in the order asked, as strings.
    records = wmt.records("test")
    block = [records[5], records[0], *records.__getitems__([5])]
    en, fr = [[x[k] for x in block] for k in ("en", "fr")]
    pairs = {v.en: v.fr for v in bible.bible_split_verses("test")}
    assert en[0] == en[2] and all(pairs[e] == f for e, f in zip(en, fr))
    # Prepared once, in a TFDS dir of this origin, and found again without rebuilding.
    tfds_dir = sources.tfds_data_dir(data_dir, raw)
    assert (tfds_dir / "lm1b" / "1.1.0").is_dir() and tfds_dir != sources.tfds_data_dir(data_dir, None)
    again = tasks.get_task("lm1b").source(data_dir, raw)
    assert again.num_examples("train") == MAX_TRAIN
    with pytest.raises(DataError, match="unknown split 'validation'.*train, test"):
        lm1b.records("validation")


def test_bible_tasks_reject_a_data_source(data_dir):
    with pytest.raises(ConfigError, match="applies to TFDS tasks only"):
        tasks.get_task("bible_lm").source(data_dir, "/somewhere")


def test_wmt14_enfr_batches_pack_english_inputs_with_french_targets(wmt, tmp_path):
    task = tasks.get_task("wmt14_enfr")
    assert task.features == {"inputs": "en", "targets": "fr"}
    joint = train_vocabulary(wmt.texts("train"), 600, tmp_path / "joint.model")
    pairs = {v.en: v.fr for v in bible.bible_split_verses("train")}
    batch = next(batches(wmt.packs(task.features), joint, "train", BatchSettings(
        sequence_length=96, batch_size=BATCH, seed=3, train=True, window=WINDOW)))
    checked = 0
    for i in range(BATCH):
        segments = {key: batch[f"{key}_segment_ids"][i] for key in ("inputs", "targets")}
        assert segments["inputs"].max() == segments["targets"].max() >= 1
        for s in range(1, segments["inputs"].max() + 1):
            en = batch["inputs"][i][segments["inputs"] == s].tolist()
            fr = batch["targets"][i][segments["targets"] == s].tolist()
            positions = batch["targets_positions"][i][segments["targets"] == s]
            assert positions.tolist() == list(range(len(fr)))  # restart per segment
            if EOS_ID in en and EOS_ID in fr and UNK_ID not in en + fr:
                assert pairs[joint.decode(en)] == joint.decode(fr)
                checked += 1
    assert checked >= 2


def test_tfds_batches_shard_by_host_and_resume_exactly(lm1b, en_vocab, tmp_path):
    def make(**kwargs):
        return batches(lm1b.packs({"targets": "text"}), en_vocab, "train", BatchSettings(
            sequence_length=LENGTH, batch_size=BATCH, seed=2, train=True, window=WINDOW,
            **kwargs))

    single = make()
    hosts = [make(shard=(p, 2)) for p in range(2)]
    for _ in range(2):
        expected = next(single)
        halves = [next(h) for h in hosts]
        for key in expected:  # host p gets rows [2p, 2p + 2) of every global batch
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]),
                                          expected[key])
    single.save(tmp_path)
    wanted = [next(single) for _ in range(3)]
    resumed = make()
    resumed.restore(tmp_path)
    for a, b in zip(wanted, [next(resumed) for _ in range(3)]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_corrupt_prepared_file_is_one_line_with_and_without_workers(lm1b, en_vocab, raw,
                                                                    data_dir, tmp_path):
    """A prepared array_record file that does not read back (a disk error, a bad copy) is a
    DataError naming the dataset and what to do, from a worker process as from this one."""
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    [train] = (copy / "tfds_local").rglob("lm1b-train.array_record*")
    data = bytearray(train.read_bytes())
    data[len(data) // 10:-len(data) // 10] = bytes(len(data) - 2 * (len(data) // 10))
    train.write_bytes(bytes(data))
    source = tasks.get_task("lm1b").source(str(copy), raw)
    for workers in (0, 2):
        pipeline = batches(source.packs({"targets": "text"}), en_vocab, "train", BatchSettings(
            sequence_length=LENGTH, batch_size=BATCH, train=True, window=WINDOW,
            workers=workers))
        with pytest.raises(DataError, match=r"cannot read the prepared dataset .*lm1b/1\.1\.0 "
                                            r"\(.*\): delete it, and the next run prepares it"):
            next(pipeline)
        pipeline.close()


def test_word_count_is_words_plus_end_of_sentence(lm1b, en_vocab):
    exp = types.SimpleNamespace(source=lm1b, eval_split="test", vocab=en_vocab, cache={},
                                sequence_length=100_000)  # nothing trimmed
    stats = evaluation.heldout_statistics(exp)
    texts = list(lm1b.texts("test"))
    assert stats["words"] == sum(len(t.split()) + 1 for t in texts)
    assert 1 < stats["unigram_perplexity"] < en_vocab.vocab_size
    # Evaluation cuts long texts into pieces and scores every token: the same words at any
    # sequence length.
    short = types.SimpleNamespace(**{**vars(exp), "sequence_length": 8})
    assert evaluation.heldout_statistics(short)["words"] == stats["words"]


@pytest.mark.slow
def test_cli_trains_lm1b_offline_from_the_shipped_corpus(tmp_path, monkeypatch):
    from mtrain.__main__ import main

    monkeypatch.setenv("MTRAIN_DATA_DIR", str(tmp_path / "data"))
    params = ["transformer.d_model=32", "transformer.d_ff=64", "transformer.num_heads=2",
              "transformer.d_kv=16", "transformer.num_layers=1", "transformer.max_length=32",
              "vocabulary.size=300", "run.batch_size=8", "run.sequence_length=32",
              "run.train_steps=3", "run.log_every=1", "learning_rate_schedule.warmup_steps=2"]
    argv = ["--gin_file=tasks/lm1b.gin", "--gin_file=layouts/dp4_mp2.gin",
            f"--model_dir={tmp_path / 'run'}", "--data_source=shipped"]
    assert main(argv + [f"--gin_param={p}" for p in params]) == 0
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        final = [json.loads(line) for line in f][-1]
    assert final["step"] == 3
    # exp(token loss x tokens / words): word perplexity from the same log-loss.
    expected = np.exp(final["eval/loss"] * final["eval/num_tokens"] / final["eval/num_words"])
    assert final["eval/word_perplexity"] == pytest.approx(expected, rel=1e-6)
    assert final["eval/word_perplexity"] > final["eval/perplexity"]  # several tokens a word
    assert final["eval/num_words"] > 10_000  # the four test books, trimmed to 32 tokens
    assert os.path.isdir(tmp_path / "data" / "raw" / "lm1b")
    assert os.path.isdir(tmp_path / "data" / "tfds_shipped" / "lm1b" / "1.1.0")
    assert os.path.isfile(tmp_path / "data" / "tfds_shipped" / "mtrain" / "lm1b" / "spm_300.model")


def test_translation_tasks_are_refused_until_the_encoder_decoder_exists(tmp_path):
    from mtrain.__main__ import main

    argv = ["--gin_file=tasks/bible_enfr.gin", f"--model_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    assert not (tmp_path / "run").exists()
