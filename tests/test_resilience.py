"""Runs that survive: checkpoints across layouts, SIGKILL and SIGTERM, damaged checkpoints,
non-finite steps, fine-tuning from another run, and bad input that changes nothing."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mtrain import optimizer
from mtrain.__main__ import main
from mtrain.checkpoints import Checkpoints
from mtrain.layout import Layout
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.trainer import Trainer
from tiny_config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = [*TINY, "transformer.dropout_rate=0.1", "run.log_every=1"]
FILES = ["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin"]


def argv(model_dir, *params):
    return FILES + [f"--gin_param={p}" for p in [*PARAMS, *params]] + [f"--model_dir={model_dir}"]


def subprocess_cli(model_dir, *params):
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    return subprocess.Popen([sys.executable, "-m", "mtrain", "--cpu_devices=8",
                             *argv(model_dir, *params)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def saved_state(model_dir, step):
    """The arrays of a checkpoint's train state, as numpy."""
    path = os.path.join(model_dir, "checkpoints", str(step), "state")
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return checkpointer.restore(path, restore_args=args)


def assert_bitwise_equal(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def records(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


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

def test_checkpoint_restores_across_meshes(tmp_path):
    config = TransformerConfig(vocab_size=256, d_model=32, d_ff=64, num_heads=8, d_kv=4,
                               num_layers=1, max_length=16)
    rules = "batch:batch;d_ff:model;heads:model;vocab:model"

    def trainer(mesh_shape):
        layout = Layout(mesh_shape, rules, drop_unused_rules=True)
        mesh = layout.make_mesh(jax.devices()[: layout.size])
        opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
        return Trainer(DecoderLM(config), opt, layout, mesh, 8, 16, seed=0)

    rng = np.random.default_rng(0)
    batch = {"targets": rng.integers(1, 256, (8, 16)).astype(np.int32),
             "targets_segment_ids": np.ones((8, 16), np.int32),
             "targets_positions": np.tile(np.arange(16, dtype=np.int32), (8, 1))}
    dp = trainer("batch:8")
    state, _ = dp.train_step(dp.init_state(), dp.place_batch(batch))
    expected = jax.device_get(state)
    meta = {"model": {"d_model": 32}}
    for i, mesh_shape in enumerate(["batch:2;model:4", ""]):
        source = Checkpoints(tmp_path / str(i), async_save=False)
        source.manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       meta=ocp.args.JsonSave(meta)))
        source.wait()
        target = trainer(mesh_shape)
        state = source.restore(1, target.sharded_abstract_state(), None, meta)
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


# --- killed and preempted runs ----------------------------------------------------------

@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run_bit_for_bit(data_dir, tmp_path):
    common = ["run.train_steps=8", "run.checkpoint_every=2"]
    straight = subprocess_cli(tmp_path / "straight", *common)
    assert straight.wait(timeout=300) == 0, straight.communicate()
    killed = subprocess_cli(tmp_path / "killed", *common)
    wait_for_step(tmp_path / "killed", 5, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert os.listdir(tmp_path / "killed" / "checkpoints")  # something was saved
    resumed = subprocess_cli(tmp_path / "killed", *common)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resuming from the checkpoint of step" in err
    assert_bitwise_equal(saved_state(tmp_path / "killed", 8), saved_state(tmp_path / "straight", 8))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_0(data_dir, tmp_path):
    run = subprocess_cli(tmp_path / "run", "run.train_steps=1000", "run.checkpoint_every=500")
    wait_for_step(tmp_path / "run", 3, run)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert "SIGTERM: stopped after step" in err
    steps = [int(s) for s in os.listdir(tmp_path / "run" / "checkpoints")]
    assert len(steps) == 1 and 3 <= steps[0] < 500
    # The next start resumes from it.
    assert main(argv(tmp_path / "run", f"run.train_steps={steps[0] + 1}",
                     "run.checkpoint_every=500")) == 0
    assert records(tmp_path / "run")[-1]["step"] == steps[0] + 1


# --- damaged checkpoints, non-finite steps, fine-tuning ---------------------------------

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
    assert "checkpoint 4 cannot be restored" in log and "4.damaged" in log
    assert "resuming from the checkpoint of step 2" in log
    names = sorted(os.listdir(model_dir / "checkpoints"))
    assert "4.damaged" in names and {"4", "6"} <= set(names)  # kept aside, then redone


def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(data_dir, tmp_path, capsys):
    model_dir = tmp_path / "run"
    assert main(argv(model_dir, "run.train_steps=2", "run.checkpoint_every=2")) == 0
    os.remove(model_dir / "checkpoints" / "2" / "state" / "_METADATA")
    assert main(argv(model_dir, "run.train_steps=4")) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert not (model_dir / "checkpoints" / "4").exists()


def test_non_finite_steps_are_skipped_then_stop_the_run(data_dir, tmp_path, capsys):
    # A learning rate of 1e30 sends the parameters to inf within a few steps: every step from
    # then on has a non-finite loss, its update is skipped, and the third in a row stops it.
    model_dir = tmp_path / "run"
    code = main(argv(model_dir, "run.train_steps=40", "run.checkpoint_every=1",
                     "learning_rate_schedule.constant=1e30", "run.max_nonfinite_steps=3"))
    assert code == 2
    err = capsys.readouterr().err
    assert "training diverged: 3 steps in a row" in err and "Traceback" not in err
    losses = [r for r in records(model_dir) if "train/loss" in r]
    assert losses[-1]["train/skipped_steps"] >= 2 and np.isnan(losses[-1]["train/loss"])
    for step in os.listdir(model_dir / "checkpoints"):  # no checkpoint holds a non-finite value
        state = saved_state(model_dir, int(step))
        assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state["params"]))


def test_init_from_another_run_and_keep_every(data_dir, tmp_path):
    base = tmp_path / "base"
    assert main(argv(base, "run.train_steps=6", "run.checkpoint_every=1",
                     "run.keep_checkpoints=1", "run.keep_checkpoint_every=3")) == 0
    assert sorted(int(s) for s in os.listdir(base / "checkpoints")) == [3, 6]
    tuned = tmp_path / "tuned"
    assert main(argv(tuned, "run.train_steps=1", f"run.init_from='{base}'", "run.init_step=3",
                     "learning_rate_schedule.constant=0.0")) == 0  # lr 0: parameters stay
    assert_bitwise_equal(saved_state(tuned, 1)["params"], saved_state(base, 3)["params"])


# --- bad input: one line, exit code 2, nothing on disk changed --------------------------

def snapshot(root):
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    assert main(argv(model_dir, "run.train_steps=2", "run.checkpoint_every=2")) == 0
    return model_dir


BAD_INPUTS = [  # (extra command-line arguments, what the one line must say)
    (["--gin_param=run.mesh_shape='batch:x'"], "size of mesh dimension 'batch' must be a positive integer"),
    (["--gin_param=run.layout_rules='d_ff;heads'"], "malformed layout rules 'd_ff;heads'"),
    (["--gin_param=run.mesh_shape='batch:16'"], "needs 16 devices, but 8 are available"),
    (["--gin_param=transformer.num_heads=3"], "'heads' of size 3 is not divisible by mesh dimension 'model' of size 2"),
    (["--gin_param=run.trian_steps=5"], "trian_steps"),
    (["--gin_file=no_such.gin"], "no_such.gin"),
    (["--gin_file=tasks/lm1b.gin", "--data_source=/no/such/raw"], "/no/such/raw"),
    (["--gin_param=vocabulary.path='/no/such.model'"], "cannot read sentencepiece vocabulary /no/such.model"),
    (["--gin_param=vocabulary.path='{readme}'"], "is not a sentencepiece model"),
    (["--gin_param=transformer.d_model=64"], "holds a model of a different shape (d_model=32 there, 64 here)"),
    (["--model_dir={readme}/run"], "cannot write the model dir"),
    (["--mode=infer"], "--mode=infer translates, but task 'bible_lm' is a lm task"),
    (["--gin_param=run.init_from='/no/such/run'"], "run.init_from='/no/such/run' is not a directory"),
]


@pytest.mark.parametrize("extra, message", BAD_INPUTS, ids=[m[:30] for _, m in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_changes_nothing(trained, extra, message, capsys):
    readme = os.path.join(REPO, "README.md")
    before = snapshot(trained)
    capsys.readouterr()
    extra = [e.format(readme=readme) for e in extra]
    assert main(argv(trained, "run.train_steps=4") + extra) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # log lines, then the error
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith("mtrain: error: "), lines
    assert message in lines[-1]
    assert not any("Traceback" in line for line in lines)
    assert snapshot(trained) == before


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
    subprocess.run(["umount", str(mount_point)], check=True)


def test_full_disk_during_save_is_one_clear_error(data_dir, small_disk, capsys):
    model_dir = small_disk / "run"
    code = main(argv(model_dir, "run.train_steps=40", "run.checkpoint_every=1",
                     "run.keep_checkpoints=100"))
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("mtrain: error: could not save a checkpoint"), lines[-1]
    assert not any("Traceback" in line for line in lines)
    saved = [int(s) for s in os.listdir(model_dir / "checkpoints") if s.isdigit()]
    assert saved, "the disk should hold a few checkpoints before it fills up"
    for step in saved:  # what was saved before the disk filled up is intact
        state = saved_state(model_dir, step)
        assert state["step"] == step
