"""Rewards of GRPO's completions (`training.grpo`): functions a user names in gin, and two
built-ins for verifiable tasks.

A reward is ``f(record, completions) -> [float, ...]``: the prompt's whole record (its
extra fields: an answer, a test) and the texts of the group's completions (decoded without
the id that ended them, as TRL's ``skip_special_tokens``), one number per completion
(None: no opinion, counted as 0 as TRL's NaN-summing does). gin:

    grpo.rewards = [@answer_after(), 'my_rewards.length_penalty']
    answer_after.marker = '####'
    grpo.reward_weights = [1.0, 0.1]

(a function by its name, `resolve`: ``'module.function'`` or ``'path/file.py:function'``).

A reward that raises, or returns anything but one number per completion, stops the run in
one line that names it and the example (`RewardError`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
import sys
from typing import Any, Callable, Sequence

import numpy as np

from mtrain.errors import ConfigError, DataError


class RewardError(DataError):
    """A reward function failed on an example."""


def resolve(reward) -> Callable:
    """A reward of ``grpo.rewards``: a callable (a gin reference), or the name of one,
    ``'module.function'`` (imported; the working directory is on the path) or
    ``'path/to/file.py:function'``; a `ConfigError` in one line where it cannot be had."""
    if callable(reward):
        return reward
    if not isinstance(reward, str) or not reward.strip():
        raise ConfigError(f"grpo.rewards: {reward!r} is neither a function nor its name")
    try:
        if ":" in reward:
            path, name = reward.rsplit(":", 1)
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(path))[0], path)
            if spec is None or not os.path.isfile(path):
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module_name, _, name = reward.rpartition(".")
            if not module_name:
                raise ImportError("name it as module.function or path/file.py:function")
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        function = getattr(module, name)
    except Exception as e:  # the user's module: whatever it raises, said in one line
        raise ConfigError(f"grpo.rewards: cannot load {reward!r}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())}") from None
    if not callable(function):
        raise ConfigError(f"grpo.rewards: {reward!r} is not a function")
    return function


def name_of(function: Callable) -> str:
    """The name a reward is logged under (``train/rewards/<name>/mean``)."""
    return getattr(function, "__name__", None) or type(function).__name__


@dataclasses.dataclass(frozen=True)
class answer_after:  # noqa: N801 (named as gin and the logs call it)
    """1 where the text after the last `marker` of a completion (stripped; a number's
    commas and a trailing period dropped) equals the record's `field`, else 0: GSM8K's
    ``#### 42``; with `marker` '' the whole completion is compared."""

    marker: str = "####"
    field: str = "answer"

    @property
    def __name__(self) -> str:
        return "answer_after"

    @staticmethod
    def _normal(text: str) -> str:
        text = text.strip().rstrip(".").strip()
        return text.replace(",", "") if re.fullmatch(r"[-+$\d.,\s]+", text) else text

    def __call__(self, record: dict, completions: Sequence[str]) -> list[float]:
        if self.field not in record:
            raise KeyError(f"the record has no {self.field!r} field")
        want = self._normal(str(record[self.field]))
        if not self.marker:  # the whole completion is the answer
            return [float(self._normal(c) == want) for c in completions]
        return [float(self.marker in c and self._normal(c.rsplit(self.marker, 1)[1]) == want)
                for c in completions]


@dataclasses.dataclass(frozen=True)
class matches:  # noqa: N801
    """1 where a completion matches the regular expression `pattern` (`re.search`, or the
    whole completion with `whole`), else 0: a format reward (``<think>.*</think>``), or an
    ending (``light\\.?\\s*$``)."""

    pattern: str = ""
    whole: bool = False

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"matches.pattern={self.pattern!r} is not a regular expression: "
                              f"{e}") from None

    @property
    def __name__(self) -> str:
        return "matches"

    def __call__(self, record: dict, completions: Sequence[str]) -> list[float]:
        find = re.compile(self.pattern, re.DOTALL)
        test = find.fullmatch if self.whole else find.search
        return [float(test(c) is not None) for c in completions]


def _checked(values: Any, group: int, name: str, where: str) -> list[float]:
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != group:
        got = (f"{len(values)} values" if isinstance(values, (list, tuple))
               else type(values).__name__)
        raise RewardError(f"reward {name} returned {got} for {where}; it must return one "
                          f"number per completion ({group})")
    out = []
    for v in values:
        if v is None:
            out.append(0.0)
        elif (isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
              and math.isfinite(v)):
            out.append(float(v))
        else:
            raise RewardError(f"reward {name} returned {v!r} for {where}; a reward is a "
                              f"finite number (or None)")
    return out


def score(functions: Sequence[Callable], weights: Sequence[float], records: Sequence[Any],
          completions: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """(the weighted sum [n] float32, each function's [k, n] float32) of the groups of
    `completions` of `records` (`data.prompts.PromptRecord`: their `record` and `where`),
    n = groups x their size, in order."""
    per = np.zeros((len(functions), sum(len(c) for c in completions)), np.float32)
    for k, function in enumerate(functions):
        name, row = name_of(function), 0
        for record, texts in zip(records, completions):
            try:
                values = function(dict(record.record), list(texts))
            except Exception as e:  # a user's function: say which, on what, in one line
                raise RewardError(f"reward {name} raised {type(e).__name__} on "
                                  f"{record.where}: {e}") from None
            per[k, row:row + len(texts)] = _checked(values, len(texts), name, record.where)
            row += len(texts)
    total = (np.asarray(weights, np.float32)[:, None] * per).sum(axis=0)
    return total.astype(np.float32), per
