"""The grouped-matmul kernels of `mtrain/models/grouped.py` a GPU runs, checked here through
the same calls: ``'tokamax'`` (``tokamax.ragged_dot``, on the CPU with tokamax's 'xla'
implementation, its reference) against a per-group reference in float32 and bfloat16
(values and both gradients, an empty group, rows past the groups); the one table
(`grouped.SELECTION`) that ``'auto'`` reads, with the GPU branch's choices forced by
backend, generation and dtype; `moe_tiny` trained with ``'tokamax'`` as with ``'tiles'``,
on one device and with the experts split over the devices that hold the tokens.

Tolerances are error bounds derived from the dtypes, not tuned: each output element is a
sum of r products computed with a float32 accumulator (tokamax's reference accumulates in
float32 whatever the operands, as the Mosaic kernel does) and rounded once to the output's
dtype, so against the exact sum of the same (rounded) operands it errs by at most
u_out |exact| + r u_f32 sum|products| (u: half the dtype's machine epsilon; r u bounds a
float32 sum of r terms in any order, to first order). The train runs compare two float32
computations that sum in other orders: test_dropless's 1e-5 relative on the losses.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import grouped

SIZES = [13, 0, 22, 1]  # an empty group; 4 rows past the groups (40 rows)


def _per_group(x, w, dy, sizes):
    """y = grouped x w and its gradients for cotangent `dy`, a dense matmul per group."""
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tokamax_kernel_equals_the_per_group_reference_within_its_dtypes_bound(dtype):
    rng = np.random.default_rng(0)
    m, k, n = 40, 6, 5
    x, w, dy = (jnp.asarray(rng.normal(size=s), dtype) for s in ((m, k), (4, k, n), (m, n)))
    y, vjp = jax.jit(lambda x, w: jax.vjp(
        lambda x, w: grouped.grouped_matmul(x, w, jnp.asarray(SIZES), "tokamax"), x, w))(x, w)
    dx, dw = vjp(dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    exact = [np.asarray(a, np.float64) for a in (x, w, dy)]  # the rounded operands, exactly
    reference = _per_group(*exact, SIZES)
    magnitude = _per_group(*(np.abs(a) for a in exact), SIZES)  # sum |products|
    u_out, u_f32 = jnp.finfo(dtype).eps / 2, jnp.finfo(jnp.float32).eps / 2
    for name, ours, ref, mag, r in zip(("y", "dx", "dw"), (y, dx, dw), reference, magnitude,
                                       (k, n, max(SIZES))):
        error = np.abs(np.asarray(ours, np.float64) - ref)
        bound = u_out * np.abs(ref) + r * u_f32 * mag
        assert np.all(error <= bound), (name, float(np.max(error - bound)))
    assert not np.any(np.asarray(y[36:])) and not np.any(np.asarray(dx[36:]))  # past: 0
    assert not np.any(np.asarray(dw[1]))  # the empty group's weight: no gradient


def test_auto_on_a_hopper_gpu_asks_for_mosaic_and_masks_the_rows_it_leaves_unwritten(
        monkeypatch):
    """This process taken for an H100: 'auto' in bfloat16 calls ``tokamax.ragged_dot``
    asking for Mosaic first; a stand-in kernel that, as Mosaic, leaves the rows past the
    groups unwritten (NaN here) in its output and in the input's gradient: they come out 0,
    the rest as the reference implementation's."""
    import tokamax

    real, asked = tokamax.ragged_dot, []
    sizes = jnp.asarray(SIZES)
    past = (jnp.arange(40) >= sum(SIZES))[:, None]

    def reference(x, w):
        return real(x, w, sizes, preferred_element_type=x.dtype, implementation="xla")

    @jax.custom_vjp
    def unwritten(x, w):
        return jnp.where(past, jnp.nan, reference(x, w)).astype(x.dtype)

    def backward(saved, dy):
        dx, dw = jax.vjp(reference, *saved)[1](dy)
        return jnp.where(past, jnp.nan, dx).astype(dx.dtype), dw

    unwritten.defvjp(lambda x, w: (unwritten(x, w), (x, w)), backward)

    def mosaic_like(x, w, group_sizes, *, preferred_element_type, implementation):
        asked.append(implementation)
        assert group_sizes is sizes or np.array_equal(group_sizes, sizes)
        return unwritten(x, w).astype(preferred_element_type)

    monkeypatch.setattr(tokamax, "ragged_dot", mosaic_like)
    monkeypatch.setattr(grouped, "_here", lambda: ("gpu", grouped.gpu_generation("9.0")))
    rng = np.random.default_rng(1)
    x, w, dy = (jnp.asarray(rng.normal(size=s), jnp.bfloat16)
                for s in ((40, 6), (4, 6, 5), (40, 5)))
    y, vjp = jax.vjp(lambda x, w: grouped.grouped_matmul(x, w, sizes), x, w)
    dx, dw = vjp(dy)
    assert asked and asked[0][0] == "mosaic" and asked[0][-1] == "xla"  # (Triton, if there)
    y_ref, vjp_ref = jax.vjp(reference, x, w)
    for ours, theirs in zip((y, dx, dw), (y_ref, *vjp_ref(dy))):
        np.testing.assert_array_equal(np.asarray(ours, np.float32),
                                      np.asarray(theirs, np.float32))
    assert not np.any(np.asarray(y[36:])) and not np.any(np.asarray(dx[36:]))


def test_auto_chooses_by_backend_dtype_and_gpu_generation_from_one_table():
    """H100 and H200 (compute capability 9.0) in bfloat16 or float16: tokamax's Mosaic
    kernel; float32 there, and every other GPU: XLA's ragged_dot ('tokamax' there: Triton
    where it registers, else XLA's); never the tiles on a GPU; TPU Megablox; CPU tiles."""
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    hopper = grouped.gpu_generation("9.0")
    assert hopper == "hopper" == grouped.gpu_generation(9.0)
    assert [grouped.gpu_generation(cc) for cc in (7.0, 8.0, 8.9, 10.0, 12.0, None)] == [
        "older", "ampere", "ampere", "blackwell", "blackwell", None]
    for dtype in (bf16, f16):
        assert grouped.default_kernel("gpu", dtype, hopper) == "tokamax"
        assert grouped.tokamax_implementations("gpu", hopper, dtype)[0] == "mosaic"
    assert grouped.default_kernel("gpu", f32, hopper) == "ragged_dot"
    for generation in ("older", "ampere", "blackwell", None):
        for dtype in (bf16, f16, f32):
            assert grouped.default_kernel("gpu", dtype, generation) == "ragged_dot"
    for generation in (hopper, "ampere", "blackwell"):  # Mosaic takes bf16 / f16, on Hopper
        assert grouped.tokamax_implementations("gpu", generation, f32) == ("triton", "xla")
    assert grouped.tokamax_implementations("gpu", "ampere", bf16) == ("triton", "xla")
    for dtype in (bf16, f32):
        assert grouped.default_kernel("tpu", dtype) == "megablox"
        assert grouped.default_kernel("cpu", dtype) == "tiles"
        assert grouped.tokamax_implementations("cpu", None, dtype) == ("xla",)
    assert grouped.default_kernel() == "tiles"  # this process's (a CPU)
    assert grouped.default_kernel("gpu") == "ragged_dot"  # (float32, generation unknown)
    for row in grouped.SELECTION:  # each a kernel, with its measurement; tokamax's reference
        assert row.kernel in grouped.GROUPED_KERNELS[1:] and row.measured  # last: always there
        assert row.tokamax[-1] == "xla"
        assert row.backend != "gpu" or row.kernel != "tiles"
    assert grouped.choose("some new backend", None, f32) is grouped.SELECTION[-1]


def testtokamax_missing_auto_falls_back_and_the_setting_says_what_to_install(monkeypatch):
    monkeypatch.setattr(grouped, "tokamax_missing", lambda: True)
    assert grouped.default_kernel("gpu", jnp.bfloat16, "hopper") == "ragged_dot"
    with pytest.raises(ValueError, match=r"^moe.grouped_kernel='tokamax' needs tokamax: pip "):
        grouped.grouped_matmul(jnp.ones((8, 2)), jnp.ones((2, 2, 3)), jnp.asarray([4, 4]),
                               "tokamax")
    from mtrain.models.moe import MoEConfig  # (and so, before anything is traced)

    with pytest.raises(ValueError, match=r"^moe.grouped_kernel='tokamax' needs tokamax: pip "):
        MoEConfig(grouped_kernel="tokamax")


def test_a_bad_kernel_is_one_line_naming_every_kernel():
    from mtrain.models.moe import MoEConfig

    for make in (lambda: MoEConfig(grouped_kernel="nope"),
                 lambda: grouped.grouped_matmul(jnp.ones((8, 2)), jnp.ones((2, 2, 3)),
                                                jnp.asarray([4, 4]), "nope")):
        with pytest.raises(ValueError) as error:
            make()
        message = str(error.value)
        assert "\n" not in message and "moe.grouped_kernel" in message and "'nope'" in message
        assert all(repr(kernel) in message for kernel in grouped.GROUPED_KERNELS)
    assert "tokamax" in grouped.GROUPED_KERNELS


@pytest.mark.slow  # (about 20 s: two trainers; the fast tier checks the kernel itself)
def test_moe_tiny_trains_with_tokamax_as_with_tiles_on_one_device_and_experts_split():
    """Dropless `moe_tiny` (4 layers, experts in 2), 3 steps: the same losses with
    'tokamax' as with 'tiles' on one device, and with the experts over `batch` (the
    all-to-all: each device's received rows end in rows past its groups)."""
    from test_dropless import moe_tiny_losses

    runs = [((kernel, mesh_shape), {"grouped_kernel": kernel}, mesh_shape, rules, "")
            for kernel, mesh_shape, rules in (("tiles", "", ""), ("tokamax", "", ""),
                                              ("tokamax", "batch:8", "batch:batch;experts:batch"))]
    losses = {key: run for key, (run, _) in
              moe_tiny_losses(["moe.dispatch='dropless'"], runs).items()}
    first = losses["tiles", ""]
    assert len(set(first)) == 3  # (the steps change the model)
    for key, run in losses.items():
        np.testing.assert_allclose(run, first, rtol=1e-5, err_msg=str(key))
