"""A user's own data: formats cut and weighted, files prepared once by what they are, and
mixtures drawn by weight and resumed exactly (`data.formats`, `data.prepared`,
`data.lanes`)."""

import json
import os

import numpy as np
import pytest

from mtrain.data import formats, pipeline, prepared
from mtrain.data.lanes import PERIOD, Mixture
from mtrain.data.streams import Stream, Streams
from mtrain.data.sources import BibleLM
from mtrain.data.vocabulary import train_vocabulary
from mtrain.errors import DataError


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "v.model"
    return train_vocabulary(BibleLM("en").texts("train", limit=3000), 300, str(path))


def flat_of(*examples):
    return formats.flat([list(e) for e in examples])


def test_text_pieces_cut_long_examples_and_read_the_start_token_first():
    encoded = formats.Encoded({"targets": flat_of(range(10, 17), [5, 6])})
    keys, example = formats.pieces(encoded, 3, reads_first=False, start_id=9, with_inputs=True)
    values, splits = keys["targets"]
    pieces = [values[a:b].tolist() for a, b in zip(splits[:-1], splits[1:])]
    assert pieces == [[10, 11, 12], [13, 14, 15], [16], [5, 6]]  # cut, nothing trimmed
    assert example.tolist() == [0, 0, 0, 1]
    inputs = keys["targets_inputs"][0]
    assert inputs.tolist() == [9, 10, 11, 9, 13, 14, 9, 9, 5]  # each piece a new document
    assert keys["targets_weights"][0].tolist() == [1] * 9


def test_fine_tuning_pieces_read_the_true_token_before_and_drop_unweighted_pieces():
    ids, mask = [20, 21, 22, 23, 24, 25, 26], [0, 0, 0, 0, 0, 1, 1]
    encoded = formats.Encoded({"targets": flat_of(ids)}, np.array(mask, np.int32))
    keys, _ = formats.pieces(encoded, 3, reads_first=True, start_id=9, with_inputs=True)
    values, splits = keys["targets"]
    # targets ids[1:] cut in threes: [21 22 23] (no weight: dropped), [24 25 26]
    assert values.tolist() == [24, 25, 26] and splits.tolist() == [0, 3]
    assert keys["targets_inputs"][0].tolist() == [23, 24, 25]  # the true previous tokens
    assert keys["targets_weights"][0].tolist() == [0, 1, 1]


def test_pretokenized_ids_are_checked_against_the_vocabulary(vocab):
    fmt = formats.Pretokenized()
    out = fmt.encode([{"input_ids": [3, 4]}, {"input_ids": [5]}], vocab)
    assert out.keys["targets"][0].tolist() == [3, 4, 5]  # as they are: nothing appended
    with pytest.raises(DataError, match=r"f\.jsonl line 2: 'input_ids' holds the id 300"):
        fmt.encode([{"input_ids": [3]}, {"input_ids": [300]}], vocab, ["f.jsonl line 1",
                                                                      "f.jsonl line 2"])


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_files_are_prepared_once_and_again_when_edited(tmp_path, vocab):
    texts = [f"In the beginning {i} God created the heaven" for i in range(300)]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in texts])
    spec = prepared.Files(train=corpus, validation=0.1)
    fmt = spec.make_format()
    data = tmp_path / "data"
    first = prepared.prepare(spec, fmt, vocab, str(data))
    held = first.num_examples("validation")
    assert first.num_examples("train") + held == 300 and 10 < held < 60
    info = os.path.join(first.directory, "info.json")
    made = os.stat(info).st_mtime_ns
    again = prepared.prepare(spec, fmt, vocab, str(data))
    assert again.directory == first.directory and os.stat(info).st_mtime_ns == made
    ids, weights = first.records("train")[0]
    assert weights is None and ids[0][-1] == vocab.eos_id
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in texts[:200]])
    edited = prepared.prepare(spec, fmt, vocab, str(data))
    assert edited.directory != first.directory
    assert edited.num_examples("train") + edited.num_examples("validation") == 200
    # The same records are held out from the same files wherever they are prepared.
    elsewhere = prepared.prepare(spec, fmt, vocab, str(tmp_path / "other"))
    assert [r[0][0].tolist() for r in elsewhere.records("validation")] == \
        [r[0][0].tolist() for r in edited.records("validation")]


def test_a_bad_record_stops_preparing_with_its_file_and_line(tmp_path, vocab):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"body": "b"}])
    spec = prepared.Files(train=corpus)
    with pytest.raises(DataError, match=r"c\.jsonl line 2: no 'text' in this record"):
        prepared.prepare(spec, spec.make_format(), vocab, str(tmp_path / "data"))
    assert not list((tmp_path / "data" / "prepared").iterdir())  # nothing left behind


def test_mixture_pattern_counts_each_source_by_weight():
    mixture = Mixture([0.25, 0.75])
    assert mixture.counts.tolist() == [250, 750]
    taken = mixture.taken(np.arange(PERIOD + 1))
    assert (np.diff(taken, axis=0).sum(axis=1) == 1).all()  # one source per slot
    assert abs(taken[40, 0] - 10) <= 1  # spread evenly, not in runs
    with pytest.raises(DataError, match="below 1/1000"):
        Mixture([1, 2000])


def mixture_streams(tmp_path, vocab):
    out = []
    for name, word in (("code", "alpha"), ("web", "omega")):
        corpus = write_jsonl(tmp_path / f"{name}.jsonl",
                             [{"text": f"{word} {i}"} for i in range(200)])
        spec = prepared.Files(train=corpus)
        source = prepared.prepare(spec, spec.make_format(), vocab, str(tmp_path / "data"), name)
        out.append(Stream(name, source.records("train"), source.format,
                          {"code": 0.25, "web": 0.75}[name], source.fingerprint()))
    return out


def mixed(streams, vocab, **kwargs):
    return pipeline.batches(Streams(streams), vocab, "train", pipeline.BatchSettings(
        sequence_length=16, batch_size=8, seed=3, train=True, window=32, **kwargs))


@pytest.mark.slow  # (about 20 s)
def test_mixture_draws_by_weight_and_resumes_exactly(tmp_path, vocab):
    streams = mixture_streams(tmp_path, vocab)
    alpha = vocab.encode("alpha")[0]
    batches = mixed(streams, vocab)
    rows = [next(batches) for _ in range(250)]
    firsts = np.concatenate([b["targets"][(b["targets_positions"] == 0)
                                          & (b["targets_segment_ids"] > 0)] for b in rows])
    share = np.mean(firsts == alpha)
    assert len(firsts) >= 2000 and abs(share - 0.25) < 0.02, share
    assert batches.taken()["code"] + batches.taken()["web"] >= len(firsts)
    fractions = batches.mixture_fractions()  # what the train log reports
    assert abs(fractions["code"] - 0.25) < 0.02 and abs(sum(fractions.values()) - 1) < 1e-9
    for shards, workers in (((0, 1), 0), ((0, 1), 2), ((1, 2), 0)):
        fresh = mixed(streams, vocab, shard=shards, workers=workers)
        for _ in range(7):
            next(fresh)
        fresh.save(tmp_path / f"state{shards}{workers}")
        after = [next(fresh) for _ in range(4)]
        fresh.close()
        resumed = mixed(streams, vocab, shard=shards, workers=workers)
        resumed.restore(tmp_path / f"state{shards}{workers}")
        for a, b in zip(after, [next(resumed) for _ in range(4)]):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
        resumed.close()
        saved = json.loads((tmp_path / f"state{shards}{workers}").glob("*.json").__next__()
                           .read_text())
        assert set(saved["sources"]) == {"code", "web"}


def test_a_split_of_empty_files_says_so(tmp_path, vocab):
    spec = prepared.Files(train=write_jsonl(tmp_path / "empty.jsonl", []))
    source = prepared.prepare(spec, spec.make_format(), vocab, str(tmp_path / "data"))
    with pytest.raises(DataError, match="'train' split of .* has no examples"):
        source.check_split("train")


def test_an_implausible_share_of_loss_tokens_is_said_when_a_run_starts(tmp_path, vocab,
                                                                         caplog):
    """A chat whose every token carries loss (a template marking it all) and one whose
    assistant says almost nothing: each a warning naming its source; a plausible one
    none."""
    from mtrain.data.chat import ChatTemplate
    from mtrain.data.user_data import UserData

    everything = ChatTemplate("{% for m in messages %}{% generation %}{{ m['content'] }} "
                              "{% endgeneration %}{% endfor %}", vocab, name="all.jinja")
    turns = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == "
                         "'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                         "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}", vocab,
                         name="turns.jinja")
    verse = "In the beginning God created the heaven and the earth. "
    chats = {"all": ([verse, verse], everything), "terse": ([verse * 60, "Yea."], turns),
             "fair": ([verse, verse], turns)}
    sources = {}
    for name, ((asked, said), template) in chats.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": [
            {"role": "user", "content": asked}, {"role": "assistant", "content": said}]}] * 4)
        spec = prepared.Files(train=path, format="chat")
        sources[name] = prepared.prepare(spec, spec.make_format(template), vocab,
                                         str(tmp_path / "data"), name)
    caplog.clear()
    with caplog.at_level("INFO", logger="mtrain"):
        UserData(None, sources).check_loss_fraction()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("all: every token of the chats carries loss")
    assert warnings[1].startswith("terse: only 0.") and "carry loss" in warnings[1]
    assert sum("carry loss" in r.getMessage() for r in caplog.records) == 4  # 3 counts
