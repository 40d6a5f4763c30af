"""Phase 2 of a run's build (`run.build`): the mesh and the layout rules of its settings,
the rules the mesh lacks dropped (with a warning where that probably loses a split), and the
mesh the mode lays the model out on (a plan, import or export on the devices there are)."""

from __future__ import annotations

import itertools
import math

import jax

from mtrain.errors import ConfigError
from mtrain.io.metrics import log
from mtrain.modes.experiment import RunConfig
from mtrain.parallel.layout import Layout, LayoutError

NO_DATA = ("plan", "import", "export")  # the modes that build the model without its data


def layout_and_mesh(s: RunConfig) -> tuple[Layout, jax.sharding.Mesh]:
    """Phase 2: the mesh and the layout rules."""
    layout = Layout(s.mesh_shape, s.layout_rules, s.parameter_layout_rules,
                    drop_unused_rules=True)
    warn_of_dropped_rules(layout)
    try:
        mesh = mesh_of(s, layout)
    except LayoutError as e:
        raise ConfigError(f"{e} — change run.mesh_shape (or, on CPU, --cpu_devices)") from None
    data_ways = layout.ways("batch")
    if s.num_microbatches > 1 and s.batch_size % (s.num_microbatches * data_ways):
        raise ConfigError(f"run.batch_size={s.batch_size} must split into "
                          f"run.num_microbatches={s.num_microbatches} microbatches of a "
                          f"multiple of {data_ways} rows (the mesh's batch dimension)")
    return layout, mesh


def warn_of_dropped_rules(layout: Layout) -> None:
    """Rules naming a mesh dimension the mesh lacks are dropped (Mesh-TF's way: one set of
    rules serves every mesh, the one-device mesh included), in silence unless the drop
    probably loses something the user meant: on a mesh of several devices, a mesh
    dimension that no rule left splits over (its devices would all do the same work: the
    dropped rule was likely meant for it, under another name), or rules of which none is
    left (``d_model:batch`` on a ``model:8`` mesh: no FSDP at all)."""
    kept = {m for _, m in [*layout.layout_rules, *layout.parameter_rules]}
    idle = [name for name, size in layout.mesh_shape if size > 1 and name not in kept]
    for kind, dropped, rules in (
            ("layout rules", layout.dropped_rules, layout.layout_rules),
            ("parameter layout rules", layout.dropped_parameter_rules, layout.parameter_rules)):
        if not dropped or layout.size == 1 or (rules and not idle):
            continue
        missing = " or ".join(repr(m) for m in sorted({m for _, m in dropped}))
        why = (f"; its dimension {' and '.join(repr(m) for m in idle)} splits nothing"
               if idle else ", so none of them applies")
        log.warning("%s %s ignored: the mesh %r has no dimension %s%s", kind,
                    ", ".join(f"'{t}:{m}'" for t, m in dropped), layout.mesh_text, missing, why)


def mesh_of(s: RunConfig, layout: Layout) -> jax.sharding.Mesh:
    """The mesh of `layout`: over every device of every process, but for the modes that
    only lay the model out. A plan lays it out on the mesh's first devices, however many
    the machine has (`__main__` simulates enough). An import or export in one process
    needs no mesh of the training run's shape (it reads or gathers each parameter whole):
    on the first devices where there are enough, else on a mesh of the same dimension
    names shrunk to fit the devices there are (`shrunk`): each size a divisor of the
    configured one, so that every split the layout checked still divides. The layout (its
    legality checks, the config written) stays the configured one."""
    if s.mode == "plan" or (s.mode in NO_DATA and jax.process_count() == 1):
        devices = jax.devices()
        if s.mode == "plan" or layout.size <= len(devices):
            return layout.make_mesh(devices[:layout.size])
        smaller = shrunk(layout, len(devices))
        log.info("--mode=%s: the mesh %r needs %d devices and this process has %d: the "
                 "parameters are laid out on the mesh %r", s.mode, layout.mesh_text,
                 layout.size, len(devices), smaller.mesh_text or "(one device)")
        return smaller.make_mesh(devices[:smaller.size])
    return layout.make_mesh()


def shrunk(layout: Layout, devices: int) -> Layout:
    """`layout`'s mesh with each dimension cut to a divisor of its size, on as many of
    `devices` as such a mesh can use (of equals, the one whose trailing dimensions, where
    Mesh-TF puts `model`, are largest: the one that splits parameters most); rules as
    `layout`'s."""
    best: tuple = ()
    for sizes in itertools.product(*[[d for d in range(1, n + 1) if n % d == 0]
                                     for _, n in layout.mesh_shape]):
        if math.prod(sizes) <= devices:
            best = max(best, (math.prod(sizes), sizes[::-1]))
    sizes = best[1][::-1] if best else ()
    mesh = ";".join(f"{name}:{size}" for (name, _), size in zip(layout.mesh_shape, sizes))
    return Layout(mesh, layout.rules_text, layout.parameter_rules_text)
