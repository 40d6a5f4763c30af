"""Runs stopped from outside and started again: SIGKILL, then a resume bit for bit equal to
an uninterrupted run; SIGTERM and Ctrl-C, which save a checkpoint first; a second Ctrl-C; a
resume's steps taken again, recorded once; and two runs on one model dir."""

import json
import logging
import os
import shutil
import signal
import socket
import time

import pytest

from mtrain.__main__ import main
from cli_runs import argv, subprocess_cli, wait_for_step
from model_dirs import (assert_bitwise_equal, assert_each_step_once, records, saved_state,
                        untimed)


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
    assert main(argv(model_dir, "run.train_steps=8", "run.checkpoint_every=4",
                     "run.eval_every=0")) == 0
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
