"""Bytes moved and dot FLOPs of one run of a compiled XLA program, read from its optimized
HLO text (`benchmarks/dense_step.py`'s accounting): every top-level instruction (a fusion, a
dot, a copy, a GPU's cuBLAS call) reads its operands and writes its result once (a fusion's
sliced operand counts as the slice, an in-place update as the update), and a while loop's
body counts as many times as its trip count (XLA's own `cost_analysis` counts it once). Each
instruction's bytes go to the item a `classify` function names; cuDNN's attention calls to
"attention".
"""

from __future__ import annotations

import collections
import math
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "iota"}


def arrays(shape: str) -> list[tuple[int, tuple[int, ...]]]:
    """(bytes per element, dims) of each array in an HLO type."""
    return [(_BYTES.get(t, 1), tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
    return sum(b * math.prod(d) for b, d in arrays(shape))


def _closing(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] in "([{"
        depth -= s[j] in ")]}"
        if depth == 0:
            return j
    return len(s)


def parse(text: str):
    """{computation: [(name, type, opcode, operands, attributes, is_root, arguments)]}, the
    entry's name."""
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            words = line.split()
            name = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            current = computations[name] = []
            entry = name if words[0] == "ENTRY" else entry
            continue
        if line.startswith("}"):
            current = None
        if current is None or " = " not in line:
            continue
        text_ = line.strip()
        root = text_.startswith("ROOT ")
        name, rest = text_.removeprefix("ROOT ").split(" = ", 1)
        if rest.startswith("("):
            j = _closing(rest, 0)
            kind, rest = rest[:j + 1], rest[j + 1:].lstrip()
        else:
            kind, rest = rest.split(" ", 1)
        k = rest.index("(")
        j = _closing(rest, k)
        current.append((name.lstrip("%"), kind, rest[:k],
                        re.findall(r"%([\w.\-]+)", rest[k:j + 1]), rest[j + 1:], root,
                        rest[k + 1:j]))
    return computations, entry


def _dot_flops(kind, operands, attributes, types) -> float:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
    lhs = arrays(types[operands[0]])[0][1]
    k = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
    return 2.0 * math.prod(arrays(kind)[0][1]) * k


def _fusion(computations, name):
    """A fused computation's dot FLOPs, the bytes it reads of each operand (a sliced one, or
    one converted or reshaped on its way to slices: the slices; the buffer it updates in
    place: none) and the bytes it writes (None: its result)."""
    body = computations[name]
    types = {i[0]: i[1] for i in body}
    users = collections.defaultdict(list)
    for i in body:
        for o in i[3]:
            users[o].append(i)

    def sliced(value, per_element):  # the elements of `value` that slices read, or None
        us = users[value]
        if not us:
            return None
        total = 0
        for u in us:
            if u[2] in ("dynamic-slice", "slice", "gather") and u[3][0] == value:
                total += math.prod(arrays(u[1])[0][1]) * per_element
            elif u[2] in ("convert", "bitcast", "reshape", "copy") and \
                    sliced(u[0], per_element) is not None:
                total += sliced(u[0], per_element)
            else:
                return None
        return total

    flops, reads, writes = 0.0, {}, None
    for name_, kind, op, operands, attributes, root, arguments in body:
        if op in ("dot", "convolution"):
            flops += _dot_flops(kind, operands, attributes, types)
        elif op in ("fusion", "call"):
            called = re.search(r"calls=%([\w.\-]+)", attributes)
            flops += _fusion(computations, called.group(1))[0] if called else 0
        elif op == "parameter":
            us = users[name_]
            part = sliced(name_, arrays(kind)[0][0]) if arrays(kind) else None
            if part is not None:
                read = part
            elif us and all(u[2] == "dynamic-update-slice" and u[3][0] == name_ for u in us):
                read = 0
            else:
                read = nbytes(kind)
            reads[int(arguments)] = read
        if root and op == "dynamic-update-slice":
            writes = nbytes(types[operands[1]])
    return flops, reads, writes


def account(text: str, classify) -> tuple[dict, list]:
    """Bytes and dot FLOPs by item (`classify(op, [(bytes/element, dims)], in_loop)`) of one
    run of a compiled module, and every instruction's row (bytes, FLOPs, item, op, type, name)."""
    computations, entry = parse(text)
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    rows = []

    def walk(name, times, in_loop):
        body = computations[name]
        types = {i[0]: i[1] for i in body}
        for name_, kind, op, operands, attributes, _, _ in body:
            if op in _FREE:
                continue
            if op == "while":  # (a loop of unknown trip count: once)
                n = int((re.search(r'known_trip_count":\{"n":"(\d+)"', attributes) or [0, 1])[1])
                walk(re.search(r"body=%([\w.\-]+)", attributes).group(1), times * n, True)
                continue
            if op in ("call", "conditional"):
                for called in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", attributes):
                    walk(called, times, in_loop)
                continue
            read = [nbytes(types.get(o, "")) for o in operands]
            written, flops = nbytes(kind), 0.0
            if op == "fusion":
                fused = re.search(r"calls=%([\w.\-]+)", attributes).group(1)
                flops, reads, writes = _fusion(computations, fused)
                read = [reads.get(k, r) for k, r in enumerate(read)]
                written = written if writes is None else writes
            elif op in ("dot", "convolution"):
                flops = _dot_flops(kind, operands, attributes, types)
            elif op == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)',
                                                   attributes):  # cuBLAS on a GPU
                lhs = arrays(types[operands[0]])[0][1]
                contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
                k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contracting.group(1))) \
                    if contracting else 1
                size, dims = arrays(kind)[0]  # (the result, not the workspace after it)
                written, flops = size * math.prod(dims), 2.0 * math.prod(dims) * k
            elif op in ("dynamic-slice", "slice"):
                read = [written]
            elif op == "dynamic-update-slice":
                written = nbytes(types[operands[1]])
                read = [written]
            touched = [a for o in operands for a in arrays(types.get(o, ""))] + arrays(kind)
            item = "attention" if re.search(r'custom_call_target="[^"]*fmha', attributes) \
                else classify(op, touched, in_loop, flops)
            b = times * (sum(read) + written)
            totals[item][0] += b
            totals[item][1] += times * flops
            rows.append((b, times * flops, item, op, kind, name_))

    walk(entry, 1, False)
    return dict(totals), rows
