"""The user's paths, end to end, as `python -m mtrain` processes with an empty HOME: no
fixture prepares data, so the first run builds the TFDS dataset and trains the vocabulary
itself (as on a fresh machine), and every later run loads what it built.

For the LM quickstart and for the WMT14 translation experiment: a first run killed while
TFDS writes the dataset; then train 6 steps and, its last checkpoint lost (as if stopped
after step 4), run the same command again: it resumes from step 4 and ends bit for bit where
it had (a checkpoint every 2 steps: few steps, since each costs time and the paths are the
same at any step). For the quickstart, then change a setting that the checkpoints cannot
follow (refused in one line, nothing changed) and one that they can (the layout, to FSDP:
it resumes); the checks behind both are the same for every task, so the translation
experiment leaves them out."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import filelock
import jax
import numpy as np
import pytest

from conftest import no_compilation_cache, split_import_times
from model_dirs import digest, saved_state
from mtrain.io.lock import DATA_LOCK_FILE
from mtrain.io.work_dirs import OWNER

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPERIMENTS = {
    # The quickstart as the README runs it, evaluated only at the end.
    "quickstart": (["--gin_file=quickstart.gin"], ["run.eval_every=0"], "lm1b:1.1.0",
                   "tfds_shipped"),
    # The translation experiment with a smaller model and BLEU on a few sentences, so that
    # CPU tests stay fast; the data, vocabulary and pipeline are the experiment's own.
    "wmt14_enfr_tiny": (["--gin_file=experiments/wmt14_enfr_tiny.gin"],
                        ["run.eval_every=0", "transformer.d_model=64", "transformer.d_ff=128",
                         "transformer.num_heads=2", "decoding.num_examples=8",
                         "decoding.beam_size=2", "decoding.max_decode_length=16"],
                        "wmt14_translate/fr-en:1.0.0", "tfds_shipped"),
}


def user_env(home):
    """The environment of a user whose HOME is `home`, with nothing of mtrain's set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MTRAIN_", "XLA_"))}
    env.update(HOME=str(home), XLA_FLAGS="--xla_backend_optimization_level=0")
    return env


def command(home, files, params, model_dir, *more, python_flags=()):
    """(argv, env) of `python -m mtrain` on 8 CPU devices, with `home` as HOME."""
    args = [sys.executable, *python_flags, "-m", "mtrain", "--cpu_devices=8", *files,
            *[f"--gin_param={p}" for p in params], f"--model_dir={model_dir}", *more]
    return args, user_env(home)


def mtrain(home, files, params, model_dir, *more, python_flags=()):
    args, env = command(home, files, params, model_dir, *more, python_flags=python_flags)
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def killed_when(appears, home, files, params, model_dir, signum=signal.SIGKILL):
    """Starts `mtrain` and sends it `signum` (SIGKILL) as soon as a path matching the glob
    `appears` exists; returns (its exit code, its stderr)."""
    args, env = command(home, files, params, model_dir)
    with subprocess.Popen(args, cwd=REPO, env=no_compilation_cache(env),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        while proc.poll() is None and not glob.glob(str(appears)):
            time.sleep(0.01)
        proc.send_signal(signum)
        stderr = proc.communicate(timeout=60)[1].decode()
    assert glob.glob(str(appears)) or signum != signal.SIGKILL, \
        f"it ended before {appears} appeared: {stderr}"
    return proc.returncode, stderr


def records(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_first_run_rerun_and_changed_settings(name, tmp_path):
    files, params, dataset, tfds_dir = EXPERIMENTS[name]
    home = tmp_path / "home"
    home.mkdir()
    common = [*params, "run.checkpoint_every=2", "run.log_every=2"]
    stopped = tmp_path / "run"

    # The first run on this machine is killed while TFDS writes the dataset (into its
    # "incomplete" directory); the next one removes that and builds it again, whole.
    cache = home / ".cache" / "mtrain"
    unfinished = cache / tfds_dir / dataset.split(":")[0] / "incomplete.*"
    killed_when(unfinished, home, files, [*common, "run.train_steps=6"], stopped)
    assert not (stopped / "checkpoints").exists()

    first = mtrain(home, files, [*common, "run.train_steps=6"], stopped)
    assert first.returncode == 0, first.stderr
    assert f"preparing {dataset} in {cache / tfds_dir}" in first.stderr  # built here
    assert "left by a preparation that did not finish" in first.stderr  # and removed
    assert not glob.glob(str(unfinished))
    assert "sentencepiece vocabulary" in first.stderr
    straight = saved_state(stopped, 6)
    losses = {r["step"]: r["train/loss"] for r in records(stopped) if "train/loss" in r}
    assert sorted(losses) == [2, 4, 6]

    # Its checkpoint of step 6 lost (as if stopped after step 4), the same command again:
    # resumed with two Grain workers (the first run had none) and, its data prepared,
    # without importing TensorFlow; it ends where it had, bit for bit.
    shutil.rmtree(stopped / "checkpoints" / "6")
    again = mtrain(home, files, [*common, "run.train_steps=6", "run.data_workers=2"], stopped,
                   python_flags=("-X", "importtime"))
    assert again.returncode == 0, again.stderr
    imported, _ = split_import_times(again.stderr)
    assert "grain" in imported and "tensorflow" not in imported
    assert "preparing" not in again.stderr and "sentencepiece vocabulary" not in again.stderr
    assert "resuming from the checkpoint of step 4" in again.stderr
    assert sorted(os.listdir(stopped / "checkpoints")) == ["2", "4", "6"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, saved_state(stopped, 6), straight)
    assert {r["step"]: r["train/loss"] for r in records(stopped) if "train/loss" in r} == losses
    if name != "quickstart":
        return

    # A setting that decides the data: refused in one line, the model dir untouched.
    before = digest(stopped)
    changed = mtrain(home, files, [*common, "run.train_steps=8", "run.batch_size=8"], stopped)
    assert changed.returncode == 2
    lines = changed.stderr.strip().splitlines()
    assert len(lines) <= 3 and lines[-1].startswith("mtrain: error: checkpoint "), lines
    assert "run.batch_size=16 there, 8 here" in lines[-1]
    assert digest(stopped) == before

    # The mesh, the layout and the learning rate may change: it resumes, here with the
    # parameters stored sharded over the 8 data-parallel devices (FSDP).
    moved = mtrain(home, files, [*common, "run.train_steps=7",
                                 "learning_rate_schedule.constant=0.5"], stopped,
                   "--gin_file=layouts/fsdp8.gin")
    assert moved.returncode == 0, moved.stderr
    assert "resuming from the checkpoint of step 6" in moved.stderr
    assert "parameter_rules='d_model:batch'" in moved.stderr
    assert records(stopped)[-1]["step"] == 7


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_runs_started_together_on_a_fresh_machine_prepare_the_data_once(tmp_path):
    """Two experiments started at once on a fresh HOME: one builds lm1b and its vocabulary,
    the other waits for it, then uses them (it had failed on the first's half-written raw
    tree). Each process builds its run and stops there: the race is in the data."""
    home = tmp_path / "home"
    data = home / ".cache" / "mtrain"
    data.mkdir(parents=True)
    script = ("import sys; from mtrain.parallel.cpu_devices import simulate_cpu_devices; "
              "simulate_cpu_devices(8); from mtrain import run; "
              "run.parse_config(['quickstart.gin'], []); "
              "print(run.build(model_dir=sys.argv[1]).vocab.digest)")
    # Side by side: without the tests' compilation cache (see conftest).
    env = no_compilation_cache(dict(user_env(home), TF_CPP_MIN_LOG_LEVEL="3"))
    with filelock.FileLock(str(data / DATA_LOCK_FILE)):  # until both wait for it
        procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"run{i}")],
                                  cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for i in range(2)]
        for proc in procs:  # each says that it waits (after what libraries may log first)
            lines = [proc.stderr.readline()]
            while lines[-1] and "waiting for another mtrain process" not in lines[-1]:
                lines.append(proc.stderr.readline())
            assert lines[-1].strip() == (f"waiting for another mtrain process to finish "
                                         f"preparing data in {data}"), lines
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]  # the same vocabulary
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("preparing lm1b:1.1.0") == 1, stderr
    assert stderr.count("sentencepiece vocabulary") == 1, stderr


ORACLES = os.path.join(REPO, "..", "shared", "oracles")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
def test_import_of_a_published_model_then_infer_rerun_and_a_changed_setting(tmp_path):
    """``--mode=import`` of the tiny Llama with an empty HOME and data dir, then infer from
    it through stdin (no data prepared on the way); the same import again is refused in one
    line and leaves the model dir as it was; a kill during an import leaves no model dir
    behind, only its work dir marked as mtrain's, which the next import beside it (with a
    changed layout, into a new dir) clears while the user's look-alike stays; the killed
    import then runs again; SIGTERM during an import removes its work dir at once."""
    home, folder = tmp_path / "home", os.path.join(ORACLES, "llama_gqa")
    home.mkdir()
    layout = ["run.mesh_shape='batch:4;model:2'",
              "run.layout_rules='batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model'"]
    first = mtrain(home, [], layout, tmp_path / "m", "--mode=import", f"--input_dir={folder}")
    assert first.returncode == 0, first.stderr
    args, env = command(home, [f"--gin_file={tmp_path / 'm' / 'config.gin'}"],
                        ["decoding.max_decode_length=4"], tmp_path / "m", "--mode=infer")
    infer = subprocess.run(args, cwd=REPO, env=env, input="And God said\n", capture_output=True,
                           text=True, timeout=900)
    assert infer.returncode == 0 and infer.stdout.strip(), infer.stderr
    assert not (home / ".cache" / "mtrain").exists()  # infer reads no data: none prepared
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "m").rglob("*")}
    again = mtrain(home, [], layout, tmp_path / "m", "--mode=import", f"--input_dir={folder}")
    assert again.returncode == 2 and "not empty" in again.stderr
    assert len(again.stderr.strip().splitlines()) <= 3
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "m").rglob("*")} == before
    importing = ["--mode=import", f"--input_dir={folder}"]
    killed_when(tmp_path / "killed.importing" / "checkpoints", home, importing, [],
                tmp_path / "killed")
    assert not (tmp_path / "killed").exists()
    owner = json.loads((tmp_path / "killed.importing" / OWNER).read_text())
    assert owner["target"] == str(tmp_path / "killed") and "unfinished" in owner["note"]
    (tmp_path / "mine.importing").mkdir()  # the user's, named like a work dir
    (tmp_path / "mine.importing" / "notes.txt").write_text("mine")
    changed = mtrain(home, [], ["run.mesh_shape='model:8'", "run.layout_rules='d_ff:model'"],
                     tmp_path / "m8", "--mode=import", f"--input_dir={folder}")
    assert changed.returncode == 0, changed.stderr
    assert "run.mesh_shape = 'model:8'" in (tmp_path / "m8" / "config.gin").read_text()
    assert not (tmp_path / "killed.importing").exists()
    assert f"removed {tmp_path / 'killed.importing'}" in changed.stderr
    assert (tmp_path / "mine.importing" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "m8" / OWNER).exists()
    rerun = mtrain(home, importing, [], tmp_path / "killed")
    assert rerun.returncode == 0 and not (tmp_path / "killed.importing").exists(), rerun.stderr
    code, stderr = killed_when(tmp_path / "term.importing" / "checkpoints", home, importing,
                               [], tmp_path / "term", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr.strip().splitlines()[-1], stderr
    assert not (tmp_path / "term").exists() and not (tmp_path / "term.importing").exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (that one)
def test_a_sigterm_whose_exception_python_swallowed_still_stops_the_write(tmp_path, capsys):
    """SIGTERM handled while Python runs a garbage collector's callback: the handler's
    exception is ignored there ("Exception ignored in ..."), and the write must stop anyway
    before its work dir becomes the target (CI once saw an import finish so)."""
    import gc

    from mtrain.io.work_dirs import Terminated, writing

    target = tmp_path / "out"

    def callback(phase, info):
        gc.callbacks.remove(callback)
        os.kill(os.getpid(), signal.SIGTERM)  # (handled at this callback's next instruction)

    with pytest.raises(Terminated):
        with writing(str(target), ".importing", "the import"):
            gc.callbacks.append(callback)
            gc.collect()
    assert not target.exists() and not os.path.exists(f"{target}.importing")
    assert "stopped by SIGTERM" in capsys.readouterr().err
