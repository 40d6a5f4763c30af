"""Directories mtrain writes whole, then renames into place: an import's model dir, an
export's Hugging Face folder.

    with writing("runs/llama", ".importing", "the model dir") as work:
        ...write into work...
    # renamed to runs/llama; on an error (Ctrl-C, SIGTERM too) removed instead

The work dir ``<target><suffix>`` (``runs/llama.importing``) holds an owner record,
``MTRAIN_UNFINISHED.json``: the host, pid (and its start time and the boot, so that a
reused pid is not taken for it) of the process writing it, and a note saying what it is.
Only a directory with that record is ever removed, and only when its process is gone:

- an error, Ctrl-C or SIGTERM removes it at once (SIGTERM then exits with 143);
- one left by a process killed outright (SIGKILL, a crash, a power cut) is removed by the
  next import or export into the same parent directory, on the same host (a process of
  another host cannot be checked from here: it stays, and a run that needs its name says so);
- a directory of that name without the record (the user's) is never touched: a run that
  needs the name refuses in one line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import sys

import jax

from mtrain.errors import ConfigError
from mtrain.parallel import distributed

log = logging.getLogger("mtrain")
OWNER = "MTRAIN_UNFINISHED.json"
SUFFIXES = {".importing": "--mode=import", ".exporting": "--mode=export"}


class Terminated(SystemExit):
    """SIGTERM arrived while a work dir was being written (exit code 143, as the signal's)."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot; None where /proc has none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but is someone else's
        return True
    return True


def read_owner(work: str) -> dict | None:
    """The owner record of the directory `work`: None if it has none (not mtrain's work
    dir), {} if it cannot be read (cut short by a kill while being written)."""
    path = os.path.join(work, OWNER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def owner_gone(owner: dict) -> bool:
    """Whether the process of `owner` (an owner record) no longer runs; False when that
    cannot be known here (another host's process)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    if owner.get("boot") and _boot_id() and owner["boot"] != _boot_id():
        return True  # a process of an earlier boot of this host
    if not _alive(owner["pid"]):
        return True
    started = owner.get("started")
    return started is not None and _start_time(owner["pid"]) not in (None, started)


def _who(owner: dict) -> str:
    return (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, since "
            f"{owner.get('since', '?')}")


def clear_stale(parent: str) -> list[str]:
    """Removes the work dirs in `parent` whose owner record names a process of this host
    that is gone; returns their paths. Nothing else is touched."""
    removed = []
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return removed
    for name in sorted(names):
        path = os.path.join(parent, name)
        if not name.endswith(tuple(SUFFIXES)) or not os.path.isdir(path):
            continue
        owner = read_owner(path)
        if owner and owner_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s: the unfinished work of a %s (%s) that no longer runs",
                        path, SUFFIXES[name[name.rindex("."):]], _who(owner))
    return removed


def _claim(work: str, target: str, suffix: str) -> str | None:
    """Makes `work` with its owner record; returns why it cannot (None: made)."""
    try:
        os.makedirs(os.path.dirname(work) or ".", exist_ok=True)
        os.mkdir(work)
    except FileExistsError:
        owner = read_owner(work)
        if owner is None:
            return (f"{work} is in the way: it is not an unfinished mtrain work dir (it has "
                    f"no {OWNER}); move it, or name another directory")
        if owner == {}:
            return (f"{work} is an unfinished mtrain work dir whose owner cannot be read; "
                    f"delete it if no mtrain is writing {target}")
        return (f"another {SUFFIXES[suffix]} ({_who(owner)}) is writing {target} in {work}; "
                f"wait for it to end (if it is gone, delete {work})")
    except OSError as e:
        return f"cannot make {work}: {e.strerror or e}"
    record = {"note": f"an unfinished mtrain {SUFFIXES[suffix]} into {target}; not a finished "
                      f"directory. mtrain removes it once this process is gone (its next "
                      f"import or export here); you may delete it then.",
              "target": os.path.abspath(target), "host": socket.gethostname(),
              "pid": os.getpid(), "started": _start_time(os.getpid()), "boot": _boot_id(),
              "since": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)}
    with open(os.path.join(work, OWNER), "w") as f:
        json.dump(record, f, indent=1)
    return None


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises `Terminated` in the main thread of a single process (with several,
    JAX's coordination service owns it), so that the work dir is removed on the way out.
    Yields the signals received: a handler's exception raised where Python ignores it (a
    garbage collector's callback) is raised again before the work dir is renamed."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        raise Terminated()

    previous = None
    if jax.process_count() == 1:
        try:
            previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield received
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def writing(target: str, suffix: str, what: str):
    """Yields the work dir ``<target><suffix>`` to write `target` (`what`, for messages) in,
    and renames it to `target` (a new or empty directory) at the end; on any error removes
    it instead. Clears the stale work dirs beside it first (`clear_stale`)."""
    target = target.rstrip("/")
    work = target + suffix
    why = None
    if jax.process_index() == 0:
        clear_stale(os.path.dirname(target))
        why = _claim(work, target, suffix)
    if not distributed.process_0_says(why is None):
        raise ConfigError(why or f"process 0 could not make {work} to write {what} in")
    distributed.sync(f"mtrain_{suffix.strip('.')}_dir")
    try:
        with _sigterm_raises() as received:
            yield work
            if jax.process_index() == 0:
                # (SIGTERM waits for the rename and the record's removal: a finished
                # directory never keeps the record)
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                try:
                    if received:  # (one whose exception was swallowed where it was raised)
                        raise Terminated()
                    if os.path.isdir(target):
                        os.rmdir(target)  # (checked empty by the caller)
                    os.rename(work, target)
                    os.unlink(os.path.join(target, OWNER))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            distributed.sync(f"mtrain_{suffix.strip('.')}_done")
    except BaseException as e:
        if jax.process_index() == 0 and os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
            if isinstance(e, Terminated):
                print(f"mtrain: stopped by SIGTERM; removed the unfinished {work}",
                      file=sys.stderr, flush=True)
        raise
