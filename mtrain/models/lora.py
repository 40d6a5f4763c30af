"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's projections, as PEFT applies them.

A projection ``y = einsum(spec, x, w)`` whose parameter path matches `LoraConfig.targets`
gains two parameters beside ``w``: ``<w>_lora_a`` [its input dimensions..., lora_rank] and
``<w>_lora_b`` [lora_rank, its output dimensions...] (an expert's weight [experts, ...]:
each expert its own, ``experts`` leading both), and computes

    y = einsum(spec, x, w) + scale * einsum(einsum(dropout(x), a), b)

with scale = alpha / rank (rsLoRA: alpha / sqrt(rank)). The adapter is applied factored,
never merged into ``w``: the base weight's gradient (x^T dy, as large as the weight) is not
needed to train the adapters, and where ``w`` is frozen XLA never forms it. ``a`` starts as
PEFT's (kaiming-uniform, U(-1/sqrt(fan_in), 1/sqrt(fan_in))) and ``b`` at zero, so that an
adapted model starts as its base. The adapters' dimensions carry the weight's names and
``lora_rank``: the layout rules split them as they split the weight (the ``b`` of a
``d_ff:model`` weight splits on d_ff), and ``lora_rank`` like any dimension.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models.base import shape_field
from mtrain.models.parameters import param
from mtrain.models.quantization import Quantization

# PEFT's "all-linear" minus the output layer: every attention and feed-forward projection
# (experts' included; latent attention's low-rank ones too).
DEFAULT_TARGETS = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")
# Latent attention's projections (`latent_attention`), which the default targets too: kept
# out of the tuple above, so that the ``lora.targets`` a run of the default recorded in its
# checkpoints before latent attention existed is still the default.
LATENT_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")
RANK = "lora_rank"
SUFFIXES = ("_lora_a", "_lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """gin's ``lora.*``. `targets`: parameter names (``'q'``, ``'wo'``) or regular
    expressions matched against a parameter's whole path (``'layer_[0-3]/mlp/wo'``);
    `dropout` on the adapters' input; `rslora`: scale by alpha / sqrt(rank)."""

    rank: int = shape_field(0)
    alpha: float = 16.0
    targets: tuple[str, ...] = shape_field(DEFAULT_TARGETS)
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise ValueError(f"lora.rank must be positive (0: no adapters), got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        for t in self.targets:
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"lora.targets: {t!r} is not a regular expression: {e}") \
                    from None

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets_path(self, path: str) -> bool:
        """Whether the parameter at `path` ("layer_0/self_attention/q") is adapted."""
        name = path.rsplit("/", 1)[-1]
        targets = self.targets + (LATENT_TARGETS if self.targets == DEFAULT_TARGETS else ())
        return any(re.fullmatch(t, name) or re.fullmatch(t, path) for t in targets)


def is_adapter(path: str) -> bool:
    return path.endswith(SUFFIXES)


def _parameter_path(module: nn.Module, name: str) -> str:
    return "/".join((*module.scope.path, name))


class Adapter(NamedTuple):
    """A weight's adapter parameters `a` and `b` and their letters in its projection's
    einsum (`rank`: the adapter rank's letter)."""

    a: jax.Array
    b: jax.Array
    a_letters: str
    b_letters: str
    rank: str


@dataclasses.dataclass(frozen=True)
class Projection:
    """A projection ``einsum(spec, x, w)`` by weight `w` (the parameter `name`) with its
    `adapter` (None: not targeted), made by `projection`: applied factored (`__call__`) or
    merged into the weight (`merged_weight`)."""

    name: str
    spec: str
    w: jax.Array
    adapter: Adapter | None
    lora: LoraConfig | None
    quantization: Quantization | None = None  # its low-precision matmul (None: none)
    module: nn.Module | None = None  # the module it is `name` of (delayed scaling's state)

    def __call__(self, x, deterministic: bool = True):
        """``einsum(spec, x, w)`` (quantized by `quantization`) plus the adapter's factored
        share (module doc)."""
        if self.quantization is None:
            y = jnp.einsum(self.spec, x, self.w)
        else:
            meta = None  # delayed scaling's state: a pass with dropout's randomness reads it
            if self.quantization.delayed and (not deterministic
                                              or self.module.is_initializing()):
                meta = self.quantization.meta(self.module, self.name)
            y = self.quantization.einsum(self.spec, x, self.w, per_token=deterministic,
                                         meta=meta)
        if self.adapter is None:
            return y
        a, b, a_letters, b_letters, r = self.adapter
        inputs, out = self.spec.split("->")
        xs = inputs.split(",")[0]
        if self.lora.dropout:
            x = nn.Dropout(self.lora.dropout)(x, deterministic=deterministic)
        hidden = "".join(c for c in xs if c in out) + r
        low = jnp.einsum(f"{xs},{a_letters}->{hidden}", x, a)
        return y + self.lora.scale * jnp.einsum(f"{hidden},{b_letters}->{out}", low, b)

    def merged_weight(self):
        """The weight with its adapter merged in (`merged`: w + scale a b, the same
        parameters), for a computation that cannot take the factored form (dropless
        experts' grouped matmuls): the merged weight and its gradient are as large as the
        weight. Refuses adapter dropout, which applies to the input."""
        if self.adapter is None:
            return self.w
        if self.lora.dropout:
            raise ValueError(f"lora.dropout applies to the input of {self.name!r}, which the "
                             f"dropless experts' grouped matmuls take merged: set lora.dropout"
                             f" = 0.0 or moe.dispatch = 'capacity'")
        ws = self.spec.split("->")[0].split(",")[1]
        a, b, a_letters, b_letters, r = self.adapter
        if ws != a_letters.replace(r, "") + b_letters.split(r)[1]:  # (as `merged` reads it)
            raise ValueError(f"{self.name!r}: a weight {ws!r} that is not [shared..., "
                             f"inputs..., outputs...] cannot be merged")
        return merged(self.w, a, b, self.lora.scale)


def projection(module: nn.Module, name: str, spec: str, w, names: tuple[str, ...],
               lora: LoraConfig | None, quantization: Quantization | None = None
               ) -> Projection:
    """The projection of `spec` by `w`, the parameter `name` of `module` (of logical
    `names`), with its adapter's parameters made beside it where `lora` targets it, its
    matmul in the low precision of `quantization` (None: the operands')."""
    return Projection(name, spec, w, _adapter(module, name, spec, w, names, lora), lora,
                      quantization, module)


def project(module: nn.Module, name: str, spec: str, x, w, names: tuple[str, ...],
            lora: LoraConfig | None, deterministic: bool = True,
            quantization: Quantization | None = None):
    """``einsum(spec, x, w)`` (``w`` the parameter `name` of `module`, of logical `names`),
    with its adapter where `lora` targets it (module doc), quantized by `quantization`."""
    return projection(module, name, spec, w, names, lora, quantization)(x, deterministic)


def _adapter(module, name, spec, w, names, lora):
    """The `Adapter` of weight `name` (its parameters made here), or None where `lora` does
    not target it."""
    if not lora or not lora.rank or not lora.targets_path(_parameter_path(module, name)):
        return None
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    r = "r" if "r" not in spec else next(c for c in "zyxwvutsq" if c not in spec)
    lead = [c for c in ws if c in xs and c in out]  # experts: in the input, weight and output
    contracted = [c for c in ws if c in xs and c not in out]
    made = [c for c in ws if c not in xs]
    name_of = dict(zip(ws, names))
    a_letters, b_letters = [*lead, *contracted, r], [*lead, r, *made]
    fan_in = math.prod(w.shape[ws.index(c)] for c in contracted)
    bound = fan_in ** -0.5
    a = param(module, f"{name}_lora_a",
              lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound),
              tuple(w.shape[ws.index(c)] if c != r else lora.rank for c in a_letters),
              tuple(name_of.get(c, RANK) for c in a_letters), w.dtype)
    b = param(module, f"{name}_lora_b", nn.initializers.zeros,
              tuple(w.shape[ws.index(c)] if c != r else lora.rank for c in b_letters),
              tuple(name_of.get(c, RANK) for c in b_letters), w.dtype)
    return Adapter(a, b, "".join(a_letters), "".join(b_letters), r)


def merged(w, a, b, scale: float):
    """The weight `w` with its adapter (`a`, `b`, as `project` makes them) merged in: w +
    scale x a b (the leading dimensions both adapters share with the weight, experts' or a
    scanned stack's layers, taken pairwise), in `w`'s dtype. Numpy arrays (an export's) by
    numpy, others by jax (a traced step's: `Projection.merged_weight`)."""
    xp = np if all(isinstance(x, np.ndarray) for x in (w, a, b)) else jnp
    lead = a.ndim + b.ndim - 2 - w.ndim
    letters = "abcdefghijklmnop"
    head, ins = letters[:lead], letters[lead:a.ndim - 1]
    outs = letters[a.ndim - 1:w.ndim]
    delta = xp.einsum(f"{head}{ins}z,{head}z{outs}->{head}{ins}{outs}", a, b)
    return w + scale * delta.astype(w.dtype)
