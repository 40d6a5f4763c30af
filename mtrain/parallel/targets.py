"""The accelerators a plan is made for, and the peak FLOP/s of the device this runs on.

A `Target` is one accelerator as one JAX device sees it; `TARGETS` lists those `--target`
names, with their sources. `device_peak_flops` is the peak the training loop and the
benchmarks measure MFU against. A target's low-precision peaks (fp8, int8: dense, no
sparsity) are those its matrix units run faster than bf16; a format it has no such rate for
runs at its bf16 peak (`Target.peak_of`). `dcn_bandwidth` is what one device can send across
slices (TPU multislice) or nodes (GPUs over InfiniBand): the data-centre network that a plan
with ``--slices`` crosses (`mtrain.planning.slices`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

GiB = 2**30
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator, as one JAX device sees it. Throughputs are per device."""

    name: str
    device: str  # what one JAX device is on it
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    interconnect_bandwidth: float  # bytes/s one device can send to its peers
    # dense peaks of the low-precision formats (`transformer.quantization`) where they are
    # faster than bf16; 0: none (the format runs at `peak_flops`)
    fp8_flops: float = 0.0
    int8_flops: float = 0.0
    # bytes/s one device can send to other slices or nodes (the data-centre network: a
    # host's network bandwidth over its devices); 0: unknown (a plan over slices refuses)
    dcn_bandwidth: float = 0.0

    def peak_of(self, fmt: str) -> tuple[float, bool]:
        """(the peak FLOP/s of matmuls in `fmt` ('none', 'fp8' or 'int8'), whether the
        target has a rate of its own for it): without one, its bf16 peak."""
        own = {"fp8": self.fp8_flops, "int8": self.int8_flops}.get(fmt, 0.0)
        return (own, True) if own > self.peak_flops else (self.peak_flops, False)


TARGETS = {t.name: t for t in [
    # TPU v2 and v3: a JAX device is one TensorCore, half a chip. Per chip: v2 45 TFLOP/s,
    # 16 GiB HBM at 700 GB/s, 4 ICI links of 496 Gbit/s; v3 123 TFLOP/s, 32 GiB at 900 GB/s,
    # 4 links of 656 Gbit/s (Norrie et al., "The Design Process for Google's Training Chips:
    # TPUv2 and TPUv3", IEEE Micro 2021; cloud.google.com/tpu/docs/v3).
    # Between pods (DCN): no figure published; assumed a host's 100 Gbit/s over its 8 cores.
    Target("tpu-v2", "TensorCore (half a chip)", 22.5e12, 8 * GiB, 350 * GB, 4 * 62 * GB / 2,
           dcn_bandwidth=100e9 / 8 / 8),
    Target("tpu-v3", "TensorCore (half a chip)", 61.5e12, 16 * GiB, 450 * GB, 4 * 82 * GB / 2,
           dcn_bandwidth=100e9 / 8 / 8),
    # TPU v4, v5e, v5p: a JAX device is a chip. v4: 275 TFLOP/s, 32 GiB at 1200 GB/s, pod
    # all-reduce bandwidth 1.1 PB/s over 4096 chips (cloud.google.com/tpu/docs/v4). v5e: 197
    # TFLOP/s, 16 GB at 819 GB/s, ICI 1600 Gbit/s (docs/v5e). v5p: 459 TFLOP/s, 95 GB at
    # 2765 GB/s, ICI 4800 Gbit/s (docs/v5p). int8: v5e 393 TOPS (docs/v5e), v5p 918 (Google's
    # v5p announcement, 2023-12); v4's int8 runs at its bf16 rate (275), v2 and v3 have none;
    # no TPU here has an fp8 rate above its bf16 one (docs/v5p: fp8 459). Across slices
    # (multislice, the data-centre network): v5p 50 Gbit/s per chip (docs/v5p: "DCN
    # bandwidth per chip"); v5e 6.4 Tbit/s per 256-chip pod (docs/v5e), 25 Gbit/s a chip;
    # v4 publishes none: assumed v5p's 50 Gbit/s a chip (a host of 4 chips, 200 Gbit/s).
    Target("tpu-v4", "chip", 275e12, 32 * GiB, 1200 * GB, 1.1e15 / 4096,
           dcn_bandwidth=50e9 / 8),
    Target("tpu-v5e", "chip", 197e12, 16 * GiB, 819 * GB, 1600e9 / 8, int8_flops=393e12,
           dcn_bandwidth=6.4e12 / 256 / 8),
    Target("tpu-v5p", "chip", 459e12, 95 * GB, 2765 * GB, 4800e9 / 8, int8_flops=918e12,
           dcn_bandwidth=50e9 / 8),
    # NVIDIA H100 and H200 SXM: dense bf16 989 TFLOP/s; 80 GB HBM3 at 3.35 TB/s and 141 GB
    # HBM3e at 4.8 TB/s; NVLink 4 900 GB/s in both directions, 450 GB/s out (NVIDIA data
    # sheets). Across nodes: one InfiniBand NDR adapter (ConnectX-7, 400 Gbit/s) per GPU, as
    # DGX H100 and H200 systems have: 50 GB/s, 9x slower than NVLink (DGX H100 user guide).
    # fp8 and int8: 1979 T(FL)OP/s dense on both (the data sheets' 3958 is with sparsity).
    Target("h100", "GPU", 989e12, 80 * GB, 3350 * GB, 450 * GB, fp8_flops=1979e12,
           int8_flops=1979e12, dcn_bandwidth=400e9 / 8),
    Target("h200", "GPU", 989e12, 141 * GB, 4800 * GB, 450 * GB, fp8_flops=1979e12,
           int8_flops=1979e12, dcn_bandwidth=400e9 / 8),
]}

# jax's device_kind (lower case) -> the target whose peak it has.
_DEVICE_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"),
                 ("v5", "tpu-v5p"), ("v4", "tpu-v4"), ("v3", "tpu-v3"), ("v2", "tpu-v2"),
                 ("h100", "h100"), ("h200", "h200"))


def device_peak_flops(device=None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from): the table's bf16 peak for
    known TPUs and GPUs; on CPU a float32 matmul measured now, divided among the simulated
    devices that share the cores; (0, ...) for anything else."""
    device = device or jax.local_devices()[0]
    kind = device.device_kind.lower()
    for key, target in _DEVICE_KINDS:
        if key in kind:
            return TARGETS[target].peak_flops, f"{target} bf16 peak"
    if device.platform == "cpu":
        n = jax.local_device_count()
        return _cpu_matmul_flops(device) / n, (f"measured float32 matmul, shared by {n} CPU "
                                               f"device{'s' if n > 1 else ''}")
    return 0.0, f"no peak known for {device.device_kind}"


@functools.lru_cache(maxsize=None)  # once per device and process
def _cpu_matmul_flops(device, n: int = 1536, repeats: int = 4) -> float:
    import time

    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)
