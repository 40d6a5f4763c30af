"""How the dropless experts move their rows (`models.dropless`): sorted by expert and back
by gathers, forward and backward (`permute`: the gradient of a gather by a permutation is
the gather by its inverse, not the scatter autodiff makes), as MaxText sorts activations;
on a GPU a scatter of rows costs more than a gather. The layer's results are
test_dropless.py's."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models import dropless
from mtrain.parallel.layout import Layout


def test_a_permutations_gradient_is_the_gather_by_its_inverse():
    x = jnp.arange(18.0).reshape(6, 3)
    order = jnp.array([4, 0, 5, 2, 1, 3])
    inverse = jnp.argsort(order)
    g = jnp.asarray(np.random.default_rng(0).standard_normal((6, 3)), jnp.float32)
    y, vjp = jax.vjp(lambda x: dropless.permute(x, order, inverse), x)
    y_ref, vjp_ref = jax.vjp(lambda x: x[order], x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(vjp(g)[0], vjp_ref(g)[0])


def test_the_layer_moves_rows_by_gathers_forward_and_backward():
    """One device, XLA's ragged_dot (as a GPU runs it): the compiled forward and backward
    pass hold no scatter of floating-point rows (autodiff's of the gather with each token
    repeated top_k times, and the scatter back to the choices' order, were two)."""
    t, k, d, f, e = 64, 4, 16, 16, 8
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (2, t // 2, d))
    index = jax.random.randint(keys[1], (2, t // 2, k), 0, e + 1)  # (e: padding, nowhere)
    gates = jax.random.uniform(keys[2], (2, t // 2, k))
    wis = [jax.random.normal(keys[3], (e, d, f)), jax.random.normal(keys[4], (e, d, f))]
    wo = jnp.ones((e, f, d))
    layout = Layout("", "")
    mesh = layout.make_mesh(jax.devices()[:1])

    def loss(x, gates, wis, wo):
        with layout.activate(mesh):
            return dropless.experts(x, index, gates, wis, wo, activations=("silu", "linear"),
                                    kernel="ragged_dot").sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, gates, wis, wo).compile()
    assert not re.findall(r"= (f32|bf16)\[[^\]]*\]\S* scatter\(", hlo.as_text())
