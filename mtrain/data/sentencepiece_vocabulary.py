"""The vocabulary class every vocabulary is: a SentencePiece model (`Vocabulary`), which
`mtrain.data.tokenizer_vocabulary` extends for ``tokenizer.json`` files, and what both share.
Loading, training and choosing one are `mtrain.data.vocabulary`'s.

Id 0 is not padding by definition: a published tokenizer's id 0 may be an ordinary piece
(Llama 3's and Qwen's "!") or the unknown one (Llama 2's). Packed rows hold 0 where nothing
is, but what is real is told by their segment ids (0 on padding) or by lengths, never by
the ids: a text whose ids include 0 is trained on, scored, continued and decoded whole.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import re
from typing import Iterable

import numpy as np
import sentencepiece as spm

from mtrain.data.ragged import flat_ids
from mtrain.errors import UserError
from mtrain.io.textfiles import write_atomically


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
        self._special = None
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

    def token_id(self, token: str) -> int | None:
        """The id of the piece `token`, None if it has none."""
        i = self._sp.piece_to_id(token)
        return i if i != self._sp.unk_id() or token == self.piece(i) else None

    def is_special(self, i: int) -> bool:
        """Whether id `i` is a special piece rather than text: a control piece (BOS, EOS,
        pad), the unknown one, or a user-defined one (a chat template's markers)."""
        return i in self._specials()[1]

    def _specials(self) -> tuple[dict[str, int], frozenset[int]]:
        """({piece: id} of the control pieces and the unknown one, which sentencepiece spells
        out when a text holds them, and the ids of those and the user-defined pieces), read
        from the model once."""
        if self._special is None:
            from sentencepiece import sentencepiece_model_pb2 as model_pb2

            kinds = [p.type for p in model_pb2.ModelProto.FromString(self._proto).pieces]
            named = {self.piece(i): i for i, k in enumerate(kinds) if k in (2, 3)}  # unk, control
            self._special = named, frozenset(i for i, k in enumerate(kinds) if k in (2, 3, 4))
        return self._special

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

    def encode_with_offsets(self, text: str, *, specials: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each one's (start, end) character offsets in `text`. The bytes
        of a character sentencepiece spells byte by byte (<0xE6><0x97><0xA5>) each get that
        character's offsets, as a ``tokenizers`` tokenizer gives them. `specials`: the text of
        a control piece or the unknown one ("</s>", "<unk>") in `text` is read as that piece,
        as Hugging Face tokenizers read their special tokens (sentencepiece reads only
        user-defined pieces so, and spells the others out); each stretch between them is
        encoded alone."""
        named = self._specials()[0] if specials else {}
        if not named:
            return self._offsets(text, 0, len(text))
        pattern = "|".join(re.escape(p) for p in sorted(named, key=len, reverse=True))
        ids, offsets, at = [], [], 0
        for m in re.finditer(pattern, text):
            more, spans = self._offsets(text, at, m.start())
            ids += more + [named[m.group()]]
            offsets += spans + [m.span()]
            at = m.end()
        more, spans = self._offsets(text, at, len(text))
        return ids + more, offsets + spans

    def _offsets(self, text: str, start: int, end: int):
        """encode_with_offsets of text[start:end], its offsets into `text`."""
        if start == end:
            return [], []
        part = text[start:end]
        pieces = self._sp.encode_as_proto(part).pieces
        # byte_at[c]: where character c of `part` starts in its UTF-8 bytes.
        byte_at = list(itertools.accumulate((len(c.encode()) for c in part), initial=0))

        def char(b, up):  # the character at byte offset b, rounded down or up
            c = bisect.bisect_right(byte_at, b) - 1
            return c + (up and byte_at[c] < b)

        spans = [(char(p.begin, False), char(p.end, True)) for p in pieces]
        for k in range(len(spans) - 2, -1, -1):  # a character's leading bytes: its offsets
            if spans[k][0] == spans[k][1] == spans[k + 1][0] and self._sp.is_byte(pieces[k].id):
                spans[k] = spans[k + 1]
        return [p.id for p in pieces], [(start + s, start + e) for s, e in spans]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS. The tokenizer's pad piece (if it has one) is
        skipped, and ids past its pieces (a published model's spare rows) give nothing; any
        other id is text, 0 too (Llama's unknown piece reads " ⁇ ")."""
        return self._sp.decode(ids_before_eos(ids, self.eos_id, self.pad_id, self.vocab_size))

    def encode_published(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids as a Hugging Face tokenizer of this model makes them
        (``tokenizer.encode``, as Llama's and Gemma's do): its BOS in front, if it has one and
        `add_special_tokens`, and the text of a special piece read as that piece."""
        bos = [self.bos_id] if add_special_tokens and self.bos_id is not None else []
        return bos + self.encode_with_offsets(text, specials=True)[0]

    def decode_published(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """`ids` as a Hugging Face tokenizer decodes them: no cut at EOS; the special pieces
        written out as their text unless skipped; ids past the pieces give nothing."""
        special, out, run = self._specials()[1], [], []
        for i in (int(i) for i in ids if 0 <= int(i) < self.vocab_size):
            if i in special:
                out.append(self._sp.decode(run))
                run = []
                if not skip_special_tokens:
                    out.append(self.piece(i))
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def encode_batch(self, texts: list[str], add_eos: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Tokenises `texts` with one SentencePiece call: (flat int32 ids, int64 row splits),
        the ids of text i being ids[row_splits[i]:row_splits[i + 1]]."""
        return flat_ids(self._sp.encode(list(texts), out_type=int, add_eos=add_eos,
                                        num_threads=1))

    def __getstate__(self):  # pickled for the input pipeline's worker processes
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["model_proto"], state["path"])


def ids_before_eos(ids: Iterable[int], eos_id: int, pad_id: int | None, size: int) -> list[int]:
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
