"""Where a run starts: what it takes from a checkpoint, what from a base, what starts fresh.

Checkpoints are read one way (`io.checkpoints.Checkpoints.read`), which returns what a
checkpoint holds of the tree it is asked for. What the rest is, this module decides:

- a run's checkpoint that stores its frozen parameters once (`io.bases.Base`): those come
  from its base, read the same way (`_with_base`);
- an import (the parameters of a published model alone): a fresh optimizer state, and
  fresh adapters where it has none (its model's function: B is zero). A reader (eval,
  score, infer, export) takes zero adapters, the same function;
- ``run.init_from``'s parameters: those the run has in common with the checkpoint's; its
  adapters, if it has others, fresh (`params_of`).

`resume` is where a training run starts, `restore_for_reading` a reader's restore,
`base_for` where a frozen run's checkpoints will keep their frozen parameters.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from etils import epath

from mtrain.errors import IncompatibleRun, failure_reason
from mtrain.io.bases import Base, base_digest
from mtrain.io.checkpoints import CheckpointError, Checkpoints, DamagedCheckpoint, Read
from mtrain.io.model_dir import ModelDir
from mtrain.io.reading import require_checkpoints
from mtrain.models import parameters
from mtrain.models.lora import is_adapter
from mtrain.models.quantization import is_meta, with_fresh_meta

log = logging.getLogger("mtrain")


def resume(checkpoints: Checkpoints, trainer, meta: dict, iterator):
    """(state, read) of the newest intact checkpoint of a training run's own model dir
    (damaged ones moved aside), `iterator` moved to its input position; an import's
    parameters with a fresh optimizer state. Data that changed since the checkpoint (a
    file's contents edited) is no error: the run continues on it from its start, with its
    parameters and optimizer state, and says so in one line."""
    abstract = trainer.sharded_abstract_state()
    got = checkpoints.read(None, abstract, meta, iterator=iterator, set_aside=True,
                           data_may_change=True)
    where = checkpoints.directory
    if got.imported:  # a published model's parameters (--mode=import)
        log.info("starting from the imported parameters of step %d in %s (a fresh "
                 "optimizer state)", got.step, where)
        fresh = trainer.init_state()
        params = _complete(got, where, got.params, fresh.params, lambda part: parameters.select(
            fresh.params, set(parameters.paths(part)).__contains__))
        return fresh.replace(params=params), got
    log.info("resuming from the checkpoint of step %d in %s", got.step, where)
    if got.data_restarted:
        log.warning("the data differs from the data the checkpoint of step %d was trained "
                    "on (its files, or how they are prepared): continuing on the new data "
                    "from its beginning, with the parameters and optimizer state of step %d",
                    got.step, got.step)
    params = _with_base(checkpoints, got, abstract.params, meta)
    return got.state.replace(params=params), got


def restore_for_reading(directory: str, abstract_state, meta: dict, step: int | None = None,
                        missing: str = "train first (--mode=train)",
                        advice: str = "use the settings of the run that trained it (its "
                                      "config.gin)", zero_adapters: bool = True):
    """(state, step) of checkpoint `step` (default: the newest that can be read) in
    `directory`, into the shardings of `abstract_state`, without the input position: for
    eval, score, infer, export and init_from. Reads only (a damaged checkpoint is skipped,
    not moved aside); `missing` says what to do when `directory` holds no checkpoint,
    `advice` what to do about one of another model. An import's adapters, where it has
    none, are zeros (the base's function), or left out (not `zero_adapters`: the caller's
    fresh ones take their place); its optimizer state stays abstract."""
    require_checkpoints(directory, missing)
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        got = checkpoints.read(step, abstract_state, meta, advice=advice)
        params = _with_base(checkpoints, got, abstract_state.params, meta)
        params = _complete(got, checkpoints.directory, params, abstract_state.params,
                           _zeros if zero_adapters else None)
        return got.state.replace(params=params), got.step
    finally:
        checkpoints.close()


def params_of(directory: str, abstract_params, meta: dict, step: int | None = None,
              missing: str = "", advice: str | None = None):
    """(parameters, step) of checkpoint `step` (default: the newest that can be read) in
    `directory`, whatever it holds (an import, a run's state, its frozen parameters in a
    base), laid out as `abstract_params`: ``run.init_from``'s read and DPO's reference. Only
    the model must match; adapters the checkpoint lacks are missing (the caller's fresh
    ones take their place)."""
    require_checkpoints(directory, missing)
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        return params_in(checkpoints, step, abstract_params, meta, advice)
    finally:
        checkpoints.close()


def params_in(checkpoints: Checkpoints, step: int | None, abstract_params, meta: dict,
              advice: str | None = None):
    """`params_of` of checkpoints already open."""
    got = checkpoints.read(step, abstract_params, meta, part="params", advice=advice)
    params = _with_base(checkpoints, got, abstract_params, meta)
    return _complete(got, checkpoints.directory, params, abstract_params), got.step


def init_from(directory: str, abstract_state, meta: dict, step: int | None = None):
    """(parameters, step, where) of ``run.init_from``'s checkpoint `step` of run
    `directory` (a model dir, or its checkpoints)."""
    where = directory
    if epath.Path(ModelDir(where).checkpoints).is_dir():
        where = ModelDir(where).checkpoints
    kwargs = dict(missing="run.init_from must name the model dir of a run",
                  advice="run.init_from starts from a run of the same model: give this run "
                         "that run's model settings (its config.gin)")
    try:  # (the whole state read and verified, as a reader does; adapters it has not are
        # left to the run's fresh ones: zero A and B would never train)
        state, step = restore_for_reading(where, abstract_state, meta, step,
                                          zero_adapters=False, **kwargs)
        return state.params, step, where
    except IncompatibleRun:  # another task, optimizer or adapters: its parameters alone
        params, step = params_of(where, abstract_state.params, meta, step, **kwargs)
        return params, step, where


def base_for(trainer, checkpoints: Checkpoints, origin) -> Base | None:
    """Where a run's checkpoints keep their frozen parameters (`io.bases.Base`): a resumed
    run's, where it has one; the checkpoint (`origin`: directory, "" for the model dir's
    own, and step) a frozen run started from; else None (they hold every parameter)."""
    if origin is None or not trainer.frozen:
        return None
    directory, step = origin
    reader = checkpoints if not directory else Checkpoints(directory, read_only=True)
    try:
        meta = reader.meta(step)
    finally:
        if reader is not checkpoints:
            reader.close()
    if not meta.get("imported") and not directory:  # resumed: as its checkpoint says
        return Base(**meta["base"]) if "base" in meta else None
    frozen = sorted(p for p in parameters.paths(trainer.abstract_state.params)
                    if not trainer.trainable(p))
    digest = base_digest(meta, frozen)
    if digest != "incomplete":
        return Base(directory, step, frozen, digest)
    if "base" in meta and sorted(meta["base"]["frozen"]) == frozen:  # (a run stored once:
        theirs = Base(**meta["base"])  # the same frozen parameters lie in its base)
        return dataclasses.replace(theirs, checkpoints=theirs.checkpoints or directory)
    return None


def _with_base(checkpoints: Checkpoints, got: Read, abstract_params, meta: dict):
    """The parameters `got` holds, with those its base holds for it (if it has one)."""
    base = got.base
    if base is None:
        return got.params
    where = checkpoints.directory / str(got.step)
    directory = epath.Path(base.checkpoints) if base.checkpoints else checkpoints.directory
    named = f"step {base.step} of {directory}"
    try:
        reader = checkpoints if not base.checkpoints else Checkpoints(directory, read_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {where} keeps its frozen parameters in {named}, "
                              f"which cannot be opened: {failure_reason(e)}") from None

    def expect(theirs: dict) -> None:
        if base_digest(theirs, base.frozen) != base.digest:
            raise IncompatibleRun(
                f"checkpoint {where} was trained on other frozen parameters than those of "
                f"{named} (another model is there now); put back the base it was trained "
                f"on, or pass --restart to train from step 0")

    frozen = set(base.frozen)
    wanted = parameters.select(abstract_params, lambda path: path in frozen)
    try:
        if base.step not in reader.all_steps():
            raise CheckpointError(
                f"checkpoint {where} keeps its frozen parameters in {named}, which is "
                f"gone; put that checkpoint back, or pass --restart to train from step 0")
        theirs = reader.read(base.step, wanted, meta, part="params", expect=expect)
        held = _with_base(reader, theirs, wanted, meta)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"checkpoint {where} keeps its frozen parameters in {named}, "
                              f"which cannot be read: {e.reason}") from None
    finally:
        if reader is not checkpoints:
            reader.close()
    return parameters.merge(held, got.params)


def _complete(got: Read, directory, params, abstract_params, fresh=None):
    """`params` with the adapters it lacks made by `fresh` (from their abstract tree; None:
    left missing) and the delayed fp8 scaling state it lacks fresh (an import's, or
    `run.init_from` another scaling's run: scale 1, an empty history); any other parameter
    it lacks is an IncompatibleRun (another model's)."""
    have = parameters.paths(params)
    lacking = {path for path in parameters.paths(abstract_params) if path not in have}
    if other := sorted(path for path in lacking if not is_adapter(path) and not is_meta(path)):
        raise IncompatibleRun(f"checkpoint {directory / str(got.step)} holds no parameter "
                              f"{other[0]}" + (f" (nor {len(other) - 1} others)" if other[1:]
                                               else "") + " of this model")
    params = with_fresh_meta(params, abstract_params)
    adapters = {path for path in lacking if not is_meta(path)}
    if fresh is None or not adapters:
        return params
    return parameters.merge(params, fresh(parameters.select(abstract_params,
                                                            adapters.__contains__)))


def _zeros(abstract):
    """Zeros laid out as the abstract tree `abstract` (adapters with the base's function)."""
    return jax.tree.map(lambda leaf: jax.jit(lambda: jax.numpy.zeros(leaf.shape, leaf.dtype),
                                             out_shardings=leaf.sharding)(), abstract)
