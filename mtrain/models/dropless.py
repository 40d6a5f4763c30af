"""Dropless experts (``moe.dispatch = 'dropless'``, MaxText's and Megatron's): every token
goes to each of its top_k experts, whatever their load; no capacity, no one-hot tensors.

Per device (under a shard_map by names, `manual.shard_map_by_names`, as the active layout
splits the tokens' ``batch`` and ``length``, the weights' ``experts`` and ``d_ff``), the
token choices are sorted by expert, so that each expert's tokens are consecutive rows, and
each expert's feed-forward layer runs as grouped matmuls over those rows
(`mtrain.models.grouped`). The outputs go back to the tokens' order, weighted by the gates,
summed over the choices. The rows move by gathers both ways, forward and backward
(`permute`). Padding tokens are routed nowhere. Where the experts are split:

- over a mesh dimension that does not split the tokens (``experts:model``), every device of
  it holds the same tokens and computes those routed to its own experts (the sorted rows of
  its experts, contiguous, moved to the front); the outputs are summed over it;
- over the one that splits the tokens (``experts:batch``), the routed rows travel to the
  devices of their experts and back by all-to-all: ``jax.lax.ragged_all_to_all`` (only the
  routed rows move) where the backend has it (GPU, TPU; ``moe.ragged_all_to_all``), else an
  all-to-all of blocks padded to what one device could send to one other at most (all its
  choices: dropless), which is what XLA:CPU runs and what the planner counts;
- ``d_ff`` split: each device's share of the hidden units, the outputs summed over it.

gpt-oss's expert biases (`biases`) are added to each row by its expert: the local experts'
biases on each device, the output's on one device of a split ``d_ff`` (the sum over it
adds the rest), before the gate weights the row.

The balanced expectation of each device's rows goes to the grouped kernel for the planner:
its choices (``experts:batch``) or its share of them (``experts`` split over a dimension
that does not split the tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtrain.models import grouped
from mtrain.models.feedforward import Clamp, gated
from mtrain.parallel import manual


def experts(x, index, gates, wis, wo, *, activations, kernel="auto", ragged=None,
            dropout_rate=0.0, key=None, biases=None, clamp: Clamp | None = None):
    """The experts' outputs [b, l, d] of tokens `x` [b, l, d] routed to experts `index`
    [b, l, k] (int32; ``num_experts`` for a padding token: nowhere) with `gates` [b, l, k];
    weights `wis` (one per activation) [experts, d, f] and `wo` [experts, f, d]; `biases`
    (None: none) ([one per wi: [experts, f]], [experts, d]). `ragged`: whether the
    all-to-all is ragged (None: where the backend has it). `key`: dropout's. `clamp`: the
    clamped activations' settings."""
    ragged = jax.default_backend() in ("gpu", "tpu") if ragged is None else ragged
    kwargs = dict(activations=activations, kernel=kernel, ragged=ragged,
                  dropout_rate=dropout_rate if key is not None else 0.0, clamp=clamp,
                  inputs=len(wis), biased=biases is not None)
    bias_arrays = [] if biases is None else [*biases[0], biases[1]]
    key = jax.random.key(0) if key is None else key
    batch, length, e_axis, f_axis = (manual.axis(n)
                                     for n in ("batch", "length", "experts", "d_ff"))
    if f_axis == e_axis:
        f_axis = None  # (experts claim their mesh dimension first: `layout.LEADING`)
    token_axes = tuple(a for a in (batch, length) if a is not None)
    axes = (e_axis, f_axis, e_axis if e_axis in token_axes else None, token_axes)

    def local(x, index, gates, key, *weights):
        return _local(x, index, gates, key, *weights, axes=axes, **kwargs)

    tokens = ("batch", "length", None)
    weights = [("experts", None, "d_ff")] * len(wis) + [("experts", "d_ff", None)]
    if biases is not None:
        weights += [("experts", "d_ff")] * len(wis) + [("experts", None)]
    return manual.shard_map_by_names(local, in_names=(tokens, tokens, tokens, (), *weights),
                                     out_names=tokens, always=True)(x, index, gates, key,
                                                                    *wis, wo, *bias_arrays)


def _local(x, index, gates, key, *weights, axes, activations, kernel, ragged, dropout_rate,
           clamp, inputs, biased):
    e_axis, f_axis, a2a_axis, token_axes = axes
    wis, wo, biases = weights[:inputs], weights[inputs], weights[inputs + 1:]
    b, l, d = x.shape
    k = index.shape[-1]
    e_local = wo.shape[0]
    experts = e_local * (jax.lax.axis_size(e_axis) if e_axis else 1)
    choice = index.reshape(-1)  # [T k]
    order = jnp.argsort(choice, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    rows = permute(jnp.repeat(x.reshape(-1, d), k, axis=0), order, inverse)  # sorted by expert
    sizes = jnp.bincount(choice, length=experts + 1)[:experts].astype(jnp.int32)
    for axis in token_axes:  # (the key differs per device holding other tokens)
        key = jax.random.fold_in(key, jax.lax.axis_index(axis))

    def compute(rows, sizes, balanced):
        add = _biases_by_row(sizes, rows.shape[0], f_axis) if biased else None
        hidden = [grouped.grouped_matmul(rows, wi, sizes, kernel, balanced) for wi in wis]
        if biased:
            hidden = [add(h, bias) for h, bias in zip(hidden, biases)]
        h = gated(activations, hidden, clamp)
        if dropout_rate:
            keep = jax.random.bernoulli(key, 1.0 - dropout_rate, h.shape)
            h = jnp.where(keep, h / (1.0 - dropout_rate), 0).astype(h.dtype)
        out = grouped.grouped_matmul(h, wo, sizes, kernel, balanced)
        return add(out, biases[-1], output=True) if biased else out

    if e_axis is None:
        out = compute(rows, sizes, rows.shape[0])
    elif a2a_axis is None:  # the tokens are the same on every device of `e_axis`
        first = jax.lax.axis_index(e_axis) * e_local
        start = jnp.sum(jnp.where(jnp.arange(experts) < first, sizes, 0))
        mine = jax.lax.dynamic_slice_in_dim(sizes, first, e_local)
        n = jax.lax.axis_size(e_axis)
        out = jnp.roll(compute(jnp.roll(rows, -start, axis=0), mine, rows.shape[0] // n),
                       start, axis=0)
    else:
        out = _exchanged(rows, choice[order], sizes, e_local, a2a_axis, ragged, compute)
    y = permute(out, inverse, order).reshape(b * l, k, d)  # (back in the choices' order)
    y = jnp.einsum("tkd,tk->td", y, gates.reshape(-1, k).astype(y.dtype)).reshape(b, l, d)
    for axis in (f_axis, None if a2a_axis else e_axis):
        if axis is not None:
            y = jax.lax.psum(y, axis)
    return y


@jax.custom_vjp
def permute(x, order, inverse):
    """The rows of `x` [n, ...] in `order` (a permutation of n; `inverse` its inverse): a
    gather, whose gradient is the gather by `inverse` (MaxText's sorted activations), not
    the scatter autodiff would make of it (on a GPU, a scatter of rows is slower than a
    gather)."""
    return x[order]


def _permute_forward(x, order, inverse):
    return x[order], (order, inverse)


def _permute_backward(residuals, g):
    order, inverse = residuals
    return g[inverse], None, None


permute.defvjp(_permute_forward, _permute_backward)


def _biases_by_row(sizes, m: int, f_axis):
    """``add(y, bias, output=False)``: `y` [m, n] (rows in consecutive groups of `sizes`, one
    per local expert) plus each row's expert's `bias` [experts, n]; rows past the groups
    keep 0. An `output` bias goes on one device of a split ``d_ff`` (`f_axis`) alone."""
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m)
    expert = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), sizes.shape[0] - 1)
    valid = (rows < ends[-1])[:, None]

    def add(y, bias, output=False):
        if output and f_axis is not None:
            valid_here = valid & (jax.lax.axis_index(f_axis) == 0)
        else:
            valid_here = valid
        return y + jnp.where(valid_here, bias[expert], 0).astype(y.dtype)

    return add


def _exchanged(rows, expert, sizes, e_local: int, axis: str, ragged: bool, compute):
    """The sorted `rows` [m, d] (of experts `expert` [m], `sizes` per expert) through the
    devices of their experts along `axis` and back."""
    m, d = rows.shape
    n = jax.lax.axis_size(axis)
    counts = sizes.reshape(n, e_local).sum(1)  # [n]: rows to each device
    offsets = jnp.cumsum(counts) - counts
    # What each device receives: [n sources, m, ...], source i's rows in block i
    received_counts = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)
    received_sizes = jax.lax.all_to_all(sizes.reshape(n, e_local), axis, 0, 0, tiled=True)
    if ragged:
        here = jax.lax.axis_index(axis)
        block_starts = jnp.arange(n) * m
        their_offsets = jax.lax.all_to_all(offsets, axis, 0, 0, tiled=True)
        inbox = ragged_all_to_all(rows, jnp.zeros((n * m, d), rows.dtype), offsets, counts,
                                  jnp.full((n,), here * m, jnp.int32), received_counts, axis)
    else:
        blocks = jnp.arange(m) - offsets[expert // e_local]  # a row's place in its block
        outbox = jnp.zeros((n, m, d), rows.dtype).at[expert // e_local, blocks].set(rows)
        with jax.named_scope(f"routed_rows_1_in_{n}"):  # (the planner's note of the padding)
            inbox = jax.lax.all_to_all(outbox, axis, 0, 0, tiled=True).reshape(n * m, d)
    # the received rows by local expert: block i holds source i's rows, sorted by expert
    local = jnp.concatenate([
        jnp.repeat(jnp.arange(e_local + 1), jnp.append(received_sizes[i], m - received_counts[i]),
                   total_repeat_length=m) for i in range(n)])
    order = jnp.argsort(local, stable=True)
    out = compute(inbox[order], received_sizes.sum(0), m)
    outbox = jnp.zeros_like(out).at[order].set(out)
    if ragged:
        return ragged_all_to_all(outbox, jnp.zeros((m, d), rows.dtype), block_starts,
                                 received_counts, their_offsets, counts, axis)
    with jax.named_scope(f"routed_rows_1_in_{n}"):
        back = jax.lax.all_to_all(outbox.reshape(n, m, d), axis, 0, 0, tiled=True)
    return back.at[expert // e_local, blocks].get(mode="fill", fill_value=0)  # (padding: 0)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                      recv_sizes, axis: str):
    """``jax.lax.ragged_all_to_all`` on a GPU or TPU; elsewhere (XLA:CPU has no such op: the
    tests of the ragged path) the same result by an all-to-all of padded blocks."""
    if jax.default_backend() in ("gpu", "tpu"):
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axis)
    m, n = operand.shape[0], input_offsets.shape[0]
    rows = jnp.arange(m)
    blocks = jax.vmap(lambda o, s: jnp.where(  # [n, m, ...]: what goes to each device
        (rows < s)[:, None], jnp.take(operand, o + rows, axis=0, mode="clip"), 0))(
            input_offsets, send_sizes)
    with jax.named_scope(f"routed_rows_1_in_{n}"):  # [n, m, d]: from each source
        got = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True)
    places = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # theirs for me
    target = places[:, None] + rows[None, :]
    target = jnp.where(rows[None, :] < recv_sizes[:, None], target, output.shape[0])
    return output.at[target.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")
