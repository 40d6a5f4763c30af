"""What a checkpoint holds is what was saved, and readers need not write.

- A byte changed inside the newest checkpoint (the file keeps its size, so nothing but its
  contents tells) is damage for every restore: training sets it aside and resumes from the
  one before; eval, score and `run.init_from` skip it, changing nothing, and use the one
  before. Before checksums, training resumed from the altered parameters.
- A checkpoint whose state holds non-finite values is damage, not divergence.
- A checkpoint of an older mtrain (no checksums) restores, with one line that says so.
- eval and score on a model dir that cannot be written give their numbers (rc 0), and keep
  what they measured in --output_dir when given.
"""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from mtrain.__main__ import main
from cli_runs import argv
from model_dirs import records

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A tiny LM trained 4 steps, with checkpoints of steps 2 and 4, evaluated at the end."""
    model_dir = tmp_path_factory.mktemp("integrity") / "run"
    assert main(argv(model_dir, "run.train_steps=4", "run.checkpoint_every=2",
                     "run.eval_every=0")) == 0
    return model_dir


def copy_of(trained, tmp_path):
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    return model_dir


def change_a_byte(model_dir, step=4):
    """Flips every bit of 8 bytes in the middle of checkpoint `step`'s largest array file,
    whose size does not change."""
    files = list((model_dir / "checkpoints" / str(step) / "state").rglob("d/*"))
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    largest.write_bytes(bytes(data))


def warnings_of(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if "checkpoint" in line]


def test_a_changed_byte_is_damage_for_training(trained, tmp_path, capsys):
    model_dir = copy_of(trained, tmp_path)
    change_a_byte(model_dir)
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=5", "run.checkpoint_every=2")) == 0
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if "cannot be read" in line)
    assert "checkpoint 4 in" in warning and "does not match its checksum" in warning
    assert "was moved to 4.damaged; using the checkpoint of step 2" in warning
    assert "resuming from the checkpoint of step 2" in err
    assert "diverged" not in err
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4", "4.damaged", "5"]


@pytest.mark.parametrize("mode", ["eval", "score", "init_from"])
def test_a_changed_byte_is_skipped_by_readers(trained, tmp_path, capsys, mode):
    model_dir = copy_of(trained, tmp_path)
    change_a_byte(model_dir)
    before = sorted(os.listdir(model_dir / "checkpoints"))
    capsys.readouterr()
    if mode == "eval":
        assert main(argv(model_dir, "run.train_steps=4") + ["--mode=eval"]) == 0
        assert [r for r in records(model_dir) if "eval/loss" in r][-1]["step"] == 2
    elif mode == "score":
        (tmp_path / "in.txt").write_text("In the beginning God created the heaven.\n")
        assert main(argv(model_dir, "run.train_steps=4") + [
            "--mode=score", f"--input_file={tmp_path / 'in.txt'}",
            f"--output_file={tmp_path / 'out.jsonl'}"]) == 0
        assert [r for r in records(model_dir) if "score/tokens" in r][-1]["step"] == 2
    else:
        new = tmp_path / "new"
        assert main(argv(new, "run.train_steps=1", f"run.init_from='{model_dir}'")) == 0
    err = capsys.readouterr().err
    if mode == "init_from":
        assert "starting from the parameters of step 2 of" in err
    warning = next(line for line in err.splitlines() if "cannot be read" in line)
    assert "checkpoint 4 in" in warning and "does not match its checksum" in warning
    assert "left as they are; using the checkpoint of step 2" in warning
    assert sorted(os.listdir(model_dir / "checkpoints")) == before  # a reader renames nothing


def test_a_state_that_is_not_finite_is_damage_not_divergence(trained, tmp_path, capsys):
    """What a checksum cannot catch (a checkpoint saved without one, or a state made
    non-finite before its checksum was taken) is still never resumed from: here the
    checksum is removed and a parameter set to NaN in place."""
    import orbax.checkpoint as ocp

    model_dir = copy_of(trained, tmp_path)
    path = model_dir / "checkpoints" / "4"
    state = ocp.StandardCheckpointer().restore(path / "state")
    state["params"]["final_norm"]["scale"] = np.full_like(state["params"]["final_norm"]["scale"],
                                                          np.nan)
    shutil.rmtree(path / "state")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "state", state)
    checkpointer.wait_until_finished()
    meta = json.loads((path / "meta" / "metadata").read_text())
    del meta["checksums"]
    (path / "meta" / "metadata").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=5", "run.checkpoint_every=2")) == 0
    err = capsys.readouterr().err
    assert "params.final_norm.scale holds values that are not finite" in err
    assert "resuming from the checkpoint of step 2" in err and "diverged" not in err


def test_a_checkpoint_without_checksums_restores_with_one_line(trained, tmp_path, capsys):
    """As an older mtrain wrote them (b8b58d2): no checksums in the meta, no SHA-256 of the
    input position."""
    model_dir = copy_of(trained, tmp_path)
    for step in (2, 4):
        path = model_dir / "checkpoints" / str(step)
        meta = json.loads((path / "meta" / "metadata").read_text())
        del meta["checksums"]
        (path / "meta" / "metadata").write_text(json.dumps(meta))
        for listed in (path / "data").glob("*.sha256"):
            listed.unlink()
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=4") + ["--mode=eval"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "checksums" in line]
    assert len(lines) == 1 and "checkpoint" in lines[0] and "4 has no checksums" in lines[0]


def test_the_input_position_is_checksummed(trained, tmp_path, capsys):
    model_dir = copy_of(trained, tmp_path)
    position = next((model_dir / "checkpoints" / "4" / "data").glob("*.json"))
    text = position.read_text()
    position.write_text(text.replace('"position": ', '"position": 1', 1))
    capsys.readouterr()
    assert main(argv(model_dir, "run.train_steps=5", "run.checkpoint_every=2")) == 0
    warning = next(line for line in capsys.readouterr().err.splitlines()
                   if "cannot be read" in line)
    assert f"{position} does not match its checksum" in warning


def read_only_copy(trained, tmp_path):
    """A read-only bind mount of a copy of the trained model dir (root ignores mode bits)."""
    source = copy_of(trained, tmp_path)
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(source), str(mount)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot bind-mount read-only here: {proc.stderr.strip()}")
    subprocess.run(["mount", "-o", "remount,ro,bind", str(mount)], check=True)
    with pytest.raises(OSError):
        (mount / "probe").write_text("x")
    return mount


@pytest.fixture
def read_only(trained, tmp_path):
    mount = read_only_copy(trained, tmp_path)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_eval_and_score_on_a_read_only_model_dir(read_only, tmp_path, capsys):
    before = sorted(p.name for p in read_only.rglob("*"))
    eval_argv = argv(read_only, "run.train_steps=4") + ["--mode=eval"]
    capsys.readouterr()
    assert main(eval_argv) == 0
    err = capsys.readouterr().err
    assert "eval/loss" in err and "Traceback" not in err
    assert (f"the model dir {read_only} cannot be written: the metrics, events and decodes of "
            "this evaluation are not kept (give --output_dir to keep them)") in err
    (tmp_path / "in.txt").write_text("In the beginning God created the heaven.\nAmen.\n")
    score_argv = argv(read_only, "run.train_steps=4") + [
        "--mode=score", f"--input_file={tmp_path / 'in.txt'}",
        f"--output_file={tmp_path / 'scores.jsonl'}"]
    assert main(score_argv) == 0
    assert len((tmp_path / "scores.jsonl").read_text().splitlines()) == 2
    assert "the scores' summary is not kept" in capsys.readouterr().err
    # With --output_dir, what they measured is kept there.
    out = tmp_path / "out"
    assert main(eval_argv + [f"--output_dir={out}"]) == 0
    assert main(score_argv + [f"--output_dir={out}"]) == 0
    kept = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [4, 4] and "eval/loss" in kept[0]
    assert "score/tokens" in kept[1]
    assert any(p.name.startswith("events.out.tfevents") for p in out.iterdir())
    assert sorted(p.name for p in read_only.rglob("*")) == before
    # And a plan needs no model dir at all.
    assert main(argv(read_only, "run.train_steps=4") + ["--mode=plan"]) == 0


def test_the_same_evaluation_is_recorded_once(trained, tmp_path):
    """A resume of a finished run evaluates its checkpoint again, as does --mode=eval: the
    same record at the same step is not appended again, nor a new event file made."""
    model_dir = copy_of(trained, tmp_path)
    events = sorted(p.name for p in model_dir.iterdir() if p.name.startswith("events"))
    assert main(argv(model_dir, "run.train_steps=4", "run.eval_every=0")) == 0
    assert main(argv(model_dir, "run.train_steps=4") + ["--mode=eval"]) == 0
    evaluated = [r["step"] for r in records(model_dir) if "eval/loss" in r]
    assert evaluated == [4]
    assert sorted(p.name for p in model_dir.iterdir() if p.name.startswith("events")) == events


def test_shared_files_are_readable_by_others(trained):
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("config.gin", "vocabulary.model"):
        assert (trained / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
