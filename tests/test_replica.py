"""The replica API: a step written for one replica, run on every replica of a mesh axis."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mtrain.parallel.layout import Layout
from mtrain.parallel.replica import replicate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import mlp_classifier  # noqa: E402

MESH8 = Layout("batch:8").make_mesh()


def test_cross_replica_primitives():
    def step(ctx, x):
        me = ctx.replica_id
        return {
            "id": me[None], "n": jnp.full((1,), ctx.num_replicas),
            "sum": ctx.all_sum(x)[None], "mean": ctx.all_mean(x)[None],
            "gathered": ctx.all_gather(x)[None], "from3": ctx.broadcast(x, source=3)[None],
            "next": ctx.send_to(x, 1)[None], "back2": ctx.send_to(x, -2)[None],
        }

    x = jnp.arange(8.0) * 10  # replica i holds 10 i
    out = replicate(lambda ctx, x: step(ctx, x[0]), MESH8, split_inputs=(True,),
                    split_outputs=True)(x)
    ids = np.arange(8)
    np.testing.assert_array_equal(out["id"], ids)
    np.testing.assert_array_equal(out["n"], 8)
    np.testing.assert_array_equal(out["sum"], 280.0)
    np.testing.assert_array_equal(out["mean"], 35.0)
    np.testing.assert_array_equal(out["gathered"], np.tile(x, (8, 1)))
    np.testing.assert_array_equal(out["from3"], 30.0)
    np.testing.assert_array_equal(out["next"], 10.0 * ((ids - 1) % 8))  # i got i-1's value
    np.testing.assert_array_equal(out["back2"], 10.0 * ((ids + 2) % 8))
    with pytest.raises(ValueError, match="no axis 'data'"):
        replicate(step, MESH8, axis="data")


def test_replicas_compose_with_model_parallelism():
    # batch:4;model:2: 4 replicas, each of them splitting its weight over `model`.
    layout = Layout("batch:4;model:2")
    mesh = layout.make_mesh()
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.normal(size=(16, 64)).astype(np.float32),
                       NamedSharding(mesh, P(None, "model")))
    x = rng.normal(size=(32, 16)).astype(np.float32)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def step(ctx, w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return ctx.all_mean(value), ctx.all_mean(grad)

    value, grad = replicate(step, mesh, split_inputs=(False, True))(w, x)
    want_value, want_grad = jax.value_and_grad(loss)(np.asarray(w), x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert grad.sharding.spec == P(None, "model")  # still split over `model`


def test_mlp_example_trains_the_same_on_8_replicas_as_on_1():
    args = mlp_classifier.parse_args(["--steps", "60"])
    eight = mlp_classifier.main(args)
    one = mlp_classifier.main(mlp_classifier.parse_args(["--steps", "60", "--mesh_shape", "batch:1"]))
    assert eight["accuracy"] > 0.95
    assert eight["loss"] == pytest.approx(one["loss"], rel=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(eight["params"]),
                    jax.tree_util.tree_leaves(one["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
