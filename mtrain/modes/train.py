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
import logging
import os

import jax
from etils import epath

from mtrain.errors import TrainingDiverged
from mtrain.evaluation.heldout import evaluate
from mtrain.io.bases import Base
from mtrain.io.checkpoints import CheckpointError, Checkpoints
from mtrain.io.lock import lock_model_dir
from mtrain.io.metrics import MetricsWriter
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import check_writable, write_atomically
from mtrain.modes.experiment import Experiment
from mtrain.modes.lm_eval import Tasks, during_training
from mtrain.parallel import targets
from mtrain.training import hooks
from mtrain.models import parameters
from mtrain.training import start as starting
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
                if exp.trainer.objective.needs_start:  # (DPO's frozen reference)
                    exp.trainer.objective.set_start(state.params if start == 0 else
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
    evaluates = exp.evaluates and config.eval_every >= 0
    if start >= config.train_steps:
        log.info("the checkpoint of step %d is at or past run.train_steps=%d: nothing to "
                 "train%s", start, config.train_steps, ", evaluating it" if evaluates else "")
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
    schedule = [log_train, evaluation, saving] if evaluates else [log_train, saving]
    if config.lm_eval_tasks:  # downstream tasks, on the parameters as they train
        downstream = during_training(exp, Tasks.of_run(config), writer.write)
        schedule.insert(-1, hooks.Evaluate(config.lm_eval_every, downstream, stepper,
                                           after_each=log_train.restart_clock))
    if not exp.evaluates:  # (run.eval_every=-1: the user's own setting, not said again)
        log.info("files.validation=0: no held-out data, this run evaluates nothing")
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
        state, read = starting.resume(checkpoints, exp.trainer, exp.checkpoint_meta(),
                                      iterator)
        return state, read.step, ("", read.step)
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
    """Where this run's checkpoints keep their frozen parameters (`training.start.base_for`)."""
    return starting.base_for(exp.trainer, checkpoints, origin)


def _keep_chat_template(exp: Experiment, model_dir: ModelDir) -> None:
    """A run started from another's parameters (`init_from`) keeps its chat template, as
    an import keeps its folder's: the model's conversations are rendered by it."""
    theirs = exp.config.init_from and epath.Path(ModelDir(exp.config.init_from).chat_template)
    if theirs and theirs.exists() and not epath.Path(model_dir.chat_template).exists():
        write_atomically(model_dir.chat_template, theirs.read_text())


def _base_params(exp: Experiment, checkpoints: Checkpoints):
    """The parameters a resumed run started from (DPO's reference): the model dir's import,
    else `init_from`'s, else the initialisation of its seed."""
    fresh = exp.trainer.init_state().params
    if 0 in checkpoints.all_steps() and checkpoints.meta(0).get("imported"):
        return parameters.merge(fresh, starting.params_in(
            checkpoints, 0, exp.trainer.sharded_abstract_state().params,
            exp.checkpoint_meta())[0])
    if exp.config.init_from:
        return parameters.merge(fresh, _params_from(exp)[0])
    return fresh


def _params_from(exp: Experiment):
    """The parameters of checkpoint `init_step` (default: the latest) of run `init_from`."""
    return starting.init_from(exp.config.init_from, exp.trainer.sharded_abstract_state(),
                              exp.checkpoint_meta(), exp.config.init_step)


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
