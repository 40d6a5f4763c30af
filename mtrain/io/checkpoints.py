"""Checkpoints with orbax: the train state, the input position, and what run saved them.

A checkpoint is one orbax step directory ``<model_dir>/checkpoints/<step>/`` with three items:

- ``state``: the `TrainState` as logical (global) arrays. Restoring takes the target
  shardings of the current run, so a checkpoint saved with one mesh and layout restores onto
  another.
- ``data``: the input iterator's position, one file per process.
- ``meta``: JSON describing the run that saved it (see `check_compatible`).

A checkpoint written by ``--mode=import`` (`save_imported`) holds the parameters of a
published model and no more: its ``state`` item is ``{"params": ...}``, it has no input
position, and its meta says ``imported``. Readers restore its parameters; training starts
from them at step 0 with a fresh optimizer state and input (`is_imported`), as from
``run.init_from``.

A run that freezes parameters and started from a checkpoint stores them once: its
checkpoints name their *base* (`io.bases`), which every restore reads them from
(`base_params`) and checks. A model dir keeps its step 0 (its import) whatever
``keep_checkpoints`` says.

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
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from mtrain.io import checksums
from mtrain.io.bases import Base, base_digest, stored_params
from mtrain.io.input_state import DataIteratorRestore, DataIteratorSave
from mtrain.parallel import distributed
from mtrain.errors import IncompatibleRun, UserError, failure_reason
from mtrain.models import parameters
from mtrain.models.lora import is_adapter
from mtrain.io.compatibility import ADVICE, check_compatible
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

    def is_imported(self, step: int) -> bool:
        """Whether checkpoint `step` holds imported parameters alone (`save_imported`)."""
        return bool(self.meta(step).get("imported"))

    def has_adapters(self, step: int) -> bool:
        """Whether checkpoint `step` holds LoRA adapters (`models.lora`)."""
        return "lora.rank" in self.meta(step).get("model", {})

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

    def restore(self, step: int, abstract_state, iterator, meta: dict,
                advice: str | None = None):
        """Restores `step` into the shardings of `abstract_state` and, if given, moves
        `iterator` to the saved input position (resuming a run). Of an imported checkpoint
        only the parameters are restored; the rest of the state is `abstract_state`'s.

        Raises `IncompatibleRun` if the checkpoint was saved by a run that `meta` (this
        run's, as `save` takes it) cannot continue (`advice`: what its error tells a reader
        to do), `DamagedCheckpoint` if it cannot be read,
        if what it restores does not match its checksums, or if that is not finite (no
        run saves a state that is not). A checkpoint without checksums (of an older mtrain)
        restores with one warning, once.
        """
        where = self.directory / str(step)
        try:
            saved = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax, tensorstore and the file system raise many kinds
            raise DamagedCheckpoint(where, failure_reason(e)) from None
        imported = bool(saved.get("imported"))  # parameters alone: no run, state or data
        check_compatible(saved, meta, where, resume=iterator is not None, advice=advice)
        base = Base(**saved["base"]) if "base" in saved else None
        target = {"params": abstract_state.params} if imported else abstract_state
        if base is not None:  # the frozen parameters are the base's
            target = abstract_state.replace(params=base.without_frozen(abstract_state.params))
        # A base imported without adapters, for a model with them: its parameters, and
        # zero adapters (the base's function; training makes fresh ones:
        # `has_adapters`).
        fresh_adapters = imported and "lora.rank" not in saved.get("model", {})
        if fresh_adapters:
            target = {"params": parameters.select(abstract_state.params,
                                                    lambda path: not is_adapter(path))}
        items = {"state": ocp.args.StandardRestore(target)}
        if iterator is not None and not imported:
            items["data"] = DataIteratorRestore(iterator)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except IncompatibleRun:
            raise
        except Exception as e:
            if "tree structures do not match" in str(e):  # a checkpoint without "state" meta
                raise IncompatibleRun(
                    f"checkpoint {where} holds a train state of another structure (a model or "
                    f"optimizer setting differs); {ADVICE}") from None
            raise DamagedCheckpoint(where, failure_reason(e)) from None
        state = restored["state"]
        if "checksums" not in saved:
            if str(self.directory) not in _UNVERIFIED:
                _UNVERIFIED.add(str(self.directory))
                log.warning("checkpoint %s has no checksums (an older mtrain wrote it): what it "
                            "restores cannot be verified", where)
        elif bad := checksums.mismatches(saved["checksums"], state):
            raise DamagedCheckpoint(where, f"{array_name(bad[0])} does not match its checksum"
                                    + (f" (nor do {len(bad) - 1} other arrays)" if bad[1:] else ""))
        if bad := checksums.not_finite(state):
            raise DamagedCheckpoint(where, f"{array_name(bad[0])} holds values that are not finite")
        if imported:  # (the optimizer state stays abstract: `is_imported` says to make one)
            params = state["params"]
            if fresh_adapters:
                params = parameters.merge(jax.tree.map(_zeros, abstract_state.params), params)
            return abstract_state.replace(params=params)
        if base is not None:
            frozen = base_params(self, base, abstract_state.params, meta, where)
            return state.replace(params=parameters.merge(frozen, state.params))
        return state

    def restore_intact(self, abstract_state, iterator, meta: dict, set_aside: bool = True,
                       advice: str | None = None):
        """(state, step) of the newest checkpoint that restores.

        A checkpoint that cannot be read (partly written, truncated, corrupted) is moved
        aside to ``<step>.damaged`` (`set_aside`; a reader, which changes nothing in the
        model dir, only skips it), and the one before it is tried (one warning line says
        which were moved or skipped): a run never silently starts from scratch over a model
        dir that has checkpoints. A checkpoint of another run (`IncompatibleRun`) is not
        damage: that is an error, and nothing is renamed.
        """
        damaged, first_reason = [], None

        def report() -> str:
            moved = (f"{'were' if len(damaged) > 1 else 'was'} moved to "
                     f"{', '.join(f'{name}.damaged' for name in damaged)}" if set_aside else
                     "left as they are")
            return (f"checkpoint{'s' * (len(damaged) > 1)} {', '.join(damaged)} in "
                    f"{self.directory} cannot be read ({first_reason}) and {moved}")

        for step in self.all_steps()[::-1]:
            try:
                state = self.restore(step, abstract_state, iterator, meta, advice)
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
            return state, step
        raise CheckpointError(f"no checkpoint can be read: {report()}; restore a good copy, "
                              f"or pass --restart to train from step 0")

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


def restore_params(checkpoints: Checkpoints, step: int, abstract_params, meta: dict,
                   advice: str | None = None):
    """The parameters of checkpoint `step`, whatever it holds (an import, with or
    without adapters; a run's state, its frozen parameters in a base), laid out as
    `abstract_params`: a base's, or ``run.init_from``'s. `meta`: this run's (its
    ``model`` must match; `advice`: what its error says to do). Adapters the checkpoint
    lacks (of a model without them) are zeros from an import, and missing from a run's
    state."""
    where = checkpoints.directory / str(step)
    try:
        saved = checkpoints.meta(step)
    except Exception as e:
        raise DamagedCheckpoint(where, failure_reason(e)) from None
    # Only the model must match (the task, optimizer and state may differ).
    current = {"model": meta.get("model", {}), "task": saved.get("task"),
               "state": saved.get("state")}
    if saved.get("imported"):
        return checkpoints.restore(step, _params_only(abstract_params), None, current,
                                   advice).params
    check_compatible(saved, current, where, resume=False, advice=advice)
    base = Base(**saved["base"]) if "base" in saved else None
    own = base.without_frozen(abstract_params) if base else abstract_params
    stored = stored_params(saved)  # (None: an older mtrain's, which stored them all)
    if stored is not None:  # (a model with adapters from one without: theirs are not)
        own = parameters.select(own, lambda path: path in stored)
    # (a part of the state: orbax's PyTree handler restores a subtree, the manager not)
    target = {"params": own}
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(where / "state", args=ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))
    except Exception as e:
        raise DamagedCheckpoint(where, failure_reason(e)) from None
    if "checksums" in saved and (bad := checksums.mismatches(saved["checksums"], restored)):
        raise DamagedCheckpoint(where, f"{array_name(bad[0])} does not match its checksum")
    params = restored["params"]
    if base is not None:
        params = parameters.merge(base_params(checkpoints, base, abstract_params, meta, where),
                                  params)
    return params


def base_params(checkpoints: Checkpoints, base: Base, abstract_params, meta: dict, where):
    """The frozen parameters of a checkpoint (`where`) whose `base` holds them."""
    directory = epath.Path(base.checkpoints) if base.checkpoints else checkpoints.directory
    named = f"step {base.step} of {directory}"
    try:
        reader = checkpoints if not base.checkpoints else Checkpoints(directory, read_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {where} keeps its frozen parameters in {named}, "
                              f"which cannot be opened: {failure_reason(e)}") from None
    try:
        if base.step not in reader.all_steps():
            raise CheckpointError(
                f"checkpoint {where} keeps its frozen parameters in {named}, which is "
                f"gone; put that checkpoint back, or pass --restart to train from step 0")
        if base_digest(reader.meta(base.step), base.frozen) != base.digest:
            raise IncompatibleRun(
                f"checkpoint {where} was trained on other frozen parameters than those of "
                f"{named} (another model is there now); put back the base it was trained "
                f"on, or pass --restart to train from step 0")
        params = restore_params(reader, base.step, abstract_params, meta)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"checkpoint {where} keeps its frozen parameters in {named}, "
                              f"which cannot be read: {e.reason}") from None
    finally:
        if reader is not checkpoints:
            reader.close()
    frozen = set(base.frozen)
    return parameters.select(params, lambda path: path in frozen)


def _params_only(abstract_params):
    """An abstract state of parameters alone, as `Checkpoints.restore` takes (an import)."""
    return _ParamsOnly(abstract_params)


@dataclasses.dataclass
class _ParamsOnly:
    params: Any

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _zeros(leaf: jax.ShapeDtypeStruct) -> jax.Array:
    return jax.jit(lambda: jax.numpy.zeros(leaf.shape, leaf.dtype),
                   out_shardings=leaf.sharding)()


_UNVERIFIED: set[str] = set()  # the directories whose checkpoints without checksums were reported


def array_name(path: str) -> str:
    """A train state's path as a name: ".params['layer_0']['mlp']['wi']" -> params.layer_0.mlp.wi."""
    return path.replace("']['", ".").replace("['", ".").replace("']", "").lstrip(".")
