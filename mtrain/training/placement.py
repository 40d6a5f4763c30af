"""A batch on the devices: `PlacedBatch` (its global arrays and how its examples are packed),
`place` (a host batch made one) and `local_rows` (the rows of a global batch that this
process's devices hold, and so feed)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from mtrain.models.base import READ_INPUTS
from mtrain.parallel.layout import LayoutError

BATCH_NAMES = ("batch", "length")  # the logical dimensions of every batch feature


class PlacedBatch(dict):
    """A batch on the devices: feature name -> global array, and `packing` (`base.packing_of`
    of it; None where the model does not ask). A pytree whose structure (what jit compiles
    for) holds the packing."""

    def __init__(self, arrays: dict, packing: int | None = None):
        super().__init__(arrays)
        self.packing = packing

    def like(self, arrays: dict) -> "PlacedBatch":
        """Other arrays (e.g. a microbatch's) with this batch's packing."""
        return PlacedBatch(arrays, self.packing)


def _flatten_batch(batch: PlacedBatch):
    keys = tuple(sorted(batch))
    return [(jax.tree_util.DictKey(k), batch[k]) for k in keys], (keys, batch.packing)


jax.tree_util.register_pytree_with_keys(
    PlacedBatch, _flatten_batch,
    lambda aux, arrays: PlacedBatch(dict(zip(aux[0], arrays)), aux[1]))


def place(batch: dict, sharding: NamedSharding, shape: tuple[int, int],
          packing: int | None = None, order: np.ndarray | None = None,
          start_id: int = 0) -> PlacedBatch:
    """This process's rows of a global batch of `shape` (`local_rows`) -> global arrays laid
    out by `sharding`, with `packing`; each row's positions in `order` where one is given
    (context parallelism's load-balanced order, `models.context.length_order`: the
    positions, segment ids and weights travel with their tokens, and so does the token each
    target reads, `READ_INPUTS`, made first where the batch has none: the targets shifted
    right within their segments, `start_id` first, as the model would)."""
    if order is not None:
        if READ_INPUTS not in batch:
            targets, segments = (np.asarray(batch[k]) for k in ("targets", "targets_segment_ids"))
            before = np.pad(segments, ((0, 0), (1, 0)))[:, :-1]
            shifted = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
            batch = {**batch, READ_INPUTS: np.where(
                segments == before, shifted, np.where(segments > 0, start_id, 0)).astype(
                targets.dtype)}
        batch = {k: np.asarray(v)[:, order] for k, v in batch.items()}
    return PlacedBatch({k: jax.make_array_from_process_local_data(sharding, np.asarray(v), shape)
                        for k, v in batch.items()}, packing)


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int]:
    """The rows [start, stop) of a global array of `shape` laid out by `sharding` that this
    process's devices hold (see `Trainer.local_rows`)."""
    size = shape[0]
    slices = {(s[0].start or 0, size if s[0].stop is None else s[0].stop) for s in
              sharding.addressable_devices_indices_map(shape).values()}
    start, stop = min(a for a, _ in slices), max(b for _, b in slices)
    covered = sum(b - a for a, b in slices)
    if covered != stop - start or size % (stop - start) or start % (stop - start):
        raise LayoutError(
            f"this process's devices hold rows {sorted(slices)} of the batch, not one "
            f"block of it: put the hosts along the batch mesh dimension")
    return start, stop
