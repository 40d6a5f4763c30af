"""Several TPU slices (multislice), or GPU nodes, as one mesh: the data-centre network
joins them, so the mesh's outermost dimension spans them (`Layout.make_mesh` puts the
dimension that splits ``layers``, else ``batch``'s, there with several processes) and the
others lie within a slice on its interconnect."""

from __future__ import annotations

from collections.abc import Sequence

from mtrain.parallel.layout_syntax import LayoutError


def sliced_grid(devices: Sequence, sizes: tuple[int, ...], names: tuple[str, ...]):
    """The devices of several TPU slices (their `slice_index`: multislice) as a grid of
    `sizes` whose outermost dimension spans the slices, which the data-centre network
    joins, and the others lie within a slice on its interconnect (`mesh_utils`' hybrid
    mesh); None for the devices of one slice. Raises `LayoutError` where the outermost
    dimension does not divide into the slices."""
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices <= 1:
        return None
    if sizes[0] % slices:
        raise LayoutError(
            f"the devices are {slices} slices, joined by the data-centre network, which the "
            f"mesh's outermost dimension spans: {names[0]!r} of size {sizes[0]} does not "
            f"divide into them — change the mesh shape (with several processes the "
            f"dimension that splits 'layers', else 'batch', is outermost)")
    from jax.experimental import mesh_utils

    return mesh_utils.create_hybrid_device_mesh(
        (sizes[0] // slices, *sizes[1:]), (slices, *[1] * (len(sizes) - 1)), list(devices))
