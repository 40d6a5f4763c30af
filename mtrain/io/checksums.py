"""Checksums of what a checkpoint holds, verified on every restore.

TensorFlow's checkpoints (Mesh-TF's) carried a CRC32C per tensor. orbax writes TensorStore
arrays whose shard index carries one, but not their chunks, and offers no way to add
TensorStore's ``crc32c`` codec to them: a byte changed inside a chunk reads back silently.
So mtrain checks what it restores against what it saved:

- every array of the train state gets a 64-bit checksum, computed on the devices before the
  save and again after a restore (`of_arrays`): two sums, modulo 2^32, of the array's
  32-bit words, each word times an odd weight that depends on its position. A change of
  one word always changes both sums (an odd weight is invertible modulo 2^32); changes of
  several words go unseen with a chance of about 2^-64. Modular sums do not depend on the
  order of addition, so the checksum is the same for any mesh, layout or number of
  processes that holds the array;
- every file of the input position gets a SHA-256 (`of_files`, `verify_files`).

The checksums live in the checkpoint's meta (`checksums`) and in a ``<prefix>.sha256`` file
next to the input position's files.
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
from etils import epath

from mtrain.errors import UserError

_WEIGHTS = (0x9E3779B1, 0x85EBCA77)  # odd multipliers of 2 * position + 1 (itself odd)


class ChecksumMismatch(UserError):
    """Restored contents that are not what was saved."""


def _words(x: jax.Array) -> jax.Array:
    """`x` as uint32 words, one per element (wider types are folded into one word)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = jnp.dtype(x.dtype).itemsize * 8
    if bits == 64:
        pairs = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
        return pairs[..., 0] ^ (pairs[..., 1] * jnp.uint32(0x27D4EB2F))
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sums(x: jax.Array) -> jax.Array:
    """[2] uint32: the two weighted sums of `x`'s words. The position is built from iotas
    over `x`'s own shape (no reshape), so each device sums its shard where it lies."""
    words = _words(x)
    position, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        position = position + iota * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= words.shape[axis]
    odd = position * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words * odd * jnp.uint32(w), dtype=jnp.uint32)
                      for w in _WEIGHTS])


@jax.jit
def _all_sums(leaves):
    return [_sums(x) for x in leaves]


# The arrays summed by one call, at most: XLA keeps a few word-sized temporaries of every
# array of a call alive together (measured: one call over a 3.4 GB tree of a 0.84B-parameter
# model peaked 6.3 GB above it), so a large tree is summed in groups of this many bytes.
# A small model's tree is one group, one compilation, as before.
GROUP_BYTES = 256 * 2**20


def of_arrays(tree) -> dict[str, str]:
    """{path: 16 hex digits} for every array leaf of `tree` (any sharding)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups, size = [[]], 0
    for path, leaf in leaves:
        nbytes = leaf.size * leaf.dtype.itemsize
        if groups[-1] and size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(leaf)
        size += nbytes
    sums = [s for group in groups for s in jax.device_get(_all_sums(group))]
    return {jax.tree_util.keystr(path): f"{int(s[0]):08x}{int(s[1]):08x}"
            for (path, _), s in zip(leaves, sums)}


def mismatches(saved: dict[str, str], tree) -> list[str]:
    """The paths of `tree` whose arrays do not match the checksums `saved` of them."""
    now = of_arrays(tree)
    return [path for path, value in now.items() if path in saved and saved[path] != value]


def not_finite(tree) -> list[str]:
    """The paths of the floating-point arrays of `tree` holding a NaN or an infinity."""
    leaves = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
              if jnp.issubdtype(leaf.dtype, jnp.floating)]
    finite = jax.device_get(jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])(
        [leaf for _, leaf in leaves]))
    return [jax.tree_util.keystr(path) for (path, _), ok in zip(leaves, finite) if not ok]


def of_files(paths) -> dict[str, str]:
    """{file name: SHA-256} of each file (local or in a bucket)."""
    return {epath.Path(p).name: hashlib.sha256(epath.Path(p).read_bytes()).hexdigest()
            for p in paths}


def write_file_checksums(paths, to) -> None:
    from mtrain.io.textfiles import write_atomically

    write_atomically(to, json.dumps(of_files(paths), indent=1, sort_keys=True))


def verify_files(checksum_file) -> None:
    """Raises ChecksumMismatch naming the first file listed in `checksum_file` whose
    contents do not have its SHA-256."""
    checksum_file = epath.Path(checksum_file)
    expected = json.loads(checksum_file.read_text())
    for name, digest in sorted(expected.items()):
        path = checksum_file.parent / name
        if not path.exists():
            raise ChecksumMismatch(f"{path} is missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise ChecksumMismatch(f"{path} does not match its checksum")
