"""Proves a run fits before the hardware is rented (``--mode=plan``).

XLA compiles the real train step ahead of time for a mesh of any size of virtual CPU
devices, from abstract shapes only: no parameter is allocated. From the compiled program a
`Plan` reads

- per-device bytes of parameters and optimizer state (from their shardings: exact), and
  XLA's temporary memory (its buffer assignment: activations kept for the backward pass,
  gradients, scratch);
- FLOPs per device (XLA's cost analysis, and the matmuls of the HLO counted per loop
  iteration, which the cost analysis is not) beside the analytic count (6 x matmul
  parameters x tokens + attention);
- every collective the SPMD partitioner inserted, by kind, with the bytes each device
  sends per step, a loop's collectives once per iteration (ring algorithms: an all-reduce
  of B bytes over g devices sends 2 B (g-1)/g, an all-gather or all-to-all producing B
  sends B (g-1)/g, a reduce-scatter producing B sends B (g-1), a collective-permute sends
  B);
- a roofline step time for a `Target` accelerator: compute (FLOPs / peak) and memory traffic
  (each argument and output moved once, each temporary written and read once, over HBM
  bandwidth) overlap; collectives (bytes sent / interconnect bandwidth) do not.

The program is compiled by XLA:CPU, so it is the program a TPU or GPU would run up to the
backend's own fusion and scheduling choices: memory and time are estimates, good for
ranking layouts and catching what cannot fit, not for quoting to three digits.
`auto_layout` compiles every legal mesh and layout for a number of devices and ranks those
that fit by estimated step time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtrain import step_model
from mtrain.layout import Layout, LayoutError
from mtrain.models.transformer import TransformerConfig
from mtrain.trainer import Trainer

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


TARGETS = {t.name: t for t in [
    # TPU v2 and v3: a JAX device is one TensorCore, half a chip. Per chip: v2 45 TFLOP/s,
    # 16 GiB HBM at 700 GB/s, 4 ICI links of 496 Gbit/s; v3 123 TFLOP/s, 32 GiB at 900 GB/s,
    # 4 links of 656 Gbit/s (Norrie et al., "The Design Process for Google's Training Chips:
    # TPUv2 and TPUv3", IEEE Micro 2021; cloud.google.com/tpu/docs/v3).
    Target("tpu-v2", "TensorCore (half a chip)", 22.5e12, 8 * GiB, 350 * GB, 4 * 62 * GB / 2),
    Target("tpu-v3", "TensorCore (half a chip)", 61.5e12, 16 * GiB, 450 * GB, 4 * 82 * GB / 2),
    # TPU v4, v5e, v5p: a JAX device is a chip. v4: 275 TFLOP/s, 32 GiB at 1200 GB/s, pod
    # all-reduce bandwidth 1.1 PB/s over 4096 chips (cloud.google.com/tpu/docs/v4). v5e: 197
    # TFLOP/s, 16 GB at 819 GB/s, ICI 1600 Gbit/s (docs/v5e). v5p: 459 TFLOP/s, 95 GB at
    # 2765 GB/s, ICI 4800 Gbit/s (docs/v5p).
    Target("tpu-v4", "chip", 275e12, 32 * GiB, 1200 * GB, 1.1e15 / 4096),
    Target("tpu-v5e", "chip", 197e12, 16 * GiB, 819 * GB, 1600e9 / 8),
    Target("tpu-v5p", "chip", 459e12, 95 * GB, 2765 * GB, 4800e9 / 8),
    # NVIDIA H100 and H200 SXM: dense bf16 989 TFLOP/s; 80 GB HBM3 at 3.35 TB/s and 141 GB
    # HBM3e at 4.8 TB/s; NVLink 4 900 GB/s in both directions, 450 GB/s out (NVIDIA data
    # sheets). Across nodes, InfiniBand is ~10x slower: plan multi-node runs accordingly.
    Target("h100", "GPU", 989e12, 80 * GB, 3350 * GB, 450 * GB),
    Target("h200", "GPU", 989e12, 141 * GB, 4800 * GB, 450 * GB),
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


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%?\S+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r"|f8\w*)\[([\d,]*)\]")


def _shapes(text: str) -> list[tuple[int, tuple[int, ...]]]:
    """(bytes per element, dims) of every array shape in an HLO result type."""
    return [(_DTYPE_BYTES.get(dtype, 1), tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _SHAPE.findall(text)]


def _group_size(attributes: str) -> int:
    """The number of devices in each replica group of an HLO collective."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if m:  # mesh['axis_0'=8,'axis_1'=2] {'axis_0'}: the listed axes form a group
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", attributes)
    if m:  # iota groups [4,2]<=[8]: the last dimension is the group size
        return int(m.group(1))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if m:  # explicit groups {{0,1},{2,3}}
        return len(m.group(1).split(","))
    return 0  # empty groups: all devices (the caller knows how many)


@dataclasses.dataclass
class CollectiveStats:
    count: int = 0
    bytes_sent: float = 0.0  # per device, per step
    parameter_shaped_bytes: float = 0.0  # of which buffers shaped like parameters (gradients)


@dataclasses.dataclass
class HloCost:
    """What one execution of an HLO computation (and all it calls) does on one device."""

    collectives: dict[str, CollectiveStats] = dataclasses.field(
        default_factory=lambda: {k: CollectiveStats() for k in COLLECTIVES})
    matmul_flops: float = 0.0  # 2 x multiply-adds of its dots

    def add(self, other: "HloCost", times: int = 1) -> None:
        self.matmul_flops += times * other.matmul_flops
        for kind, s in other.collectives.items():
            mine = self.collectives[kind]
            mine.count += times * s.count
            mine.bytes_sent += times * s.bytes_sent
            mine.parameter_shaped_bytes += times * s.parameter_shaped_bytes

    @property
    def collective_bytes(self) -> float:
        return sum(s.bytes_sent for s in self.collectives.values())


def hlo_cost(hlo_text: str, num_devices: int,
             parameter_shapes: set[tuple[int, ...]] = frozenset()) -> HloCost:
    """Every collective of a compiled (SPMD-partitioned) HLO module, by kind: how many, and
    the bytes each device sends; and the FLOPs of its matmuls. A buffer whose shape is that
    of a parameter (or its shard) is counted as parameter-shaped: a gradient or a gathered
    weight, not an activation.

    Counted per execution, as the program runs: a while loop's body as many times as its
    known trip count (scanned layers, microbatches; XLA's own cost analysis counts it once),
    and of a conditional's branches only the costliest (SGP's step compiles a
    collective-permute for each hop of its cycle, and one runs per step)."""
    # Per computation: what its own instructions do, and what it calls, as (callees of
    # which the costliest runs, times). Instructions before any computation header (a bare
    # listing) form the entry, "".
    direct: dict[str, HloCost] = {"": HloCost()}
    calls: dict[str, list[tuple[list[str], int]]] = {"": []}
    shapes: dict[str, str] = {}  # instruction -> its result type, in the current computation
    entry = current = ""
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line[:1].isspace():  # a computation begins
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            entry = current if line.startswith("ENTRY") else entry
            direct[current], calls[current], shapes = HloCost(), [], {}
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        shapes[name.lstrip("%")] = result
        _note_calls(op, rest, calls[current])
        if op == "dot":
            direct[current].matmul_flops += _dot_flops(result, rest, shapes)
        elif op in COLLECTIVES:
            _add_collective(direct[current].collectives[op], op, result, rest, num_devices,
                            parameter_shapes)

    @functools.lru_cache(maxsize=None)
    def total(name: str) -> HloCost:
        cost = HloCost()
        cost.add(direct.get(name, HloCost()))
        for callees, times in calls.get(name, []):
            cost.add(max((total(c) for c in callees),
                         key=lambda c: (c.collective_bytes, c.matmul_flops)), times)
        return cost

    return total(entry)


def _note_calls(op: str, rest: str, calls: list) -> None:
    """The computations an instruction runs, and how many times."""
    if op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", rest).group(1)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        calls.append(([body], int(trips.group(1)) if trips else 1))
        return
    branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
    if branches:
        calls.append(([b.strip().lstrip("%") for b in branches.group(1).split(",")], 1))
    pair = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", rest)
    if pair:
        calls.append((list(pair.groups()), 1))
    # Fusions, calls and async wrappers run their computation once; reducers (to_apply of a
    # reduce or an all-reduce) hold no matmul or collective, so once is as good as any.
    for callee in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest):
        calls.append(([callee], 1))


def _dot_flops(result: str, rest: str, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted elements of a dot."""
    operands = rest.split(")")[0]
    lhs_shapes = _shapes(operands)  # printed inline, or else defined earlier
    if not lhs_shapes:
        lhs_shapes = _shapes(shapes.get(operands.split(",")[0].strip().lstrip("%"), ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    if not lhs_shapes or not contracting:
        return 0.0
    dims = lhs_shapes[0][1]
    k = math.prod(dims[int(d)] for d in contracting.group(1).split(",") if d)
    return 2.0 * sum(math.prod(d) for _, d in _shapes(result)) * k


def _add_collective(s: CollectiveStats, kind: str, result: str, rest: str, num_devices: int,
                    parameter_shapes) -> None:
    g = _group_size(rest) or num_devices
    if g <= 1 and kind != "collective-permute":
        return
    factor = {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g,
              "all-to-all": (g - 1) / g, "reduce-scatter": g - 1,
              "collective-permute": 1.0}[kind]
    s.count += 1
    for itemsize, dims in _shapes(result):
        sent = itemsize * math.prod(dims) * factor
        s.bytes_sent += sent
        if dims and dims in parameter_shapes:
            s.parameter_shaped_bytes += sent


def collectives(hlo_text: str, num_devices: int,
                parameter_shapes: set[tuple[int, ...]] = frozenset()) -> dict[str, CollectiveStats]:
    """The collectives of `hlo_cost`, by kind."""
    return hlo_cost(hlo_text, num_devices, parameter_shapes).collectives


def _layer_parameters(c: TransformerConfig, kind: str) -> int:
    attention, ffn = 4 * c.d_model * c.num_heads * c.d_kv, 2 * c.d_model * c.d_ff
    if kind == "lm":
        return c.num_layers * (attention + ffn)
    encoder_layers = c.num_encoder_layers or c.num_layers
    return encoder_layers * (attention + ffn) + c.num_layers * (2 * attention + ffn)


def analytic_parameters(c: TransformerConfig, kind: str) -> int:
    """Matmul and embedding parameters as the Mesh-TF paper counts them (no position
    embeddings, no norm scales). LM: layers (4 d h d_kv + 2 d d_ff) + 2 V d; translation:
    encoder layers (4 d h d_kv + 2 d d_ff) + decoder layers (8 d h d_kv + 2 d d_ff) + 2 V d
    (one embedding for inputs and targets, one softmax); V d less with a shared softmax."""
    tables = (1 if c.shared_embedding_and_softmax else 2) * c.vocab_size * c.d_model
    return _layer_parameters(c, kind) + tables


def analytic_flops(c: TransformerConfig, kind: str, batch_size: int, length: int) -> float:
    """Training FLOPs per step: 6 x matmul parameters x tokens (forward 2, backward 4) plus
    attention's scores and weighted sums, 12 x length x heads x d_kv per token and layer of
    attention. The embedding lookup is no matmul; the softmax is (shared or not)."""
    tokens = batch_size * length
    matmul = _layer_parameters(c, kind) + c.vocab_size * c.d_model
    scores = 12 * length * c.num_heads * c.d_kv * tokens
    attention_layers = c.num_layers if kind == "lm" else (
        (c.num_encoder_layers or c.num_layers) + 2 * c.num_layers)
    return 6 * matmul * tokens + attention_layers * scores


def _bytes(tree, shardings) -> int:
    """Bytes per device of a tree of abstract arrays laid out by `shardings`."""
    total = 0
    for leaf, sharding in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
        total += math.prod(sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass
class Plan:
    """What one compiled train step needs per device, and what it would take on `target`."""

    mesh_shape: str
    layout_rules: str
    num_devices: int
    target: str
    parameters: int
    analytic_parameters: int
    batch_size: int
    sequence_length: int
    parameter_bytes: int  # per device, as for all sizes below
    optimizer_bytes: int
    batch_bytes: int
    temp_bytes: int
    xla_total_bytes: int  # what XLA:CPU's buffer assignment needs
    total_bytes: int  # the verdict's: XLA's, or on a GPU target the step model's
    hbm_bytes: float
    fits: bool
    memory_basis: str  # "XLA:CPU buffer assignment" or "step model (GPU)"
    step_model: dict  # step_model.estimate's parts
    xla_flops: float  # per device, XLA's cost analysis (a loop's body counted once)
    matmul_flops: float  # per device, the dots of the HLO (a loop's body per iteration)
    analytic_flops: float  # whole step, all devices
    collectives: dict  # kind -> {count, bytes_sent, parameter_shaped_bytes}
    compute_seconds: float
    memory_seconds: float
    communication_seconds: float
    step_seconds: float
    tokens_per_second: float
    mfu: float  # analytic FLOPs / (step time x peak x devices): the best this layout can do

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def gin_lines(self) -> str:
        return f'run.mesh_shape = "{self.mesh_shape}"\nrun.layout_rules = "{self.layout_rules}"'


def compile_train_step(trainer: Trainer):
    """The train step compiled ahead of time from abstract state and batch."""
    return trainer._train_step.lower(trainer.sharded_abstract_state(),
                                     trainer.abstract_batch()).compile()


def _format_layout(layout: Layout) -> tuple[str, str]:
    return (";".join(f"{n}:{s}" for n, s in layout.mesh_shape),
            ";".join(f"{t}:{m}" for t, m in layout.layout_rules))


def plan(trainer: Trainer, config: TransformerConfig, kind: str, target: Target,
         analytic_parameters: int = 0, compiled=None) -> Plan:
    """Compiles `trainer`'s train step (unless `compiled` is given) and estimates its cost."""
    compiled = compiled or compile_train_step(trainer)
    layout, n = trainer.layout, trainer.layout.size
    abstract, shardings = trainer.abstract_state, trainer.state_shardings
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    parameter_shapes = set()
    for leaf, s in zip(jax.tree_util.tree_leaves(abstract.params),
                       jax.tree_util.tree_leaves(shardings.params)):
        parameter_shapes |= {tuple(leaf.shape), tuple(s.shard_shape(leaf.shape))}
    hlo = hlo_cost(compiled.as_text(), n, parameter_shapes)
    comms = hlo.collectives
    batch, length = trainer.batch_shape
    param_bytes = _bytes(abstract.params, shardings.params)
    opt_bytes = _bytes(abstract.opt_state, shardings.opt_state)
    batch_bytes = memory.argument_size_in_bytes - param_bytes - opt_bytes - 4  # 4: the step
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    flops = float(cost.get("flops", 0.0))
    analytic = analytic_flops(config, kind, batch, length)
    # XLA's cost analysis counts a loop's body once; the matmuls, counted per iteration,
    # are the floor for a scanned or microbatched step.
    compute = max(flops, hlo.matmul_flops) / target.peak_flops
    traffic = (memory.argument_size_in_bytes + memory.output_size_in_bytes
               + 2 * memory.temp_size_in_bytes)
    hbm = traffic / target.hbm_bandwidth
    comm = sum(s.bytes_sent for s in comms.values()) / target.interconnect_bandwidth
    step = max(compute, hbm) + comm
    largest = max(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x, s in
                  zip(jax.tree_util.tree_leaves(abstract.params),
                      jax.tree_util.tree_leaves(shardings.params)))
    model = step_model.estimate(
        config, kind, layout, batch, length, trainer.num_microbatches, trainer.loss_chunks,
        param_bytes + opt_bytes + batch_bytes, param_bytes, largest, analytic, target)
    basis = "XLA:CPU buffer assignment"
    xla_total = total
    if target.device == "GPU":  # where XLA:CPU's figures were measured to be far off
        basis, total = "step model (GPU)", int(model.total_bytes)
        compute = model.compute_seconds
        moved = 2 * (model.saved_activation_bytes + model.gradient_bytes + model.logits_bytes)
        hbm = (2 * (param_bytes + opt_bytes) + moved) / target.hbm_bandwidth
        step = max(model.step_seconds, hbm) + comm
    mesh_shape, rules = _format_layout(layout)
    return Plan(
        mesh_shape=mesh_shape, layout_rules=rules, num_devices=n, target=target.name,
        parameters=sum(x.size for x in jax.tree_util.tree_leaves(abstract.params)),
        analytic_parameters=analytic_parameters, batch_size=batch, sequence_length=length,
        parameter_bytes=param_bytes, optimizer_bytes=opt_bytes, batch_bytes=batch_bytes,
        temp_bytes=memory.temp_size_in_bytes, xla_total_bytes=xla_total, total_bytes=total,
        hbm_bytes=target.hbm_bytes, fits=total <= target.hbm_bytes, memory_basis=basis,
        step_model=dataclasses.asdict(model), xla_flops=flops, matmul_flops=hlo.matmul_flops,
        analytic_flops=analytic,
        collectives={k: dataclasses.asdict(v) for k, v in comms.items()},
        compute_seconds=compute, memory_seconds=hbm, communication_seconds=comm,
        step_seconds=step, tokens_per_second=batch * length / step,
        mfu=analytic / (step * target.peak_flops * n),
    )


# ---- automatic layout ----

# Candidate layout rules per mesh: the Mesh-TF paper's (split d_ff, heads and vocab over
# `model`), the same with the vocabulary replicated, and d_model split instead; on 3-D meshes
# the paper's plus d_model over a third dimension (2-D weight sharding).
_MODEL_RULES = ("batch:batch;d_ff:model;heads:model;vocab:model",
                "batch:batch;d_ff:model;heads:model",
                "batch:batch;d_model:model")
_3D_RULES = ("batch:batch;d_ff:model;heads:model;vocab:model;d_model:embed",)


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered factorizations of n into `parts` factors, each > 1."""
    if parts == 1:
        return [(n,)] if n > 1 else []
    return [(d, *rest) for d in range(2, n + 1) if n % d == 0
            for rest in _factorizations(n // d, parts - 1)]


def candidate_layouts(num_devices: int) -> list[tuple[str, str]]:
    """(mesh shape, layout rules) candidates for `num_devices` devices: pure data and pure
    model parallelism, every 2-D batch x model mesh with each of the model rules, and every
    3-D batch x model x embed mesh."""
    if num_devices == 1:
        return [("", "")]
    out = [(f"batch:{num_devices}", "batch:batch"),
           (f"model:{num_devices}", _MODEL_RULES[0].replace("batch:batch;", ""))]
    for b, m in _factorizations(num_devices, 2):
        out += [(f"batch:{b};model:{m}", rules) for rules in _MODEL_RULES]
    for b, m, e in _factorizations(num_devices, 3):
        out += [(f"batch:{b};model:{m};embed:{e}", rules) for rules in _3D_RULES]
    return out


@dataclasses.dataclass
class Candidate:
    mesh_shape: str
    layout_rules: str
    plan: Plan | None = None
    rejected: str = ""  # why it was not compiled or does not fit


def auto_layout(make_trainer: Callable[[Layout], Trainer], config: TransformerConfig, kind: str,
                num_devices: int, target: Target, analytic_parameters: int = 0,
                progress: Callable[[str], None] = lambda message: None) -> list[Candidate]:
    """Every candidate layout for `num_devices`, best first: those that fit ranked by
    estimated step time, then those that do not fit (least memory first), then the illegal
    ones. A candidate whose parameters and optimizer state alone overflow the target is not
    compiled."""
    results = []
    candidates = candidate_layouts(num_devices)
    for i, (mesh_shape, rules) in enumerate(candidates):
        c = Candidate(mesh_shape, rules)
        results.append(c)
        try:
            trainer = make_trainer(Layout(mesh_shape, rules))
            state = _bytes(trainer.abstract_state, trainer.state_shardings)
            if state > target.hbm_bytes:
                c.rejected = (f"does not fit: parameters and optimizer state alone take "
                              f"{state / GiB:.1f} GiB per device")
                continue
            c.plan = plan(trainer, config, kind, target, analytic_parameters)
            if not c.plan.fits:
                c.rejected = f"does not fit: {c.plan.total_bytes / GiB:.1f} GiB per device"
        except LayoutError as e:
            c.rejected = "illegal: " + str(e).split(" — ")[0]
        progress(f"[{i + 1}/{len(candidates)}] {mesh_shape or '(one device)'} {rules}: "
                 + (c.rejected or f"{c.plan.step_seconds:.3g} s per step"))

    def rank(c: Candidate):
        if c.plan is None:
            return (2, math.inf, 0)
        if not c.plan.fits:
            return (1, c.plan.total_bytes, 0)
        return (0, c.plan.step_seconds, c.plan.total_bytes)

    return sorted(results, key=rank)


# ---- reports ----

def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _step_model_lines(p: Plan) -> list[str]:
    """The step model's parts, where it gives the verdict (GPU targets)."""
    if p.memory_basis.startswith("XLA"):
        return []
    m = p.step_model
    return [
        f"  XLA:CPU total     {_size(p.xla_total_bytes):>12}   (CPU kernels and buffer "
        f"assignment; the GPU's differ: step model below)",
        f"  saved activations {_size(m['saved_activation_bytes']):>12}   ({m['attention']} "
        f"attention; the larger of these two is held)",
        f"  gradients         {_size(m['gradient_bytes']):>12}",
        f"  layer working set {_size(m['working_bytes']):>12}   (one layer's backward)",
        f"  loss logits       {_size(m['logits_bytes']):>12}",
        f"  optimizer update  {_size(m['update_bytes']):>12}   (the largest parameter's)",
    ]


def format_plan(p: Plan, describe: str = "") -> str:
    t = TARGETS[p.target]
    lines = [
        f"mtrain plan: {describe}" if describe else "mtrain plan",
        f"  mesh {p.mesh_shape or '(one device)'} ({p.num_devices} devices), "
        f"layout {p.layout_rules or '(replicated)'}",
        f"  batch {p.batch_size} x {p.sequence_length} tokens",
        f"parameters: {p.parameters:,}" + (
            f" (analytic matmul and embedding parameters: {p.analytic_parameters:,})"
            if p.analytic_parameters else ""),
        "memory per device:",
        f"  parameters        {_size(p.parameter_bytes):>12}",
        f"  optimizer state   {_size(p.optimizer_bytes):>12}",
        f"  batch             {_size(p.batch_bytes):>12}",
        f"  XLA temporaries   {_size(p.temp_bytes):>12}   (activations, gradients, scratch)",
        *_step_model_lines(p),
        f"  total             {_size(p.total_bytes):>12}   of {_size(p.hbm_bytes)} on {p.target} "
        f"({p.memory_basis})",
        "FLOPs per step:",
        f"  XLA, per device   {p.xla_flops:.3e}   (x {p.num_devices} devices = "
        f"{p.xla_flops * p.num_devices:.3e}; a loop's body counted once)",
        f"  HLO matmuls       {p.matmul_flops:.3e}   (per device, loops counted per iteration)",
        f"  analytic          {p.analytic_flops:.3e}   (6 x matmul params x tokens + attention; "
        f"{p.analytic_flops / p.num_devices:.3e} per device)",
        "collectives per step (bytes each device sends):",
    ]
    for kind, s in p.collectives.items():
        if s["count"]:
            shaped = s["parameter_shaped_bytes"]
            lines.append(f"  {kind:<19}{s['count']:>4} ops {_size(s['bytes_sent']):>12}"
                         + (f"   ({_size(shaped)} parameter-shaped: gradients, weights)"
                            if shaped else "   (activations)"))
    if not any(s["count"] for s in p.collectives.values()):
        lines.append("  none")
    lines += [
        f"roofline on {p.target} ({t.device}: {t.peak_flops / 1e12:.1f} TFLOP/s bf16, "
        f"{t.hbm_bandwidth / GB:.0f} GB/s HBM, {t.interconnect_bandwidth / GB:.0f} GB/s "
        f"interconnect):",
        f"  compute {_seconds(p.compute_seconds)}" + (
            "" if p.memory_basis.startswith("XLA") else
            f" (at {100 * p.step_model['efficiency']:.0f}% of peak, as measured for a "
            f"strong JAX baseline; + {_seconds(p.step_model['attention_traffic_seconds'])} "
            f"of attention matrices through HBM)") +
        f", memory {_seconds(p.memory_seconds)}, "
        f"collectives {_seconds(p.communication_seconds)}",
        f"  step ~{_seconds(p.step_seconds)}, {p.tokens_per_second:,.0f} tokens/s, "
        f"MFU {'at most ' if p.memory_basis.startswith('XLA') else '~'}{100 * p.mfu:.0f}%",
        ("verdict: FITS" if p.fits else "verdict: DOES NOT FIT") +
        f" in {p.target} memory: {_size(p.total_bytes)} of {_size(p.hbm_bytes)} per device "
        f"({100 * p.total_bytes / p.hbm_bytes:.0f}%)",
    ]
    return "\n".join(lines)


def format_auto_layout(results: list[Candidate], num_devices: int, target: str,
                       top: int = 5) -> str:
    fitting = [c for c in results if c.plan and c.plan.fits]
    compiled = sum(c.plan is not None for c in results)
    lines = [f"auto-layout for {num_devices} devices on {target}: {len(results)} candidates, "
             f"{compiled} compiled, {len(fitting)} fit"]
    if not fitting:
        lines.append("none fits; the closest:")
    shown = (fitting or [c for c in results if c.plan])[:top]
    for rank, c in enumerate(shown, 1):
        p = c.plan
        lines += [
            f"#{rank}  step ~{_seconds(p.step_seconds)}  {_size(p.total_bytes)} per device  "
            f"MFU <= {100 * p.mfu:.0f}%  (compute {_seconds(p.compute_seconds)}, memory "
            f"{_seconds(p.memory_seconds)}, collectives {_seconds(p.communication_seconds)})",
            *("    " + line for line in p.gin_lines().splitlines()),
        ]
    rejected = [c for c in results if c.plan is None]
    if rejected:
        lines.append(f"not compiled ({len(rejected)}):")
        lines += [f"  {c.mesh_shape} {c.layout_rules}: {c.rejected}" for c in rejected[:8]]
        if len(rejected) > 8:
            lines.append(f"  ... and {len(rejected) - 8} more")
    return "\n".join(lines)

