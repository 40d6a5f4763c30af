"""Runs that survive: checkpoints across layouts, SIGKILL and SIGTERM, damaged checkpoints,
non-finite steps, fine-tuning from another run, and bad input that changes nothing."""

import contextlib
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import gin

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mtrain.training import optimizer
from mtrain.__main__ import main
from mtrain.io.checkpoints import Checkpoints
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.training.trainer import Trainer
from conftest import no_compilation_cache
from model_dirs import digest, saved_state
from tiny_config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = [*TINY, "transformer.dropout_rate=0.1", "run.log_every=1"]
FILES = ["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin"]


def argv(model_dir, *params):
    return FILES + [f"--gin_param={p}" for p in [*PARAMS, *params]] + [f"--model_dir={model_dir}"]


def subprocess_cli(model_dir, *params, cache=True):
    """`python -m mtrain` started as from a terminal, where Ctrl-C stops it, whatever this
    process inherited: a test run started in the background by a shell inherits SIGINT
    ignored and would pass that on (and mtrain, as Python, keeps an ignored SIGINT ignored).
    A handler of this process is not inherited (exec resets it to the default); so, for the
    moment the child starts, this process handles SIGINT. (Not a `preexec_fn`: that forks
    this multithreaded process instead of spawning.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    env = env if cache else no_compilation_cache(env)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "mtrain", "--cpu_devices=8",
                                 *argv(model_dir, *params)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def assert_bitwise_equal(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def records(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def untimed(recs):
    """`recs` without the metrics that measure time (which no two runs share)."""
    timings = ("tokens_per_second", "model_flops_per_second_per_device", "mfu")
    return [{k: v for k, v in r.items() if not k.endswith(timings)} for r in recs]


def assert_each_step_once(model_dir):
    """metrics.jsonl holds each step at most once per kind (train/, eval/, ...)."""
    seen = [(r["step"], kind) for r in records(model_dir)
            for kind in {name.split("/")[0] for name in r if name != "step"}]
    assert len(seen) == len(set(seen)), sorted(seen)


def wait_for_step(model_dir, step, proc, timeout=240):
    """Waits until `model_dir`'s metrics show `step` (the process still running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        path = os.path.join(model_dir, "metrics.jsonl")
        if os.path.exists(path) and any(r.get("step", 0) >= step and "train/loss" in r
                                        for r in records(model_dir)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


# --- checkpoints store logical arrays, not device shards --------------------------------

@pytest.mark.parametrize("backend", [
    "cpu", pytest.param("gpu", marks=pytest.mark.slow)])  # (9 s; cpu's the same path)
def test_checkpoint_restores_across_meshes(tmp_path, caplog, monkeypatch, backend):
    """On CPU orbax copies each replicated array off the devices whole; elsewhere (its own
    default, run here behind an emulated 'gpu' backend) each replica writes a slice."""
    config = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=8, d_kv=4,
                               num_layers=1, max_length=16)
    rules = "batch:batch;d_ff:model;heads:model;vocab:model"

    def trainer(mesh_shape):
        layout = Layout(mesh_shape, rules, drop_unused_rules=True)
        mesh = layout.make_mesh(jax.devices()[: layout.size])
        opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
        return Trainer(model=DecoderLM(config), optimizer=opt, layout=layout, mesh=mesh,
                       batch_size=8, sequence_length=16, seed=0)

    rng = np.random.default_rng(0)
    batch = {"targets": rng.integers(1, 256, (8, 16)).astype(np.int32),
             "targets_segment_ids": np.ones((8, 16), np.int32),
             "targets_positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))}
    dp = trainer("batch:8")
    state, _ = dp.train_step(dp.init_state(), dp.place_batch(batch))
    expected = jax.device_get(state)
    meta = {"model": {"d_model": 32}}
    if backend == "gpu":  # orbax's default handler, which a CPU run replaces process-wide
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(),
                                                override=True)
    for i, mesh_shape in enumerate(["batch:2;model:4", ""]):
        source = Checkpoints(tmp_path / str(i), async_save=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles():
            source.manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           meta=ocp.args.JsonSave(meta)))
            source.wait()
        # On CPU each replicated array is copied whole: no slice of it compiled per replica.
        sliced = [r for r in caplog.records if "jit(slice)" in r.getMessage()]
        assert bool(sliced) == (backend == "gpu")
        target = trainer(mesh_shape)
        state = source.read(1, target.sharded_abstract_state(), meta).state
        source.close()
        assert_bitwise_equal(jax.device_get(state), expected)
        wi = state.params["layer_0"]["mlp"]["wi"]
        assert wi.sharding == target.state_shardings.params["layer_0"]["mlp"]["wi"]
        # ... and the restored state trains on its new mesh as on the old one (the steps
        # donate their input: give each a copy).
        copy = jax.tree.map(lambda x: x.copy(), state)
        again, _ = target.train_step(copy, target.place_batch(batch))
        reference, _ = dp.train_step(jax.device_put(jax.tree.map(lambda x: x.copy(), state),
                                                    dp.state_shardings), dp.place_batch(batch))
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                               jax.device_get(again.params), jax.device_get(reference.params))
    monkeypatch.undo()
    Checkpoints(tmp_path / "cpu")  # (a CPU run's handler again, for the tests after this one)


# --- killed and preempted runs ----------------------------------------------------------

@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run_bit_for_bit(data_dir, tmp_path):
    common = ["run.train_steps=8", "run.checkpoint_every=2"]
    straight = subprocess_cli(tmp_path / "straight", *common)
    assert straight.wait(timeout=300) == 0, straight.communicate()
    killed = subprocess_cli(tmp_path / "killed", *common, cache=False)
    wait_for_step(tmp_path / "killed", 5, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert os.listdir(tmp_path / "killed" / "checkpoints")  # something was saved
    assert (tmp_path / "killed" / "mtrain.lock").exists()  # the killed run could not remove it
    resumed = subprocess_cli(tmp_path / "killed", *common)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resuming from the checkpoint of step" in err
    assert f"took over the lock of a run that is no longer running (pid {killed.pid}" in err
    assert not (tmp_path / "killed" / "mtrain.lock").exists()
    assert_bitwise_equal(saved_state(tmp_path / "killed", 8), saved_state(tmp_path / "straight", 8))
    # The steps logged after the checkpoint it resumed from were taken again: recorded once.
    assert_each_step_once(tmp_path / "killed")
    assert untimed(records(tmp_path / "killed")) == untimed(records(tmp_path / "straight"))


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGTERM, 0, "SIGTERM: stopped after step {step} and saved its checkpoint"),
    pytest.param(signal.SIGINT, 130,
                 "mtrain: interrupted (Ctrl-C) after step {step}, and saved its checkpoint",
                 marks=pytest.mark.extended)],
    ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_save_a_checkpoint_and_the_next_run_resumes(data_dir, tmp_path,
                                                                       signum, code, said):
    run = subprocess_cli(tmp_path / "run", "run.train_steps=1000", "run.checkpoint_every=500")
    wait_for_step(tmp_path / "run", 3, run)
    run.send_signal(signum)
    out, err = run.communicate(timeout=120)
    assert run.returncode == code, err
    steps = [int(s) for s in os.listdir(tmp_path / "run" / "checkpoints")]
    assert len(steps) == 1 and 3 <= steps[0] < 500
    assert said.format(step=steps[0]) in err
    assert "Traceback" not in err and not (tmp_path / "run" / "mtrain.lock").exists()
    # The next start resumes from it.
    assert main(argv(tmp_path / "run", f"run.train_steps={steps[0] + 1}",
                     "run.checkpoint_every=500")) == 0
    assert records(tmp_path / "run")[-1]["step"] == steps[0] + 1


def test_a_second_ctrl_c_aborts():
    """Whatever this process inherited (a test run started in the background by a script
    inherits SIGINT ignored), with Ctrl-C's usual handler: the first is noted, the second
    aborts, and the handler found is put back."""
    from mtrain.training.stop_signals import StopSignals

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("mtrain").addHandler(handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGINT)  # handled before os.kill returns to Python
            assert signals.reached(1) == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
        logging.getLogger("mtrain").removeHandler(handler)
    # What the first one says of the second: it does not promise "without saving" (a save
    # under way when it comes is completed).
    assert said == ["Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again "
                    "to stop at once: a checkpoint being written then is completed first)"]


def test_ctrl_c_ignored_from_the_start_stays_ignored():
    """A run started with SIGINT ignored (in the background) is not stopped by one: only
    SIGTERM stops it."""
    from mtrain.training.stop_signals import StopSignals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert signals.reached(1) is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.reached(1) == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_steps_taken_again_after_a_resume_are_recorded_once(data_dir, tmp_path):
    """A run that logged steps it had not checkpointed (killed while it wrote the checkpoint
    of step 6: here it is removed) takes them again when resumed: metrics.jsonl and the
    TensorBoard events hold each step once per kind, with the values of the run that the
    checkpoints continue (here the first run's, bit for bit, but for the timings)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=6", "run.checkpoint_every=4")) == 0
    first = records(model_dir)
    shutil.rmtree(model_dir / "checkpoints" / "6")
    assert main(argv(model_dir, "run.train_steps=8", "run.checkpoint_every=4")) == 0
    assert_each_step_once(model_dir)
    again = records(model_dir)
    assert [r["step"] for r in again if "train/loss" in r] == list(range(1, 9))
    assert untimed(again[:6]) == untimed(first[:6])  # steps 1-6 as the first run took them
    events = EventAccumulator(str(model_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert [e.step for e in events.Scalars("eval/loss")] == [8]


@pytest.mark.slow
def test_two_runs_on_one_model_dir(data_dir, tmp_path):
    """The second run stops at once with the first one's pid, and changes nothing; the first
    trains on undisturbed."""
    first = subprocess_cli(tmp_path / "run", "run.train_steps=1000", "run.checkpoint_every=2",
                           cache=False)
    wait_for_step(tmp_path / "run", 3, first)
    lock = json.loads((tmp_path / "run" / "mtrain.lock").read_text())
    assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
    started = time.time()
    second = subprocess_cli(tmp_path / "run", "run.train_steps=1000", "run.checkpoint_every=2",
                            cache=False)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2 and time.time() - started < 30, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtrain: error: the model dir "), lines
    assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in lines[0]
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    steps = [r["step"] for r in records(tmp_path / "run") if "train/loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one run's records, each step once
    assert not any("tmp" in name for name in os.listdir(tmp_path / "run" / "checkpoints"))


# --- damaged checkpoints, non-finite steps, fine-tuning ---------------------------------

@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(data_dir, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2")) == 0
    # Truncate every data file of the newest checkpoint's state, as a crash mid-write would.
    for root, _, files in os.walk(model_dir / "checkpoints" / "4" / "state"):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(root, name)) // 3)
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=6", "run.checkpoint_every=2")) == 0
    log = capsys.readouterr().err
    report = [line for line in log.splitlines() if "cannot be read" in line]
    assert len(report) == 1 and "checkpoint 4 in" in report[0] and "4.damaged" in report[0]
    assert "resuming from the checkpoint of step 2" in log and "Traceback" not in log
    names = sorted(os.listdir(model_dir / "checkpoints"))
    assert "4.damaged" in names and {"4", "6"} <= set(names)  # kept aside, then redone


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(data_dir, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=2", "run.checkpoint_every=2")) == 0
    os.remove(model_dir / "checkpoints" / "2" / "state" / "_METADATA")
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=4")) == 2
    assert "no checkpoint can be read: checkpoint 2 in" in capsys.readouterr().err
    assert os.listdir(model_dir / "checkpoints") == ["2.damaged"]
    # The next run refuses too (a model dir with only damaged checkpoints is not new), and
    # changes nothing.
    before = digest(model_dir)
    assert main(argv(model_dir, "run.train_steps=4")) == 2
    err = capsys.readouterr().err
    assert "holds only checkpoints that were set aside (2.damaged)" in err and "--restart" in err
    assert digest(model_dir) == before
    # --restart trains from step 0 after moving what the model dir held into a new folder.
    assert main(argv(model_dir, "run.train_steps=2") + ["--restart"]) == 0
    kept = model_dir / "before-restart-1"
    assert {"checkpoints", "metrics.jsonl", "config.gin"} <= set(os.listdir(kept))
    assert os.listdir(kept / "checkpoints") == ["2.damaged"]
    assert [r["step"] for r in records(model_dir) if "train/loss" in r] == [1, 2]
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2"]


def test_non_finite_steps_are_skipped_then_stop_the_run(data_dir, tmp_path, capsys):
    # A learning rate of 1e30 sends the parameters to inf within a few steps: every step from
    # then on has a non-finite loss, its update is skipped, and the third in a row stops it.
    model_dir = tmp_path / "run"
    code = main(argv(model_dir, "run.train_steps=40", "run.checkpoint_every=1",
                     "learning_rate_schedule.constant=1e30", "run.max_nonfinite_steps=3"))
    assert code == 2
    err = capsys.readouterr().err
    assert "training diverged: steps" in err and "Traceback" not in err
    losses = [r for r in records(model_dir) if "train/loss" in r]
    assert losses[-1]["train/skipped_steps"] >= 2 and np.isnan(losses[-1]["train/loss"])
    for step in os.listdir(model_dir / "checkpoints"):  # no checkpoint holds a non-finite value
        if step.isdigit():
            state = saved_state(model_dir, int(step))
            assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state["params"]))


@pytest.mark.slow
def test_divergence_never_poisons_the_newest_checkpoint(data_dir, tmp_path, capsys):
    """Diverging at a learning rate of 1e30: step 5's update (from step 4's sound parameters)
    is finite but huge, and every step after it is non-finite. Checkpoint 5 is written (its
    step was finite), but holds the parameters that every skipped step ran from: it is set
    aside, nothing is written while steps are skipped, and the error names checkpoint 4,
    from which a run at the normal learning rate trains on."""
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2")) == 0
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=40", "run.checkpoint_every=1",
                     "learning_rate_schedule.constant=1e30", "run.max_nonfinite_steps=3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mtrain: error: training diverged: steps 6-8 had a non-finite")
    assert "moved to 5.diverged" in err[-1] and "resume from the checkpoint of step 4" in err[-1]
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4", "5.diverged"]
    assert main(argv(model_dir, "run.train_steps=8", "run.checkpoint_every=2")) == 0
    assert "resuming from the checkpoint of step 4" in capsys.readouterr().err
    # The diverged steps' records were replaced by those of the steps taken again.
    logged = [r for r in records(model_dir) if "train/loss" in r and r["step"] > 4]
    assert [r["step"] for r in logged] == [5, 6, 7, 8]
    assert all(np.isfinite(r["train/loss"]) for r in logged)
    assert logged[-1]["train/skipped_steps"] == 0
    state = saved_state(model_dir, 8)
    assert all(np.isfinite(x).all() and np.abs(x).max() < 100
               for x in jax.tree_util.tree_leaves(state["params"]))


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_init_from_another_run_and_keep_every(data_dir, tmp_path):
    base = tmp_path / "base"
    assert main(argv(base, "run.train_steps=6", "run.checkpoint_every=1",
                     "run.keep_checkpoints=1", "run.keep_checkpoint_every=3")) == 0
    assert sorted(int(s) for s in os.listdir(base / "checkpoints")) == [3, 6]
    tuned = tmp_path / "tuned"
    assert main(argv(tuned, "run.train_steps=1", f"run.init_from='{base}'", "run.init_step=3",
                     "learning_rate_schedule.constant=0.0")) == 0  # lr 0: parameters stay
    assert_bitwise_equal(saved_state(tuned, 1)["params"], saved_state(base, 3)["params"])


@pytest.mark.slow
def test_train_steps_below_the_checkpoint_evaluates_it_as_its_step(data_dir, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2")) == 0
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=2")) == 0
    err = capsys.readouterr().err
    assert "the checkpoint of step 4 is at or past run.train_steps=2" in err
    assert "step 4  eval/loss" in err  # evaluated again, and the same: recorded once
    evals = [r for r in records(model_dir) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [4]


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_config_changes_on_resume(data_dir, tmp_path, capsys):
    """Settings that decide the data, the model or the optimizer state are refused in one
    line naming each (nothing renamed or written); the schedules, the mesh and layout and the
    learning rate may change, and the run resumes."""
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=2", "run.checkpoint_every=2")) == 0
    before = digest(model_dir)
    for params, named in [
            (["run.batch_size=16"], ["run.batch_size=8 there, 16 here"]),
            (["run.seed=3", "run.sequence_length=16"],
             ["run.seed=0 there, 3 here", "run.sequence_length=32 there, 16 here"]),
            (["adafactor.momentum=0.9"], ["adafactor.momentum=None there, 0.9 here"]),
            (["transformer.scan_layers=True"], ["transformer.scan_layers=False there, True here"])]:
        capsys.readouterr()
        assert main(argv(model_dir, "run.train_steps=4", *params)) == 2, params
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and lines[-1].startswith("mtrain: error: checkpoint "), lines
        assert all(n in lines[-1] for n in named), lines[-1]
        assert digest(model_dir) == before
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=1",
                     "run.mesh_shape='batch:8'", "run.layout_rules='batch:batch'",
                     "learning_rate_schedule.constant=0.5", "adafactor.decay_rate=0.7",
                     "loss.label_smoothing=0.1", "transformer.dropout_rate=0.0")) == 0
    assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "3", "4"]
    gin.clear_config()


# --- bad input and faults: one line, exit code 2, nothing on disk changed ---------------

@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    assert main(argv(model_dir, "run.train_steps=2", "run.checkpoint_every=2")) == 0
    return model_dir


@contextlib.contextmanager
def read_only(path):
    """`path` read-only: a read-only bind mount as root (who ignores file modes), else its
    mode."""
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
        if proc.returncode:
            pytest.skip(f"cannot bind-mount here: {proc.stderr.decode().strip()}")
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        mode = os.stat(path).st_mode
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, mode)


def checkpoints_read_only(model_dir, tmp):
    return read_only(model_dir / "checkpoints")


def only_damaged(model_dir, tmp):
    return renamed(model_dir / "checkpoints" / "2", "2.damaged")


@contextlib.contextmanager
def renamed(path, new_name):
    """`path` renamed for the block (the model dir digest is taken with it renamed)."""
    target = path.parent / new_name
    os.rename(path, target)
    try:
        yield
    finally:
        os.rename(target, path)


@contextlib.contextmanager
def lock_held_by_this_process(model_dir, tmp):
    """A lock of a live run: this very process, on this host."""
    path = model_dir / "mtrain.lock"
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "since": "2026-11-22T10:00:00"}))
    try:
        yield
    finally:
        path.unlink()


@contextlib.contextmanager
def garbage_lm1b_tree(model_dir, tmp):
    """A raw lm1b tree with the archive's file names and bytes that are not text."""
    from mtrain.data.make_offline import write_lm1b_tree

    root = write_lm1b_tree(tmp / "garbage")
    rng = np.random.default_rng(0)
    for path in root.rglob("news.en*"):
        path.write_bytes(rng.integers(128, 256, 5000, dtype=np.uint8).tobytes())
    yield


@contextlib.contextmanager
def empty_vocabulary(model_dir, tmp):
    """The model dir's recorded vocabulary emptied (a copy gone wrong)."""
    path = model_dir / "vocabulary.model"
    content = path.read_bytes()
    path.write_bytes(b"")
    try:
        yield
    finally:
        path.write_bytes(content)


def env(name, value):
    @contextlib.contextmanager
    def setting(model_dir, tmp):
        old = os.environ.get(name)
        os.environ[name] = value.format(readme=README, tmp=tmp)
        try:
            yield
        finally:
            os.environ[name] = old  # the data_dir fixture set it
    return setting


README = os.path.join(REPO, "README.md")
ENFR = ["--gin_file=tasks/bible_enfr.gin"]
# (extra command-line arguments, what the one line must say, how the model dir is prepared
# (a context manager given the model dir, or with `tmp` the test's tmp_path), exit code)
BAD_INPUTS = [
    # malformed settings
    (["--gin_param=run.mesh_shape='batch:x'"], "size of mesh dimension 'batch' must be a positive integer"),
    (["--gin_param=run.mesh_shape=8"], "run.mesh_shape must be a string like 'batch:4;model:2', got 8"),
    (["--gin_param=run.layout_rules='d_ff;heads'"], "malformed layout rules 'd_ff;heads'"),
    (["--gin_param=run.layout_rules='batch:batch;dff:model'"], "layout rule 'dff:model' names tensor dimension 'dff', which no parameter or activation of the model has; its dimensions are batch, d_ff, d_kv, d_model, heads, length, memory_length, vocab"),
    (["--gin_param=run.layout_rules='batch:batch;d_ff:modle'"], "layout rule 'd_ff:modle' names mesh dimension 'modle': did you mean 'model'? (the mesh 'batch:4;model:2' has ['batch', 'model'])"),
    (["--gin_param=run.parameter_layout_rules='d_model:bacth'"], "parameter layout rule 'd_model:bacth' names mesh dimension 'bacth': did you mean 'batch'?"),
    (["--gin_param=run.parameter_layout_rules='d_model'"], "malformed parameter layout rules 'd_model'"),
    (["--gin_param=run.parameter_layout_rules='dmodel:batch'"], "parameter layout rule 'dmodel:batch' names tensor dimension 'dmodel', which no parameter of the model has"),
    (["--gin_param=run.parameter_layout_rules='d_model:model'"], "are both split over mesh dimension 'model'; a mesh dimension may split at most one dimension of a tensor — change the layout rule 'vocab:model' or the parameter rule 'd_model:model'"),
    (["--gin_param=run.data_parallel='sgp'", "--gin_param=run.parameter_layout_rules='d_model:batch'"], "run.data_parallel='sgp': parameter layout rule 'd_model:batch' splits the parameters over the gossip mesh dimension 'batch'"),
    (["--gin_param=run.mesh_shape='batch:16'"], "needs 16 devices, but 8 are available"),
    (["--gin_param=transformer.num_heads=3"], "'heads' of size 3 is not divisible by mesh dimension 'model' of size 2"),
    (["--gin_param=run.trian_steps=5"], "trian_steps"),
    (["--gin_file=no_such.gin"], "no_such.gin"),
    (["--gin_param=run.train_steps=0"], "run.train_steps must be a positive integer, got 0"),
    (["--gin_param=run.num_microbatches=3"], "must split into run.num_microbatches=3 microbatches"),
    (["--gin_param=loss.chunks=7"], "loss.chunks=7 must be 0 (automatic) or divide the sequence length 32"),
    (["--gin_param=transformer.remat_policy='most'"], "remat_policy"),
    (["--gin_param=transformer.attention='flash'", "--gin_param=transformer.dropout_rate=0.1"],
     "transformer.attention='flash' has no attention dropout, and transformer.dropout_rate is 0.1"),
    (["--gin_param=transformer.flash_kernel='fast'"], "transformer.flash_kernel must be one of auto, cudnn, cudnn_segments, splash, triton"),
    (["--gin_param=transformer.attention='flash'", "--gin_param=transformer.dropout_rate=0.0",
      "--gin_param=transformer.flash_kernel='cudnn'"],
     "transformer.attention='flash': flash_kernel='cudnn' needs a GPU; use 'splash' or 'auto' here"),
    (["--gin_param=run.sequence_length=64"], "run.sequence_length=64 is longer than transformer.max_length=32"),
    (["--gin_param=run.task='nope'"], "unknown task 'nope'"),
    (["--gin_param=run.eval_split='dev'"], "unknown split 'dev'"),
    (["--gin_param=run.data_parallel='gossip'"], "run.data_parallel must be 'allreduce' or 'sgp'"),
    (["--gin_param=run.data_source='shipped'"], "applies to TFDS tasks only"),
    (["--cpu_devices=0"], "--cpu_devices must be at least 1"),
    (["--mode=evaluate"], "argument --mode: invalid choice: 'evaluate' (choose from"),
    (["--learning_rate=0.1"], "unrecognized arguments: --learning_rate=0.1 (see --help)"),
    (["--auto_layout"], "--auto_layout and --devices go with --mode=plan"),
    (["--mode=eval", "--restart"], "--restart goes with --mode=train"),
    (["--mode=plan", "--target=tpu-v9"], "unknown --target 'tpu-v9'"),
    # data, vocabulary and files that cannot be used
    (["--gin_file=tasks/lm1b.gin", "--data_source=/no/such/raw"], "/no/such/raw"),
    (["--gin_file=tasks/lm1b.gin", "--data_source={tmp}/garbage"], "could not build lm1b:1.1.0 from the raw tree", garbage_lm1b_tree),
    ([], "the data dir {readme} (run.data_dir, or $MTRAIN_DATA_DIR) is not a directory", env("MTRAIN_DATA_DIR", "{readme}")),
    (["--gin_param=vocabulary.path='/no/such.model'"], "cannot read sentencepiece vocabulary /no/such.model"),
    (["--gin_param=vocabulary.path='{readme}'"], "is not a sentencepiece model"),
    (["--model_dir={readme}/run"], "cannot write the model dir"),
    (["--mode=infer", "--output_file={tmp}/no/out.txt"], "the directory {tmp}/no does not exist"),
    (["--mode=score", "--input_file={readme}", "--output_file={readme}"], "--output_file {readme} is the --input_file: writing it would replace the lines being read"),
    (["--output_dir={tmp}/out"], "--output_dir goes with --mode=eval, score, lm_eval or export"),
    (["--model_dir={readme}"], "the model dir {readme} is a file, not a directory"),
    (["--mode=eval", "--model_dir={readme}"], "the model dir {readme} is a file, not a directory"),
    (["--mode=eval"], "holds only checkpoints that were set aside (2.damaged); restore a good copy", only_damaged),
    ([], "{trained}/vocabulary.model is empty: not a sentencepiece model", empty_vocabulary),
    (["--gin_param=run.init_from='{trained}'", "--gin_param=transformer.d_model=64", "--model_dir={tmp}/new"], "transformer.d_model=32 there, 64 here; run.init_from starts from a run of the same model: give this run that run's model settings (its config.gin)"),
    (["--mode=eval", "--model_dir={tmp}/empty"], "no checkpoints in {tmp}/empty/checkpoints; train first"),
    (["--gin_param=run.init_from='/no/such/run'"], "run.init_from='/no/such/run' is not a directory"),
    # the model dir holds another run, or cannot be resumed, or written
    (["--gin_param=transformer.d_model=64"], "is of a run with other settings: transformer.d_model=32 there, 64 here"),
    (["--gin_param=transformer.scan_layers=True"], "transformer.scan_layers=False there, True here"),
    (["--gin_param=vocabulary.size=300"], "vocabulary.size=300, but the checkpoints in {trained} were trained with a vocabulary of 256 pieces"),
    ([*ENFR], "run.task='bible_lm' there, 'bible_enfr' here"),
    (["--gin_param=run.batch_size=16"], "run.batch_size=8 there, 16 here"),
    (["--gin_param=run.seed=1"], "run.seed=0 there, 1 here"),
    (["--gin_param=run.sequence_length=16"], "run.sequence_length=32 there, 16 here"),
    (["--gin_param=adafactor.momentum=0.9"], "adafactor.momentum=None there, 0.9 here"),
    ([], "is in use by another run (pid {pid} on host {host}", lock_held_by_this_process),
    ([], "holds only checkpoints that were set aside (2.damaged)", only_damaged),
    ([], "cannot write checkpoints to", checkpoints_read_only),
]
# These fail in seconds, before anything is compiled or trained.
FAST = (lock_held_by_this_process, checkpoints_read_only)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[1][:40] for c in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_changes_nothing(trained, case, tmp_path, capsys):
    extra, message, prepare = (*case, None)[:3]
    fill = dict(readme=README, tmp=tmp_path, pid=os.getpid(), host=socket.gethostname(),
                trained=trained)
    extra = [e.format(**fill) for e in extra]
    model_dir = next((pathlib.Path(e.split("=", 1)[1]) for e in extra
                      if e.startswith("--model_dir=")), trained)
    setup = prepare(trained, tmp_path) if prepare else contextlib.nullcontext()
    with setup:
        before = digest(model_dir)
        capsys.readouterr()
        started = time.time()
        code = main(argv(trained, "run.train_steps=4") + extra)
        took = time.time() - started
        lines = capsys.readouterr().err.strip().splitlines()
        after = digest(model_dir)
    assert code == 2, lines
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("mtrain: error: "), lines
    assert message.format(**fill) in lines[-1], lines[-1]
    assert not any("Traceback" in line or "Exception" in line for line in lines)
    assert after == before
    if prepare in FAST:
        assert took < 10, f"took {took:.1f} s"
    gin.clear_config()  # a bad binding must not stay for the next test


def test_events_that_cannot_be_written_are_not_tried_again_at_exit(tmp_path, monkeypatch):
    """A full disk fails the TensorBoard events' last flush when the run closes its metrics
    writer; tensorboardX's atexit handler would then flush again and print a traceback after
    the run's one-line error (seen in test_full_disk_during_save_is_one_clear_error)."""
    from tensorboardX.event_file_writer import EventFileWriter

    from mtrain.io.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": 1.0})
    event_writers = [w.event_writer for w in writer._tb.all_writers.values()]

    def full(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EventFileWriter, "flush", full)
    with pytest.raises(OSError, match="No space left"):
        writer.close()
    for event_writer in event_writers:  # what tensorboardX's handlers do at exit
        event_writer.close()
    writer.close()  # and a second close is nothing


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB file system (tmpfs) that fills up after a few tiny checkpoints."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    yield mount_point
    for _ in range(20):  # the failed save's background writer may still be letting go
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.slow
def test_full_disk_during_save_is_one_clear_error(trained, small_disk):
    """In a process of its own, so that what orbax's abandoned writes print at exit counts
    (`trained` made the vocabulary, so the run does not say it trains one)."""
    model_dir = small_disk / "run"
    run = subprocess_cli(model_dir, "run.train_steps=40", "run.checkpoint_every=1",
                         "run.keep_checkpoints=100", "run.log_every=100")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) <= 3, lines  # the start-up line, the FLOPs line, the error
    assert lines[-1].startswith("mtrain: error: could not save a checkpoint"), lines[-1]
    assert "No space left on device" in lines[-1], lines[-1]  # the cause, not cut off
    saved = [int(s) for s in os.listdir(model_dir / "checkpoints") if s.isdigit()]
    assert saved, "the disk should hold a few checkpoints before it fills up"
    for step in saved:  # what was saved before the disk filled up is intact
        state = saved_state(model_dir, step)
        assert state["step"] == step


@pytest.mark.slow
def test_unreadable_checkpoints_are_one_line_in_a_process(data_dir, tmp_path):
    """Every checkpoint truncated: orbax abandons thousands of reads, which Python reported
    at exit as tracebacks; what stays is the start-up line and the error."""
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2")) == 0
    for path in (model_dir / "checkpoints").rglob("*"):
        if path.is_file() and "ocdbt.process_0" in str(path):
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 3)
    run = subprocess_cli(model_dir, "run.train_steps=6")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("mtrain: error: no checkpoint can be read: "
                                                    "checkpoints 4, 2 in"), lines
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2.damaged", "4.damaged"]


def test_a_failed_saves_cause_names_the_system_error():
    """tensorstore's errors are long: cut to one line, the system's reason (from its
    os_error_code) stays in view (a full disk once read as a cut-off zarr spec)."""
    from mtrain import errors

    long = ValueError("RESOURCE_EXHAUSTED: Error opening \"zarr\" driver: Error writing "
                      "\"opt_state/.zarray\" in OCDBT " + "x" * 400 + " [os_error_code='28']")
    reason = errors.failure_reason(long)
    assert reason.startswith("No space left on device: RESOURCE_EXHAUSTED") and len(reason) < 300
    assert errors.failure_reason(OSError(28, "No space left on device")) == \
        "[Errno 28] No space left on device"
