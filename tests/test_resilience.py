"""Runs that survive: checkpoints across layouts, damaged checkpoints, non-finite steps,
fine-tuning from another run, and settings changed on a resume. (Runs stopped by signals:
test_signals; bad input and failed writes: test_bad_inputs.)"""

import logging
import os

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
from cli_runs import argv
from model_dirs import assert_bitwise_equal, digest, records, saved_state

# --- checkpoints store logical arrays, not device shards --------------------------------

@pytest.mark.slow  # (about 20 s a backend)
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
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


@pytest.mark.slow  # (several runs through main(): about 20 s)
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
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2",
                     "run.eval_every=0")) == 0
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=2", "run.eval_every=0")) == 0
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
