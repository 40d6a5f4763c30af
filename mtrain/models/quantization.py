"""Low-precision matmuls (``transformer.quantization``): the projections' einsums in fp8
(Hopper and newer GPUs) or int8 (TPU v5e), through qwix's quantized training ops.

A quantized projection ``einsum(spec, x, w)`` quantizes both operands to the format (each
scaled so that its largest magnitude lands on the format's largest value), multiplies the
quantized values (on hardware with such units, at their rate: an H100's fp8 tensor cores
run 2x its bf16 rate) and scales the product back. Its backward pass quantizes the incoming
gradient the same way (fp8: to e5m2, the wider-range format, as Transformer Engine's and
torchtitan's recipes do; int8: to int8, rounded to nearest, where AQT rounds it
stochastically: with one scale for the tensor, entries below 1/254 of its largest become 0,
so int8 wants ``'rowwise'``) and multiplies it by the quantized operands saved from the
forward pass. int8 quantizes in float32 whatever the activations' dtype (x / scale rounded
to bf16 first would cost up to 3/4 of a step, not 1/2). Parameters, optimizer state and checkpoints stay as
they are (float32, or the run's dtype): the low-precision copies live only inside a step.

`transformer.quantization_scaling` says what one scale covers:

- ``'tensorwise'``: one scale per operand (torchtitan's ``tensorwise``, the current scaling
  of Transformer Engine: computed from this step's values, not a history);
- ``'rowwise'``: a scale per row of each operand along the dimensions it keeps (each token's
  activations, each output unit's weights; torchtitan's ``rowwise``): more accurate where
  a few tokens carry outliers, at the cost of the scales' reductions;
- ``'delayed'`` (fp8 only): one scale per operand from the largest magnitude in a history
  of the last `history` steps' (``transformer.quantization_history``, default 1024, as
  Transformer Engine's ``amax_history_len``), this step's added after it is used: Transformer
  Engine's delayed scaling and MaxText's ``fp8``, through flax's ``fp8_scaled_dot_general``
  (the op under flax's ``Fp8Einsum``). A step needs no reduction over an operand before its
  product, but a quantized projection holds state: ``<weight>_fp8`` [3, 1 + history] beside
  its weight (the scale, then the history, of its input, its weight and its incoming
  gradient), a parameter the optimizer never sees. Its gradient is its new value (flax's
  "overwrite with gradient"), which the trainer writes over it on every finite step (the
  largest over microbatches), so a checkpoint holds it and a resumed run goes on bit for
  bit. It starts at scale 1 with an empty history: the first step quantizes unscaled. Being
  part of the train state, it makes a delayed run's checkpoints readable with delayed
  scaling alone (``run.init_from`` leaves it: a run of another setting starts from its
  parameters, a delayed one from another's with its state fresh).
  torchao deleted delayed scaling from the float8 training torchtitan runs (pytorch/ao#1753,
  2025: current scaling more accurate, and no slower: 6,750 against 6,810 tokens/s for
  Llama 3 8B, torchtitan#698); it is here for the recipes that use it.

Whatever the scaling, a pass without dropout's randomness (``deterministic``: evaluation,
scoring, decoding, a frozen reference, DPO's policy with dropout disabled) scales per token:
then no row's result depends on the rows beside it in its batch, and decoding a token a
step computes what the whole pass computes (one scale for a tensor would span the batch,
its padding, and a decoding step's single token).

Only the projections are quantized (attention's q, k, v, o and latent attention's, the
feed-forward layers' and the capacity-dispatched experts'): never the embeddings, the
logits, the attention's own products (q.k, p.v), the router or the norms, as torchtitan and
MaxText leave them. The dropless experts' grouped matmuls and the multi-token prediction's
projection stay in the run's dtype; so does a projection's low-rank adapter (`lora`): its
matmuls are small. Latent attention's absorbed decoding (``kv_b`` folded into the queries)
multiplies ``kv_b`` and the cached latents as its expanded pass quantized them (`rounded`).

Why qwix: it is Google's quantization library for JAX (MaxText's, after AQT), a dependency
of tokamax already, and its quantized-training (QT) dot_general has the backward pass
above for fp8 and int8 alike, with either scaling; flax's fp8 ops have fp8 alone, and
Transformer Engine ships CUDA alone. mtrain calls the op, with each operand's role
explicit (`_qwix_training_op`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MODES = ("none", "fp8", "int8")
SCALINGS = ("tensorwise", "rowwise", "delayed")
META = "_fp8"  # the suffix of a projection's delayed-scaling state (`Quantization.meta`)
# the logical names of its dimensions: (input, weight, gradient) x (scale, history...)
META_NAMES = ("fp8_operand", "amax_history")
# (forward operands, incoming gradient) of each format
FORMATS = {"fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2), "int8": (jnp.int8, jnp.int8)}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A run's low-precision matmuls: `mode` ('fp8' or 'int8') and `scaling`
    ('tensorwise' or 'rowwise'); `of` gives None for ``'none'``."""

    mode: str
    scaling: str = "tensorwise"
    history: int = 1024  # delayed scaling's amax history, in steps

    def __post_init__(self):
        if self.mode not in FORMATS:
            raise ValueError(f"transformer.quantization must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"transformer.quantization_scaling must be one of "
                             f"{', '.join(SCALINGS)}, got {self.scaling!r}")
        if self.scaling == "delayed" and self.mode != "fp8":
            raise ValueError(f"transformer.quantization_scaling='delayed' is fp8's (flax's fp8 "
                             f"ops), not {self.mode}'s: use 'tensorwise' or 'rowwise'")
        if self.history < 1:
            raise ValueError(f"transformer.quantization_history must be at least 1 step, got "
                             f"{self.history}")

    @classmethod
    def of(cls, c) -> Quantization | None:
        """The quantization of a `TransformerConfig` `c` (None: none)."""
        if c.quantization == "none":
            return None
        return cls(mode=c.quantization, scaling=c.quantization_scaling,
                   history=c.quantization_history)

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    def meta(self, module, name: str):
        """The delayed-scaling state of `module`'s projection by weight `name` (module doc):
        the parameter ``<name>_fp8`` [3, 1 + history], made at scale 1 with an empty
        history."""
        import flax.linen as nn

        return module.param(name + META, nn.with_logical_partitioning(
            lambda key, shape, dtype: fresh_meta(shape), META_NAMES), (3, 1 + self.history),
            jnp.float32)

    def einsum(self, spec: str, x, w, per_token: bool = False, meta=None):
        """``einsum(spec, x, w)`` with both operands and the backward pass's incoming
        gradient quantized (module doc), in the operands' dtype; `per_token`: rowwise
        whatever the scaling (a pass without dropout's randomness: module doc). Delayed
        scaling takes the projection's `meta` (`meta`), whose gradient is its new value."""
        if self.delayed and not per_token:
            return _delayed_einsum(spec, x, w, meta)
        qt = _qwix_training_op()
        forward, backward = FORMATS[self.mode]
        one = self.scaling == "tensorwise" and not per_token
        config = qt.DotGeneralQtConfig(
            lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=backward,
            drhs_grad_qtype=backward, lhs_disable_channelwise_axes=one,
            rhs_disable_channelwise_axes=one, dlhs_grad_disable_channelwise_axes=one,
            drhs_grad_disable_channelwise_axes=one)

        def dot_general(lhs, rhs, dimension_numbers, *args, **kwargs):
            return qt.dot_general_qt(lhs, rhs, dimension_numbers, config)

        dtype = jnp.result_type(x, w)
        if self.mode == "int8":  # x / scale rounded to bf16 first would cost int8 up to
            x, w = x.astype(jnp.float32), w.astype(jnp.float32)  # 3/4 of a step, not 1/2
        with jax.disable_jit():  # (einsum's own jit would cache the closure: as qwix's)
            y = jnp.einsum(spec, x, w, _dot_general=dot_general)
        return y.astype(dtype)


    def rounded(self, x, contracted: tuple[int, ...]):
        """`x` as a per-token (rowwise) quantized matmul that contracts its `contracted`
        axes sees it: quantized with a scale per slice along them, and back, in `x`'s dtype
        (latent attention's absorbed decoding folds ``kv_b`` and the latents this way into
        what its expanded pass multiplies)."""
        import qwix

        y = x.astype(jnp.float32) if self.mode == "int8" else x
        kept = tuple(i for i in range(x.ndim) if i not in contracted)
        return qwix.dequantize(qwix.quantize(y, FORMATS[self.mode][0],
                                             channelwise_axes=kept)).astype(x.dtype)


def _delayed_einsum(spec: str, x, w, meta):
    """``einsum(spec, x, w)`` through flax's delayed-scaling fp8 dot_general, its scales
    and histories the rows of `meta` (input, weight, gradient; column 0 the scale), in the
    operands' dtype."""
    from flax.linen import fp8_ops

    dtype = jnp.result_type(x, w)

    def dot_general(lhs, rhs, dimension_numbers, *args, **kwargs):
        return fp8_ops.fp8_scaled_dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=dtype,
            lhs_scale=meta[0, :1], rhs_scale=meta[1, :1], grad_scale=meta[2, :1],
            lhs_amax_history=meta[0, 1:], rhs_amax_history=meta[1, 1:],
            grad_amax_history=meta[2, 1:], quantize_compute_type=dtype)

    with jax.disable_jit():  # (einsum's own jit would cache the closure over `meta`)
        return jnp.einsum(spec, x, w, _dot_general=dot_general).astype(dtype)


def is_meta(path: str) -> bool:
    """Whether the parameter at `path` is a projection's delayed-scaling state."""
    return path.endswith(META)


def updated_meta(old, new, finite):
    """The state of `old` (a tree of delayed-scaling states) after a step whose gradient of
    it is `new` (its new values): `new` where the step is `finite` and used the state, else
    `old` (a state no quantized product read this step, as in a pass without dropout's
    randomness, has a zero gradient)."""
    def one(old, new):
        used = jnp.any(new != 0, axis=(-2, -1), keepdims=True) & finite
        return jnp.where(used, new, old)

    return jax.tree_util.tree_map(one, old, new)


def fresh_meta(shape) -> jax.Array:
    """Delayed-scaling state of `shape` (a stack's [layers, 3, 1 + history] too) as
    `Quantization.meta` makes it: scale 1, an empty history."""
    return jnp.zeros(shape, jnp.float32).at[..., 0].set(1.0)


def with_fresh_meta(params, abstract):
    """`params` with the delayed-scaling states of the abstract tree `abstract` that it
    lacks (an import's, another scaling's checkpoint's), fresh, laid out as `abstract`'s
    leaves say where they carry a sharding."""
    from mtrain.models import parameters

    have = parameters.paths(params)
    lacking = {p for p in parameters.paths(abstract) if is_meta(p) and p not in have}
    if not lacking:
        return params
    return parameters.merge(params, jax.tree.map(
        lambda leaf: jax.jit(lambda: fresh_meta(leaf.shape),
                             out_shardings=getattr(leaf, "sharding", None))(),
        parameters.select(abstract, lacking.__contains__)))


def _qwix_training_op():
    """qwix's quantized-training dot_general (`dot_general_qt` and its config). Its public
    entry points (``qwix.QtProvider``) find which operand is the weight by looking the
    arrays up among the module's parameters, by shape where tracing hides them, which
    fails for q, k and v of one shape; the op itself takes both operands' roles from its
    config. (pyproject pins qwix's minor version for this import.)"""
    from qwix._src.core import dot_general_qt

    return dot_general_qt


def check(mode: str, scaling: str, history: int = 1024) -> None:
    """One line naming the setting where `mode`, `scaling` or `history` is not one of them
    (with no quantization, the others as fp8 would take them)."""
    Quantization(mode=mode if mode != "none" else "fp8", scaling=scaling, history=history)
