"""fp8 on the command line (`transformer.quantization`): the Llama-style tiny LM trains 50
steps in fp8 to within 2% of bf16's loss, from an empty data dir and HOME; its checkpoints
hold float32 parameters, and the run resumed from the one before its last (the last lost)
ends bit for bit where it had; evaluation, inference, scoring and the plan run with it; a
bad setting is one line and touches nothing."""

import json
import shutil

import numpy as np
import pytest
from model_dirs import digest, saved_state
from test_model_family_runs import common_modes

from mtrain.__main__ import main

pytestmark = pytest.mark.slow  # (about a minute: three short runs of the tiny Llama)

SETTINGS = ["vocabulary.size=512", "run.batch_size=8", "run.sequence_length=64",
            "run.eval_every=0", "run.log_every=10", "run.checkpoint_every=25",
            "transformer.activation_dtype='bfloat16'", "learning_rate_schedule.warmup_steps=10",
            "learning_rate_schedule.decay_steps=50",  # (as a run of 25 steps resumed to 50)
            "decoding.max_decode_length=4"]


def argv(model_dir, *settings):
    return ["--gin_file=models/llama_tiny.gin", "--gin_file=tasks/bible_lm.gin",
            "--gin_file=layouts/dp4_mp2.gin", f"--model_dir={model_dir}",
            *(f"--gin_param={p}" for p in [*SETTINGS, *settings])]


def final_loss(model_dir):
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if "train/loss" in x][-1]["train/loss"]


def test_fp8_trains_as_bf16_does(fresh_home, tmp_path, capsys):
    fp8 = ["transformer.quantization='fp8'"]
    assert main(argv(tmp_path / "fp8", *fp8, "run.train_steps=50")) == 0
    assert main(argv(tmp_path / "bf16", "run.train_steps=50")) == 0
    ours, theirs = final_loss(tmp_path / "fp8"), final_loss(tmp_path / "bf16")
    assert abs(ours - theirs) <= 0.02 * theirs and ours < 0.75 * np.log(512), (ours, theirs)

    state = saved_state(tmp_path / "fp8", 50)
    assert {a.dtype for a in _leaves(state["params"])} == {np.dtype(np.float32)}
    shutil.rmtree(tmp_path / "fp8" / "checkpoints" / "50")  # (as if stopped after step 25)
    capsys.readouterr()
    assert main(argv(tmp_path / "fp8", *fp8, "run.train_steps=50")) == 0
    assert "resuming from the checkpoint of step 25" in capsys.readouterr().err
    for a, b in zip(_leaves(saved_state(tmp_path / "fp8", 50)), _leaves(state)):
        np.testing.assert_array_equal(a, b)

    run = argv(tmp_path / "fp8", *fp8, "run.train_steps=50")
    assert main(run + ["--mode=eval"]) == 0
    common_modes(capsys, run, tmp_path, ["And God said", "In the beginning"], "lm")
    plain = argv(tmp_path / "fp8", "run.train_steps=50")  # (the setting may change)
    assert main(plain + ["--mode=eval"]) == 0

    before = digest(tmp_path / "fp8")
    capsys.readouterr()
    assert main(argv(tmp_path / "fp8", "transformer.quantization='fp4'",
                     "run.train_steps=60")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "transformer.quantization must be one of none, fp8, int8, got " \
        "'fp4'" in err[-1], err
    assert digest(tmp_path / "fp8") == before


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)
