"""Looking into model dirs from tests: a checkpoint's arrays, and a digest of everything."""

import hashlib
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp


def saved_state(model_dir, step):
    """The arrays of a checkpoint's train state, as numpy."""
    path = os.path.join(model_dir, "checkpoints", str(step), "state")
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return checkpointer.restore(path, restore_args=args)


def digest(root) -> str:
    """sha256 over the relative path and contents of every file and directory under `root`
    ("missing" if there is no `root`)."""
    if not os.path.exists(root):
        return "missing"
    h = hashlib.sha256()
    for path in sorted(pathlib.Path(root).rglob("*")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()
