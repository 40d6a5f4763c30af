"""Multi-process runs: one process per host (or per GPU), all running the same program.

`initialize` starts JAX's distributed runtime when there is more than one process, before
anything else touches jax: from explicit settings (``--coordinator_address``,
``--num_processes``, ``--process_id``, or the ``MTRAIN_*`` environment variables of the
same names) or, on Cloud TPU pods and under Slurm, from what JAX detects itself.

Hang-proofing comes from JAX's coordination service: every process sends it heartbeats, and
when one stops (it crashed, was killed, or its host died) all the others are terminated
after `heartbeat_timeout` seconds with "the JAX distributed service detected fatal errors
... another task died", instead of waiting in a collective forever. Sooner, when a
collective was in flight: its transport fails on the closed connection (on CPU, gloo
aborts with its own error). A process that never joins makes the others stop after
`timeout` seconds with an mtrain error saying so.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("mtrain")


def detected_processes() -> int:
    """How many processes the environment says this job has (1 if it says nothing): Slurm
    (inside srun), Open MPI, or a multi-host Cloud TPU slice."""
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_NTASKS"])
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    return max(len(hosts), 1)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: int = 300,
               heartbeat_timeout: int = 100) -> bool:
    """Starts jax.distributed if this is one of several processes; returns whether it did.

    Must run before any other jax call. With `coordinator_address` (host:port of process
    0), `num_processes` and `process_id` all given, uses them; with none given, lets JAX
    detect them where `detected_processes` finds several; otherwise does nothing.
    """
    explicit = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        from mtrain.errors import ConfigError

        raise ConfigError("a multi-process run needs all of --coordinator_address, "
                          "--num_processes and --process_id (or none, where JAX detects them)")
    if num_processes is None and detected_processes() <= 1:
        return False
    if num_processes is not None and num_processes <= 1:
        return False
    import jax

    who = (f"process {process_id} of {num_processes}" if num_processes is not None
           else "this process")
    where = coordinator_address or "the detected coordinator"
    # JAX aborts with a terse DEADLINE_EXCEEDED when the others do not join in time; say
    # what happened first, a little before it would.
    watchdog = threading.Timer(timeout, _never_joined, (who, where, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes,
            process_id=process_id, initialization_timeout=timeout + 10,
            heartbeat_timeout_seconds=heartbeat_timeout)
    finally:
        watchdog.cancel()
    return True


def _never_joined(who: str, where: str, timeout: int) -> None:
    print(f"mtrain: error: {who}: not every process joined the coordinator at {where} within "
          f"{timeout} s (--distributed_timeout); start the same command on every host, with "
          f"the same --num_processes and --coordinator_address", file=sys.stderr, flush=True)
    os._exit(3)


def sync(name: str) -> None:
    """A barrier across all processes (a no-op with one)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_0_says(flag: bool) -> bool:
    """Process 0's `flag`, on every process (itself with one process)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
