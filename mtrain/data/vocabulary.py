"""SentencePiece vocabularies with the T5 conventions: pad 0, EOS 1, UNK 2, no BOS.

    vocab = get_or_train_vocabulary("runs/vocab/bible_en_2000.model",
                                    lambda: source.texts("train"), 2000)
    ids = vocab.encode("In the beginning")      # no EOS appended
    text = vocab.decode(ids + [vocab.eos_id])   # stops at the first EOS

`encode_batch` tokenises a window of strings with one SentencePiece call (the input
pipeline's).

Id 0 is not padding by definition: a published tokenizer's id 0 may be an ordinary piece
(Llama 3's and Qwen's "!") or the unknown one (Llama 2's). Packed rows hold 0 where nothing
is, but what is real is told by their segment ids (0 on padding) or by lengths, never by
the ids: a text whose ids include 0 is trained on, scored, continued and decoded whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import sentencepiece as spm
from etils import epath

from mtrain.errors import UserError, first_line
from mtrain.io.textfiles import write_atomically

log = logging.getLogger("mtrain")
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2

# SentencePiece trains with this many threads whatever the machine, so that the same texts
# give the same model everywhere.
_TRAINER_THREADS = 4


class VocabularyError(UserError, ValueError):
    """A vocabulary file is missing, unreadable, or does not match the configuration."""


class Vocabulary:
    """A loaded SentencePiece model. mtrain trains its own with T5's special ids (pad 0, EOS 1,
    UNK 2, no BOS); a published model's (`mtrain.huggingface`) keeps its own: Llama's has
    UNK 0, BOS 1, EOS 2 and no pad, Gemma's pad 0, EOS 1, BOS 2, UNK 3. Only an EOS is
    required (every example ends with it); id 0 may be any piece (see the module doc)."""

    def __init__(self, model_proto: bytes, path: str | None = None):
        self.path = path
        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        if self._sp.eos_id() < 0:
            raise VocabularyError(f"sentencepiece model {path or '(in memory)'} has no EOS "
                                  f"piece, which mtrain ends every example with")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int | None:
        """The tokenizer's padding piece (mtrain's own: 0), None if it has none. Packed rows
        hold 0 where nothing is whatever this is (their segment ids say what is real)."""
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def unk_id(self) -> int | None:
        """The unknown piece (every sentencepiece model has one); None where a tokenizer has
        none (a byte-level BPE's)."""
        return self._sp.unk_id()

    def piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    @property
    def model_proto(self) -> bytes:
        """The serialized SentencePiece model (the contents of the .model file)."""
        return self._proto

    def save(self, path: str | os.PathLike) -> None:
        """Writes the .model file to `path` (local or a bucket) whole: a reader never sees half
        of it."""
        write_atomically(path, self._proto)

    @property
    def digest(self) -> str:
        """The first 16 hex digits of the model's sha256: which vocabulary this is."""
        return hashlib.sha256(self._proto).hexdigest()[:16]

    def encode_example(self, text: str, length: int) -> tuple[list[int], bool]:
        """An example's ids as training sees them: encoded, EOS appended, trimmed to
        `length`; and whether it was cut."""
        ids = self.encode(text) + [self.eos_id]
        return ids[:length], len(ids) > length

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without EOS."""
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS. The tokenizer's pad piece (if it has one) is
        skipped, and ids past its pieces (a published model's spare rows) give nothing; any
        other id is text, 0 too (Llama's unknown piece reads " ⁇ ")."""
        return self._sp.decode(_before_eos(ids, self.eos_id, self.pad_id, self.vocab_size))

    def encode_batch(self, texts: list[str], add_eos: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Tokenises `texts` with one SentencePiece call: (flat int32 ids, int64 row splits),
        the ids of text i being ids[row_splits[i]:row_splits[i + 1]]."""
        return _flat(self._sp.encode(list(texts), out_type=int, add_eos=add_eos,
                                     num_threads=1))

    def __getstate__(self):  # pickled for the input pipeline's worker processes
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state["path"])


def _flat(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ids as (flat int32 ids, int64 row splits)."""
    lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
    row_splits = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lengths, out=row_splits[1:])
    values = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(row_splits[-1]))
    return values, row_splits


def _before_eos(ids: Iterable[int], eos_id: int, pad_id: int | None, size: int) -> list[int]:
    """`ids` up to the first `eos_id`, without `pad_id` (None: no id is padding) and without
    ids outside [0, size)."""
    kept = []
    for i in ids:
        i = int(i)
        if i == eos_id:
            break
        if i != pad_id and 0 <= i < size:
            kept.append(i)
    return kept


class TokenizerVocabulary(Vocabulary):
    """A Hugging Face ``tokenizer.json`` (through the `tokenizers` package) as a vocabulary,
    for published models that ship no sentencepiece file (Llama 3, Qwen, Mistral's newer
    ones). Its file (`save`) is JSON: ``{"format": FORMAT, "eos_id": N, "bos_id": N or null,
    "tokenizer": <tokenizer.json>}`` and, where the model has one, ``"pad_id": N``, since
    those are the model's (config.json, tokenizer_config.json), not the tokenizer's. Texts
    are encoded without the tokenizer's own special tokens: the model adds what its family
    needs (EOS, `TransformerConfig.start_id`). A byte-level BPE has no unknown piece, and its
    id 0 is an ordinary one ("!")."""

    FORMAT = "mtrain tokenizers vocabulary 1"

    def __init__(self, data: bytes, path: str | None = None):
        import json

        import tokenizers

        self.path, self._proto = path, data
        try:
            spec = json.loads(data)
            self._tok = tokenizers.Tokenizer.from_str(json.dumps(spec["tokenizer"]))
            self._eos, self._bos = int(spec["eos_id"]), spec.get("bos_id")
            self._pad = spec.get("pad_id")
            unk = spec["tokenizer"].get("model", {}).get("unk_token")
            self._unk = self._tok.token_to_id(unk) if unk is not None else None
        except Exception as e:
            raise VocabularyError(f"{path or '(in memory)'} is not a tokenizers vocabulary: "
                                  f"{first_line(e)}") from None
        for name, i in (("EOS", self._eos), ("BOS", self._bos), ("pad", self._pad)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise VocabularyError(f"{path or '(in memory)'}: its {name} id {i} is not one "
                                      f"of the tokenizer's {self.vocab_size} ids")

    @classmethod
    def of(cls, tokenizer_json: bytes, eos_id: int, bos_id: int | None,
           pad_id: int | None = None) -> "TokenizerVocabulary":
        import json

        spec = {"format": cls.FORMAT, "eos_id": eos_id, "bos_id": bos_id,
                "tokenizer": json.loads(tokenizer_json)}
        if pad_id is not None:
            spec["pad_id"] = pad_id
        return cls(json.dumps(spec).encode())

    def tokenizer_json(self) -> str:
        import json

        return json.dumps(json.loads(self._proto)["tokenizer"], ensure_ascii=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    @property
    def unk_id(self) -> int | None:
        return self._unk

    def piece(self, i: int) -> str:
        return self._tok.id_to_token(i)

    def token_id(self, token: str) -> int | None:
        """The id of the token `token`, None if it has none."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(_before_eos(ids, self.eos_id, self.pad_id, self.vocab_size),
                                skip_special_tokens=True)

    def encode_batch(self, texts: list[str], add_eos: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        return _flat([e.ids + [self._eos] * add_eos
                      for e in self._tok.encode_batch(list(texts), add_special_tokens=False)])


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
