"""Files in and out: the CLI's text inputs and outputs, the files of a model dir, and
whether a directory can be reached and written.

A model dir may be local or in a bucket (``gs://``, which `launch/tpu.sh` requires): its files
go through `etils.epath`, which reads and writes both. A local file is replaced atomically
(written to a temporary name, then renamed); an object in a bucket is replaced whole by a
single write, and cannot be appended to, so `append_text` rewrites it there (metrics.jsonl,
the one file that grows, is a few kB per thousand steps).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

from etils import epath

from mtrain.errors import ConfigError, UserError, first_line


def is_remote(path: str | os.PathLike) -> bool:
    """Whether `path` is a URL (gs://, s3://, ...) rather than a local path."""
    return "://" in os.fspath(path)


def read_lines(input_file: str | None) -> list[str]:
    """The lines of `input_file` (None or '-': stdin), or a one-line error."""
    if input_file in (None, "-"):
        return sys.stdin.read().splitlines()
    try:
        with open(input_file, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or "not UTF-8 text"
        raise ConfigError(f"cannot read --input_file {input_file}: {reason}") from None


def write_atomically(output_file: str | os.PathLike | None, data: str | bytes) -> None:
    """`data` to `output_file` (None or '-': stdout); a reader never sees half of it."""
    if output_file in (None, "-"):
        sys.stdout.write(data)
        sys.stdout.flush()
        return
    content = data.encode("utf-8") if isinstance(data, str) else data
    if is_remote(output_file):
        epath.Path(output_file).write_bytes(content)
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".mtrain-")
    try:
        # mkstemp's file is its owner's alone (0600): give it the mode a new file gets
        # (0666 less the umask), so that others who share a model dir can read it.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, output_file)
    except BaseException:
        os.unlink(tmp)
        raise


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends `text` to the file `path` (creating it); in a bucket, rewrites the object."""
    if not is_remote(path):
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    path = epath.Path(path)
    path.write_text((path.read_text() if path.exists() else "") + text)


def _umask() -> int:
    mask = os.umask(0)  # (the only way to read it, which sets it: put it back)
    os.umask(mask)
    return mask


def check_reachable(directory: str, what: str) -> None:
    """Raises a one-line UserError naming `what` if `directory` is in a bucket that cannot be
    reached (no network, no credentials); a local one always can."""
    if is_remote(directory):
        try:
            epath.Path(directory).exists()
        except Exception as e:  # a bucket's client raises errors of its own
            raise UserError(f"cannot reach {what} {directory}: {first_line(e)}") from None


def check_writable(directory: str, what: str) -> None:
    """Creates `directory` if needed and writes a file into it (then deletes it); raises a
    UserError naming `what` (e.g. "the model dir") if either fails."""
    if is_remote(directory):
        probe = epath.Path(directory) / f".mtrain-write-test-{socket.gethostname()}-{os.getpid()}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"mtrain")
            probe.unlink()
        except Exception as e:
            raise UserError(f"cannot write {what} {directory}: {first_line(e)}") from None
        return
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".mtrain-write-test-")
        try:
            os.write(fd, b"mtrain")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write {what} {directory}: {e.strerror or e}") from None


def is_writable(directory: str) -> bool:
    """Whether `directory` exists and takes a new file (`check_writable`, creating nothing
    where it does not exist)."""
    if not epath.Path(directory).is_dir():
        return False
    try:
        check_writable(directory, "")
    except UserError:
        return False
    return True
