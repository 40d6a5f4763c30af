"""A plan's pipeline: what a layout that splits ``layers`` over a stage mesh dimension costs
(`mtrain.models.pipeline`).

For a trainer whose layout splits ``layers`` S ways (S > 1): the schedule, its R runs of
layers a stage (1 for GPipe), the M microbatches each trainer microbatch is cut into
(`pipeline.microbatch_count`) and the bubble, (S-1) / (R M + S-1): the share of the
iterations each stage computes on nothing. The compiled program's FLOPs already hold the
bubble (every stage computes every iteration, `pipeline.run`), so the plan's compute time
is the pipelined step's.

Per device: the bytes of the stacked ``layers`` parameters and their optimizer state (from
the state's shardings) against what they would be were ``layers`` not split (S times
more); the bytes sent between stages per step, as the schedule needs them: each of the
R M + S - 1 iterations of each pipelined stack a device sends its shard of one microbatch's
[rows / M, length, d_model] activation to the next stage, and as much again backwards (the
gradient), per trainer microbatch; the circular schedule (R > 1) also moves each stored
chunk of layers not already on the stage that runs it there, and its gradient back. Beside
them, what the compiled program sends over the stage dimension alone (its HLO's
collectives whose groups span only that dimension), and both over the link the stage
dimension crosses: ICI, or the data-centre network where it is the first mesh dimension of
a plan over several slices (`slices`).

The embedding, final norm, output head and loss run beside the pipeline with the batch
split over the stage dimension too (`layout.rows_over_stages`): each stage does 1/S of
their work, where the rows divide (else all of it, S times).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mtrain.models import pipeline
from mtrain.models.blocks import scan_parts
from mtrain.parallel.layout import is_names
from mtrain.parallel.targets import GB, Target
from mtrain.training.trainer import Trainer


@dataclasses.dataclass
class Pipelined:
    """A pipelined step's figures, per device and step."""

    stages: int  # S
    stage_dim: str  # the mesh dimension that splits `layers`
    schedule: str
    repeats: int  # R: runs of layers a stage
    microbatches: int  # M: of each trainer microbatch
    trainer_microbatches: int
    stacks: int  # pipelined scans a pass (first dense layers, then the rest)
    iterations: int  # R M + S - 1 per stack and trainer microbatch
    bubble: float
    stacked_parameter_bytes: int  # the stacked layers' parameters on one device
    stacked_optimizer_bytes: int
    unsplit_parameter_bytes: int  # the same were `layers` not split
    unsplit_optimizer_bytes: int
    other_parameter_bytes: int  # embedding, head, final norm: on every stage
    head_flops: float  # the output head's matmuls (whole step)
    head_split: bool  # whether the stages share them (the rows divide S ways more)
    activation_bytes: int  # one microbatch's activation shard, as a device sends it
    activation_bytes_sent: float  # activations forward and their gradients backward
    reorder_bytes_sent: float  # circular: parameters to their stages, gradients back
    bytes_sent: float  # the two above: what the schedule needs sent between stages
    compiled: dict  # collective kind -> bytes the compiled step sends over the stage dim alone
    compiled_bytes_sent: float
    link: str  # "ICI" or "DCN"
    link_bandwidth: float  # bytes/s a device sends over it
    seconds: float  # bytes_sent over the link
    compiled_seconds: float


def stage_ways(trainer: Trainer) -> int:
    """S: the stages `trainer`'s layout splits ``layers`` into (1: none)."""
    return trainer.layout.ways(pipeline.STACKED)


def estimate(trainer: Trainer, target: Target, collectives: dict, slices: int = 1
             ) -> Pipelined:
    """The pipeline figures of `trainer` (whose layout splits ``layers``) on `target`, with
    `collectives` its compiled step's (`hlo_cost`'s stats by kind, with their bytes by mesh
    dimensions) and `slices` the slices the first mesh dimension spans."""
    layout, model = trainer.layout, trainer.model
    c = model.config
    s_count, axis = stage_ways(trainer), layout.mesh_dim_for(pipeline.STACKED)
    config = c.pipeline
    r_count = config.chunks
    batch, length = trainer.batch_shape
    rows = batch // trainer.num_microbatches
    m_count = pipeline.microbatch_count(config, rows, s_count, layout.ways("batch"))
    stacks = len(scan_parts(c, c.num_layers))
    iterations = r_count * m_count + s_count - 1

    abstract, shardings = trainer.abstract_state, trainer.state_shardings
    stacked, other, reorder = 0, 0, [0.0] * s_count
    for leaf, s, names in zip(jax.tree_util.tree_leaves(abstract.params),
                              jax.tree_util.tree_leaves(shardings.params),
                              jax.tree_util.tree_leaves(trainer.param_names, is_leaf=is_names)):
        size = math.prod(s.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        if names and names[0] == pipeline.STACKED:
            stacked += size
            for stage, moved in enumerate(_moved_chunks(s_count, r_count)):
                reorder[stage] += size / r_count * moved
        else:
            other += size
    optimizer = sum(math.prod(s.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                    for leaf, s in zip(jax.tree_util.tree_leaves(abstract.opt_state),
                                       jax.tree_util.tree_leaves(shardings.opt_state))
                    if leaf.ndim and _leads_with(s.spec, axis))

    shard = (rows // m_count // layout.ways("batch") * length // layout.ways("length")
             * c.d_model // layout.ways("d_model") * c.dtype.itemsize)
    per_run = trainer.num_microbatches * stacks
    activations = 2.0 * per_run * iterations * shard
    reordered = 2.0 * per_run * max(reorder)  # and the gradients back
    compiled = {kind: s["over"].get(axis, 0.0) for kind, s in collectives.items()
                if s["over"].get(axis)}
    dcn = slices > 1 and layout.mesh_shape[0][0] == axis
    bandwidth = target.dcn_bandwidth if dcn else target.interconnect_bandwidth
    return Pipelined(
        stages=s_count, stage_dim=axis, schedule=config.schedule, repeats=r_count,
        microbatches=m_count, trainer_microbatches=trainer.num_microbatches, stacks=stacks,
        iterations=iterations, bubble=pipeline.bubble(s_count, m_count, r_count),
        stacked_parameter_bytes=stacked, stacked_optimizer_bytes=optimizer,
        unsplit_parameter_bytes=stacked * s_count, unsplit_optimizer_bytes=optimizer * s_count,
        other_parameter_bytes=other,
        head_flops=6.0 * c.d_model * c.vocab_size * batch * length,
        head_split=rows % (layout.ways("batch") * s_count) == 0,
        activation_bytes=shard, activation_bytes_sent=activations,
        reorder_bytes_sent=reordered, bytes_sent=activations + reordered,
        compiled=compiled, compiled_bytes_sent=sum(compiled.values()),
        link="DCN" if dcn else "ICI", link_bandwidth=bandwidth,
        seconds=(activations + reordered) / bandwidth,
        compiled_seconds=sum(compiled.values()) / bandwidth)


def _moved_chunks(s_count: int, r_count: int) -> list[int]:
    """Per stage, how many of the R chunks it stores (stage s: chunks s R .. s R + R - 1,
    in layer order) another stage runs (chunk c runs on stage c mod S:
    `pipeline.circular_order`); none for GPipe."""
    return [sum((s * r_count + j) % s_count != s for j in range(r_count))
            for s in range(s_count)]


def _leads_with(spec, axis: str) -> bool:
    """Whether a stored array's first dimension is split over `axis` (a stacked layer's)."""
    first = spec[0] if len(spec) else None
    return first == axis or (isinstance(first, tuple) and axis in first)


def lines(p: dict, size_text, seconds_text) -> list[str]:
    """The plan report's ``pipeline:`` section from `Pipelined`'s fields."""
    kinds = ", ".join(f"{kind} {size_text(sent)}" for kind, sent in p["compiled"].items())
    schedule = (f"{p['schedule']}" + (f", {p['repeats']} runs of layers a stage"
                                      if p["repeats"] > 1 else ""))
    return [
        f"pipeline: {p['stages']} stages over mesh dimension {p['stage_dim']!r} ({schedule})",
        f"  microbatches {p['microbatches']} a trainer microbatch (of "
        f"{p['trainer_microbatches']}), {p['iterations']} iterations; bubble "
        f"{100 * p['bubble']:.1f}% ((S-1)/(R M+S-1); the compiled FLOPs include it)",
        f"  stacked layers    {size_text(p['stacked_parameter_bytes']):>12} parameters, "
        f"{size_text(p['stacked_optimizer_bytes'])} optimizer state per device (unsplit: "
        f"{size_text(p['unsplit_parameter_bytes'])}, "
        f"{size_text(p['unsplit_optimizer_bytes'])})",
        f"  between stages    {size_text(p['bytes_sent']):>12}   sent per device and step "
        f"(activations forward and gradients back"
        + (f"; {size_text(p['reorder_bytes_sent'])} of them circular's parameters to their "
           f"stages and back" if p["reorder_bytes_sent"] else "")
        + f"): {seconds_text(p['seconds'])} over {p['link']} at "
        f"{p['link_bandwidth'] / GB:.1f} GB/s",
        f"  as compiled       {size_text(p['compiled_bytes_sent']):>12}   over "
        f"{p['stage_dim']!r} alone ({kinds or 'none'}): {seconds_text(p['compiled_seconds'])}",
        f"  embedding, final norm and head ({size_text(p['other_parameter_bytes'])} per device) "
        + (f"beside the stages, the batch split over {p['stage_dim']!r} too: the head's "
           f"{p['head_flops']:.2e} FLOPs a step, 1/{p['stages']} on each stage"
           if p["head_split"] else
           f"run on every stage, on the whole batch (its rows do not divide over "
           f"{p['stage_dim']!r} too): the head's {p['head_flops']:.2e} FLOPs a step, "
           f"{p['stages']} times"),
    ]
