"""Bad input and faults a user's files, settings and machine bring: one clear line on stderr
(a traceback only with --verbose), exit code 2, and nothing on disk renamed, overwritten or
lost; writes that fail (a full disk, unwritable events) are one line, not tried again."""

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import time

import gin
import numpy as np
import pytest

from mtrain.__main__ import main
from model_dirs import digest, saved_state
from cli_runs import REPO, argv, subprocess_cli


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
    (["--gin_param=run.eval_every=-2"], "run.eval_every must be a number of steps (0: at the end only, -1: never), got -2"),
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
