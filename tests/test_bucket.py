"""A model dir in a bucket (``gs://``), as `launch/tpu.sh` runs: train, run the same command
again, evaluate, start another run from it, --restart; and a data dir there is refused.

The bucket is a GCS emulator: gcp-storage-emulator (a test dependency) with what tensorstore
and gcsfs need of it added, in tests/gcs_emulator.py. orbax writes the checkpoints through
tensorstore (pointed at it by TENSORSTORE_GCS_HTTP_URL), and mtrain its own files (metrics,
TensorBoard events, config, vocabulary, input position) through etils.epath. epath reaches
gs:// through TensorFlow's gfile when TensorFlow is installed, and gfile cannot be pointed at
an emulator, so here epath takes its other backend, gcsfs, which honours
STORAGE_EMULATOR_HOST. What this tests is that every file of the model dir goes through
those libraries, none through the local file system, and that nothing relies on what a
bucket cannot do (append to an object, hold a lock, make an empty directory).
"""

import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from etils import epath
from etils.epath import gpath

from mtrain.__main__ import main
from tiny_config import TINY

BUCKET = "mtrain-test"


# The emulator (tests/gcs_emulator.py), in a process of its own: in this one it would wait
# for the GIL while the training loop holds it, and tensorstore's requests would time out.
EMULATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator.py")


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, EMULATOR, str(port), BUCKET],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "no emulator"
                time.sleep(0.1)
        url = f"http://localhost:{port}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
        monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # gcsfs, not gfile
        # gcsfs warns of the missing credentials
        monkeypatch.setattr(logging.getLogger("gcsfs"), "level", logging.ERROR)
        monkeypatch.chdir(tmp_path)  # where a model dir taken for a local path would appear
        yield f"gs://{BUCKET}"
    finally:
        server.kill()
        server.wait()
    assert not (tmp_path / "gs:").exists()


def cli(model_dir, *params, mode=None, more=()):
    argv = ["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin",
            *[f"--gin_param={p}" for p in [*TINY, "run.eval_every=0", "run.log_every=2",
                                          "run.checkpoint_every=2",
                                          *params]],
            f"--model_dir={model_dir}", *([f"--mode={mode}"] if mode else []), *more]
    return main(argv)


def records(model_dir):
    return [json.loads(line) for line in epath.Path(model_dir, "metrics.jsonl").read_text()
            .splitlines()]


@pytest.mark.slow
def test_a_model_dir_in_a_bucket(bucket, data_dir, tmp_path, capfd):
    run = f"{bucket}/run"
    assert cli(run, "run.train_steps=4") == 0
    names = {p.name for p in epath.Path(run).iterdir()}
    assert {"checkpoints", "metrics.jsonl", "config.gin", "vocabulary.model"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)  # TensorBoard's
    assert "mtrain.lock" not in names  # a bucket dir is not locked (see mtrain.lock)
    assert sorted(p.name for p in epath.Path(run, "checkpoints").iterdir()) == ["2", "4"]
    assert "run.train_steps = 4" in epath.Path(run, "config.gin").read_text()

    # The same command again, further: it resumes, and metrics.jsonl keeps the first run's.
    capfd.readouterr()
    assert cli(run, "run.train_steps=6") == 0
    assert "resuming from the checkpoint of step 4" in capfd.readouterr().err
    train = [r["step"] for r in records(run) if "train/loss" in r]
    assert train == [2, 4, 6]
    capfd.readouterr()
    assert cli(run, "run.train_steps=6", mode="eval") == 0
    logged = next(line for line in capfd.readouterr().err.splitlines() if "step 6  eval/loss" in line)
    evals = [r for r in records(run) if "eval/loss" in r]
    # (the same results for the same step are recorded once)
    assert [r["step"] for r in evals] in ([4, 6], [4, 6, 6])
    assert float(logged.split("eval/loss ")[1].split()[0]) == pytest.approx(
        evals[1]["eval/loss"], rel=1e-4)  # (as logged: 4 decimals)

    # Another run, local, starts from its parameters.
    capfd.readouterr()
    assert cli(tmp_path / "local", "run.train_steps=2", f"run.init_from='{run}'") == 0
    assert f"starting from the parameters of step 6 of {run}/checkpoints" in capfd.readouterr().err

    # --restart moves the run's files aside, within the bucket, and trains from step 0.
    assert cli(run, "run.train_steps=2", more=["--restart"]) == 0
    moved = {p.name for p in epath.Path(run, "before-restart-1").iterdir()}
    assert {"checkpoints", "metrics.jsonl", "config.gin", "vocabulary.model"} <= moved
    assert sorted(p.name for p in epath.Path(run, "before-restart-1", "checkpoints").iterdir()) \
        == ["2", "4", "6"]
    assert [r["step"] for r in records(run) if "train/loss" in r] == [2]


def test_a_data_dir_in_a_bucket_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTRAIN_DATA_DIR", "gs://some-bucket/data")
    monkeypatch.chdir(tmp_path)
    assert cli(tmp_path / "run", "run.train_steps=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be a local path" in err[0], err
    assert not (tmp_path / "gs:").exists() and not (tmp_path / "run").exists()


def test_a_bucket_that_cannot_be_written_is_one_error(bucket, data_dir, capsys):
    assert cli("gs://no-such-bucket/run", "run.train_steps=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and "Traceback" not in "".join(err), err
    assert err[-1].startswith("mtrain: error: cannot write the model dir gs://no-such-bucket/run"), err


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """A storage endpoint that refuses every request, as GCS does without credentials or
    permission."""

    def _refuse(self):
        body = b'{"error": {"code": 403, "message": "no access"}}'
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

    def log_message(self, *args):
        pass


def test_a_bucket_without_access_is_one_error(monkeypatch, tmp_path, capsys):
    """Refused before any data is prepared, and nothing is written anywhere."""
    with http.server.HTTPServer(("localhost", 0), _Forbidden) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://localhost:{server.server_port}")
        monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
        monkeypatch.setattr(logging.getLogger("gcsfs"), "level", logging.ERROR)
        monkeypatch.setenv("MTRAIN_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.chdir(tmp_path)
        remote, local = f"gs://{BUCKET}/run", tmp_path / "local"
        for model_dir, mode, params, what in [
                (remote, "train", (), "the model dir"),
                (remote, "eval", (), "the model dir"),  # not "no checkpoints; train first"
                (local, "train", (f"run.init_from='{remote}'",), "run.init_from")]:
            assert cli(model_dir, "run.train_steps=2", *params, mode=mode) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(
                f"mtrain: error: cannot reach {what} {remote}: Forbidden"), err
        server.shutdown()
    assert os.listdir(tmp_path) == []
