"""The test processes' in-memory executable cache (`executable_cache`, installed by conftest):
a program lowered again to the same text is compiled once; one with host callbacks is
compiled with its own."""

import jax
import jax.numpy as jnp
import numpy as np

import executable_cache


def test_the_same_program_from_another_function_is_compiled_once():
    x = jnp.arange(8.0)
    first = jax.jit(lambda v: jnp.sin(v) * 3.0)(x)  # (two functions jax's caches tell apart)
    kept = executable_cache.size()
    second = jax.jit(lambda v: jnp.sin(v) * 3.0)(x)
    assert executable_cache.size() == kept
    np.testing.assert_array_equal(first, second)
    jax.jit(lambda v: jnp.sin(v) * 4.0)(x)  # (another program: another executable)
    assert executable_cache.size() == kept + 1


def test_a_program_with_a_callback_calls_its_own():
    def with_callback(value):
        out = jax.ShapeDtypeStruct((), jnp.float32)
        return jax.jit(lambda v: jax.pure_callback(lambda: np.float32(value), out) + v)

    zero = jnp.float32(0)
    kept = executable_cache.size()
    assert float(with_callback(1.0)(zero)) == 1.0
    assert float(with_callback(2.0)(zero)) == 2.0
    assert executable_cache.size() == kept
