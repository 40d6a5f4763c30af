"""The Mesh-TensorFlow layout language on top of `jax.sharding`.

A *mesh shape* names the processor dimensions: ``"batch:16;model:32"``.
*Layout rules* map tensor-dimension names to mesh-dimension names:
``"batch:batch;d_ff:model;heads:model"``. A tensor dimension without a rule is replicated.

`Layout` turns a tuple of logical dimension names (``("d_model", "d_ff")``) into a
`PartitionSpec` over mesh dimensions (``P(None, "model")``), checking Mesh-TF's legality rules:
one mesh dimension splits at most one dimension of a tensor, and a split dimension must be
divisible by the size of its mesh dimension. Every violation is a `LayoutError` that says what
to change. One exception is by name: an ``experts`` dimension claims its mesh dimension
first (`LEADING`).

*Parameter layout rules* (``"d_model:batch"``) lay out parameters and optimizer state on top
of the layout rules, while activations follow the layout rules alone: the same rule syntax
expresses fully sharded data parallelism (ZeRO-3, FSDP), which one set of rules cannot (a
parameter's ``d_model`` split over ``batch`` would collide with an activation's ``batch``).
A parameter is stored by both rule sets and computed with by the layout rules alone (the
models constrain it so where they use it: it is gathered from its shards there), so its
gradient is reduced back into the shards it is stored in.

Models call `constrain(x, names)` on their activations; it does nothing unless a layout is
active (`Layout.activate`), so model code knows dimension names but never meshes.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtrain.parallel.layout_syntax import LayoutError, parse_layout_rules, parse_mesh_shape
from mtrain.parallel.slices import sliced_grid

# Tensor dimensions that claim their mesh dimension before the others of a tensor: an
# expert's weights and inputs [experts, ...] split over `experts` keep whole the dimensions
# whose rules name the same mesh dimension (the groups of tokens under ``experts:batch``,
# an expert's ``d_ff`` under ``experts:model;d_ff:model``), as Mesh-TF's MoE renames them
# ``batch_unsplit``: expert parallelism and the rules of the dense layers live side by side.
LEADING = ("experts",)

# The mesh dimension names mtrain's gin files and layout search use: a rule may name one
# that the mesh at hand lacks (dropped, as in Mesh-TF).
MESH_DIMS = ("batch", "model", "embed")


class Layout:
    """A mesh shape plus layout rules: logical dimension names -> `PartitionSpec`s and a `Mesh`."""

    def __init__(self, mesh_shape: str | Sequence = "", layout_rules: str | Sequence = "",
                 parameter_rules: str | Sequence = "", drop_unused_rules: bool = False):
        """`parameter_rules` lay out parameters (and optimizer state) on top of
        `layout_rules`: for a parameter, a parameter rule takes the place of a layout rule
        for the same tensor dimension. `drop_unused_rules`: ignore rules whose mesh dimension
        the mesh lacks (Mesh-TF's behaviour, so one set of rules serves every mesh) instead
        of raising `LayoutError`; the dropped rules are kept in `self.dropped_rules` and
        `self.dropped_parameter_rules`."""
        self.mesh_shape = parse_mesh_shape(mesh_shape)
        self.layout_rules = parse_layout_rules(layout_rules)
        self.parameter_rules = parse_layout_rules(parameter_rules, "parameter layout rules")
        self.mesh_dims = dict(self.mesh_shape)
        self.dropped_rules, self.dropped_parameter_rules = [], []
        if drop_unused_rules:
            self._check_spelling()
            self.dropped_rules = [r for r in self.layout_rules if r[1] not in self.mesh_dims]
            self.layout_rules = [r for r in self.layout_rules if r[1] in self.mesh_dims]
            self.dropped_parameter_rules = [r for r in self.parameter_rules
                                            if r[1] not in self.mesh_dims]
            self.parameter_rules = [r for r in self.parameter_rules if r[1] in self.mesh_dims]
        for kind, rules in (("layout rule", self.layout_rules),
                            ("parameter layout rule", self.parameter_rules)):
            for tensor_dim, mesh_dim in rules:
                if mesh_dim not in self.mesh_dims:
                    raise LayoutError(
                        f"{kind} '{tensor_dim}:{mesh_dim}' names mesh dimension {mesh_dim!r}, "
                        f"but the mesh {self.mesh_text or '(one device)'!r} has no such "
                        f"dimension (it has {sorted(self.mesh_dims) or 'none'})"
                    )
        self.rules = dict(self.layout_rules)
        self.parameter_map = {**self.rules, **dict(self.parameter_rules)}
        self.seen_names: set[str] = set()  # every dimension name laid out so far
        self.seen_parameter_names: set[str] = set()  # those of parameters

    def _check_spelling(self) -> None:
        """A rule may name a mesh dimension this mesh lacks (it is dropped), but not one
        that is no mesh's name and looks like a misspelling of one (`MESH_DIMS`, or this
        mesh's): ``d_ff:modle`` would leave d_ff replicated without a word."""
        names = sorted({*MESH_DIMS, *self.mesh_dims})
        for kind, rules in (("layout rule", self.layout_rules),
                            ("parameter layout rule", self.parameter_rules)):
            for tensor_dim, mesh_dim in rules:
                if mesh_dim in names:
                    continue
                close = difflib.get_close_matches(mesh_dim, names, n=1, cutoff=0.6)
                if close:
                    raise LayoutError(
                        f"{kind} '{tensor_dim}:{mesh_dim}' names mesh dimension {mesh_dim!r}: "
                        f"did you mean {close[0]!r}? (the mesh "
                        f"{self.mesh_text or '(one device)'!r} has "
                        f"{sorted(self.mesh_dims) or 'no dimension'})")

    def check_rules_used(self) -> None:
        """Raises `LayoutError` if a rule (dropped ones included) names a tensor dimension
        that nothing laid out so far has (a parameter rule: no parameter): a typo such as
        ``dff:model`` would otherwise leave d_ff replicated without a word. Call it once the
        model's parameters and activations have been laid out (`Trainer` does)."""
        for kind, rules, seen, owners in (
                ("layout rule", [*self.layout_rules, *self.dropped_rules], self.seen_names,
                 "parameter or activation of the model has; its"),
                ("parameter layout rule", [*self.parameter_rules, *self.dropped_parameter_rules],
                 self.seen_parameter_names, "parameter of the model has; their")):
            for tensor_dim, mesh_dim in rules:
                if tensor_dim not in seen:
                    raise LayoutError(
                        f"{kind} '{tensor_dim}:{mesh_dim}' names tensor dimension "
                        f"{tensor_dim!r}, which no {owners} dimensions are "
                        f"{', '.join(sorted(seen))}")

    @property
    def size(self) -> int:
        """The number of devices the mesh needs."""
        return math.prod(self.mesh_dims.values())

    @property
    def mesh_text(self) -> str:
        """The mesh shape as a string (``"batch:4;model:2"``; ``""`` for one device)."""
        return ";".join(f"{n}:{s}" for n, s in self.mesh_shape)

    @property
    def rules_text(self) -> str:
        """The layout rules as a string (``"batch:batch;d_ff:model"``)."""
        return ";".join(f"{t}:{m}" for t, m in self.layout_rules)

    @property
    def parameter_rules_text(self) -> str:
        """The parameter layout rules as a string (``"d_model:batch"``; ``""``: none)."""
        return ";".join(f"{t}:{m}" for t, m in self.parameter_rules)

    def __repr__(self) -> str:
        return (f"Layout(mesh_shape={self.mesh_text or '(one device)'!r}, "
                f"layout_rules={self.rules_text!r}"
                + (f", parameter_rules={self.parameter_rules_text!r})"
                   if self.parameter_rules else ")"))

    def _rule(self, tensor_dim: str, parameter: bool) -> str:
        """The rule that splits `tensor_dim` (a parameter's, with `parameter`), as text."""
        if parameter and tensor_dim in dict(self.parameter_rules):
            return f"parameter rule '{tensor_dim}:{self.parameter_map[tensor_dim]}'"
        return f"layout rule '{tensor_dim}:{self.rules[tensor_dim]}'"

    def mesh_dim_for(self, tensor_dim: str | None) -> str | None:
        """The mesh dimension that splits `tensor_dim`, or None if it is replicated."""
        return None if tensor_dim is None else self.rules.get(tensor_dim)

    def ways(self, tensor_dim: str | None) -> int:
        """Into how many parts the mesh splits `tensor_dim` (1 if it is replicated)."""
        return self.mesh_dims.get(self.mesh_dim_for(tensor_dim), 1)

    def partition_spec(
        self,
        names: Sequence[str | None],
        shape: Sequence[int] | None = None,
        tensor: str = "tensor",
        parameter: bool = False,
    ) -> PartitionSpec:
        """Logical dimension names (and optionally the shape) of `tensor` -> a `PartitionSpec`;
        with `parameter`, as a parameter (or optimizer state) is stored: by the parameter
        rules on top of the layout rules.

        Raises `LayoutError` if two of its dimensions would be split over the same mesh
        dimension, or if a split dimension is not divisible by its mesh dimension.
        """
        names = tuple(names)
        self.seen_names.update(n for n in names if n is not None)
        if parameter:
            self.seen_parameter_names.update(n for n in names if n is not None)
        rules = self.parameter_map if parameter else self.rules
        if shape is not None and len(shape) != len(names):
            raise LayoutError(
                f"{tensor}: {len(names)} dimension names {names} for a tensor of rank {len(shape)}"
            )
        spec, used = [], {}
        # A leading dimension (`LEADING`: the experts of a mixture of experts) claims its
        # mesh dimension first: another dimension of the tensor split over it stays whole.
        claimed = {rules[n]: n for n in names if n in LEADING and n in rules}
        for i, name in enumerate(names):
            mesh_dim = None if name is None else rules.get(name)
            if mesh_dim is not None and claimed.get(mesh_dim, name) != name:
                mesh_dim = None
            if mesh_dim is not None:
                if mesh_dim in used:
                    which = "the layout rules"
                    if parameter and self.parameter_rules:
                        which = (f"the {self._rule(used[mesh_dim], True)} or the "
                                 f"{self._rule(name, True)}")
                    raise LayoutError(
                        f"{tensor} {names}: dimensions {used[mesh_dim]!r} and {name!r} are both "
                        f"split over mesh dimension {mesh_dim!r}; a mesh dimension may split at "
                        f"most one dimension of a tensor — change {which}"
                    )
                used[mesh_dim] = name
                if shape is not None and shape[i] % self.mesh_dims[mesh_dim]:
                    raise LayoutError(
                        f"{tensor} {names}: dimension {name!r} of size {shape[i]} is not divisible "
                        f"by mesh dimension {mesh_dim!r} of size {self.mesh_dims[mesh_dim]} — "
                        f"change the size, the mesh shape, or the {self._rule(name, parameter)}"
                    )
            spec.append(mesh_dim)
        return PartitionSpec(*spec)

    def make_mesh(self, devices: Sequence[jax.Device] | None = None,
                  data_major: bool | None = None) -> Mesh:
        """The `jax.sharding.Mesh` over `devices` (default: all devices of all processes).

        Devices are ordered by `jax.make_mesh` (mesh_utils), which respects TPU topologies and
        keeps the devices of one host together along the trailing mesh dimensions. With
        `data_major` (default: when there are several processes) the mesh dimension that
        splits `batch` is laid out outermost whatever its place in the mesh shape, so that
        the hosts lie along it and each feeds only its own rows of the batch; before it, the
        one that splits ``layers`` (pipeline stages: a stage a host or slice, the activations
        crossing between hosts rather than every gradient).
        """
        devices = list(jax.devices() if devices is None else devices)
        if self.size != len(devices):
            raise LayoutError(
                f"mesh shape {self.mesh_text!r} needs {self.size} devices, but "
                f"{len(devices)} are available")
        if not self.mesh_shape:  # the empty mesh: one device, everything replicated
            return Mesh(np.array(devices).reshape(()), ())
        names = tuple(n for n, _ in self.mesh_shape)
        sizes = tuple(s for _, s in self.mesh_shape)
        auto = (jax.sharding.AxisType.Auto,) * len(names)
        if data_major is None:
            data_major = jax.process_count() > 1
        outer = [self.rules.get("layers"), self.rules.get("batch")]
        rank = lambda i: outer.index(names[i]) if names[i] in outer else len(outer)  # noqa: E731
        order = sorted(range(len(names)), key=rank) if data_major else list(range(len(names)))
        ordered = tuple(names[i] for i in order)
        grid = sliced_grid(devices, tuple(sizes[i] for i in order), ordered)
        mesh = Mesh(grid, ordered, axis_types=auto) if grid is not None else jax.make_mesh(
            tuple(sizes[i] for i in order), ordered, axis_types=auto, devices=devices)
        if order == sorted(order):
            return mesh
        return Mesh(mesh.devices.transpose(np.argsort(order)), names, axis_types=auto)

    def sharding(
        self, mesh: Mesh, names: Sequence[str | None], shape: Sequence[int] | None = None,
        tensor: str = "tensor", parameter: bool = False,
    ) -> NamedSharding:
        return NamedSharding(mesh, self.partition_spec(names, shape, tensor, parameter))

    def without(self, tensor_dim: str) -> "Layout":
        """This layout with `tensor_dim` split nowhere (incremental decoding's ``length``:
        one position a step), on the same mesh; itself where nothing splits it."""
        if tensor_dim not in self.rules and tensor_dim not in dict(self.parameter_rules):
            return self
        keep = lambda rules: [r for r in rules if r[0] != tensor_dim]  # noqa: E731
        return Layout(self.mesh_shape, keep(self.layout_rules), keep(self.parameter_rules))

    @contextlib.contextmanager
    def activate(self, mesh: Mesh):
        """Makes `constrain` place activations on `mesh` by this layout (use while tracing)."""
        token = _ACTIVE.set((self, mesh))
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


_ACTIVE: contextvars.ContextVar[tuple[Layout, Mesh] | None] = contextvars.ContextVar(
    "mtrain_active_layout", default=None
)


def active() -> tuple[Layout, Mesh] | None:
    """The layout and mesh `Layout.activate` made active, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None], tensor: str = "activation",
              parameter: bool = False) -> jax.Array:
    """Constrains activation `x`, whose dimensions are called `names`, to the active layout
    (with `parameter`, to the layout a parameter or its gradient is stored in)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    layout, mesh = active
    context = jax.sharding.get_abstract_mesh()
    manual = context.manual_axes if not context.empty else ()
    given = tuple(names)
    if manual:
        # Inside a shard_map that is manual over some axes (mtrain.parallel.replica, a
        # pipeline's data shards): the tensor is already this shard's along them; constrain
        # over the automatic ones, on the mesh as the shard_map sees it.
        rules = layout.parameter_map if parameter else layout.rules
        names = tuple(None if rules.get(n) in manual else n for n in names)
    spec = layout.partition_spec(names, x.shape, tensor=tensor, parameter=parameter)
    if not parameter:
        spec = rows_over_stages(layout, spec, given, x.shape, manual)
    if manual:
        if all(s is None for s in spec):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(context, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def rows_over_stages(layout: Layout, spec: PartitionSpec, names: Sequence[str | None],
                     shape: Sequence[int], manual=()) -> PartitionSpec:
    """`spec` of an activation (dimensions `names`) with its ``batch`` also split over the
    mesh dimension that splits ``layers`` (pipeline stages), after its own split: outside
    the pipeline (where the stage dimension is not `manual`) the embedding, final norm,
    output head and loss so each do 1/S of the rows on each of the S stages instead of all
    of them S times (MaxText's ``activation_embed_and_logits_batch``). `spec` as it is
    where nothing splits ``layers``, the stage dimension already splits the tensor, or the
    rows do not divide."""
    stage = layout.mesh_dim_for("layers")
    if stage is None or stage in manual or "batch" not in names:
        return spec
    entries = [*spec, *[None] * (len(names) - len(spec))]
    if any(e == stage or (isinstance(e, tuple) and stage in e) for e in entries):
        return spec
    i = list(names).index("batch")
    own = entries[i]
    if shape[i] % (layout.mesh_dims[stage] * layout.mesh_dims.get(own, 1)):
        return spec
    entries[i] = stage if own is None else (own, stage)
    return PartitionSpec(*entries)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def use_parameter(x: jax.Array, names: tuple[str | None, ...], tensor: str) -> jax.Array:
    """Parameter `x` (dimensions `names`) laid out for use by the active layout's layout
    rules (`constrain`), its gradient laid out as the parameter is stored. Under parameter
    layout rules the forward pass gathers the parameter from its shards, and the backward
    pass reduces its gradient straight into them (a reduce-scatter), never whole: the
    plain constraint would also constrain the gradient to the layout of use, and so sum
    the whole gradient on every device first. `x` is first pinned to the stored layout, so
    that what comes before (a cast to bfloat16) runs on the shards and the gather moves the
    cast value."""
    return _use_parameter_forward(x, names, tensor)[0]


def _use_parameter_forward(x, names, tensor):
    stored = constrain(x, names, tensor, parameter=True)
    return constrain(stored, names, tensor), None


def _use_parameter_backward(names, tensor, _, gradient):
    return (constrain(gradient, names, "gradient of " + tensor, parameter=True),)


use_parameter.defvjp(_use_parameter_forward, _use_parameter_backward)


def is_names(x: Any) -> bool:
    """Whether `x` is a leaf of a tree of logical names: a `PartitionSpec` or None."""
    return x is None or isinstance(x, PartitionSpec)


def logical_names(spec: PartitionSpec | None, rank: int) -> tuple[str | None, ...]:
    """The dimension names a model gave a tensor of `rank` dimensions (a `PartitionSpec` of
    names, or None), padded with None (replicated) for the dimensions it did not name."""
    names = tuple(spec) if spec is not None else ()
    return names + (None,) * (rank - len(names))


def tree_shardings(layout: Layout, mesh: Mesh, logical_specs: Any, abstract: Any,
                   parameter: bool = False) -> Any:
    """Maps a tree of logical `PartitionSpec`s (names per dimension) to `NamedSharding`s
    (with `parameter`: as parameters and optimizer state are stored).

    `abstract` is the matching tree of shapes (e.g. from `jax.eval_shape`); each tensor is named
    by its path in error messages.
    """

    def one(path, spec, leaf):
        names = logical_names(spec, len(leaf.shape))
        return layout.sharding(mesh, names, leaf.shape, jax.tree_util.keystr(path), parameter)

    flat_specs, treedef = jax.tree_util.tree_flatten(logical_specs, is_leaf=is_names)
    flat_abstract = treedef.flatten_up_to(abstract)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(logical_specs, is_leaf=is_names)[0]]
    return treedef.unflatten([one(p, s, a) for p, s, a in zip(paths, flat_specs, flat_abstract)])
