"""Running mtrain's command line from tests as a user would: its arguments for the tiny LM
on the simulated 8-device mesh (`argv`), a separate process started as from a terminal
(`subprocess_cli`), and waiting for a running one to reach a step (`wait_for_step`)."""

import os
import signal
import subprocess
import sys
import time

from conftest import no_compilation_cache
from model_dirs import records
from tiny_config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = [*TINY, "transformer.dropout_rate=0.1", "run.log_every=1"]
FILES = ["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin"]


def argv(model_dir, *params):
    return FILES + [f"--gin_param={p}" for p in [*PARAMS, *params]] + [f"--model_dir={model_dir}"]


def subprocess_cli(model_dir, *params, cache=True):
    """`python -m mtrain` started as from a terminal, where Ctrl-C stops it, whatever this
    process inherited: a test run started in the background by a shell inherits SIGINT
    ignored and would pass that on (and mtrain, as Python, keeps an ignored SIGINT ignored).
    A handler of this process is not inherited (exec resets it to the default); so, for the
    moment the child starts, this process handles SIGINT. (Not a `preexec_fn`: that forks
    this multithreaded process instead of spawning.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    env = env if cache else no_compilation_cache(env)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "mtrain", "--cpu_devices=8",
                                 *argv(model_dir, *params)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def wait_for_step(model_dir, step, proc, timeout=240):
    """Waits until `model_dir`'s metrics show `step` (the process still running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        path = os.path.join(model_dir, "metrics.jsonl")
        if os.path.exists(path) and any(r.get("step", 0) >= step and "train/loss" in r
                                        for r in records(model_dir)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")
