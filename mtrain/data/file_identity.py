"""Which data a run reads: a digest of its files' contents (`identity`).

A run's checkpoints record it (the input position is only valid for the data it was saved
with), and the prepared copy of a user's files is named by it. Contents and names, not
folders or modification times: a byte-identical copy of a file (``cp``, a ``git checkout``,
a sync, a folder moved) is the same data, so the same command resumes; an edited file is
other data.

Each file is read once (in chunks, never whole), however often its digest is asked for: the
digest of a file is kept for as long as its path, size, inode and times (modification and
change: any write changes the latter) stay the same, in this process and, once a run has
prepared its data (`remember`), in the data dir's ``file_digests.json`` for the runs after
it (`identity`'s `store`), so that a large corpus, or one in a bucket, is not read again at
every start. A run refused before that leaves the data dir as it was.

`stat_identity` is the older, cheaper kind (paths, sizes, modification times): what names a
TFDS dataset prepared from local raw files, where a rebuild is the cost of a change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Sequence

from etils import epath

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_KNOWN: dict[str, str] = {}  # `_stat`, joined by tabs -> size and digest of the contents
STORE = "file_digests.json"


def identity(paths: Sequence, store: str | None = None) -> str:
    """A short hex digest of the files' names (without their folders) and contents, in the
    order given. It changes when a file's contents change or a file is added, removed or
    renamed, and is the same in every process and run otherwise (a file rewritten with the
    same bytes, or its folder moved, included). `store`: a directory whose digests
    (`remember`) stand in for reading a file whose stat they name."""
    stats = [_stat(path) for path in paths]
    keys = ["\t".join(map(str, fields)) for fields in stats]
    kept = _load(store) if any(k not in _KNOWN for k in keys) else {}
    digest = hashlib.sha256()
    for path, fields, key in zip(paths, stats, keys):
        if key not in _KNOWN:
            if key in kept:
                _KNOWN[key] = kept[key]
            else:
                with epath.Path(fields[0]).open("rb") as f:
                    _KNOWN[key] = f"{fields[1]} {hashlib.file_digest(f, 'sha256').hexdigest()}"
        digest.update(f"{epath.Path(path).name}\t{_KNOWN[key]}\n".encode())
    return digest.hexdigest()[:16]


def remember(store: str) -> None:
    """Keeps the digests this process has read in `store` (a local directory: the data
    dir), for `identity` in the runs after it."""
    kept = _load(store)
    if store and not _URI.match(str(store)) and not set(_KNOWN.items()) <= set(kept.items()):
        _save(store, {**kept, **_KNOWN})


def stat_identity(paths: Sequence) -> str:
    """A short hex digest of the files' full paths, sizes and modification times, in the
    order given (one stat each, no reading)."""
    digest = hashlib.sha256()
    for path in paths:
        name, size, mtime = _stat(path)[:3]
        digest.update(f"{name}\t{size}\t{mtime}\n".encode())
    return digest.hexdigest()[:16]


def _stat(path) -> tuple:
    """(the path to open, its size, modification time, change time, inode); the last two
    empty in a bucket."""
    if not _URI.match(str(path)):
        name = os.path.abspath(os.path.expanduser(str(path)))
        stat = os.stat(name)
        return name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino
    stat = epath.Path(path).stat()
    return str(path), stat.length, stat.mtime, "", ""


def _load(store: str | None) -> dict[str, str]:
    if not store or _URI.match(str(store)):
        return {}
    try:
        with open(os.path.join(store, STORE), encoding="utf-8") as f:
            kept = json.load(f)
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: a cache, read the files again
        return {}


def _save(store: str, kept: dict[str, str]) -> None:
    """Writes the digests atomically (a run beside this one may write them too: the last
    one's stand, each of them right)."""
    try:
        os.makedirs(store, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=store, suffix=".tmp", delete=False,
                                         encoding="utf-8") as f:
            json.dump(kept, f)
        os.replace(f.name, os.path.join(store, STORE))
    except OSError:  # a data dir that cannot be written: the digests are kept in memory
        pass
