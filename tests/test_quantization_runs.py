"""fp8 on the command line (`transformer.quantization`): the Llama-style tiny LM trains 50
steps in fp8 to within 2% of bf16's loss, from an empty data dir and HOME, with current
and with delayed scaling; its checkpoints hold float32 parameters (and delayed scaling's
state), and the run resumed from the one before its last (the last lost) ends bit for bit
where it had; evaluation, inference, scoring and the plan run with it; an import
fine-tunes with LoRA in delayed scaling and resumes bit for bit; a bad setting is one line
and touches nothing."""

import json
import os
import shutil

import numpy as np
import pytest
from model_dirs import digest, saved_state
from test_oracles import ORACLES
from test_model_family_runs import common_modes

from mtrain.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # (about a minute: three short runs of the tiny Llama)

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

    # Delayed scaling: as close to bf16; its state in the checkpoints (an amax a step of
    # each projection's input, weight and gradient), and resumed bit for bit with it.
    delayed = [*fp8, "transformer.quantization_scaling='delayed'"]
    assert main(argv(tmp_path / "delayed", *delayed, "run.train_steps=50")) == 0
    ours = final_loss(tmp_path / "delayed")
    assert abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)
    state = saved_state(tmp_path / "delayed", 50)
    held = [a for p, a in _paths(state["params"]) if p.endswith("_fp8']")]
    assert len(held) == 2 * 7 and all(  # (2 layers x q, k, v, o, wi_0, wi_1, wo)
        np.all(np.count_nonzero(a[:, 1:], axis=1) == 50) for a in held)
    shutil.rmtree(tmp_path / "delayed" / "checkpoints" / "50")
    capsys.readouterr()
    assert main(argv(tmp_path / "delayed", *delayed, "run.train_steps=50")) == 0
    assert "resuming from the checkpoint of step 25" in capsys.readouterr().err
    for a, b in zip(_leaves(saved_state(tmp_path / "delayed", 50)), _leaves(state)):
        np.testing.assert_array_equal(a, b)
    run = argv(tmp_path / "delayed", *delayed, "run.train_steps=50")
    assert main(run + ["--mode=eval"]) == 0 and main(run + ["--mode=plan"]) == 0
    assert "quantization fp8 (delayed)" in capsys.readouterr().out
    before = digest(tmp_path / "delayed")  # (its state is the train state's: read with it)
    assert main(argv(tmp_path / "delayed", "run.train_steps=50") + ["--mode=eval"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "wi_0_fp8']: float32[3, 1025] there, absent here" in err[-1], err
    assert digest(tmp_path / "delayed") == before

    # An import holds no state (it starts fresh); a LoRA run's checkpoints keep it beside
    # the adapters (its base stored once), and it resumes bit for bit.
    imported = tmp_path / "imported"
    assert os.path.isdir(ORACLES) and main([
        "--mode=import", f"--input_dir={ORACLES}/llama3", f"--model_dir={imported}",
        *(f"--gin_param={p}" for p in delayed)]) == 0
    lora = [f"--gin_file={imported}/config.gin", "--gin_file=tasks/bible_lm.gin",
            "--gin_file=layouts/dp8.gin", f"--model_dir={imported}",
            *(f"--gin_param={p}" for p in ["run.train_steps=2", "run.batch_size=8",
              "run.sequence_length=64", "run.eval_every=0", "run.checkpoint_every=1",
              "learning_rate_schedule.warmup_steps=1", "lora.rank=4"])]
    assert main(lora) == 0
    state = saved_state(imported, 2)
    names = [p for p, _ in _paths(state["params"])]
    assert sum("_fp8" in p for p in names) == 14 and sum("_lora_" in p for p in names) == 28
    shutil.rmtree(imported / "checkpoints" / "2")
    assert main(lora) == 0
    for a, b in zip(_leaves(saved_state(imported, 2)), _leaves(state)):
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


def _paths(tree):
    import jax

    return [(jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_leaves_with_path(tree)]
