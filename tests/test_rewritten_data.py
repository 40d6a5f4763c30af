"""A user's data file rewritten between two runs of the same command, as issue 59 found it
(a fresh HOME and data dir, the command as a user types it, run in-process): the same bytes
written again (``cp``, a ``git checkout``, ``touch``) are the same data, and the run resumes;
other contents are new data, and the run continues on them (its parameters and optimizer
state kept, its input from the start of the new data) with one line that says so.

And checkpoints are read one way: ``--mode=eval`` reaches the restored parameters through
one reading function of `io.checkpoints` (`Checkpoints.read`), and checks the checkpoint's
settings once (`io.compatibility.check_compatible`)."""

import json
import os
import shutil
import sys

import pytest

from mtrain.__main__ import main

from tiny_config import TINY

WORDS = ("in the beginning god created heaven and earth was without form void darkness upon "
         "face of deep spirit moved waters said let there be light saw that it good").split()


def corpus(path, seed: int) -> None:
    lines = [" ".join(WORDS[(i * 7 + j * seed) % len(WORDS)] for j in range(5 + i % 9))
             for i in range(400)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def command(model_dir, data, *params):
    return ["--gin_file=layouts/dp4_mp2.gin", "--gin_param=run.task=@task()",
            "--gin_param=task.data=@files()", f"--gin_param=files.train='{data}'",
            "--gin_param=files.format='text'", "--gin_param=files.validation=0.1",
            f"--model_dir={model_dir}",
            *[f"--gin_param={p}" for p in [*TINY, "vocabulary.size=48", "run.checkpoint_every=2",
                                           "run.eval_split='validation'", *params]]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A user's text file, and a run of 2 steps on it (checkpoint 2), with a fresh HOME."""
    root = tmp_path_factory.mktemp("rewritten")
    home, before = root / "home", {k: os.environ.get(k) for k in ("HOME", "MTRAIN_DATA_DIR")}
    os.environ["HOME"] = str(home)
    os.environ.pop("MTRAIN_DATA_DIR", None)
    corpus(root / "train.txt", 3)
    assert main(command(root / "run", root / "train.txt", "run.train_steps=2")) == 0
    yield root
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def copy(trained, tmp_path):
    """The trained run and its data file, copied (the data dir stays the user's)."""
    shutil.copytree(trained / "run", tmp_path / "run")
    shutil.copy2(trained / "train.txt", tmp_path / "train.txt")
    return tmp_path / "run", tmp_path / "train.txt"


def prepared(trained):
    return sorted(p.name for p in (trained / "home").rglob("*") if p.is_dir())


def position(model_dir, step: int) -> dict:
    """The input position a checkpoint saved."""
    (saved,) = (model_dir / "checkpoints" / str(step) / "data").glob("*.json")
    return json.loads(saved.read_text())


@pytest.mark.slow  # (about 20 s)
def test_the_same_bytes_written_again_resume(trained, tmp_path, capsys):
    model_dir, data = copy(trained, tmp_path)
    made = prepared(trained)
    text = data.read_bytes()
    data.unlink()
    data.write_bytes(text)  # a new file (another inode and times), the same bytes
    os.utime(data, ns=(10**18, 10**18))  # and touched
    capsys.readouterr()
    assert main(command(model_dir, data, "run.train_steps=4")) == 0
    err = capsys.readouterr().err
    assert "resuming from the checkpoint of step 2" in err
    assert "data differs" not in err and "other settings" not in err
    assert prepared(trained) == made  # nothing prepared again
    assert position(model_dir, 4) != position(model_dir, 2)  # its input went on


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_other_contents_continue_on_the_new_data_from_its_start(trained, tmp_path, capsys):
    model_dir, data = copy(trained, tmp_path)
    corpus(data, 5)  # edited: other lines
    capsys.readouterr()
    assert main(command(model_dir, data, "run.train_steps=4")) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "data differs" in line]
    assert len(said) == 1, err
    assert "continuing on the new data from its beginning" in said[0]
    assert "parameters and optimizer state of step 2" in said[0]
    assert "resuming from the checkpoint of step 2" in err
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["2", "4"]
    # Its input started again: after 2 steps it stands where a new run on the new data
    # stands after its first 2.
    fresh = tmp_path / "fresh"
    shutil.copytree(model_dir, fresh, ignore=shutil.ignore_patterns("checkpoints", "*.jsonl",
                                                                   "events*"))
    assert main(command(fresh, data, "run.train_steps=2")) == 0
    assert position(model_dir, 4) == position(fresh, 2)
    # ... and the same command again resumes from step 4 without a word about the data.
    capsys.readouterr()
    assert main(command(model_dir, data, "run.train_steps=6")) == 0
    err = capsys.readouterr().err
    assert "resuming from the checkpoint of step 4" in err and "data differs" not in err


def test_eval_reads_the_parameters_through_one_reading_function(trained, tmp_path):
    """The functions of io/checkpoints.py and io/compatibility.py that `--mode=eval` enters
    from outside them (their calls of each other, and the callbacks they hand out, are
    inside): the checkpoints opened, one `read`, and closed; and the checkpoint's settings
    checked once. (`state_signature` makes this run's own meta: no read.)"""
    model_dir, data = copy(trained, tmp_path)
    modules = (os.path.join("mtrain", "io", "checkpoints.py"),
               os.path.join("mtrain", "io", "compatibility.py"))
    entered, checked = [], []

    def inside(frame) -> bool:
        return frame.f_code.co_filename.endswith(modules)

    def profile(frame, event, arg):
        if event != "call" or not inside(frame):
            return
        if frame.f_code.co_name == "check_compatible":
            checked.append(frame.f_code.co_qualname)
        caller = frame.f_back
        while caller is not None and not inside(caller):
            caller = caller.f_back
        if caller is None and frame.f_code.co_name != "state_signature":
            entered.append(f"{os.path.basename(frame.f_code.co_filename)}:"
                           f"{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        code = main(command(model_dir, data, "run.train_steps=2") + ["--mode=eval"])
    finally:
        sys.setprofile(None)
    assert code == 0
    assert entered == ["checkpoints.py:Checkpoints.__init__", "checkpoints.py:Checkpoints.read",
                       "checkpoints.py:Checkpoints.close"], entered
    assert checked == ["check_compatible"]
