"""Formats: how the records of a source become token sequences with their loss weights.

A source gives records (dicts, by index); its format turns a window of them into token ids
with one call (`Format.encode`), flat: for each packed key, (values, row splits), and for
the fine-tuning formats the loss weight of every target token. Then `pieces` cuts them to
the sequence length and `packing` packs them into rows. The formats:

- `Text`: a string feature; its ids, EOS appended. The model reads its start token first.
- `Translation`: two string features, "inputs" and "targets", each with EOS.
- `Pretokenized`: a list of ids (an ``input_ids`` column), as they are: no tokenizer run,
  nothing appended; the model reads its start token, then the ids. Ids outside the
  vocabulary are an error.
- `Chat`: ``{"messages": [{"role", "content"}, ...]}`` rendered with the model's chat
  template (`chat.ChatTemplate`), the loss on the assistant's tokens only.
- `PromptCompletion`: ``{"prompt", "completion"}``, the loss on the completion and its EOS
  (TRL's convention).
- `preference.Preference`: ``{"prompt", "chosen", "rejected"}`` pairs for DPO, both
  halves of a pair one example.

The two fine-tuning formats `reads_first`: their ids are the model's input as they are (the
template decides whether a BOS comes first, as transformers and TRL feed them), so the first
id of an example is read, not predicted, and nothing is read before it. Their batches carry
the token read before each target (`base.READ_INPUTS`) and the weights
(`base.LOSS_WEIGHTS`); so do
those of a mixture that holds one, where the examples of the other formats read the model's
start token first, as they always do.

Long examples are cut, not trimmed (`pieces`): an LM example of more tokens than the
sequence length becomes several, each at most the length. A piece of a `Text` or
`Pretokenized` example reads the start token first, as a new document (seqio's
`split_tokens`, MaxText's); a piece of a fine-tuning example reads the true token before it
(its context is cut, nothing else changes), and a piece with no weighted token is dropped.
A translation pair is trimmed to the length, as in Mesh-TF.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mtrain.data.sentencepiece_vocabulary import flat_ids
from mtrain.errors import DataError
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS

Flat = tuple[np.ndarray, np.ndarray]  # (values int32, row splits int64)



@dataclasses.dataclass
class Encoded:
    """A window of examples as flat arrays: `keys` {packed key: (values, row splits)};
    `weights` the loss weight of each "targets" value (None: all 1)."""

    keys: dict[str, Flat]
    weights: np.ndarray | None = None


def flat(ids: Sequence[Sequence[int]]) -> Flat:
    """Arrays of ids as (flat int32 values, int64 row splits) (lists of Python ints:
    `sentencepiece_vocabulary.flat_ids`, faster for those)."""
    lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
    splits = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lengths, out=splits[1:])
    values = np.concatenate([np.asarray(x, np.int32) for x in ids]) if len(ids) else \
        np.zeros(0, np.int32)
    return values.astype(np.int32, copy=False), splits


class Format:
    """A map of records to ids; see the module doc."""

    kind = "lm"  # "lm" (decoder-only) or "translation" (encoder-decoder)
    reads_first = False  # the first id of each example is read, not predicted
    needs_tokenizer = True

    def encode(self, records: Sequence[dict], vocab, where: Sequence[str] = ()) -> Encoded:
        raise NotImplementedError

    def texts(self, record: dict) -> list[str]:
        """The strings of a raw record (what a vocabulary is trained on)."""
        return []

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items())
                             if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"

    def field(self, record: dict, name: str, where: str, types=(str,)):
        if name not in record:
            raise DataError(f"{where}: no {name!r} in this record (it has "
                            f"{', '.join(map(repr, record)) or 'nothing'}); "
                            f"{type(self).__name__.lower()} examples need one")
        value = record[name]
        if not isinstance(value, types):
            raise DataError(f"{where}: {name!r} is a {type(value).__name__}, not a "
                            f"{' or '.join(t.__name__ for t in types)}")
        return value


def _weighted(examples) -> Encoded:
    """Examples given as (ids, loss weights) lists, as one window."""
    pairs = list(examples)
    return Encoded({"targets": flat_ids([ids for ids, _ in pairs])},
                   flat_ids([weights for _, weights in pairs])[0])


def where_of(where: Sequence[str], i: int) -> str:
    return where[i] if i < len(where) else f"example {i}"


@dataclasses.dataclass
class Text(Format):
    feature: str = "text"

    def encode(self, records, vocab, where=()) -> Encoded:
        texts = [self.field(r, self.feature, where_of(where, i)) for i, r in enumerate(records)]
        return Encoded({"targets": vocab.encode_batch(texts, add_eos=True)})

    def texts(self, record):
        return [record.get(self.feature, "")]


@dataclasses.dataclass
class Translation(Format):
    inputs: str = "inputs"
    targets: str = "targets"
    kind = "translation"

    def encode(self, records, vocab, where=()) -> Encoded:
        out = {}
        for key, feature in (("inputs", self.inputs), ("targets", self.targets)):
            texts = [self.field(r, feature, where_of(where, i)) for i, r in enumerate(records)]
            out[key] = vocab.encode_batch(texts, add_eos=True)
        return Encoded(out)

    def texts(self, record):
        return [record.get(self.inputs, ""), record.get(self.targets, "")]


@dataclasses.dataclass
class Pretokenized(Format):
    column: str = "input_ids"
    needs_tokenizer = False

    def encode(self, records, vocab, where=()) -> Encoded:
        ids = [self.field(r, self.column, where_of(where, i), (list, tuple, np.ndarray))
               for i, r in enumerate(records)]
        values, splits = flat(ids)
        bad = (values < 0) | (values >= vocab.vocab_size)
        if bad.any():
            i = int(np.searchsorted(splits, np.argmax(bad), side="right")) - 1
            raise DataError(f"{where_of(where, i)}: {self.column!r} holds the id "
                            f"{int(values[np.argmax(bad)])}, outside the vocabulary's "
                            f"{vocab.vocab_size} ids")
        return Encoded({"targets": (values, splits)})


@dataclasses.dataclass
class Chat(Format):
    """`template` a `chat.ChatTemplate` (the model dir's chat template)."""

    template: object = None
    column: str = "messages"
    reads_first = True

    def encode(self, records, vocab, where=()) -> Encoded:
        return _weighted(self.template.encode(
            self.field(r, self.column, where_of(where, i), (list,)), where=where_of(where, i))
            for i, r in enumerate(records))

    def texts(self, record):
        return [m.get("content", "") for m in record.get(self.column, [])
                if isinstance(m, dict) and isinstance(m.get("content"), str)]

    def describe(self) -> str:
        return f"Chat(column={self.column!r}, template={self.template.describe()})"


@dataclasses.dataclass
class PromptCompletion(Format):
    prompt: str = "prompt"
    completion: str = "completion"
    reads_first = True

    def encode(self, records, vocab, where=()) -> Encoded:
        from mtrain.data.chat import prompt_completion

        return _weighted(prompt_completion(vocab, self.field(r, self.prompt, where_of(where, i)),
                                           self.field(r, self.completion, where_of(where, i)))
                         for i, r in enumerate(records))

    def texts(self, record):
        return [record.get(self.prompt, ""), record.get(self.completion, "")]


# --- cutting examples to the sequence length -------------------------------------------------

def _cut(splits: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Examples of row splits `splits` cut into pieces of at most `length`: (the example of
    each piece, its start in the flat values, its length)."""
    sizes = np.diff(splits)
    counts = np.maximum(-(-sizes // length), 0)
    example = np.repeat(np.arange(len(sizes)), counts)
    k = np.arange(len(example)) - np.repeat(np.cumsum(counts) - counts, counts)
    return example, splits[example] + k * length, np.minimum(length, sizes[example] - k * length)


def gather(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> Flat:
    splits = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=splits[1:])
    index = np.arange(int(splits[-1])) - np.repeat(splits[:-1] - starts, sizes)
    return values[index], splits


def pieces(encoded: Encoded, length: int, *, reads_first: bool, start_id: int,
           with_inputs: bool) -> tuple[dict[str, Flat], np.ndarray]:
    """The packed keys of a window (see the module doc): "targets" (and "inputs" for
    translation), and with `with_inputs` also `base.READ_INPUTS` and `base.LOSS_WEIGHTS`
    aligned with "targets"; and the example of each piece. (Preference pairs:
    `preference.pieces`.)"""
    keys = encoded.keys
    if "inputs" in keys:  # translation: trimmed by packing
        return dict(keys), np.arange(len(keys["targets"][1]) - 1)
    values, splits = keys["targets"]
    weights = (np.ones(len(values), np.int32) if encoded.weights is None
               else np.asarray(encoded.weights, np.int32))
    if reads_first:  # read ids[:-1], predict ids[1:]
        first = np.zeros(len(values), bool)
        first[splits[:-1][np.diff(splits) > 0]] = True
        last = np.zeros(len(values), bool)
        last[splits[1:][np.diff(splits) > 0] - 1] = True
        sizes = np.maximum(np.diff(splits) - 1, 0)
        new_splits = np.zeros_like(splits)
        np.cumsum(sizes, out=new_splits[1:])
        read, values, weights, splits = values[~last], values[~first], weights[~first], new_splits
    example, starts, sizes = _cut(splits, length)
    if reads_first:
        keep = np.add.reduceat(weights, starts) > 0 if len(starts) and len(weights) else \
            np.zeros(len(starts), bool)
        keep &= sizes > 0
        example, starts, sizes = example[keep], starts[keep], sizes[keep]
    targets = gather(values, starts, sizes)
    out = {"targets": targets}
    if with_inputs:
        if reads_first:
            inputs = gather(read, starts, sizes)[0]
        else:  # the start token, then the targets
            inputs = np.empty_like(targets[0])
            inputs[1:] = targets[0][:-1]
            inputs[targets[1][:-1][sizes > 0]] = start_id
        out[READ_INPUTS] = (inputs, targets[1])
        out[LOSS_WEIGHTS] = (gather(weights, starts, sizes)[0], targets[1])
    return out, example


def take(keys: dict[str, Flat], order: np.ndarray) -> dict[str, Flat]:
    """The examples `order` of every key of `keys`, in that order."""
    out = {}
    for key, (values, splits) in keys.items():
        out[key] = gather(values, splits[:-1][order], np.diff(splits)[order])
    return out


def concat(parts: list[dict[str, Flat]]) -> dict[str, Flat]:
    """The examples of several windows' keys, one after the other."""
    out = {}
    for key in parts[0]:
        values = np.concatenate([p[key][0] for p in parts])
        sizes = np.concatenate([np.diff(p[key][1]) for p in parts])
        splits = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=splits[1:])
        out[key] = (values, splits)
    return out
