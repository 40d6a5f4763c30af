"""A Hugging Face ``tokenizer.json`` as a vocabulary (`TokenizerVocabulary`), through the
``tokenizers`` package: the tokenizer of published models that ship no sentencepiece file."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from mtrain.data.ragged import flat_ids
from mtrain.data.sentencepiece_vocabulary import Vocabulary, VocabularyError, ids_before_eos
from mtrain.errors import first_line


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

        self.path, self._proto, self._added = path, data, None
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

    def is_special(self, i: int) -> bool:
        """Whether id `i` is one of the tokenizer's added tokens (its specials, a chat
        template's markers) rather than text."""
        if self._added is None:
            self._added = frozenset(self._tok.get_added_tokens_decoder())
        return i in self._added

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_published(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids as the published tokenizer makes them (Hugging Face's
        ``tokenizer.encode``): with the special tokens its post-processor adds (Llama 3's
        BOS in front; Qwen's nothing) unless `add_special_tokens` is False."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode_published(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """`ids` as the published tokenizer decodes them (``tokenizer.decode``): no cut at
        EOS, special tokens written out unless skipped; ids past its pieces give nothing."""
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size],
                                skip_special_tokens=skip_special_tokens)

    def encode_with_offsets(self, text: str, *, specials: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each one's (start, end) character offsets in `text` (the
        tokenizer's own: the bytes of one character split over several tokens each have
        that character's). Like `encode` it always reads a special token's text in `text` as
        that token: `specials` changes nothing (see `Vocabulary.encode_with_offsets`)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(ids_before_eos(ids, self.eos_id, self.pad_id, self.vocab_size),
                                skip_special_tokens=True)

    def encode_batch(self, texts: list[str], add_eos: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        return flat_ids([e.ids + [self._eos] * add_eos
                      for e in self._tok.encode_batch(list(texts), add_special_tokens=False)])
