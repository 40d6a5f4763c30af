"""``--mode=train``: the training loop of a run, and what keeps its model dir safe.

`train(exp)` trains the `Experiment` `exp` with `training.loop.train_loop` and the hooks of
`training.hooks`:

- **One run per model dir**: process 0 holds the model dir's lock for the whole run
  (`io.lock`), and the model dir and its checkpoints are written to once before the first
  step, so that a directory that cannot be written fails in seconds.
- **Resume**: from the newest checkpoint that can be read (the metrics of later steps, which
  the run takes again, are replaced: `io.metrics.MetricsWriter`); damaged ones are moved to
  ``<step>.damaged``; one of a run with other settings is an error (`io.checkpoints`). A
  model dir with checkpoints or damaged ones that cannot resume is never trained from
  scratch unless `restart` says so (then what it held is moved to ``before-restart-<n>/``).
  `run.init_from` is read first: a run that cannot start from it writes nothing.
- **Divergence**: ``run.max_nonfinite_steps`` skipped steps in a row stop the run with an
  error that names the checkpoint to resume from (one holding the very parameters they all
  ran from is moved to ``<step>.diverged``).
- **Signals**: on SIGTERM and Ctrl-C the run finishes its step, saves a checkpoint and
  stops (`training.stop_signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import jax
from etils import epath

from mtrain.errors import IncompatibleRun, TrainingDiverged
from mtrain.evaluation.heldout import evaluate
from mtrain.io.bases import Base, base_digest
from mtrain.io.checkpoints import CheckpointError, Checkpoints, restore_params
from mtrain.io.reading import read_params, restore_for_reading
from mtrain.io.lock import lock_model_dir
from mtrain.io.metrics import MetricsWriter
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import check_writable, write_atomically
from mtrain.modes.experiment import Experiment
from mtrain.parallel import targets
from mtrain.training import hooks
from mtrain.models import parameters
from mtrain.models.lora import is_adapter
from mtrain.training.loop import Diverged, FiniteGuard, train_loop

log = logging.getLogger("mtrain")


def train(exp: Experiment, restart: bool = False) -> dict:
    """Trains `exp`: logs, evaluates and checkpoints on schedule; returns the last
    evaluation's results."""
    model_dir = ModelDir(exp.model_dir)
    initial = _params_from(exp) if exp.config.init_from and (
        restart or not model_dir.has_checkpoints()) else None
    check_writable(exp.model_dir, "the model dir")
    lock = lock_model_dir(exp.model_dir)
    with _closing(lock.release):
        if restart:
            model_dir.move_aside_for_restart()
        check_writable(model_dir.checkpoints, "checkpoints to")
        checkpoints = Checkpoints(model_dir.checkpoints, exp.config.keep_checkpoints,
                                  exp.config.keep_checkpoint_every,
                                  cleanup_tmp=True)  # no other run writes here: we hold the lock
        # A run that stops on an error still completes the checkpoints it started.
        with _closing(checkpoints.close), _closing(checkpoints.wait):
            batches = exp.train_batches()
            with _closing(batches.close):  # the input pipeline's workers
                state, start, origin = _restore_or_init(exp, checkpoints, batches, initial)
                base = _base(exp, checkpoints, origin)
                if exp.trainer.dpo and exp.trainer.reference.needs_copy:  # DPO's frozen copy
                    exp.trainer.reference.set(state.params if start == 0 else
                                              _base_params(exp, checkpoints))
                if jax.process_index() == 0:
                    write_atomically(model_dir.config, exp.config_text)
                    _keep_chat_template(exp, model_dir)
                    if not epath.Path(model_dir.vocabulary).exists():
                        exp.vocab.save(model_dir.vocabulary)
                # (the records of steps after `start` are of steps taken again: replaced)
                writer = MetricsWriter(exp.model_dir, resumed_from=start)
                with _closing(writer.close):
                    results = _train(exp, state, start, batches, checkpoints, writer, base)
    log.info("metrics: %s  checkpoints: %s", writer.path, checkpoints.directory)
    return results


def _train(exp: Experiment, state, start: int, batches, checkpoints: Checkpoints,
           writer: MetricsWriter, base: Base | None = None) -> dict:
    config, stepper = exp.config, exp.stepper
    if stepper is not exp.trainer:
        log.info("%s", stepper.describe())
    peak, source = targets.device_peak_flops()
    log.info("model FLOPs per step %.3g; MFU against %.3g FLOP/s per device (%s)",
             exp.flops_per_step, peak, source)
    if start >= config.train_steps:
        log.info("the checkpoint of step %d is at or past run.train_steps=%d: nothing to "
                 "train, evaluating it", start, config.train_steps)
    guard = FiniteGuard(config.max_nonfinite_steps, last_checkpoint=start or None)
    fractions = getattr(batches, "mixture_fractions", dict)
    log_train = hooks.LogTrain(
        config.log_every, writer.write, stepper, guard, exp.schedule, exp.flops_per_step, peak,
        lambda: {f"train/mixture/{name}": f for name, f in fractions().items()})
    evaluation = hooks.Evaluate(config.eval_every,
                                lambda params, step: evaluate(exp, params, step, writer),
                                stepper, after_each=log_train.restart_clock)
    saving = hooks.SaveCheckpoints(
        config.checkpoint_every,
        lambda step, state: checkpoints.save(step, state, batches, exp.checkpoint_meta(), base),
        stepper, guard)
    schedule = [log_train, evaluation, saving]
    if config.profile_steps:
        schedule.insert(0, hooks.Profile(*config.profile_steps, ModelDir(exp.model_dir).profile))
    with _on_divergence(guard, checkpoints):
        train_loop(stepper, stepper.start(state), batches, start, config.train_steps,
                   schedule, guard)
    return evaluation.results


@contextlib.contextmanager
def _closing(close):
    """Calls `close()` when the block ends. If the block raised, a `close()` that fails too
    (a full disk fails both) is logged at debug level and the block's error is the one
    reported."""
    try:
        yield
    except BaseException:
        try:
            close()
        except Exception as e:
            log.debug("%s failed after an error: %s", getattr(close, "__qualname__", close), e)
        raise
    close()


def _restore_or_init(exp: Experiment, checkpoints: Checkpoints, iterator, initial=None):
    """(state, step, origin): resumed from the model dir's newest intact checkpoint, else
    started from `init_from`'s parameters (`initial`, if already read: `_params_from`),
    else freshly initialised. `origin`: the checkpoint (directory, step) the run started
    from ("": the model dir's own), or where it resumed; None: from nothing."""
    if checkpoints.all_steps():
        state, step = checkpoints.restore_intact(exp.trainer.sharded_abstract_state(),
                                                 iterator, exp.checkpoint_meta())
        if checkpoints.is_imported(step):  # a published model's parameters (--mode=import)
            log.info("starting from the imported parameters of step %d in %s (a fresh "
                     "optimizer state)", step, checkpoints.directory)
            return _from_import(exp, checkpoints, step, state.params), step, ("", step)
        log.info("resuming from the checkpoint of step %d in %s", step, checkpoints.directory)
        return state, step, ("", step)
    set_aside = checkpoints.set_aside()
    if set_aside:
        raise CheckpointError(
            f"{checkpoints.directory} holds only checkpoints that were set aside "
            f"({', '.join(set_aside)}); restore a good copy, or pass --restart to train from "
            f"step 0 (they are kept)")
    state = exp.trainer.init_state()
    if exp.config.init_from:
        params, step, where = initial or _params_from(exp)
        log.info("starting from the parameters of step %d of %s", step, where)
        # (adapters that run had not: fresh ones, B zero: its function)
        state = state.replace(params=parameters.merge(state.params, params))
        return state, 0, (os.path.abspath(where), step)
    return state, 0, None


def _base(exp: Experiment, checkpoints: Checkpoints, origin) -> Base | None:
    """Where this run's checkpoints keep their frozen parameters (`io.checkpoints.Base`):
    a resumed run's, where it has one; the checkpoint a frozen run started from; else
    None (they hold every parameter)."""
    if origin is None or not exp.trainer.frozen:
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
    frozen = sorted(p for p in parameters.paths(exp.trainer.abstract_state.params)
                    if not exp.trainer.trainable(p))
    digest = base_digest(meta, frozen)
    if digest != "incomplete":
        return Base(directory, step, frozen, digest)
    if "base" in meta and sorted(meta["base"]["frozen"]) == frozen:  # (a run stored once:
        theirs = Base(**meta["base"])  # the same frozen parameters lie in its base)
        return dataclasses.replace(theirs, checkpoints=theirs.checkpoints or directory)
    return None


def _keep_chat_template(exp: Experiment, model_dir: ModelDir) -> None:
    """A run started from another's parameters (`init_from`) keeps its chat template, as
    an import keeps its folder's: the model's conversations are rendered by it."""
    theirs = exp.config.init_from and epath.Path(ModelDir(exp.config.init_from).chat_template)
    if theirs and theirs.exists() and not epath.Path(model_dir.chat_template).exists():
        write_atomically(model_dir.chat_template, theirs.read_text())


def _from_import(exp: Experiment, checkpoints: Checkpoints, step: int, params):
    """A fresh state at the `params` of the imported checkpoint `step` (with fresh
    adapters where it has none)."""
    fresh = exp.trainer.init_state()
    if not checkpoints.has_adapters(step):  # a base alone: fresh adapters on it
        params = parameters.merge(params, parameters.select(fresh.params, is_adapter))
    return fresh.replace(params=params)


def _base_params(exp: Experiment, checkpoints: Checkpoints):
    """The parameters a resumed run started from (DPO's reference): the model dir's import,
    else `init_from`'s, else the initialisation of its seed."""
    fresh = exp.trainer.init_state().params
    if 0 in checkpoints.all_steps() and checkpoints.is_imported(0):
        return parameters.merge(fresh, restore_params(
            checkpoints, 0, exp.trainer.sharded_abstract_state().params, exp.checkpoint_meta()))
    if exp.config.init_from:
        return parameters.merge(fresh, _params_from(exp)[0])
    return fresh


def _params_from(exp: Experiment):
    """The parameters of checkpoint `init_step` (default: the latest) of run `init_from`."""
    where = exp.config.init_from
    if epath.Path(ModelDir(where).checkpoints).is_dir():
        where = ModelDir(where).checkpoints
    kwargs = dict(missing="run.init_from must name the model dir of a run",
                  advice="run.init_from starts from a run of the same model: give this run "
                         "that run's model settings (its config.gin)")
    try:  # (the whole state read and verified, as a reader does)
        state, step = restore_for_reading(where, exp.trainer.sharded_abstract_state(),
                                          exp.checkpoint_meta(), exp.config.init_step, **kwargs)
        return state.params, step, where
    except IncompatibleRun:  # another task, optimizer or adapters: its parameters alone
        params, step = read_params(where, exp.trainer.sharded_abstract_state().params,
                                   exp.checkpoint_meta(), exp.config.init_step, **kwargs)
        return params, step, where


@contextlib.contextmanager
def _on_divergence(guard: FiniteGuard, checkpoints: Checkpoints):
    """Turns `Diverged` into a `TrainingDiverged` that says where to resume from.

    Every skipped step left the state as it was, so all of them ran from the parameters of
    the step before the first: if a checkpoint holds exactly those (it was written at that
    step), they made `limit` different batches non-finite, and resuming from it would
    diverge again. That checkpoint is moved to ``<step>.diverged`` (kept), so that the
    newest one is the one to resume from.
    """
    try:
        yield
    except Diverged as e:
        message = (f"training diverged: steps {e.first}-{e.last} had a non-finite loss or "
                   f"gradient (run.max_nonfinite_steps={guard.limit} in a row), and no "
                   f"checkpoint was written while they were skipped")
        checkpoints.wait()
        if guard.last_checkpoint == e.first - 1 and guard.last_checkpoint in checkpoints.all_steps():
            moved = checkpoints.move_aside(guard.last_checkpoint, "diverged")
            message += (f"; the checkpoint of step {guard.last_checkpoint} holds the parameters "
                        f"they all ran from, and was moved to {moved.name}")
        steps = checkpoints.all_steps()
        if steps:
            message += (f"; lower the learning rate (learning_rate_schedule.constant) and run "
                        f"the same command to resume from the checkpoint of step {steps[-1]}")
        else:
            message += ("; no checkpoint is left to resume from: lower the learning rate and "
                        "run the same command" + (" with --restart" if checkpoints.set_aside()
                                                  else "") + " to train from step 0")
        raise TrainingDiverged(message) from None
