"""A new user's own text files, as issue 59 found them (a fresh HOME and data dir, the
command as a user types it, run in-process): a book of one very long line trains with any
batch size and a held-out fraction, its pieces the examples that counts and splits see,
read and tokenised a part at a time; files.validation=0 trains and evaluates nothing."""

import json
import random
import tracemalloc

import numpy as np
import pytest

from mtrain.__main__ import main
from mtrain.data import files, formats, prepared

from tiny_config import TINY

WORDS = ("in the beginning god created heaven and earth was without form void darkness upon "
         "face of deep spirit moved waters said let there be light saw that it good divided "
         "from called day night evening morning first firmament midst").split()


def text_task(path, *params):
    return ["--gin_file=layouts/dp4_mp2.gin", "--gin_param=run.task=@task()",
            "--gin_param=task.data=@files()",
            f"--gin_param=files.train='{path}'", "--gin_param=files.format='text'",
            *[f"--gin_param={p}" for p in [*TINY, "run.train_steps=2", "run.checkpoint_every=2",
                                           "vocabulary.size=64",
                                           *params]]]


def user(tmp_path, monkeypatch):
    """A fresh HOME and data dir."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MTRAIN_DATA_DIR", raising=False)
    return tmp_path / "home" / ".cache" / "mtrain"


def one_line_book(path, words: int) -> str:
    rng = random.Random(0)
    line = " ".join(rng.choice(WORDS) for _ in range(words))
    path.write_text(line + "\n", encoding="utf-8")
    return line


def test_a_long_line_is_read_in_parts_that_join_to_it(tmp_path):
    """A line of 3 MB (and a word longer than a part, and characters of several bytes)
    comes in parts of at most about 2 x files.PART bytes, cut before a space, the last not
    marked CONTINUED; read whole (text_file), the file the same way; Python holds a few
    parts at most."""
    line = one_line_book(tmp_path / "book.txt", 500_000) + " " + "é" * files.PART
    (tmp_path / "book.txt").write_text(f"{line}\nshort\n", encoding="utf-8")
    tracemalloc.start()
    records = list(files.read(tmp_path / "book.txt", "text"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    first = [r for n, r in records if n == 1]
    assert len(first) > 10 and "".join(r["text"] for r in first) == line
    assert all(r.get(files.CONTINUED) for r in first[:-1]) and files.CONTINUED not in first[-1]
    assert max(len(r["text"].encode()) for r in first) <= 2 * files.PART
    assert all(r["text"].startswith(" ") for r in first[1:5])  # cut before a space
    assert records[-1] == (2, {"text": "short"})
    whole = list(files.read(tmp_path / "book.txt", "text_file"))
    assert "".join(r["text"] for _, r in whole) == f"{line}\nshort\n"
    assert peak < 40 * files.PART  # (the records it returns included: 3.3 MB of text)


def test_a_long_text_is_stored_in_pieces_of_the_ids_it_has_whole(tmp_path):
    """Tokenised a part at a time and cut to `formats.piece_size` ids, a long text gives
    the ids it gives whole, EOS at its end alone."""
    from mtrain.data.vocabulary import train_vocabulary

    line = one_line_book(tmp_path / "book.txt", 100_000)
    vocab = train_vocabulary((" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))),
                             64, tmp_path / "v.model")
    whole = vocab.encode(line) + [vocab.eos_id]
    spec = prepared.Files(train=str(tmp_path / "book.txt"))
    source = prepared.prepare(spec, spec.make_format(), vocab, str(tmp_path / "data"),
                              piece=formats.piece_size(96))
    assert formats.piece_size(96) == 2112 and formats.piece_size(None) == formats.PIECE
    stored = [source.records("train")[i][0][0] for i in range(source.num_examples("train"))]
    assert [len(s) for s in stored[:-1]] == [2112] * (len(stored) - 1)
    assert np.concatenate(stored).tolist() == whole


@pytest.mark.slow
def test_one_long_line_trains_with_a_batch_of_8_and_a_held_out_fraction(
        tmp_path, monkeypatch, capsys):
    """A book of one 2 MB line: refused before ("split 'train' of files has 1 examples,
    fewer than the batch size 8"), tens of GB with a batch of 1. Its pieces are the
    examples: both splits have some, none longer than a piece."""
    data = user(tmp_path, monkeypatch)
    one_line_book(tmp_path / "book.txt", 330_000)
    model_dir = tmp_path / "run"
    assert main([*text_task(tmp_path / "book.txt", "files.validation=0.1", "run.eval_every=0",
                            "run.eval_split='validation'"), f"--model_dir={model_dir}"]) == 0
    (directory,) = (data / "prepared").iterdir()
    info = json.loads((directory / "info.json").read_text())["splits"]
    assert info["train"]["examples"] > 8 and info["validation"]["examples"] > 0
    longest = max(len(ids[0]) for split in ("train", "validation")
                  for ids, _ in prepared.PreparedRecords(str(directory / f"{split}.array_record")))
    assert longest == formats.piece_size(32)
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in r for r in records)


def test_a_held_out_fraction_that_holds_out_nothing_says_so_and_leaves_nothing(
        tmp_path, monkeypatch, capsys):
    data = user(tmp_path, monkeypatch)
    (tmp_path / "few.txt").write_text(
        "\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    capsys.readouterr()
    assert main([*text_task(tmp_path / "few.txt", "files.validation=0.001",
                            "run.eval_split='validation'"), f"--model_dir={tmp_path / 'run'}"]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert f"files.validation=0.001 held out none of the {len(WORDS)} examples" in error[-1]
    assert not (data / "prepared").exists() or not list((data / "prepared").iterdir())
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())


@pytest.mark.slow
def test_no_held_out_data_trains_and_evaluates_nothing(tmp_path, monkeypatch, capsys):
    """files.validation=0 (as the README allows): the run trains and says in one line
    that it evaluates nothing; --mode=eval refuses in one line, writing nothing."""
    user(tmp_path, monkeypatch)
    (tmp_path / "lines.txt").write_text(
        "\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    model_dir = tmp_path / "run"
    command = [*text_task(tmp_path / "lines.txt", "files.validation=0", "run.eval_every=0",
                          "run.eval_split='validation'"), f"--model_dir={model_dir}"]
    capsys.readouterr()
    assert main(command) == 0
    said = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()
            if "evaluates nothing" in line]
    assert said == ["files.validation=0: no held-out data, this run evaluates nothing"]
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r for r in records)
    assert not any(k.startswith("eval/") for r in records for k in r)
    before = sorted(p.name for p in model_dir.rglob("*"))
    capsys.readouterr()
    assert main([*command, "--mode=eval"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "files.validation=0 holds out nothing" in error[0]
    assert sorted(p.name for p in model_dir.rglob("*")) == before
