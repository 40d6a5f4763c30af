"""The plain `jax.jit` + optax train step that benchmarks/throughput.py and dense_step.py
measure mtrain against: the reference decoder-only LM written as pure functions over a dict
of arrays (no Flax, no mtrain model code), its loss with z-loss, `optax.adafactor` with
Mesh-TF's settings, and the random batches both steps take. With `fast` (the GPU baseline,
rows of one example each): bfloat16 compute from float32 parameters, cuDNN's `is_causal`
flash attention and each layer under `jax.checkpoint` keeping its matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

NEG_INF = -1e9
Z_LOSS = 1e-4


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale


def dropout(x, rate, key):
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def plain_logits(params, batch, rate, key, fast=False):
    """The decoder-only LM: packed targets [b, l] -> next-token logits [b, l, vocab].

    `fast` (the GPU baseline; rows must hold one example each): bfloat16 compute from the
    float32 parameters, `jax.nn.dot_product_attention(is_causal=True)` (cuDNN flash attention
    on a GPU, XLA elsewhere) and each layer under `jax.checkpoint` keeping its matmuls."""
    targets, seg, pos = batch["targets"], batch["targets_segment_ids"], batch["targets_positions"]
    layer_names = sorted(k for k in params if k.startswith("layer_"))
    n_keys = 4 * len(layer_names) + 2
    keys = iter(jax.random.split(key, n_keys) if rate else [None] * n_keys)
    if fast:
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    # Shift right; every packed segment starts again from token 0.
    prev_seg = jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1]
    inputs = jnp.where(seg == prev_seg, jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1], 0)
    x = jnp.take(params["token_embedding"]["embedding"], inputs, axis=0)
    x = x + jnp.take(params["position_embedding"], pos, axis=0)
    x = dropout(x, rate, next(keys))
    length = targets.shape[1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    mask = (causal[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]  # [b, 1, l, m]
    def block(x, p, layer_keys):
        layer_keys = iter(layer_keys)
        a = p["self_attention"]
        y = rms_norm(x, p["attention_norm"]["scale"])
        q = jnp.einsum("bld,dhk->blhk", y, a["q"])  # no 1/sqrt(d_kv): folded into q's init
        k = jnp.einsum("bmd,dhk->bmhk", y, a["k"])
        v = jnp.einsum("bmd,dhk->bmhk", y, a["v"])
        if fast:
            gpu = jax.default_backend() == "gpu"
            out = jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True,
                                               implementation="cudnn" if gpu else "xla")
        else:
            logits = jnp.where(mask, jnp.einsum("blhk,bmhk->bhlm", q, k), NEG_INF)
            w = dropout(jax.nn.softmax(logits, axis=-1), rate, next(layer_keys))
            out = jnp.einsum("bhlm,bmhk->blhk", w, v)
        y = jnp.einsum("blhk,hkd->bld", out, a["o"])
        x = x + dropout(y, rate, next(layer_keys))
        m = p["mlp"]
        y = rms_norm(x, p["mlp_norm"]["scale"])
        h = dropout(jax.nn.relu(jnp.einsum("bld,df->blf", y, m["wi"])), rate, next(layer_keys))
        return x + dropout(jnp.einsum("blf,fd->bld", h, m["wo"]), rate, next(layer_keys))

    if fast:
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.checkpoint_dots)
    for name in layer_names:
        x = block(x, params[name], [next(keys) for _ in range(4)])
    x = dropout(rms_norm(x, params["final_norm"]["scale"]), rate, next(keys))
    return jnp.einsum("bld,dv->blv", x, params["softmax"])


def plain_loss(params, batch, rate, key, fast=False):
    """Mean over real tokens of cross-entropy + z_loss * log(Z)^2, in float32."""
    logits = plain_logits(params, batch, rate, key, fast).astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    weights = (batch["targets_segment_ids"] > 0).astype(jnp.float32)
    loss = (log_z - target_logit + Z_LOSS * jnp.square(log_z)) * weights
    return loss.sum() / jnp.maximum(weights.sum(), 1.0)


def plain_optimizer(warmup_steps):
    """optax Adafactor with Mesh-TF's settings and linear warmup * rsqrt decay."""

    def schedule(count):
        s = count.astype(jnp.float32) + 1.0
        return jnp.minimum(1.0, s / warmup_steps) * jnp.sqrt(1.0 / jnp.maximum(s, warmup_steps))

    return optax.adafactor(
        learning_rate=schedule, min_dim_size_to_factor=128, decay_rate=0.8,
        multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None,
        factored=True, eps=1e-30,
    )


def make_plain_step(opt, rate, seed, fast=False):
    key = jax.random.key(seed)

    def step(state, batch):
        params, opt_state, count = state
        loss, grads = jax.value_and_grad(plain_loss)(params, batch, rate,
                                                     jax.random.fold_in(key, count), fast)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, count + 1), loss

    return jax.jit(step, donate_argnums=0)

def packed_batch(batch_size, length, vocab, seed=0):
    """Random tokens, 2-3 packed segments per row (positions restart), a little padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch_size, length), np.int32)
    pos = np.zeros((batch_size, length), np.int32)
    for r in range(batch_size):
        cuts = sorted(rng.choice(np.arange(8, length - 8), size=2, replace=False))
        bounds = [0, *cuts, length - int(rng.integers(0, 4))]
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[r, a:b], pos[r, a:b] = s + 1, np.arange(b - a)
    tokens = rng.integers(1, vocab, (batch_size, length)).astype(np.int32) * (seg > 0)
    return {"targets": tokens, "targets_segment_ids": seg, "targets_positions": pos}


def unpacked_batch(batch_size, length, vocab, seed=0):
    """Random tokens, one example filling each row (what `is_causal` attention can take)."""
    rng = np.random.default_rng(seed)
    return {"targets": rng.integers(1, vocab, (batch_size, length)).astype(np.int32),
            "targets_segment_ids": np.ones((batch_size, length), np.int32),
            "targets_positions": np.tile(np.arange(length, dtype=np.int32), (batch_size, 1))}
