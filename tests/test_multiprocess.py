"""Multi-process runs: 2 processes x 4 CPU devices (JAX's multi-controller runtime with gloo
collectives) train exactly as 1 process x 8 devices, save a checkpoint that one process
resumes, and stop with an error, not a hang, when the other process dies."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import no_compilation_cache
from mtrain.__main__ import main
from tiny_config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["--gin_file=tasks/bible_lm.gin", "--gin_param=run.mesh_shape='batch:4;model:2'"]
# The `python -m mtrain` processes' XLA flags (their device count is --cpu_devices'): XLA's
# fast compile of conftest, which the tiny models' few steps need more than fast code.
SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_processes(model_dir, *params, heartbeat=100, files=FILES, base=TINY):
    """Two `python -m mtrain` processes of one run, 4 CPU devices each."""
    address = f"localhost:{free_port()}"
    argv = [*files, *[f"--gin_param={p}" for p in [*base, *params]],
            f"--model_dir={model_dir}", "--cpu_devices=4", f"--coordinator_address={address}",
            "--num_processes=2", "--distributed_timeout=60", f"--heartbeat_timeout={heartbeat}"]
    # Each process simulates its own 4 devices, compiled as this process compiles.
    env = no_compilation_cache(dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS))
    return [subprocess.Popen([sys.executable, "-m", "mtrain", *argv, f"--process_id={i}"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for i in range(2)]


def losses(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


def train_in_this_process(model_dir, *params, base=TINY):
    argv = [*FILES, *[f"--gin_param={p}" for p in [*base, *params]], f"--model_dir={model_dir}"]
    assert main(argv) == 0


# The quickstart's model, batch and schedule (configs/quickstart.gin; no dropout), on the
# shipped Bible.
QUICKSTART = ["transformer.d_model=128", "transformer.d_ff=512", "transformer.num_heads=4",
              "transformer.d_kv=32", "transformer.num_layers=2", "transformer.max_length=128",
              "vocabulary.size=2048", "run.batch_size=16", "run.sequence_length=128",
              "learning_rate_schedule.warmup_steps=100", "run.eval_split='test'"]


@pytest.mark.slow
def test_two_processes_train_like_one_and_one_process_resumes(data_dir, tmp_path):
    """The quickstart as 2 processes x 4 devices: the same global batches, so the same losses
    but for the order of float32 sums in the collectives. That reordering alone moved losses
    by at most 1.4e-7 (relative) in the first 10 steps, and then grows as training
    amplifies it: ~1e-5 at step 20, 3% by step 60, exactly as much as two meshes in one
    process differ (batch:8, batch:2;model:4 against batch:4;model:2, measured with the
    quickstart). So 10 steps at 1e-5, which a wrong row, mask or random number in any
    process would break from the first step on."""
    steps = ["run.log_every=1", "run.checkpoint_every=5", "run.eval_every=1000"]
    # The reference: one process with 8 devices (this one), 10 steps then 3 more.
    train_in_this_process(tmp_path / "one", "run.train_steps=10", *steps, base=QUICKSTART)
    expected = losses(tmp_path / "one")

    # The same layout with the mesh dimensions the other way round: the hosts still lie
    # along `batch`, each feeding half of every batch.
    files = [FILES[0], "--gin_param=run.mesh_shape='model:2;batch:4'"]
    procs = start_processes(tmp_path / "two", "run.train_steps=10", *steps,
                            "run.data_workers=2", files=files, base=QUICKSTART)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = losses(tmp_path / "two")  # written by process 0 only
    assert sorted(got) == sorted(expected) == list(range(1, 11))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    assert "step 10" in outs[0][1] and "step 10" not in outs[1][1]  # process 1: warnings only
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["10", "5"]
    # Each process read its own rows (lanes) of every batch, with two Grain workers each:
    # disjoint halves that together are the one process's lanes, each at the same position.
    data = [tmp_path / run / "checkpoints" / "10" / "data" for run in ("one", "two")]
    one = json.loads((data[0] / "input_pipeline.process-0-of-1.json").read_text())["lanes"]
    halves = [json.loads((data[1] / f"input_pipeline.process-{p}-of-2.json").read_text())
              for p in range(2)]
    assert [h["shard"] for h in halves] == [[0, 2], [1, 2]]
    assert sorted(halves[0]["lanes"], key=int) == [str(lane) for lane in range(8)]
    assert sorted(halves[1]["lanes"], key=int) == [str(lane) for lane in range(8, 16)]
    assert {**halves[0]["lanes"], **halves[1]["lanes"]} == one

    # One process resumes the two processes' checkpoint, each lane where the process that
    # read it left it, and continues as the single-process run does.
    # The batches are the same (the lanes end where the one process's end); the parameters
    # they start from differ by the collectives' float32 sum order, which steps amplify:
    # 1.6e-5 (relative) by step 12, measured. One wrong row of 16 would move the loss by
    # ~1e-3, so 1e-4 still tells them apart.
    train_in_this_process(tmp_path / "one", "run.train_steps=13", *steps, base=QUICKSTART)
    train_in_this_process(tmp_path / "two", "run.train_steps=13", *steps, base=QUICKSTART)
    expected, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    for step in (11, 12, 13):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    lanes = [json.loads((tmp_path / run / "checkpoints" / "13" / "data" /
                         "input_pipeline.process-0-of-1.json").read_text())["lanes"]
             for run in ("one", "two")]
    assert lanes[0] == lanes[1]


@pytest.mark.slow
def test_when_one_process_dies_the_other_stops_with_an_error(data_dir, tmp_path):
    train_in_this_process(tmp_path / "warm", "run.train_steps=1")  # the vocabulary, cached
    procs = start_processes(tmp_path / "run", "run.train_steps=100000", "run.log_every=1",
                            "run.checkpoint_every=100000", heartbeat=5)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(losses(tmp_path / "run")) >= 2):
        assert time.time() < deadline and procs[0].poll() is None, procs[0].communicate()[1]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)  # a host dies mid-run
    killed = time.time()
    _, err = procs[0].communicate(timeout=120)  # bounded: no hang
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert time.time() - killed < 60
    # Whichever notices first stops the survivor: the coordination service ("another task
    # died", or missed heartbeats), or gloo itself, when the dead peer's socket closes in the
    # middle of a collective (the connection reset, or a truncated message it then reports
    # as a size mismatch).
    signs = ["another task died", "stopped sending heartbeats", "gloo::", "Connection reset",
             "Connection closed"]
    assert any(sign in err for sign in signs), err[-2000:]


def test_partial_multiprocess_flags_are_refused(capsys):
    assert main(["--gin_file=quickstart.gin", "--num_processes=2"]) == 2
    assert "needs all of --coordinator_address, --num_processes and --process_id" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_to_one_process_saves_the_same_step_on_all_and_exits_0(data_dir, tmp_path):
    train_in_this_process(tmp_path / "warm", "run.train_steps=1")  # the vocabulary, cached
    procs = start_processes(tmp_path / "run", "run.train_steps=100000", "run.log_every=1",
                            "run.checkpoint_every=100000")
    deadline = time.time() + 300
    while not ((tmp_path / "run" / "metrics.jsonl").exists()
               and len(losses(tmp_path / "run")) >= 2):
        assert time.time() < deadline and procs[0].poll() is None, procs[0].communicate()[1]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)  # only one host is told
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    steps = os.listdir(tmp_path / "run" / "checkpoints")
    assert len(steps) == 1 and int(steps[0]) >= 2
    assert f"SIGTERM: stopped after step {steps[0]}" in outs[0][1]


def mixture(tmp_path) -> list[str]:
    """The gin of a mixture of two JSONL sources at 0.25 / 0.75 (each word its source's)."""
    params = []
    for name, word in (("code", "alpha"), ("web", "omega")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{word} {i} {word} {i * 7}"}) + "\n"
                                for i in range(400)))
        params += [f"{name}/files.train='{path}'", f"{name}/files.validation=0.05"]
    return ["run.task=@task()", "task.data={'code': @code/files(), 'web': @web/files()}",
            "task.mixture={'code': 0.25, 'web': 0.75}", "run.eval_split='validation'",
            f"run.data_dir='{tmp_path / 'data'}'", "run.log_every=1",
            "run.checkpoint_every=2", "run.eval_every=1000", *params]


def wait_for(path, procs, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        time.sleep(0.05)


def launch(processes, model_dir, params, mesh):
    """`processes` `python -m mtrain` processes of one run on 8 CPU devices in all."""
    if processes == 2:
        return start_processes(model_dir, *params, files=[mesh], base=[])
    env = no_compilation_cache(dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS))
    return [subprocess.Popen([sys.executable, "-m", "mtrain", "--cpu_devices=8", mesh,
                              *[f"--gin_param={p}" for p in params], f"--model_dir={model_dir}"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)]


def finish(procs):
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), outs[0][1][-3000:]


@pytest.mark.slow
def test_a_mixture_killed_at_random_resumes_with_the_rows_of_an_unbroken_run(tmp_path):
    """A mixture's run killed (SIGKILL) after a checkpoint picked at random, then run again,
    takes the steps an unbroken run takes: each source's position is in the checkpoint. One
    process with 2 workers, and two processes (no workers), each end bit for bit as an
    unbroken run of as many processes: two processes sum in another order than one (their
    collectives), and this tiny run's unstable losses grow that order's 1e-7 to 0.5% in
    8 steps. The realised proportions are in the train log."""
    params = [*TINY, *mixture(tmp_path), "run.train_steps=8"]
    mesh = "--gin_param=run.mesh_shape='batch:4;model:2'"
    rng = random.Random(48)
    for processes, workers in ((1, 2), (2, 0)):
        unbroken = tmp_path / f"unbroken{processes}"
        finish(launch(processes, unbroken, params, mesh))
        expected = losses(unbroken)
        with open(unbroken / "metrics.jsonl") as f:
            last = [r for r in map(json.loads, f) if "train/loss" in r][-1]
        assert abs(last["train/mixture/code"] - 0.25) < 0.02, last
        model_dir = tmp_path / f"run{processes}"
        killed_after = rng.choice([2, 4, 6])
        run = [*params, f"run.data_workers={workers}"]
        procs = launch(processes, model_dir, run, mesh)
        wait_for(model_dir / "checkpoints" / str(killed_after) / "data", procs)
        time.sleep(rng.random())  # somewhere in the steps after it
        for p in procs:
            p.kill()
            p.communicate()
        finish(launch(processes, model_dir, run, mesh))
        got = losses(model_dir)
        assert sorted(got) == list(range(1, 9)), (processes, sorted(got))
        for step in range(killed_after + 1, 9):
            assert got[step] == expected[step], (processes, step)
