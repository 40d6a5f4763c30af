"""Prompts for reinforcement learning (GRPO: `training.grpo`), and rollouts sampled elsewhere.

Two formats of ``files.*`` (read here whole, not prepared: a prompt's other fields are the
reward's, whatever they hold):

- ``files.format = 'prompts'``: a prompt a line. JSON Lines ``{"prompt": ...}`` (the field
  named by ``files.columns = {"prompt": "question"}``): a text, which the model continues
  after its start id as an LM example begins; a conversation ``[{"role", "content"}, ...]``,
  rendered by the chat template with its generation prompt; or ids, read as they are, the
  first one first. A text file: a text a line. Every other field of the record is kept for
  the rewards (`evaluation.rewards`).
- ``files.format = 'rollouts'``: completions sampled by another engine (a serving stack,
  an earlier run), ``{"prompt", "completions": [...], "rewards": [...]}``, one record per
  group of ``grpo.num_generations``; a completion is ids (ended by EOS if it ended) or a
  text (encoded and ended by EOS, or a chat's end of turn). Read in file order.

`PromptBatches` is a GRPO run's input iterator: step k (from 0) is of generation
k // num_iterations, whose prompts are records g x P ... g x P + P - 1 of the run's order
(P = batch_size / num_generations prompts a step; prompts shuffled by ``run.seed`` each
epoch, rollouts in file order), read by every process. Its position is a
function of the step; what it saves besides is the rollout that later steps of a
generation train on again (`StepPrompts.keep`), so that a resumed run takes exactly those steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
from typing import Any

import numpy as np
from etils import epath

from mtrain.data import files as files_lib
from mtrain.errors import DataError
from mtrain.io.textfiles import write_atomically

FORMATS = ("prompts", "rollouts")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One line: `where` it is (``file:line``), the whole `record` (for the rewards), its
    `prompt` (a text, ids, or a conversation), and of a rollout its `completions` (texts
    or ids) and `rewards`."""

    where: str
    record: dict
    prompt: Any
    completions: tuple | None = None
    rewards: tuple | None = None


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                       for i in x)


def _is_chat(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in x)


def _check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str) or _is_chat(prompt) or (_is_ids(prompt) and prompt):
        return
    raise DataError(f"{where}: a prompt must be a text, a list of {{\"role\", \"content\"}} "
                    f"messages or a list of ids, got {type(prompt).__name__}")


def record_of(raw, where: str, fmt: str, field: str, group: int) -> PromptRecord:
    """A `PromptRecord` of one raw record, checked (a `DataError` naming `where`)."""
    if isinstance(raw, str):  # a text file's line
        raw = {field: raw}
    if not isinstance(raw, dict) or field not in raw:
        raise DataError(f"{where}: a {fmt} record is a JSON object with a {field!r} field")
    prompt = raw[field]
    _check_prompt(prompt, where)
    if fmt == "prompts":
        return PromptRecord(where, raw, prompt)
    completions, rewards = raw.get("completions"), raw.get("rewards")
    if not isinstance(completions, list) or not isinstance(rewards, list):
        raise DataError(f"{where}: a rollout needs \"completions\" and \"rewards\" lists")
    if len(completions) != group or len(rewards) != group:
        raise DataError(f"{where}: {len(completions)} completions and {len(rewards)} rewards; "
                        f"grpo.num_generations is {group}")
    if not all(isinstance(c, str) or _is_ids(c) for c in completions):
        raise DataError(f"{where}: each completion must be a text or a list of ids")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
               for r in rewards):
        raise DataError(f"{where}: each reward must be a finite number")
    return PromptRecord(where, raw, prompt, tuple(completions), tuple(float(r) for r in rewards))


def read(spec, group: int) -> list[PromptRecord]:
    """The records of ``files.train`` of a `prepared.Files` of a format of `FORMATS`, in
    order (`group`: grpo.num_generations, which a rollout's lists must hold)."""
    field = (spec.columns or {}).get("prompt", "prompt")
    out = []
    for path in spec.splits().get("train", []):
        kind = spec.reader_kind() or files_lib.file_kind(path)
        for number, raw in files_lib.read(path, kind):
            if kind != "jsonl" and isinstance(raw, dict) and set(raw) == {"text"}:
                raw = raw["text"]  # (a text file's line)
            out.append(record_of(raw, f"{path}:{number}", spec.format, field, group))
    if not out:
        raise DataError(f"files.train holds no {spec.format}")
    return out


class PromptSource:
    """The data of a GRPO run: its records (`read`), every one for training (no held-out
    split: a run logs its rewards each step)."""

    def __init__(self, records: list[PromptRecord], fmt: str):
        self.records, self.format = records, fmt

    def check_split(self, split: str) -> str:
        if split != "train":
            raise DataError(f"files.format={self.format!r} holds no {split!r} split: a GRPO "
                            f"run evaluates its rewards as it trains")
        return split

    def holds_out_nothing(self, split: str) -> bool:
        return True

    def num_examples(self, split: str) -> int:
        return len(self.records) if split == "train" else 0

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for r in self.records:
            digest.update(json.dumps(r.record, sort_keys=True).encode())
        return f"{self.format}: {len(self.records)} records, sha256 {digest.hexdigest()[:16]}"

    def description(self) -> str:
        return f"PromptSource({self.format}, {len(self.records)} records)"

    def check_loss_fraction(self, split: str = "train") -> None:
        """(No fixed share of tokens carries loss: the completions are sampled.)"""


@dataclasses.dataclass
class StepPrompts:
    """What the iterator gives step `number` (from 0): the generation it is of, whether it
    is that generation's first step (`fresh`: sample, or read the rollouts), its `records`,
    and the `pending` rollout (of that generation) where it is not fresh."""

    number: int
    generation: int
    fresh: bool
    records: list[PromptRecord]
    iterator: "PromptBatches"

    @property
    def pending(self):
        return self.iterator.pending

    def keep(self, arrays: dict) -> None:
        """The rollout the later steps of this generation train on again, as the arrays a
        checkpoint saves with the position (`rollouts.Rollout.arrays`)."""
        self.iterator.pending = arrays


class PromptBatches:
    """The input iterator of a GRPO run (module doc): `per_step` prompts a step (every
    process reads them all: the generator samples the global batch, each process keeping
    its rows' groups), `iterations` steps a generation."""

    def __init__(self, source: PromptSource, *, per_step: int, iterations: int, seed: int,
                 shuffle: bool, process: int = 0):
        self.source, self.per_step = source, per_step
        self.iterations, self.seed, self.shuffle = iterations, seed, shuffle
        self.process = process  # (which names the files it saves)
        self.position = 0  # steps taken
        self.pending: dict | None = None  # (`StepPrompts.keep`)

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.source.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def records_of(self, generation: int) -> list[PromptRecord]:
        """The records of `generation`."""
        n = len(self.source.records)
        out = []
        for index in range(generation * self.per_step, (generation + 1) * self.per_step):
            epoch, at = divmod(index, n)
            out.append(self.source.records[int(self._order(epoch)[at])])
        return out

    def __iter__(self):
        return self

    def __next__(self) -> StepPrompts:
        number, self.position = self.position, self.position + 1
        generation, offset = divmod(number, self.iterations)
        if offset == 0:
            self.pending = None
        return StepPrompts(number, generation, offset == 0, self.records_of(generation), self)

    def close(self) -> None:
        """(No worker to stop.)"""

    # ---- the checkpoint's ``data`` item (`io.input_state`) ----

    def _prefix(self, directory) -> str:
        return os.path.join(str(directory), f"grpo_prompts.{self.process}")

    def save(self, directory) -> str:
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
        prefix = self._prefix(directory)
        if self.pending is not None:
            buffer = io.BytesIO()
            np.savez(buffer, **self.pending)
            epath.Path(prefix + ".npz").write_bytes(buffer.getvalue())
        write_atomically(prefix + ".json", json.dumps(
            {"position": self.position, "pending": self.pending is not None},
            sort_keys=True))
        return prefix

    def restore(self, directory) -> None:
        prefix = self._prefix(directory)
        try:
            state = json.loads(epath.Path(prefix + ".json").read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the prompts' position under {directory}: "
                            f"{type(e).__name__}") from None
        self.position, self.pending = int(state["position"]), None
        if state.get("pending") and self.position % self.iterations:
            with np.load(io.BytesIO(epath.Path(prefix + ".npz").read_bytes())) as saved:
                self.pending = dict(saved)
