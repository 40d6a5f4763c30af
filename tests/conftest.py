"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

`--xla_backend_optimization_level=0` makes XLA compile the tiny test models several times
faster on CPU; tests check results, not speed.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; was jax imported before conftest?"
