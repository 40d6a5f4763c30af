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

from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtrain.data.vocabulary import Vocabulary
from mtrain.evaluation.decoding import sample
from mtrain.evaluation.translation import BatchedDecoder, DecodingConfig, empty_cache
from mtrain.training.trainer import Trainer


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
                 seed: int = 0):
        if config.temperature < 0:
            raise ValueError(f"decoding.temperature must be >= 0, got {config.temperature}")
        if config.top_k < 0 or not 0.0 < config.top_p <= 1.0:
            raise ValueError(f"decoding.top_k must be >= 0 and decoding.top_p in (0, 1], got "
                             f"{config.top_k} and {config.top_p}")
        super().__init__(trainer, vocab, config)
        self.seed = seed
        replicated = NamedSharding(trainer.mesh, PartitionSpec())
        self._generate = jax.jit(
            self._generate_fn, in_shardings=(trainer.state_shardings.params, self.sharding,
                                             self.sharding, replicated),
            out_shardings=replicated)

    def _generate_fn(self, params, prompts, prompted, rng):
        """`prompts` [batch, length] continued; `prompted` is 1 on each row's prompt."""
        model, config = self.trainer.model, self.config
        with self.trainer.layout.activate(self.trainer.mesh):
            cache = empty_cache(model, (), prompts.shape[0], self.length)

            def tokens_to_logits(ids, cache):
                logits, variables = model.apply({"params": params, "cache": cache}, ids,
                                                method=model.decode_step, mutable=["cache"])
                return self.real(logits), variables["cache"]

            return sample(tokens_to_logits, cache, prompts, self.max_decode_length, rng,
                          config.temperature, config.top_k, config.top_p, self.vocab.eos_id,
                          model.config.start_id, prompt_lengths=prompted.sum(axis=1))

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """[batch_size, length] prompt ids (no EOS; cut to leave one position, counted in
        `truncated`) and each prompt's length."""
        ids, lengths = np.zeros((self.batch_size, self.length), np.int32), []
        for row, text in enumerate(texts):
            tokens = self.vocab.encode(text)
            if len(tokens) > self.length - 1:
                tokens, self.truncated = tokens[:self.length - 1], self.truncated + 1
            ids[row, :len(tokens)] = tokens
            lengths.append(len(tokens))
        return ids, lengths

    def continuations(self, params, ids: np.ndarray, lengths: list[int], number: int = 0
                      ) -> list[list[int]]:
        """The ids of each prompt's continuation (`ids` [batch_size, length] holding the
        prompts of `lengths`), up to and including its EOS if one came. `number`: the
        batch's, which seeds its sampling (``fold_in(PRNGKey(seed), number)``)."""
        prompted = (np.arange(self.length)[None, :] < np.array(
            lengths + [0] * (self.batch_size - len(lengths)))[:, None]).astype(np.int32)
        rng = jax.random.fold_in(jax.random.key(self.seed), number)
        out = np.asarray(jax.device_get(self._generate(params, self.place(ids),
                                                       self.place(prompted), rng)))
        kept = []
        for row, n in zip(out, lengths):
            new = row[n:min(n + self.max_decode_length, self.length)].tolist()
            kept.append(new[:new.index(self.vocab.eos_id) + 1] if self.vocab.eos_id in new
                        else new)
        return kept

    def batches(self, params, texts: Sequence[str]) -> Iterator[list[str]]:
        """The continuations of `texts` (without the prompt), a batch at a time. The k-th
        batch samples with the key ``fold_in(PRNGKey(seed), k)``: a rerun gives the same."""
        for number, start in enumerate(range(0, len(texts), self.batch_size)):
            ids, lengths = self.encode_batch(texts[start:start + self.batch_size])
            yield [self.vocab.decode(new + [self.vocab.eos_id])
                   for new in self.continuations(params, ids, lengths, number)]
