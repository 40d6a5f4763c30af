"""Greedy and beam search on toy models written here: Markov tables and a model with history."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.evaluation import decoding

EOS = 1
NEVER = -1e9  # a logit that makes a token impossible in practice


def markov_model(stops, *, vocab=8, max_len=8, seed=0):
    """A second-order Markov model: logits = table[token before last, last token] + bias[row, step].

    The cache holds the token before the last one per row (so beam search must reorder it),
    each sequence's row in the batch, and a shared scalar step counter. Example `row` can
    only end at step ``stops[row]``, where EOS is almost certain (``None``: never ends);
    padding (0) is never produced.
    """
    rng = np.random.default_rng(seed)
    table = jnp.asarray(2 * rng.normal(size=(vocab, vocab, vocab)), jnp.float32)
    bias = np.zeros((len(stops), max_len, vocab), np.float32)
    bias[:, :, [0, EOS]] = NEVER
    for row, stop in enumerate(stops):
        if stop is not None:
            bias[row, stop, EOS] = 100.0
    bias = jnp.asarray(bias)

    def tokens_to_logits(ids, cache):
        last = ids[:, 0]
        logits = table[cache["prev"], last] + bias[cache["row"], cache["step"]]
        return logits, {"prev": last, "row": cache["row"], "step": cache["step"] + 1}

    n = len(stops)
    cache = {"prev": jnp.zeros((n,), jnp.int32), "row": jnp.arange(n), "step": jnp.array(0)}
    return tokens_to_logits, cache


def test_expand_to_beams_repeats_rows_and_keeps_scalars():
    tree = {"x": jnp.array([[1, 2], [3, 4]]), "step": jnp.array(5)}
    out = decoding.expand_to_beams(tree, 3)
    np.testing.assert_array_equal(out["x"], [[1, 2]] * 3 + [[3, 4]] * 3)  # row b * beam + k
    assert out["step"].shape == () and int(out["step"]) == 5


def test_cache_rows_must_match_the_batch():
    tokens_to_logits, cache = markov_model([2, 3])
    with pytest.raises(ValueError, match=r"\['prev'\].*leading dimension must be 3"):
        decoding.greedy_search(tokens_to_logits, cache, batch_size=3, max_decode_len=4)


def test_beam_size_one_is_greedy():
    # Row 2 never ends: beam search returns its alive beam, greedy its max_decode_len tokens.
    tokens_to_logits, cache = markov_model([2, 5, None])
    greedy = decoding.greedy_search(tokens_to_logits, cache, batch_size=3, max_decode_len=8)
    seqs, scores = decoding.beam_search(tokens_to_logits, cache, batch_size=3, beam_size=1,
                                        max_decode_len=8, alpha=0.0)
    assert seqs.shape == (3, 1, 8) and scores.shape == (3, 1)
    np.testing.assert_array_equal(seqs[:, 0], greedy)
    np.testing.assert_array_equal(greedy[0, 2:], [EOS, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(greedy[1, 5:], [EOS, 0, 0])
    assert np.all(greedy[2] > EOS) and np.all(greedy[:, :2] > EOS)


# A first-order model on 5 tokens (0 padding, 1 EOS, 2 A, 3 B, 4 C) where greedy is not
# optimal: A (0.6) beats B (0.4) first, but A is followed by near-uniform choices (EOS best,
# 0.28) while B is followed by C (0.85) and C by EOS (0.97). Rows: previous token.
TRAP_PROBS = np.array([
    [1e-9, 1e-9, 0.6, 0.4, 1e-9],   # start
    [1e-9, 0.25, 0.25, 0.25, 0.25],  # after EOS (never used)
    [1e-9, 0.28, 0.23, 0.24, 0.25],  # after A
    [1e-9, 0.05, 0.05, 0.05, 0.85],  # after B
    [1e-9, 0.97, 0.01, 0.01, 0.01],  # after C
])
TRAP_LOG_PROBS = np.log(TRAP_PROBS / TRAP_PROBS.sum(axis=1, keepdims=True))


def trap_model(ids, cache):
    return jnp.asarray(TRAP_LOG_PROBS, jnp.float32)[ids[:, 0]], cache


def brute_force(max_len, alpha):
    """All (score, sequence) ending with EOS within max_len tokens under TRAP, best first."""
    results = []
    for length in range(1, max_len + 1):
        for body in itertools.product(range(2, 5), repeat=length - 1):
            seq = (*body, EOS)
            log_prob = sum(TRAP_LOG_PROBS[prev, tok] for prev, tok in zip((0, *seq), seq))
            score = log_prob / ((5 + length) / 6) ** alpha
            results.append((score, seq + (0,) * (max_len - length)))
    return sorted(results, reverse=True)


@pytest.mark.parametrize("beam_size", [2, 3])
def test_beam_search_finds_the_best_sequence_greedy_misses(beam_size):
    max_len = 5
    seqs, scores = decoding.beam_search(trap_model, {}, batch_size=1, beam_size=beam_size,
                                        max_decode_len=max_len, alpha=0.0)
    best = brute_force(max_len, alpha=0.0)
    np.testing.assert_array_equal(seqs[0, 0], best[0][1])  # B C EOS
    np.testing.assert_array_equal(seqs[0, 0], [3, 4, EOS, 0, 0])
    # Beam search is exact here for the two best (it need not be further down the list).
    np.testing.assert_allclose(scores[0, :2], [best[0][0], best[1][0]], rtol=1e-5)
    np.testing.assert_array_equal(seqs[0, 1], best[1][1])  # A EOS
    greedy = decoding.greedy_search(trap_model, {}, batch_size=1, max_decode_len=max_len)
    np.testing.assert_array_equal(greedy[0], [2, EOS, 0, 0, 0])


def test_eos_ends_sequences_and_scores_use_the_length_penalty():
    seqs, scores = decoding.beam_search(trap_model, {}, batch_size=1, beam_size=2,
                                        max_decode_len=6, alpha=0.6)
    # The length penalty favours A C EOS (3 tokens) over A EOS (2), the second at alpha 0.
    np.testing.assert_array_equal(seqs[0], [[3, 4, EOS, 0, 0, 0], [2, 4, EOS, 0, 0, 0]])
    # B C EOS: log(0.4) + log(0.85) + log(0.97), divided by ((5 + 3) / 6) ** 0.6.
    expected = (np.log(0.4) + np.log(0.85) + np.log(0.97)) / (8 / 6) ** 0.6
    np.testing.assert_allclose(scores[0, 0], expected, rtol=1e-4)  # the table's 1e-9s aside
    best = brute_force(6, alpha=0.6)
    np.testing.assert_allclose(scores[0], [best[0][0], best[1][0]], rtol=1e-5)
    np.testing.assert_array_equal(seqs[0], [best[0][1], best[1][1]])


def test_slots_without_a_hypothesis_score_minus_infinity():
    # Tokens: 0 impossible, EOS and A equally likely. In 2 steps only E and A E can finish.
    def coin(ids, cache):
        return jnp.tile(jnp.array([-jnp.inf, 0.0, 0.0]), (ids.shape[0], 1)), cache

    seqs, scores = decoding.beam_search(coin, {}, batch_size=1, beam_size=3, max_decode_len=2,
                                        alpha=0.0)
    np.testing.assert_array_equal(seqs[0], [[EOS, 0], [2, EOS], [0, 0]])
    np.testing.assert_allclose(scores[0], [np.log(0.5), 2 * np.log(0.5), -np.inf], rtol=1e-6)


def test_jit_with_a_sharded_batch_matches_eager_with_rows_of_different_lengths():
    stops = [1, 4, 6, None]  # the last row never ends: its alive beams come back
    tokens_to_logits, cache = markov_model(stops, seed=1)
    eager_seqs, eager_scores = decoding.beam_search(tokens_to_logits, cache, 4, 3, 8, alpha=0.6)
    # The caller's way: jit with the cache's batch split over a mesh (scalars replicated).
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    spec = lambda x: jax.sharding.PartitionSpec(*(("data",) if x.ndim else ()))  # noqa: E731
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec(x))), cache)
    jitted = jax.jit(decoding.beam_search, static_argnums=(0, 2, 3, 4),
                     static_argnames=("alpha", "eos_id"))
    seqs, scores = jitted(tokens_to_logits, sharded, 4, 3, 8, alpha=0.6)
    np.testing.assert_array_equal(seqs, eager_seqs)
    np.testing.assert_allclose(scores, eager_scores, rtol=1e-6)
    for row, stop in enumerate(stops[:-1]):
        # Every beam ends exactly where its row can, and is padded with 0 after the EOS.
        np.testing.assert_array_equal(seqs[row, :, stop], EOS)
        assert np.all(seqs[row, :, :stop] > EOS) and np.all(seqs[row, :, stop + 1:] == 0)
    assert np.all(seqs[-1] > EOS) and np.all(np.isfinite(scores))
    assert all(len({tuple(s) for s in np.asarray(beams)}) == 3 for beams in seqs)  # distinct
    assert np.all(np.diff(scores, axis=1) <= 0)  # best first
    greedy = jax.jit(decoding.greedy_search, static_argnums=(0, 2, 3))
    greedy = greedy(tokens_to_logits, sharded, 4, 8)
    np.testing.assert_array_equal(greedy, decoding.greedy_search(tokens_to_logits, cache, 4, 8))


def history_model(batch, *, vocab=6, max_len=6, seed=2):
    """Logits depend on all earlier tokens and positions: sum_j weights[j, token_j] + a row bias.

    The cache keeps all tokens fed so far [n, max_len] (written at the shared step counter)
    and each sequence's row; a wrongly reordered cache gives other logits.
    """
    rng = np.random.default_rng(seed)
    weights = jnp.asarray(1.5 * rng.normal(size=(max_len, vocab, vocab)), jnp.float32)
    row_bias = np.asarray(rng.normal(size=(batch, vocab)), np.float32)
    row_bias[:, 0] = NEVER
    row_bias = jnp.asarray(row_bias)

    def tokens_to_logits(ids, cache):
        step = cache["step"]
        tokens = cache["tokens"].at[:, step].set(ids[:, 0])
        seen = jnp.arange(max_len) <= step
        per_position = weights[jnp.arange(max_len), tokens]  # [n, max_len, vocab]
        logits = jnp.einsum("j,njv->nv", seen.astype(jnp.float32), per_position)
        logits = logits + row_bias[cache["row"]] + (0.4 * step) * jax.nn.one_hot(EOS, vocab)
        return logits, {"tokens": tokens, "row": cache["row"], "step": step + 1}

    def init_cache(rows):
        return {"tokens": jnp.zeros((len(rows), max_len), jnp.int32), "row": jnp.asarray(rows),
                "step": jnp.array(0)}

    return tokens_to_logits, init_cache


def test_cache_follows_the_beams():
    batch, beam, max_len, alpha = 2, 3, 6, 0.6
    tokens_to_logits, init_cache = history_model(batch, max_len=max_len)
    seqs, scores = decoding.beam_search(tokens_to_logits, init_cache(np.arange(batch)), batch, beam,
                                        max_len, alpha=alpha)
    seqs, scores = np.asarray(seqs).reshape(batch * beam, max_len), np.asarray(scores).reshape(-1)
    assert np.all(np.isfinite(scores))
    # Replay every returned hypothesis on its own (one row each, fresh cache), summing the
    # log-probabilities of its tokens up to and including EOS (all max_len if none).
    cache = init_cache(np.repeat(np.arange(batch), beam))
    ids = jnp.zeros((batch * beam, 1), jnp.int32)
    log_prob, ended = np.zeros(batch * beam), np.zeros(batch * beam, bool)
    lengths = np.full(batch * beam, max_len)
    for step in range(max_len):
        logits, cache = tokens_to_logits(ids, cache)
        log_probs = np.asarray(jax.nn.log_softmax(logits))
        token_log_probs = log_probs[np.arange(batch * beam), seqs[:, step]]
        log_prob += np.where(ended, 0.0, token_log_probs)
        lengths = np.where(~ended & (seqs[:, step] == EOS), step + 1, lengths)
        ended |= seqs[:, step] == EOS
        ids = jnp.asarray(seqs[:, step:step + 1])
    assert ended.any() and len(set(lengths)) > 1  # the toy model gives EOS at several lengths
    np.testing.assert_allclose(scores * ((5 + lengths) / 6) ** alpha, log_prob, atol=1e-5)
