"""What a compiled step's HLO does: its matmul FLOPs and its collectives, loops counted per
iteration.

XLA's own cost analysis counts a loop's body once; `hlo_cost` walks the HLO text, follows
every called computation with the number of times it runs (a while loop's trip count from
its backend config), and adds up the dots' FLOPs and, per kind of collective, the bytes each
device sends (ring algorithms: an all-reduce of B bytes over g devices sends 2 B (g-1)/g, an
all-gather or all-to-all producing B sends B (g-1)/g, a reduce-scatter producing B sends
B (g-1), a collective-permute sends B). Given the mesh (`slices.Topology`), each collective's
bytes are also told by the mesh dimensions its groups span, and, where the first mesh
dimension spans slices joined by the data-centre network, split into what crosses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from mtrain.planning.slices import Topology, groups_of, split

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
    # of which the padding of dropless experts' padded all-to-alls (what a ragged all-to-all
    # does not send when routing is balanced: `mtrain.models.dropless`)
    padding_bytes: float = 0.0
    dcn_bytes: float = 0.0  # of which over the data-centre network (between slices)
    # bytes_sent by the mesh dimensions their groups span ("stage", "stage,batch"; "" where
    # no mesh was given or the groups are not known)
    over: dict[str, float] = dataclasses.field(default_factory=dict)


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
            mine.padding_bytes += times * s.padding_bytes
            mine.dcn_bytes += times * s.dcn_bytes
            for axes, sent in s.over.items():
                mine.over[axes] = mine.over.get(axes, 0.0) + times * sent

    @property
    def collective_bytes(self) -> float:
        return sum(s.bytes_sent for s in self.collectives.values())


def hlo_cost(hlo_text: str, num_devices: int,
             parameter_shapes: set[tuple[int, ...]] = frozenset(),
             topology: Topology | None = None) -> HloCost:
    """Every collective of a compiled (SPMD-partitioned) HLO module, by kind: how many, and
    the bytes each device sends; and the FLOPs of its matmuls. A buffer whose shape is that
    of a parameter (or its shard) is counted as parameter-shaped: a gradient or a gathered
    weight, not an activation.

    An all-reduce whose result every device only uses a 1/g slice of (its own, picked by
    partition id) is counted as the reduce-scatter it is: XLA's GPU and TPU pipelines
    rewrite it into one (ReduceScatterCreator), XLA:CPU keeps the pair. That is how the
    SPMD partitioner reduces a gradient into the shards of a parameter stored split
    (`run.parameter_layout_rules`).

    Counted per execution, as the program runs: a while loop's body as many times as its
    known trip count (scanned layers, microbatches; XLA's own cost analysis counts it once),
    and of a conditional's branches only the costliest (SGP's step compiles a
    collective-permute for each hop of its cycle, and one runs per step).

    With `topology` (the mesh, and the slices its first dimension spans), each collective's
    bytes are kept by the mesh dimensions its groups span (`CollectiveStats.over`), and
    those of a collective that joins slices are its ICI and DCN parts (`slices.split`:
    `dcn_bytes`); a collective-permute whose pairs all stay on their device sends nothing."""
    # Per computation: what its own instructions do, and what it calls, as (callees of
    # which the costliest runs, times). Instructions before any computation header (a bare
    # listing) form the entry, "".
    direct: dict[str, HloCost] = {}
    calls: dict[str, list[tuple[list[str], int]]] = {}
    computations, entry = _computations(hlo_text)
    for current, instructions in computations.items():
        direct[current], calls[current] = HloCost(), []
        shapes = {name: result for name, result, _, _ in instructions}
        ops = {name: op for name, _, op, _ in instructions}
        users: dict[str, list[tuple[str, str, str, str]]] = {}
        for instruction in instructions:
            for operand in set(_operands(instruction[3])):
                users.setdefault(operand, []).append(instruction)
        for name, result, op, rest in instructions:
            _note_calls(op, rest, calls[current])
            if op == "dot":
                direct[current].matmul_flops += _dot_flops(result, rest, shapes)
            elif op in COLLECTIVES:
                g = _group_size(rest) or num_devices
                groups = groups_of(rest, num_devices) if topology else None
                if op == "collective-permute" and groups == []:
                    continue
                where = (topology.span(groups), topology.axes(groups)) if topology else (1, "")
                elements = _shapes(result)
                sliced = [op == "all-reduce" and _only_sliced(name, i, len(elements), elements[i],
                                                              g, users, ops, shapes, computations)
                          for i in range(len(elements))]
                kept = [e for e, s in zip(elements, sliced) if not s]
                if kept:
                    stats = direct[current].collectives[op]
                    before = stats.bytes_sent
                    _add_collective(stats, op, kept, g, parameter_shapes, where=where)
                    # a block of routed rows padded to the most one device could send: a
                    # ragged all-to-all sends the rows, 1/n of it when routing is balanced
                    padded = re.search(r"routed_rows_1_in_(\d+)", rest)
                    if padded:
                        share = 1 / int(padded.group(1))
                        stats.padding_bytes += (stats.bytes_sent - before) * (1 - share)
                if any(sliced):  # as reduce-scatters producing the slices
                    _add_collective(direct[current].collectives["reduce-scatter"],
                                    "reduce-scatter",
                                    [(b, (math.prod(d) // g,)) for (b, d), s in
                                     zip(elements, sliced) if s], g, parameter_shapes,
                                    [d for (_, d), s in zip(elements, sliced) if s], where)

    @functools.lru_cache(maxsize=None)
    def total(name: str) -> HloCost:
        cost = HloCost()
        cost.add(direct.get(name, HloCost()))
        for callees, times in calls.get(name, []):
            cost.add(max((total(c) for c in callees),
                         key=lambda c: (c.collective_bytes, c.matmul_flops)), times)
        return cost

    return total(entry)


def _computations(hlo_text: str):
    """{computation: its instructions as (name, result type, opcode, the rest)}, and the
    entry computation's name."""
    computations: dict[str, list] = {"": []}
    entry = current = ""
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line[:1].isspace():  # a computation begins
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            entry = current if line.startswith("ENTRY") else entry
            computations[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, result, op, rest = m.groups()
            computations[current].append((name.lstrip("%"), result, op, rest))
    return computations, entry


def _operands(rest: str) -> list[str]:
    """The instructions an instruction reads (its operand list, before the attributes)."""
    depth, end = 1, len(rest)
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _only_sliced(name: str, index: int, count: int, element, g: int, users, ops,
                 shapes, computations) -> bool:
    """Whether every use of element `index` (of `count`) of all-reduce `name` keeps 1/g of
    it: a dynamic-slice of that size, or (XLA:CPU fuses it) an instruction that reads the
    partition id and is no larger than the slice, or a fusion that reads it only through
    such a dynamic-slice (in a scanned stack, fused with the write into the stacked
    gradient); a use that only casts or scales it (no other operand but scalars, as many
    elements) is followed to its own uses."""
    uses = users.get(name, [])
    if count > 1:  # a tuple: its elements are read through get-tuple-element
        uses = [(gte[0], u) for gte in uses if gte[2] == "get-tuple-element"
                and re.search(rf"\bindex={index}\b", gte[3]) for u in users.get(gte[0], [])]
    else:
        uses = [(name, u) for u in uses]
    size = math.prod(element[1])
    if g <= 1 or not uses or size < g:
        return False

    def scalar(operand: str) -> bool:
        return [d for _, d in _shapes(shapes.get(operand, ""))] == [()]

    for _ in range(4):  # through casts (XLA:CPU all-reduces bfloat16 in float32) and scalings
        casts = [(v, u) for v, u in uses
                 if u[2] in ("convert", "bitcast", "copy", "multiply", "fusion")
                 and sum(not scalar(o) for o in set(_operands(u[3]))) == 1
                 and [math.prod(d) for _, d in _shapes(u[1])] == [size]]
        uses = [x for x in uses if x not in casts] + [
            (u[0], w) for _, u in casts for w in users.get(u[0], [])]

    def slice_of(value: str, use) -> bool:
        _, result, op, rest = use
        largest = max((math.prod(d) for _, d in _shapes(result)), default=size)
        if op == "dynamic-slice" or any(ops.get(o) in ("partition-id", "replica-id")
                                        for o in _operands(rest)):
            return largest * g <= size
        callee = re.search(r"\bcalls=%?([\w.\-]+)", rest)
        if op != "fusion" or not callee or callee.group(1) not in computations:
            return False
        body = computations[callee.group(1)]
        position = _operands(rest).index(value)
        inner = [n for n, _, o, r in body if o == "parameter" and r.startswith(f"{position})")]
        reads = [u for u in body if inner and inner[0] in _operands(u[3])]
        return bool(reads) and all(
            u[2] == "dynamic-slice" and math.prod(_shapes(u[1])[0][1]) * g <= size for u in reads)

    return bool(uses) and all(slice_of(v, u) for v, u in uses)


def _note_calls(op: str, rest: str, calls: list) -> None:
    """The computations an instruction runs, and how many times."""
    if op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", rest).group(1)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        # A loop that runs as often as the data say (a grouped matmul's tiles in use) names
        # what balanced routing makes of it (`mtrain.models.grouped`).
        trips = trips or re.search(r"balanced_trips_(\d+)", rest)
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


def _add_collective(s: CollectiveStats, kind: str, elements, g: int, parameter_shapes,
                    logical=None, where: tuple[int, str] = (1, "")) -> None:
    """Adds one collective over groups of `g` devices producing `elements` ((bytes per
    element, dims) each; `logical`: the dims to match with parameter shapes, if others;
    `where`: the slices its groups span and the mesh dimensions, `slices.Topology`)."""
    if g <= 1 and kind != "collective-permute":
        return
    ici, dcn = split(kind, g, where[0])
    s.count += 1
    for (itemsize, dims), shape in zip(elements, logical or [d for _, d in elements]):
        size = itemsize * math.prod(dims)
        sent = size * (ici + dcn)
        s.bytes_sent += sent
        s.dcn_bytes += size * dcn
        s.over[where[1]] = s.over.get(where[1], 0.0) + sent
        if shape and shape in parameter_shapes:
            s.parameter_shaped_bytes += sent
