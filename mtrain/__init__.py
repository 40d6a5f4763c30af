"""mtrain: Mesh-TensorFlow rebuilt on JAX/Flax."""

__version__ = "0.1.0"
MODES = ("train", "eval", "infer", "score", "plan", "import", "export", "lm_eval")  # --mode / run.mode


def python_too_old() -> str | None:
    """Why this Python cannot run mtrain (None: it can). Current jax needs Python 3.12; an
    environment made with an older one (a `.venv` from before) must be made again."""
    import sys

    if sys.version_info >= (3, 12):
        return None
    return (f"mtrain needs Python 3.12 or later, and {sys.executable} is "
            f"{'.'.join(map(str, sys.version_info[:3]))}: make the environment again with "
            f"python3.12 (rm -rf .venv, then the README's quickstart)")
