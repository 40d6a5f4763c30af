"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

`--xla_backend_optimization_level=0` makes XLA compile the tiny test models several times
faster on CPU; tests check results, not speed.
"""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

from mtrain import python_too_old
from mtrain.parallel.cpu_devices import simulate_cpu_devices  # imports no jax

if why := python_too_old():
    pytest.exit(why, returncode=2)

simulate_cpu_devices(8)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# Tests compile the same small programs many times (every run of one config, in this process
# and in the `python -m mtrain` processes they start, which inherit these variables): one
# persistent compilation cache for the session compiles each once. jax writes an entry
# without a lock, so processes that run side by side, or that a test kills, start without it
# (`no_compilation_cache`): they could read an entry another is still writing, or leave a
# damaged one, and jax warns on stderr when it reads one. So do processes that compile large
# programs no other test compiles (the paper configs): writing them costs seconds each.
_CACHE = tempfile.mkdtemp(prefix="mtrain-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import jax  # noqa: E402

import executable_cache  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; was jax imported before conftest?"
# This process compiles many more small programs, most of them once; and twice in two full
# runs (2026-11-26, jax 0.12.0.1) a test process died of a segfault inside jax's own read or
# write of a persistent cache entry (`compilation_cache.get_executable_and_time`,
# `put_executable_and_time`), each time in another test: the test processes keep no
# persistent cache (the `python -m mtrain` processes they start still share the session's).
# They keep the executables they compile in memory instead (`executable_cache`): a program
# lowered again to the same text, by another `main()` or `Trainer`, is compiled once.
jax.config.update("jax_enable_compilation_cache", False)
executable_cache.install()


def no_compilation_cache(env: dict) -> dict:
    """`env` for a process that runs beside another, that a test kills, or that compiles
    large programs once: without the session's compilation cache."""
    return {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                              "JAX_PERSISTENT_CACHE"))}


def split_import_times(stderr: str) -> tuple[set[str], list[str]]:
    """The stderr of `python -X importtime ...`: (the top-level packages it imported, its
    other lines)."""
    packages, lines = set(), []
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            packages.add(line.rsplit("|", 1)[1].strip().split(".")[0])
        elif line.strip():
            lines.append(line)
    return packages, lines


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches():
    """Each test module's compiled programs let go at its end (`jax.clear_caches`, and the
    executables kept by their text): a test process of the full suite otherwise keeps
    every executable it ever compiled, hundreds of test modules' worth, and a worker that
    grew so has aborted inside XLA's compiler."""
    yield
    jax.clear_caches()
    executable_cache.clear()
    gc.collect()


@pytest.fixture(scope="session")
def _shared_data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def data_dir(_shared_data_dir):
    """A data dir (vocabularies, prepared datasets), MTRAIN_DATA_DIR for the tests of a module
    that asks for it. One for the test process's whole session, as a user's ~/.cache/mtrain
    is one for all their runs: a module finds what an earlier one prepared (a dataset is
    prepared in seconds, once per process, not once per module). Tests of a first
    preparation use `fresh_home` or a data dir of their own."""
    os.environ["MTRAIN_DATA_DIR"] = str(_shared_data_dir)
    yield _shared_data_dir
    del os.environ["MTRAIN_DATA_DIR"]


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """An empty HOME and no data dir set: a user's first command on a new machine (its data
    dir ~/.cache/mtrain under that HOME)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MTRAIN_DATA_DIR", raising=False)
    return home


# The slow tests of these files are in the extended tier too (`pytest -m extended`), beside
# the tests marked `extended` one by one: on 2 CPU cores today the whole suite runs past CI's
# 90 minutes. Each file's fast tier keeps a case of each kind it checks (a family, a layout,
# a loss, a mode); what moves out is its other families, layouts and settings. The default
# run keeps the slow tests of the users' paths: first runs, resumes, faults, the
# accelerators' kernels in every mode, several processes, their own data.
EXTENDED_SLOW_FILES = frozenset({
    "test_huggingface.py", "test_hf_folders.py", "test_grpo.py", "test_oracles.py",
    "test_lora_families.py", "test_deepseek_experts.py", "test_context_parallel.py",
    "test_context_parallel_runs.py", "test_planner.py", "test_plan_quantization.py",
    "test_prefill.py", "test_latent_attention.py", "test_family_records.py",
    "test_encoder_decoder.py", "test_moe.py",
    "test_delayed_scaling.py", "test_mtp.py", "test_model_families.py",
    "test_frontier_presets.py", "test_finetune_exact.py"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in EXTENDED_SLOW_FILES and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.extended)
