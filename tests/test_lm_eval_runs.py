"""Downstream evaluation through the command lines a user types (`mtrain.modes.lm_eval`):
an import fine-tuned with ``run.lm_eval_tasks`` (the in-training hook), then ``--mode=lm_eval``
run, run again and run with other tasks and ``--limit``, then lm-eval's own command line
(``mtrain-lm-eval``), each giving the task metrics lm-eval's hf backend computed
(../shared/oracles/lm_eval; the learning rate is 0, so the parameters stay the import's);
several processes; and every refusal in one line. test_lm_eval checks every sample."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_multiprocess import SUBPROCESS_XLA_FLAGS, free_port
from test_oracles import ORACLES, import_folder
from conftest import no_compilation_cache

pytest.importorskip("lm_eval")
from mtrain.__main__ import main  # noqa: E402

ORACLE = os.path.join(ORACLES, "lm_eval")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.skipif(not os.path.isdir(ORACLE), reason="no oracles"),
              pytest.mark.slow]
RULES = "batch:batch;d_ff:model;heads:model;vocab:model;kv_heads:model"
LAYOUT = [f"--gin_param=run.mesh_shape='batch:4;model:2'", f"--gin_param=run.layout_rules='{RULES}'"]


def oracle_results(result="llama3") -> dict:
    with open(os.path.join(ORACLE, "results", result, "results.json")) as f:
        return json.load(f)["results"]


def records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture()
def work(tmp_path, monkeypatch):
    """The oracle's tasks and data in the working directory (the YAMLs' data files are
    relative to it), offline."""
    for part in ("tasks", "data"):
        shutil.copytree(os.path.join(ORACLE, part), tmp_path / part)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture(scope="module")
def qwen2_import(tmp_path_factory):
    """qwen2 imported for batch:4;model:2 once for the module (each test takes a copy)."""
    model = tmp_path_factory.mktemp("lm_eval_runs") / "qwen2"
    import_folder(os.path.join(ORACLES, "qwen2"), model, *LAYOUT)
    return model


def assert_metrics(got: dict, want: dict, tasks, prefix="lm_eval/") -> None:
    """Accuracies and exact matches equal (counts); perplexities within 1e-5 relative (see
    test_lm_eval)."""
    for task in tasks:
        for key, value in want[task].items():
            metric = key.split(",")[0]
            if not isinstance(value, float) or "stderr" in metric:
                continue
            mine = got[f"{prefix}{task}/{metric}" if prefix else key] if prefix else got[task][key]
            if metric.startswith(("acc", "exact_match")):
                assert mine == pytest.approx(value, abs=1e-12), (task, metric)
            else:
                assert abs(mine - value) <= 1e-5 * value, (task, metric)


def test_training_hook_mode_and_lm_evals_command_line(fresh_home, work, monkeypatch, capsys):
    model = work / "model"
    settings = [*LAYOUT, "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=64",
                "--gin_param=run.data_workers=0", "--gin_param=run.log_every=1",
                "--gin_param=run.checkpoint_every=2", "--gin_param=run.eval_every=0",
                "--gin_param=learning_rate_schedule.constant=0.0",
                "--gin_param=run.lm_eval_tasks='kjv_next_verse,kjv_genesis_stops'",
                "--gin_param=run.lm_eval_every=1", "--gin_param=run.lm_eval_include_path='tasks'"]
    import_folder(os.path.join(ORACLES, "llama3"), model, *settings)
    config = [f"--gin_file={model / 'config.gin'}", f"--model_dir={model}"]
    # Training from an empty data dir (the shipped Bible, with the import's tokenizer): the
    # hook after step 1 and at the end (step 2).
    assert main([*config, "--gin_param=run.train_steps=2"]) == 0
    want = oracle_results()
    hooked = {r["step"]: r for r in records(model / "metrics.jsonl")
              if "lm_eval/kjv_next_verse/acc" in r}
    assert sorted(hooked) == [1, 2]
    for step in hooked:
        assert_metrics(hooked[step], want, ["kjv_next_verse", "kjv_genesis_stops"])
    assert hooked[2]["lm_eval/kjv_next_verse/sample_len"] == 40

    # --mode=lm_eval on the checkpoint of step 2, then again, then other tasks with --limit.
    out = work / "measured"
    command = [*config, "--mode=lm_eval", "--tasks=kjv_next_verse,kjv_exodus_last_word",
               "--include_path=tasks", f"--output_dir={out}"]
    assert main([*command, "--log_samples"]) == 0
    samples = records(out / "lm_eval_samples_kjv_next_verse.jsonl")
    assert len(samples) == 40 and len(samples[0]["resps"]) == 8  # (4 choices, 4 unconditional)
    first = records(out / "metrics.jsonl")
    assert len(first) == 1 and first[0]["step"] == 2
    assert_metrics(first[0], want, ["kjv_next_verse", "kjv_exodus_last_word"])
    results = json.loads((out / "lm_eval_results.json").read_text())
    assert results["results"]["kjv_next_verse"]["acc,none"] == first[0]["lm_eval/kjv_next_verse/acc"]
    assert main(command) == 0
    assert records(out / "metrics.jsonl") == first  # (the same record is not written twice)

    # The README's tasks, shipped in configs/lm_eval (made from the corpus: no data files),
    # with --limit, to the same output dir: the same step's other metrics, a record of theirs.
    assert main([*config, "--mode=lm_eval", "--tasks=bible_next_verse,bible_test_perplexity",
                 f"--include_path={os.path.join(REPO, 'configs', 'lm_eval')}", "--limit=8",
                 f"--output_dir={out}"]) == 0
    last = records(out / "metrics.jsonl")
    assert len(last) == 2 and last[0] == first[0] and last[1]["step"] == 2
    record = last[1]
    assert record["lm_eval/bible_next_verse/sample_len"] == 8
    assert 0 <= record["lm_eval/bible_next_verse/acc"] <= 1
    assert record["lm_eval/bible_test_perplexity/word_perplexity"] > 1

    # lm-eval's own command line with mtrain's model.
    from mtrain.harness_cli import cli

    args = f"pretrained={model},mesh_shape=batch:4;model:2,layout_rules={RULES}"
    monkeypatch.setattr(sys, "argv", [
        "mtrain-lm-eval", "--model", "mtrain", "--model_args", args, "--batch_size", "8",
        "--tasks", "kjv_psalms_rolling", "--include_path", "tasks", "--output_path",
        str(work / "harness")])
    cli()
    (written,) = [os.path.join(d, f) for d, _, files in os.walk(work / "harness") for f in files
                  if f.startswith("results_")]
    assert os.path.basename(os.path.dirname(written)).endswith("model")  # (named after it)
    with open(written) as f:
        assert_metrics(json.load(f)["results"], want, ["kjv_psalms_rolling"], prefix="")
    assert "kjv_psalms_rolling" in capsys.readouterr().out  # (its table)


def _refused(capsys, argv, *fragments):
    """Exit 2, at most 3 lines on stderr (the run's first log line may come before), the
    error last."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and err[-1].startswith("mtrain: error: "), err
    assert all(f in err[-1] for f in fragments), err


@pytest.mark.extended  # (the hook's and mode's refusals: test_lm_eval's)
def test_every_refusal_is_one_line_and_writes_nothing(qwen2_import, work, capsys, monkeypatch):
    model = work / "model"
    shutil.copytree(qwen2_import, model)
    capsys.readouterr()
    before = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    config = [f"--gin_file={model / 'config.gin'}", f"--model_dir={model}"]
    _refused(capsys, [*config, "--mode=lm_eval"], "needs --tasks")
    _refused(capsys, [*config, "--tasks=kjv_next_verse"], "go with --mode=lm_eval")
    _refused(capsys, [*config, "--mode=lm_eval", "--tasks=no_such_task"],
             "lm-eval knows no task 'no_such_task'", "--include_path")
    _refused(capsys, [*config, "--mode=lm_eval", "--tasks=kjv_next_verse",
                      f"--include_path={work / 'nowhere'}"], "is not a directory")
    _refused(capsys, [*config, "--mode=lm_eval", "--tasks=kjv_next_verse",
                      "--include_path=tasks", "--limit=-1"], "limit must be a whole number")
    os.remove(model / "chat_template.jinja")  # (restored below)
    _refused(capsys, [*config, "--mode=lm_eval", "--tasks=kjv_next_verse",
                      "--include_path=tasks", "--apply_chat_template"], "has no chat template")
    shutil.copy(os.path.join(ORACLES, "qwen2", "chat_template.jinja"), model)
    _refused(capsys, [*config, "--gin_param=run.lm_eval_tasks='kjv_next_verse'",
                      "--gin_param=run.lm_eval_every=-1"], "run.lm_eval_every")
    empty = work / "empty"
    empty.mkdir()
    _refused(capsys, [*config, f"--model_dir={empty}", "--mode=lm_eval",
                      "--tasks=kjv_next_verse", "--include_path=tasks"], "train first")
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == before
    assert os.listdir(empty) == []

    from mtrain.errors import UserError
    from mtrain.harness_cli import cli, load

    # (each cli() indexes every task lm-eval ships, seconds: one refusal through it shows a
    # UserError of the model_args made one line; the other model_args' is that UserError)
    monkeypatch.setattr(sys, "argv", [
        "mtrain-lm-eval", "--model", "mtrain", "--model_args", f"model_dir={model},dropout=0.1",
        "--tasks", "kjv_next_verse", "--include_path", "tasks"])
    with pytest.raises(SystemExit) as exit_:
        cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "takes no dropout" in err[0], err
    with pytest.raises(UserError, match="is not a directory"):
        load(model_dir=str(work / "nowhere"))


@pytest.mark.extended  # (two processes: test_multiprocess's)
def test_two_processes_share_the_requests_and_agree(qwen2_import, work):
    """2 processes x 4 CPU devices, the batch split across them: each feeds its rows of
    every batch, both get every result, and process 0 writes the oracle's metrics."""
    model = work / "model"
    shutil.copytree(qwen2_import, model)
    address = f"localhost:{free_port()}"
    argv = [f"--gin_file={model / 'config.gin'}", f"--model_dir={model}", "--mode=lm_eval",
            "--tasks=kjv_next_verse,kjv_genesis_greedy", "--include_path=tasks",
            "--gin_param=decoding.batch_size=8", "--cpu_devices=4",
            f"--coordinator_address={address}", "--num_processes=2",
            "--distributed_timeout=60"]
    env = no_compilation_cache(dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS))
    procs = [subprocess.Popen([sys.executable, "-m", "mtrain", *argv, f"--process_id={i}"],
                              cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    (record,) = records(model / "metrics.jsonl")
    assert_metrics(record, oracle_results("qwen2"), ["kjv_next_verse", "kjv_genesis_greedy"])
