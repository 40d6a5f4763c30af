"""One training run per model dir, a model dir that can really be written, and one run at a
time preparing the data.

    lock = ModelDirLock(model_dir)
    lock.check_free()   # read-only: fails at once if a live run holds the dir
    lock.acquire()      # writes <model_dir>/mtrain.lock: {"host", "pid", "since", "command"}
    ...
    lock.release()

Two runs training into one model dir would both write checkpoints and metrics, and the
second to finish would delete the first one's checkpoints. The lock file names its holder,
so the error says who holds it. A lock left by a run that died (SIGKILL, a crash) on this
host, whose process no longer exists, is taken over with a warning; one held from another
host cannot be checked from here, and stays until its run ends or a person deletes it.
With several processes only process 0 takes the lock (`lock_model_dir`). A model dir in a
bucket (gs://) is not locked: a bucket has no exclusive create through TensorFlow's gfile,
and the lock of a preempted pod could not be told from a live one's, so a restarted job
would wait for a person; one job per bucket dir is the launcher's to keep, as with T5X and
MaxText.

`check_writable` writes and deletes a file, so that an unwritable directory (read-only,
full, no permission, whatever the user) fails before the first step instead of at the
first checkpoint.

`check_data_dir` makes the data dir, which is local: each host prepares its own copy.
`preparing_data(data_dir)` is held while a run prepares datasets and vocabularies in it:
runs started together on a fresh machine take turns, and the later ones reuse what the
first made instead of building the same files at once (the second would find the first's
half-written raw tree and fail).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys

import filelock
import jax

from mtrain.errors import ConfigError, UserError
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import is_remote
from mtrain.parallel import distributed

log = logging.getLogger("mtrain")
DATA_LOCK_FILE = ".mtrain-prepare.lock"


class ModelDirInUse(UserError):
    """Another run trains into the same model dir."""


def check_data_dir(data_dir: str) -> None:
    """The data dir is a local directory, or can be made one."""
    if is_remote(data_dir):
        raise ConfigError(f"the data dir {data_dir} (run.data_dir, or $MTRAIN_DATA_DIR) must be "
                          f"a local path: each host prepares its own copy of the data there")
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as e:
        reason = "is not a directory" if os.path.exists(data_dir) else f"cannot be made: {e.strerror}"
        raise ConfigError(f"the data dir {data_dir} (run.data_dir, or $MTRAIN_DATA_DIR) "
                          f"{reason}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to someone else
        return True
    return True


class ModelDirLock:
    """The lock file of one model dir (see the module docstring)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.path = ModelDir(model_dir).lock
        self.held = False
        self.unlocked = is_remote(model_dir)  # a bucket: see the module docstring

    def _holder(self) -> dict | None:
        """The lock's contents, None if there is no lock ({} if it cannot be parsed)."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError):  # unreadable, or cut short by a crash: name no one
            return {}

    def _stale(self, holder: dict) -> bool:
        """Whether `holder` is a process of this host that no longer runs."""
        return (holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
                and not _alive(holder["pid"]))

    def _in_use(self, holder: dict) -> ModelDirInUse:
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
               f"{holder.get('since', '?')}")
        return ModelDirInUse(
            f"the model dir {self.model_dir} is in use by another run ({who}); wait for it to "
            f"end, or use another --model_dir (if that run is gone, delete {self.path})")

    def check_free(self) -> None:
        """Raises ModelDirInUse if a live run holds the lock; writes nothing."""
        if self.unlocked:
            return
        holder = self._holder()
        if holder is not None and not self._stale(holder):
            raise self._in_use(holder)

    def acquire(self) -> None:
        """Takes the lock (taking over a stale one with a warning), or raises ModelDirInUse."""
        if self.unlocked:
            return
        record = json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)})
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile: try again
                if not self._stale(holder):
                    raise self._in_use(holder) from None
                # Rename before taking over: of two runs that find the same stale lock,
                # only one renames it.
                try:
                    os.replace(self.path, f"{self.path}.stale-{os.getpid()}")
                except FileNotFoundError:
                    continue
                os.unlink(f"{self.path}.stale-{os.getpid()}")
                log.warning("took over the lock of a run that is no longer running (pid %s on "
                            "this host, since %s)", holder["pid"], holder.get("since", "?"))
                continue
            except OSError as e:
                raise UserError(f"cannot write the model dir {self.model_dir}: "
                                f"{e.strerror or e}") from None
            with os.fdopen(fd, "w") as f:
                f.write(record + "\n")
            self.held = True
            return
        raise self._in_use(self._holder() or {})

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def preparing_data(data_dir: str):
    """Holds `data_dir`'s preparation lock, waiting (with one line on stderr) while another
    process holds it. An OS lock (`filelock`): the system releases it when its process
    dies, so it is never stale. A data dir where it cannot be made (read-only, prepared
    elsewhere) is used without it."""
    lock = filelock.FileLock(os.path.join(data_dir, DATA_LOCK_FILE))
    try:
        try:
            lock.acquire(blocking=False)
        except filelock.Timeout:
            print(f"waiting for another mtrain process to finish preparing data in {data_dir}",
                  file=sys.stderr, flush=True)
            lock.acquire()
    except OSError as e:
        log.debug("preparing %s without a lock: %s", data_dir, e)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def check_model_dir_free(model_dir: str) -> None:
    """Fails at once (writing nothing) if another live run trains into `model_dir`."""
    _on_process_0(ModelDirLock(model_dir).check_free, model_dir)


def lock_model_dir(model_dir: str) -> ModelDirLock:
    """The model dir's lock, taken by process 0; every process fails if it could not."""
    lock = ModelDirLock(model_dir)
    _on_process_0(lock.acquire, model_dir)
    return lock


def _on_process_0(action, model_dir: str) -> None:
    """Runs `action` on process 0 only; if it raises a UserError, every process raises one
    (process 0 its own), so that none is left waiting for the others."""
    error = None
    if jax.process_index() == 0:
        try:
            action()
        except UserError as e:
            error = e
    if not distributed.process_0_says(error is None):
        if error is not None:
            raise error
        raise ModelDirInUse(f"process 0 cannot use the model dir {model_dir} (its error says why)")
