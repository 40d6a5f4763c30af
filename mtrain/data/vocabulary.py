"""Vocabularies: loaded, trained and chosen. mtrain's own are SentencePiece models with the
T5 conventions: pad 0, EOS 1, UNK 2, no BOS.

    vocab = get_or_train_vocabulary("runs/vocab/bible_en_2000.model",
                                    lambda: source.texts("train"), 2000)
    ids = vocab.encode("In the beginning")      # no EOS appended
    text = vocab.decode(ids + [vocab.eos_id])   # stops at the first EOS

`encode_batch` tokenises a window of strings with one SentencePiece call (the input
pipeline's). The classes: `Vocabulary` (a sentencepiece model,
`mtrain.data.sentencepiece_vocabulary`) and `TokenizerVocabulary` (a ``tokenizer.json``,
`mtrain.data.tokenizer_vocabulary`); id 0 is not padding by definition (see the former).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import sentencepiece as spm
from etils import epath

from mtrain.data.sentencepiece_vocabulary import Vocabulary, VocabularyError
from mtrain.data.tokenizer_vocabulary import TokenizerVocabulary
from mtrain.errors import first_line

log = logging.getLogger("mtrain")
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

# SentencePiece trains with this many threads whatever the machine, so that the same texts
# give the same model everywhere.
_TRAINER_THREADS = 4


def vocabulary_of(data: bytes, path: str | None = None) -> Vocabulary:
    """The vocabulary in the bytes of a vocabulary file: a sentencepiece model, or a
    `TokenizerVocabulary`'s JSON."""
    if data.lstrip()[:1] == b"{":
        return TokenizerVocabulary(data, path)
    return Vocabulary(data, path)


def load_vocabulary(path: str | os.PathLike) -> Vocabulary:
    """Loads a SentencePiece .model file; raises VocabularyError if it is missing or invalid."""
    path = str(path)
    try:
        proto = epath.Path(path).read_bytes()
    except Exception as e:  # OSError locally; a bucket's client raises errors of its own
        reason = getattr(e, "strerror", None) or first_line(e)
        raise VocabularyError(f"cannot read sentencepiece vocabulary {path}: {reason}") from None
    if not proto:
        raise VocabularyError(f"{path} is empty: not a sentencepiece model")
    try:
        return vocabulary_of(proto, path)
    except VocabularyError:
        raise
    except Exception:  # sentencepiece raises RuntimeError (or others) on a bad proto
        raise VocabularyError(f"{path} is not a sentencepiece model") from None


def train_vocabulary(
    texts: Iterable[str],
    vocab_size: int,
    path: str | os.PathLike,
    *,
    max_sentences: int = 1_000_000,
    seed: int = 0,
) -> Vocabulary:
    """Trains a unigram SentencePiece model on the first `max_sentences` texts, writes `path`.

    Deterministic: the texts are taken in order (no sampling), the trainer's seed and thread
    count are fixed. The file is written to a temporary name in the same directory and then
    renamed, so a crash never leaves a truncated model behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sentences = (t for t in itertools.islice(texts, max_sentences) if t)
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            character_coverage=1.0,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            input_sentence_size=0,  # use every sentence given, in order: no random sampling
            shuffle_input_sentence=False,
            num_threads=_TRAINER_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:  # (too few texts for the size asked, ...)
        message = str(e).split("] ")[-1]
        raise VocabularyError(f"cannot train a {vocab_size}-piece vocabulary on these "
                              f"texts: {message}") from None
    vocab = Vocabulary(model.getvalue(), str(path))
    vocab.save(path)
    return vocab


def get_or_train_vocabulary(
    path: str | os.PathLike,
    texts_fn: Callable[[], Iterable[str]],
    vocab_size: int,
    *,
    texts_name: str = "the training texts",
    **train_kwargs,
) -> Vocabulary:
    """Loads the vocabulary at `path`, or trains it on `texts_fn()` and saves it there first.

    `texts_name` describes the texts in the one line printed before training. A cached
    model of a different size is an error (delete it, or change vocab_size).
    """
    if os.path.exists(path):
        vocab = load_vocabulary(path)
        if vocab.vocab_size != vocab_size:
            raise VocabularyError(
                f"sentencepiece vocabulary {path} has {vocab.vocab_size} pieces but "
                f"{vocab_size} were asked for; delete it to retrain, or change vocab_size"
            )
        return vocab
    print(f"training a {vocab_size}-piece sentencepiece vocabulary on {texts_name} -> {path}",
          file=sys.stderr, flush=True)
    return train_vocabulary(texts_fn(), vocab_size, path, **train_kwargs)


# --- which vocabulary a run uses ---------------------------------------------------------

DEFAULT_SIZE = 8192


@dataclasses.dataclass(frozen=True)
class VocabularyConfig:
    """``vocabulary.size`` (pieces to train; None: the default, 8192) and ``vocabulary.path``
    (a sentencepiece .model file to use instead) in gin. ``vocabulary.model_size``: the
    model's vocabulary dimension where it has more rows than the vocabulary has pieces (a
    published model's config.json vocab_size, e.g. T5's 32,128 rows for 32,000 pieces and
    100 sentinels); None: as many as the pieces. Either way the model pads it to a multiple
    of 128."""

    size: int | None = None
    path: str | None = None
    model_size: int | None = None

    def rows(self, pieces: int) -> int:
        """The model's vocabulary dimension (before padding) for a vocabulary of `pieces`."""
        return max(pieces, self.model_size or 0)

    def planned_size(self, recorded: str | None) -> int:
        """The model's vocabulary size (`rows`) a run will have, known without data: that
        of the vocabulary `recorded` in its model dir if any (see `choose`), else of `path`,
        else `size` (sentencepiece trains exactly that many pieces)."""
        path = recorded or self.path
        return self.rows(load_vocabulary(path).vocab_size if path else self.size or DEFAULT_SIZE)

    def choose(self, recorded: str | None, cached: str,
               texts_fn: Callable[[], Iterable[str]], texts_name: str,
               where: str = "", unrecorded: str | None = None) -> Vocabulary:
        """The vocabulary of a run: the one `recorded` in its model dir (`where`), never
        another (a `path` or `size` that names a different one is an error); else `path`;
        else one trained on `texts_fn()` once and cached at `cached`. `unrecorded`: where
        the model dir should have recorded one and has not (its checkpoints, whose digest of
        their vocabulary is checked when they are restored): one line says which is used."""
        if recorded:
            vocab = load_vocabulary(recorded)
            if self.path and load_vocabulary(self.path).digest != vocab.digest:
                raise VocabularyError(
                    f"vocabulary.path={self.path} is not the vocabulary the checkpoints in "
                    f"{where} were trained with ({recorded}); leave it unset, or start a new "
                    f"run in another --model_dir")
            if not self.path and self.size is not None and self.size != vocab.vocab_size:
                raise VocabularyError(
                    f"vocabulary.size={self.size}, but the checkpoints in {where} were "
                    f"trained with a vocabulary of {vocab.vocab_size} pieces ({recorded}); "
                    f"leave it as it was, or start a new run in another --model_dir")
            return vocab
        if self.path:
            vocab = load_vocabulary(self.path)
        else:
            vocab = get_or_train_vocabulary(cached, texts_fn, self.size or DEFAULT_SIZE,
                                            texts_name=texts_name)
        if unrecorded:
            log.warning("the model dir has no %s: using %s (the checkpoints' own digest of "
                        "theirs is checked)", unrecorded, vocab.path)
        return vocab
