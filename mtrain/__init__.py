"""mtrain: Mesh-TensorFlow rebuilt on JAX/Flax."""

__version__ = "0.1.0"
MODES = ("train", "eval", "infer", "score", "plan")  # --mode / run.mode
