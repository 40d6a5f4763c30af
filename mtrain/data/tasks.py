"""Named tasks that a gin config selects with ``run.task``: data, features, splits, metrics.

    run.task = 'lm1b'          # TFDS lm1b, decoder-only language modelling
    run.task = 'wmt14_enfr'    # TFDS wmt14_translate/fr-en, English -> French
    run.task = 'bible_lm'      # the shipped English Bible (offline)
    run.task = 'bible_enfr'    # the shipped English -> French Bible (offline)

A task knows where its examples come from (a TFDS name and version, or the shipped corpus),
which source feature is packed as ``inputs`` and which as ``targets``, its splits and the
split evaluated by default, and its evaluation metrics. TFDS tasks read the web by default;
``run.data_source = DIR`` runs the same TFDS builder on raw files laid out as the official
archives (``python -m mtrain.data.make_offline``), and ``run.data_source = 'shipped'`` makes
such files from the shipped corpus first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mtrain.data import sources
from mtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "lm" (decoder-only) or "translation" (encoder-decoder)
    # (data_dir, data_source) -> the source of examples
    make_source: Callable[[str, str | None], sources.TextSource]
    features: dict[str, str]  # packed key ("inputs", "targets") -> source feature
    eval_split: str  # the split evaluated by default
    metrics: tuple[str, ...]  # evaluation metrics beyond loss and token accuracy
    tfds_name: str | None = None
    description: str = ""

    def source(self, data_dir: str, data_source: str | None = None) -> sources.TextSource:
        if data_source and not self.tfds_name:
            raise ConfigError(f"task {self.name!r} reads the corpus shipped in data/; "
                              f"run.data_source={data_source!r} applies to TFDS tasks only")
        return self.make_source(data_dir, data_source)


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def _tfds(name: str):
    return lambda data_dir, data_source: sources.TfdsSource(name, data_dir, data_source)


LM_METRICS = ("perplexity", "word_perplexity")
TRANSLATION_METRICS = ("bleu",)

register(Task(
    "lm1b", "lm", _tfds("lm1b:1.1.0"), {"targets": "text"}, eval_split="test",
    metrics=LM_METRICS, tfds_name="lm1b:1.1.0",
    description="One Billion Word benchmark (TFDS lm1b; splits train, test)",
))
register(Task(
    # as_supervised yields (fr, en); English -> French takes en as inputs, fr as targets.
    "wmt14_enfr", "translation", _tfds("wmt14_translate/fr-en:1.0.0"),
    {"inputs": "en", "targets": "fr"}, eval_split="test", metrics=TRANSLATION_METRICS,
    tfds_name="wmt14_translate/fr-en:1.0.0",
    description="WMT14 English -> French (TFDS wmt14_translate/fr-en; newstest2013 is "
                "validation, newstest2014 test)",
))
register(Task(
    "bible_lm", "lm", lambda data_dir, data_source: sources.BibleLM("en"), {"targets": "text"},
    eval_split="validation", metrics=LM_METRICS,
    description="English King James Bible verses shipped in data/ (offline language modelling)",
))
register(Task(
    "bible_enfr", "translation",
    lambda data_dir, data_source: sources.BibleTranslation("en", "fr"),
    {"inputs": "inputs", "targets": "targets"}, eval_split="validation",
    metrics=TRANSLATION_METRICS,
    description="King James English -> Louis Segond French, verse by verse, shipped in data/",
))
