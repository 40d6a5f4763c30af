"""Examples as flat arrays: a key's examples are (values, row splits), example i being
values[splits[i]:splits[i + 1]] (tf.RaggedTensor's layout, in numpy). Tokenisers, formats,
packing and preference pairs all make and cut them with these."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

Flat = tuple[np.ndarray, np.ndarray]  # (values int32, row splits int64)


def row_splits(sizes: np.ndarray) -> np.ndarray:
    """The int64 row splits of examples of `sizes`: 0, then their running sum."""
    splits = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=splits[1:])
    return splits


def flat_ids(ids: list[list[int]]) -> Flat:
    """Lists of Python ints as (flat int32 ids, int64 row splits)."""
    splits = row_splits(np.fromiter((len(x) for x in ids), np.int64, len(ids)))
    return np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(splits[-1])), splits


def flat(ids: Sequence[Sequence[int]]) -> Flat:
    """Arrays of ids as (flat int32 values, int64 row splits) (lists of Python ints:
    `flat_ids`, faster for those)."""
    splits = row_splits(np.fromiter((len(x) for x in ids), np.int64, len(ids)))
    values = np.concatenate([np.asarray(x, np.int32) for x in ids]) if len(ids) else \
        np.zeros(0, np.int32)
    return values.astype(np.int32, copy=False), splits


def gather(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> Flat:
    """The runs values[starts[i]:starts[i] + sizes[i]] as examples."""
    splits = row_splits(sizes)
    index = np.arange(int(splits[-1])) - np.repeat(splits[:-1] - starts, sizes)
    return values[index], splits


def sums(x: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """The sum of `x` over each example of row splits `splits` (empty ones: 0)."""
    total = np.concatenate([[0], np.cumsum(x, dtype=np.int64)])
    return total[splits[1:]] - total[splits[:-1]]


def take(keys: dict[str, Flat], order: np.ndarray) -> dict[str, Flat]:
    """The examples `order` of every key of `keys`, in that order."""
    return {key: gather(values, splits[:-1][order], np.diff(splits)[order])
            for key, (values, splits) in keys.items()}


def concat(parts: list[dict[str, Flat]]) -> dict[str, Flat]:
    """The examples of several windows' keys, one after the other."""
    return {key: (np.concatenate([p[key][0] for p in parts]),
                  row_splits(np.concatenate([np.diff(p[key][1]) for p in parts])))
            for key in parts[0]}
