"""The flash attention kernels compute what the einsum reference computes, on packed rows.

The Pallas kernels (splash: TPU; triton: GPU, tokamax's) run here in Pallas' interpret
mode, which executes the kernels' own code (blocking, online softmax, segment masking, and
splash's custom backward) with XLA on the CPU; tokamax's Triton backward cannot run there
(see `triton_interpreted`). cuDNN cannot run on a CPU at all: for it, what mtrain adds
(the mask it builds and the arguments it passes to `jax.nn.dot_product_attention`) is
checked by running the same call with jax's XLA implementation.

Tolerances: float32 throughout. The kernels sum the same products in another order (blocks
of keys, rescaled by a running maximum); with unit-scale inputs, d_kv 16 and at most 256
keys, each output and gradient element is a sum of a few hundred terms of size <= ~10, so
float32 reordering moves it by well under 1e-5 (the observed difference is ~1e-6).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.parallel.layout import Layout
from mtrain.models import attention, base, kernels
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig

import test_trainer
from accelerators import on_a_gpu_emulated, triton_interpreted

TOL = dict(rtol=1e-5, atol=1e-5)


def packed_ids(batch, length, segments, seed=0, padding=True):
    """Segment ids [batch, length]: row r holds 1 + r % segments examples (1-4), then some
    padding (0) on every other row."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, length), np.int32)
    for r in range(batch):
        n = 1 + r % segments
        end = length - (int(rng.integers(1, length // 4)) if padding and r % 2 else 0)
        cuts = sorted(rng.choice(np.arange(1, end), size=n - 1, replace=False)) if n > 1 else []
        for s, (a, b) in enumerate(zip([0, *cuts], [*cuts, end])):
            ids[r, a:b] = s + 1
    return jnp.asarray(ids)


def qkv(batch, length, memory_length, heads=2, d=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, d)) / d**0.25
    k = jax.random.normal(keys[1], (batch, memory_length, heads, d)) / d**0.25
    v = jax.random.normal(keys[2], (batch, memory_length, heads, d))
    return q, k, v


def outputs_and_grads(fn, q, k, v, real):
    """fn's output at real query positions and the gradients of a random projection of it."""
    cot = jax.random.normal(jax.random.key(9), q.shape[:3] + (v.shape[-1],)) * real[..., None, None]

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v) * cot)

    out = fn(q, k, v) * real[..., None, None]
    return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def assert_same(fn, ref, q, k, v, real):
    out, grads = outputs_and_grads(fn, q, k, v, real)
    ref_out, ref_grads = outputs_and_grads(ref, q, k, v, real)
    np.testing.assert_allclose(out, ref_out, **TOL)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, **TOL, err_msg=f"d{name}")


@pytest.fixture
def on(monkeypatch):
    """on(kernel): where `kernel` runs here (the Triton one through `triton_interpreted`)."""
    def backend_of(kernel):
        if kernel == "triton":
            triton_interpreted(monkeypatch)
        return kernel
    return backend_of


@pytest.mark.parametrize("kernel", ["splash", "triton"])
@pytest.mark.parametrize("length", [  # 2 blocks; ragged, padded (128: the tests below)
    pytest.param(256, marks=pytest.mark.slow), 40])
def test_self_attention_kernels_match_the_reference(on, kernel, length):
    kernel = on(kernel)
    ids = packed_ids(4, length, segments=4)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    q, k, v = qkv(4, length, length)
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, kernel),
                lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)


@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_non_causal_self_attention_matches_the_reference(on, kernel):  # the encoder's
    kernel = on(kernel)
    ids = packed_ids(4, 128, segments=3, seed=1)
    mask = attention.AttentionMask.of_self(ids, causal=False)
    q, k, v = qkv(4, 128, 128, seed=1)
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, kernel),
                lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, ids > 0)


@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_cross_attention_matches_the_reference(on, kernel):
    """Encoder-decoder attention: other lengths, other segment ids, padding on both sides,
    and a row of targets longer than its inputs (padded queries with no padded key)."""
    kernel = on(kernel)
    targets, inputs = packed_ids(4, 128, 3, seed=2), packed_ids(4, 256, 3, seed=3)
    inputs = inputs.at[0].set(jnp.where(targets[0, :1] > 0, jnp.maximum(inputs[0], 1), 0))
    mask = attention.AttentionMask(targets, inputs)
    q, k, v = qkv(4, 128, 256, seed=2)
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, kernel),
                lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, targets > 0)


@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_segments_are_honoured(on, kernel):
    """Two examples packed in one row: what the second computes must not depend on the
    first. A kernel that ignored segment ids (attended across the packed examples, as one
    path of a reference implementation was found to do) fails here."""
    kernel = on(kernel)
    ids = jnp.asarray(np.repeat([[1] * 64 + [2] * 64], 2, axis=0), jnp.int32)
    q, k, v = qkv(2, 128, 128, seed=4)
    packed = attention.flash(q, k, v, attention.AttentionMask.of_self(ids, causal=True), kernel)
    # The second example alone, at the start of its own row.
    alone = attention.flash(*(jnp.roll(x, -64, axis=1) for x in (q, k, v)),
                            attention.AttentionMask.of_self(ids, causal=True), kernel)
    np.testing.assert_allclose(packed[:, 64:], alone[:, :64], **TOL)
    # And across segments it would indeed differ: plain causal attention over the row.
    unsegmented = attention.reference(q, k, v, attention.AttentionMask.of_self(ids * 0 + 1,
                                                                               causal=True))
    assert np.abs(packed[:, 64:] - unsegmented[:, 64:]).max() > 0.1


@pytest.mark.parametrize("kernel", ["splash", "triton", "cudnn", "cudnn_segments"])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_windows_and_a_scale_match_the_reference(on, monkeypatch, kernel, causal):
    """Each kernel's own local window (splash's LocalMask, cuDNN's sliding window; the
    Triton kernel's and a bidirectional cuDNN window in the packed mask) and its logits'
    scale give the reference's attention; which does differ from the unwindowed one."""
    if kernel.startswith("cudnn"):
        on_a_gpu_emulated(monkeypatch)
    else:
        kernel = on(kernel)
    ids = packed_ids(4, 128, segments=3, seed=5)
    mask = attention.AttentionMask.of_self(ids, causal=causal).windowed(8)
    q, k, v = qkv(4, 128, 128, seed=5)
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, kernel, scale=0.7),
                lambda q, k, v: attention.reference(q, k, v, mask, scale=0.7), q, k, v, ids > 0)
    full = attention.reference(q, k, v, mask.windowed(0), scale=0.7)
    windowed = attention.reference(q, k, v, mask, scale=0.7)
    assert np.abs((full - windowed)[ids > 0]).max() > 0.1


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_cudnn_call_is_the_packed_mask(monkeypatch):
    """The cuDNN kernel needs a GPU; mtrain's part of it (the mask and the call of
    `jax.nn.dot_product_attention`) runs here through jax's XLA implementation."""
    calls = []
    original = jax.nn.dot_product_attention

    def on_xla(*args, implementation=None, **kwargs):
        calls.append((implementation, kwargs["mask"].shape, str(kwargs["mask"].dtype)))
        return original(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_xla)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.default_kernel() == "cudnn"
    targets, inputs = packed_ids(4, 64, 3, seed=5), packed_ids(4, 96, 2, seed=6)
    # (as many input as target segments per row: no real query sees nothing, where the
    # padding to even lengths would change what such a query averages over)
    odd, odd_inputs = packed_ids(4, 63, 3, seed=7), packed_ids(4, 95, 3, seed=8)
    for mask, real in [(attention.AttentionMask.of_self(targets, causal=True), targets),
                       (attention.AttentionMask(targets, inputs), targets),
                       # odd lengths are padded to even ones (cuDNN's bias needs them)
                       (attention.AttentionMask.of_self(odd, causal=True), odd),
                       (attention.AttentionMask(odd, odd_inputs), odd)]:
        q, k, v = qkv(4, real.shape[1], mask.memory.shape[1], seed=mask.memory.shape[1])
        assert_same(lambda q, k, v: attention.flash(q, k, v, mask),
                    lambda q, k, v: attention.reference(q, k, v, mask), q, k, v, real > 0)
    assert {c[0] for c in calls} == {"cudnn"}
    # (the odd lengths arrive padded: 63 x 63 and 63 x 95 as 64 x 64 and 64 x 96)
    assert {(c[1], c[2]) for c in calls} == {((4, 1, 64, 64), "bool"), ((4, 1, 64, 96), "bool")}


def test_segment_layout():
    """cuDNN's table of a packed row: each segment's length and start, -1 after the last."""
    ids = jnp.asarray([[1, 1, 2, 2, 2, 0], [1] * 6, [0] * 6, [3, 4, 4, 5, 0, 0]], jnp.int32)
    lengths, offsets, most = kernels.segment_layout(ids, 3)
    np.testing.assert_array_equal(lengths, [[2, 3, -1], [6, -1, -1], [-1, -1, -1], [1, 2, 1]])
    np.testing.assert_array_equal(offsets, [[0, 2, -1, -1], [0, -1, -1, -1], [-1] * 4,
                                            [0, 1, 3, -1]])
    assert int(most) == 3
    assert int(kernels.segment_layout(ids, 2)[2]) == 3  # more than the table holds
    # Tiled (causal): each example runs on over the padding after it, a row that starts
    # with padding has that run as an entry, and a row of padding alone is one entry.
    ids = jnp.concatenate([ids, jnp.asarray([[0, 0, 1, 1, 0, 0]], jnp.int32)])
    lengths, offsets, most = kernels.segment_layout(ids, 3, tiled=True)
    np.testing.assert_array_equal(lengths, [[2, 4, -1], [6, -1, -1], [6, -1, -1], [1, 2, 3],
                                            [2, 4, -1]])
    np.testing.assert_array_equal(offsets, [[0, 2, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1],
                                            [0, 1, 3, -1], [0, 2, -1, -1]])
    assert int(most) == 3
    np.testing.assert_array_equal(base.table_entries(np.asarray(ids)), [2, 1, 1, 3, 2])


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_segments_matches_the_reference(monkeypatch, causal):
    """mtrain's use of cuDNN's packed layout (the table, the zeroed padding), with the kernel
    emulated as documented: equal to the reference on real positions, no NaN from the
    positions cuDNN leaves unwritten, forward or backward; NaN where a row holds more
    segments than the table."""
    calls = on_a_gpu_emulated(monkeypatch)
    ids = packed_ids(4, 64, segments=4, seed=11)  # 1-4 segments and padding
    mask = attention.AttentionMask.of_self(ids, causal=causal)
    q, k, v = qkv(4, 64, 64, seed=11)
    ref = lambda q, k, v: attention.reference(q, k, v, mask)  # noqa: E731
    assert_same(lambda q, k, v: attention.flash(q, k, v, mask, "cudnn_segments"), ref,
                q, k, v, ids > 0)
    assert ("cudnn_segments", (4, attention.CUDNN_MAX_SEGMENTS + 1)) in calls
    # A table of 2 segments per row, with rows of up to 4 (row r holds 1 + r). Causal: the
    # tiled table covers every position of rows 0 and 1 (each example runs on over its
    # padding: the emulation leaves no NaN), and cuDNN writes nothing past it, which is why
    # `check_batch` refuses such a batch first. Bidirectional: never a wrong number, NaN.
    out = kernels.cudnn_segments(q, k, v, ids, ids, causal, max_segments=2)
    if causal:
        assert not np.isnan(out[:2]).any()
        np.testing.assert_allclose(out[:2] * (ids[:2] > 0)[..., None, None],
                                   ref(q, k, v)[:2] * (ids[:2] > 0)[..., None, None], **TOL)
        # (rows 2 and 3: from their third example on, the padding after it too)
        past = np.cumsum(base.segment_starts(np.asarray(ids[2:])), axis=1) > 2
        assert np.isnan(out[2:][past]).all() and not np.isnan(out[2:][~past]).any()
    else:
        assert np.isnan(out[ids > 0]).all() and not np.isnan(out[ids == 0]).any()
    # And over the mesh: each shard of the batch builds its own table.
    layout = Layout("batch:4;model:2", "batch:batch;heads:model")
    with layout.activate(layout.make_mesh(jax.devices()[:8])):
        assert_same(jax.jit(lambda q, k, v: attention.flash(q, k, v, mask, "cudnn_segments")),
                    ref, q, k, v, ids > 0)


def test_cudnn_segments_honours_segments(monkeypatch):
    on_a_gpu_emulated(monkeypatch)
    ids = jnp.asarray(np.repeat([[1] * 32 + [2] * 32], 2, axis=0), jnp.int32)
    q, k, v = qkv(2, 64, 64, seed=4)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    packed = attention.flash(q, k, v, mask, "cudnn_segments")
    alone = attention.flash(*(jnp.roll(x, -32, axis=1) for x in (q, k, v)), mask, "cudnn_segments")
    np.testing.assert_allclose(packed[:, 32:], alone[:, :32], **TOL)
    unsegmented = attention.reference(q, k, v, attention.AttentionMask.of_self(ids * 0 + 1, True))
    assert np.abs(packed[:, 32:] - unsegmented[:, 32:]).max() > 0.1


def test_kernel_choice_and_errors(monkeypatch):
    ids = packed_ids(2, 128, 2)
    q, k, v = qkv(2, 128, 128)
    for kernel in kernels.GPU_KERNELS:
        with pytest.raises(ValueError, match=f"flash_kernel='{kernel}' needs a GPU"):
            attention.flash(q, k, v, attention.AttentionMask.of_self(ids, True), kernel)
        with pytest.raises(ValueError, match=f"flash_kernel='{kernel}' needs a GPU"):
            TransformerConfig(attention="flash", flash_kernel=kernel)
    # On a GPU without tokamax, triton is a one-line configuration error.
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        m.setattr(attention, "_tokamax_missing", lambda: True)
        with pytest.raises(ValueError, match=r"flash_kernel='triton' needs tokamax: "
                                             r"pip install 'mtrain\[gpu\]'"):
            TransformerConfig(attention="flash", flash_kernel="triton")
    with pytest.raises(ValueError, match="attention='flash' has no attention dropout"):
        TransformerConfig(attention="flash", dropout_rate=0.1)
    with pytest.raises(ValueError, match="flash_kernel must be one of"):
        TransformerConfig(flash_kernel="fast")
    assert attention.default_kernel() == "splash"  # on this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert attention.default_kernel() == "splash"


FLASH = dataclasses.replace(test_trainer.CONFIG, dropout_rate=0.0, attention="flash")
EINSUM = dataclasses.replace(FLASH, attention="einsum")


def _losses(config, mesh_shape, rules, model=DecoderLM, steps=3):
    trainer = test_trainer.make_trainer(mesh_shape, rules, config)
    if model is not DecoderLM:
        trainer = trainer.__class__(model=model(config), optimizer=trainer.optimizer,
                                    layout=trainer.layout, mesh=trainer.mesh,
                                    batch_size=trainer.batch_shape[0],
                                    sequence_length=trainer.batch_shape[1], seed=3)
    state, losses = trainer.init_state(), []
    for batch in test_trainer.packed_batches(steps):
        if model is not DecoderLM:  # the same packing for the inputs
            batch |= {k.replace("targets", "inputs"): v for k, v in batch.items()}
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def einsum_losses():
    return _losses(EINSUM, "", "")


@pytest.mark.parametrize("mesh_shape,rules", [  # (batch:8 alone went: the last splits it too)
    pytest.param("model:8", test_trainer.SPLIT_MODEL, marks=pytest.mark.slow),
    ("batch:4;model:2", "batch:batch;" + test_trainer.SPLIT_MODEL),
])
def test_flash_trains_like_einsum_on_the_mesh(einsum_losses, mesh_shape, rules):
    """Tolerance: that of the layout-invariance tests (test_trainer), which compare the
    same training under other summation orders."""
    np.testing.assert_allclose(_losses(FLASH, mesh_shape, rules), einsum_losses, rtol=1e-5)


@pytest.mark.slow
def test_flash_encoder_decoder_trains_like_einsum():
    layout = ("batch:4;model:2", "batch:batch;" + test_trainer.SPLIT_MODEL)
    np.testing.assert_allclose(_losses(FLASH, *layout, model=EncoderDecoder),
                               _losses(EINSUM, "", "", model=EncoderDecoder), rtol=1e-5)


def test_auto_chooses_flash_off_the_cpu_where_its_kernel_runs(monkeypatch):
    from mtrain.models import layers

    bf16 = jnp.bfloat16
    mha = layers.MultiHeadAttention(2, 16, dtype=bf16, implementation="auto")
    assert mha._path(True) == "einsum"  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert mha._path(True) == "flash"
    assert mha._path(True, single_query=True) == "einsum"  # a decoding step
    dropping = layers.MultiHeadAttention(2, 16, dropout_rate=0.1, dtype=bf16,
                                         implementation="auto")
    assert dropping._path(False) == "einsum"  # training with attention dropout
    assert dropping._path(True) == "flash"  # evaluation
    # cuDNN (the GPU's kernel) takes bfloat16 or float16, and heads of a multiple of 8 up to
    # 128 (256 from Hopper on): else 'auto' is einsum there, and 'flash' a one-line error.
    for dtype, d_kv in [(jnp.float32, 16), (bf16, 12), (bf16, 512)]:
        mha = layers.MultiHeadAttention(2, d_kv, dtype=dtype, implementation="auto")
        assert mha._path(True) == "einsum"
    assert layers.MultiHeadAttention(2, 16, dtype=jnp.float32, implementation="auto",
                                     flash_kernel="triton")._path(True) == "flash"
    with pytest.raises(ValueError, match="cuDNN's flash attention takes bfloat16 or float16 "
                                         "activations, not float32"):
        TransformerConfig(attention="flash")
    TransformerConfig(attention="flash", activation_dtype="bfloat16")
    TransformerConfig(attention="flash", flash_kernel="triton")
    # Splash (TPU) takes float32.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert layers.MultiHeadAttention(2, 16, implementation="auto")._path(True) == "flash"
    TransformerConfig(attention="flash")


def test_layout_unused_when_nothing_splits_batch_or_heads():
    """A layout that splits neither batch nor heads runs the kernel unsharded."""
    layout = Layout("model:8", "d_ff:model")
    ids = packed_ids(2, 128, 2)
    q, k, v = qkv(2, 128, 128)
    mask = attention.AttentionMask.of_self(ids, causal=True)
    with layout.activate(layout.make_mesh(jax.devices()[:8])):
        out = jax.jit(lambda q, k, v: attention.flash(q, k, v, mask))(q, k, v)
    np.testing.assert_allclose(out * (ids > 0)[..., None, None],
                               attention.reference(q, k, v, mask) * (ids > 0)[..., None, None],
                               **TOL)


@pytest.mark.slow  # (flash in the fast tier: the kernels and meshes above; SGP: test_sgp)
def test_flash_inside_sgp_replicas():
    """SGP runs each replica's step in a shard_map manual over the data axis; the kernel's
    own shard_map then splits the remaining axes."""
    import test_sgp
    from mtrain.training.sgp import SGPTrainer

    losses = {}
    for name in ("einsum", "flash"):
        config = dataclasses.replace(test_sgp.CONFIG, attention=name)
        t = test_sgp.trainer("batch:4;model:2")
        t = t.__class__(model=DecoderLM(config), optimizer=t.optimizer, layout=t.layout,
                        mesh=t.mesh, batch_size=t.batch_shape[0], sequence_length=t.batch_shape[1])
        sgp = SGPTrainer(t)
        state, losses[name] = sgp.init_state(t.init_state()), []
        for i in range(2):
            state, metrics = sgp.train_step(state, t.place_batch(test_sgp.batch(i)))
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["flash"], losses["einsum"], rtol=1e-5)
