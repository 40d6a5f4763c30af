"""Named tasks that a gin config selects with ``run.task``: where the text comes from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mtrain.data import sources
from mtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "lm" (decoder-only) or "translation" (encoder-decoder)
    make_source: Callable[[str], sources.TextSource]  # data_dir -> source
    description: str = ""


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


register(Task(
    "bible_lm", "lm", lambda data_dir: sources.BibleLM("en"),
    "English King James Bible verses shipped in data/ (offline language modelling)",
))
