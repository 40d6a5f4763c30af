"""Generation with and without prefill: time to first token and tokens/s.

A Llama-style decoder (SwiGLU, rotary, grouped-query attention; d_model --d_model, --layers
layers, float32, random weights) continues --batch prompts of 128 and of 1,024 tokens (rows
of prompt + --new positions) by `decoding.sample`, greedy, as `--mode=infer` does: the
baseline feeds the prompt a token a step through the decoding loop (mtrain before prefill),
the other reads it in one pass into the cache (`DecoderLM.prefill`), then both decode a
token a step. Time to first token: a call that makes one new token; tokens/s: the batch's
--new new tokens over the time of the call that makes them, its prompts' reading included
(what a user of `--mode=infer` waits for). Each time is
the median of --repeats jitted calls after a warm-up; both paths' tokens are checked equal.

    python benchmarks/generation.py [--d_model 512] [--layers 4] [--batch 4] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.evaluation.decoding import sample
from mtrain.evaluation.translation import empty_cache
from mtrain.models.transformer import DecoderLM, TransformerConfig


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", default="128,1024")
    return p.parse_args()


def median_seconds(fn, repeats: int):
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def main():
    args = parse_args()
    d = args.d_model
    print(f"backend {jax.default_backend()}: d_model {d}, {args.layers} layers, batch "
          f"{args.batch}, greedy, float32")
    print(f"{'prompt':>7s} {'path':>12s} {'first token s':>14s} {'tokens/s':>9s} "
          f"{'first token: loop/prefill':>27s} {'tokens/s: prefill/loop':>23s}")
    for prompt in (int(p) for p in args.prompts.split(",")):
        length = prompt + args.new
        config = TransformerConfig(
            vocab_size=8192, d_model=d, d_ff=int(d * 2.6875) // 64 * 64, num_heads=d // 64,
            num_kv_heads=max(1, d // 256), d_kv=64, num_layers=args.layers, max_length=length,
            mlp_activations=("silu", "linear"), position_encoding="rotary")
        model = DecoderLM(config)
        ids = jnp.ones((1, length), jnp.int32)
        params = {"params": model.init(jax.random.key(1), ids, ids, jnp.arange(length)[None])[
            "params"]}
        rng = np.random.default_rng(0)
        prompts = np.zeros((args.batch, length), np.int32)
        prompts[:, :prompt] = rng.integers(2, 8192, (args.batch, prompt))
        prompts = jnp.asarray(prompts)
        lengths = jnp.full((args.batch,), prompt, jnp.int32)
        cache = empty_cache(model, (), args.batch, length)

        def step(ids, cache):
            logits, v = model.apply({**params, "cache": cache}, ids, method=model.decode_step,
                                    mutable=["cache"])
            return logits, v["cache"]

        def prefill(ids, counts, cache):
            return model.apply({**params, "cache": cache}, ids, counts, method=model.prefill,
                               mutable=["cache"])[1]["cache"]

        results = {}
        for name, fill in (("token loop", None), ("prefill", prefill)):
            calls = {new: jax.jit(lambda new=new, fill=fill: sample(
                step, cache, prompts, new, None, eos_id=-1, prompt_lengths=lengths,
                prefill=fill, prefill_length=prompt if fill else None))
                for new in (1, args.new)}
            first, t_first = median_seconds(calls[1], args.repeats)
            out, t_all = median_seconds(calls[args.new], args.repeats)
            rate = args.batch * args.new / t_all
            results[name] = (np.asarray(out), t_first, rate)
        (loop, t_loop, r_loop), (once, t_once, r_once) = results.values()
        assert np.array_equal(loop, once), "prefill changed the tokens"
        for name, (_, t, r) in results.items():
            print(f"{prompt:7d} {name:>12s} {t:14.3f} {r:9.1f}")
        print(f"{prompt:7d} {'ratio':>12s} {'':14s} {'':9s} {t_loop / t_once:27.2f} "
              f"{r_once / r_loop:23.2f}")


if __name__ == "__main__":
    main()
