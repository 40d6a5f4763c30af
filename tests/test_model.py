"""The decoder-only LM: causality, packed segments, shared softmax, logical names."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtrain.models.transformer import DecoderLM, TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, d_model=16, d_ff=32, num_heads=2, d_kv=8, num_layers=2,
                           max_length=16)


def logits_fn(config=CONFIG):
    model = DecoderLM(config)
    ids = jnp.zeros((1, 12), jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), ids, ids + 1, ids))["params"]
    return params, jax.jit(lambda p, t, s, q: model.apply({"params": p}, t, s, q))


def test_no_peeking_at_the_future_or_other_segments():
    params, apply = logits_fn()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (1, 12))
    segments = np.array([[1] * 5 + [2] * 4 + [0] * 3])
    positions = np.array([list(range(5)) + list(range(4)) + [0] * 3])
    base = np.asarray(apply(params, tokens, segments, positions))
    # Logits at position i predict token i from tokens < i (inputs are shifted right).
    changed = tokens.copy()
    changed[0, 3] = (tokens[0, 3] % 63) + 1
    out = np.asarray(apply(params, changed, segments, positions))
    np.testing.assert_allclose(out[0, :4], base[0, :4], atol=1e-6)  # earlier positions unaffected
    assert np.abs(out[0, 4] - base[0, 4]).max() > 1e-4  # the next position sees it
    np.testing.assert_allclose(out[0, 5:9], base[0, 5:9], atol=1e-6)  # segment 2 does not
    # A second segment gives the same logits as the same tokens packed alone.
    alone = np.asarray(apply(params, np.pad(tokens[:, 5:9], ((0, 0), (0, 8))),
                             np.array([[1] * 4 + [0] * 8]), np.array([list(range(4)) + [0] * 8])))
    np.testing.assert_allclose(alone[0, :4], base[0, 5:9], atol=1e-5)


def test_shared_embedding_and_softmax():
    config = TransformerConfig(**{**CONFIG.__dict__, "shared_embedding_and_softmax": True})
    params, apply = logits_fn(config)
    assert "softmax" not in params
    ids = jnp.ones((1, 12), jnp.int32)
    logits = apply(params, ids, ids, jnp.arange(12)[None])
    assert logits.shape == (1, 12, 64)
    unshared, _ = logits_fn()
    assert unshared["softmax"].shape == (16, 64)


def test_every_parameter_has_logical_names():
    model = DecoderLM(CONFIG)
    ids = jnp.zeros((1, 12), jnp.int32)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))
    specs = nn.get_partition_spec(boxed)["params"]
    flat = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    names = {jax.tree_util.keystr(p): tuple(s) for p, s in flat}
    assert names["['layer_0']['mlp']['wi']"] == ("d_model", "d_ff")
    assert names["['layer_1']['self_attention']['o']"] == ("heads", "d_kv", "d_model")
    assert names["['token_embedding']['embedding']"] == ("vocab", "d_model")
    assert names["['softmax']"] == ("d_model", "vocab")
    assert all(all(n is not None for n in s) for s in names.values())
