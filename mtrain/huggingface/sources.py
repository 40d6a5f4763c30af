"""How an mtrain parameter is made of a Hugging Face family's tensors, both ways: a
`Source` reads a device's slice of the parameter from a `tensors.Folder` (only the rows the
slice needs) and makes the tensors of the whole parameter for export. Which parameter is
which source is the weight table's (`weights.parameters`); `weights`' module doc says how
each family's tensors are laid out.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def ranges(index, shape) -> list[tuple[int, int]]:
    """A `jax.make_array_from_callback` index (slices, maybe open) as (start, stop) ranges."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


class Source:
    """An mtrain parameter of `shape` made of Hugging Face tensors: `read` makes a slice of
    it (ranges per axis) from a `tensors.Folder`, reading only the rows the slice needs;
    `tensors` are the (name, shape) it comes from, `to_hf` makes them from the whole
    parameter (export)."""

    shape: tuple[int, ...]

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    def read(self, folder, ranges) -> np.ndarray:
        raise NotImplementedError

    def to_hf(self, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        raise NotImplementedError


@dataclasses.dataclass
class Plain(Source):
    """The tensor as it is ([rows, ...]: norm scales, embedding tables); mtrain's rows
    past the tensor's `rows` (a padded vocabulary) are zeros."""

    name: str
    shape: tuple[int, ...]
    rows: int | None = None

    def tensors(self):
        return [(self.name, (self.rows or self.shape[0], *self.shape[1:]))]

    def read(self, folder, ranges):
        (start, stop), rest = ranges[0], ranges[1:]
        have = min(stop, self.rows or self.shape[0])
        out = np.zeros((stop - start, *[b - a for a, b in rest]), np.float32)
        if have > start:
            out[:have - start] = folder.read(self.name, start, have)[
                (slice(None), *[slice(a, b) for a, b in rest])]
        return out

    def to_hf(self, value):
        return [(self.name, value[:self.rows or self.shape[0]])]


@dataclasses.dataclass
class Transposed(Source):
    """mtrain [a, b] = the tensor [b, a] transposed (a linear layer's kernel; the untied
    softmax, whose b past `rows` are zeros; T5's relative bias)."""

    name: str
    shape: tuple[int, int]
    rows: int | None = None

    def tensors(self):
        return [(self.name, (self.rows or self.shape[1], self.shape[0]))]

    def read(self, folder, ranges):
        (a0, a1), (b0, b1) = ranges
        have = min(b1, self.rows or self.shape[1])
        out = np.zeros((a1 - a0, b1 - b0), np.float32)
        if have > b0:
            out[:, :have - b0] = folder.read(self.name, b0, have)[:, a0:a1].T
        return out

    def to_hf(self, value):
        return [(self.name, value[:, :self.rows or self.shape[1]].T)]


@dataclasses.dataclass
class HeadsIn(Source):
    """mtrain's q/k/v [d_model, heads, d_kv] = the projection [heads x d_kv, d_model],
    transposed and split into heads, times `scale` (Llama's d_kv^-0.5 on the queries)."""

    name: str
    shape: tuple[int, int, int]
    scale: float = 1.0

    def tensors(self):
        d, h, k = self.shape
        return [(self.name, (h * k, d))]

    def read(self, folder, ranges):
        (d0, d1), (h0, h1), (k0, k1) = ranges
        k = self.shape[2]
        rows = folder.read(self.name, h0 * k, h1 * k)[:, d0:d1]  # [heads x d_kv, d]
        out = rows.reshape(h1 - h0, k, d1 - d0)[:, k0:k1].transpose(2, 0, 1)
        return out * np.float32(self.scale) if self.scale != 1.0 else out

    def to_hf(self, value):
        d, h, k = self.shape
        if self.scale != 1.0:
            value = value / np.float32(self.scale)
        return [(self.name, value.reshape(d, h * k).T)]


@dataclasses.dataclass
class HeadsOut(Source):
    """mtrain's o [heads, d_kv, d_model] = the projection [d_model, heads x d_kv],
    transposed and split into heads."""

    name: str
    shape: tuple[int, int, int]

    def tensors(self):
        h, k, d = self.shape
        return [(self.name, (d, h * k))]

    def read(self, folder, ranges):
        (h0, h1), (k0, k1), (d0, d1) = ranges
        k = self.shape[1]
        rows = folder.read(self.name, d0, d1)[:, h0 * k:h1 * k]  # [d, heads x d_kv]
        return rows.reshape(d1 - d0, h1 - h0, k)[:, :, k0:k1].transpose(1, 2, 0)

    def to_hf(self, value):
        h, k, d = self.shape
        return [(self.name, value.reshape(h * k, d).T)]


@dataclasses.dataclass
class Reshaped(Source):
    """mtrain [a, b] = the tensor [a x b] (q/k/v biases split into heads)."""

    name: str
    shape: tuple[int, int]

    def tensors(self):
        return [(self.name, (self.shape[0] * self.shape[1],))]

    def read(self, folder, ranges):
        (a0, a1), (b0, b1) = ranges
        b = self.shape[1]
        return folder.read(self.name, a0 * b, a1 * b).reshape(a1 - a0, b)[:, b0:b1]

    def to_hf(self, value):
        return [(self.name, value.reshape(-1))]


@dataclasses.dataclass
class Stacked(Source):
    """mtrain [n, ...] = `parts` stacked (Mixtral's experts; scanned layers)."""

    parts: list
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        self.shape = (len(self.parts), *self.parts[0].shape)

    def tensors(self):
        return [t for part in self.parts for t in part.tensors()]

    def read(self, folder, ranges):
        (n0, n1), rest = ranges[0], ranges[1:]
        return np.stack([self.parts[i].read(folder, rest) for i in range(n0, n1)])

    def to_hf(self, value):
        return [t for part, v in zip(self.parts, value) for t in part.to_hf(v)]


@dataclasses.dataclass
class Strided(Source):
    """mtrain [..., n] = every `step`-th entry of the tensor's last axis [..., n x step], from
    `start` (gpt-oss's gate_up_proj [experts, d_model, 2 x d_ff]: the gates at 0::2, the up
    projections at 1::2). Export joins the parts of one tensor (`Part`, `whole`)."""

    name: str
    shape: tuple[int, ...]
    start: int
    step: int

    def tensors(self):
        return [(self.name, (*self.shape[:-1], self.shape[-1] * self.step))]

    def read(self, folder, ranges):
        (a0, a1), *middle, (f0, f1) = ranges
        rows = folder.read(self.name, a0, a1)
        last = slice(self.start + f0 * self.step, self.start + f1 * self.step, self.step)
        return rows[(slice(None), *[slice(a, b) for a, b in middle], last)]

    def to_hf(self, value):
        return [(self.name, Part(self.start, self.step, value))]


@dataclasses.dataclass
class Part:
    """What a `Strided` source exports: its entries of a tensor that other parts complete."""

    start: int
    step: int
    value: np.ndarray


@dataclasses.dataclass
class Copied(Source):
    """`source`, whose one tensor a checkpoint also holds under the names `copies`
    (DeepSeek's multi-token prediction modules keep copies of the embedding and the output
    head): the import reads the original and checks no copy; the export writes them all."""

    source: Source
    copies: tuple[str, ...]

    @property
    def shape(self):
        return self.source.shape

    def tensors(self):
        (_, shape), = self.source.tensors()
        return [*self.source.tensors(), *[(name, shape) for name in self.copies]]

    def read(self, folder, ranges):
        return self.source.read(folder, ranges)

    def to_hf(self, value):
        (name, tensor), = self.source.to_hf(value)
        return [(name, tensor), *[(copy, tensor) for copy in self.copies]]


def copies(sources) -> set[str]:
    """The names of the copies among the tensors of `sources` (which an import need not find)."""
    return {name for s in sources if isinstance(s, Copied) for name in s.copies} | {
        name for s in sources if isinstance(s, Stacked) for name in copies(s.parts)}


def entries(sources) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of the tensors `sources` export, each once, in the order `whole`
    yields them: where its last part comes."""
    order = {}
    for source in sources:
        for name, shape in source.tensors():
            order.pop(name, None)
            order[name] = shape
    return list(order.items())


def whole(tensors):
    """The (name, array) of exported `tensors` with the `Part`s of a tensor joined into it
    when its last part comes (each held until then)."""
    pending: dict[str, list[Part]] = {}
    for name, value in tensors:
        if not isinstance(value, Part):
            yield name, value
            continue
        parts = pending.setdefault(name, [])
        parts.append(value)
        if len(parts) == value.step:
            del pending[name]
            *lead, n = value.value.shape
            out = np.empty((*lead, n * value.step), value.value.dtype)
            for part in parts:
                out[..., part.start::part.step] = part.value
            yield name, out
