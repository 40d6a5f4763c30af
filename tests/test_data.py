"""Input pipeline: Bible splits, packing, host sharding, workers, resumable iterators, eval
passes."""

import itertools
import json

import numpy as np
import pytest

from mtrain.data import bible, formats, lanes, packing, pipeline
from mtrain.data.pipeline import BatchSettings, batches, lm_batches
from mtrain.models.base import batch_keys
from mtrain.data.sources import BibleLM, BibleTranslation
from mtrain.errors import DataError, IncompatibleRun
from mtrain.data.vocabulary import EOS_ID, UNK_ID, train_vocabulary

LENGTH = 32  # small shapes keep the tests fast
BATCH = 4
WINDOW = 16
EN = BibleLM("en")  # one source, so its split tensors are made once


@pytest.fixture(scope="session")
def vocab(tmp_path_factory):
    texts = itertools.islice(EN.texts("train"), 3000)
    return train_vocabulary(texts, 500, tmp_path_factory.mktemp("vocab") / "en_500.model")


# --- sources -----------------------------------------------------------------------------

VALIDATION_BOOKS, TEST_BOOKS = bible.VALIDATION_BOOKS, bible.TEST_BOOKS
GENESIS_1_1 = ("In the beginning God created the heaven and the earth.",
               "Au commencement, Dieu créa les cieux et la terre.")


def test_bible_splits_are_disjoint_sets_of_books():
    assert not VALIDATION_BOOKS.keys() & TEST_BOOKS.keys()
    books = {split: {v.book for v in bible.bible_split_verses(split)} for split in bible.SPLITS}
    assert books["validation"] == VALIDATION_BOOKS.keys()
    assert books["test"] == TEST_BOOKS.keys()
    assert books["train"] == set(range(1, 67)) - VALIDATION_BOOKS.keys() - TEST_BOOKS.keys()
    sizes = {split: len(bible.bible_split_verses(split)) for split in bible.SPLITS}
    assert sum(sizes.values()) == len(bible.bible_verses()) == 31_102
    assert 0.02 < sizes["validation"] / 31_102 < 0.04 and 0.02 < sizes["test"] / 31_102 < 0.04


def test_known_verse_is_in_train():
    assert bible.bible_verses()[0] == (1, 1, 1, *GENESIS_1_1)
    assert BibleLM("en").columns("train")["text"][0] == GENESIS_1_1[0]
    assert BibleLM("fr").columns("train")["text"][0] == GENESIS_1_1[1]
    first = BibleTranslation("en", "fr").records("train")[0]
    assert (first["inputs"], first["targets"]) == GENESIS_1_1
    assert GENESIS_1_1[0] not in set(BibleLM("en").texts("validation"))


def test_unknown_split_or_language_is_a_clear_error():
    with pytest.raises(DataError, match="unknown split 'valid'.*train, validation, test"):
        BibleLM().records("valid")
    with pytest.raises(ValueError, match="languages"):
        BibleLM("de")


def test_lanes_partition_a_split_and_shuffle_every_epoch(vocab):
    """Lane r of B reads shard r of B of the split (every B-th example from r on), a new
    permutation of it every epoch, the same for the same seed."""
    split = EN.columns("test")["text"]
    texts = lambda rows: [vocab.decode(seq) for row in rows for seq in unpack_rows(row)]
    pack = lanes.PackWindow([lanes.Stream("en", EN.records("test"), formats.Text())], vocab, 512)
    streams = [lanes.lane_windows([len(split)], r, 3, seed=7, window=len(split[r::3]), pack=pack)
               for r in range(3)]
    epoch1, epoch2 = texts([streams[1][0]]), texts([streams[1][1]])
    shard = [vocab.decode(vocab.encode(t)) for t in split[1::3]]
    assert sorted(epoch1) == sorted(epoch2) == sorted(shard)
    assert epoch1 != epoch2 and epoch1 != shard
    again = lanes.lane_windows([len(split)], 1, 3, seed=7, window=len(shard), pack=pack)
    assert texts([again[0]]) == epoch1
    assert sorted(sum((texts([lane[0]]) for lane in streams), [])) == sorted(
        vocab.decode(vocab.encode(t)) for t in split)


def unpack_rows(rows):
    return [seq for i in range(len(rows["targets"]))
            for seq in unpack({k: v[i] for k, v in rows.items()}, "targets")]


# --- packing -----------------------------------------------------------------------------

def random_examples(rng, count, max_length):
    """Token sequences of random lengths (some longer than the packing length), EOS last."""
    return [np.append(rng.integers(2, 100, size=rng.integers(0, max_length)), EOS_ID)
            .astype(np.int32) for _ in range(count)]


def unpack(row, key):
    """The sequences of a packed row, split by segment id, checking positions and padding."""
    tokens, segments, positions = (row[key], row[f"{key}_segment_ids"], row[f"{key}_positions"])
    assert (tokens[segments == 0] == 0).all() and (positions[segments == 0] == 0).all()
    used = segments > 0
    assert used[:used.sum()].all()  # padding only at the end
    assert (np.diff(segments[used]) >= 0).all()  # segments one after the other
    sequences = []
    for segment in range(1, segments.max(initial=0) + 1):
        where = np.flatnonzero(segments == segment)
        assert len(where) and (np.diff(where) == 1).all()  # contiguous
        assert (positions[where] == np.arange(len(where))).all()
        sequences.append(tokens[where].tolist())
    return sequences


def pack(examples, keys, length, window):
    """As the pipeline packs: `window` examples at a time; the rows one by one."""
    rows = []
    for start in range(0, len(examples), window):
        arrays = []
        for key in keys:
            sequences = [x[key] for x in examples[start:start + window]]
            arrays += [np.concatenate(sequences).astype(np.int32),
                       np.cumsum([0] + [len(x) for x in sequences]).astype(np.int64)]
        packed = dict(zip(batch_keys(keys), packing.pack_arrays(arrays, length)))
        rows += [{k: v[i] for k, v in packed.items()} for i in range(len(packed[keys[0]]))]
    return rows


def test_packing_one_key_keeps_examples_whole_and_in_order():
    rng = np.random.default_rng(0)
    # Each example starts with its own number (200 + i), to tell its place in a row.
    examples = [{"targets": np.append(200 + i, x).astype(np.int32)}
                for i, x in enumerate(random_examples(rng, 100, 30))]
    rows = pack(examples, ("targets",), 16, window=9)
    for row in rows:
        assert set(row) == {"targets", "targets_segment_ids", "targets_positions"}
        assert all(v.shape == (16,) and v.dtype == np.int32 for v in row.values())
    unpacked = [seq for row in rows for seq in unpack(row, "targets")]
    expected = [x["targets"][:16].tolist() for x in examples]  # trimmed to 16
    assert sorted(unpacked) == sorted(expected)  # each example once, whole
    for row in rows:  # a row's examples in their order in the window
        found = [seq[0] for seq in unpack(row, "targets")]
        assert found == sorted(found)
    assert any(len(x["targets"]) > 16 for x in examples)
    assert max(row["targets_segment_ids"].max() for row in rows) > 1  # rows hold several
    # First fit: no example could have joined an earlier row of its window.
    for window in range(0, 100, 9):
        room = []  # per row of the window: (free positions, numbers of its examples)
        for row in rows:
            numbers = [seq[0] - 200 for seq in unpack(row, "targets")]
            if window <= numbers[0] < window + 9:
                room.append((16 - (row["targets_segment_ids"] > 0).sum(), numbers))
        for r, (_, numbers) in enumerate(room):
            for number in numbers:
                n = min(len(examples[number]["targets"]), 16)
                assert all(free < n or min(earlier) > number for free, earlier in room[:r])


def test_packing_worked_example():
    """packing.py's docstring: the third example goes back into the first row (first fit;
    next fit would have started a third row), and windows never share a row."""
    examples = [{"targets": np.array(x, np.int32)}
                for x in ([7, 8, 1], [9, 9, 9, 9, 9, 1], [5, 1], [4, 1])]
    rows = pack(examples, ("targets",), 8, window=3)
    assert [r["targets"].tolist() for r in rows] == [[7, 8, 1, 5, 1, 0, 0, 0],
                                                     [9, 9, 9, 9, 9, 1, 0, 0],
                                                     [4, 1, 0, 0, 0, 0, 0, 0]]
    assert [r["targets_segment_ids"].tolist() for r in rows] == [[1, 1, 1, 2, 2, 0, 0, 0],
                                                                 [1, 1, 1, 1, 1, 1, 0, 0],
                                                                 [1, 1, 0, 0, 0, 0, 0, 0]]
    assert [r["targets_positions"].tolist() for r in rows] == [[0, 1, 2, 0, 1, 0, 0, 0],
                                                               [0, 1, 2, 3, 4, 5, 0, 0],
                                                               [0, 1, 0, 0, 0, 0, 0, 0]]


def test_packing_two_keys_keeps_segments_aligned():
    rng = np.random.default_rng(1)
    examples = [{"inputs": a, "targets": b}
                for a, b in zip(random_examples(rng, 80, 20), random_examples(rng, 80, 12))]
    rows = pack(examples, ("inputs", "targets"), 12, window=10)
    pairs = []
    for row in rows:
        inputs, targets = unpack(row, "inputs"), unpack(row, "targets")
        assert len(inputs) == len(targets)  # example i is segment i in both keys
        pairs += zip(inputs, targets)
    assert sorted(pairs) == sorted((x["inputs"][:12].tolist(), x["targets"][:12].tolist())
                                   for x in examples)


# --- batches -----------------------------------------------------------------------------

def train_batches(vocab, **kwargs):
    return lm_batches(EN, vocab, "train", LENGTH, BATCH, seed=5, train=True,
                      window=WINDOW, **kwargs)


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_train_batches_shape_and_content(vocab):
    batch = next(train_batches(vocab))
    assert set(batch) == {"targets", "targets_segment_ids", "targets_positions"}
    for value in batch.values():
        assert value.shape == (BATCH, LENGTH) and value.dtype == np.int32
    train = list(EN.texts("train"))
    for i in range(BATCH):
        for sequence in unpack({k: v[i] for k, v in batch.items()}, "targets"):
            if UNK_ID not in sequence:  # each is a training verse, or a piece of one
                text = vocab.decode(sequence).strip()
                assert any(text in verse for verse in train), text


def test_process_batches_are_rows_of_the_global_batch(vocab):
    single = train_batches(vocab)
    halves = [train_batches(vocab, shard=(p, 2)) for p in range(2)]
    for _ in range(3):
        expected = next(single)
        got = [next(h) for h in halves]
        assert_same([expected], [{k: np.concatenate([g[k] for g in got]) for k in expected}])


def test_restored_iterator_continues_exactly(vocab, tmp_path):
    batches = train_batches(vocab)
    for _ in range(2):
        next(batches)
    batches.save(tmp_path)
    expected = [next(batches) for _ in range(3)]
    restored = train_batches(vocab)
    restored.restore(tmp_path)
    assert_same([next(restored) for _ in range(3)], expected)
    other = lm_batches(EN, vocab, "train", LENGTH, BATCH, seed=6, train=True, window=WINDOW)
    with pytest.raises(IncompatibleRun, match=r"saved by another pipeline: seed=5 there, 6 here"):
        other.restore(tmp_path)
    with pytest.raises(DataError, match="no input pipeline state"):
        train_batches(vocab).restore(tmp_path / "none")


@pytest.mark.slow  # (worker processes: about 12 s)
def test_workers_make_the_same_batches_and_resume_exactly(vocab, tmp_path):
    """Three Grain worker processes, making the rows of 2, 1 and 1 of the 4 lanes, give the
    batches of the in-process pipeline; a position saved with workers restores without them
    and with two the other way round, and the saved positions are each lane's next row."""
    alone, workers = train_batches(vocab), train_batches(vocab, workers=3)
    try:
        assert workers.workers == 3
        assert_same([next(alone) for _ in range(3)], [next(workers) for _ in range(3)])
        workers.save(tmp_path / "workers")
        alone.save(tmp_path / "alone")
        expected = [next(alone) for _ in range(4)]
        for saved, restored in (("workers", train_batches(vocab)),
                                ("alone", train_batches(vocab, workers=2))):
            restored.restore(tmp_path / saved)
            assert restored.position == 3
            assert_same([next(restored) for _ in range(4)], expected)
            restored.close()
    finally:
        workers.close()
    state = json.loads((tmp_path / "alone" / "input_pipeline.process-0-of-1.json").read_text())
    assert sorted(state["lanes"]) == [str(lane) for lane in range(BATCH)]
    assert train_batches(vocab, workers=5).workers == 4  # at most one per lane


def test_a_tf_data_position_of_an_older_mtrain_is_refused_in_one_line(vocab, tmp_path):
    """Checkpoints of the tf.data pipeline (fc8be58 and older) saved a tf.data state and a
    position, but no lanes: their order of examples cannot be continued. Resuming from one
    is an incompatible run (one line, what to do), and nothing is renamed."""
    import jax.numpy as jnp

    from mtrain.io.checkpoints import Checkpoints

    batches = train_batches(vocab)
    next(batches)
    state, meta = {"w": jnp.arange(4.0)}, {"model": {"d_model": 4}}
    checkpoints = Checkpoints(tmp_path / "checkpoints", async_save=False)
    checkpoints.save(1, state, batches, meta)
    data = tmp_path / "checkpoints" / "1" / "data"
    saved = data / "input_pipeline.process-0-of-1.json"
    old = {k: v for k, v in json.loads(saved.read_text()).items() if k != "lanes"}
    saved.write_text(json.dumps(dict(old, start=0)))  # as fc8be58 wrote it, with
    (data / "input_pipeline.process-0-of-1.state").write_bytes(b"tf.data")  # its state
    for listed in data.glob("*.sha256"):
        listed.unlink()  # (checksums of the files it wrote: not what this test is about)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(IncompatibleRun) as error:
        checkpoints.read(None, {"w": jnp.zeros(4)}, meta, iterator=train_batches(vocab))
    assert "\n" not in str(error.value)
    assert "tf.data pipeline of mtrain fc8be58 or older" in str(error.value)
    assert "run.init_from" in str(error.value)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    checkpoints.close()


def test_default_workers_follow_the_cores(monkeypatch):
    for cores, workers in [(None, 0), (2, 0), (8, 2), (16, 4), (64, 8)]:
        monkeypatch.setattr(pipeline.os, "cpu_count", lambda: cores)
        assert pipeline.default_workers() == workers


def test_a_different_number_of_processes_resumes_exactly(vocab, tmp_path):
    # Saved by one process after 3 batches; resumed by two (each its half of the lanes, read
    # from the one process's file), and back again by one from the two files.
    single = train_batches(vocab)
    for _ in range(3):
        next(single)
    single.save(tmp_path / "one")
    expected = [next(single) for _ in range(2)]
    halves = [train_batches(vocab, shard=(p, 2)) for p in range(2)]
    for h in halves:
        h.restore(tmp_path / "one")
        assert h.position == 3
    got = [[next(h) for h in halves] for _ in range(2)]
    assert_same(expected, [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in got])
    for h in halves:
        h.save(tmp_path / "two")
    more = next(single)
    again = train_batches(vocab)
    again.restore(tmp_path / "two")
    assert again.position == 5
    assert_same([more], [next(again)])
    (tmp_path / "two" / "input_pipeline.process-1-of-2.json").unlink()
    with pytest.raises(DataError, match="incomplete: no position of lanes"):
        train_batches(vocab).restore(tmp_path / "two")


def test_eval_pass_sees_every_token_once(vocab):
    length, batch_size = 64, 32
    batches = list(lm_batches(EN, vocab, "validation", length, batch_size, train=False))
    assert all(b["targets"].shape == (batch_size, length) for b in batches)
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    used = rows["targets_segment_ids"] > 0
    # Every verse, cut into pieces of at most `length`, once (each segment's positions
    # counting from 0: `unpack`).
    ids = [vocab.encode(t) + [EOS_ID] for t in EN.texts("validation")]
    expected = [x[i:i + length] for x in ids for i in range(0, len(x), length)]
    assert sorted(unpack_rows(rows)) == sorted(expected)
    assert (rows["targets"][~used] == 0).all()
    rows_used = used.any(axis=1)
    assert rows_used[:rows_used.sum()].all()  # only the last batch has all-zero rows

    halves = [list(lm_batches(EN, vocab, "validation", length, batch_size, train=False,
                              shard=(p, 2)))
              for p in range(2)]
    assert_same([{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)],
                batches)


def test_bad_process_count_is_a_clear_error(vocab):
    with pytest.raises(ValueError, match="batch_size 4 is not divisible into 3 shards"):
        train_batches(vocab, shard=(0, 3))


def test_translation_batches_pack_aligned_pairs(tmp_path):
    source = BibleTranslation("en", "fr")
    joint = train_vocabulary(itertools.islice(source.texts("train"), 4000), 700,
                             tmp_path / "joint.model")
    pairs = dict(zip(source.columns("train")["inputs"], source.columns("train")["targets"]))
    features = {"inputs": "inputs", "targets": "targets"}
    iterator = batches(source.packs(features), joint, "train", BatchSettings(
        sequence_length=96, batch_size=BATCH, seed=1, train=True,
        window=WINDOW))  # long enough for most verses to fit whole
    batch = next(iterator)
    assert set(batch) == {f"{k}{s}" for k in features for s in ("", "_segment_ids", "_positions")}
    checked = 0
    for i in range(BATCH):
        row = {k: v[i] for k, v in batch.items()}
        inputs, targets = unpack(row, "inputs"), unpack(row, "targets")
        assert len(inputs) == len(targets) >= 1  # pair i is segment i of inputs and targets
        for en_ids, fr_ids in zip(inputs, targets):
            if UNK_ID in en_ids or UNK_ID in fr_ids or EOS_ID not in en_ids:
                continue  # trimmed or not exactly decodable: skip
            en = joint.decode(en_ids)
            assert en in pairs, en
            assert pairs[en].startswith(joint.decode(fr_ids))
            checked += 1
    assert checked >= BATCH
