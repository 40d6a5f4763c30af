"""The loss falls on real text: the quickstart model, shortened, beats the unigram baseline."""

import json
import os

import pytest

from mtrain.__main__ import main


@pytest.mark.slow
def test_quickstart_learns_real_text(tmp_path, monkeypatch):
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(tmp_path / "data"))
    model_dir = tmp_path / "run"
    # The quickstart's mesh and data, with a smaller model and batch so that CPU tests stay fast.
    params = ["run.train_steps=200", "run.eval_every=0", "run.log_every=20",
              "run.checkpoint_every=200", "run.batch_size=8", "transformer.d_model=64",
              "transformer.d_ff=256", "transformer.num_heads=2", "vocabulary.size=512"]
    argv = ["--gin_file=quickstart.gin", f"--model_dir={model_dir}"]
    argv += [f"--gin_param={p}" for p in params]
    assert main(argv) == 0
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r["train/cross_entropy"] for r in records if "train/cross_entropy" in r]
    final = [r for r in records if "eval/perplexity" in r][-1]
    assert train[-1] < train[0] - 2.0, train
    # Held-out perplexity clearly below what a context-free (unigram) model scores.
    assert final["eval/perplexity"] < 0.6 * final["eval/unigram_perplexity"], final
