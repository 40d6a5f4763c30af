"""Translating text with a trained encoder-decoder: batched, jitted, sharded beam search.

    translator = Translator(trainer, vocab, DecodingConfig(beam_size=4, alpha=0.6))
    french = translator(params, ["In the beginning God created the heaven and the earth."])

Sentences are tokenised (EOS appended, trimmed to the training sequence length), padded into
batches of the training batch size with segment ids that say which ids are a sentence's
(never the ids themselves: id 0 may be a token), and decoded by `decoding.beam_search` (or
greedy search for beam 1) in one jitted function whose inputs and parameters carry the
training layout:
the batch of sentences is split over the mesh like a training batch, and the model's
weights stay where training put them. Encoder outputs are computed once per batch; the
decoder runs one token at a time with its key/value cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mtrain.evaluation import decoding
from mtrain.training.trainer import Trainer, local_rows
from mtrain.data.vocabulary import Vocabulary


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """``decoding.beam_size = 4``, ``decoding.alpha = 0.6`` (the paper's setting) in gin.

    `max_decode_length` 0 means the training sequence length (an LM's: at most that many
    tokens after the prompt, within it); `num_examples` is how many
    examples of the eval split BLEU is computed on (0: all); `batch_size` how many sentences
    are decoded at once (0: the training batch size; a multiple of the mesh's batch
    dimension).
    """

    beam_size: int = 4
    alpha: float = 0.6
    max_decode_length: int = 0
    num_examples: int = 0
    batch_size: int = 0
    # Generating from an LM (`generation.Generator`): 0 greedy, else sampled at this
    # temperature from the top_k most likely tokens (0: all) within top_p of the mass.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # An LM reads each batch's prompts in one pass into its cache (False: a token a step,
    # as before; the same tokens)
    prefill: bool = True


class BatchedDecoder:
    """What translating and generating share: texts decoded `batch_size` at a time (the
    training batch size, or decoding.batch_size), each batch split over the mesh as a
    training batch is (a LayoutError if it cannot be), with at most `max_decode_length`
    positions of output."""

    texts = "sentences"  # what a batch holds, for the layout's errors
    verb = "translat"  # what it does, for the log: translat-ing, translat-ed

    def how(self) -> str:
        """How it decodes, for the log's first line (after a comma), or ''."""
        return ""

    def __init__(self, trainer: Trainer, vocab: Vocabulary, config: DecodingConfig, *,
                 length: int = 0):
        """`length`: the positions a row holds (0: the training sequence length)."""
        self.trainer, self.vocab, self.config = trainer, vocab, config
        # The ids the model may emit: its real vocabulary rows (`Trainer.classes`, 0: all),
        # never the padding mtrain adds to split them evenly over a mesh. A published
        # model's rows may outnumber its tokenizer's ids (Qwen's 512 for 496): Hugging
        # Face emits those too, and they decode to nothing.
        self.rows = trainer.classes or trainer.model.config.vocab_size
        self.length = length or trainer.batch_shape[1]
        self.batch_size = config.batch_size or trainer.batch_shape[0]
        if self.batch_size < 1:
            raise ValueError(f"decoding.batch_size must be positive, got {config.batch_size}")
        self.sharding = trainer.layout.without("length").sharding(  # (see `_decode_fn`)
            trainer.mesh, ("batch", "length"), (self.batch_size, self.length),
            tensor=f"decoding.batch_size {self.texts}")
        self.max_decode_length = config.max_decode_length or self.length
        longest = getattr(trainer.model.config, "max_length", self.max_decode_length)
        if self.max_decode_length > longest:
            raise ValueError(f"decoding.max_decode_length={self.max_decode_length} is longer "
                             f"than transformer.max_length={longest}")
        self.truncated = 0  # how many texts were cut to fit

    def real(self, logits):
        """`logits` [n, padded vocab] in float32, -inf past the model's `rows`."""
        return jnp.where(jnp.arange(logits.shape[-1]) < self.rows,
                         logits.astype(jnp.float32), -jnp.inf)

    def place(self, ids: np.ndarray) -> jax.Array:
        """A host batch [batch_size, length] of ids on the mesh (this process's rows)."""
        shape = (self.batch_size, self.length)
        first, stop = local_rows(self.sharding, shape)
        return jax.make_array_from_process_local_data(self.sharding, ids[first:stop], shape)

    def __call__(self, params, texts: Sequence[str]) -> list[str]:
        """The outputs for `texts`, in order."""
        return [t for batch in self.batches(params, texts) for t in batch]

    def batches(self, params, texts: Sequence[str]) -> Iterator[list[str]]:
        raise NotImplementedError

    def truncation_note(self) -> str:
        """What became of the `truncated` texts, for the log after "longer than N tokens"."""
        return f"and were cut to it before {self.verb}ing"


class Translator(BatchedDecoder):
    """Translates batches of sentences with the model and layout of `trainer`."""

    def __init__(self, trainer: Trainer, vocab: Vocabulary, config: DecodingConfig):
        if config.beam_size < 1:
            raise ValueError(f"decoding.beam_size must be at least 1, got {config.beam_size}")
        super().__init__(trainer, vocab, config)
        replicated = NamedSharding(trainer.mesh, PartitionSpec())
        self._decode = jax.jit(
            self._decode_fn,
            in_shardings=(trainer.state_shardings.params, self.sharding, self.sharding),
            out_shardings=replicated,
        )

    def _decode_fn(self, params, inputs, segments):
        """The best output of each row of `inputs` [batch, length]: its ids where
        `segments` is 1 (a sentence, any ids, 0 too), nothing where it is 0."""
        model, config = self.trainer.model, self.config
        # (a decoding step is one position: ``length`` splits nowhere)
        with self.trainer.layout.without("length").activate(self.trainer.mesh):
            segments = segments.astype(jnp.int32)
            positions = jnp.where(segments > 0, jnp.arange(inputs.shape[1])[None, :], 0)
            encoded = model.apply({"params": params}, inputs, segments, positions,
                                  method=model.encode)
            cache = empty_cache(model, (encoded, segments), encoded.shape[0],
                                self.max_decode_length)
            if config.beam_size > 1:  # the decoder sees every beam: expand what it closes over
                encoded, segments = decoding.expand_to_beams((encoded, segments), config.beam_size)

            def tokens_to_logits(ids, cache):
                logits, variables = model.apply(
                    {"params": params, "cache": cache}, encoded, segments, ids,
                    method=model.decode_step, mutable=["cache"])
                return self.real(logits), variables["cache"]

            if config.beam_size == 1:
                return decoding.greedy_search(tokens_to_logits, cache, self.batch_size,
                                              self.max_decode_length, eos_id=self.vocab.eos_id)
            sequences, _ = decoding.beam_search(
                tokens_to_logits, cache, self.batch_size, config.beam_size,
                self.max_decode_length, alpha=config.alpha, eos_id=self.vocab.eos_id)
            return sequences[:, 0]  # the best hypothesis of each sentence

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """[batch_size, length] input ids (EOS appended, trimmed: counted in `truncated`;
        0 after them and in the rows past the texts) and segment ids (1 on each text's ids,
        0 elsewhere)."""
        ids = np.zeros((self.batch_size, self.length), np.int32)
        segments = np.zeros((self.batch_size, self.length), np.int32)
        for row, text in enumerate(texts):
            tokens, cut = self.vocab.encode_example(text, self.length)
            self.truncated += cut
            ids[row, : len(tokens)], segments[row, : len(tokens)] = tokens, 1
        return ids, segments

    def batches(self, params, texts: Sequence[str]) -> Iterator[list[str]]:
        """The translations of `texts`, in order, a batch of `batch_size` at a time."""
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start:start + self.batch_size])
            ids, segments = self.encode_batch(chunk)
            decoded = np.asarray(jax.device_get(self._decode(params, self.place(ids),
                                                             self.place(segments))))
            yield [self.vocab.decode(row) for row in decoded[: len(chunk)]]


def empty_cache(model, leading: tuple, rows: int, length: int):
    """Zeros shaped like a model's key/value cache for `rows` sequences of `length`
    positions: the cache that `decode_step(*leading, ids)` makes with ids [rows, length]."""
    ids = jnp.zeros((rows, length), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *leading, ids,
                                               method=model.decode_step))["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
