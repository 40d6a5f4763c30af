"""What a training run does on a schedule, as hooks of the loop (`training.loop`).

- `LogTrain`: every ``run.log_every`` steps and at the last, one record of the training
  metrics averaged over the steps since the last one (the skipped, non-finite ones left out),
  with the model FLOP/s per device and the MFU.
- `Evaluate`: every ``run.eval_every`` steps (0: none) and at the end, the run's evaluation
  (``run.eval_every=-1``: not in the schedule).
- `SaveCheckpoints`: every ``run.checkpoint_every`` steps, at the last step and when a stop
  signal ends the run; none while non-finite steps are being skipped (the state may be the
  one that made them so).
- `Profile`: a jax.profiler trace of ``run.profile_steps``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from mtrain.training.loop import FiniteGuard, Hook, Step, Stepper

log = logging.getLogger("mtrain")


_STEP_METRICS = ("loss", "cross_entropy", "grad_norm", "num_tokens", "finite")


class LogTrain(Hook):
    """`write(step, record)` every `every` steps and at the last one. `flops_per_step`: the
    model's FLOPs of one step; `peak_flops`: one device's peak, for the MFU (0: none);
    `schedule`: the learning rate of an update; `data_metrics`: the input pipeline's (a
    mixture's realised proportions)."""

    def __init__(self, every: int, write: Callable[[int, dict], None], stepper: Stepper,
                 guard: FiniteGuard, schedule, flops_per_step: float, peak_flops: float,
                 data_metrics: Callable[[], dict] = dict):
        self.every, self.write, self.stepper, self.guard = every, write, stepper, guard
        self.data_metrics = data_metrics
        self.schedule, self.flops_per_step, self.peak_flops = schedule, flops_per_step, peak_flops
        self.pending: list[dict] = []
        self.tick = time.time()

    def after(self, step: Step) -> None:
        self.pending.append(step.metrics)
        if step.number % self.every and not step.last:
            return
        fetched, elapsed = jax.device_get(self.pending), max(time.time() - self.tick, 1e-9)
        finite = [m for m in fetched if m["finite"]] or [{k: np.nan for k in fetched[0]}]
        flops = self.flops_per_step * len(fetched) / elapsed / jax.device_count()
        self.write(step.number, {
            "train/loss": np.mean([m["loss"] for m in finite]),
            "train/cross_entropy": np.mean([m["cross_entropy"] for m in finite]),
            "train/grad_norm": np.mean([m["grad_norm"] for m in finite]),
            # The schedule counts updates from 0: step s was produced by update s - 1.
            "train/learning_rate": float(self.schedule(step.number - 1)),
            "train/tokens_per_second": sum(float(m["num_tokens"]) for m in fetched) / elapsed,
            "train/skipped_steps": self.guard.skipped,
            "train/model_flops_per_second_per_device": flops,
            "train/mfu": flops / self.peak_flops if self.peak_flops else np.nan,
            # the model's own (a mixture of experts' losses and load: `moe.summary`)
            **{f"train/{k}": np.mean([m[k] for m in finite]) for k in finite[0]
               if k not in _STEP_METRICS},
            **self.stepper.log_metrics(step.state),
            **self.data_metrics(),
        })
        self.pending, self.tick = [], time.time()

    def restart_clock(self) -> None:
        """Leaves out of the next record's time what another hook spent (an evaluation)."""
        self.tick = time.time()


class Evaluate(Hook):
    """`evaluate(params, step) -> results` every `every` steps (0: none) but the last, and
    at the end; `results` is the newest. `after_each` runs after each evaluation."""

    def __init__(self, every: int, evaluate: Callable[[object, int], dict], stepper: Stepper,
                 after_each: Callable[[], None] = lambda: None):
        self.every, self.evaluate, self.stepper, self.after_each = (every, evaluate, stepper,
                                                                    after_each)
        self.results: dict = {}

    def after(self, step: Step) -> None:
        if self.every and step.number % self.every == 0 and not step.last:
            self.results = self.evaluate(self.stepper.eval_params(step.state), step.number)
            self.after_each()

    def end(self, state, number: int) -> None:
        self.results = self.evaluate(self.stepper.eval_params(state), number)


class SaveCheckpoints(Hook):
    """`save(step, train_state)` every `every` steps, at the last step and at a stop."""

    def __init__(self, every: int, save: Callable[[int, object], None], stepper: Stepper,
                 guard: FiniteGuard):
        self.every, self.save, self.stepper, self.guard = every, save, stepper, guard

    def after(self, step: Step) -> None:
        if step.number % self.every and not step.last:
            return
        self.guard.check(until=step.number)
        if self.guard.in_a_row:  # the state may be the one that made them non-finite
            log.warning("step %d: no checkpoint while non-finite steps are being skipped (the "
                        "newest is of step %s)", step.number, self.guard.last_checkpoint)
            return
        self.save(step.number, self.stepper.train_state(step.state))
        self.guard.last_checkpoint = step.number


class Profile(Hook):
    """A jax.profiler trace of steps `first` to `last` into `directory`."""

    def __init__(self, first: int, last: int, directory: str):
        self.first, self.last, self.directory = first, last, directory

    def before(self, number: int) -> None:
        if number == self.first:
            jax.profiler.start_trace(self.directory)

    def after(self, step: Step) -> None:
        if step.number == self.last:
            jax.block_until_ready(step.state)
            jax.profiler.stop_trace()
            log.info("profile of steps %d-%d: %s", self.first, self.last, self.directory)
