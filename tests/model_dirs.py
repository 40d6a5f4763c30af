"""Looking into model dirs from tests: a checkpoint's arrays, the metrics a run wrote, and a
digest of everything."""

import hashlib
import json
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


def records(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def untimed(recs):
    """`recs` without the metrics that measure time (which no two runs share)."""
    timings = ("tokens_per_second", "model_flops_per_second_per_device", "mfu")
    return [{k: v for k, v in r.items() if not k.endswith(timings)} for r in recs]


def assert_each_step_once(model_dir):
    """metrics.jsonl holds each step at most once per kind (train/, eval/, ...)."""
    seen = [(r["step"], kind) for r in records(model_dir)
            for kind in {name.split("/")[0] for name in r if name != "step"}]
    assert len(seen) == len(set(seen)), sorted(seen)


def assert_bitwise_equal(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
