"""Grouped matmuls: rows sorted into consecutive groups, group i multiplied by its own weight
(the experts of a dropless mixture of experts, `mtrain.models.dropless`).

``grouped_matmul(x [m, k], w [groups, k, n], sizes [groups])`` is ``jax.lax.ragged_dot``:
rows ``sum(sizes[:i]) .. sum(sizes[:i+1])`` times ``w[i]``; rows past ``sum(sizes)`` give 0.
Three kernels compute it (`moe.grouped_kernel`, chosen like the attention kernel):

- ``'ragged_dot'``: XLA's own op. XLA:CPU expands it into one dense matmul against every
  group's weight with the other groups' rows masked out (``groups`` x the FLOPs: measured
  by `benchmarks/moe.py` and the plan's matmul count); XLA:TPU and XLA:GPU have their own
  lowerings. ``'auto'`` takes it on a GPU (where no other kernel is measured yet).
- ``'megablox'``: the Pallas TPU kernel of Megablox (`jax.experimental.pallas.ops.tpu
  .megablox`, MaxText's), with its own backward pass; ``'auto'`` on a TPU. Elsewhere it runs
  in Pallas's interpreter (tests), which is slow.
- ``'tiles'``: the same algorithm in XLA, ``'auto'`` on the CPU. Each group's rows are
  padded to a multiple of a tile of ``t`` rows, so that a tile belongs to one group; a loop
  over the tiles that hold rows (as many as the routing filled, not a static worst case)
  multiplies each by its group's weight. The backward pass is its own (`jax.custom_vjp`):
  the input's gradient by the same loop against the transposed weights, each weight's
  gradient summed over its tiles. The loop's trip count is known only at run time, so its
  name says how many tiles balanced routing fills (``balanced_trips_N``), which is what the
  planner counts (`mtrain.planning.hlo_cost`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

GROUPED_KERNELS = ("auto", "ragged_dot", "megablox", "tiles")


def default_kernel(backend: str | None = None) -> str:
    """The kernel of ``'auto'`` on `backend` (default: this process's)."""
    return {"tpu": "megablox", "gpu": "ragged_dot"}.get(backend or jax.default_backend(),
                                                        "tiles")


def grouped_matmul(x, w, sizes, kernel: str = "auto", balanced_rows: int | None = None):
    """``x`` [m, k] rows in consecutive groups of `sizes` [groups] (int32, summing to at most
    m) times ``w`` [groups, k, n] -> [m, n] (module doc). `balanced_rows`: how many rows
    the groups hold when the routing is balanced (default m; the planner's count)."""
    kernel = default_kernel() if kernel == "auto" else kernel
    sizes = sizes.astype(jnp.int32)
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    if kernel == "megablox":
        return _megablox(x, w, sizes)
    if kernel == "tiles":
        t = tile_rows(x.shape[0], w.shape[0])
        rows = x.shape[0] if balanced_rows is None else balanced_rows
        return _tiles(x, w, sizes, t, balanced_trips(rows, w.shape[0], t))
    raise ValueError(f"moe.grouped_kernel must be one of {GROUPED_KERNELS}, got {kernel!r}")


def tile_rows(m: int, groups: int) -> int:
    """The tile of the ``'tiles'`` kernel: 128 rows, fewer (a power of two, at least 8)
    where a balanced group holds fewer, so that padding stays below a tile per group."""
    t = 8
    while t < 128 and t * 2 <= max(m // groups, 1):
        t *= 2
    return t


def balanced_trips(rows: int, groups: int, t: int) -> int:
    """The tiles that `rows` spread evenly over `groups` fill."""
    per_group = -(-rows // groups)
    return groups * -(-per_group // t) if rows else 0


def _megablox(x, w, sizes):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = x.shape
    n = w.shape[2]
    pad = (-m) % 128  # the kernel's row tiles
    # Rows past the groups are left undefined by the kernel, and so are their gradients:
    # both masked, the gradient by the mask on the input.
    valid = (jnp.arange(m) < sizes.sum())[:, None]
    x = jnp.where(valid, x, 0)
    xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    tiling = tuple(min(128, s) for s in (m + pad, k, n))
    y = gmm(xp, w, sizes, preferred_element_type=x.dtype, tiling=tiling,
            interpret=jax.default_backend() != "tpu")[:m]
    return jnp.where(valid, y, 0).astype(x.dtype)


def _layout(sizes, m: int, t: int):
    """Where the tiles kernel puts each of `m` rows in its padded layout (past the padded
    rows for rows beyond the groups), the group of each tile, and the tiles in use."""
    groups = sizes.shape[0]
    padded = (sizes + t - 1) // t * t
    padded_end = jnp.cumsum(padded)
    end = jnp.cumsum(sizes)
    rows = jnp.arange(m)
    group = jnp.minimum(jnp.searchsorted(end, rows, side="right"), groups - 1)
    capacity = -(-(m + groups * (t - 1)) // t) * t
    place = jnp.where(rows < end[-1], padded_end[group] - padded[group] + rows
                      - (end[group] - sizes[group]), capacity)
    tiles = capacity // t
    tile_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(tiles) * t,
                                              side="right"), groups - 1)
    return place, tile_group, padded_end[-1] // t, capacity


def _loop(count, trips: int, body, init):
    with jax.named_scope(f"grouped_matmul_balanced_trips_{trips}"):
        return jax.lax.fori_loop(0, count, body, init)


def _multiply(xp, w, tile_group, count, t: int, trips: int, transpose: bool = False):
    """Each used tile of padded rows `xp` [capacity, k] times its group's weight."""
    n = w.shape[1] if transpose else w.shape[2]

    def body(i, out):
        rows = jax.lax.dynamic_slice_in_dim(xp, i * t, t)
        wi = w[tile_group[i]]
        y = rows @ (wi.T if transpose else wi)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), i * t, 0)

    return _loop(count, trips, body, jnp.zeros((xp.shape[0], n), xp.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiles(x, w, sizes, t: int, trips: int):
    place, tile_group, count, capacity = _layout(sizes, x.shape[0], t)
    xp = jnp.zeros((capacity, x.shape[1]), x.dtype).at[place].set(x, mode="drop")
    yp = _multiply(xp, w, tile_group, count, t, trips)
    return yp.at[place].get(mode="fill", fill_value=0)


def _tiles_forward(x, w, sizes, t, trips):
    return _tiles(x, w, sizes, t, trips), (x, w, sizes)


def _tiles_backward(t, trips, saved, dy):
    x, w, sizes = saved
    place, tile_group, count, capacity = _layout(sizes, x.shape[0], t)
    xp = jnp.zeros((capacity, x.shape[1]), x.dtype).at[place].set(x, mode="drop")
    dyp = jnp.zeros((capacity, dy.shape[1]), dy.dtype).at[place].set(dy, mode="drop")
    dx = _multiply(dyp, w, tile_group, count, t, trips, transpose=True)

    def weight_gradient(i, dw):
        rows = jax.lax.dynamic_slice_in_dim(xp, i * t, t)
        d_rows = jax.lax.dynamic_slice_in_dim(dyp, i * t, t)
        g = tile_group[i]
        return dw.at[g].add(jnp.matmul(rows.T, d_rows, preferred_element_type=jnp.float32))

    dw = _loop(count, trips, weight_gradient, jnp.zeros(w.shape, jnp.float32))
    return dx.at[place].get(mode="fill", fill_value=0), dw.astype(w.dtype), None


_tiles.defvjp(_tiles_forward, _tiles_backward)
