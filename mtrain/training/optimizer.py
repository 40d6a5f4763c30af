"""The optimizers and learning-rate schedules: Adafactor with Mesh-TF's defaults and its
`linear_warmup * rsqrt_decay` schedule; AdamW with gradient clipping and the warmup + cosine
schedule Llama-style models train with; and the logical names of an optimizer state's
leaves (for its sharding).

A scanned stack's parameters are stacked on a leading ``layers`` dimension, yet each layer's
slice is a parameter of its own: `for_parameters` tells an optimizer which parameters are
stacked (from their logical names; the trainer calls it), and `layerwise` makes a
transformation's per-tensor statistics (Adafactor's factored moments, parameter scale and
update clipping) those of each slice, so that scanning the layers never changes an update.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

# The first logical name of the parameters of a scanned stack (`models.blocks`): one slice
# per layer (or per repeating group of layers).
STACKED = "layers"
# The parameters the optimizer being traced holds stacked: their key paths (`jax.tree_util.
# keystr`). Set only by `for_parameters`, read only by `layerwise`.
_stacked_paths: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "mtrain_stacked_paths", default=frozenset())


SCHEDULE_SHAPES = ("rsqrt", "cosine", "constant")


def learning_rate_schedule(
    warmup_steps: int = 10_000,
    train_steps: int | None = None,
    linear_decay_steps: int = 0,
    constant: float = 1.0,
    shape: str = "rsqrt",
    final_fraction: float = 0.1,
    decay_steps: int = 0,
) -> optax.Schedule:
    """The learning rate at each step, by `shape`. `s` counts from 1 (the rate for the update
    that produces step s), so the first update is not wasted.

    - ``'rsqrt'``: Mesh-TF/T2T's ``linear_warmup * rsqrt_decay [* linear_decay]`` (times
      `constant`): ``lr(s) = constant * min(1, s / warmup) / sqrt(max(s, warmup))``, and,
      when `linear_decay_steps` > 0, times ``clip((train_steps - s) / linear_decay_steps, 0,
      1)`` so that the rate falls linearly to zero over the last `linear_decay_steps` steps.
    - ``'cosine'``: linear warmup to `constant` (the peak rate), then a cosine decay to
      ``final_fraction * constant`` at step T, `decay_steps` or else `train_steps`: ``lr(s) =
      constant * s / warmup`` up to warmup, then ``constant * (f + (1 - f) * (1 + cos(pi *
      p)) / 2)`` with ``p = (s - warmup) / (T - warmup)``, held at its end value after T.
      (With `decay_steps`, a run given more steps keeps the rates it trained with.)
    - ``'constant'``: linear warmup to `constant`, then `constant` (``warmup_steps=1``: from
      the first update): fine-tuning's rate (Hugging Face's ``constant_with_warmup``).
    """
    if warmup_steps < 1:
        raise ValueError(f"learning_rate_schedule.warmup_steps must be >= 1, got {warmup_steps}")
    if shape not in SCHEDULE_SHAPES:
        raise ValueError(f"learning_rate_schedule.shape must be one of "
                         f"{', '.join(SCHEDULE_SHAPES)}, got {shape!r}")
    if linear_decay_steps and not train_steps:
        raise ValueError("learning_rate_schedule.linear_decay_steps needs train_steps")
    horizon = decay_steps or train_steps
    if shape == "cosine":
        if not horizon or horizon <= warmup_steps:
            which = (f"learning_rate_schedule.decay_steps={decay_steps}" if decay_steps else
                     f"run.train_steps={train_steps}")
            raise ValueError(f"learning_rate_schedule.shape='cosine' decays after the warmup: "
                             f"{which} must exceed learning_rate_schedule.warmup_steps="
                             f"{warmup_steps}")
        if not 0.0 <= final_fraction <= 1.0:
            raise ValueError(f"learning_rate_schedule.final_fraction must be in [0, 1], got "
                             f"{final_fraction}")

    def rsqrt(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        lr = constant * jnp.minimum(1.0, s / warmup_steps) * jnp.sqrt(1.0 / jnp.maximum(s, warmup_steps))
        if linear_decay_steps:
            lr = lr * jnp.clip((train_steps - s) / linear_decay_steps, 0.0, 1.0)
        return lr

    def cosine(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        progress = jnp.clip((s - warmup_steps) / (horizon - warmup_steps), 0.0, 1.0)
        decay = final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return constant * jnp.where(s < warmup_steps, s / warmup_steps, decay)

    def flat(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        return constant * jnp.minimum(1.0, s / warmup_steps)

    return {"rsqrt": rsqrt, "cosine": cosine, "constant": flat}[shape]


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
) -> optax.GradientTransformation:
    """optax's AdamW after clipping the gradients to global norm `clip_norm` (None: no
    clipping), with Llama's settings as defaults: torch's ``AdamW`` step for step.

    Weight decay (decoupled: ``p -= lr * weight_decay * p``) applies by a parameter's role,
    `decays`: to every weight and table (embeddings included, as torch and Hugging Face
    recipes decay them), not to the norms' scales nor to biases. Not by rank: a scanned
    stack's norm scales are [layers, d_model], and a bias of heads [heads, d_kv], yet neither
    is decayed, so that the same parameters decay with and without ``scan_layers``. AdamW's
    statistics are elementwise and its clipping global, so stacking changes nothing else."""
    decay = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=decay_mask)
    if clip_norm is None:
        return decay
    return optax.chain(optax.clip_by_global_norm(clip_norm), decay)


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: float | None = None,
        nesterov: bool = False, clip_norm: float | None = None) -> optax.GradientTransformation:
    """Plain stochastic gradient descent (optax's; torch's ``SGD`` without weight decay),
    after clipping to global norm `clip_norm` (None: none): what reference numbers of one
    update are compared with."""
    step = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)
    return step if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), step)


def adafactor(
    learning_rate: optax.ScalarOrSchedule,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = True,
    momentum: float | None = None,
    factored: bool = True,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
) -> optax.GradientTransformation:
    """optax's Adafactor with Mesh-TF's defaults.

    Factored second moments for matrices whose two largest dimensions are >= 128, second-moment
    decay ``1 - (step + 1)^-0.8``, updates scaled by the parameter's RMS (at least 1e-3), update
    clipping at RMS 1.0, and no momentum. All are statistics of one parameter: a stacked
    one's are each layer's (`layerwise`), as in the run without ``scan_layers``.
    """
    return layerwise(optax.adafactor(
        learning_rate=learning_rate,
        min_dim_size_to_factor=min_dim_size_to_factor,
        decay_rate=decay_rate,
        multiply_by_parameter_scale=multiply_by_parameter_scale,
        clipping_threshold=clipping_threshold,
        momentum=momentum,
        factored=factored,
        eps=epsilon,
    ))


def _key_name(key) -> str:
    """The name of one step of a key path (a dict key, an attribute, an index)."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def decays(path) -> bool:
    """Whether weight decay applies to the parameter at `path` (a key path), by its role:
    not to a norm's ``scale`` nor to a bias (``bias``, ``q_bias``, ...), to all else,
    embeddings included: Hugging Face's Trainer's rule (no decay for its norms' weights nor
    for any name holding "bias", which T5's ``relative_attention_bias`` table does: so
    mtrain's ``relative_bias`` is not decayed either)."""
    name = _key_name(path[-1]) if path else ""
    bias = name == "bias" or name.endswith("_bias")
    return not (name == "scale" or bias)


def decay_mask(params):
    """True at each parameter that weight decay applies to (`decays`)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def for_parameters(optimizer: optax.GradientTransformation,
                   param_names) -> optax.GradientTransformationExtraArgs:
    """`optimizer` told which parameters are stacked layers: those whose first logical name
    (`param_names`: a PartitionSpec of logical names per parameter, as the model gives them)
    is ``layers``. Its `layerwise` parts then keep each layer's statistics apart. The same
    transformation otherwise; with no stacked parameter, exactly `optimizer`'s state."""
    stacked = frozenset(
        jax.tree_util.keystr(path) for path, names in
        jax.tree_util.tree_leaves_with_path(
            param_names, is_leaf=lambda x: isinstance(x, PartitionSpec))
        if len(names) and names[0] == STACKED)
    optimizer = optax.with_extra_args_support(optimizer)

    @contextlib.contextmanager
    def bound():
        token = _stacked_paths.set(stacked)
        try:
            yield
        finally:
            _stacked_paths.reset(token)

    def init(params):
        with bound():
            return optimizer.init(params)

    def update(updates, state, params=None, **extra_args):
        with bound():
            return optimizer.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def _vmapped(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` on each slice along axis 0 of every parameter (all of one depth)."""
    def update(updates, state, params=None, **extra_args):
        return jax.vmap(lambda u, s, p: inner.update(u, s, p, **extra_args))(
            updates, state, params)
    return optax.GradientTransformation(jax.vmap(inner.init), update)


def layerwise(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner`, a transformation of each parameter on its own (optax's per-tensor ones:
    Adafactor's factored moments, `scale_by_param_block_rms`, `clip_by_block_rms`), with
    each layer of a stacked parameter (`for_parameters`) taken as a parameter of its own:
    `inner` vmapped over the ``layers`` dimension. Its state then holds ``stacked_<depth>``
    (the vmapped states of the parameters stacked that deep: its step counts are per layer,
    all equal) beside ``tensors`` (the rest); with nothing stacked, it is `inner`'s. Not for
    a transformation across parameters (global-norm clipping): per layer it is another."""
    def transformation(tree):
        stacked = _stacked_paths.get()
        labels = jax.tree_util.tree_map_with_path(
            lambda path, x: (f"stacked_{x.shape[0]}" if jax.tree_util.keystr(path) in stacked
                             else "tensors"), tree)
        groups = set(jax.tree.leaves(labels)) - {"tensors"}
        if not groups:
            return inner
        return optax.partition({"tensors": inner, **{g: _vmapped(inner) for g in groups}},
                               labels)

    def init(params):
        return transformation(params).init(params)

    def update(updates, state, params=None, **extra_args):
        return transformation(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def state_names(opt_state, params, param_names):
    """Logical names for every optimizer-state leaf, taken from the parameter it belongs to.

    optax states hold trees shaped like the parameters (Adafactor: row/column second-moment
    factors and full second moments). A leaf with the parameter's shape gets its names; a
    factored statistic (one dimension reduced away) gets the names of the dimensions it kept;
    anything else (step counters) is replicated. A tree of some of the parameters, the others
    `optax.MaskedNode` (`optax.masked`, `optax.partition`, `layerwise`), is matched leaf by
    leaf; a stacked parameter's per-layer statistics (`layerwise`) keep ``layers`` first.
    """
    params_def = jax.tree_util.tree_structure(params)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731

    def match(leaf, p, names):
        if masked(leaf):
            return leaf
        if leaf.shape == p.shape:
            return PartitionSpec(*names)
        if len(leaf.shape) == len(p.shape) - 1:
            kept = {
                tuple(n for j, n in enumerate(names) if j != i)
                for i in range(len(p.shape))
                if tuple(d for j, d in enumerate(p.shape) if j != i) == tuple(leaf.shape)
            }
            if len(kept) == 1:
                return PartitionSpec(*kept.pop())
        return PartitionSpec()

    def walk(node):
        if jax.tree_util.tree_structure(node, is_leaf=masked) == params_def:
            return jax.tree_util.tree_map(match, node, params, param_names, is_leaf=masked)
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if not children:
            return node  # an empty container (optax's EmptyState)
        if len(children) == 1 and children[0] is node:
            return PartitionSpec()  # a leaf that does not belong to a parameter
        return treedef.unflatten([walk(c) for c in children])

    return walk(opt_state)
