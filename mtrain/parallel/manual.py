"""Manual parallelism by logical names: `jax.shard_map` where a model needs to see its own
shard (a kernel XLA cannot partition, a ring of devices, experts that exchange tokens).

The model names its tensors' dimensions (``("batch", "length", "heads", None)``), as it does
for `layout.constrain`; `shard_map_by_names` resolves them through the active layout to the
mesh axes that split them, and `axis(name)`, asked where the shard_map is made, tells
which mesh axis splits a dimension (for the collectives of the function inside), so that
models still know dimension names but never meshes. Inside a shard_map that is already
manual over some axes (a replica's, `mtrain.parallel.replica`), those axes are left out:
the tensors are already this replica's along them, and the new shard_map takes the axes
still automatic, on the mesh as the replica sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from mtrain.parallel import layout as layout_lib


def _manual_axes() -> frozenset[str]:
    """The mesh axes already manual where this is traced (inside a replica's shard_map)."""
    context = jax.sharding.get_abstract_mesh()
    return frozenset(context.manual_axes) if not context.empty else frozenset()


def axis(name: str | None) -> str | None:
    """The mesh axis that splits logical dimension `name` in a `shard_map_by_names` made
    here: the active layout's, None where no layout is active, nothing splits `name`, or
    its axis is already manual (inside a replica, or inside a shard_map by names: ask
    before making it)."""
    active = layout_lib.active()
    if active is None or name is None:
        return None
    found = active[0].mesh_dim_for(name)
    return None if found in _manual_axes() else found


def _is_names(x: Any) -> bool:
    """Whether `x` is one tensor's dimension names (a tuple of str or None)."""
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def spec(names: tuple[str | None, ...]) -> PartitionSpec:
    """The `PartitionSpec` of a tensor of dimension `names` in a `shard_map_by_names` traced
    here (`axis` of each; an ``experts`` dimension claims its axis first, as
    `layout.LEADING` says)."""
    axes = [axis(n) for n in names]
    claimed = {a: n for a, n in zip(axes, names) if n in layout_lib.LEADING and a is not None}
    return PartitionSpec(*(None if a is not None and claimed.get(a, n) != n else a
                           for a, n in zip(axes, names)))


def shard_map_by_names(fn: Callable, *, in_names, out_names, always: bool = False) -> Callable:
    """`fn` under `jax.shard_map` over the active layout's mesh, its arguments and results
    split as their dimension names say: `in_names` one entry per argument, `out_names` the
    results' (each a tuple of names, None for a dimension left whole, ``()`` for a scalar,
    or a pytree of such tuples where the argument is a pytree). `axis(name)`, asked here
    (inside `fn` the axes are manual already), is the mesh axis a dimension is split over,
    for `fn`'s collectives. `fn` itself where no layout is active, or where no
    dimension is split unless `always` (then every device runs `fn` whole, and XLA
    partitions nothing of it)."""
    active = layout_lib.active()
    if active is None:
        return fn
    to_specs = lambda tree: jax.tree_util.tree_map(spec, tree, is_leaf=_is_names)  # noqa: E731
    in_specs, out_specs = to_specs(tuple(in_names)), to_specs(out_names)
    split = [a for s in jax.tree_util.tree_leaves((in_specs, out_specs)) for a in s
             if a is not None]
    if not split and not always:
        return fn
    manual = _manual_axes()
    mesh = jax.sharding.get_abstract_mesh() if manual else active[1]
    free = frozenset(mesh.axis_names) - manual
    if not free:  # (every axis already manual: the arrays are this device's)
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=free, check_vma=False)
