"""Formats: how the records of a source become token sequences with their loss weights.

A source gives records (dicts, by index); its format turns a window of them into token ids
with one call (`Format.encode`), flat: for each packed key, (values, row splits), and for
the fine-tuning formats the loss weight of every target token. Then `pieces` cuts them to
the sequence length and `packing` packs them into rows. Each format is registered by its
files.format name (`register`, `make`: an unknown name lists the known ones). The formats:

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
A translation pair is trimmed to the length, as in Mesh-TF. Before that, a long text is
stored cut (`Format.cut`): tokenised `CHUNK` characters at a time, its ids in pieces of
`piece_size` (a multiple of the sequence length, so that the pieces at the length are the
same), each piece an example of its own; so is a long list of pre-tokenized ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mtrain.data.files import CONTINUED
from mtrain.data.ragged import Flat, flat, flat_ids, gather, row_splits
from mtrain.errors import DataError
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS

CHUNK = 1 << 15  # characters of a long text tokenised at a time
PIECE = 2048  # ids of a long text's stored example (`piece_size`)


def piece_size(sequence_length: int | None) -> int:
    """How many ids a long text's stored examples hold: the multiple of the run's
    sequence length from `PIECE` up, so that they are cut to it where the whole would be."""
    return PIECE if not sequence_length else -(-PIECE // sequence_length) * sequence_length


@dataclasses.dataclass
class Encoded:
    """A window of examples as flat arrays: `keys` {packed key: (values, row splits)};
    `weights` the loss weight of each "targets" value (None: all 1)."""

    keys: dict[str, Flat]
    weights: np.ndarray | None = None


FORMATS: dict[str, type["Format"]] = {}  # files.format's names: `register`


def register(*names: str):
    """A class decorator: the `Format` that files.format=`name` reads."""
    def add(cls):
        for name in names:
            FORMATS[name] = cls
        return cls
    return add


def make(name: str, columns: dict | None = None, template=None) -> "Format":
    """The format registered as `name`, reading `columns` ({role: a record's field}) and
    rendering chats with `template` (a `chat.ChatTemplate`) where it has one."""
    if name not in FORMATS:
        raise DataError(f"files.format={name!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[name].of(columns or {}, template)


class Format:
    """A map of records to ids; see the module doc."""

    kind = "lm"  # "lm" (decoder-only) or "translation" (encoder-decoder)
    reads_first = False  # the first id of each example is read, not predicted
    needs_tokenizer = True
    paired = False  # a preference pair's halves are one example (`preference`)
    roles = {}  # files.columns' roles -> this format's fields that name a record's field

    @classmethod
    def of(cls, columns: dict, template=None) -> "Format":
        kwargs = {field: columns[role] for role, field in cls.roles.items() if role in columns}
        if "template" in {f.name for f in dataclasses.fields(cls)}:
            kwargs["template"] = template
        return cls(**kwargs)

    def pieces(self, encoded: "Encoded", length: int, *, start_id: int,
               with_inputs: bool) -> tuple[dict[str, Flat], np.ndarray]:
        """A window's examples cut to the sequence length (`pieces`), and the example of
        each piece."""
        return pieces(encoded, length, reads_first=self.reads_first, start_id=start_id,
                      with_inputs=with_inputs)

    def rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Packed rows as a batch holds them (default: as packed)."""
        return rows

    def encode(self, records: Sequence[dict], vocab, where: Sequence[str] = ()) -> Encoded:
        raise NotImplementedError

    def texts(self, record: dict) -> list[str]:
        """The strings of a raw record (what a vocabulary is trained on)."""
        return []

    def cut(self, examples, size: int):
        """How a long example is stored: `examples` ((ids of each key, weights or None),
        whether the text goes on in the next) -> the examples to store, each of at most
        `size` targets where this format cuts them (`Text`, `Pretokenized`; the others keep
        theirs whole, cut or trimmed to the run's length by `pieces`)."""
        for example, _ in examples:
            yield example

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


@register("text", "text_file")
@dataclasses.dataclass
class Text(Format):
    feature: str = "text"
    roles = {"text": "feature"}

    def encode(self, records, vocab, where=()) -> Encoded:
        texts = [self.field(r, self.feature, where_of(where, i)) for i, r in enumerate(records)]
        ends = [not r.get(CONTINUED) for r in records]
        if all(ends) and max(map(len, texts), default=0) <= CHUNK:  # (the common case)
            return Encoded({"targets": vocab.encode_batch(texts, add_eos=True)})
        # a long text tokenised a chunk at a time; a part whose text goes on: no EOS yet
        parts = [list(chunks(t, CHUNK)) for t in texts]
        values, splits = vocab.encode_batch([c for cs in parts for c in cs])
        ids = [values[a:b] for a, b in zip(splits[:-1], splits[1:])]
        out, at = [], 0
        for cs, end in zip(parts, ends):
            out.append(np.concatenate(ids[at:at + len(cs)] + [[vocab.eos_id]] * end))
            at += len(cs)
        return Encoded({"targets": flat(out)})

    def cut(self, examples, size):
        return cut_ids(examples, size)

    def texts(self, record):
        return [record.get(self.feature, "")]


def chunks(text: str, size: int):
    """`text` in chunks of at most `size` characters, each cut before a space in its second
    half where it has one (tokenised apart, they give the ids of the whole)."""
    while len(text) > size:
        cut = text.rfind(" ", size // 2, size)
        cut = size if cut <= 0 else cut
        yield text[:cut]
        text = text[cut:]
    yield text


def cut_ids(examples, size: int):
    """The examples ((ids of "targets",), no weights) cut into pieces of `size` ids, a text's
    parts (`CONTINUED`) joined first, so that it is cut where it would be whole."""
    pending = None
    for (ids, weights), continued in examples:
        (targets,) = ids
        if pending is not None:
            targets, pending = np.concatenate([pending, targets]), None
        ends = range(size, len(targets) + size, size)
        for start, end in zip(range(0, len(targets), size), ends):
            if continued and end >= len(targets):
                pending = targets[start:]
                break
            yield [targets[start:end]], weights
        else:
            if not continued and not len(targets):
                yield [targets], weights
    if pending is not None and len(pending):
        yield [pending], None


@register("translation")
@dataclasses.dataclass
class Translation(Format):
    inputs: str = "inputs"
    targets: str = "targets"
    kind = "translation"
    roles = {"inputs": "inputs", "targets": "targets"}

    def encode(self, records, vocab, where=()) -> Encoded:
        out = {}
        for key, feature in (("inputs", self.inputs), ("targets", self.targets)):
            texts = [self.field(r, feature, where_of(where, i)) for i, r in enumerate(records)]
            out[key] = vocab.encode_batch(texts, add_eos=True)
        return Encoded(out)

    def texts(self, record):
        return [record.get(self.inputs, ""), record.get(self.targets, "")]


@register("pretokenized")
@dataclasses.dataclass
class Pretokenized(Format):
    column: str = "input_ids"
    needs_tokenizer = False
    roles = {"input_ids": "column"}

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

    def cut(self, examples, size):
        return cut_ids(examples, size)


@register("chat")
@dataclasses.dataclass
class Chat(Format):
    """`template` a `chat.ChatTemplate` (the model dir's chat template)."""

    template: object = None
    column: str = "messages"
    reads_first = True
    roles = {"messages": "column"}

    def encode(self, records, vocab, where=()) -> Encoded:
        return _weighted(self.template.encode(
            self.field(r, self.column, where_of(where, i), (list,)), where=where_of(where, i))
            for i, r in enumerate(records))

    def texts(self, record):
        return [m.get("content", "") for m in record.get(self.column, [])
                if isinstance(m, dict) and isinstance(m.get("content"), str)]

    def describe(self) -> str:
        return f"Chat(column={self.column!r}, template={self.template.describe()})"


@register("prompt_completion")
@dataclasses.dataclass
class PromptCompletion(Format):
    prompt: str = "prompt"
    completion: str = "completion"
    reads_first = True
    roles = {"prompt": "prompt", "completion": "completion"}

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
    k = np.arange(len(example)) - np.repeat(row_splits(counts)[:-1], counts)
    return example, splits[example] + k * length, np.minimum(length, sizes[example] - k * length)


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
        new_splits = row_splits(np.maximum(np.diff(splits) - 1, 0))
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
