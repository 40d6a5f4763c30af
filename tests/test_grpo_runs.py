"""GRPO runs as a user starts them (``files.format='prompts'``, rewards named in gin): a
task RL visibly solves on CPU in seconds, full and LoRA, and what a killed run resumes.

The task: `llama_gqa` (the oracle's tiny Llama, its logits O(1) and nearly flat: a
completion ends with the piece "the" about once in 500) continues the first three words of
320 verses of the shipped Bible by at most 6 pieces; the reward (the built-in `matches`) is
1 where the completion ends with "the". From almost never, the policy learns to end every
completion so (full fine-tuning) or nearly every one (LoRA: its adapters cannot move the
frozen output layer's logits past the final norm's reach: measured plateaus at 0.94 at
temperature 0.7), within 100 steps of 4 prompts x 16 completions.
"""

import json
import lzma
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import no_compilation_cache
from test_huggingface import params_of, resumes_bit_for_bit
from test_multiprocess import SUBPROCESS_XLA_FLAGS, free_port
from test_oracles import ORACLES

from mtrain.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.extended,
              pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")]
CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                      "bible_kjv_lsg.tsv.xz")


def verse_openings(path, every: int = 97) -> None:
    """A prompts file: the first three words of every `every`-th English verse."""
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f, open(path, "w") as out:
        for number, line in enumerate(f):
            if number and number % every == 0:
                words = line.rstrip("\n").split("\t")[3].split()
                out.write(json.dumps({"prompt": " ".join(words[:3])}) + "\n")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_runs")
    assert main(["--mode=import", f"--input_dir={ORACLES}/llama_gqa",
                 f"--model_dir={root / 'llama'}"]) == 0
    verse_openings(root / "prompts.jsonl")
    return root


def rl_flags(root, model_dir, steps: int, *params: str) -> list[str]:
    settings = [
        f"run.init_from='{root / 'llama'}'", "run.task=@task()", "task.data=@files()",
        f"files.train='{root / 'prompts.jsonl'}'", "files.format='prompts'",
        "run.mesh_shape='batch:4;model:2'",
        "run.layout_rules='batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model'",
        "run.batch_size=64", "run.sequence_length=24", f"run.train_steps={steps}",
        "run.log_every=10", "run.checkpoint_every=50", f"run.data_dir='{root / 'data'}'",
        "run.optimizer=@adamw", "adamw.weight_decay=0.0",
        "learning_rate_schedule.shape='constant'", "learning_rate_schedule.warmup_steps=1",
        "grpo.num_generations=16", "grpo.max_completion_length=6", "grpo.temperature=0.7",
        "grpo.rewards=[@matches()]", r"matches.pattern='the\\s*$'", *params]
    return [f"--gin_file={root / 'llama'}/config.gin", f"--model_dir={model_dir}",
            *[f"--gin_param={p}" for p in settings]]


def rewards(model_dir) -> dict[int, float]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["train/reward"] for r in map(json.loads, f)}


def killed_after(argv, model_dir, step: int) -> None:
    """`argv` run in a process of its own (8 simulated devices, as this one), killed
    (SIGKILL) as soon as its checkpoint of `step` is there."""
    # (XLA compiled as in this process: the same float roundings, so the same parameters)
    flags = "--xla_backend_optimization_level=0"
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", "--cpu_devices=8", *argv],
                            env=no_compilation_cache(dict(os.environ, XLA_FLAGS=flags)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    saved, deadline = model_dir / "checkpoints" / str(step), time.time() + 600
    while not saved.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.kill()
    _, err = proc.communicate()
    assert saved.is_dir(), err[-2000:]


@pytest.mark.parametrize("kind, params, reached", [
    ("full", ["learning_rate_schedule.constant=3e-3"], 0.97),
    ("lora", ["learning_rate_schedule.constant=1e-2", "lora.rank=8",
              "run.checkpoint_every=90"], 0.85),  # (a resume of 10 steps, not of 50)
])
def test_grpo_learns_to_end_completions_with_a_word_and_resumes(policy, tmp_path, capsys,
                                                               kind, params, reached):
    """The mean reward of the first 10 steps is under 0.02 and of the last 10 (of 100)
    above `reached` (measured: 1.00 full, 0.94 LoRA). Full: the same run killed after its
    checkpoint of step 50 and started again takes the same steps: the same rewards, the
    same parameters. LoRA: with its newest checkpoint lost, the run resumes from step 90
    and ends as it did."""
    argv = rl_flags(policy, tmp_path / kind, 100, *params)
    assert main(argv) == 0
    got = rewards(tmp_path / kind)
    assert got[10] < 0.02 and got[100] > reached, got
    assert all(0.0 <= r <= 1.0 for r in got.values())
    if kind == "lora":
        resumes_bit_for_bit(capsys, argv, tmp_path / kind, newest=100, back_to=90)
        assert rewards(tmp_path / kind) == got
        return
    killed = [a.replace(str(tmp_path / kind), str(tmp_path / "killed")) for a in argv]
    killed_after(killed, tmp_path / "killed", 50)
    capsys.readouterr()
    assert main(killed) == 0
    assert "resuming from the checkpoint of step 50" in capsys.readouterr().err
    assert rewards(tmp_path / "killed") == got
    straight, resumed = params_of(tmp_path / kind), params_of(tmp_path / "killed")
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)


def test_a_generation_trained_on_twice_resumes_between_its_steps(policy, tmp_path, capsys):
    """grpo.num_iterations=2: step 2 trains on step 1's completions again; a run that
    resumes from the checkpoint of step 1 (which saves them) takes step 2 exactly."""
    argv = rl_flags(policy, tmp_path / "m", 2, "learning_rate_schedule.constant=3e-3",
                    "grpo.num_iterations=2", "run.checkpoint_every=1", "run.log_every=1",
                    "grpo.beta=0.04")
    assert main(argv) == 0
    got = rewards(tmp_path / "m")
    assert got[1] == got[2]  # (step 2's rewards are step 1's completions')
    resumes_bit_for_bit(capsys, argv, tmp_path / "m", newest=2, back_to=1)
    assert rewards(tmp_path / "m") == got
    assert np.isfinite(list(got.values())).all()


def test_two_processes_sample_and_step_as_one(policy, tmp_path):
    """2 processes x 4 devices (each feeding its half of the batch: whole groups) take the
    steps of 1 process x 8: the same completions (each row's key is a function of the step
    and the row, not of the process), so the same rewards, and losses equal but for the
    order of float32 sums in the collectives (1e-5, as test_multiprocess measures)."""
    argv = rl_flags(policy, tmp_path / "one", 3, "learning_rate_schedule.constant=3e-3",
                    "run.log_every=1", "matches.pattern='e'")
    assert main(argv) == 0
    address = f"localhost:{free_port()}"
    two = [a.replace(str(tmp_path / "one"), str(tmp_path / "two")) for a in argv]
    env = no_compilation_cache(dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mtrain", *two, "--cpu_devices=4",
         f"--coordinator_address={address}", "--num_processes=2", "--distributed_timeout=60",
         f"--process_id={i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    with open(tmp_path / "one" / "metrics.jsonl") as f:
        one = [json.loads(line) for line in f]
    with open(tmp_path / "two" / "metrics.jsonl") as f:
        two_ = [json.loads(line) for line in f]
    assert [r["step"] for r in two_] == [1, 2, 3]
    assert 0 < one[0]["train/reward"] < 1
    for a, b in zip(one, two_):
        assert a["train/reward"] == b["train/reward"]
        assert a["train/completions/mean_length"] == b["train/completions/mean_length"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-5)
