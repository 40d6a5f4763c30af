"""Errors a user can cause. The command line turns them into one line and exit code 2."""


class UserError(Exception):
    """Bad input: a config, mesh, layout, dataset, vocabulary or checkpoint that cannot work."""


class ConfigError(UserError, ValueError):
    """A gin file or binding that cannot be used."""


class TrainingDiverged(UserError):
    """Too many steps in a row with a non-finite loss or gradient (usually a learning rate
    that is too high for the model)."""
