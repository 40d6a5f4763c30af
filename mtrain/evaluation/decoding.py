"""Autoregressive decoding: greedy search, sampling after prompts and beam search,
model-agnostic and jit-able.

The model supplies a ``cache`` and a one-step function; nothing here knows about Flax:

- ``cache`` is the decoder's autoregressive state for ``batch_size`` rows, e.g. the Flax
  ``"cache"`` collection of a decoder initialised in decode mode: per-layer key/value buffers
  [batch, ...] and scalar decode positions. Every leaf with ndim >= 1 has one row per
  sequence; leaves with ndim 0 are shared by all rows and are never reordered.
- ``tokens_to_logits(ids, cache) -> (logits, new_cache)`` runs one decoder step: ``ids`` int32
  [n, 1] is the previous token of each of n sequences (0 at the first step, as the decoder's
  inputs are the targets shifted right), ``logits`` float [n, vocab] scores the next token.
  It closes over the parameters and, for an encoder-decoder, the encoder outputs. Beam search
  runs n = batch * beam rows (row ``b * beam + k`` is beam k of example b), so whatever the
  step function closes over must be expanded the same way with ``expand_to_beams``::

      encoded, mask = expand_to_beams((encoded, mask), beam_size)

      def tokens_to_logits(ids, cache):
          logits, new_vars = model.apply({"params": params, "cache": cache}, encoded, mask,
                                         ids, method=model.decode_step, mutable=["cache"])
          return logits, new_vars["cache"]

  (translation.py does exactly this for mtrain's EncoderDecoder.)

      seqs, scores = beam_search(tokens_to_logits, cache, batch, beam_size, max_len)

``beam_search`` expands ``cache`` itself. Both searches are a single ``lax.while_loop`` with
no Python control flow on traced values, so a caller can ``jax.jit`` them (the step function
and the sizes static) with sharded parameters and inputs. Returned sequences do not include
the initial 0; position 0 is the first generated token, and positions after EOS are 0 (id
0 may be a token too: what is output is told by EOS and lengths, never by the ids).

Beam search follows tensor2tensor and the Flax WMT example: each step keeps the best
``beam`` unfinished ("alive") hypotheses and the best ``beam`` finished ones (ended by EOS),
choosing among the top ``2 * beam`` extensions so that enough non-EOS candidates survive.
A hypothesis' log-probability is the sum of its tokens' log-probabilities; a finished one is
ranked by that divided by the GNMT length penalty ((5 + length) / 6) ** alpha, its length
counting the EOS. The search stops early once no alive hypothesis can beat the worst
finished one of its example.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Scores of impossible hypotheses (empty finished slots, the copies of the single initial
# beam). -inf stays -inf under the adds and positive divisions done here, and no expression
# subtracts two scores, so it never turns into NaN.
NEG_INF = -jnp.inf

TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def length_penalty(length, alpha: float):
    """The GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016); 1 for alpha 0."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _check_rows(tree, rows: int, what: str):
    """Raises ValueError naming a leaf with ndim >= 1 whose leading dimension is not `rows`."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] != rows:
            raise ValueError(f"{what} leaf {jax.tree_util.keystr(path)} has shape "
                             f"{jnp.shape(leaf)}; its leading dimension must be {rows} (one row "
                             "per sequence; scalar leaves are shared)")


def expand_to_beams(tree, beam_size: int):
    """Repeats every ndim >= 1 leaf's rows `beam_size` times: [batch, ...] -> [batch * beam, ...].

    Row ``b * beam_size + k`` is beam k of example b, the order beam search uses. Scalar
    leaves are returned unchanged.
    """
    return jax.tree.map(lambda x: jnp.repeat(x, beam_size, axis=0) if jnp.ndim(x) >= 1 else x, tree)


def _gather_beams(x, beam_indices):
    """x [batch, beams, ...], beam_indices int [batch, new_beams] -> x[b, beam_indices[b]].

    A batched gather (vmap over the batch), which XLA's SPMD partitioner keeps local to each
    device when the batch is split over the mesh.
    """
    return jax.vmap(lambda rows, idx: rows[idx])(x, beam_indices)


def _gather_cache(cache, beam_indices, batch_size: int, beam_size: int):
    """Reorders the rows [batch * beam, ...] of every ndim >= 1 cache leaf by `beam_indices`."""

    def gather(x):
        if jnp.ndim(x) == 0:
            return x
        x = x.reshape((batch_size, beam_size) + x.shape[1:])
        return _gather_beams(x, beam_indices).reshape((batch_size * beam_size,) + x.shape[2:])

    return jax.tree.map(gather, cache)


def greedy_search(tokens_to_logits: TokensToLogits, cache, batch_size: int, max_decode_len: int,
                  eos_id: int = 1) -> jax.Array:
    """[batch, max_decode_len] int32: argmax decoding; after a sequence's EOS, 0s (`sample`
    with empty prompts at temperature 0).

    The loop stops as soon as every sequence has produced EOS.
    """
    _check_rows(cache, batch_size, "cache")
    prompts = jnp.zeros((batch_size, max_decode_len), jnp.int32)
    return sample(tokens_to_logits, cache, prompts, max_decode_len, None, eos_id=eos_id,
                  prompt_lengths=jnp.zeros((batch_size,), jnp.int32))


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
    """`logits` [n, vocab] with every token outside the `top_k` most likely (0: all) and
    outside the smallest set whose probabilities reach `top_p` (1: all) set to -inf."""
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
        kept = jnp.where(before < top_p, ordered, jnp.inf)
        logits = jnp.where(logits < kept.min(axis=-1, keepdims=True), -jnp.inf, logits)
    return logits


def sample(tokens_to_logits: TokensToLogits, cache, prompts, max_decode_len: int, rng,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           eos_id: int = 1, start_id: int = 0, *, prompt_lengths, prefill=None,
           prefill_length: int | None = None) -> jax.Array:
    """[batch, length] int32: each row's prompt (its first `prompt_lengths` [batch] ids of
    `prompts` [batch, length], any id, 0 too) followed by its continuation: at most
    `max_decode_len` tokens, ended by EOS, then 0s. A row's output is its first
    ``min(prompt_length + max_decode_len, length)`` ids cut after the first EOS of the
    continuation (the 0s after that are no tokens). Greedy for `temperature` 0, else sampled
    from softmax(logits / temperature) after `filter_logits`, each row with the key
    ``fold_in(rng, position)`` (`rng` one key, or [batch] keys: one a row). The model reads
    `start_id` first (`TransformerConfig.start_id`; or [batch] ids, one per row: a prompt
    read as it is, its first id read first). `eos_id`: an id, or [batch, k] ids each of which ends its row
    (a chat's end of turn and EOS).

    Each row is at its own position (the cache's index is per row). Without `prefill` the
    prompts are fed a token a step, as the continuation is. With `prefill(ids, counts,
    cache) -> cache` (a model's one pass into the empty cache: `DecoderLM.prefill`), the
    first `prefill_length` (default: all) positions of every row are read in one pass, of
    which each row keeps its prompt's; the steps then start at each row's first new token."""
    batch, length = prompts.shape
    rows = jnp.arange(batch)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    stop = jnp.minimum(prompt_lengths + max_decode_len, length)
    stops = jnp.asarray(eos_id, jnp.int32)
    stops = stops.reshape(1, 1) if stops.ndim == 0 else stops  # [1 or batch, k]
    starts = jnp.broadcast_to(jnp.asarray(start_id, jnp.int32), (batch,))
    position, last = jnp.zeros((batch,), jnp.int32), starts
    if prefill is not None:  # read: the start id, then the prompt
        n = length if prefill_length is None else prefill_length
        reads = jnp.concatenate([starts[:, None], prompts[:, :n - 1]], axis=1)
        position = jnp.minimum(prompt_lengths, n)
        cache = prefill(reads, position, cache)
        last = jnp.where(position > 0, prompts[rows, jnp.maximum(position - 1, 0)], starts)
    seqs = jnp.where(jnp.arange(length)[None, :] < position[:, None], prompts, 0)

    def cond(state):
        position, _, _, done, _ = state
        return jnp.any((position < length) & ~done)

    def body(state):
        position, last, seqs, done, cache = state
        logits, cache = tokens_to_logits(last[:, None], cache)
        if temperature == 0.0:
            token = jnp.argmax(logits, axis=-1)
        else:
            logits = filter_logits(logits / temperature, top_k, top_p)
            keys = jax.vmap(jax.random.fold_in, (None if rng.ndim == 0 else 0, 0))(
                rng, position)
            token = jax.vmap(jax.random.categorical)(keys, logits)
        prompted = position < prompt_lengths
        fed = prompts[rows, jnp.minimum(position, length - 1)]
        token = jnp.where(prompted, fed, jnp.where(done, 0, token)).astype(jnp.int32)
        seqs = seqs.at[rows, position].set(token, mode="drop")
        ended = jnp.any(token[:, None] == stops, axis=-1)
        done = done | (~prompted & ended) | (position + 1 >= stop)
        return position + 1, token, seqs, done, cache

    state = (position, last, seqs, stop <= position, cache)
    return lax.while_loop(cond, body, state)[2]


class _BeamState(NamedTuple):
    """Beam-search loop state; sequences have max_decode_len + 1 positions, 0 the start token."""

    index: jax.Array  # scalar int32: tokens generated so far; the next one goes to index + 1
    alive_seqs: jax.Array  # [batch, beam, max_decode_len + 1] int32, never containing EOS
    alive_log_probs: jax.Array  # [batch, beam] float32, summed log-probabilities, best first
    finished_seqs: jax.Array  # [batch, beam, max_decode_len + 1] int32, ending with EOS then 0s
    finished_scores: jax.Array  # [batch, beam] float32, log-prob / length penalty, best first
    cache: Any  # the model's cache, batch * beam rows, in the order of alive_seqs


def beam_search(tokens_to_logits: TokensToLogits, cache, batch_size: int, beam_size: int,
                max_decode_len: int, *, alpha: float = 0.6, eos_id: int = 1
                ) -> tuple[jax.Array, jax.Array]:
    """(sequences [batch, beam, max_decode_len] int32, best first; scores [batch, beam] float32).

    `cache` has `batch_size` rows; it is expanded here to batch * beam rows (see
    `expand_to_beams`). A score is the hypothesis' summed token log-probability divided by
    `length_penalty(length, alpha)` (alpha >= 0; 0 ranks by the plain sum). Finished
    hypotheses are returned; an example with none at `max_decode_len` gets its alive ones
    instead, scored with length `max_decode_len`. Slots with no hypothesis score -inf.
    """
    _check_rows(cache, batch_size, "cache")
    max_penalty = length_penalty(max_decode_len, alpha)  # the largest a hypothesis can get

    def cond(state: _BeamState):
        # Log-probabilities only fall as a hypothesis grows, and for alpha >= 0 the penalty
        # is largest at max_decode_len, so this bounds every score an alive beam can reach.
        best_alive = jnp.max(state.alive_log_probs, axis=1) / max_penalty
        # -inf while an example has an empty finished slot: that example keeps searching.
        worst_finished = jnp.min(state.finished_scores, axis=1)
        done = jnp.all(worst_finished > best_alive)
        return (state.index < max_decode_len) & ~done

    def body(state: _BeamState):
        ids = lax.dynamic_index_in_dim(state.alive_seqs, state.index, axis=2, keepdims=False)
        logits, cache = tokens_to_logits(ids.reshape(batch_size * beam_size, 1), state.cache)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        vocab = log_probs.shape[-1]
        if vocab < 2:  # a static shape, checked while tracing
            raise ValueError(f"beam_search needs a vocabulary of at least 2 tokens, got {vocab}")
        # Every (beam, token) extension, flattened per example; keep the best 2 * beam, of
        # which at most `beam` end with EOS (one per beam), so `beam` alive ones remain.
        # (With the batch split over a mesh, XLA's SPMD partitioner, as of jax 0.10 on CPU,
        # all-gathers top_k's [batch, beam * vocab] input rather than splitting it: correct,
        # but a per-step collective a large vocabulary will notice.)
        log_probs = log_probs.reshape(batch_size, beam_size * vocab)
        candidates = jnp.repeat(state.alive_log_probs, vocab, axis=1) + log_probs
        top_log_probs, top_indices = lax.top_k(candidates, 2 * beam_size)
        top_beams, top_tokens = top_indices // vocab, top_indices % vocab
        top_seqs = _gather_beams(state.alive_seqs, top_beams)
        top_seqs = lax.dynamic_update_slice_in_dim(top_seqs, top_tokens[:, :, None],
                                                   state.index + 1, axis=2)
        ends = top_tokens == eos_id

        # Alive: the best `beam` candidates that did not end; the cache follows their beams.
        alive_log_probs, keep = lax.top_k(jnp.where(ends, NEG_INF, top_log_probs), beam_size)
        alive_seqs = _gather_beams(top_seqs, keep)
        cache = _gather_cache(cache, jnp.take_along_axis(top_beams, keep, axis=1),
                              batch_size, beam_size)

        # Finished: the best `beam` of the old finished ones and the candidates that ended
        # (length index + 1, counting the EOS). On ties the older hypothesis wins.
        new_scores = top_log_probs / length_penalty(state.index + 1, alpha)
        new_scores = jnp.where(ends, new_scores, NEG_INF)
        scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
        seqs = jnp.concatenate([state.finished_seqs, top_seqs], axis=1)
        finished_scores, keep = lax.top_k(scores, beam_size)
        finished_seqs = _gather_beams(seqs, keep)
        return _BeamState(state.index + 1, alive_seqs, alive_log_probs, finished_seqs,
                          finished_scores, cache)

    seqs = jnp.zeros((batch_size, beam_size, max_decode_len + 1), jnp.int32)
    # One real beam to start with; the copies are impossible until the first step fills them.
    alive_log_probs = jnp.where(jnp.arange(beam_size) == 0, 0.0, NEG_INF)
    state = _BeamState(
        index=jnp.array(0, jnp.int32),
        alive_seqs=seqs,
        alive_log_probs=jnp.tile(alive_log_probs.astype(jnp.float32), (batch_size, 1)),
        finished_seqs=seqs,
        finished_scores=jnp.full((batch_size, beam_size), NEG_INF, jnp.float32),
        cache=expand_to_beams(cache, beam_size),
    )
    state = lax.while_loop(cond, body, state)

    # An example that finished nothing (only possible at max_decode_len) returns its alive beams.
    none_finished = jnp.all(state.finished_scores == NEG_INF, axis=1)
    seqs = jnp.where(none_finished[:, None, None], state.alive_seqs, state.finished_seqs)
    scores = jnp.where(none_finished[:, None],
                       state.alive_log_probs / length_penalty(state.index, alpha),
                       state.finished_scores)
    seqs = jnp.where(scores[:, :, None] == NEG_INF, 0, seqs)  # empty slots: all 0
    return seqs[:, :, 1:], scores
