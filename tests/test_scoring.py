"""`--mode=score`: the log-likelihood of each line of a file, for language models (text) and
translation models (source<TAB>target), consistent with `--mode=eval`."""

import json
import math

import pytest

from mtrain.data.bible import bible_split_verses
from mtrain.__main__ import main

from test_cli import cli, records


@pytest.fixture(scope="module")
def lm_dir(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lm") / "run"
    assert cli(model_dir, "run.train_steps=6", "run.checkpoint_every=6") == 0
    return model_dir


def score(model_dir, *args, files=("tasks/bible_lm.gin", "layouts/dp4_mp2.gin"), params=()):
    from tiny_config import TINY

    argv = [f"--gin_file={f}" for f in files] + [f"--gin_param={p}" for p in [*TINY, *params]]
    return main(argv + [f"--model_dir={model_dir}", "--mode=score", *args])


@pytest.mark.slow  # (about 18 s)
def test_scoring_the_test_split_gives_evals_perplexities(lm_dir, tmp_path):
    """The test split's text, scored line by line, has the perplexities --mode=eval reports
    on it (evaluation packs several verses per row; scoring puts one per row: the same
    per-token numbers, summed in another order: float32 sums of ~30,000 terms, 1e-5)."""
    verses = [v.en for v in bible_split_verses("test")]
    text = tmp_path / "test.txt"
    text.write_text("".join(v + "\n" for v in verses))
    out = tmp_path / "scores.jsonl"
    assert score(lm_dir, f"--input_file={text}", f"--output_file={out}") == 0
    assert cli(lm_dir, "run.train_steps=6", mode="eval") == 0
    evaluated = [r for r in records(lm_dir) if "eval/loss" in r][-1]
    summary = [r for r in records(lm_dir) if "score/token_perplexity" in r][-1]
    assert summary["step"] == evaluated["step"] == 6
    assert summary["score/tokens"] == evaluated["eval/num_tokens"]
    assert summary["score/words"] == evaluated["eval/num_words"]
    assert summary["score/token_perplexity"] == pytest.approx(evaluated["eval/perplexity"],
                                                              rel=1e-5)
    assert summary["score/word_perplexity"] == pytest.approx(
        evaluated["eval/word_perplexity"], rel=1e-5)
    # One JSON object per line, in order, adding up to the summary.
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, len(verses) + 1))
    assert sum(r["tokens"] for r in rows) == summary["score/tokens"]
    assert sum(r["words"] for r in rows) == summary["score/words"]
    assert sum(r["log_likelihood"] for r in rows) == pytest.approx(
        summary["score/log_likelihood"], rel=1e-9)
    assert math.exp(-summary["score/log_likelihood"] / summary["score/tokens"]) == \
        pytest.approx(summary["score/token_perplexity"], rel=1e-9)
    assert all(r["log_likelihood"] < 0 for r in rows)


def test_long_lines_are_scored_in_pieces_with_a_warning(lm_dir, tmp_path, capsys):
    """A line longer than the sequence is scored whole, in pieces as evaluation cuts it
    (never trimmed): every token of it counts."""
    text = tmp_path / "long.txt"
    text.write_text("in the beginning\n" + "and God said " * 40 + "\n")
    out = tmp_path / "long.out"
    assert score(lm_dir, f"--input_file={text}", f"--output_file={out}") == 0
    assert "1 of 2 lines were longer than 32 tokens" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["cut"] for r in rows] == [False, True] and rows[1]["tokens"] > 64


def test_jsonl_is_scored_by_its_fields_not_as_text(lm_dir, tmp_path, capsys):
    """A .jsonl of {"text"} scores as the same lines of plain text (not braces and all);
    {"prompt", "completion"} scores the completion given the prompt, less than the whole;
    a line of neither is one line of error."""
    lines = ["in the beginning God created", "and the earth was without form"]
    plain, jsonl = tmp_path / "plain.txt", tmp_path / "texts.jsonl"
    plain.write_text("".join(t + "\n" for t in lines))
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    pc = tmp_path / "pc.jsonl"
    pc.write_text("".join(json.dumps({"prompt": t[:12], "completion": t[12:]}) + "\n"
                          for t in lines))
    outs = []
    for name in (plain, jsonl, pc):
        out = tmp_path / f"{name.stem}.out"
        assert score(lm_dir, f"--input_file={name}", f"--output_file={out}") == 0
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert [r["log_likelihood"] for r in outs[0]] == pytest.approx(
        [r["log_likelihood"] for r in outs[1]], rel=1e-6)
    assert all(0 > c["log_likelihood"] > t["log_likelihood"] for c, t in zip(outs[2], outs[0]))
    # A completion longer than the sequence: its last 32 tokens, after none of the prompt.
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "in the beginning",
                                "completion": " and God said" * 40}) + "\n")
    out = tmp_path / "long.out"
    assert score(lm_dir, f"--input_file={long}", f"--output_file={out}") == 0
    row = json.loads(out.read_text())
    assert row["cut"] and row["tokens"] == 32 and row["log_likelihood"] < 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    capsys.readouterr()
    assert score(lm_dir, f"--input_file={bad}", f"--output_file={tmp_path / 'b.out'}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err)
    assert "line 1: a .jsonl file scores JSON objects" in err[-1]


@pytest.mark.slow
def test_translation_scores_the_target_given_the_source(data_dir, tmp_path, capsys):
    files = ("tasks/bible_enfr.gin", "layouts/dp4_mp2.gin")
    model_dir = tmp_path / "enfr"
    assert cli(model_dir, "run.train_steps=2", "run.checkpoint_every=2",
               "decoding.num_examples=4", "decoding.max_decode_length=4", files=files) == 0
    pairs = [(v.en, v.fr) for v in bible_split_verses("test")[:5]]
    text = tmp_path / "pairs.tsv"
    text.write_text("".join(f"{en}\t{fr}\n" for en, fr in pairs))
    out = tmp_path / "pairs.jsonl"
    assert score(model_dir, f"--input_file={text}", f"--output_file={out}", files=files) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(r["log_likelihood"] < 0 for r in rows)
    # The same target after another source scores otherwise: the source is attended to.
    swapped = tmp_path / "swapped.tsv"
    swapped.write_text("".join(f"{pairs[-1 - i][0]}\t{fr}\n" for i, (_, fr) in
                               enumerate(pairs)))
    again = tmp_path / "again.jsonl"
    assert score(model_dir, f"--input_file={swapped}", f"--output_file={again}",
                 files=files) == 0
    other = [json.loads(line) for line in again.read_text().splitlines()]
    assert [r["tokens"] for r in other] == [r["tokens"] for r in rows]
    assert [r["log_likelihood"] for r in other] != [r["log_likelihood"] for r in rows]
    # A line that is not source<TAB>target: one line on stderr, exit 2, nothing written.
    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n")
    capsys.readouterr()
    assert score(model_dir, f"--input_file={bad}", f"--output_file={tmp_path / 'x'}",
                 files=files) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and err[-1] == ("mtrain: error: --input_file line 1: a translation "
                                         "task scores lines 'source<TAB>target', this one "
                                         "has 0 tabs")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # (the readers' own vocabulary in the fast tier: test_user_data_journey)
def test_a_model_dir_uses_the_vocabulary_its_checkpoints_were_trained_with(
        tmp_path, monkeypatch, capsys):
    from model_dirs import digest

    data = tmp_path / "data"
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(data))
    model_dir = tmp_path / "run"
    assert cli(model_dir, "run.train_steps=2", "run.checkpoint_every=2") == 0
    recorded = model_dir / "vocabulary.model"
    (cached,) = data.rglob("spm_256.model")
    assert recorded.read_bytes() == cached.read_bytes()
    cached.unlink()  # the data dir loses its copy: the run's own is used, nothing retrained
    assert cli(model_dir, "run.train_steps=2", mode="eval") == 0
    assert not list(data.rglob("spm_*.model"))
    # Asking for another vocabulary is one clear error, and changes nothing.
    before = digest(model_dir)
    capsys.readouterr()
    assert cli(model_dir, "run.train_steps=2", "vocabulary.size=300", mode="eval") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"mtrain: error: vocabulary.size=300, but the checkpoints in {model_dir} were trained "
        f"with a vocabulary of 256 pieces")
    assert digest(model_dir) == before
    # Without its recorded vocabulary, the model dir uses the data dir's and says so (the
    # checkpoints' own digest of theirs is then what refuses another one).
    recorded.unlink()
    capsys.readouterr()
    assert cli(model_dir, "run.train_steps=2", mode="eval") == 0
    err = capsys.readouterr().err
    assert (f"the model dir has no {model_dir}/vocabulary.model: using "
            f"{next(data.rglob('spm_256.model'))}") in err


def test_empty_input_is_empty_output(lm_dir, tmp_path, capsys):
    """Scoring (like translating, test_encoder_decoder) an empty file writes an empty one;
    nothing is recorded for it."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out.jsonl"
    before = len(records(lm_dir))
    assert score(lm_dir, f"--input_file={empty}", f"--output_file={out}") == 0
    assert out.read_text() == "" and len(records(lm_dir)) == before
    assert "scored 0 lines" in capsys.readouterr().err
