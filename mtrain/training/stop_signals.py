"""Stopping a training run cleanly: SIGTERM and Ctrl-C end it after a step, with a checkpoint.

    with StopSignals() as signals:
        for step in ...:
            ...
            if why := signals.reached(step):   # "SIGTERM", "SIGINT" or None
                save a checkpoint and stop

SIGTERM is what Cloud TPU, Kubernetes and Slurm send before they stop a job; Ctrl-C
(SIGINT) is a person's. After the first Ctrl-C a second one stops at once
(KeyboardInterrupt): a checkpoint already being written is completed first, one not yet
started is not. A process that inherited SIGINT ignored (a job started in the background
by a shell script) keeps ignoring it, as Python does: only SIGTERM stops it.

With several processes, JAX's coordination service catches SIGTERM on whichever processes
get it and agrees with all of them on a step to stop at (`reached_preemption_sync_point`),
so that they all save the same one; Ctrl-C keeps its default there (it aborts).
"""

from __future__ import annotations

import logging
import signal

import jax

log = logging.getLogger("mtrain")


class StopSignals:
    """Notes SIGTERM and Ctrl-C while the block runs (see the module doc)."""

    requested: str | None = None  # "SIGTERM" or "SIGINT" once one arrived

    def reached(self, step: int) -> str | None:
        """Whether to save and stop after `step` ("SIGTERM", "SIGINT" or None); call it at
        every step, on every process."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        return self.requested

    def __enter__(self):
        self.requested = None
        self._previous = {}
        if jax.process_count() > 1:
            return self  # the coordination service owns SIGTERM
        for signum, handler in [(signal.SIGTERM, self._term), (signal.SIGINT, self._interrupt)]:
            if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # started with Ctrl-C ignored (in the background): keep it so
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _term(self, signum, frame):
        self.requested = self.requested or "SIGTERM"

    def _interrupt(self, signum, frame):
        self.requested = "SIGINT"
        log.warning("Ctrl-C: stopping after this step and saving a checkpoint (Ctrl-C again "
                    "to stop at once: a checkpoint being written then is completed first)")
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
