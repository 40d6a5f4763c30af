"""What a reader of checkpoints checks before it opens them: that the directory holds one
(`require_checkpoints`). The readers' restores themselves (eval, score, infer, export,
``run.init_from``) are `training.start`'s, through `io.checkpoints.Checkpoints.read`.
"""

from __future__ import annotations

from etils import epath

from mtrain.io.checkpoints import CheckpointError


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
