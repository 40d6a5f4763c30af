"""Simulated CPU devices: N XLA host devices in one process, so that a mesh such as
``batch:4;model:2`` runs on a laptop. Must be called before jax is imported (it only sets
environment variables, and imports nothing)."""

import os

# On CPU, XLA aborts the whole process when a device thread waits more than 40 s for the
# others at a collective (all-reduce and friends) -- meant to catch deadlocks, it also fires
# when simulated devices share a few busy cores. Wait up to 10 minutes instead.
COLLECTIVE_TIMEOUT_SECONDS = 600


def simulate_cpu_devices(count: int) -> None:
    """Makes jax (once imported) see `count` CPU devices, and only CPU devices."""
    flags = [f"--xla_force_host_platform_device_count={count}",
             f"--xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_SECONDS}",
             f"--xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_SECONDS}"]
    # Replace, not add to, any device count already in XLA_FLAGS (a parent process's).
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count=")]
    os.environ["XLA_FLAGS"] = " ".join([*kept, *flags])
    os.environ["JAX_PLATFORMS"] = "cpu"
