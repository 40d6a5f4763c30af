"""Errors a user can cause. The command line turns them into one line and exit code 2."""

import os
import re


class UserError(Exception):
    """Bad input: a config, mesh, layout, dataset, vocabulary or checkpoint that cannot work."""


class ConfigError(UserError, ValueError):
    """A gin file or binding that cannot be used."""


class IncompatibleRun(UserError):
    """A checkpoint (or input state) that reads fine but was saved by a run with other
    settings: another model shape, vocabulary, data, batch size, seed or optimizer state.
    Never taken for damage: nothing is renamed."""


class TrainingDiverged(UserError):
    """Too many steps in a row with a non-finite loss or gradient (usually a learning rate
    that is too high for the model)."""


class Interrupted(Exception):
    """The run was stopped by Ctrl-C after saving a checkpoint (exit code 130)."""


class DataError(UserError, ValueError):
    """A data request that cannot work: an unknown split or language, too little data, an
    input state saved by a different pipeline."""


def first_line(e: BaseException) -> str:
    """The first line of what `e` says (its class's name if nothing): a library's error in a
    one-line message."""
    return next(iter(str(e).splitlines()), type(e).__name__)


def failure_reason(error: BaseException) -> str:
    """The root cause of `error` (orbax wraps tensorstore's), in one line of at most 250
    characters: its start and its end, where tensorstore puts the system's reason ("No
    space left on device")."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = " ".join(str(error).split()) or type(error).__name__
    short = text if len(text) <= 250 else f"{text[:120]} ... {text[-125:]}"
    # tensorstore names the system's error by its number too: say it where the cut hid it
    code = re.search(r"os_error_code='?(\d+)", text)
    reason = os.strerror(int(code.group(1))) if code else None
    return f"{reason}: {short}" if reason and reason not in short else short
