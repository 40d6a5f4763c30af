"""Cross-entropy, label smoothing, z-loss; Adafactor's Mesh-TF defaults and the schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrain.training import losses, optimizer


def test_cross_entropy_matches_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 3))
    weights = np.array([[1, 1, 0], [1, 0, 0]])
    loss, xent = losses.cross_entropy(logits, targets, weights)
    expected = -np.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(xent, expected * weights, rtol=1e-6)
    np.testing.assert_allclose(loss, xent)


def test_z_loss_adds_squared_log_partition():
    logits = jnp.array([[[1.0, 2.0, 3.0]]])
    _, xent = losses.cross_entropy(logits, jnp.array([[2]]), jnp.ones((1, 1)))
    loss, _ = losses.cross_entropy(logits, jnp.array([[2]]), jnp.ones((1, 1)), z_loss=0.1)
    log_z = jax.nn.logsumexp(logits)
    np.testing.assert_allclose(loss - xent, 0.1 * log_z**2, rtol=1e-6)


def test_label_smoothing_minimum_is_zero():
    vocab, eps = 5, 0.1
    # The smoothed target distribution itself is the optimum: loss 0 there, > 0 elsewhere.
    probs = np.full(vocab, eps / (vocab - 1))
    probs[3] = 1 - eps
    best, _ = losses.cross_entropy(np.log(probs)[None, None], np.array([[3]]), np.ones((1, 1)),
                                   label_smoothing=eps)
    worse, _ = losses.cross_entropy(np.zeros((1, 1, vocab)), np.array([[3]]), np.ones((1, 1)),
                                    label_smoothing=eps)
    assert abs(float(best[0, 0])) < 1e-5 and float(worse[0, 0]) > 0.1


@pytest.mark.parametrize("z_loss,smoothing,classes", [
    (0.0, 0.0, 0), (1e-4, 0.0, 0), (1e-2, 0.1, 0), (1e-2, 0.1, 12), (0.0, 0.0, 12)])
def test_written_out_gradient_is_autodiffs(z_loss, smoothing, classes):
    """cross_entropy's gradient (written out, one pass over the logits) is autodiff's of the
    textbook loss (log_softmax over the real classes only), for the loss and the
    cross-entropy at once (DPO differentiates the latter) and for the weights; in bfloat16
    it comes back in bfloat16."""
    rng = np.random.default_rng(0)
    vocab = 16
    logits = (rng.normal(size=(3, 8, vocab)) * 4).astype(np.float32)
    targets = rng.integers(0, classes or vocab, (3, 8)).astype(np.int32)
    weights = (rng.random((3, 8)) > 0.3).astype(np.float32)
    on_loss, on_xent = rng.normal(size=(2, 3, 8)).astype(np.float32)

    def reference(logits, weights):
        real = classes or vocab
        log_p = jax.nn.log_softmax(logits[..., :real])
        low = smoothing / (real - 1)
        soft = jax.nn.one_hot(targets, real) * (1 - smoothing - low) + low
        entropy = -(1 - smoothing) * np.log(1 - smoothing) - (real - 1) * low * np.log(
            low + 1e-20) if smoothing else 0.0
        xent = -jnp.take_along_axis(log_p, targets[..., None], -1)[..., 0]
        loss = -(soft * log_p).sum(-1) - entropy \
            + z_loss * jnp.square(jax.nn.logsumexp(logits[..., :real], -1))
        return (on_loss * loss * weights + on_xent * xent * weights).sum()

    def ours(logits, weights):
        loss, xent = losses.cross_entropy(logits, targets, weights, z_loss=z_loss,
                                          label_smoothing=smoothing, classes=classes)
        return (on_loss * loss + on_xent * xent).sum()

    (want, want_w), (got, got_w) = (jax.grad(f, (0, 1))(logits, weights)
                                    for f in (reference, ours))
    # The same sums in other orders: a few float32 roundings of each term, the largest of
    # which (softmax x the row's cotangent) is at most |on_loss| (1 + 2 z |log Z|) + |on_xent|;
    # the softmax itself off by the rounding of log(sum of exp) <= log(vocab) (autodiff's
    # log_softmax subtracts it, ours divides by the sum).
    log_z = np.abs(jax.nn.logsumexp(logits, -1)).max()
    scale = np.abs(on_loss).max() * (1 + 2 * z_loss * log_z) + np.abs(on_xent).max()
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=8 * 2.0**-24 * scale * (1 + np.log(vocab)))
    assert not np.asarray(got)[..., classes:].any() if classes else True
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
    # bfloat16 logits: the float32 gradient rounded once to bfloat16 (half an ulp, 2**-9).
    got16 = jax.grad(ours)(jnp.asarray(logits, jnp.bfloat16), weights)
    exact = jax.grad(ours)(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32), weights)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got16, np.float32), exact, rtol=2.0**-8, atol=1e-30)


def test_schedule_is_linear_warmup_rsqrt_decay_linear_decay():
    sched = optimizer.learning_rate_schedule(warmup_steps=100, train_steps=1000, linear_decay_steps=200)
    lr = lambda s: float(sched(s - 1))  # noqa: E731 (the schedule counts updates from 0)
    np.testing.assert_allclose(lr(50), 0.5 / 10, rtol=1e-6)  # warming up: (50/100) / sqrt(100)
    np.testing.assert_allclose(lr(100), 1 / 10, rtol=1e-6)
    np.testing.assert_allclose(lr(400), 1 / 20, rtol=1e-6)  # rsqrt decay
    np.testing.assert_allclose(lr(900), 1 / 30 * 0.5, rtol=1e-6)  # halfway through linear decay
    assert lr(1000) == 0.0


def test_adafactor_factors_large_matrices_only():
    params = {"big": jnp.ones((128, 256)), "small": jnp.ones((64, 256)), "vec": jnp.ones((256,))}
    state = optimizer.adafactor(0.01).init(params)[0]
    assert state.v_row["big"].shape == (128,) and state.v_col["big"].shape == (256,)
    assert state.v["small"].shape == (64, 256) and state.v["vec"].shape == (256,)


def test_adafactor_update_is_relative_and_clipped():
    # Parameter-scale updates: the step is proportional to the parameter's RMS (>= 1e-3), and
    # update clipping at RMS 1.0 bounds the first step to lr * RMS(param).
    tx = optimizer.adafactor(0.1)
    for scale in (1.0, 10.0):
        params = {"w": jnp.full((128, 128), scale)}
        grads = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(128, 128)) * 1e3, jnp.float32)}
        updates, _ = tx.update(grads, tx.init(params), params)
        rms = float(jnp.sqrt(jnp.mean(updates["w"] ** 2)))
        np.testing.assert_allclose(rms, 0.1 * scale, rtol=1e-3)


def test_split_vocab_loss_never_all_gathers_the_logits():
    """With vocab split over the mesh, loss and gradient need only all-reduces of
    [batch, length] values: the logits are never gathered whole onto a device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from mtrain.parallel.layout import Layout

    layout = Layout("batch:2;model:4", "batch:batch;vocab:model")
    mesh = layout.make_mesh()
    logits_sharding = layout.sharding(mesh, ("batch", "length", "vocab"), (8, 16, 512))
    ids_sharding = NamedSharding(mesh, PartitionSpec("batch", None))

    def loss(logits, targets):
        per_token, _ = losses.cross_entropy(logits, targets, targets > 0, z_loss=1e-4,
                                            label_smoothing=0.1)
        return per_token.sum()

    step = jax.jit(jax.value_and_grad(loss), in_shardings=(logits_sharding, ids_sharding))
    shapes = (jax.ShapeDtypeStruct((8, 16, 512), jnp.float32),
              jax.ShapeDtypeStruct((8, 16), jnp.int32))
    hlo = step.lower(*shapes).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 16, 512)).astype(np.float32)
    targets = rng.integers(0, 512, (8, 16)).astype(np.int32)
    value, grad = step(logits, targets)
    expected_value, expected_grad = jax.value_and_grad(loss)(logits, targets)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_chunked_loss_with_split_vocab_never_all_gathers():
    """The slice-at-a-time loss on a vocab-split mesh keeps the logits and the output kernel
    split: only [batch, length] and d_model-sized values are all-reduced."""
    from mtrain.parallel.layout import Layout

    layout = Layout("batch:2;model:4", "batch:batch;vocab:model")
    mesh = layout.make_mesh()
    shapes = {"hidden": ((8, 16, 32), ("batch", "length", "d_model")),
              "kernel": ((32, 512), ("d_model", "vocab")),
              "targets": ((8, 16), ("batch", "length"))}
    shardings = [layout.sharding(mesh, names, shape) for shape, names in shapes.values()]

    def loss(hidden, kernel, targets):
        with layout.activate(mesh):
            return losses.chunked_cross_entropy(hidden, kernel, targets, targets > 0, chunks=4,
                                                z_loss=1e-4, label_smoothing=0.1)[0]

    step = jax.jit(jax.value_and_grad(loss, (0, 1)), in_shardings=shardings)
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(8, 16, 32)).astype(np.float32)
    kernel = rng.normal(size=(32, 512)).astype(np.float32) * 0.1
    targets = rng.integers(0, 512, (8, 16)).astype(np.int32)
    assert "all-gather" not in step.lower(hidden, kernel, targets).compile().as_text()

    def whole(hidden, kernel, targets):
        per_token, _ = losses.cross_entropy(hidden @ kernel, targets, targets > 0, z_loss=1e-4,
                                            label_smoothing=0.1)
        return per_token.sum()

    (value, grads), (expected, expected_grads) = (
        step(hidden, kernel, targets), jax.value_and_grad(whole, (0, 1))(hidden, kernel, targets))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_cosine_schedule_is_warmup_then_cosine_to_the_final_fraction():
    schedule = optimizer.learning_rate_schedule(warmup_steps=10, train_steps=110, constant=3e-3,
                                                shape="cosine", final_fraction=0.1)
    for count in (0, 4, 9, 10, 35, 60, 85, 109, 150):
        s = count + 1  # the rate of the update that makes step s
        if s < 10:
            want = 3e-3 * s / 10
        else:
            p = min((s - 10) / 100, 1.0)
            want = 3e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))
        np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6, err_msg=f"{count}")
    np.testing.assert_allclose(float(schedule(59)), 3e-3 * 0.55, rtol=1e-6)  # half-way
    # decay_steps: the decay's horizon instead of train_steps
    fixed = optimizer.learning_rate_schedule(warmup_steps=10, train_steps=20, decay_steps=110,
                                             constant=3e-3, shape="cosine", final_fraction=0.1)
    np.testing.assert_allclose(float(fixed(59)), float(schedule(59)), rtol=1e-6)
    for bad in (dict(train_steps=10), dict(train_steps=None), dict(final_fraction=1.5),
                dict(shape="linear")):
        with pytest.raises(ValueError):
            optimizer.learning_rate_schedule(**{"warmup_steps": 10, "train_steps": 110,
                                                "shape": "cosine", **bad})


def test_adamw_first_update_is_optaxs_and_adams_closed_form():
    """The first Adam step is -lr * g / (|g| + eps) per element (bias-corrected moments of
    one gradient), plus decoupled weight decay -lr * wd * p on the weight, not the norm's
    scale; with gradients of global norm above clip_norm, g is scaled down to that norm
    first."""
    params = {"w": jnp.arange(6.0).reshape(2, 3) / 10 - 0.2, "scale": jnp.ones(3)}
    grads = {"w": jnp.array([[0.3, -0.2, 0.0], [1.0, 2.0, -0.5]]), "scale": jnp.array([0.1, 0.2, -0.3])}
    lr, wd = 1e-2, 0.1
    for clip in (None, 1.0):
        opt = optimizer.adamw(lr, weight_decay=wd, clip_norm=clip)
        updates, _ = opt.update(grads, opt.init(params), params)
        g = grads
        if clip:
            norm = np.sqrt(sum(float(jnp.sum(x**2)) for x in grads.values()))
            g = {k: v * clip / norm for k, v in grads.items()}
        for k in params:
            want = -lr * np.asarray(g[k]) / (np.abs(np.asarray(g[k])) + 1e-8)
            if k == "w":
                want = want - lr * wd * np.asarray(params[k])
            np.testing.assert_allclose(updates[k], want, rtol=1e-5, atol=1e-7, err_msg=f"{k} {clip}")
        if clip is None:
            reference = optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd,
                                    mask={"w": True, "scale": False})
            ref_updates, _ = reference.update(grads, reference.init(params), params)
            jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)


def test_weight_decay_follows_the_role_not_the_rank():
    """Norm scales and biases are not decayed, whatever their rank (a scanned stack's scales
    are [layers, d_model], a query bias [heads, d_kv], T5's relative_bias table, which
    Hugging Face's Trainer leaves out by its name); weights and tables are, embeddings
    included. The step shows it:
    a parameter with a zero gradient moves by -lr * wd * p exactly where it decays."""
    shapes = {
        "token_embedding": {"embedding": (16, 4)}, "softmax": (4, 16),
        "relative_bias": {"relative_bias": (8, 2)},
        "final_norm": {"scale": (4,)},
        "layers": {"attention_norm": {"scale": (2, 4)}, "mlp_norm": {"scale": (2, 4)},
                   "self_attention": {"q": (2, 4, 2, 2), "q_bias": (2, 2, 2),
                                      "k_bias": (2, 2, 2), "v_bias": (2, 2, 2),
                                      "q_norm": {"scale": (2, 2)}, "k_norm": {"scale": (2, 2)}},
                   "post_attention_norm": {"scale": (2, 4)},
                   "post_mlp_norm": {"scale": (2, 4)}, "mlp": {"wi_0": (2, 4, 8)}},
    }
    leaves = lambda tree: {jax.tree_util.keystr(p): x  # noqa: E731
                           for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    params = jax.tree.map(lambda s: jnp.full(s, 2.0), shapes, is_leaf=lambda x: isinstance(x, tuple))
    opt = optimizer.adamw(0.5, weight_decay=0.1, clip_norm=None)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)
    moved = {k: float(jnp.max(jnp.abs(u))) for k, u in leaves(updates).items()}
    kept = {k for k, m in moved.items() if m == 0}
    assert kept == {k for k in moved if k.endswith(("['scale']", "_bias']"))}, kept
    for k, m in moved.items():
        assert m == 0.0 or m == pytest.approx(0.5 * 0.1 * 2.0, rel=1e-6), (k, m)  # float32
    assert leaves(optimizer.decay_mask(params)) == {k: k not in kept for k in moved}
