"""Checkpoints with orbax: the train state, the input position, and a little metadata.

A checkpoint is one orbax step directory ``<model_dir>/checkpoints/<step>/`` with three items:

- ``state``: the `TrainState` as logical (global) arrays. Restoring takes the target
  shardings of the current run, so a checkpoint saved with one mesh and layout restores onto
  another.
- ``data``: the input iterator's position, one file per process.
- ``meta``: JSON (step, model config) used to refuse restoring a different model shape.

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and the
write to disk overlaps the following train steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from mtrain import distributed
from mtrain.errors import UserError

log = logging.getLogger("mtrain")


class CheckpointError(UserError):
    """A checkpoint that cannot be restored into this run."""


class DataIteratorHandler(ocp.CheckpointHandler):
    """Saves and restores an input iterator (``save(directory)``/``restore(directory)``)."""

    def save(self, directory: epath.Path, args: DataIteratorSave):
        args.iterator.save(str(directory))  # the iterator names its file after its process

    def restore(self, directory: epath.Path, args: DataIteratorRestore):
        args.iterator.restore(str(directory))
        return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    iterator: Any


class Checkpoints:
    """Keeps the last `keep` checkpoints of a model dir."""

    def __init__(self, directory: str, keep: int = 3, keep_period: int | None = None,
                 async_save: bool = True):
        """Keeps the last `keep` checkpoints, and every step divisible by `keep_period`."""
        # orbax's tensorstore writer needs an absolute path (a relative one fails in the
        # background save thread, after the step has moved on).
        self.directory = epath.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_period or None, create=True,
            enable_async_checkpointing=async_save,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, iterator, meta: dict) -> None:
        """Starts saving `step` in the background (after checking that the previous save
        succeeded: a failed one, e.g. on a full disk, is a CheckpointError)."""
        with self._failing_save(step):
            self.manager.check_for_errors()
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=DataIteratorSave(iterator),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )

    @contextlib.contextmanager
    def _failing_save(self, step: int):
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # OSError (a full disk), or orbax's wrapping of it
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(
                f"could not save a checkpoint (step {step} or the one before it) in "
                f"{self.directory}: {reason}; the checkpoints already there are intact "
                f"(steps {self.all_steps() or 'none'})") from None

    def restore(self, step: int, abstract_state, iterator, meta: dict):
        """Restores `step` into the shardings of `abstract_state` and moves `iterator`."""
        saved_meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        _check_meta(saved_meta["meta"], meta, self.directory / str(step))
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if iterator is not None:
            items["data"] = DataIteratorRestore(iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"]

    def restore_intact(self, abstract_state, iterator, meta: dict):
        """(state, step) of the newest checkpoint that restores.

        A checkpoint that fails to restore (partly written, truncated, corrupted) is moved
        aside to ``<step>.damaged`` with a warning, and the one before it is tried: a run
        never silently starts from scratch over a model dir that has checkpoints. A
        checkpoint of a different model shape is not damage: that is an error.
        """
        for step in self.all_steps()[::-1]:
            try:
                return self.restore(step, abstract_state, iterator, meta), step
            except CheckpointError:
                raise
            except Exception as e:  # orbax, tensorstore and tf.data raise many kinds
                reason = " ".join(str(e).split())[:300] or type(e).__name__
                damaged = self._move_aside(step)
                log.warning("checkpoint %d cannot be restored (%s); moved it to %s and trying "
                            "the one before", step, reason, damaged)
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be restored (damaged ones were moved to "
            f"<step>.damaged); use a new --model_dir, or restore a good copy")

    def _move_aside(self, step: int) -> epath.Path:
        """Renames a damaged step directory to <step>.damaged[.N] (keeping it for a human);
        process 0 renames, the others wait for it."""
        source = self.directory / str(step)
        target, n = self.directory / f"{step}.damaged", 1
        while target.exists():
            target, n = self.directory / f"{step}.damaged.{n}", n + 1
        if jax.process_index() == 0:
            source.rename(target)
        distributed.sync(f"mtrain_damaged_{step}")
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Waits for the background save, raising a CheckpointError if it failed."""
        with self._failing_save(self.manager.latest_step() or 0):
            self.manager.wait_until_finished()
            self.manager.check_for_errors()

    def close(self) -> None:
        self.manager.close()


def _check_meta(saved: dict, current: dict, where) -> None:
    saved_model, model = saved.get("model", {}), current.get("model", {})
    diffs = [
        f"{k}={saved_model.get(k)!r} there, {model.get(k)!r} here"
        for k in sorted(set(saved_model) | set(model))
        if saved_model.get(k) != model.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {where} holds a model of a different shape ({'; '.join(diffs)}); "
            f"use a new --model_dir or the same model settings"
        )
