"""What ``--mode=infer`` costs a decoder-only LM on a target, by roofline (``--mode=plan
--prompt_length=N``): the prompts' prefill, one parallel pass, then a decoding step per new
token, each at most the longer of its compute (FLOPs / peak) and its memory traffic (the
weights read once a step, and the cached keys and values read by a step; bytes / HBM
bandwidth). A step of a small batch reads every weight to compute a few tokens: decoding is
bound by memory, a prefill of a long prompt by compute.

Per device, as the layout splits the work: the FLOPs over all devices, the weights as the
plan stores them, the cache by the ways the rows (`batch`) and the key/value heads split.

Latent attention (``transformer.latent_attention``) caches a latent and a rotary key a
position, not keys and values per head, and a decoding step attends in its absorbed form
(`models.latent_attention`): its scores and weighted sums are over the latent (2 heads
(2 kv_lora + rope) FLOPs a cached position), its cache (kv_lora + rope) values a position
and layer; a prefill attends in the expanded form (2 heads (nope + rope + v)).
"""

from __future__ import annotations

import jax.numpy as jnp

from mtrain.models import counts
from mtrain.models.blocks import layer_window


def estimate(c, layout, target, batch: int, length: int, prompt_length: int,
             parameter_bytes: int) -> dict:
    """The figures of rows of `length` positions, `batch` of them, each a prompt of
    `prompt_length` tokens then new ones to the end of the row."""
    prompt = max(1, min(prompt_length, length - 1))
    new = length - prompt
    devices = layout.size
    a = jnp.dtype(c.dtype).itemsize
    matmul = counts.layer_parameters(c, c.num_layers, 0, active=True) + c.vocab_size * c.d_model
    kv_heads = c.num_kv_heads or c.num_heads
    h, qk, v = c.num_heads, c.d_kv, c.d_kv  # (a head's query/key and value widths)
    step_per_position = 4 * h * c.d_kv  # the attention FLOPs of a cached position
    cached = 2 * kv_heads * c.d_kv * a  # a position's bytes in one layer's cache, unsplit
    on_device = cached / layout.ways("batch") / layout.ways(
        "heads" if kv_heads == c.num_heads else "kv_heads")
    if getattr(c, "latent_attention", False):
        m = c.mla
        qk, v = m.qk_head_dim, m.v_head_dim
        step_per_position = 2 * h * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        cached = (m.kv_lora_rank + m.qk_rope_head_dim) * a
        on_device = (m.kv_lora_rank / layout.ways("kv_lora") + m.qk_rope_head_dim) * a \
            / layout.ways("batch")

    full_layers = sum(not layer_window(c, i) for i in range(c.num_layers))

    def attended(context: float) -> float:  # positions a query sees, summed over layers
        return sum(min(layer_window(c, i) or context, context) for i in range(c.num_layers))

    def step(context: float) -> float:  # one new token per row at `context` positions
        flops = batch * (2 * matmul + step_per_position * attended(context))
        cache = batch * on_device * attended(context)
        return max(flops / devices / target.peak_flops,
                   (parameter_bytes + cache) / target.hbm_bandwidth)

    prefill_flops = batch * prompt * (2 * matmul + 2 * h * (qk + v) * attended(prompt) / 2)
    prefill = max(prefill_flops / devices / target.peak_flops,
                  parameter_bytes / target.hbm_bandwidth)
    decode = step(prompt + new / 2)  # (the mean context of the new tokens)
    sampled = range(0, prompt, max(1, prompt // 64))  # (the prompt's steps, a sample of)
    loop = prompt * sum(step(t + 0.5) for t in sampled) / len(sampled)
    return {"prompt_length": prompt, "new_tokens": new, "batch_size": batch,
            "prefill_seconds": prefill, "decode_step_seconds": decode,
            "time_to_first_token": prefill + step(prompt),
            "token_loop_time_to_first_token": loop + step(prompt),
            "tokens_per_second": batch / decode,
            "total_seconds": prefill + new * decode,
            # what the cache grows by a token, all layers together (one row, unsplit: the
            # full layers', a sliding window's ring holds its window whatever the length),
            # and the same of multi-head attention with the same heads (every head's key
            # and value)
            "cache_bytes_per_token": cached * full_layers,
            "mha_cache_bytes_per_token": h * (qk + v) * a * full_layers}
