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
  sends per step, a loop's collectives once per iteration (`mtrain.planning.hlo_cost`);
- a roofline step time for a `Target` accelerator (`mtrain.parallel.targets`): compute (FLOPs /
  peak) and memory traffic (each argument and output moved once, each temporary written
  and read once, over HBM bandwidth) overlap; collectives (bytes sent / interconnect
  bandwidth) do not. On a GPU target memory and time come from `mtrain.planning.step_model`
  instead, which was measured to be closer there;
- with ``transformer.quantization``, the step with its projections in fp8 or int8 against
  the same step in bf16, and whether the format pays on the target
  (`mtrain.planning.quantized`);
- over ``slices`` slices joined by the data-centre network (the first mesh dimension spans
  them), the bytes of each collective that crosses them at its DCN bandwidth
  (`mtrain.planning.slices`); where the layout splits ``layers`` over stages, the
  pipeline's bubble, per-stage memory and sends between stages (`mtrain.planning.pipelined`).

The bf16 step of a quantized plan is the plan of the bf16 program, compiled
  too (a second compilation: the quantized program's time on XLA:CPU is not a TPU's or a
  GPU's): the quantized step is its compute at the format's rate, its memory traffic, the
  casts, and the quantized program's collectives; the memory that must fit, the quantized
  program's.

The program is compiled by XLA:CPU, so it is the program a TPU or GPU would run up to the
backend's own fusion and scheduling choices: memory and time are estimates, good for
ranking layouts and catching what cannot fit, not for quoting to three digits.
`planning.auto_layout` compiles every legal mesh and layout for a number of devices and
ranks those that fit by estimated step time.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from mtrain.planning import inference, pipelined, quantized, step_model
from mtrain.planning.hlo_cost import hlo_cost
from mtrain.planning.slices import Topology, check
from mtrain.parallel.layout import is_names, logical_names
from mtrain.models.transformer import TransformerConfig
from mtrain.parallel.targets import GB, TARGETS, GiB, Target
from mtrain.models import parameters
from mtrain.training.trainer import Trainer


def sharded_bytes(tree, shardings) -> int:
    """Bytes per device of a tree of abstract arrays laid out by `shardings`."""
    total = 0
    for leaf, sharding in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
        total += math.prod(sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def bf16_trainer(trainer: Trainer) -> Trainer:
    """`trainer` with its model's projections in bf16 (``transformer.quantization='none'``):
    the same optimizer, objective, layout, mesh, batch, seed and settings."""
    model = trainer.model.clone(config=dataclasses.replace(trainer.model.config,
                                                           quantization="none"))
    batch_size, sequence_length = trainer.batch_shape
    return Trainer(model=model, optimizer=trainer.given_optimizer,
                   objective=trainer.given_objective, layout=trainer.layout, mesh=trainer.mesh,
                   batch_size=batch_size, sequence_length=sequence_length, seed=trainer.seed,
                   num_microbatches=trainer.num_microbatches,
                   trainable=trainer.trainable if trainer.frozen else None)


@dataclasses.dataclass
class Plan:
    """What one compiled train step needs per device, and what it would take on `target`."""

    mesh_shape: str
    layout_rules: str
    parameter_layout_rules: str  # "" when parameters follow the layout rules
    num_devices: int
    target: str
    parameters: int
    analytic_parameters: int
    active_parameters: int  # those a token computes with (fewer with experts)
    batch_size: int
    sequence_length: int
    parameter_bytes: int  # per device, as for all sizes below
    expert_bytes: int  # of which the experts' weights
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
    inference: dict  # a decoder-only LM's `inference.estimate` ({} for others)
    quantization: dict = dataclasses.field(default_factory=dict)  # `quantized.Quantized`
    slices: int = 1  # slices (or nodes) the first mesh dimension spans, joined by DCN
    dcn_seconds: float = 0.0  # of communication_seconds, the data-centre network's
    pipeline: dict = dataclasses.field(default_factory=dict)  # `pipelined.Pipelined`

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def gin_lines(self) -> str:
        lines = f'run.mesh_shape = "{self.mesh_shape}"\nrun.layout_rules = "{self.layout_rules}"'
        if self.parameter_layout_rules:
            lines += f'\nrun.parameter_layout_rules = "{self.parameter_layout_rules}"'
        return lines


def plan(trainer: Trainer, target: Target, compiled=None, prompt_length: int | None = None,
         slices: int = 1) -> Plan:
    """Compiles `trainer`'s train step (unless `compiled` is given) and estimates its cost;
    for a decoder-only LM, also generation's from prompts of `prompt_length` tokens (default
    half the row) to the end of the row (`inference`). `slices`: the slices (TPU
    multislice, GPU nodes) the first mesh dimension spans, joined by the data-centre
    network."""
    layout, n = trainer.layout, trainer.layout.size
    check(layout, target, slices)
    compiled = compiled or trainer.compile_train_step()
    abstract, shardings = trainer.abstract_state, trainer.state_shardings
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # A parameter's shapes: whole, its stored shard, and (under parameter layout rules) its
    # shard as the layout rules lay it out for use, which is what is gathered. What the
    # optimizer sees: the trainable parameters (a frozen one has no gradient, no update, and
    # no weight-gradient matmul: 4, not 6, FLOPs per weight and token; an expert's weights
    # by their share of the tokens).
    moe = getattr(trainer.model.config, "moe", None)
    active = moe.top_k / moe.num_experts if moe else 1.0
    parameter_shapes, expert_bytes = set(), 0
    largest = gradient_bytes = frozen_matmul = 0
    for (path, leaf), s, names in zip(
            parameters.paths(abstract.params).items(), jax.tree_util.tree_leaves(shardings.params),
            jax.tree_util.tree_leaves(trainer.param_names, is_leaf=is_names)):
        used = NamedSharding(s.mesh, layout.partition_spec(logical_names(names, leaf.ndim),
                                                           leaf.shape))
        shapes = {tuple(leaf.shape), tuple(s.shard_shape(leaf.shape)),
                  tuple(used.shard_shape(leaf.shape))}
        # A scanned stack's parameter [layers, ...] moves a layer at a time in the loop (a
        # pipeline stage's as [1, ...]).
        parameter_shapes |= shapes | ({y for x in shapes for y in (x[1:], (1, *x[1:]))}
                                      if names and names[0] == "layers" else set())
        shard = math.prod(s.shard_shape(leaf.shape))
        if names and "experts" in names:  # the experts' weights, per device
            expert_bytes += shard * jnp.dtype(leaf.dtype).itemsize
        if trainer.trainable(path):
            largest = max(largest, shard * jnp.dtype(leaf.dtype).itemsize)
            gradient_bytes += shard * 4
        elif leaf.ndim >= 2 and not path.endswith("embedding"):
            frozen_matmul += leaf.size * (active if "experts" in names else 1.0)
    hlo = hlo_cost(compiled.as_text(), n, parameter_shapes,
                   Topology(tuple(layout.mesh_shape), slices))
    comms = hlo.collectives
    batch, length = trainer.batch_shape
    param_bytes = sharded_bytes(abstract.params, shardings.params)
    opt_bytes = sharded_bytes(abstract.opt_state, shardings.opt_state)
    batch_bytes = memory.argument_size_in_bytes - param_bytes - opt_bytes - 4  # 4: the step
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    flops = float(cost.get("flops", 0.0))
    model = trainer.model
    analytic = model.analytic_flops(batch, length)
    # XLA's cost analysis counts a loop's body once; the matmuls, counted per iteration,
    # are the floor for a scanned or microbatched step.
    compute = max(flops, hlo.matmul_flops) / target.peak_flops
    traffic = (memory.argument_size_in_bytes + memory.output_size_in_bytes
               + 2 * memory.temp_size_in_bytes)
    hbm = traffic / target.hbm_bandwidth
    # every target has a ragged all-to-all: it sends the routed rows, not XLA:CPU's padding;
    # what crosses slices goes at the data-centre network's bandwidth
    kept = {k: 1 - s.padding_bytes / s.bytes_sent if s.bytes_sent else 0.0
            for k, s in comms.items()}
    dcn = sum(kept[k] * s.dcn_bytes for k, s in comms.items()) / (target.dcn_bandwidth or 1)
    comm = sum(kept[k] * (s.bytes_sent - s.dcn_bytes) for k, s in comms.items()) \
        / target.interconnect_bandwidth + dcn
    step = max(compute, hbm) + comm
    executed = analytic - 2 * frozen_matmul * batch * length
    estimate = kind = None
    if isinstance(model.config, TransformerConfig):  # the step model knows Transformers
        kind = "translation" if "inputs" in model.features else "lm"
        estimate = step_model.estimate(
            model.config, kind, layout, batch, length, trainer.num_microbatches,
            trainer.loss_chunks, param_bytes + opt_bytes + batch_bytes, gradient_bytes,
            largest, executed, target)
    basis = "XLA:CPU buffer assignment"
    xla_total = total
    if target.device == "GPU" and estimate:  # where XLA:CPU was measured to be far off
        basis, total = "step model (GPU)", int(estimate.total_bytes)
        compute = estimate.compute_seconds
        moved = 2 * (estimate.saved_activation_bytes + estimate.gradient_bytes
                     + estimate.logits_bytes)
        hbm = (2 * (param_bytes + opt_bytes) + moved) / target.hbm_bandwidth
        step = max(estimate.step_seconds, hbm) + comm
    quantization = None
    if kind and model.config.quantization != "none":  # against the bf16 program's own plan
        bf16 = plan(bf16_trainer(trainer), target, slices=slices)
        quantization = quantized.compare(
            model.config, kind, layout, batch, length, trainer.num_microbatches, target,
            model_flops=executed, compute=bf16.compute_seconds,
            traffic=bf16.step_model["attention_traffic_seconds"]
            if target.device == "GPU" else 0.0,
            memory=bf16.memory_seconds, bf16_collectives=bf16.communication_seconds,
            collectives=comm, bf16_step=bf16.step_seconds,
            scale_all_reduces=max(0, comms["all-reduce"].count
                                  - bf16.collectives["all-reduce"]["count"]))
        compute, hbm, step = (quantization.compute_seconds, bf16.memory_seconds,
                              quantization.step_seconds)
    mesh_shape, rules = layout.mesh_text, layout.rules_text
    return Plan(
        mesh_shape=mesh_shape, layout_rules=rules,
        parameter_layout_rules=layout.parameter_rules_text, num_devices=n, target=target.name,
        parameters=sum(x.size for x in jax.tree_util.tree_leaves(abstract.params)),
        analytic_parameters=model.analytic_parameters(),
        active_parameters=getattr(model, "active_parameters", model.analytic_parameters)(),
        batch_size=batch, sequence_length=length,
        parameter_bytes=param_bytes, expert_bytes=expert_bytes, optimizer_bytes=opt_bytes,
        batch_bytes=batch_bytes,
        temp_bytes=memory.temp_size_in_bytes, xla_total_bytes=xla_total, total_bytes=total,
        hbm_bytes=target.hbm_bytes, fits=total <= target.hbm_bytes, memory_basis=basis,
        step_model=dataclasses.asdict(estimate) if estimate else {}, xla_flops=flops, matmul_flops=hlo.matmul_flops,
        analytic_flops=analytic,
        collectives={k: dataclasses.asdict(v) for k, v in comms.items()},
        compute_seconds=compute, memory_seconds=hbm, communication_seconds=comm,
        step_seconds=step, tokens_per_second=batch * length / step,
        mfu=executed / (step * target.peak_flops * n),  # (frozen weights: 4 per token)
        inference=inference.estimate(model.config, layout, target, batch, length,
                                     prompt_length or length // 2, param_bytes)
        if hasattr(model, "prefill") and isinstance(model.config, TransformerConfig) else {},
        quantization=dataclasses.asdict(quantization) if quantization else {},
        slices=slices, dcn_seconds=dcn,
        pipeline=dataclasses.asdict(pipelined.estimate(
            trainer, target, {k: dataclasses.asdict(v) for k, v in comms.items()}, slices))
        if pipelined.stage_ways(trainer) > 1 else {},
    )


# ---- reports ----

def size_text(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def seconds_text(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _step_model_lines(p: Plan) -> list[str]:
    """The step model's parts, where it gives the verdict (GPU targets)."""
    if p.memory_basis.startswith("XLA"):
        return []
    m = p.step_model
    return [
        f"  XLA:CPU total     {size_text(p.xla_total_bytes):>12}   (CPU kernels and buffer "
        f"assignment; the GPU's differ: step model below)",
        f"  saved activations {size_text(m['saved_activation_bytes']):>12}   ({m['attention']} "
        f"attention; the larger of these two is held)",
        f"  gradients         {size_text(m['gradient_bytes']):>12}",
        f"  layer working set {size_text(m['working_bytes']):>12}   (one layer's backward)",
        *([f"  keys/values in    {size_text(m['context_bytes']):>12}   (a layer's, received "
           f"with length split)"] if m['context_bytes'] else []),
        f"  loss logits       {size_text(m['logits_bytes']):>12}",
        f"  optimizer update  {size_text(m['update_bytes']):>12}   (the largest parameter's)",
    ]


def format_plan(p: Plan, describe: str = "") -> str:
    t = TARGETS[p.target]
    lines = [
        f"mtrain plan: {describe}" if describe else "mtrain plan",
        f"  mesh {p.mesh_shape or '(one device)'} ({p.num_devices} devices), "
        f"layout {p.layout_rules or '(replicated)'}" + (
            f", parameters also {p.parameter_layout_rules} (stored split: FSDP)"
            if p.parameter_layout_rules else ""),
        *([f"  {p.slices} slices joined by the data-centre network: the first mesh dimension "
           f"spans them ({t.dcn_bandwidth / GB:.2f} GB/s a device across them)"]
          if p.slices > 1 else []),
        f"  batch {p.batch_size} x {p.sequence_length} tokens",
        f"parameters: {p.parameters:,}" + (
            f" (analytic matmul and embedding parameters: {p.analytic_parameters:,})"
            if p.analytic_parameters else ""),
        *([f"  active per token: {p.active_parameters:,} (its top-k experts of all)"]
          if p.active_parameters != p.analytic_parameters else []),
        "memory per device:",
        f"  parameters        {size_text(p.parameter_bytes):>12}" + (
            f"   (experts' weights {size_text(p.expert_bytes)})" if p.expert_bytes else ""),
        f"  optimizer state   {size_text(p.optimizer_bytes):>12}",
        f"  batch             {size_text(p.batch_bytes):>12}",
        f"  XLA temporaries   {size_text(p.temp_bytes):>12}   (activations, gradients, scratch)",
        *_step_model_lines(p),
        f"  total             {size_text(p.total_bytes):>12}   of {size_text(p.hbm_bytes)} on {p.target} "
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
            lines.append(f"  {kind:<19}{s['count']:>4} ops {size_text(s['bytes_sent']):>12}"
                         + (f"   ({size_text(shaped)} parameter-shaped: gradients, weights)"
                            if shaped else "   (activations)"))
            if s.get("dcn_bytes"):
                lines.append(f"{'':30}of which {size_text(s['dcn_bytes'])} between slices (DCN)")
            if s["padding_bytes"]:
                lines.append(f"{'':30}of which {size_text(s['padding_bytes'])} padding: a ragged "
                             f"all-to-all (GPU, TPU) sends only routed rows")
    if not any(s["count"] for s in p.collectives.values()):
        lines.append("  none")
    lines += [
        f"roofline on {p.target} ({t.device}: {t.peak_flops / 1e12:.1f} TFLOP/s bf16, "
        f"{t.hbm_bandwidth / GB:.0f} GB/s HBM, {t.interconnect_bandwidth / GB:.0f} GB/s "
        f"interconnect):",
        f"  compute {seconds_text(p.compute_seconds)}" + (
            "" if p.memory_basis.startswith("XLA") else
            f" (at {100 * p.step_model['efficiency']:.0f}% of peak, as measured for a "
            f"strong JAX baseline; + {seconds_text(p.step_model['attention_traffic_seconds'])} "
            f"of attention matrices through HBM)") +
        f", memory {seconds_text(p.memory_seconds)}"
        + (" (the bf16 program's; the casts below)" if p.quantization else "") + ", "
        f"collectives {seconds_text(p.communication_seconds)}" + (
            f" ({seconds_text(p.dcn_seconds)} of it between slices)" if p.slices > 1 else ""),
        f"  step ~{seconds_text(p.step_seconds)}, {p.tokens_per_second:,.0f} tokens/s, "
        f"MFU {'at most ' if p.memory_basis.startswith('XLA') else '~'}{100 * p.mfu:.0f}%"
        + (" (of the bf16 peak)" if p.quantization else ""),
        *(quantized.lines(p.quantization, t, p.batch_size * p.sequence_length, seconds_text)
          if p.quantization else []),
    ]
    if p.pipeline:
        lines += pipelined.lines(p.pipeline, size_text, seconds_text)
    if p.inference:
        e = p.inference
        lines += [
            f"inference (--prompt_length {e['prompt_length']}, then {e['new_tokens']} new "
            f"tokens, batch {e['batch_size']}):",
            f"  prefill {seconds_text(e['prefill_seconds'])}, first token after "
            f"{seconds_text(e['time_to_first_token'])} (a token a step: "
            f"{seconds_text(e['token_loop_time_to_first_token'])}), then "
            f"{seconds_text(e['decode_step_seconds'])} a step, "
            f"{e['tokens_per_second']:,.0f} tokens/s"]
    lines += [
        ("verdict: FITS" if p.fits else "verdict: DOES NOT FIT") +
        f" in {p.target} memory: {size_text(p.total_bytes)} of {size_text(p.hbm_bytes)} per device "
        f"({100 * p.total_bytes / p.hbm_bytes:.0f}%)",
    ]
    return "\n".join(lines)
