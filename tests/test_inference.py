"""`--mode=infer` as a tool: progress while it works, output written as batches finish (a
killed run keeps what it translated), in input order."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import no_compilation_cache
from mtrain.__main__ import main
from mtrain.data.bible import bible_split_verses
from mtrain.modes.infer import _Progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = ["transformer.d_model=32", "transformer.d_ff=64", "transformer.num_heads=2",
          "transformer.d_kv=16", "transformer.num_layers=1", "transformer.max_length=32",
          "vocabulary.size=300", "run.batch_size=8", "run.sequence_length=32",
          "run.train_steps=2", "learning_rate_schedule.warmup_steps=2",
          "decoding.num_examples=4", "decoding.max_decode_length=8", "decoding.beam_size=1"]


def test_progress_is_logged_while_a_batch_runs(caplog):
    with caplog.at_level(logging.INFO, logger="mtrain"):
        progress = _Progress(total=10, every=0.05)
        with progress:
            time.sleep(0.3)  # one long batch: the lines come anyway
            progress.add(5)
            time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if "lines/s" in r.getMessage()]
    assert len(lines) >= 3
    assert lines[0].startswith("translated 0 of 10 lines") and "time left unknown" in lines[0]
    assert lines[-1].startswith("translated 5 of 10 lines") and "s left" in lines[-1]


@pytest.mark.slow
def test_a_killed_infer_keeps_the_lines_it_translated(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    argv = ["--gin_file=tasks/bible_enfr.gin", "--gin_file=layouts/dp4_mp2.gin",
            f"--model_dir={model_dir}"] + [f"--gin_param={p}" for p in PARAMS]
    assert main(argv) == 0
    sentences = [v.en for v in bible_split_verses("train")[:2000]]
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    out = tmp_path / "out.txt"
    command = [sys.executable, "-m", "mtrain", "--cpu_devices=8", "--mode=infer",
               f"--input_file={tmp_path / 'in.txt'}", f"--output_file={out}",
               "--gin_param=decoding.batch_size=4", *argv]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=no_compilation_cache(os.environ))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_text(encoding="utf-8").count("\n") >= 8:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "infer ended before it could be stopped"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    kept = out.read_text(encoding="utf-8").split("\n")
    done = len(kept) - 1
    assert 8 <= done < len(sentences)  # written as it went, and stopped part-way
    # They are the first lines, in order: those of a whole run on the same lines.
    (tmp_path / "first.txt").write_text("".join(s + "\n" for s in sentences[:done]),
                                        encoding="utf-8")
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'first.txt'}",
                        f"--output_file={tmp_path / 'whole.txt'}"]) == 0
    assert kept[:done] == (tmp_path / "whole.txt").read_text(encoding="utf-8").split("\n")[:done]
