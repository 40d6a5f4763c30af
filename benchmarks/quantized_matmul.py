"""One Llama-style feed-forward layer in bf16 against fp8 (or int8): compile time, step time,
and which kernels the compiled program calls. The fast first look at low-precision matmuls
on a borrowed GPU, before a whole model's row (benchmarks/throughput.py) spends minutes on it.

The layer is `llama_1b`'s (configs/models/llama_1b.gin) SwiGLU feed-forward on one step's
tokens: x [tokens, d_model] through gate and up [d_model, d_ff], silu(gate) * up, down
[d_ff, d_model]; forward and backward (the gradients of x and of the three kernels), jitted.
Each variant multiplies through `mtrain.models.quantization.Quantization.einsum`, the op
every quantized projection of a model calls (qwix's quantized-training dot_general; with
delayed scaling flax's fp8 op, from the states one earlier step of these operands
recorded), or plain `jnp.einsum` in bf16 for the baseline. Per variant, printed as soon as measured:

- compile: seconds to lower and compile (a variant that takes minutes here takes minutes
  per distinct projection in a model's step);
- ms and TFLOP/s: the median of --steps runs after one;
- kernels: the compiled program's matmul calls by kind (``cublas`` and ``cublasLt f8`` custom
  calls, ``triton`` GEMM fusions, plain ``dot``s: on a GPU, an fp8 product that is not a
  ``cublasLt f8`` call or a Triton GEMM runs at no fp8 rate);
- max error: the output's largest difference from float32's, relative to its largest value.

Then the ratio of each variant's time to bf16's. A variant that fails says why in one line.

    python benchmarks/quantized_matmul.py                          # 32768 x 2048 -> 5504
    python benchmarks/quantized_matmul.py --tokens 512 --d_model 128 --d_ff 384   # CPU-sized
    python benchmarks/quantized_matmul.py --variants bf16,fp8,fp8-rowwise,fp8-delayed,int8
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp

from mtrain.models.quantization import Quantization, fresh_meta

VARIANTS = {"bf16": None, "fp8": Quantization(mode="fp8"),
            "fp8-rowwise": Quantization(mode="fp8", scaling="rowwise"),
            "fp8-delayed": Quantization(mode="fp8", scaling="delayed"),
            "int8": Quantization(mode="int8")}
# (a custom call's target or an op's pattern in the compiled HLO, what to call it)
KERNELS = (("cublas$lt$matmul$f8", "cublasLt f8"), ("cublas$lt$matmul", "cublasLt"),
           ("cublas$gemm", "cublas"), ("__cudnn$fusion", "cudnn fusion"),
           ("__triton_gemm", "triton"), (" dot(", "dot"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16 * 2048)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--d_ff", type=int, default=5504)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default="bf16,fp8,fp8-rowwise,fp8-delayed")
    return p.parse_args()


def forward(quantization, x, gate, up, down, metas=(None, None, None), dtype=jnp.bfloat16):
    """The feed-forward layer's output, its operands cast to `dtype` and its matmuls plain or
    through `quantization` (delayed scaling: each from its state in `metas`)."""
    def einsum(spec, a, b, meta):
        if quantization is None:
            return jnp.einsum(spec, a, b)
        return quantization.einsum(spec, a, b, meta=meta)

    x, gate, up, down = (a.astype(dtype) for a in (x, gate, up, down))
    h = jax.nn.silu(einsum("td,df->tf", x, gate, metas[0])) * einsum("td,df->tf", x, up,
                                                                      metas[1])
    return einsum("tf,fd->td", h, down, metas[2])


def recorded(quantization, x, weights):
    """Delayed scaling's states after one step of the layer on these operands (the
    gradient of a state is its new value): what a run's later steps quantize with."""
    fresh = tuple(fresh_meta((3, 1 + quantization.history)) for _ in range(3))
    return jax.jit(jax.grad(lambda m: forward(quantization, x, *weights, metas=m).astype(
        jnp.float32).sum()))(fresh)


def kernels(hlo: str) -> str:
    """The compiled program's matmul calls, counted by kind (`KERNELS`)."""
    counts = []
    for pattern, name in KERNELS:
        n = hlo.count(pattern)
        hlo = hlo.replace(pattern, "")  # (a longer target is not counted again as a shorter)
        if n:
            counts.append(f"{n} {name}")
    return ", ".join(counts) or "none found"


def main():
    args = parse_args()
    t, d, f = args.tokens, args.d_model, args.d_ff
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (t, d), jnp.float32)
    weights = [jax.random.normal(k, s, jnp.float32) / s[0] ** 0.5
               for k, s in zip(keys[1:], ((d, f), (d, f), (f, d)))]
    flops = 3 * 2 * t * 3 * d * f  # three matmuls, forward and two gradients each
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}: SwiGLU feed-forward, "
          f"{t} tokens, d_model {d}, d_ff {f}; forward + backward ({flops / 1e12:.3f} TFLOP)")
    print(f"{'variant':<12} {'compile s':>9} {'ms':>9} {'TFLOP/s':>8} {'max error':>10} "
          f"{'vs bf16':>8}  kernels", flush=True)

    exact = jax.jit(lambda *a: forward(None, *a, dtype=jnp.float32))(x, *weights)
    base = None
    for name in args.variants.split(","):
        try:
            quantization = VARIANTS[name]
            metas = (recorded(quantization, x, weights) if quantization and quantization.delayed
                     else (None, None, None))
            loss = lambda *a: forward(quantization, *a, metas=metas).astype(  # noqa: E731
                jnp.float32).sum()
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
            t0 = time.perf_counter()
            compiled = step.lower(x, *weights).compile()
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(compiled(x, *weights))
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(x, *weights))
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            y = jax.jit(lambda *a: forward(quantization, *a, metas=metas))(x, *weights)
            error = float(jnp.max(jnp.abs(y.astype(jnp.float32) - exact)) /
                          jnp.max(jnp.abs(exact)))
            base = base or ms
            print(f"{name:<12} {compile_s:>9.1f} {ms:>9.2f} {flops / ms / 1e9:>8.1f} "
                  f"{error:>10.2e} {base / ms:>7.2f}x  {kernels(compiled.as_text())}", flush=True)
        except Exception as e:  # a lowering this backend lacks, memory: say so, go on
            why = re.sub(r"\s+", " ", str(e)).strip()[:160]
            print(f"{name:<12} failed: {type(e).__name__}: {why}", flush=True)


if __name__ == "__main__":
    main()
