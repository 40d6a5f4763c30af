"""``--mode=infer``: a file of lines in, their translations out, with the latest checkpoint."""

from __future__ import annotations

import os
import sys
import tempfile

from mtrain import training
from mtrain.errors import ConfigError
from mtrain.experiment import Experiment
from mtrain.lock import check_writable
from mtrain.metrics import log


def check_output_file(output_file: str | None) -> None:
    """An --output_file can be written: its directory exists and takes a new file."""
    if output_file in (None, "-"):
        return
    if os.path.isdir(output_file):
        raise ConfigError(f"--output_file {output_file} is a directory")
    directory = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(directory):
        raise ConfigError(f"--output_file {output_file}: the directory {directory} does not exist")
    check_writable(directory, "the directory of --output_file")


def infer(exp: Experiment, input_file: str | None, output_file: str | None) -> int:
    """``--mode=infer``: translates the lines of `input_file` (or stdin) with the latest
    checkpoint, one line out per line in, to `output_file` (or stdout; a file is replaced
    only once every line is translated)."""
    if input_file in (None, "-"):
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(input_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or "not UTF-8 text"
            raise ConfigError(f"cannot read --input_file {input_file}: {reason}") from None
    state, step = training.restore_for_reading(exp, os.path.join(exp.model_dir, "checkpoints"))
    translations = exp.translator(state.params, lines) if lines else []
    if exp.translator.truncated:
        log.warning("%d of %d input lines were longer than %d tokens (run.sequence_length) "
                    "and were cut to it before translating", exp.translator.truncated,
                    len(lines), exp.translator.length)
    text = "".join(t + "\n" for t in translations)
    if output_file in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        directory = os.path.dirname(os.path.abspath(output_file))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".mtrain-infer-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, output_file)
    log.info("translated %d lines with the checkpoint of step %d", len(lines), step)
    return len(lines)
