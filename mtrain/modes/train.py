"""The training loop of a run, and what keeps its model dir safe.

`train(exp)` trains the `run.Experiment` `exp`:

- **One run per model dir**: process 0 holds `<model_dir>/mtrain.lock` for the whole run
  (`mtrain.lock`), and the model dir and its checkpoints are written to once before the
  first step, so that a directory that cannot be written fails in seconds.
- **Resume**: from the newest checkpoint that can be read; damaged ones are moved to
  ``<step>.damaged``; one of a run with other settings is an error (`checkpoints`). A model
  dir with checkpoints or damaged ones that cannot resume is never trained from scratch
  unless `restart` says so (then what it held is moved to ``before-restart-<n>/``).
- **Divergence**: a step with a non-finite loss or gradient is skipped (optax's
  apply_if_finite), no checkpoint is written while such steps are being skipped, and
  ``run.max_nonfinite_steps`` of them in a row stop the run with an error that names the
  checkpoint to resume from (one holding the very parameters they all ran from is moved to
  ``<step>.diverged``).
- **Signals**: on SIGTERM (preemption) and on Ctrl-C the run finishes its step, saves a
  checkpoint and stops (SIGTERM: exit 0; Ctrl-C: `Interrupted`, exit 130); a second Ctrl-C
  aborts at once.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time

import jax
import numpy as np
from etils import epath

from mtrain.parallel import distributed, targets
from mtrain.io.checkpoints import CheckpointError, Checkpoints, require_checkpoints
from mtrain.errors import Interrupted, TrainingDiverged, UserError
from mtrain.evaluation.heldout import evaluate
from mtrain.io.lock import ModelDirInUse, ModelDirLock, check_writable
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import RUN_FILES, ModelDir
from mtrain.training.stop_signals import StopSignals
from mtrain.io.textfiles import write_atomically


def train(exp, restart: bool = False) -> dict:
    """The training loop: log, evaluate and checkpoint on schedule; returns the last eval."""
    model_dir = ModelDir(exp.model_dir)
    # A new run's starting point first, reading only: one that cannot start from it (another
    # model's) leaves nothing behind.
    initial = _params_from(exp) if exp.init_from and (
        restart or not model_dir.has_checkpoints()) else None
    check_writable(exp.model_dir, "the model dir")
    lock = _lock(exp.model_dir)
    with _closing(lock.release):
        if restart:
            _move_aside_for_restart(exp.model_dir)
        check_writable(model_dir.checkpoints, "checkpoints to")
        checkpoints = Checkpoints(model_dir.checkpoints, exp.keep_checkpoints,
                                  exp.keep_checkpoint_every,
                                  cleanup_tmp=True)  # no other run writes here: we hold the lock
        # A run that stops on an error still completes the checkpoints it started.
        with _closing(checkpoints.close), _closing(checkpoints.wait):
            batches = exp.train_batches()
            state, start = _restore_or_init(exp, checkpoints, batches, initial)
            if jax.process_index() == 0:
                write_atomically(model_dir.config, exp.config_text)
                if not epath.Path(model_dir.vocabulary).exists():
                    exp.vocab.save(model_dir.vocabulary)
            writer = MetricsWriter(exp.model_dir)
            with _closing(writer.close):
                results = _train_loop(exp, state, start, batches, checkpoints, writer)
    log.info("metrics: %s  checkpoints: %s", writer.path, checkpoints.directory)
    return results


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


def check_model_dir_free(model_dir: str) -> None:
    """Fails at once (writing nothing) if another live run trains into `model_dir`."""
    _on_process_0(ModelDirLock(model_dir).check_free, model_dir)


def _lock(model_dir: str) -> ModelDirLock:
    """The model dir's lock, taken by process 0; every process fails if it could not."""
    lock = ModelDirLock(model_dir)
    _on_process_0(lock.acquire, model_dir)
    return lock


def _on_process_0(action, model_dir: str) -> None:
    """Runs `action` on process 0 only; if it raises a UserError, every process raises one
    (process 0 its own), so that none is left waiting for the others."""
    error = None
    if jax.process_index() == 0:
        try:
            action()
        except UserError as e:
            error = e
    if not distributed.process_0_says(error is None):
        if error is not None:
            raise error
        raise ModelDirInUse(f"process 0 cannot use the model dir {model_dir} (its error says why)")


def _move_aside_for_restart(model_dir: str) -> None:
    """--restart: moves the checkpoints, metrics, config and TensorBoard events of the model
    dir into a new ``before-restart-<n>/`` inside it (nothing is deleted)."""
    model_dir = epath.Path(model_dir)
    names = sorted(p.name for p in model_dir.iterdir()
                   if p.name in RUN_FILES or p.name.startswith("events.out.tfevents"))
    if not names:
        return
    n = next(n for n in itertools.count(1) if not (model_dir / f"before-restart-{n}").exists())
    target = model_dir / f"before-restart-{n}"
    if jax.process_index() == 0:
        target.mkdir()  # and a file in it: in a bucket a directory is the prefix of an object
        (target / "RESTARTED").write_text(f"moved here by --restart: {', '.join(names)}\n")
        for name in names:
            (model_dir / name).rename(target / name)
    distributed.sync("mtrain_restart")
    log.warning("--restart: moved %s to %s; training from step 0", ", ".join(names), target)


def _restore_or_init(exp, checkpoints: Checkpoints, iterator, initial=None):
    """(state, step): resumed from the model dir's newest intact checkpoint, else started
    from `init_from`'s parameters (`initial`, if already read: `_params_from`), else
    freshly initialised."""
    if checkpoints.all_steps():
        state, step = checkpoints.restore_intact(exp.trainer.sharded_abstract_state(),
                                                 iterator, exp.checkpoint_meta())
        log.info("resuming from the checkpoint of step %d in %s", step, checkpoints.directory)
        return state, step
    set_aside = checkpoints.set_aside()
    if set_aside:
        raise CheckpointError(
            f"{checkpoints.directory} holds only checkpoints that were set aside "
            f"({', '.join(set_aside)}); restore a good copy, or pass --restart to train from "
            f"step 0 (they are kept)")
    state = exp.trainer.init_state()
    if exp.init_from:
        params, step, where = initial or _params_from(exp)
        log.info("starting from the parameters of step %d of %s", step, where)
        state = state.replace(params=params)
    return state, 0


def _params_from(exp):
    """The parameters of checkpoint `init_step` (default: the latest) of run `init_from`."""
    where = exp.init_from
    if epath.Path(ModelDir(where).checkpoints).is_dir():
        where = ModelDir(where).checkpoints
    state, step = restore_for_reading(
        exp, where, exp.init_step, missing="run.init_from must name the model dir of a run",
        advice="run.init_from starts from a run of the same model: give this run that run's "
               "model settings (its config.gin)")
    return state.params, step, where


def restore_for_reading(exp, directory: str, step: int | None = None,
                        missing: str = "train first (--mode=train)",
                        advice: str = "use the settings of the run that trained it (its "
                                      "config.gin)"):
    """(state, step) of checkpoint `step` (default: the latest) in `directory`, into this
    run's shardings, without the input position: for eval, infer and init_from. Reads only;
    `missing` says what to do when `directory` holds no checkpoint."""
    require_checkpoints(directory, missing)
    checkpoints = Checkpoints(directory, read_only=True)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {directory}; {missing}")
        abstract, meta = exp.trainer.sharded_abstract_state(), exp.checkpoint_meta()
        if step is None:  # the newest one that can be read, changing nothing
            return checkpoints.restore_intact(abstract, None, meta, set_aside=False,
                                              advice=advice)
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {directory} (it has {steps})")
        return checkpoints.restore(step, abstract, None, meta, advice), step
    finally:
        checkpoints.close()


def evaluate_checkpoint(exp, output_dir: str | None = None) -> dict:
    """``--mode=eval``: evaluates the latest checkpoint in the model dir; the metrics (and
    decodes) go to `output_dir`, else to the model dir if it can be written."""
    model_dir = ModelDir(exp.model_dir)
    state, step = restore_for_reading(exp, model_dir.checkpoints)
    log.info("evaluating the checkpoint of step %d", step)
    writer = MetricsWriter(model_dir.outputs(output_dir, "the metrics, events and decodes "
                                             "of this evaluation are"))
    results = evaluate(exp, state.params, step, writer)
    writer.close()
    return results


def _train_loop(exp, state, start: int, batches, checkpoints: Checkpoints,
                writer: MetricsWriter) -> dict:
    trainer, pending, results = exp.trainer, [], {}
    # With SGP the loop steps replicas of the state; evaluation and checkpoints get their
    # average, a Trainer state.
    stepper, as_trainer_state = exp.trainer, lambda state: state  # noqa: E731
    if exp.sgp:
        stepper, as_trainer_state = exp.sgp, exp.sgp.train_state
        state = exp.sgp.init_state(state)
        log.info("SGP over %d replicas (overlap %d, exact average every %s steps): each sends "
                 "%.3g MB per step", exp.sgp.num_replicas, exp.sgp.overlap,
                 exp.sgp.average_every or "no", exp.sgp.bytes_sent_per_step() / 1e6)
    peak, source = targets.device_peak_flops()
    log.info("model FLOPs per step %.3g; MFU against %.3g FLOP/s per device (%s)",
             exp.flops_per_step, peak, source)
    if start >= exp.train_steps:
        log.info("the checkpoint of step %d is at or past run.train_steps=%d: nothing to "
                 "train, evaluating it", start, exp.train_steps)
    guard = _FiniteGuard(exp.max_nonfinite_steps, last_checkpoint=start or None)
    tick = time.time()
    with StopSignals() as signals, _on_divergence(guard, checkpoints):
        for step in range(start + 1, exp.train_steps + 1):
            if exp.profile_steps and step == exp.profile_steps[0]:
                jax.profiler.start_trace(ModelDir(exp.model_dir).profile)
            state, metrics = stepper.train_step(state, trainer.place_batch(next(batches)))
            if exp.profile_steps and step == exp.profile_steps[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                log.info("profile of steps %d-%d: %s", *exp.profile_steps,
                         ModelDir(exp.model_dir).profile)
            guard.add(step, metrics["finite"])
            # At most two steps in flight: this one is queued behind the previous one, which
            # we wait for here. More buys nothing (the devices are busy either way) and, with
            # simulated CPU devices, a deep queue of multi-device programs can deadlock
            # XLA's collectives.
            guard.check(until=step - 1)
            pending.append(metrics)
            if step % exp.log_every == 0 or step == exp.train_steps:
                _log_train(exp, step, jax.device_get(pending), time.time() - tick, guard, writer,
                           peak, state)
                pending, tick = [], time.time()
            if exp.eval_every and step % exp.eval_every == 0 and step != exp.train_steps:
                results = evaluate(exp, _params(exp, state), step, writer)
                tick = time.time()
            stop = signals.reached(step)
            if step % exp.checkpoint_every == 0 or step == exp.train_steps or stop:
                guard.check(until=step)
                if guard.in_a_row:  # the state may be the one that made them non-finite
                    log.warning("step %d: no checkpoint while non-finite steps are being "
                                "skipped (the newest is of step %s)", step, guard.last_checkpoint)
                else:
                    checkpoints.save(step, as_trainer_state(state), batches, exp.checkpoint_meta())
                    guard.last_checkpoint = step
            if stop:
                saved = ("saved its checkpoint" if guard.last_checkpoint == step else
                         f"the newest checkpoint is of step {guard.last_checkpoint}")
                if stop == "SIGTERM":
                    log.warning("SIGTERM: stopped after step %d and %s; run the same command "
                                "to resume", step, saved)
                    return results
                raise Interrupted(f"interrupted (Ctrl-C) after step {step}, and {saved}; run "
                                  f"the same command to resume")
    results = evaluate(exp, _params(exp, state), max(start, exp.train_steps), writer)
    return results


def _params(exp, state):
    """The parameters to evaluate: with SGP the replicas' average."""
    return exp.sgp.average(state) if exp.sgp else state.params


def _log_train(exp, step: int, fetched: list[dict], elapsed: float, guard: "_FiniteGuard",
               writer: MetricsWriter, peak_flops: float = 0.0, state=None) -> None:
    """One record of training metrics, averaged over the steps since the last one (the
    skipped, non-finite ones left out), with the model FLOP/s each device achieved and its
    MFU against `peak_flops`; with SGP, also how far the replicas of `state` are from
    consensus and what each sends per step."""
    finite = [m for m in fetched if m["finite"]] or [{k: np.nan for k in fetched[0]}]
    flops = exp.flops_per_step * len(fetched) / max(elapsed, 1e-9) / jax.device_count()
    writer.write(step, {
        "train/loss": np.mean([m["loss"] for m in finite]),
        "train/cross_entropy": np.mean([m["cross_entropy"] for m in finite]),
        "train/grad_norm": np.mean([m["grad_norm"] for m in finite]),
        # The schedule counts updates from 0: step s was produced by update s - 1.
        "train/learning_rate": float(exp.schedule(step - 1)),
        "train/tokens_per_second": sum(float(m["num_tokens"]) for m in fetched) / max(elapsed, 1e-9),
        "train/skipped_steps": guard.skipped,
        "train/model_flops_per_second_per_device": flops,
        "train/mfu": flops / peak_flops if peak_flops else np.nan,
        **(_sgp_metrics(exp.sgp, state) if exp.sgp else {}),
    })


def _sgp_metrics(sgp, state) -> dict:
    distance = jax.device_get(sgp.consensus_distance(state))
    return {"train/consensus_distance_max": float(distance["max"]),
            "train/consensus_distance_mean": float(distance["mean"]),
            "train/bytes_sent_per_replica_per_step": sgp.bytes_sent_per_step()}


class _FiniteGuard:
    """Counts the steps whose loss or gradient was not finite (optax.apply_if_finite skipped
    their updates), and raises `Diverged` after `limit` of them in a row. The loop keeps
    `last_checkpoint` (the step of the newest checkpoint written) up to date."""

    def __init__(self, limit: int, last_checkpoint: int | None = None):
        self.limit, self.in_a_row, self.skipped = limit, 0, 0
        self.last_checkpoint = last_checkpoint
        self._unchecked: collections.deque = collections.deque()

    def add(self, step: int, finite: jax.Array) -> None:
        self._unchecked.append((step, finite))

    def check(self, until: int) -> None:
        """Waits for the steps up to `until` and counts them."""
        while self._unchecked and self._unchecked[0][0] <= until:
            step, finite = self._unchecked.popleft()
            if float(finite):
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            self.skipped += 1
            log.warning("step %d: non-finite loss or gradient; its update was skipped (%d in "
                        "a row)", step, self.in_a_row)
            if self.in_a_row >= self.limit:
                raise _Diverged(step - self.in_a_row + 1, step)


class _Diverged(Exception):
    def __init__(self, first: int, last: int):
        super().__init__(first, last)
        self.first, self.last = first, last


@contextlib.contextmanager
def _on_divergence(guard: _FiniteGuard, checkpoints: Checkpoints):
    """Turns `_Diverged` into a `TrainingDiverged` that says where to resume from.

    Every skipped step left the state as it was, so all of them ran from the parameters of
    the step before the first: if a checkpoint holds exactly those (it was written at that
    step), they made `limit` different batches non-finite, and resuming from it would
    diverge again. That checkpoint is moved to ``<step>.diverged`` (kept), so that the
    newest one is the one to resume from.
    """
    try:
        yield
    except _Diverged as e:
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
