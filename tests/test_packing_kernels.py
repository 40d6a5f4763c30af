"""On a GPU, flash attention 'auto' fits its kernel to each batch's packing (`base.packing_of`,
`attention.flash`): cuDNN's packed layout with a table of the fullest row's examples (from
Hopper on), the masked kernel beyond `AUTO_TABLE_LIMIT`, and for rows of one example from
their first position (`base.UNPACKED`) cuDNN's causal kernel with no mask
(`kernels.cudnn_causal`); and 'cudnn_segments' refuses a batch beyond its table.

cuDNN cannot run on a CPU: its calls are made with jax's XLA implementation
(`accelerators.on_a_gpu_emulated`), so that what mtrain passes (mask or none, table) is
what is checked. Tolerances as in test_flash_attention (float32; the same sums in another
order).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.models import attention, kernels
from mtrain.models.base import UNPACKED, packed_rows, packing_of
from mtrain.parallel.layout import Layout

import test_trainer
from accelerators import on_a_gpu_emulated
from test_flash_attention import assert_same, packed_ids, qkv


@pytest.mark.parametrize("window", [0, 5])
def test_unpacked_rows_run_cudnns_causal_kernel_with_no_mask(monkeypatch, window):
    """Rows of one example each, from their first position, padding after it (odd length,
    grouped key/value heads, with and without a sliding window): 'auto' causal
    self-attention makes one call, cuDNN's causal kernel given no mask, whose outputs at the
    real positions and whose gradients everywhere (the padding's cotangent being 0, as its
    loss weight is) are the reference's, alone and over a mesh. A bidirectional row's
    queries would see the padding: the encoder's attention runs the packed layout with a
    table of one instead (a bidirectional window, the masked kernel)."""
    calls = on_a_gpu_emulated(monkeypatch)
    monkeypatch.setattr(attention, "_compute_capability", lambda: 9.0)
    ids = packed_ids(4, 47, segments=1, seed=3)  # one example a row; rows 1 and 3 padded
    assert packing_of({"targets_segment_ids": np.asarray(ids)}) == UNPACKED
    assert (ids == 0).any()
    q, k, v = qkv(4, 47, 47, heads=4, seed=3)
    k, v = k[:, :, :2], v[:, :, :2]  # 2 key/value heads for 4 query heads
    for causal in (True, False):
        mask = attention.AttentionMask.of_self(ids, causal=causal).windowed(window)
        calls.clear()

        def auto(q, k, v):
            with packed_rows(UNPACKED):
                return attention.flash(q, k, v, mask)

        assert_same(auto, lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)
        # (a bidirectional window is not the packed layout's: the masked kernel)
        bidirectional = {"cudnn"} if window else {("cudnn_segments", (4, 2))}
        assert set(calls) == ({"cudnn_causal"} if causal else bidirectional)
    mask = attention.AttentionMask.of_self(ids, causal=True).windowed(window)
    layout = Layout("batch:4;model:2", "batch:batch;heads:model;kv_heads:model")
    calls.clear()
    with layout.activate(layout.make_mesh(jax.devices()[:8])), packed_rows(UNPACKED):
        assert_same(jax.jit(lambda q, k, v: attention.flash(q, k, v, mask)),
                    lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)
    assert set(calls) == {"cudnn_causal"}


def test_causal_rows_are_tiled_so_that_cuDNN_writes_every_position(monkeypatch):
    """Packed rows that start with padding, end with it or hold none, through 'auto' on a
    Hopper GPU (cuDNN emulated: a position in no entry of the table comes out NaN):
    causal self-attention takes the tiled table (`kernels.segment_layout`), of the batch's
    `packing_of` entries, and cuDNN writes every output and gradient, with no mask
    around it. Real positions are the reference's, gradients everywhere (the padding's
    cotangent 0)."""
    calls = on_a_gpu_emulated(monkeypatch)
    monkeypatch.setattr(attention, "_compute_capability", lambda: 9.0)
    ids = np.array(packed_ids(4, 64, segments=3, seed=5))  # 1-3 examples; odd rows padded
    ids[1:3, :5] = 0  # padding first in rows 1 and 2
    packing = packing_of({"targets_segment_ids": ids})
    assert packing == 4  # (row 2: 3 examples after padding)
    ids = jnp.asarray(ids)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    q, k, v = qkv(4, 64, 64, seed=5)

    def auto(q, k, v):
        with packed_rows(packing):
            return attention.flash(q, k, v, mask)

    out = auto(q, k, v)
    assert calls == [("cudnn_segments", (4, packing + 1))]
    assert not np.isnan(out).any()
    assert not any(np.isnan(g).any() for g in jax.grad(lambda *x: auto(*x).sum(),
                                                       argnums=(0, 1, 2))(q, k, v))
    assert_same(auto, lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)


def test_the_causal_kernel_refuses_what_it_cannot_compute(monkeypatch):
    q, k, v = qkv(2, 16, 16)
    ids = jnp.ones((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="needs a GPU"):
        kernels.cudnn_causal(q, k, v, ids, ids, True)
    on_a_gpu_emulated(monkeypatch)
    with pytest.raises(ValueError, match="is causal attention's"):
        kernels.cudnn_causal(q, k, v, ids, ids, False)


def test_a_batch_beyond_the_segment_table_is_refused(monkeypatch):
    """cudnn_segments' table holds `flash_max_segments` examples per row: a batch with a
    row of more is a one-line data error before any step (the kernel would give NaN)."""
    from mtrain.errors import DataError

    batch = test_trainer.packed_batches(1)[0]  # 3 examples in every row
    config = dataclasses.replace(test_trainer.CONFIG, dropout_rate=0.0,
                                 flash_kernel="cudnn_segments", flash_max_segments=1)
    # On the CPU, 'auto' attention is the einsum path: no table, nothing refused.
    test_trainer.make_trainer("", "", config=config).place_batch(batch)
    on_a_gpu_emulated(monkeypatch)
    monkeypatch.setattr(attention, "_compute_capability", lambda: 9.0)
    for table in (2, 3):
        config = dataclasses.replace(test_trainer.CONFIG, dropout_rate=0.0, d_kv=8,
                                     activation_dtype="bfloat16",
                                     flash_kernel="cudnn_segments", flash_max_segments=table)
        trainer = test_trainer.make_trainer("", "", config=config)
        if table == 2:
            with pytest.raises(DataError, match=r"takes 3 entries of cuDNN's segment table "
                                                r"\(targets_segment_ids.*flash_max_segments=2"):
                trainer.place_batch(batch)
        else:
            trainer.place_batch(batch)
    einsum = dataclasses.replace(config, attention="einsum", flash_max_segments=1)
    test_trainer.make_trainer("", "", config=einsum).place_batch(batch)  # no table used


def rows_of(n, length=64):
    """Segment ids [2, length] whose rows each hold `n` packed examples (0: only padding)."""
    ids = np.minimum(np.arange(length) // (length // max(n, 1)) + 1, n) if n else np.zeros(length)
    return np.tile(ids.astype(np.int32), (2, 1))


def test_packing_is_the_smallest_power_of_two_that_holds_the_fullest_row():
    tables = {n: packing_of({"targets_segment_ids": rows_of(n)}) for n in
              (0, 1, 2, 3, 4, 5, 17, 32, 33)}
    assert tables == {0: UNPACKED, 1: UNPACKED, 2: 2, 3: 4, 4: 4, 5: 8, 17: 32, 32: 32, 33: 64}
    # One example a row, but after padding: the padding takes an entry of the table too
    # (`kernels.segment_layout`, tiled; and a table of one, jax's padding mask, would start
    # the example at position 0).
    late = rows_of(1) * (np.arange(64) >= 3)
    assert packing_of({"targets_segment_ids": late}) == 2
    assert packing_of({"targets_segment_ids": np.concatenate([rows_of(1), late])}) == 2
    assert packing_of({"targets_segment_ids": np.concatenate([rows_of(1), rows_of(0)])}) == 0
    assert packing_of({"targets_segment_ids": np.concatenate([rows_of(3) * (
        np.arange(64) >= 3), rows_of(1)])}) == 4
    # Every feature's self-attention runs with the one table (an encoder's inputs too).
    assert packing_of({"inputs_segment_ids": rows_of(5), "targets_segment_ids": rows_of(2),
                       "targets": rows_of(40)}) == 8


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_auto_fits_the_segment_table_to_each_batch(monkeypatch):
    """On a Hopper GPU (cuDNN emulated), 'auto' attention runs cuDNN's packed layout with a
    table of each placed batch's packing, compiling each table once, the masked kernel
    beyond `AUTO_TABLE_LIMIT`, and cuDNN's causal kernel with no mask for rows of one
    example from their first position; a step's loss and gradient norm are the masked
    kernel's, from the same state. Tolerance: both sides run the model in bfloat16 (cuDNN's
    dtype), the emulated kernels by other XLA programs; a rounding of a few bfloat16 ulps
    (2**-8 relative) in some activations moves a mean over 128 tokens by far less than 1e-2
    of it (observed: ~1e-4 in the loss, ~1e-3 in the gradient norm)."""
    calls = on_a_gpu_emulated(monkeypatch)
    monkeypatch.setattr(attention, "_compute_capability", lambda: 9.0)
    config = dataclasses.replace(test_trainer.CONFIG, dropout_rate=0.0, d_kv=8,
                                 activation_dtype="bfloat16")
    auto = test_trainer.make_trainer("", "", config=config)
    masked = test_trainer.make_trainer(
        "", "", config=dataclasses.replace(config, flash_kernel="cudnn"))
    assert auto.uses_packing and not masked.uses_packing
    packed = test_trainer.packed_batches(1)[0]  # 3 examples in every row
    single = {**packed, "targets_segment_ids": (packed["targets_segment_ids"] > 0).astype(np.int32)}
    # one example a row, after two positions of padding: a causal kernel alone would let
    # its queries see the padding
    late = {**single, "targets_segment_ids": single["targets_segment_ids"] * (
        np.arange(test_trainer.L) >= 2)}

    def step(batch, expected_table, expected_calls):
        placed = auto.place_batch(batch)
        assert placed.packing == expected_table
        state = auto.init_state()
        calls.clear()
        _, metrics = auto.train_step(state, placed)
        assert set(calls) == expected_calls, calls  # what this call traced (none: cached)
        _, reference = masked.train_step(masked.init_state(), masked.place_batch(batch))
        for name in ("loss", "grad_norm"):
            np.testing.assert_allclose(metrics[name], reference[name], rtol=1e-2, err_msg=name)

    step(packed, 4, {("cudnn_segments", (test_trainer.B, 5))})
    step(single, UNPACKED, {"cudnn_causal"})  # no table, no mask
    step(late, 2, {("cudnn_segments", (test_trainer.B, 3))})  # (the padding: an entry)
    step(packed, 4, set())  # compiled once per table
    # Compiled ahead of time for a placed batch, as benchmarks/throughput.py runs its rows: the
    # program takes that batch (a program for another table would refuse its structure) and
    # computes what the jitted step does.
    placed = auto.place_batch(packed)
    _, ahead = auto.compile_train_step(placed)(auto.init_state(), placed)
    _, jitted = auto.train_step(auto.init_state(), placed)
    np.testing.assert_allclose(ahead["loss"], jitted["loss"], rtol=1e-6)
    monkeypatch.setattr(attention, "AUTO_TABLE_LIMIT", 2)
    auto = test_trainer.make_trainer("", "", config=config)  # (a step not yet compiled)
    step(packed, 4, {"cudnn"})  # more examples per row than 'auto' fits a table to
    # Where the packed layout is not taken, the 'auto' kernel stays the masked one.
    for why in ("capability", "processes", "dropout"):
        with monkeypatch.context() as m:
            if why == "capability":
                m.setattr(attention, "_compute_capability", lambda: 8.0)
            if why == "processes":
                m.setattr(jax, "process_count", lambda: 2)
            c = dataclasses.replace(config, dropout_rate=0.1 if why == "dropout" else 0.0)
            assert not attention.adapts_segment_table(c), why
    monkeypatch.undo()
    assert not attention.adapts_segment_table(config)  # on the CPU: einsum
