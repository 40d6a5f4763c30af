"""Pipeline parallelism as a split of ``layers``: a layout rule ``layers:stage`` puts each
stage's layers (and their optimizer state) on the devices of one index of the mesh
dimension `stage`, and a scanned stack's pass runs its microbatches through the stages
inside the one jitted step (MaxText's `layers/pipeline.py`, GPipe in torchtitan's words).

A stack of n scanned layers (or groups of layers: `blocks.period`) is cut into R x S
chunks of k = n / (R S): chunk ``r S + s`` (layers ``(r S + s) k`` .. ``+ k - 1``) lives on
stage s. With R = 1 (``schedule='gpipe'``) each stage holds one run of adjacent layers;
with R > 1 (``'circular'``, ``repeats`` = R) several runs, a microbatch going round the
stages R times, so that the pipeline fills and drains in chunks R times smaller: the
bubble, the share of the stages' time they idle, is (S - 1) / (R M + S - 1) for M
microbatches (GPipe's (S - 1) / (M + S - 1) at R = 1).

Microbatch m (rows m, m + M, m + 2M, ...: each device keeps its own rows) reaches stage s
in repeat r at iteration ``t = r M + m + s``. Each stage runs as its own program (a
`jax.shard_map` manual over `stage`; the other mesh dimensions stay XLA's, or `batch`'s
manual too where it splits nothing else, so that the weight gradients are summed over the
data shards once, not per microbatch): an iteration it works on one microbatch, then
sends its output to the next stage (one collective-permute); the last stage's output,
which so reaches stage 0, is kept there and re-enters for the next repeat M - S + 1
iterations later (so circular needs M >= S); after the last iteration stage 0 holds the
stack's output, which it sends on, each stage its 1/S of the rows: beside the pipeline an
activation's ``batch`` is split over the stages too (`layout.rows_over_stages`), so the
embedding, the head and the loss each stage computes are its share of the rows. Every
stage computes every iteration (the bubble's on zeros, discarded: the compiled FLOPs
include it). The backward pass is the
loop's own (autodiff runs the iterations in reverse: all forwards, then all backwards, as
GPipe), and each stage's layers are a scan of the same Blocks, so one step's result is
the unsplit step's up to the order of float sums (and, with dropout, its random numbers).

The parameters stay stored as every other layout stores them, one ``layers`` dimension in
the stack's order (a checkpoint is read by any stage count). GPipe's chunks are those
shards as they lie; circular's are not (stage s holds chunks s, S + s, ...), so its step
first moves each layer to its stage (R x R collective-permutes of the stack's parameters
over `stage`, and of their gradients back: `circular_order`), which the plan counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from mtrain.errors import ConfigError
from mtrain.models.pipeline_statistics import Reductions, add, finish, over_shards, zeros
from mtrain.parallel import layout as layout_lib

SCHEDULES = ("gpipe", "circular")
RUN_WEIGHTS = "pipeline_run_weights"  # (the checkpoint name of a run's weights)
STACKED = "layers"  # the tensor dimension whose split makes the stages
# The bubble a default microbatch count keeps the pipeline under.
BUBBLE_GOAL = 0.2


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a stack split over stages (a layout rule ``layers:<mesh dim>``) runs (gin's
    ``pipeline.*``). `schedule`: 'gpipe' (one run of adjacent layers a stage) or
    'circular' (`repeats` runs a stage, a microbatch going round the stages `repeats`
    times). `microbatches`: how many slices of a batch's rows flow through the stages (0:
    the fewest that keep the bubble under a fifth, `microbatch_count`)."""

    schedule: str = "gpipe"
    repeats: int = 2
    microbatches: int = 0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule must be one of {SCHEDULES}, got "
                             f"{self.schedule!r}")
        if self.repeats < 1 or (self.schedule == "circular" and self.repeats < 2):
            raise ValueError(f"pipeline.repeats must be at least 2 for the circular schedule "
                             f"(1 is schedule='gpipe'), got {self.repeats}")
        if self.microbatches < 0:
            raise ValueError(f"pipeline.microbatches must be 0 (as many as keep the bubble "
                             f"under {BUBBLE_GOAL:.0%}) or positive, got {self.microbatches}")

    @property
    def chunks(self) -> int:
        """R: the runs of layers each stage holds."""
        return self.repeats if self.schedule == "circular" else 1


def stage_axis() -> str | None:
    """The mesh dimension the active layout splits ``layers`` over (None: not split)."""
    active = layout_lib.active()
    if active is None or active[0].ways(STACKED) <= 1:
        return None
    return active[0].mesh_dim_for(STACKED)


def stages() -> int:
    """S: into how many stages the active layout splits ``layers`` (1: none)."""
    active = layout_lib.active()
    return 1 if active is None else active[0].ways(STACKED)


def bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The share of a step the stages idle: (S - 1) / (R M + S - 1)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


# The refusals of stages, each worded once: the run's check before anything is made
# (`blocks.check_stages`) and the model's own where it meets a layout nothing checked.
def encoder_decoder_refused() -> ConfigError:
    """The encoder-decoder's stack split over stages (it runs no pipeline)."""
    return ConfigError("the encoder-decoder runs no pipeline: a layout rule splits "
                       "'layers' over stages; split it over batch, heads, d_ff instead")


def unscanned_refused() -> ConfigError:
    """An unscanned stack (``layer_{i}`` Blocks, no ``layers`` dimension) split over stages."""
    return ConfigError("a layout rule splits 'layers' (pipeline stages), which needs "
                       "transformer.scan_layers=True: only a scanned stack has a layers "
                       "dimension to split")


def split_refused(steps: int, stages: int, runs: int, group: int = 1) -> ConfigError:
    """A scan of `steps` layers (or groups of `group` layers) that the `stages` x `runs`
    (R) chunks do not divide."""
    return ConfigError(
        f"a stack of {steps} scanned layers does not split into {stages} stages x {runs} "
        f"runs (pipeline.repeats): make the layers a multiple of {stages * runs}"
        + (f" (scanned in groups of {group})" if group > 1 else ""))


def microbatch_count(config: PipelineConfig, rows: int, stages: int, data_ways: int = 1) -> int:
    """M for a batch of `rows` over `stages` stages whose ``batch`` is split `data_ways`
    ways inside a stage: `config.microbatches`, or the fewest that keep the `bubble` under
    `BUBBLE_GOAL` (the most there are where none does). Each microbatch's rows must split
    as the batch's do, and circular needs M >= S. Raises ConfigError where none fits."""
    r = config.chunks

    def fits(m):
        return rows % m == 0 and (rows // m) % data_ways == 0 and (r == 1 or m >= stages)

    if config.microbatches:
        if not fits(config.microbatches):
            raise ConfigError(
                f"pipeline.microbatches={config.microbatches} does not fit a batch of {rows} "
                f"rows over {stages} stages: it must divide the rows into slices that "
                f"divide by the batch's {data_ways}-way split"
                + (f", and be at least the {stages} stages (circular)" if r > 1 else ""))
        return config.microbatches
    fitting = [m for m in range(1, rows + 1) if fits(m)]
    if not fitting:
        raise ConfigError(
            f"a batch of {rows} rows cannot flow through {stages} stages in the circular "
            f"schedule: it needs at least {stages} microbatches of rows that divide by the "
            f"batch's {data_ways}-way split (more rows, or pipeline.schedule='gpipe')")
    good = [m for m in fitting if bubble(stages, m, r) <= BUBBLE_GOAL]
    return good[0] if good else fitting[-1]


def microbatched(x: jax.Array, m: int) -> jax.Array:
    """[b, ...] -> [m, b / m, ...]: microbatch j holds rows j, j + m, j + 2m, ..."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def unbatched(x: jax.Array) -> jax.Array:
    """The inverse of `microbatched`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


# chunk(params of k layers, x [rows, ...], per-row arguments, dropout key or None)
#   -> (x, statistics: a tree of [k, ...] arrays, or {})
Chunk = Callable[[Any, jax.Array, Any, Any], tuple[jax.Array, Any]]


def run(config: PipelineConfig, chunk: Chunk, params, x: jax.Array, per_row=(),
        key=None, reductions: Reductions = Reductions()) -> tuple[jax.Array, Any]:
    """`x` [b, length, d_model] through a stack of n layers whose `params` (leaves [n, ...])
    the active layout splits over stages: (the stack's output, its statistics: leaves [n,
    ...], each layer's over the microbatches by `reductions`, `pipeline_statistics`).
    `per_row`: arrays [b, ...] (masks, positions) each microbatch takes its rows of; `key`:
    the dropout key (None: deterministic), one per stage, iteration and data shard.

    Each stage runs as its own program (`jax.shard_map`, manual over the stage dimension;
    the other dimensions stay XLA's). Where ``batch`` is split over a mesh dimension that
    splits nothing else (no experts, no parameters: not FSDP), that dimension is manual
    too: each shard runs the pipeline on its own rows, and the stages' weight gradients
    are summed over the shards once, where the shard_map ends, not at each iteration where
    XLA would reduce each microbatch's."""
    layout, mesh = layout_lib.active()
    axis, s_count = stage_axis(), stages()
    mesh, already = _context(mesh)  # (inside a replica's or SGP's shard_map: its rows)
    params = staged(params, config)
    data = None if already else _data_axis(layout)
    data_ways = 1 if data or layout.mesh_dim_for("batch") in already else layout.ways("batch")
    n = s_count * config.chunks * jax.tree_util.tree_leaves(params)[0].shape[2]
    rows = PartitionSpec(data)  # (P(None): every stage and device has all of them)
    # the output's rows split over the stages too, as the activations beside the pipeline
    # are (`layout.rows_over_stages`), where that is the data shard's rows cut S ways
    auto = layout.mesh_dim_for("batch") not in already and layout.ways("batch") > 1
    shard_rows = x.shape[0] // (mesh.shape[data] if data else 1)
    scatter = shard_rows % s_count == 0 and (data is not None or not auto)
    out_rows = PartitionSpec((data, axis) if data else axis) if scatter else rows

    def local(params, x, per_row, key):
        stage = jax.lax.axis_index(axis)
        if key is not None:
            key = jax.random.fold_in(key, stage)
            key = key if data is None else jax.random.fold_in(key, jax.lax.axis_index(data))
        out, stats = _stage(config, chunk, jax.tree_util.tree_map(lambda p: p[0], params), x,
                            per_row, key, reductions, stage, data_ways, scatter, data)
        return out, jax.tree_util.tree_map(lambda v: v[None], stats)

    out, stats = jax.shard_map(
        local, mesh=mesh, in_specs=(PartitionSpec(axis), rows, rows, PartitionSpec()),
        out_specs=(out_rows, PartitionSpec(axis)), axis_names={axis} | ({data} if data else set()),
        check_vma=False)(params, x, per_row, key)
    # [S, R, k, ...] -> the stack's [n, ...]: layer (r S + s) k + j
    return out, jax.tree_util.tree_map(
        lambda v: v.swapaxes(0, 1).reshape(n, *v.shape[3:]), stats)


def _context(mesh):
    """(the mesh a shard_map made here takes, the axes already manual): inside another
    shard_map (a replica's, SGP's), the mesh as it sees it."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return mesh, frozenset()
    return context, frozenset(context.manual_axes)


def _data_axis(layout) -> str | None:
    """The mesh dimension that splits ``batch`` and nothing else (`run`), or None."""
    data = layout.mesh_dim_for("batch")
    if data is None or layout.ways("batch") <= 1:
        return None
    others = [t for t, m in [*layout.layout_rules, *layout.parameter_rules]
              if m == data and t != "batch"]
    return None if others else data


def staged(params, config: PipelineConfig):
    """A stack's parameters [n, ...] (stored in layer order, split over the stages) ->
    [S, R, k, ...], stage s's run r the chunk r S + s: as they lie for GPipe, moved to
    their stages for the circular schedule (`circular_order`)."""
    mesh = _context(layout_lib.active()[1])[0]
    axis, s_count, r_count = stage_axis(), stages(), config.chunks
    n = jax.tree_util.tree_leaves(params)[0].shape[0]
    if n % (s_count * r_count):
        raise split_refused(n, s_count, r_count)
    k = n // (s_count * r_count)

    def one(p):
        if r_count == 1:
            return p.reshape(s_count, 1, k, *p.shape[1:])
        return circular_order(p, axis, mesh, s_count, r_count)

    return jax.tree_util.tree_map(one, params)


def _stage(config: PipelineConfig, chunk: Chunk, params, x: jax.Array, per_row, key,
           reductions: Reductions, stage, data_ways: int, scatter: bool, data: str | None
           ) -> tuple[jax.Array, Any]:
    """One stage's program (`run`, inside the shard_map): its runs' `params` [R, k, ...],
    the rows at hand `x` (a data shard's, or all of them split `data_ways` ways), its index
    `stage`; returns the stack's output (with `scatter` the stage's 1/S of the rows, else
    all of them, every stage's alike) and its runs' statistics [R, k, ...] (over the data
    shards of the manual axis `data`, where not None)."""
    axis, s_count, r_count = stage_axis(), stages(), config.chunks
    m_count = microbatch_count(config, x.shape[0], s_count, data_ways)
    names = ("batch", "length", "d_model")[: x.ndim]
    micro = layout_lib.constrain(microbatched(x, m_count), (None, *names),
                                 "pipeline microbatches")
    rows = jax.tree_util.tree_map(lambda a: microbatched(jnp.asarray(a), m_count), per_row)
    ring = [(s, (s + 1) % s_count) for s in range(s_count)]

    def iteration(carry, t):
        state, held, totals = carry
        step = t - stage  # where this stage is: repeat r, microbatch m
        valid = (step >= 0) & (step < r_count * m_count)
        m, r = step % m_count, jnp.clip(step // m_count, 0, r_count - 1)
        # stage 0 takes microbatch t % M: from the input in the first repeat, after it what
        # came round from the last stage
        entering = jnp.where(t < m_count, micro[t % m_count], held[t % m_count])
        state = jnp.where(stage == 0, entering, state)
        here = jax.tree_util.tree_map(lambda a: a[m], rows)
        run_r = jax.tree_util.tree_map(
            lambda q: q[0] if r_count == 1 else checkpoint_name(
                jax.lax.dynamic_index_in_dim(q, r, 0, False), RUN_WEIGHTS), params)
        out, stats = chunk(run_r, state, here,
                           None if key is None else jax.random.fold_in(key, t))
        state = jax.lax.ppermute(out, axis, ring)  # to the next stage, the last's to the first
        # what reached stage 0 is the last stage's microbatch (t - S + 1) % M: kept there
        last = (t - (s_count - 1)) % m_count
        held = held.at[last].set(jnp.where(t >= s_count - 1, state, held[last]))
        return (state, held, add(totals, stats, r, valid, reductions)), None

    stats_shape = jax.eval_shape(
        chunk, jax.tree_util.tree_map(lambda q: q[0], params), micro[0],
        jax.tree_util.tree_map(lambda a: a[0], rows), key)[1]
    carry = (jnp.zeros_like(micro[0]), jnp.zeros_like(micro),
             zeros(stats_shape, r_count, reductions))
    # (a run's weights, picked by the iteration, are picked again for the backward pass
    # rather than kept once per iteration)
    iteration = jax.checkpoint(iteration, policy=jax.checkpoint_policies.
                               save_anything_except_these_names(RUN_WEIGHTS))
    (_, held, totals), _ = jax.lax.scan(iteration, carry,
                                        jnp.arange(r_count * m_count + s_count - 1))
    # stage 0 holds every microbatch's output: sent to every stage once (each its share)
    out = unbatched(jnp.where(stage == 0, held, jnp.zeros_like(held)))
    out = (jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True) if scatter
           else jax.lax.psum(out, axis))
    if data is not None:
        totals, m_count = over_shards(totals, data, reductions), m_count * jax.lax.psum(1, data)
    return out, finish(totals, stats_shape, m_count, reductions)


def circular_order(p: jax.Array, axis: str, mesh, s_count: int, r_count: int) -> jax.Array:
    """A stack's parameter [n, ...] stored split over `axis` in layer order (stage s holds
    chunks s R .. s R + R - 1) -> [S, R, k, ...] with stage s holding chunks s, S + s, ...
    (the circular schedule's): each stage sends each of its chunks to the stage that runs
    it, chunk r S + s from stage (r S + s) // R to stage s, in R x R collective-permutes
    (autodiff sends the gradients back the same way)."""
    k = p.shape[0] // (s_count * r_count)

    def local(q):  # this stage's chunks [R k, ...] -> [1, R, k, ...]
        q = q.reshape(r_count, k, *q.shape[1:])
        runs = []
        for r in range(r_count):
            run_r = jnp.zeros_like(q[0])
            for j in range(r_count):  # the chunks that are their stage's j-th
                pairs = [((r * s_count + s) // r_count, s) for s in range(s_count)
                         if (r * s_count + s) % r_count == j]
                if pairs:
                    run_r = run_r + jax.lax.ppermute(q[j], axis, pairs)
            runs.append(run_r)
        return jnp.stack(runs)[None]

    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(axis),
                         out_specs=PartitionSpec(axis), axis_names={axis}, check_vma=False)(p)
