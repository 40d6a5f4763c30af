"""Preference pairs for DPO (`training.dpo`): the format of ``{"prompt", "chosen",
"rejected"}`` records (`Preference`), and how a window of pairs is cut and packed.

A pair is packed as one example, so that its halves share a row and a batch, and then split
in two segments (`split_pairs`): its chosen half is segment 2k - 1, its rejected half
segment 2k, each reading its own tokens alone, from position 0. Which half a target is of,
and whether it is its completion's, its loss weight says (the constants below). A pair of
more targets than the sequence length is trimmed, each half keeping its start (`pieces`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrain.data import formats, ragged
from mtrain.data.ragged import flat_ids
from mtrain.errors import DataError
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS

# A preference pair's loss weights (`Preference`): which half each target is of, and whether
# it is its completion's (only those carry the DPO loss, as weights > 0 do any loss).
CHOSEN, REJECTED = 1, 2  # a completion's targets
CHOSEN_PROMPT, REJECTED_PROMPT = 0, -1  # the other targets of each half


@formats.register("preference")
@dataclasses.dataclass
class Preference(formats.Format):
    """A preference pair for DPO: ``{"prompt", "chosen", "rejected"}``, three strings (TRL's
    standard form: each half [BOS] + the prompt's ids + the completion's ids + [EOS], as
    `PromptCompletion` makes them), or TRL's conversational form: the prompt a list of
    messages (``"prompt"``, else ``"messages"``), each completion a list of messages (or a
    string: the assistant's message), rendered by the chat template with the prompt before
    them. The targets of a pair are the chosen half's, then the rejected half's, each half
    reading its own tokens (`READ_INPUTS` is made here); weights `CHOSEN`/`REJECTED` on
    the completions' targets (the chat's: the assistant's tokens after the prompt), else
    `CHOSEN_PROMPT`/`REJECTED_PROMPT`."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    template: object = None
    reads_first = True
    paired = True
    roles = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}

    def pieces(self, encoded, length, *, start_id, with_inputs):
        return pieces(encoded, length)

    def rows(self, rows):
        rows["targets_segment_ids"], rows["targets_positions"] = split_pairs(
            rows["targets_segment_ids"], rows[LOSS_WEIGHTS])
        return rows

    def encode(self, records, vocab, where=()) -> formats.Encoded:
        targets, read, weights = [], [], []
        for i, record in enumerate(records):
            at = formats.where_of(where, i)
            t, r, w = [], [], []
            for name, (mark, unmarked) in ((self.chosen, (CHOSEN, CHOSEN_PROMPT)),
                                           (self.rejected, (REJECTED, REJECTED_PROMPT))):
                ids, mask = self._half(record, name, vocab, at)
                t += ids[1:]
                r += ids[:-1]
                w += [mark if m else unmarked for m in mask[1:]]
            targets.append(t)
            read.append(r)
            weights.append(w)
        return formats.Encoded({"targets": flat_ids(targets), READ_INPUTS: flat_ids(read)},
                       flat_ids(weights)[0])

    def _half(self, record: dict, name: str, vocab, at: str) -> tuple[list[int], list[int]]:
        """The ids of the prompt and completion `name`, and the mask of the completion's."""
        conversational = isinstance(record.get(self.prompt, record.get("messages")), list)
        if not conversational:
            from mtrain.data.chat import prompt_completion

            prompt = self.field(record, self.prompt, at)
            completion = self.field(record, name, at)
            if not completion.strip():
                raise DataError(f"{at}: {name!r} is empty; a preference pair needs two "
                                f"completions")
            return prompt_completion(vocab, prompt, completion)
        from mtrain.data.chat import ChatError

        if self.template is None:
            raise DataError(f"{at}: a conversational preference pair needs a chat template: "
                            f"import a model that has one, or name files.chat_template")
        prompt = record.get(self.prompt, record.get("messages"))
        completion = self.field(record, name, at, (list, str))
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        if not any(isinstance(m, dict) and isinstance(m.get("content"), str)
                   and m["content"].strip() for m in completion):
            raise DataError(f"{at}: {name!r} is empty; a preference pair needs two "
                            f"completions")
        head = self.template.prompt(prompt, where=at)
        ids, mask = self.template.encode(list(prompt) + list(completion), where=at)
        if ids[:len(head)] != head:
            raise ChatError(f"{at}: {self.template.name} renders the prompt differently "
                            f"before {name!r}, so its tokens cannot be told")
        mask = [0] * len(head) + mask[len(head):]
        if not any(mask):
            raise DataError(f"{at}: {name!r} holds no assistant tokens with "
                            f"{self.template.name}")
        return ids, mask

    def texts(self, record):
        out = []
        for name in (self.prompt, self.chosen, self.rejected, "messages"):
            value = record.get(name)
            out += [value] if isinstance(value, str) else [
                m.get("content", "") for m in value or [] if isinstance(m, dict)
                and isinstance(m.get("content"), str)] if isinstance(value, list) else []
        return out

    def describe(self) -> str:
        template = self.template.describe() if self.template is not None else None
        return (f"Preference(prompt={self.prompt!r}, chosen={self.chosen!r}, "
                f"rejected={self.rejected!r}, template={template})")


def split_pairs(segment_ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed rows of preference pairs (example k of a row: segment k) -> each pair's
    halves as segments of their own (chosen 2k - 1, rejected 2k) and their positions, each
    half from 0: (segment ids, positions), [rows, length] each."""
    rejected = (weights == REJECTED) | (weights == REJECTED_PROMPT)
    segments = np.where(segment_ids > 0, 2 * segment_ids - 1 + rejected, 0).astype(np.int32)
    index = np.broadcast_to(np.arange(segments.shape[1]), segments.shape)
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return segments, np.where(segments > 0, index - first, 0).astype(np.int32)


def _trim(values, read, weights, splits, length):
    """Pairs of more than `length` targets, each half trimmed to keep its start (the
    longer half first, down to half the length), and pairs left without a chosen or a
    rejected completion target dropped: (values, read, weights, splits, kept pairs)."""
    sizes = np.diff(splits)
    rejected = (weights == REJECTED) | (weights == REJECTED_PROMPT)
    chosen_sizes = ragged.sums(~rejected, splits)
    rejected_sizes = sizes - chosen_sizes
    keep_c = np.minimum(chosen_sizes, np.maximum(length // 2, length - rejected_sizes))
    keep_r = np.minimum(rejected_sizes, length - keep_c)
    starts = np.stack([splits[:-1], splits[:-1] + chosen_sizes], 1).reshape(-1)
    kept = np.stack([keep_c, keep_r], 1).reshape(-1)
    (values, half_splits), read, weights = (
        ragged.gather(values, starts, kept), ragged.gather(read, starts, kept)[0],
        ragged.gather(weights, starts, kept)[0])
    ok = (ragged.sums(weights > 0, half_splits).reshape(-1, 2) > 0).all(axis=1)
    pair_sizes = kept.reshape(-1, 2).sum(1)
    new_splits = ragged.row_splits(pair_sizes)
    pairs = np.flatnonzero(ok)
    out = [ragged.gather(x, new_splits[:-1][pairs], pair_sizes[pairs])
           for x in (values, read, weights)]
    return out[0][0], out[1][0], out[2][0], out[0][1], pairs


def pieces(encoded: formats.Encoded, length: int) -> tuple[dict, np.ndarray]:
    """`formats.pieces` of a window of pairs: their keys, each pair trimmed to `length`,
    and the pair of each piece (those left without a completion in a half are dropped)."""
    keys = encoded.keys
    values, splits = keys["targets"]
    values, read, weights, splits, pairs = _trim(
        values, keys[READ_INPUTS][0], np.asarray(encoded.weights, np.int32), splits, length)
    return {"targets": (values, splits), READ_INPUTS: (read, splits),
            LOSS_WEIGHTS: (weights, splits)}, pairs
