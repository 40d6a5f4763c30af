"""Text files in and out of the CLI's modes: lines read whole, outputs replaced atomically."""

from __future__ import annotations

import os
import sys
import tempfile

from mtrain.errors import ConfigError


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


def write_atomically(output_file: str | None, text: str) -> None:
    """`text` to `output_file` (None or '-': stdout); a file is replaced only when whole."""
    if output_file in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".mtrain-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, output_file)
