"""Grouped matmuls: rows sorted into consecutive groups, group i multiplied by its own weight
(the experts of a dropless mixture of experts, `mtrain.models.dropless`).

``grouped_matmul(x [m, k], w [groups, k, n], sizes [groups])`` is ``jax.lax.ragged_dot``:
rows ``sum(sizes[:i]) .. sum(sizes[:i+1])`` times ``w[i]``; rows past ``sum(sizes)`` give 0
(and get no gradient). Four kernels compute it (`moe.grouped_kernel`, chosen like the
attention kernel):

- ``'tokamax'``: ``tokamax.ragged_dot`` (`pip install 'mtrain[gpu]'`), with the
  implementation of `tokamax_implementations`: on a Hopper GPU with bfloat16 or float16
  operands its Mosaic GPU kernel (wgmma, with its own backward pass: on an H100 13x and 32x
  XLA's ``ragged_dot`` with 64 and 128 experts, 2.1x with Mixtral's 8: `SELECTION`);
  elsewhere its Triton kernel where that registers (it needs jax_triton, which mtrain[gpu]
  does not bring), else its reference, XLA's op with a float32 accumulator: what the CPU
  runs, so that the tests check the wiring the GPU runs through the same call. Rows past
  the groups are masked (a kernel need not write them: Megablox does not), in the input
  too, so that no gradient reaches them.
- ``'ragged_dot'``: XLA's own op. XLA:CPU expands it into one dense matmul against every
  group's weight with the other groups' rows masked out (``groups`` x the FLOPs: measured
  by `benchmarks/moe.py` and the plan's matmul count); XLA:GPU does the same unless cuDNN's
  ragged-dot fusion engages (cuDNN >= 9.22, bfloat16 output); XLA:TPU has its own lowering.
- ``'megablox'``: the Pallas TPU kernel of Megablox (`jax.experimental.pallas.ops.tpu
  .megablox`, MaxText's), with its own backward pass. Elsewhere it runs in Pallas's
  interpreter (tests), which is slow.
- ``'tiles'``: the same algorithm in XLA. Each group's rows are padded to a multiple of a
  tile of ``t`` rows, so that a tile belongs to one group; a loop over the tiles that hold
  rows (as many as the routing filled, not a static worst case) multiplies each by its
  group's weight. The backward pass is its own (`jax.custom_vjp`): the input's gradient by
  the same loop against the transposed weights, each weight's gradient summed over its
  tiles. The loop's trip count is known only at run time, so its name says how many tiles
  balanced routing fills (``balanced_trips_N``), which is what the planner counts
  (`mtrain.planning.hlo_cost`).

``'auto'`` takes the first row of `SELECTION` that matches the backend, the GPU's generation
(`gpu_generation`: from the compute capability, as tokamax dispatches) and the operands'
dtype; each row names the measurement it rests on. A TPU runs Megablox, a CPU the tiles;
a GPU never the tiles (a loop of small matmuls: 7x XLA's op for `moe_tiny` on an H100).
On a Hopper GPU bfloat16 experts run tokamax's Mosaic kernel. The fallback, float32
experts on any GPU and every GPU before or after Hopper, is XLA's ``ragged_dot``:

- float32: Mosaic takes bfloat16 or float16 alone; XLA's op is the fastest measured
  float32 kernel on an H100 (`moe_tiny` 2.4 ms against the tiles' 17.3; the 64-expert
  layer 57-58 ms either way); tokamax's Triton kernel would take float32 but does not
  register without jax_triton, and is unmeasured.
- Ampere, Blackwell: tokamax 0.0.17's Mosaic kernels for them (sm80, sm100) take only the
  default dimension numbers, so the weights' gradient (a ragged contraction) raises: they
  cannot train. XLA's op is correct everywhere and cuDNN's fusion speeds it where it
  engages; 'tokamax' (its Triton kernel where it registers) stays a setting to measure.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtrain.models.remat import KERNEL_OUTPUTS

GROUPED_KERNELS = ("auto", "ragged_dot", "megablox", "tiles", "tokamax")
TOKAMAX_MISSING = "moe.grouped_kernel='tokamax' needs tokamax: pip install 'mtrain[gpu]'"
HALF = ("bfloat16", "float16")  # the operand dtypes of tokamax's Mosaic GPU kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """A row of `SELECTION`: on `backend` (a GPU of `generation`, None: any) with operands of
    `dtypes` (names; None: any), ``'auto'`` runs `kernel` and ``'tokamax'`` tries
    `tokamax` (its implementations, in order: the first that registers and takes the call);
    `measured`: what the choice rests on."""

    backend: str | None
    generation: str | None
    dtypes: tuple[str, ...] | None
    kernel: str
    tokamax: tuple[str, ...]
    measured: str

    def matches(self, backend: str, generation: str | None, dtype: str) -> bool:
        return (self.backend in (None, backend) and self.generation in (None, generation)
                and (self.dtypes is None or dtype in self.dtypes))


# The first row that matches wins. The measurements: issue 61 (one H100 80GB, jax 0.11.2,
# 2026-11-26, and one H200, 2026-11-27; fwd+bwd TFLOP/s of [rows, k] x [groups, k, n]) and
# README's benchmarks/moe.py.
SELECTION = (
    Choice(backend="gpu", generation="hopper", dtypes=HALF, kernel="tokamax",
           tokamax=("mosaic", "triton", "xla"),
           measured="H200 bf16, 64 experts top-8, 4096 tokens, d 512, fwd+bwd: tokamax 1.9 ms "
                    "vs ragged_dot 24.7, tiles 63.8, one-hot 4.8 (1.5 at capacity 1.25); "
                    "H100 bf16: tokamax Mosaic against XLA ragged_dot, 105 vs 7.7 TFLOP/s at "
                    "[32768, 512] x [64, 512, 512], 201 vs 6.3 at [65536, 2048] x [128, 2048, "
                    "768] (Qwen3-MoE), 290 vs 139 at [16384, 4096] x [8, 4096, 14336] (Mixtral)"),
    Choice(backend="gpu", generation=None, dtypes=HALF, kernel="ragged_dot",
           tokamax=("triton", "xla"),
           measured="unmeasured off Hopper: tokamax 0.0.17's sm80/sm100 Mosaic kernels refuse "
                    "the weights' gradient (a ragged contraction); XLA's op runs everywhere"),
    Choice(backend="gpu", generation=None, dtypes=None, kernel="ragged_dot",
           tokamax=("triton", "xla"),
           measured="H100 float32 (Mosaic takes bf16/f16): moe_tiny step ragged_dot 2.4 ms vs "
                    "tiles 17.3; 64 experts top-8, 4096 tokens, d 512: 57-58 ms either"),
    Choice(backend="tpu", generation=None, dtypes=None, kernel="megablox",
           tokamax=("mosaic", "xla"),
           measured="unmeasured here: Megablox is MaxText's TPU kernel (its own backward); "
                    "tokamax's own order on a TPU"),
    Choice(backend=None, generation=None, dtypes=None, kernel="tiles", tokamax=("xla",),
           measured="2 CPU cores: moe_tiny step tiles 279 ms vs ragged_dot 538 (XLA:CPU: a "
                    "dense matmul per expert, 3.2x the FLOPs)"),
)


def gpu_generation(compute_capability) -> str | None:
    """The NVIDIA generation of a CUDA compute capability ("9.0", 9.0; None: not a GPU), as
    tokamax's kernels tell them apart: 'ampere' (8.x, Ada's 8.9 too), 'hopper' (9.x: H100,
    H200, GH200), 'blackwell' (10.x and later), 'older'."""
    if compute_capability is None:
        return None
    cc = float(compute_capability)
    return ("older" if cc < 8 else "ampere" if cc < 9 else "hopper" if cc < 10
            else "blackwell")


def choose(backend: str, generation: str | None, dtype) -> Choice:
    """The row of `SELECTION` for operands of `dtype` on `backend` (a GPU of `generation`)."""
    name = jnp.dtype(dtype).name
    return next(c for c in SELECTION if c.matches(backend, generation, name))


def tokamax_implementations(backend: str, generation: str | None, dtype) -> tuple[str, ...]:
    """What ``'tokamax'`` asks ``tokamax.ragged_dot`` for, in order (`SELECTION`)."""
    return choose(backend, generation, dtype).tokamax


def _here():
    """This process's backend and GPU generation."""
    return jax.default_backend(), gpu_generation(getattr(jax.devices()[0],
                                                         "compute_capability", None))


def tokamax_missing() -> bool:
    """Whether tokamax is not installed (it comes with ``pip install 'mtrain[gpu]'``)."""
    return importlib.util.find_spec("tokamax") is None


def default_kernel(backend: str | None = None, dtype=jnp.float32,
                   generation: str | None = None) -> str:
    """The kernel of ``'auto'`` on `backend` (default: this process's, and its GPU's
    generation) for operands of `dtype`: `SELECTION`'s, XLA's op where that is tokamax and
    tokamax is not installed."""
    if backend is None:
        backend, generation = _here()
    kernel = choose(backend, generation, dtype).kernel
    return "ragged_dot" if kernel == "tokamax" and tokamax_missing() else kernel


def grouped_matmul(x, w, sizes, kernel: str = "auto", balanced_rows: int | None = None):
    """``x`` [m, k] rows in consecutive groups of `sizes` [groups] (int32, summing to at most
    m) times ``w`` [groups, k, n] -> [m, n] (module doc). `balanced_rows`: how many rows
    the groups hold when the routing is balanced (default m; the planner's count).

    The output is named `KERNEL_OUTPUTS`: remat 'dots' keeps it (`mtrain.models.remat`),
    since every kernel's backward pass reads its inputs alone, and the forward kernel is
    not run again in the backward pass."""
    if kernel not in GROUPED_KERNELS:
        raise ValueError(f"moe.grouped_kernel must be one of {GROUPED_KERNELS}, got {kernel!r}")
    dtype = jnp.result_type(x, w)
    kernel = default_kernel(None, dtype) if kernel == "auto" else kernel
    sizes = sizes.astype(jnp.int32)
    if kernel == "ragged_dot":
        y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    elif kernel == "megablox":
        y = _megablox(x, w, sizes)
    elif kernel == "tokamax":
        y = _tokamax(x, w, sizes, tokamax_implementations(*_here(), dtype))
    else:
        t = tile_rows(x.shape[0], w.shape[0])
        rows = x.shape[0] if balanced_rows is None else balanced_rows
        y = _tiles(x, w, sizes, t, balanced_trips(rows, w.shape[0], t))
    return checkpoint_name(y, KERNEL_OUTPUTS)


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


def _tokamax(x, w, sizes, preferred: tuple[str, ...]):
    """``tokamax.ragged_dot`` with the first of the `preferred` implementations it has
    (tokamax tries the rest where one raises NotImplementedError), rows past the groups
    masked as Megablox's."""
    if tokamax_missing():
        raise ValueError(TOKAMAX_MISSING)
    import tokamax

    try:  # (tokamax has no public list; an unregistered name is an error, not a fallback)
        from tokamax._src.ops.ragged_dot.api import IMPLEMENTATIONS as registered
    except ImportError:
        registered = ("mosaic", "xla")  # (0.0.17's, Triton aside: it needs jax_triton)
    # ('mosaic' is registered as 'mosaic_gpu' and 'mosaic_tpu'; tokamax picks by device)
    usable = tuple(i for i in preferred if any(k.startswith(i) for k in registered))
    valid = (jnp.arange(x.shape[0]) < sizes.sum())[:, None]
    y = _tokamax_matmul(jnp.where(valid, x, 0), w, sizes,
                        usable[0] if len(usable) == 1 else usable)
    return jnp.where(valid, y, 0).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tokamax_matmul(x, w, sizes, implementation):
    """``tokamax.ragged_dot`` by `implementation`, with tokamax's own backward pass
    (`_tokamax_backward`) from the inputs alone. tokamax's op keeps its output among the
    residuals of a `custom_vjp` whose forward a checkpoint policy cannot see into (a
    ``custom_vmap``), so under remat its backward pass ran the forward kernel again for
    that output, which it does not read."""
    import tokamax

    return tokamax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype,
                              implementation=implementation)


def _tokamax_forward(x, w, sizes, implementation):
    return _tokamax_matmul(x, w, sizes, implementation), (x, w, sizes)


def _tokamax_backward(implementation, residuals, dy):
    """The gradients as tokamax's `ragged_dot` vjp makes them (``ragged_dot.base.vjp``), by
    the same implementation: the input's, ``dy`` [m, n] against each group's ``w`` [k, n]
    contracted on n (no transposed copy); the weights', ``x`` [m, k] and ``dy`` contracted
    on the ragged m, per group."""
    from tokamax._src.ops.ragged_dot import api  # (no public ragged_dot_general)

    x, w, sizes = residuals
    numbers = jax.lax.RaggedDotDimensionNumbers
    # (each cotangent's manual axes as tokamax gives them: its primal's, inside shard_map)
    manual = lambda a: jax.typeof(a).manual_axis_type.to_ct_mat()  # noqa: E731
    dx = api.ragged_dot_general(
        dy, w, sizes, numbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]),
        preferred_element_type=x.dtype, manual_axis_type=manual(x),
        implementation=implementation)
    dw = api.ragged_dot_general(
        x, dy, sizes, numbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[]),
        preferred_element_type=w.dtype, manual_axis_type=manual(w),
        implementation=implementation)
    return dx, dw, None


_tokamax_matmul.defvjp(_tokamax_forward, _tokamax_backward)


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
