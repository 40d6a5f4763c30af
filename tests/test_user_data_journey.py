"""A new user's own corpus, as issue 48 found it: a raw tree laid out as lm1b's archive and
passed as run.data_source. An edited corpus is prepared again (never served stale), the data
source given as a flag is in the model dir's config.gin, and infer and score read the model
dir's vocabulary and no data (nothing prepared, a data source that is gone does not matter)."""

import json
import shutil

import pytest

from mtrain import config
from mtrain.__main__ import main
from mtrain.data import make_offline, sources

from tiny_config import TINY

LAYOUT = "--gin_file=layouts/dp4_mp2.gin"
SHORT = ["run.train_steps=2", "run.checkpoint_every=2", "decoding.max_decode_length=4"]


def cli(*args, params=()):
    return main([*args, *[f"--gin_param={p}" for p in [*TINY, *SHORT, *params]]])


def tree(path):
    """Every file under `path`, relative to it."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def read_with(model_dir, mode, tmp_path, *args):
    """Runs infer or score on two lines with the model dir's config.gin and `args`; returns
    (exit code, the output's lines)."""
    lines = tmp_path / "lines.txt"
    lines.write_text("In the beginning God created\nAnd God said\n")
    out = tmp_path / f"{mode}.out"
    out.unlink(missing_ok=True)
    code = main([f"--gin_file={model_dir / 'config.gin'}", f"--model_dir={model_dir}",
                 f"--mode={mode}", f"--input_file={lines}", f"--output_file={out}", *args])
    return code, out.read_text().splitlines() if out.exists() else []


@pytest.mark.slow  # (TFDS prepares twice; a user's edited files: test_user_data, fast tier)
def test_own_lm1b_files_recorded_prepared_again_when_edited_and_not_read_by_readers(
        tmp_path, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(data))
    raw = make_offline.write_lm1b_tree(tmp_path / "corpus", max_train=200)
    model_dir = tmp_path / "run"
    assert cli("--gin_file=tasks/lm1b.gin", LAYOUT, f"--model_dir={model_dir}",
               f"--data_source={raw}") == 0
    config.parse([str(model_dir / "config.gin")], [])
    assert config.bound("run.data_source", None) == str(raw)
    prepared = tree(data)

    # The README's pattern: the model dir's config.gin alone, without the flag, reads the
    # same data (no download), prepared once.
    assert main([f"--gin_file={model_dir / 'config.gin'}", f"--model_dir={model_dir}",
                 "--mode=eval"]) == 0
    assert tree(data) == prepared

    # The corpus edited: its training files cut to half their lines. Prepared again.
    assert sources.TfdsSource("lm1b", str(data), str(raw)).num_examples("train") == 200
    for path in raw.glob(f"{make_offline.LM1B_TRAIN_DIR}/news.en-*"):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:len(lines) // 2]))
    edited = sources.TfdsSource("lm1b", str(data), str(raw)).num_examples("train")
    assert 0 < edited < 200
    prepared = tree(data)

    # Score and infer need neither the raw files nor the data dir: gone, and another flag.
    shutil.rmtree(raw)
    for mode in ("score", "infer"):
        code, out = read_with(model_dir, mode, tmp_path, f"--data_source={tmp_path / 'gone'}")
        assert code == 0 and len(out) == 2
    assert tree(data) == prepared


@pytest.mark.slow
def test_infer_and_score_prepare_no_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(tmp_path / "data"))
    model_dir = tmp_path / "run"
    assert cli("--gin_file=tasks/bible_lm.gin", LAYOUT, f"--model_dir={model_dir}") == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(empty))
    code, out = read_with(model_dir, "score", tmp_path)
    assert code == 0 and [json.loads(line)["line"] for line in out] == [1, 2]
    code, out = read_with(model_dir, "infer", tmp_path)
    assert code == 0 and len(out) == 2
    assert list(empty.iterdir()) == []

    # Without the vocabulary training recorded: one line, and nothing prepared either.
    (model_dir / "vocabulary.model").rename(tmp_path / "vocabulary.model")
    capsys.readouterr()
    assert read_with(model_dir, "score", tmp_path)[0] == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("mtrain: error: --mode=score reads the vocabulary")
    assert "train first" in error and "vocabulary.path" in error
    assert list(empty.iterdir()) == []
