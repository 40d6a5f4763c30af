"""Tasks: what a run trains on (data, features, splits, metrics), named by a gin file.

A task file names its data with `task` (``run.task = @task()``): text corpora
(`tfds_data`: any TFDS dataset by name and version with the features to read; `bible`: the
shipped corpus), or a user's own files (``task.data = @files()``: `prepared.Files`), or a
mixture of several sources by weight (``task.data = {'code': @code/files(), ...}`` and
``task.mixture = {'code': 0.3, 'web': 0.7}``). The four shipped tasks are such files
(configs/tasks/), and also have names:

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

from mtrain.data import prompts, sources
from mtrain.data.prepared import Files
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
    data: dict[str, Files] | None = None  # a user's files, by source name
    mixture: dict[str, float] | None = None  # their weights (None: one source)
    vocabulary_size: int | None = None  # the vocabulary to train where none is given

    @property
    def preference(self) -> bool:
        """Whether the task's examples are preference pairs (trained with DPO)."""
        return any(f.format == "preference" for f in (self.data or {}).values())

    @property
    def reinforcement(self) -> bool:
        """Whether the task's examples are prompts or rollouts (trained with GRPO)."""
        return any(f.format in prompts.FORMATS for f in (self.data or {}).values())

    def source(self, data_dir: str, data_source: str | None = None) -> sources.TextSource:
        if self.data is not None:
            raise ConfigError(f"task {self.name!r} reads files (task.data), not a corpus")
        if data_source and not self.tfds_name:
            raise ConfigError(f"task {self.name!r} reads the corpus shipped in data/; "
                              f"run.data_source={data_source!r} applies to TFDS tasks only")
        return self.make_source(data_dir, data_source).packs(self.features)


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: "str | Task") -> Task:
    """A task by name (of the shipped four), or a `Task` gin made (`task`)."""
    if isinstance(name, Task):
        return name
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


# --- tasks named in gin -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TextData:
    """A corpus of text examples (`sources.TextSource`) and which features a task packs."""

    make_source: Callable[[str, str | None], sources.TextSource]
    features: dict[str, str]
    tfds_name: str | None = None
    description: str = ""


def tfds_data(name: str, features: dict[str, str]) -> TextData:
    """A TFDS dataset by name and version (``'lm1b:1.1.0'``) and the features to pack
    (``{'targets': 'text'}``; ``{'inputs': 'en', 'targets': 'fr'}`` for translation),
    prepared by its builder (run.data_source: from local raw files)."""
    return TextData(_tfds(name), dict(features), name, f"TFDS {name}")


def bible(source: str = "en", target: str | None = None) -> TextData:
    """The shipped Bible: one language (language modelling) or a pair (translation)."""
    if target is None:
        return TextData(lambda data_dir, data_source: sources.BibleLM(source),
                        {"targets": "text"}, description=f"the shipped {source} Bible")
    return TextData(lambda data_dir, data_source: sources.BibleTranslation(source, target),
                    {"inputs": "inputs", "targets": "targets"},
                    description=f"the shipped {source} -> {target} Bible")


def task(data, name: str | None = None, mixture: dict[str, float] | None = None,
         eval_split: str | None = None, metrics: tuple[str, ...] | None = None,
         vocabulary_size: int | None = None) -> Task:
    """A task from gin (module doc). `data`: a `TextData`, a `Files`, or {name: Files} with
    `mixture` {name: weight}. `eval_split` defaults to "validation" ("test" for TFDS data
    that has no validation split is for the task file to say); `metrics` beyond loss, by
    default perplexity (and word perplexity and BLEU for text corpora)."""
    if isinstance(data, TextData):
        kind = "translation" if "inputs" in data.features else "lm"
        return Task(name or data.tfds_name or "text", kind, data.make_source, data.features,
                    eval_split or "validation",
                    tuple(metrics) if metrics is not None else
                    (TRANSLATION_METRICS if kind == "translation" else LM_METRICS),
                    tfds_name=data.tfds_name, description=data.description,
                    vocabulary_size=vocabulary_size)
    named = {"files": data} if isinstance(data, Files) else dict(data or {})
    if not named or not all(isinstance(f, Files) for f in named.values()):
        raise ConfigError("task.data must be @files(), @tfds_data(), @bible(), or a dict "
                          "{name: @name/files()} of a mixture")
    if len(named) > 1 or mixture:
        mixture = dict(mixture or {})
        if set(mixture) != set(named) or any(not isinstance(w, (int, float)) or w <= 0
                                             for w in mixture.values()):
            raise ConfigError(f"task.mixture must give each source of task.data "
                              f"({', '.join(named)}) a positive weight, got {mixture}")
    kinds = {"translation" if f.format == "translation" else "lm" for f in named.values()}
    if len(kinds) > 1:
        raise ConfigError("a mixture mixes translation pairs with language-model formats")
    if any(f.format in prompts.FORMATS for f in named.values()) and len(named) > 1:
        raise ConfigError("GRPO reads one file set of prompts or rollouts (task.data = "
                          "@files()), not a mixture")
    if len({f.format == "preference" for f in named.values()}) > 1:
        raise ConfigError("a mixture mixes preference pairs (DPO) with examples of another "
                          "format")
    return Task(name or "_".join(named), kinds.pop(), None, {}, eval_split or "validation",
                tuple(metrics) if metrics is not None else ("perplexity",),
                description="files: " + ", ".join(named), data=named, mixture=mixture,
                vocabulary_size=vocabulary_size)
