"""``--mode=plan --auto_layout``: every legal mesh and layout of a number of devices,
planned (`planner.plan`) and ranked: those that fit by estimated step time.

A model that can pipeline (a decoder-only LM of scanned layers) is also tried with its
layers split over a ``stage`` mesh dimension (`stage_layouts`) where nothing fits without,
or where slices joined by the data-centre network make the first mesh dimension's
collectives slow: then with the stage dimension first (over the slices) and behind
``batch`` (the gradients' all-reduce over the slices), ranked by the same step time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from mtrain.errors import ConfigError
from mtrain.parallel.layout import Layout, LayoutError
from mtrain.parallel.targets import GiB, Target
from mtrain.planning.planner import Plan, plan, seconds_text, sharded_bytes, size_text
from mtrain.training.trainer import Trainer

# Candidate layout rules per mesh: the Mesh-TF paper's (split d_ff, heads and vocab over
# `model`), the same with the vocabulary replicated, and d_model split instead; on 3-D meshes
# the paper's plus d_model over a third dimension (2-D weight sharding). Where the layout
# rules leave d_model whole, each is also tried with the parameters' d_model split over
# `batch` (fully sharded data parallelism).
_MODEL_RULES = ("batch:batch;d_ff:model;heads:model;vocab:model",
                "batch:batch;d_ff:model;heads:model",
                "batch:batch;d_model:model")
_3D_RULES = ("batch:batch;d_ff:model;heads:model;vocab:model;d_model:embed",)
_FSDP_RULES = "d_model:batch"
# Context parallelism (`models.context`), tried from this sequence length on.
_LENGTH_RULES = "batch:batch;length:seq"
LONG = 8192


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered factorizations of n into `parts` factors, each > 1."""
    if parts == 1:
        return [(n,)] if n > 1 else []
    return [(d, *rest) for d in range(2, n + 1) if n % d == 0
            for rest in _factorizations(n // d, parts - 1)]


def candidate_layouts(num_devices: int, experts: bool = False,
                      long: bool = False) -> list[tuple[str, str, str]]:
    """(mesh shape, layout rules, parameter layout rules) candidates for `num_devices`
    devices: pure data and pure model parallelism, every 2-D batch x model mesh with each of
    the model rules, every 3-D batch x model x embed mesh, and each of those whose layout
    rules leave d_model whole once more with FSDP's parameter rules. With `experts` (a
    mixture of experts), each also with the experts split over `batch` (expert
    parallelism) and, where it has a `model` dimension, over `model`. With `long` (a long
    sequence, `LONG`), ``length`` split over a ``seq`` mesh dimension as well: alone,
    beside ``batch``, and beside ``batch`` and the paper's ``model`` split."""
    if num_devices == 1:
        return [("", "", "")]
    out = [(f"batch:{num_devices}", "batch:batch"),
           (f"model:{num_devices}", _MODEL_RULES[0].replace("batch:batch;", ""))]
    for b, m in _factorizations(num_devices, 2):
        out += [(f"batch:{b};model:{m}", rules) for rules in _MODEL_RULES]
    for b, m, e in _factorizations(num_devices, 3):
        out += [(f"batch:{b};model:{m};embed:{e}", rules) for rules in _3D_RULES]
    if long:
        out += [(f"seq:{num_devices}", "length:seq")]
        out += [(f"batch:{b};seq:{s}", _LENGTH_RULES)
                for b, s in _factorizations(num_devices, 2)]
        out += [(f"batch:{b};seq:{s};model:{m}", f"{_LENGTH_RULES};{_MODEL_RULES[0][12:]}")
                for b, s, m in _factorizations(num_devices, 3)]
    if experts:
        out += [(mesh, f"{rules};experts:{dim}") for mesh, rules in list(out)
                for dim in ("batch", "model") if f"{dim}:" in mesh]
    fsdp = [(mesh, rules, _FSDP_RULES) for mesh, rules in out
            if mesh.startswith("batch:") and "d_model:" not in rules]
    return [(mesh, rules, "") for mesh, rules in out] + fsdp


_STAGE_RULES = "layers:stage;"


def stage_layouts(num_devices: int, layers: int, slices: int = 1) -> list[tuple[str, str, str]]:
    """Candidates that split a stack of `layers` layers over S stages (S dividing both the
    devices and the layers): ``stage:S`` beside ``batch``, and beside ``batch`` and the
    paper's ``model`` split; over several `slices`, each with ``stage`` first (it spans the
    slices) and, where S is no multiple of the slices or to compare, ``batch`` first."""
    out = []
    for stage in range(2, min(num_devices, layers) + 1):
        if num_devices % stage or layers % stage:
            continue
        rest = num_devices // stage
        meshes = [(f"batch:{rest}", "batch:batch")] if rest > 1 else [("", "")]
        meshes += [(f"batch:{b};model:{m}", _MODEL_RULES[0]) for b, m in _factorizations(rest, 2)]
        for mesh, rules in meshes:
            joined = f"{_STAGE_RULES}{rules}".rstrip(";")
            out.append((f"stage:{stage};{mesh}".rstrip(";"), joined, ""))
            if slices > 1 and mesh.startswith("batch:"):
                b, other = mesh.split(";", 1) if ";" in mesh else (mesh, "")
                out.append((";".join(x for x in (b, f"stage:{stage}", other) if x), joined, ""))
    return out


@dataclasses.dataclass
class Candidate:
    mesh_shape: str
    layout_rules: str
    parameter_layout_rules: str = ""
    plan: Plan | None = None
    rejected: str = ""  # why it was not compiled or does not fit


def auto_layout(make_trainer: Callable[[Layout], Trainer], num_devices: int, target: Target,
                progress: Callable[[str], None] = lambda message: None,
                experts: bool = False, sequence_length: int = 0, slices: int = 1,
                pipelines: int = 0) -> list[Candidate]:
    """Every candidate layout for `num_devices` (`experts`: of a mixture of experts; a
    `sequence_length` of `LONG` or more: with ``length`` splits too; see
    `candidate_layouts`), best first: those that fit ranked by estimated step time, then
    those that do not fit (least memory first), then the illegal ones. A candidate whose
    parameters and optimizer state alone overflow the target is not compiled. `slices`:
    the slices the first mesh dimension spans (`planner.plan`); `pipelines`: the layers of
    a stack that can pipeline (0: none), whose stage splits (`stage_layouts`) are tried
    too where no other candidate fits or `slices` > 1."""
    results: list[Candidate] = []

    def search(candidates, first=0, total=0):
        for i, (mesh_shape, rules, parameter_rules) in enumerate(candidates, first):
            results.append(_try(make_trainer, target, slices, mesh_shape, rules,
                                parameter_rules))
            c = results[-1]
            progress(f"[{i + 1}/{total or len(candidates)}] {mesh_shape or '(one device)'} "
                     f"{rules}" + (f" parameters {parameter_rules}" if parameter_rules else "")
                     + ": " + (c.rejected or f"{c.plan.step_seconds:.3g} s per step"))

    search(candidate_layouts(num_devices, experts, sequence_length >= LONG))
    if pipelines and (slices > 1 or not any(c.plan and c.plan.fits for c in results)):
        staged = stage_layouts(num_devices, pipelines, slices)
        search(staged, len(results), len(results) + len(staged))

    def rank(c: Candidate):
        if c.plan is None:
            return (2, math.inf, 0)
        if not c.plan.fits:
            return (1, c.plan.total_bytes, 0)
        return (0, c.plan.step_seconds, c.plan.total_bytes)

    return sorted(results, key=rank)


def _try(make_trainer, target: Target, slices: int, mesh_shape: str, rules: str,
         parameter_rules: str) -> Candidate:
    """One candidate, planned (or why not)."""
    c = Candidate(mesh_shape, rules, parameter_rules)
    try:
        layout = Layout(mesh_shape, rules, parameter_rules)
        if slices > 1 and (not layout.mesh_shape or layout.mesh_shape[0][1] % slices):
            c.rejected = (f"illegal: its first mesh dimension cannot span the {slices} "
                          f"slices")
            return c
        trainer = make_trainer(layout)
        state = sharded_bytes(trainer.abstract_state, trainer.state_shardings)
        if state > target.hbm_bytes:
            c.rejected = (f"does not fit: parameters and optimizer state alone take "
                          f"{state / GiB:.1f} GiB per device")
            return c
        c.plan = plan(trainer, target, slices=slices)
        if not c.plan.fits:
            c.rejected = f"does not fit: {c.plan.total_bytes / GiB:.1f} GiB per device"
    except (LayoutError, ConfigError) as e:
        c.rejected = "illegal: " + str(e).split(" — ")[0]
    return c



def format_auto_layout(results: list[Candidate], num_devices: int, target: str,
                       top: int = 5, slices: int = 1) -> str:
    fitting = [c for c in results if c.plan and c.plan.fits]
    compiled = sum(c.plan is not None for c in results)
    lines = [f"auto-layout for {num_devices} devices on {target}"
             + (f" in {slices} slices" if slices > 1 else "") + f": {len(results)} candidates, "
             f"{compiled} compiled, {len(fitting)} fit"]
    if not fitting:
        lines.append("none fits; the closest:")
    shown = (fitting or [c for c in results if c.plan])[:top]
    for rank, c in enumerate(shown, 1):
        p = c.plan
        lines += [
            f"#{rank}  step ~{seconds_text(p.step_seconds)}  {size_text(p.total_bytes)} per device  "
            f"MFU <= {100 * p.mfu:.0f}%  (compute {seconds_text(p.compute_seconds)}, memory "
            f"{seconds_text(p.memory_seconds)}, collectives {seconds_text(p.communication_seconds)}"
            + (f", pipeline bubble {100 * p.pipeline['bubble']:.0f}%" if p.pipeline else "") + ")",
            *("    " + line for line in p.gin_lines().splitlines()),
        ]
    rejected = [c for c in results if c.plan is None]
    if rejected:
        lines.append(f"not compiled ({len(rejected)}):")
        lines += [f"  {c.mesh_shape} {c.layout_rules}"
                  + (f" parameters {c.parameter_layout_rules}" if c.parameter_layout_rules else "")
                  + f": {c.rejected}" for c in rejected[:8]]
        if len(rejected) > 8:
            lines.append(f"  ... and {len(rejected) - 8} more")
    return "\n".join(lines)

