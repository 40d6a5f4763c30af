"""The frontier's attention on the flash kernels: DeepSeek-V3's latent attention (query/key
heads of 128 + 64, value heads of 128: the values zero-padded to 192 for a fused kernel) and
gpt-oss's attention with sinks (which no GPU kernel here takes: 'auto' runs einsum there).

Each candidate runs one attention layer (`LatentAttention`, `MultiHeadAttention`) over rows
packed with two examples, forward and backward, and is checked against the einsum path in
float32 from the same bfloat16 values: the output's and the input gradient's relative
errors (bfloat16 lands near 1e-2; a kernel that mixes segments near 1). Then it is timed in
bfloat16 (median of --repeats forward + backward).

    python benchmarks/frontier_attention.py [--batch 4 --length 2048]

On a CPU only einsum and splash (Pallas' interpreter) run, at small sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import attention, blocks, layers
from mtrain.models.latent_attention import LatentAttention, LatentConfig
from mtrain.models.transformer_config import TransformerConfig


def segments(batch: int, length: int) -> jax.Array:
    """Two packed examples a row, the second ending a little before the row's end."""
    ids = np.ones((batch, length), np.int32)
    ids[:, length // 3:] = 2
    ids[:, length - length // 16:] = 0
    return jnp.asarray(ids)


def positions_of(ids) -> jax.Array:
    starts = np.asarray(ids) != np.pad(np.asarray(ids), ((0, 0), (1, 0)))[:, :-1]
    pos = np.zeros(ids.shape, np.int32)
    for r in range(ids.shape[0]):
        p = 0
        for i in range(ids.shape[1]):
            p = 0 if starts[r, i] else p + 1
            pos[r, i] = p
    return jnp.asarray(pos)


def layer_of(c: TransformerConfig):
    rotary = blocks.rotary_frequencies(c)
    if c.latent_attention:
        return LatentAttention.of(c, rotary_frequencies=rotary)
    return layers.MultiHeadAttention.of(c, rotary_frequencies=rotary, window=0)


def loss_fn(c: TransformerConfig, params, x, ids, pos):
    mask = attention.AttentionMask.of_self(ids, causal=True)
    y = layer_of(c).apply({"params": params}, x, x, mask, True, None, pos)
    real = (ids > 0)[..., None]
    return jnp.sum(jnp.where(real, y.astype(jnp.float32), 0.0) ** 2) / real.sum(), y


def run(c: TransformerConfig, name: str, params, x, ids, pos, reference, repeats: int):
    """One candidate: errors against `reference` (output, input gradient; None: another
    model, timed alone), then timed."""
    grad = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(c, p, x, ids, pos), argnums=1,
                                      has_aux=True))
    try:
        (_, y), g = grad(params, x)
        jax.block_until_ready(g)
    except Exception as e:  # noqa: BLE001 (a kernel that cannot run is a row of the table)
        print(f"{name:44s} cannot run: {' '.join(str(e).split())[:120]}")
        return
    real = (ids > 0)[..., None]
    err = lambda a, b: "-" if b is None else "%.2e" % float(  # noqa: E731
        jnp.linalg.norm(jnp.where(real, a.astype(jnp.float32) - b, 0))
        / jnp.linalg.norm(jnp.where(real, b, 0)))
    out_err, grad_err = err(y, reference[0]), err(g, reference[1])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad(params, x))
        times.append(time.perf_counter() - start)
    print(f"{name:44s} {out_err:>10s} {grad_err:>10s} {1e3 * statistics.median(times):9.2f}")


def compare(base: TransformerConfig, candidates, batch: int, length: int, repeats: int):
    ids = segments(batch, length)
    pos = positions_of(ids)
    x = jax.random.normal(jax.random.key(1), (batch, length, base.d_model), jnp.float32)
    init = dataclasses.replace(base, attention="einsum", activation_dtype="float32")
    params = layer_of(init).init(jax.random.key(0), x[:, :8], x[:, :8],
                                 attention.AttentionMask.of_self(ids[:, :8], causal=True),
                                 True, None, pos[:, :8])["params"]
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    x16 = x.astype(jnp.bfloat16)
    f32 = jax.jit(jax.value_and_grad(lambda p, x: loss_fn(init, p, x, ids, pos), argnums=1,
                                     has_aux=True))
    (_, y), g = f32(params, x16.astype(jnp.float32))
    reference = (y, g)
    print(f"{'kernel':44s} {'out error':>10s} {'grad error':>10s} {'ms':>9s}")
    for name, settings in candidates:
        c = dataclasses.replace(base, activation_dtype="bfloat16", **settings)
        same = settings.get("attention_sinks", base.attention_sinks) == base.attention_sinks
        mine = params if same else {k: v for k, v in params.items() if k != "sinks"}
        run(c, name, mine, x16, ids, pos, reference if same else (None, None), repeats)


def main():
    gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4 if gpu else 1)
    p.add_argument("--length", type=int, default=2048 if gpu else 256)
    p.add_argument("--repeats", type=int, default=10 if gpu else 2)
    a = p.parse_args()
    flash = ["cudnn", "cudnn_segments", "triton"] if gpu else ["splash"]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; rows {a.batch} x "
          f"{a.length}, two packed examples each, forward + backward")

    heads = 16 if gpu else 4
    mla = TransformerConfig(
        vocab_size=128, d_model=2048 if gpu else 128, num_heads=heads, num_layers=1,
        position_encoding="rotary", latent_attention=True, attention_scale=192**-0.5,
        mla=LatentConfig(q_lora_rank=1536 if gpu else 64, kv_lora_rank=512 if gpu else 32,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         rope_interleaved=True))
    print(f"\nlatent attention: {heads} heads, q/k 128 + 64, v 128 (padded to 192 for a "
          f"fused kernel), kv_lora {mla.mla.kv_lora_rank}, q_lora {mla.mla.q_lora_rank}")
    compare(mla, [("einsum (bfloat16)", {"attention": "einsum"})] +
            [(f"flash {k!r}", {"attention": "flash", "flash_kernel": k}) for k in flash] +
            [("auto", {"attention": "auto"})], a.batch, a.length, a.repeats)
    picked = attention.uses_flash("auto", "auto", jax.default_backend(), jnp.bfloat16,
                                  mla.mla.head_width)
    print(f"'auto' runs {'flash' if picked else 'einsum'} for latent attention here")

    heads, kv = (64, 8) if gpu else (8, 2)
    sinks = TransformerConfig(
        vocab_size=128, d_model=2880 if gpu else 128, num_heads=heads, num_kv_heads=kv,
        d_kv=64 if gpu else 16, num_layers=1, position_encoding="rotary",
        attention_bias=True, attention_output_bias=True, attention_sinks=True,
        attention_scale=(64 if gpu else 16) ** -0.5)
    print(f"\ngpt-oss attention: {heads} query heads over {kv} key/value heads, full layer")
    no_sinks = [(f"flash {k!r}, no sinks (for scale)", {"attention": "flash",
                                                          "flash_kernel": k,
                                                          "attention_sinks": False})
                for k in flash[:1]]
    compare(sinks, [("einsum with sinks (what 'auto' runs on a GPU)", {"attention": "einsum"})]
            + ([("flash 'splash' with sinks", {"attention": "flash", "flash_kernel": "splash"})]
               if not gpu else []) + no_sinks, a.batch, a.length, a.repeats)


if __name__ == "__main__":
    main()
