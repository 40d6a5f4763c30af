"""Which data a run reads: a digest of its files' contents (`identity`).

A run's checkpoints record it (the input position is only valid for the data it was saved
with), and the prepared copy of a user's files is named by it. Contents and names, not
folders or modification times: a byte-identical copy of a file (``cp``, a ``git checkout``,
a sync, a folder moved) is the same data, so the same command resumes; an edited file is
other data.

Each file is read once per process (in chunks, never whole), however often its digest is
asked for: the digest of a file is kept for as long as its path, size, inode and times
(modification and change: any write changes the latter) stay the same.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

from etils import epath

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_KNOWN: dict[tuple, str] = {}  # (path, size, mtime, ctime, inode) -> digest of its contents


def identity(paths: Sequence) -> str:
    """A short hex digest of the files' names (without their folders) and contents, in the
    order given. It changes when a file's contents change or a file is added, removed or
    renamed, and is the same in every process and run otherwise (a file rewritten with the
    same bytes, or its folder moved, included)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{epath.Path(path).name}\t{_contents(path)}\n".encode())
    return digest.hexdigest()[:16]


def _contents(path) -> str:
    """The file's size and SHA-256, read in chunks."""
    if not _URI.match(str(path)):
        name = os.path.abspath(os.path.expanduser(str(path)))
        stat = os.stat(name)
        key = (name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
    else:
        name = str(path)
        stat = epath.Path(path).stat()
        key = (name, stat.length, stat.mtime, None, None)
    if key not in _KNOWN:
        with epath.Path(name).open("rb") as f:
            _KNOWN[key] = f"{key[1]} {hashlib.file_digest(f, 'sha256').hexdigest()}"
    return _KNOWN[key]
