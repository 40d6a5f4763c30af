"""Pipeline stages on the command line: the Llama-style tiny LM trains over 4 stages from an
empty data dir and HOME, resumes over 2 stages in the circular schedule beside a model
split, and ends with the losses of the one-device run, as do two processes holding a stage
each; evaluation, inference, scoring and the plan run over the stages; settings that cannot
pipeline are one line and touch nothing. SGP's gossip replicas each run their stages.
(One journey, its runs shared: each run of the tiny LM compiles for about 20 s.)"""

import json

import numpy as np
import pytest
from model_dirs import digest
from test_model_family_runs import common_modes

from mtrain.__main__ import main

SETTINGS = ["vocabulary.size=512", "run.batch_size=8", "run.sequence_length=64",
            "run.eval_every=0", "run.log_every=1", "run.checkpoint_every=10",
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


@pytest.mark.extended
@pytest.mark.slow  # (about two minutes: three short runs, two processes and the modes)
def test_stages_train_refuse_resume_across_processes_and_serve(fresh_home, tmp_path, capsys):
    """10 steps over 4 stages (GPipe); settings that cannot pipeline are refused in one
    line, the model dir untouched; 10 more over 2 stages (circular, heads and d_ff split):
    every loss within 1e-5 of the unsplit run's (float32 sums in another order). 2
    processes x 4 CPU devices over ``stage:2;batch:4`` (the stage dimension laid out across
    the processes: each holds one stage and feeds every row) take the first 10 steps within
    1e-5 of it too (test_multiprocess measured 1.4e-7 over 10 steps for data parallelism).
    The model dir then evaluates, continues prompts, scores and plans over 4 stages."""
    from test_multiprocess import losses as logged
    from test_multiprocess import start_processes

    staged = tmp_path / "staged"
    assert main(argv(staged, *FOUR, "run.train_steps=10")) == 0
    before = digest(staged)
    for settings, message in [
            (["pipeline.schedule='1f1b'"],
             "pipeline.schedule must be one of ('gpipe', 'circular'), got '1f1b'"),
            (["pipeline.schedule='circular'"],
             "a stack of 4 scanned layers does not split into 4 stages x 2 runs")]:
        capsys.readouterr()
        assert main(argv(staged, *FOUR, *settings, "run.train_steps=20")) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) <= 3 and message in err[-1], err
        assert digest(staged) == before
    assert main(argv(tmp_path / "unscanned", *FOUR, "transformer.scan_layers=False",
                     "run.train_steps=10")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "which needs transformer.scan_layers=True" in err[-1], err

    assert main(argv(staged, *TWO, "run.train_steps=20")) == 0
    assert "resuming from the checkpoint of step 10" in capsys.readouterr().err
    # (this process has 8 devices: the reference splits only the batch, which the layout
    # tests hold to the one device's losses; tests/test_pipeline compares with one device)
    assert main(argv(tmp_path / "dp", "run.train_steps=20", "run.mesh_shape='batch:8'",
                     "run.layout_rules='batch:batch'")) == 0
    expected = losses(tmp_path / "dp")
    np.testing.assert_allclose(losses(staged), expected, rtol=1e-5)
    assert len(expected) == 20

    files = ["--gin_file=models/llama_tiny.gin", "--gin_file=tasks/bible_lm.gin",
             "--gin_param=run.mesh_shape='batch:4;stage:2'",
             "--gin_param=run.layout_rules='layers:stage;batch:batch'"]
    procs = start_processes(tmp_path / "two", files=files,
                            base=[*SETTINGS, "run.train_steps=10"])
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = logged(tmp_path / "two")
    assert sorted(got) == list(range(1, 11))
    for step in got:
        assert got[step] == pytest.approx(expected[step - 1], rel=1e-5), step

    run = argv(staged, *FOUR, "run.train_steps=20")
    assert main(run + ["--mode=eval"]) == 0
    _, plan = common_modes(capsys, run, tmp_path, ["And God said", "In the beginning"], "lm")
    # (the text plan's line of these fields: test_plan_pipeline)
    assert (plan["pipeline"]["stages"], plan["pipeline"]["stage_dim"],
            plan["pipeline"]["schedule"]) == (4, "stage", "gpipe")


@pytest.mark.extended
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
