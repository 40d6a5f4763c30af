"""Checkpoints with orbax: the train state, the input position, and what run saved them.

A checkpoint is one orbax step directory ``<model_dir>/checkpoints/<step>/`` with three items:

- ``state``: the `TrainState` as logical (global) arrays. Restoring takes the target
  shardings of the current run, so a checkpoint saved with one mesh and layout restores onto
  another.
- ``data``: the input iterator's position, one file per process.
- ``meta``: JSON describing the run that saved it (see `check_compatible`).

A checkpoint written by ``--mode=import`` (`save_imported`) holds the parameters of a
published model and no more: its ``state`` item is ``{"params": ...}``, it has no input
position, and its meta says ``imported``.

A run that freezes parameters and started from a checkpoint stores them once: its
checkpoints name their *base* (`io.bases`). A model dir keeps its step 0 (its import)
whatever ``keep_checkpoints`` says.

Checkpoints are read one way, `Checkpoints.read`: it checks that the checkpoint fits the
run, reads the part of the tree it is asked for that the checkpoint holds, and verifies it
against its checksums. What the rest is (a base's parameters, fresh adapters, a fresh
optimizer for an import) is decided where the run starts (`training.start`).

A checkpoint that cannot be read (missing, truncated or corrupt files) is *damaged*: a
resuming run moves it to ``<step>.damaged`` and tries the one before. One that reads but
does not fit the run is an *incompatible run* (`IncompatibleRun`): an error naming each
setting that differs, and nothing renamed.

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and the
write to disk overlaps the following train steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from mtrain.io import checksums
from mtrain.io.bases import Base, stored_params
from mtrain.io.input_state import DataIteratorRestore, DataIteratorSave
from mtrain.parallel import distributed
from mtrain.errors import IncompatibleRun, UserError, failure_reason
from mtrain.models import parameters
from mtrain.io.compatibility import ADVICE, check_compatible, data_differs
from mtrain.io.textfiles import is_remote

log = logging.getLogger("mtrain")


class CheckpointError(UserError):
    """A checkpoint that cannot be saved or restored."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read."""

    def __init__(self, where, reason: str):
        super().__init__(f"checkpoint {where} cannot be read: {reason}")
        self.reason = reason


def _write_whole_replicas() -> None:
    """Has orbax copy each replicated array off the devices whole, from one replica, rather
    than a slice from each replica ("replica-parallel"). On CPU the devices share the host's
    memory, so the slicing only adds work: a small jitted slice compiled per parameter shape
    and replica, about 2 s on each run's first save."""
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class Checkpoints:
    """Keeps the last `keep` checkpoints of a model dir."""

    def __init__(self, directory: str, keep: int = 3, keep_period: int | None = None,
                 async_save: bool = True, cleanup_tmp: bool = False, read_only: bool = False):
        """Keeps the last `keep` checkpoints, every step divisible by `keep_period`, and
        step 0 (an import: the base of the runs that store their frozen parameters once).
        `cleanup_tmp`: delete the temporary directories of saves that never finished (only
        for the one run that writes the directory). `read_only`: restores only, writing
        nothing (a reader's, whose model dir may not be writable)."""
        # orbax's tensorstore writer needs an absolute path (a relative one fails in the
        # background save thread, after the step has moved on). Not epath's absolute(): it
        # makes gs://b/d a local path.
        self.directory = epath.Path(directory if is_remote(directory) else
                                    os.path.abspath(directory))
        if jax.default_backend() == "cpu":
            _write_whole_replicas()
        from orbax.checkpoint import checkpoint_managers as policies

        kept = [policies.LatestN(n=keep), policies.CustomSteps(steps=[0])]
        kept += [policies.EveryNSteps(keep_period)] if keep_period else []
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(kept), create=not read_only,
            read_only=read_only, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=cleanup_tmp and not read_only,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "meta")
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def set_aside(self) -> list[str]:
        """The names of the checkpoints moved aside (``<step>.damaged[.n]``,
        ``<step>.diverged[.n]``)."""
        if not self.directory.is_dir():
            return []
        return sorted(p.name for p in self.directory.iterdir()
                      if ".damaged" in p.name or ".diverged" in p.name)

    def save(self, step: int, state, iterator, meta: dict, base: "Base | None" = None) -> None:
        """Starts saving `step` in the background (after checking that the previous save
        succeeded: a failed one, e.g. on a full disk, is a CheckpointError). The meta gets
        the checksum of every array of `state` (`checksums.of_arrays`). With a `base`, the
        frozen parameters are left out (module doc)."""
        if base is not None:
            state = state.replace(params=base.without_frozen(state.params))
            meta = {**meta, "base": dataclasses.asdict(base)}
        meta = {**meta, "checksums": checksums.of_arrays(state)}
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

    def save_imported(self, step: int, params, meta: dict) -> None:
        """Saves `params` alone as checkpoint `step` (see the module doc), and waits."""
        meta = {**meta, "checksums": checksums.of_arrays({"params": params})}
        with self._failing_save(step):
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params}), meta=ocp.args.JsonSave(meta)),
                force=True)
            self.manager.wait_until_finished()
            self.manager.check_for_errors()

    def meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]

    @contextlib.contextmanager
    def _failing_save(self, step: int):
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # OSError (a full disk), or orbax's wrapping of it
            steps = self.all_steps()
            kept = (f"the checkpoints already there are intact (steps {steps})" if steps else
                    "no checkpoint was saved before it")
            raise CheckpointError(
                f"could not save a checkpoint (step {step} or the one before it) in "
                f"{self.directory}: {failure_reason(e)}; {kept}") from None

    def read(self, step: int | None, abstract, meta: dict, *, part: str = "state",
             iterator=None, advice: str | None = None, set_aside: bool = False,
             expect: Callable[[dict], None] | None = None, data_may_change: bool = False
             ) -> "Read":
        """What checkpoint `step` holds of `abstract`, into its shardings, verified: the one
        way checkpoints are read (module doc).

        `part`: "state", `abstract` a whole train state (of an import: its parameters
        alone, the rest staying abstract), and `iterator`, if given, moved to the saved
        input position (resuming a run); or "params", `abstract` parameters (any part of
        them). Only the arrays the checkpoint holds are read (what it stores elsewhere, in
        a `Base`, or never had, is missing from the `Read`: its reader decides what they
        are). `meta`: this run's, as `save` takes it, which the checkpoint's must fit (of
        "params": only its ``model``), else `IncompatibleRun` (`advice`: what to do); with
        `data_may_change`, other data than the checkpoint's is no error: the input starts
        from its beginning (`Read.data_restarted`). `expect(meta)`: the caller's own check
        of the checkpoint's meta, before anything is read.

        `step` None: the newest that can be read. A checkpoint whose files cannot be read,
        or whose arrays do not match their checksums or are not finite, is *damaged*
        (`DamagedCheckpoint`): of `step` None, it is moved aside to ``<step>.damaged``
        (`set_aside`; else only skipped) and the one before it tried, with one warning line;
        a run never silently starts from scratch over a model dir with checkpoints. A
        checkpoint without checksums (of an older mtrain) reads with one warning, once."""
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint of step {step} in {self.directory} "
                                      f"(it has {steps})")
            return self._read(step, abstract, meta, part, iterator, advice, expect,
                              data_may_change)
        damaged, first_reason = [], None

        def report() -> str:
            moved = (f"{'were' if len(damaged) > 1 else 'was'} moved to "
                     f"{', '.join(f'{name}.damaged' for name in damaged)}" if set_aside else
                     "left as they are")
            return (f"checkpoint{'s' * (len(damaged) > 1)} {', '.join(damaged)} in "
                    f"{self.directory} cannot be read ({first_reason}) and {moved}")

        for step in steps[::-1]:
            try:
                read = self._read(step, abstract, meta, part, iterator, advice, expect,
                                  data_may_change)
            except DamagedCheckpoint as e:
                if set_aside:
                    self.move_aside(step, "damaged")
                damaged.append(str(step))
                first_reason = first_reason or e.reason
                continue
            except IncompatibleRun:
                if damaged:
                    log.warning(report())
                raise
            if damaged:
                log.warning(report() + f"; using the checkpoint of step {step}")
            return read
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.directory}")
        raise CheckpointError(f"no checkpoint can be read: {report()}; restore a good copy, "
                              f"or pass --restart to train from step 0")

    def _read(self, step, abstract, meta, part, iterator, advice, expect, data_may_change):
        where = self.directory / str(step)
        try:
            saved = self.meta(step)
        except Exception as e:  # orbax, tensorstore and the file system raise many kinds
            raise DamagedCheckpoint(where, failure_reason(e)) from None
        if expect is not None:
            expect(saved)
        imported = bool(saved.get("imported"))  # parameters alone: no run, state or data
        resume = iterator is not None and not imported
        restarted = resume and data_may_change and data_differs(saved, meta)
        check_compatible(saved, meta, where, resume=resume, advice=advice,
                         model_only=part == "params", data_may_change=restarted)
        params = abstract if part == "params" else getattr(abstract, "params", None)
        if params is not None and "base" in saved:  # (held in the base)
            params = Base(**saved["base"]).without_frozen(params)
        if params is not None and (stored := stored_params(saved)) is not None:
            params = parameters.select(params, lambda path: path in stored)
        try:
            if part == "params" or imported:
                target = {"params": params}
                with ocp.PyTreeCheckpointer() as checkpointer:  # (a part of the tree)
                    tree = checkpointer.restore(where / "state", args=ocp.args.PyTreeRestore(
                        target, partial_restore=True,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
            else:
                target = abstract if params is None else abstract.replace(params=params)
                items = {"state": ocp.args.StandardRestore(target)}
                if resume and not restarted:
                    items["data"] = DataIteratorRestore(iterator)
                tree = self.manager.restore(step, args=ocp.args.Composite(**items))["state"]
        except IncompatibleRun:
            raise
        except Exception as e:
            if "tree structures do not match" in str(e):  # a checkpoint without "state" meta
                raise IncompatibleRun(
                    f"checkpoint {where} holds a train state of another structure (a model or "
                    f"optimizer setting differs); {ADVICE}") from None
            raise DamagedCheckpoint(where, failure_reason(e)) from None
        _verify(tree, saved, where, str(self.directory))
        state = None if part == "params" else (
            abstract.replace(params=tree["params"]) if imported else tree)
        return Read.of(step, saved, state, tree["params"] if part == "params" or imported else
                    getattr(tree, "params", None), restarted)

    def move_aside(self, step: int, why: str) -> epath.Path:
        """Renames the directory of checkpoint `step` to <step>.<why>[.N] (keeping it for a
        human): `why` is "damaged" (it cannot be read) or "diverged" (its parameters make
        every step non-finite). Process 0 renames, the others wait for it."""
        source = self.directory / str(step)
        target, n = self.directory / f"{step}.{why}", 1
        while target.exists():
            target, n = self.directory / f"{step}.{why}.{n}", n + 1
        if jax.process_index() == 0:
            source.rename(target)
        distributed.sync(f"mtrain_{why}_{step}")
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Waits for the background save, raising a CheckpointError if it failed."""
        with self._failing_save(self.manager.latest_step() or 0):
            self.manager.wait_until_finished()
            self.manager.check_for_errors()

    def close(self) -> None:
        self.manager.close()


@dataclasses.dataclass(frozen=True)
class Read:
    """What `Checkpoints.read` restored of checkpoint `step` (its `meta`): the train
    `state` (None for a "params" read; of an import, the parameters in the abstract state
    asked for) and the `params` it holds; `data_restarted`: the data differs from its run's,
    so the input was not restored (it starts from its beginning); `imported`: a published
    model's parameters alone (`save_imported`); `base`: where its frozen parameters lie, if
    it stores them once."""

    step: int
    meta: dict
    state: Any
    params: Any
    data_restarted: bool
    imported: bool
    base: Base | None

    @classmethod
    def of(cls, step: int, meta: dict, state, params, data_restarted: bool) -> "Read":
        return cls(step, meta, state, params, data_restarted, bool(meta.get("imported")),
                   Base(**meta["base"]) if "base" in meta else None)


def _verify(tree, saved: dict, where, directory: str) -> None:
    """Raises DamagedCheckpoint if what `tree` restored does not match the checksums of the
    checkpoint's meta (`saved`), or is not finite (no run saves a state that is not)."""
    if "checksums" not in saved:
        if directory not in _UNVERIFIED:
            _UNVERIFIED.add(directory)
            log.warning("checkpoint %s has no checksums (an older mtrain wrote it): what it "
                        "restores cannot be verified", where)
    else:
        sums = {_dotted(key): value for key, value in saved["checksums"].items()}
        now = {_dotted(key): value for key, value in checksums.of_arrays(tree).items()}
        if bad := [key for key, value in now.items() if key in sums and sums[key] != value]:
            raise DamagedCheckpoint(where, f"{array_name(bad[0])} does not match its checksum"
                                    + (f" (nor do {len(bad) - 1} other arrays)" if bad[1:] else ""))
    if bad := checksums.not_finite(tree):
        raise DamagedCheckpoint(where, f"{array_name(bad[0])} holds values that are not finite")


def _dotted(key: str) -> str:
    """An array's path with its first key as an attribute: a state's ``.params['x']`` and a
    part's ``['params']['x']`` name the same array."""
    return re.sub(r"^\['([^']*)'\]", r".\1", key)


_UNVERIFIED: set[str] = set()  # the directories whose checkpoints without checksums were reported


def array_name(path: str) -> str:
    """A train state's path as a name: ".params['layer_0']['mlp']['wi']" -> params.layer_0.mlp.wi."""
    return path.replace("']['", ".").replace("['", ".").replace("']", "").lstrip(".")
