"""SentencePiece vocabularies: conventions, round trip, caching, clear errors."""

import itertools
import os
import pickle
import re

import numpy as np
import pytest

from mtrain.data.sources import BibleLM
from mtrain.data.vocabulary import (
    EOS_ID, PAD_ID, VocabularyError, get_or_train_vocabulary, load_vocabulary, train_vocabulary)


def some_texts(n=1000):
    return list(itertools.islice(BibleLM("en").texts("train"), n))


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "bible_en_300.model"
    train_vocabulary(some_texts(), 300, path)
    return path


def test_conventions_and_round_trip(vocab_path):
    vocab = load_vocabulary(vocab_path)
    assert (vocab.vocab_size, vocab.pad_id, vocab.eos_id) == (300, PAD_ID, EOS_ID) == (300, 0, 1)
    for text in some_texts(50):
        ids = vocab.encode(text)
        assert EOS_ID not in ids and PAD_ID not in ids
        assert vocab.decode(ids) == text
    ids = vocab.encode("And God said")
    # decode skips padding and stops at the first EOS.
    assert vocab.decode([PAD_ID] + ids + [EOS_ID] + vocab.encode("junk")) == "And God said"
    assert vocab.decode(np.array(ids + [EOS_ID, PAD_ID, PAD_ID])) == "And God said"
    assert load_vocabulary(vocab_path).model_proto == vocab_path.read_bytes()


def test_encode_batch_matches_encode_and_survives_pickling(vocab_path):
    """The pipeline's one SentencePiece call per window, and the vocabulary as Grain's
    worker processes receive it."""
    vocab = load_vocabulary(vocab_path)
    texts = some_texts(20)
    values, row_splits = pickle.loads(pickle.dumps(vocab)).encode_batch(texts, add_eos=True)
    assert values.dtype == np.int32 and row_splits.dtype == np.int64
    assert [values[a:b].tolist() for a, b in zip(row_splits[:-1], row_splits[1:])] == [
        vocab.encode(t) + [EOS_ID] for t in texts]


def test_training_is_deterministic(tmp_path, vocab_path):
    train_vocabulary(some_texts(), 300, tmp_path / "again.model")
    assert (tmp_path / "again.model").read_bytes() == vocab_path.read_bytes()
    assert os.listdir(tmp_path) == ["again.model"]  # no temporary file left behind


def test_get_or_train_caches(tmp_path, capsys):
    path = tmp_path / "sub" / "v.model"
    calls = []

    def texts():
        calls.append(1)
        return some_texts(500)

    first = get_or_train_vocabulary(path, texts, 200, texts_name="500 verses")
    captured = capsys.readouterr()  # the one line goes to stderr, with the logs
    assert captured.err == f"training a 200-piece sentencepiece vocabulary on 500 verses -> {path}\n"
    assert captured.out == ""
    mtime = path.stat().st_mtime_ns
    second = get_or_train_vocabulary(path, texts, 200)
    assert capsys.readouterr().err == ""
    assert calls == [1] and path.stat().st_mtime_ns == mtime
    assert second.model_proto == first.model_proto
    with pytest.raises(VocabularyError, match=re.escape(f"{path} has 200 pieces but 300")):
        get_or_train_vocabulary(path, texts, 300)


def test_missing_or_garbage_model_is_a_clear_error(tmp_path):
    missing = tmp_path / "missing.model"
    with pytest.raises(VocabularyError, match=re.escape(str(missing))):
        load_vocabulary(missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(VocabularyError, match=re.escape(f"{garbage} is not a sentencepiece model")):
        load_vocabulary(garbage)
    with pytest.raises(VocabularyError, match=re.escape(str(garbage))):
        get_or_train_vocabulary(garbage, some_texts, 300)
