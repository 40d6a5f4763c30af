"""Errors a user can cause. The command line turns them into one line and exit code 2."""


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
