"""One data-source protocol (issue 59): every kind of data a run reads gives streams of
examples per split the same way; formats are registered by name, each cutting its long
examples its own way."""

import numpy as np
import pytest

from mtrain.data import formats, preference, prepared, ragged
from mtrain.data.sources import BibleLM, BibleTranslation
from mtrain.data.streams import DataSource, Stream, Streams
from mtrain.data.user_data import UserData
from mtrain.errors import DataError


def test_every_kind_of_source_is_a_data_source_of_streams():
    lm, pairs = BibleLM("en"), BibleTranslation("en", "fr")
    streams = Streams([Stream("s", [{"text": "a"}], formats.Text())])
    user = UserData(None, {})
    for source in (lm, pairs, streams, user):
        assert isinstance(source, DataSource)
    (stream,) = lm.streams("validation")
    assert isinstance(stream.format, formats.Text) and len(stream.records) == lm.num_examples(
        "validation")
    assert isinstance(pairs.streams("train")[0].format, formats.Translation)
    assert lm.input_config("train") == {"data": lm.fingerprint(), "features": {"targets": "text"}}
    assert streams.input_config("train") == {"data": ["s"], "features": ["Text(feature='text')"]}
    with pytest.raises(DataError, match="unknown split 'dev'"):
        lm.streams("dev")


def test_formats_are_registered_by_name_and_an_unknown_one_lists_them():
    assert formats.make("text_file", {"text": "body"}) == formats.Text("body")
    assert formats.make("translation", {"inputs": "en"}) == formats.Translation("en", "targets")
    made = prepared.Files(format="preference", columns={"chosen": "good"}).make_format()
    assert isinstance(made, preference.Preference) and made.chosen == "good" and made.paired
    with pytest.raises(DataError) as error:
        formats.make("csv")
    assert str(error.value) == ("files.format='csv'; use one of text, text_file, translation, "
                                "pretokenized, chat, prompt_completion, preference")


def test_each_format_cuts_its_long_examples_its_own_way():
    ids = np.arange(10, dtype=np.int32)
    examples = [(([ids[:7]], None), True), (([ids[7:]], None), False)]  # one text, in parts
    assert [p[0][0].tolist() for p in formats.Text().cut(iter(examples), 4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [p[0][0].tolist() for p in formats.Pretokenized().cut(iter(examples[1:]), 2)] == [
        [7, 8], [9]]
    chat = ([ids], np.ones(10, np.int32))  # a chat is cut to the run's length when packed
    assert list(formats.Chat().cut(iter([(chat, False)]), 4)) == [chat]


def test_row_splits_are_written_once():
    assert ragged.row_splits(np.array([2, 0, 3])).tolist() == [0, 2, 2, 5]
    values, splits = ragged.flat_ids([[1, 2], [], [3]])
    assert values.tolist() == [1, 2, 3] and splits.tolist() == [0, 2, 2, 3]
    assert ragged.gather(np.arange(10), np.array([5, 1]), np.array([2, 3]))[0].tolist() == [
        5, 6, 1, 2, 3]
