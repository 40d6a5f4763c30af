"""Generating text with a trained decoder-only LM: each prompt continued by greedy decoding
or by sampling (temperature, top-k, top-p), batched, jitted and sharded as `translation`.

    generator = Generator(trainer, vocab, DecodingConfig(temperature=0.8, top_p=0.9), seed=0)
    text = generator(params, ["In the beginning God"])

`decoding.sample` runs the model one position at a time with its key/value cache, from
the start token (0) on; while a row is inside its prompt it feeds the prompt's next token
instead of what it would pick, so that prompts of any length share one loop and one
decoding index (T5X's decoder-only prefix works the same way). A prompt is the line's
tokens without EOS, as an LM example begins; its length is counted on the host (any id may
be in it, 0 too) and goes to the loop as a mask of the row's prompt positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtrain.data.vocabulary import Vocabulary
from mtrain.evaluation.decoding import sample
from mtrain.evaluation.translation import BatchedDecoder, DecodingConfig, empty_cache
from mtrain.training.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt as the ids the model reads as they are, the first one first (a conversation
    rendered with its template's generation prompt; [BOS] + a prompt's ids), and the id that
    ends its continuation besides EOS (a chat template's end of turn)."""

    ids: tuple[int, ...]
    stop: int


class Generator(BatchedDecoder):
    """Continues batches of prompts with the model, layout and batch of `trainer` (the rows
    hold run.sequence_length positions: prompt and continuation together)."""

    texts = "prompts"
    verb = "continu"

    def how(self) -> str:
        c = self.config
        if c.temperature == 0:
            return ", greedy"
        return (f", sampling at temperature {c.temperature} (top_k {c.top_k}, top_p {c.top_p}, "
                f"run.seed {self.seed})")

    def __init__(self, trainer: Trainer, vocab: Vocabulary, config: DecodingConfig,
                 seed: int = 0, *, length: int = 0):
        if config.temperature < 0:
            raise ValueError(f"decoding.temperature must be >= 0, got {config.temperature}")
        if config.top_k < 0 or not 0.0 < config.top_p <= 1.0:
            raise ValueError(f"decoding.top_k must be >= 0 and decoding.top_p in (0, 1], got "
                             f"{config.top_k} and {config.top_p}")
        super().__init__(trainer, vocab, config, length=length)
        self.seed = seed
        self.replicated = replicated = NamedSharding(trainer.mesh, PartitionSpec())
        self._generate = jax.jit(
            self._generate_fn, in_shardings=(trainer.state_shardings.params, self.sharding,
                                             self.sharding, replicated, replicated, replicated),
            out_shardings=replicated, static_argnums=(6,))

    def _replicated(self, x: np.ndarray) -> jax.Array:
        """A host array every process holds whole, on every device of the mesh."""
        return jax.make_array_from_callback(x.shape, self.replicated, lambda index: x[index])

    def _generate_fn(self, params, prompts, prompted, starts, stops, rng, prefill_length=0):
        """`prompts` [batch, length] continued; `prompted` is 1 on each row's prompt;
        `starts` [batch] the id each row reads first, `stops` [batch, 2] the ids ending it;
        `prefill_length`: the positions read in one pass (0: none, a token a step)."""
        model, config = self.trainer.model, self.config
        # (a decoding step is one position: ``length`` splits nowhere)
        with self.trainer.layout.without("length").activate(self.trainer.mesh):
            cache = empty_cache(model, (), prompts.shape[0], self.length)

            def tokens_to_logits(ids, cache):
                logits, variables = model.apply({"params": params, "cache": cache}, ids,
                                                method=model.decode_step, mutable=["cache"])
                return self.real(logits), variables["cache"]

            def prefill(ids, counts, cache):
                _, variables = model.apply({"params": params, "cache": cache}, ids, counts,
                                           method=model.prefill, mutable=["cache"])
                return variables["cache"]

            return sample(tokens_to_logits, cache, prompts, self.max_decode_length, rng,
                          config.temperature, config.top_k, config.top_p, stops, starts,
                          prompt_lengths=prompted.sum(axis=1),
                          prefill=prefill if prefill_length else None,
                          prefill_length=prefill_length or None)

    def encode_batch(self, texts: Sequence[str | Prompt]
                     ) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray]:
        """[batch_size, length] prompt ids, each prompt's length, the id each row reads
        first and the [batch_size, 2] ids that end it. A text is read after the model's
        start id, without EOS, as an LM example begins; a `Prompt` is read as its ids are,
        the first one first. A prompt that does not fit the row keeps its end (what the
        continuation follows; a chat's generation prompt): its last `kept` ids, which leave
        room for `room` new ones (counted in `truncated`)."""
        ids = np.zeros((self.batch_size, self.length), np.int32)
        eos, lengths = self.vocab.eos_id, []
        starts, stops = self._text_rows()
        for row, text in enumerate(texts):
            if isinstance(text, Prompt):
                starts[row], tokens = text.ids[0], list(text.ids[1:])
                stops[row] = (text.stop, eos)
            else:
                tokens = self.vocab.encode(text)
            if len(tokens) > self.length - 1:
                tokens, self.truncated = tokens[-self.kept:], self.truncated + 1
            ids[row, :len(tokens)] = tokens
            lengths.append(len(tokens))
        return ids, lengths, starts, stops

    @property
    def room(self) -> int:
        """The new ids a cut prompt leaves room for: decoding.max_decode_length, at most
        half the row."""
        return max(1, min(self.max_decode_length, self.length // 2))

    @property
    def kept(self) -> int:
        return self.length - self.room

    def truncation_note(self) -> str:
        return (f"and kept their last {self.kept} tokens (what the continuation follows), "
                f"leaving room for {self.room} new ones")

    def _text_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The start ids and stop ids of a batch of texts: the model's start id, and EOS."""
        return (np.full((self.batch_size,), self.trainer.model.config.start_id, np.int32),
                np.full((self.batch_size, 2), self.vocab.eos_id, np.int32))

    def continuations(self, params, ids: np.ndarray, lengths: list[int],
                      starts: np.ndarray | None = None, stops: np.ndarray | None = None,
                      number: int = 0, keys: jax.Array | None = None) -> list[list[int]]:
        """The ids of each prompt's continuation (`ids` [batch_size, length] holding the
        prompts of `lengths`; `starts` and `stops` as `encode_batch` makes them, by default
        the model's start id and EOS), up to and including the id that ended it if one came.
        `number`: the batch's, which seeds its sampling (``fold_in(PRNGKey(seed), number)``);
        or `keys`, [batch_size] keys, one a row (rows with one prompt sample apart)."""
        if starts is None or stops is None:
            starts, stops = self._text_rows()
        prompted = (np.arange(self.length)[None, :] < np.array(
            lengths + [0] * (self.batch_size - len(lengths)))[:, None]).astype(np.int32)
        rng = jax.random.fold_in(jax.random.key(self.seed), number) if keys is None else keys
        out = np.asarray(jax.device_get(self._generate(
            params, self.place(ids), self.place(prompted), self._replicated(starts),
            self._replicated(stops), rng, self.prefill_length(lengths))))
        kept = []
        for row, n, ends in zip(out, lengths, stops):
            new = row[n:min(n + self.max_decode_length, self.length)].tolist()
            end = next((k for k, t in enumerate(new) if t in ends), None)
            kept.append(new if end is None else new[:end + 1])
        return kept

    def prefill_length(self, lengths: list[int]) -> int:
        """The positions a batch of prompts of `lengths` reads in one pass: the longest
        prompt's, rounded up to a power of two (at least 16, at most the row: a compile per
        bucket, not per batch); 0 without `decoding.prefill` or where the model has no
        `prefill` (an encoder-decoder)."""
        if not self.config.prefill or not hasattr(self.trainer.model, "prefill"):
            return 0
        return min(self.length, max(16, 1 << (max(lengths, default=0) - 1).bit_length()))

    def batches(self, params, texts: Sequence[str | Prompt]) -> Iterator[list[str]]:
        """The continuations of `texts` (without the prompt and the id that ended them), a
        batch at a time. The k-th batch samples with the key ``fold_in(PRNGKey(seed), k)``:
        a rerun gives the same."""
        for number, start in enumerate(range(0, len(texts), self.batch_size)):
            encoded = self.encode_batch(texts[start:start + self.batch_size])
            outs = self.continuations(params, *encoded, number=number)
            yield [self.vocab.decode((new[:-1] if new and new[-1] in ends else new)
                                     + [self.vocab.eos_id]) for new, ends in zip(outs, encoded[3])]
