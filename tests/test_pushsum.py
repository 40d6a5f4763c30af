"""PushSum gossip on 8 replicas: exact consensus in log2(8) rounds, conservation of mass,
and de-biased convergence when messages are lost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.parallel import pushsum
from mtrain.parallel.layout import Layout
from mtrain.parallel.replica import replicate

MESH = Layout("batch:8").make_mesh()


def rounds(values, phases, drop=None):
    """Runs PushSum rounds with the given phases; returns x, w per replica after each."""
    drop = np.zeros((len(phases), 8), bool) if drop is None else drop

    def step(ctx, x, w, phase, lost):
        x, w = pushsum.mix(ctx, x[0], w[0], phase, delivered=~lost[0])
        return x[None], w[None]

    mix = replicate(step, MESH, split_inputs=(True, True, False, True), split_outputs=True)
    x, w = jnp.asarray(values, jnp.float32), jnp.ones(8, jnp.float32)
    history = []
    for phase, lost in zip(phases, drop):
        x, w = mix(x, w, jnp.int32(phase), jnp.asarray(lost))
        history.append((np.asarray(x), np.asarray(w)))
    return history


def test_three_rounds_of_the_exponential_graph_average_exactly():
    values = np.arange(8.0) ** 2
    history = rounds(values, [0, 1, 2])
    x, w = history[-1]
    np.testing.assert_allclose(x, values.mean(), rtol=1e-6)
    np.testing.assert_allclose(w, 1.0)
    assert not np.allclose(history[1][0], values.mean())  # two rounds are not enough
    for x, w in history:  # every round conserves the sums of x and of w
        assert x.sum() == pytest.approx(values.sum(), rel=1e-6)
        assert w.sum() == pytest.approx(8.0, rel=1e-6)


def test_with_lost_messages_the_debiased_value_still_reaches_the_average():
    rng = np.random.default_rng(0)
    values = rng.normal(size=8) * 10
    steps = 90
    drop = rng.random((steps, 8)) < 0.3  # 30% of the messages lost
    x, w = rounds(values, [s % 3 for s in range(steps)], drop)[-1]
    assert x.sum() == pytest.approx(values.sum(), rel=1e-5) and w.sum() == pytest.approx(8.0)
    z = x / w
    np.testing.assert_allclose(z, values.mean(), atol=1e-3)
    assert np.abs(x - values.mean()).max() > 0.1  # x alone is biased by the uneven weights


def test_pushsum_needs_a_power_of_two():
    assert pushsum.num_phases(8) == 3 and pushsum.num_phases(1) == 1
    with pytest.raises(ValueError, match="power-of-two"):
        pushsum.num_phases(6)


def test_debias_divides_by_the_weight():
    tree = {"a": jnp.array([2.0, 4.0]), "b": jnp.array(6.0)}
    out = pushsum.debias(tree, jnp.array(2.0))
    assert jax.tree_util.tree_map(float, out["b"]) == 3.0
    np.testing.assert_allclose(out["a"], [1.0, 2.0])
