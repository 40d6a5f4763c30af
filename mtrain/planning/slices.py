"""Which devices a compiled collective joins, and what of it crosses the data-centre network.

A plan over ``--slices=N`` (TPU multislice, or N GPU nodes) joins N slices by the data-centre
network (DCN), much slower than the interconnect inside a slice (ICI, NVLink); the first mesh
dimension spans the slices: its index picks the slice. A device of the compiled (SPMD) program
is its partition id, its place in the mesh in row-major order, so a collective's replica
groups (or a collective-permute's pairs) say which slices it joins.

A collective whose groups span k slices of g_i devices each runs as the multislice runtimes
run it (XLA's hierarchical all-reduce, NCCL's tree over nodes): the part inside a slice over
ICI, the part between slices over DCN, on 1/g_i of the data where it can. For an all-reduce
of B bytes each device sends 2 B (g_i-1)/g_i over ICI (reduce-scatter and all-gather inside
the slice) and 2 (B/g_i) (k-1)/k over DCN (the all-reduce of its slice's shard between
slices); an all-gather producing B: B (g_i-1)/g_i and (B/g_i)(k-1)/k; a reduce-scatter
producing B: k B (g_i-1) and B (k-1); an all-to-all of B: B (g_i-1)/g and B (k-1)/k; a
collective-permute of B that crosses slices: B over DCN.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

from mtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
    """A mesh (dimension name -> size, in order) whose first dimension spans `slices`
    slices joined by the data-centre network (1: one slice, all ICI)."""

    mesh: tuple[tuple[str, int], ...]
    slices: int = 1

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.mesh)

    def axes(self, groups: list[list[int]]) -> str:
        """The mesh dimensions along which the members of `groups` differ, as
        ``"stage,batch"`` in mesh order ("" where no mesh is known)."""
        if not self.mesh or not groups:
            return ""
        sizes = [s for _, s in self.mesh]
        varies = np.zeros(len(sizes), bool)
        for group in groups:
            coords = np.array(np.unravel_index(np.asarray(group) % self.size, sizes))
            varies |= (coords != coords[:, :1]).any(axis=1)
        return ",".join(n for (n, _), v in zip(self.mesh, varies) if v)

    def span(self, groups: list[list[int]]) -> int:
        """The most slices any of `groups` joins."""
        if self.slices <= 1 or not groups:
            return 1
        per = self.size // self.slices
        return max(len({d // per for d in group}) for group in groups)


def check(layout, target, slices: int) -> None:
    """Raises ConfigError (one line) unless the first mesh dimension of `layout` can span
    `slices` slices joined by `target`'s data-centre network."""
    if slices < 1:
        raise ConfigError(f"--slices must be at least 1, got {slices}")
    if slices == 1:
        return
    if not layout.mesh_shape or layout.mesh_shape[0][1] % slices:
        first = ":".join(map(str, layout.mesh_shape[0])) if layout.mesh_shape else "none"
        raise ConfigError(f"--slices={slices}: the first mesh dimension spans the slices, so "
                          f"its size must be a multiple of {slices} (it is {first})")
    if not target.dcn_bandwidth:
        raise ConfigError(f"--slices={slices}: no data-centre network bandwidth is known for "
                          f"{target.name}")


def split(kind: str, g: int, k: int) -> tuple[float, float]:
    """(ICI, DCN) bytes each device sends per byte of a collective's result (an
    all-reduce's operand) over groups of `g` devices spanning `k` slices (module doc)."""
    if k <= 1:
        return {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g,
                "all-to-all": (g - 1) / g, "reduce-scatter": g - 1,
                "collective-permute": 1.0}[kind], 0.0
    gi = max(g // k, 1)
    return {"all-reduce": (2 * (gi - 1) / gi, 2 * (k - 1) / (k * gi)),
            "all-gather": ((gi - 1) / gi, (k - 1) / (k * gi)),
            "all-to-all": ((gi - 1) / g, (k - 1) / k),
            "reduce-scatter": (k * (gi - 1), k - 1),
            "collective-permute": (0.0, 1.0)}[kind]


@functools.lru_cache(maxsize=4096)
def _groups_cached(attributes: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    if m:  # a collective-permute: each pair that moves data is a group of two
        pairs = [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}",
                                                                         m.group(1))]
        return tuple(p for p in pairs if p[0] != p[1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if m:  # mesh['stage'=4,'batch'=2] {'stage'}: the listed axes vary within a group
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        listed = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in listed]
        ids = ids.transpose(rest + listed).reshape(-1, math.prod(sizes[i] for i in listed))
        return tuple(tuple(int(x) for x in row) for row in ids)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if m:  # iota groups [G,S]<=[dims]T(perm): arange reshaped, transposed, cut into rows
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return tuple(tuple(int(x) for x in row)
                     for row in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if m:  # explicit {{0,1},{2,3}}, or {} for all devices
        groups = [tuple(int(x) for x in g.split(",") if x)
                  for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return tuple(groups) if groups else (tuple(range(num_devices)),)
    return None


def groups_of(attributes: str, num_devices: int) -> list[list[int]] | None:
    """The device groups of an HLO collective's attributes: its replica groups (mesh, iota
    or explicit form; empty: all devices), or a collective-permute's pairs that move data
    (a pair to itself moves none); None where none is written in a form known here."""
    groups = _groups_cached(attributes.split(", metadata=")[0], num_devices)
    return None if groups is None else [list(g) for g in groups]
