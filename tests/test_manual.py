"""`parallel.manual`: a shard_map given by logical dimension names, resolved through the
active layout, leaving out the axes a replica has already made manual."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mtrain.parallel import manual
from mtrain.parallel.layout import Layout
from mtrain.parallel.replica import replicate

NAMES = ("batch", None, "heads")


def shard_ids():
    """A function of x: x plus 10 x its ``batch`` shard and its ``heads`` shard (their axes
    resolved where the shard_map is made, not inside it, where they are manual)."""
    axes = [(manual.axis(name), scale) for name, scale in (("batch", 10), ("heads", 1))]

    def fn(x):
        assert manual.axis("heads") is None  # (manual here)
        return x + sum(scale * jax.lax.axis_index(a) for a, scale in axes if a is not None)

    return fn


def test_without_a_layout_the_function_runs_as_it_is():
    fn = lambda x: x  # noqa: E731
    assert manual.shard_map_by_names(fn, in_names=(NAMES,), out_names=NAMES) is fn
    assert manual.axis("batch") is None


def test_names_are_resolved_through_the_active_layout():
    layout = Layout("batch:4;model:2", "batch:batch;heads:model;experts:model;d_ff:model")
    mesh = layout.make_mesh()
    x = jnp.zeros((8, 3, 4), jnp.int32)
    with layout.activate(mesh):
        assert (manual.axis("batch"), manual.axis("heads"), manual.axis("length")) == \
            ("batch", "model", None)
        # (an expert's d_ff stays whole where experts claim its mesh dimension)
        assert manual.spec(("experts", None, "d_ff")) == P("model", None, None)
        got = jax.jit(manual.shard_map_by_names(shard_ids(), in_names=(NAMES,),
                                                out_names=NAMES))(x)
    want = 10 * (np.arange(8) // 2)[:, None, None] + (np.arange(4) // 2)[None, None, :]
    np.testing.assert_array_equal(got, np.broadcast_to(want, x.shape))


def test_nothing_split_runs_the_function_itself_unless_always():
    layout = Layout("batch:4;model:2", "batch:batch")
    with layout.activate(layout.make_mesh()):
        fn = lambda x: x  # noqa: E731
        assert manual.shard_map_by_names(fn, in_names=((None, "heads"),),
                                         out_names=(None, "heads")) is fn
        assert manual.shard_map_by_names(fn, in_names=((None, "heads"),),
                                         out_names=(None, "heads"), always=True) is not fn


def test_inside_a_replica_its_manual_axis_is_left_out():
    layout = Layout("batch:4;model:2", "batch:batch;heads:model")
    mesh = layout.make_mesh()
    x = jnp.zeros((8, 3, 4), jnp.int32)

    def step(ctx, x):
        with layout.activate(mesh):
            assert manual.axis("batch") is None and manual.axis("heads") == "model"
            return manual.shard_map_by_names(shard_ids(), in_names=(NAMES,), out_names=NAMES)(x)

    got = replicate(step, mesh, split_inputs=(True,), split_outputs=True)(x)
    want = (np.arange(4) // 2)[None, None, :]  # (batch: each replica's own, no shard id)
    np.testing.assert_array_equal(got, np.broadcast_to(want, x.shape))
