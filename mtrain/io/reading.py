"""Reading checkpoints without training from them: a reader's restore
(`restore_for_reading`: eval, score, infer, export), and ``run.init_from``'s read of a
checkpoint's parameters alone, whatever it holds (`read_params`).
"""

from __future__ import annotations


from etils import epath

from mtrain.io.checkpoints import (CheckpointError, Checkpoints, DamagedCheckpoint,
                                   restore_params)


def require_checkpoints(directory, missing: str) -> None:
    """Raises a CheckpointError saying `missing` (what to do) unless `directory` holds a
    checkpoint's step directory; reads only (a `Checkpoints` would create `directory`)."""
    path = epath.Path(directory)
    names = [p.name for p in path.iterdir()] if path.is_dir() else []
    if not any(name.isdigit() for name in names):
        set_aside = sorted(n for n in names if ".damaged" in n or ".diverged" in n)
        if set_aside:
            raise CheckpointError(f"{directory} holds only checkpoints that were set aside "
                                  f"({', '.join(set_aside)}); restore a good copy")
        raise CheckpointError(f"no checkpoints in {directory}; {missing}")


def restore_for_reading(directory: str, abstract_state, meta: dict, step: int | None = None,
                        missing: str = "train first (--mode=train)",
                        advice: str = "use the settings of the run that trained it (its "
                                      "config.gin)"):
    """(state, step) of checkpoint `step` (default: the newest that can be read) in
    `directory`, into the shardings of `abstract_state`, without the input position: for
    eval, score, infer and init_from. Reads only (a damaged checkpoint is skipped, not moved
    aside); `missing` says what to do when `directory` holds no checkpoint, `advice` what
    to do about one of another model."""
    require_checkpoints(directory, missing)
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {directory}; {missing}")
        if step is None:
            return checkpoints.restore_intact(abstract_state, None, meta, set_aside=False,
                                              advice=advice)
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {directory} (it has {steps})")
        return checkpoints.restore(step, abstract_state, None, meta, advice), step
    finally:
        checkpoints.close()


def read_params(directory: str, abstract_params, meta: dict, step: int | None = None,
                missing: str = "", advice: str | None = None):
    """(parameters, step) of checkpoint `step` (default: the newest that can be read) in
    `directory` (`Checkpoints.restore_params`): ``run.init_from``'s read."""
    require_checkpoints(directory, missing)
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        steps = checkpoints.all_steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {directory} (it has {steps})")
        first = None
        for candidate in [step] if step is not None else steps[::-1]:
            try:
                return (restore_params(checkpoints, candidate, abstract_params, meta, advice),
                        candidate)
            except DamagedCheckpoint as e:
                if step is not None:
                    raise
                first = first or e
        raise CheckpointError(f"no checkpoint in {directory} can be read: {first}")
    finally:
        checkpoints.close()

