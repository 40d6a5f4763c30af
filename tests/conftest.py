"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

`--xla_backend_optimization_level=0` makes XLA compile the tiny test models several times
faster on CPU; tests check results, not speed.
"""

import os

from mtrain.cpu_devices import simulate_cpu_devices  # imports no jax

simulate_cpu_devices(8)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; was jax imported before conftest?"

import tempfile  # noqa: E402

import pytest  # noqa: E402

# Tests compile the same small programs many times (every CLI run of one config): a
# persistent compilation cache for the session compiles each once.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="mtrain-jax-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data dir (vocabularies, prepared datasets) shared by the tests of a module."""
    path = tmp_path_factory.mktemp("data")
    os.environ["MTRAIN_DATA_DIR"] = str(path)
    yield path
    del os.environ["MTRAIN_DATA_DIR"]
