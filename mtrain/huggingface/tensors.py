"""The safetensors format, read a slice at a time and written a tensor at a time.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{...}}``, offsets counted from the end of the header), then every tensor's bytes, C order.
A model folder holds ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``).

`Folder` checks every header when it opens (dtypes, sizes, files long enough: a truncated
shard is an error before anything is read) and `Folder.read` reads rows ``[start, stop)``
of a tensor's first axis with one ``pread``: only those bytes leave the disk, and no more
than them is held. The safetensors package's numpy reader refuses bfloat16, which most
published checkpoints are; this reads float32, bfloat16 (through ml_dtypes) and float16 and
returns float32. `write_folder` writes a folder in shards of at most `max_shard_bytes`,
asking for each tensor only when its turn comes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

from mtrain.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F16": np.dtype(np.float16)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size


class TensorFileError(UserError):
    """A weights file that is missing, unreadable, truncated, or holds a tensor mtrain cannot
    take."""


class Folder:
    """The tensors of a Hugging Face model folder (`path`), by name."""

    def __init__(self, path: str, single: str = SINGLE):
        """`single`: the name of an unsharded folder's one file (a PEFT adapter's
        ``adapter_model.safetensors``)."""
        self.path = path
        index = os.path.join(path, INDEX)
        if single == SINGLE and os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise TensorFileError(f"{index} cannot be read: {_reason(e)}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(path, single)):
            weight_map, files = None, [single]
        else:
            raise TensorFileError(f"{path} has no {single} nor {INDEX}: not a Hugging Face "
                                  f"model folder with safetensors weights")
        self._tensors: dict[str, tuple[str, np.dtype, tuple[int, ...], int]] = {}
        for name in files:
            for tensor, entry in _header(os.path.join(path, name)).items():
                self._tensors[tensor] = (os.path.join(path, name), *entry)
        for tensor, name in (weight_map or {}).items():
            if self._tensors.get(tensor, (None,))[0] != os.path.join(path, name):
                raise TensorFileError(f"{index} puts {tensor} in {name}, which does not hold it")

    def add(self, path: str, file: str) -> "Folder":
        """Also the tensors of `file` in the folder `path` (a PEFT adapter's
        ``adapter_model.safetensors`` beside its base's)."""
        full = os.path.join(path, file)
        if not os.path.exists(full):
            raise TensorFileError(f"{path} has no {file}")
        for tensor, entry in _header(full).items():
            self._tensors[tensor] = (full, *entry)
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self._tensors[name][1]

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of tensor `name` along its first axis, as float32."""
        file, dtype, shape, offset = self._tensors[name]
        if not shape:
            start, stop, row = 0, 1, dtype.itemsize
        else:
            stop = shape[0] if stop is None else stop
            row = dtype.itemsize * math.prod(shape[1:])
        count = (stop - start) * row
        try:
            with open(file, "rb") as f:
                data = os.pread(f.fileno(), count, offset + start * row)
        except OSError as e:
            raise TensorFileError(f"{file} cannot be read: {_reason(e)}") from None
        if len(data) != count:
            raise TensorFileError(f"{file} is truncated: {name} needs bytes it does not hold")
        array = np.frombuffer(data, dtype).reshape((stop - start, *shape[1:]) if shape else ())
        return array.astype(np.float32)


def _header(file: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """{tensor: (dtype, shape, absolute byte offset)} of a safetensors file, every entry
    checked against the file's size."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > min(size - 8, 100 * 2**20):
                raise TensorFileError(f"{file} is not a safetensors file (its header is cut "
                                      f"or missing)")
            header = json.loads(f.read(length))
    except TensorFileError:
        raise
    except (OSError, ValueError) as e:
        raise TensorFileError(f"{file} cannot be read as safetensors: {_reason(e)}") from None
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(f"{file}: the header's entry for {name} is malformed") from None
        if kind not in DTYPES:
            raise TensorFileError(f"{file}: {name} is {kind}; mtrain imports float32 (F32), "
                                  f"bfloat16 (BF16) and float16 (F16) weights")
        if end - begin != DTYPES[kind].itemsize * math.prod(shape):
            raise TensorFileError(f"{file}: {name} has {end - begin} bytes for shape "
                                  f"{list(shape)} of {kind}")
        if 8 + length + end > size:
            raise TensorFileError(f"{file} is truncated: it has {size} bytes, its header "
                                  f"places {name} up to byte {8 + length + end}")
        tensors[name] = (DTYPES[kind], shape, 8 + length + begin)
    return tensors


def write_folder(path: str, entries: Iterable[tuple[str, tuple[int, ...]]], dtype,
                 produce: Callable[[], Iterable[tuple[str, np.ndarray]]],
                 max_shard_bytes: int = MAX_SHARD_BYTES, single: str = SINGLE) -> list[str]:
    """Writes tensors of `dtype` (numpy or ml_dtypes) into `path` as ``model.safetensors``,
    or as shards ``model-0000k-of-0000n.safetensors`` of at most `max_shard_bytes` (a larger
    tensor alone in its shard) with the index file. `entries` are (name, shape) in order;
    `produce()` yields (name, array) in the same order, one at a time, each cast to `dtype`
    and written before the next is asked for. Returns the files written."""
    dtype = np.dtype(dtype)
    entries = [(name, tuple(shape)) for name, shape in entries]
    shards, size = [[]], 0
    for name, shape in entries:
        nbytes = dtype.itemsize * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = ([single] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tensors = iter(produce())
    for file, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = dtype.itemsize * math.prod(shape)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
        with open(os.path.join(path, file), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name, shape in shard:
                got, array = next(tensors)
                if got != name or tuple(array.shape) != shape:
                    raise ValueError(f"expected {name} {list(shape)}, got {got} "
                                     f"{list(array.shape)}")
                f.write(np.ascontiguousarray(array, dtype).reshape(-1).view(np.uint8).data)
    if len(shards) > 1:
        total = sum(dtype.itemsize * math.prod(shape) for _, shape in entries)
        weight_map = {name: file for file, shard in zip(names, shards) for name, _ in shard}
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        names.append(INDEX)
    return names


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or " ".join(str(e).split()) or type(e).__name__
