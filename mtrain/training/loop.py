"""The training loop: a step function over batches, and hooks with a cadence.

    state = train_loop(stepper, state, batches, start, end, hooks, guard)

The `stepper` updates a state from a batch: `Trainer` (all-reduce data parallelism) or
`SGPTrainer` (gossip), which share the `Stepper` methods below. Everything else a run does
on a schedule is a `Hook` (`training.hooks`: logging, evaluation, checkpoints, profiling),
called before and after each step and at the end; the loop itself knows none of them.

Two things stay in the loop because every hook depends on them:

- `FiniteGuard`: a step whose loss or gradient is not finite has had its update skipped
  (optax's apply_if_finite); the guard counts them, a step behind so that at most two steps
  are in flight, and raises `Diverged` after ``run.max_nonfinite_steps`` in a row. Hooks
  read it (no checkpoint while such steps are being skipped; the skipped count in the log).
- `StopSignals`: on SIGTERM or Ctrl-C the loop finishes the step, lets the hooks see it as
  the last one (so a checkpoint is written), and stops: SIGTERM returns, Ctrl-C raises
  `Interrupted`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax

from mtrain.errors import Interrupted
from mtrain.training.stop_signals import StopSignals

log = logging.getLogger("mtrain")


class Stepper(Protocol):
    """What the loop steps: a state through batches."""

    def start(self, state) -> Any:
        """The stepper's state to begin from a train state (a checkpoint's)."""

    def place_batch(self, batch: dict) -> Any:
        """A host batch (this process's rows) on the devices."""

    def train_step(self, state, batch) -> tuple[Any, dict]:
        """The next state, and the step's metrics (``finite`` among them)."""

    def train_state(self, state) -> Any:
        """The train state a checkpoint holds."""

    def eval_params(self, state) -> Any:
        """The parameters evaluation uses."""

    def log_metrics(self, state) -> dict:
        """Metrics of the state to add to each training log record."""


@dataclasses.dataclass
class Step:
    """What the hooks see after a step."""

    number: int
    state: Any  # the stepper's state after the step
    metrics: dict  # the step's metrics, on the devices
    last: bool  # the run's last step, or the one a stop signal ends it at
    stop: str | None = None  # "SIGTERM" or "SIGINT": the run stops after this step


class Hook:
    """Something done on a schedule; every method is optional."""

    def before(self, number: int) -> None:
        """Before step `number` runs."""

    def after(self, step: Step) -> None:
        """After each step."""

    def end(self, state, number: int) -> None:
        """After the loop, with the last state and its step (also when no step ran)."""


class Diverged(Exception):
    def __init__(self, first: int, last: int):
        super().__init__(first, last)
        self.first, self.last = first, last


class FiniteGuard:
    """Counts the steps whose loss or gradient was not finite (their updates were skipped)
    and raises `Diverged` after `limit` in a row. `last_checkpoint` is the step of the
    newest checkpoint written (the checkpoint hook keeps it up to date)."""

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
                raise Diverged(step - self.in_a_row + 1, step)


def train_loop(stepper: Stepper, state, batches: Iterator[dict], start: int, end: int,
               hooks: Sequence[Hook], guard: FiniteGuard):
    """Steps `state` from step `start` to `end` over `batches`, calling the hooks; returns
    the last state (stopped early by SIGTERM), or raises `Interrupted` (Ctrl-C) or
    `Diverged`."""
    number = start
    with StopSignals() as signals:
        for number in range(start + 1, end + 1):
            for hook in hooks:
                hook.before(number)
            state, metrics = stepper.train_step(state, stepper.place_batch(next(batches)))
            guard.add(number, metrics["finite"])
            # At most two steps in flight: this one is queued behind the previous one, which
            # we wait for here. More buys nothing (the devices are busy either way) and, with
            # simulated CPU devices, a deep queue of multi-device programs can deadlock
            # XLA's collectives.
            guard.check(until=number - 1)
            stop = signals.reached(number)
            step = Step(number, state, metrics, last=number == end or stop is not None,
                        stop=stop)
            for hook in hooks:
                hook.after(step)
            if stop:
                saved = ("saved its checkpoint" if guard.last_checkpoint == number else
                         f"the newest checkpoint is of step {guard.last_checkpoint}")
                if stop == "SIGTERM":
                    log.warning("SIGTERM: stopped after step %d and %s; run the same command "
                                "to resume", number, saved)
                    return state
                raise Interrupted(f"interrupted (Ctrl-C) after step {number}, and {saved}; "
                                  f"run the same command to resume")
    for hook in hooks:
        hook.end(state, max(start, end))
    return state
