"""Pipeline stages on the command line: the Llama-style tiny LM trains over 4 stages from an
empty data dir and HOME, resumes over 2 stages in the circular schedule beside a model
split, and ends with the losses of the one-device run; evaluation, inference, scoring and
the plan run over the stages; settings that cannot pipeline are one line and touch
nothing."""

import json

import numpy as np
import pytest
from model_dirs import digest
from test_model_family_runs import common_modes

from mtrain.__main__ import main

SETTINGS = ["vocabulary.size=512", "run.batch_size=8", "run.sequence_length=64",
            "run.eval_every=0", "run.log_every=5", "run.checkpoint_every=10",
            "transformer.scan_layers=True", "transformer.num_layers=4",
            "learning_rate_schedule.warmup_steps=5", "learning_rate_schedule.decay_steps=20",
            "decoding.max_decode_length=4"]
FOUR = ["run.mesh_shape='stage:4;batch:2'", "run.layout_rules='layers:stage;batch:batch'"]
TWO = ["run.mesh_shape='stage:2;batch:2;model:2'",
       "run.layout_rules='layers:stage;batch:batch;heads:model;kv_heads:model;d_ff:model'",
       "pipeline.schedule='circular'"]


def argv(model_dir, *settings):
    return ["--gin_file=models/llama_tiny.gin", "--gin_file=tasks/bible_lm.gin",
            f"--model_dir={model_dir}", "--cpu_devices=8",
            *(f"--gin_param={p}" for p in [*SETTINGS, *settings])]


def losses(model_dir):
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]


@pytest.mark.slow  # (about a minute: three short runs and the modes)
def test_stages_train_resume_and_serve(fresh_home, tmp_path, capsys):
    """10 steps over 4 stages (GPipe), 10 more over 2 (circular, heads and d_ff split):
    every logged loss within 1e-5 of the unsplit run's (float32 sums in another order);
    the model dir then evaluates, continues prompts, scores and plans over 4 stages."""
    staged = tmp_path / "staged"
    assert main(argv(staged, *FOUR, "run.train_steps=10")) == 0
    assert main(argv(staged, *TWO, "run.train_steps=20")) == 0
    assert "resuming from the checkpoint of step 10" in capsys.readouterr().err
    # (this process has 8 devices: the reference splits only the batch, which the layout
    # tests hold to the one device's losses; tests/test_pipeline compares with one device)
    assert main(argv(tmp_path / "dp", "run.train_steps=20", "run.mesh_shape='batch:8'",
                     "run.layout_rules='batch:batch'")) == 0
    np.testing.assert_allclose(losses(staged), losses(tmp_path / "dp"), rtol=1e-5)
    assert len(losses(staged)) == 4

    run = argv(staged, *FOUR, "run.train_steps=20")
    assert main(run + ["--mode=eval"]) == 0
    common_modes(capsys, run, tmp_path, ["And God said", "In the beginning"], "lm")
    assert main(run + ["--mode=plan"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 4 stages over mesh dimension 'stage' (gpipe)" in out


@pytest.mark.slow  # (about 30 s: a short run, then three refusals)
def test_settings_that_cannot_pipeline_are_one_line(fresh_home, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, *FOUR, "run.train_steps=10")) == 0
    before = digest(model_dir)
    for settings, message in [
            (["pipeline.schedule='1f1b'"],
             "pipeline.schedule must be one of ('gpipe', 'circular'), got '1f1b'"),
            (["pipeline.schedule='circular'"],
             "a stack of 4 scanned layers does not split into 4 stages x 2 runs")]:
        capsys.readouterr()
        assert main(argv(model_dir, *FOUR, *settings, "run.train_steps=20")) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) <= 3 and message in err[-1], err
        assert digest(model_dir) == before
    assert main(argv(tmp_path / "unscanned", *FOUR, "transformer.scan_layers=False",
                     "run.train_steps=10")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "which needs transformer.scan_layers=True" in err[-1], err


@pytest.mark.slow  # (about 80 s: the run in this process, then in two)
def test_two_processes_one_stage_each_train_as_one(data_dir, tmp_path):
    """2 processes x 4 CPU devices over ``stage:2;batch:4``: the stage dimension laid out
    across the processes (each holds one stage and feeds every row), 10 steps within 1e-5
    of one process with the same mesh (float32 sums of the collectives in another order:
    test_multiprocess measured 1.4e-7 over 10 steps for data parallelism)."""
    from test_multiprocess import losses as logged
    from test_multiprocess import start_processes

    files = ["--gin_file=models/llama_tiny.gin", "--gin_file=tasks/bible_lm.gin",
             "--gin_param=run.mesh_shape='batch:4;stage:2'",
             "--gin_param=run.layout_rules='layers:stage;batch:batch'"]
    base = [*SETTINGS, "run.log_every=1", "run.checkpoint_every=10", "run.train_steps=10"]
    argv = [*files, *[f"--gin_param={p}" for p in base], f"--model_dir={tmp_path / 'one'}"]
    assert main(argv) == 0
    procs = start_processes(tmp_path / "two", files=files, base=base)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    expected, got = logged(tmp_path / "one"), logged(tmp_path / "two")
    assert sorted(got) == sorted(expected) == list(range(1, 11))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.slow  # (about 30 s: two short runs)
def test_gossip_replicas_each_run_their_stages(fresh_home, tmp_path):
    """SGP's replicas (run.data_parallel='sgp', each data shard its own model, inside a
    shard_map over batch) each run their pipeline over 2 stages: the losses of the same
    gossip without stages (float32 sums in another order)."""
    sgp = ["run.data_parallel='sgp'", "run.train_steps=10", "run.mesh_shape='stage:2;batch:4'"]
    assert main(argv(tmp_path / "staged", *sgp, "run.layout_rules='layers:stage;batch:batch'")) \
        == 0
    assert main(argv(tmp_path / "flat", *sgp, "run.layout_rules='batch:batch'")) == 0
    np.testing.assert_allclose(losses(tmp_path / "staged"), losses(tmp_path / "flat"),
                               rtol=1e-5)
