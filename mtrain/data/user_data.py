"""The data of a task that reads a user's files (`tasks.task` with `prepared.Files`): each
source prepared (`prepared.prepare`), and each split as the streams the pipeline mixes.

`UserData` is the `streams.DataSource` of such a task, as a text corpus
(`sources.TextSource`) is the shipped tasks': it checks splits, counts examples,
fingerprints what decides the examples (saved with checkpoints), and gives the pipeline
each split's `Stream`s, weighted by the task's mixture. Evaluation passes over every
source's split in turn.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from collections.abc import Iterator

from etils import epath

from mtrain.data import file_identity, formats
from mtrain.data.chat import ChatTemplate
from mtrain.data.streams import Stream, stream_config
from mtrain.data.prepared import PreparedSource, prepare
from mtrain.data.vocabulary import DEFAULT_SIZE
from mtrain.errors import DataError
from mtrain.io.model_dir import ModelDir

log = logging.getLogger("mtrain")


class UserData:
    def __init__(self, task, sources: dict[str, PreparedSource]):
        self.task, self.sources = task, dict(sources)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in ("train", "validation", "test")
                     if all(s in p.splits for p in self.sources.values()))

    def check_split(self, split: str) -> str:
        for source in self.sources.values():
            source.check_split(split)
        return split

    def holds_out_nothing(self, split: str) -> bool:
        """Whether `split` is the validation split that files.validation=0 left out: a run
        then evaluates nothing."""
        return split == "validation" and all(
            p.spec is not None and p.spec.holds_out_nothing for p in self.sources.values())

    def num_examples(self, split: str) -> int:
        return sum(p.num_examples(split) for p in self.sources.values())

    def streams(self, split: str) -> list[Stream]:
        weights = self.task.mixture or {}
        return [Stream(name, p.records(split), p.format, float(weights.get(name, 1.0)),
                       p.fingerprint()) for name, p in self.sources.items()]

    def input_config(self, split: str) -> dict:
        return stream_config(self.streams(split))

    def fingerprint(self) -> str:
        return "; ".join(f"{name}: {p.fingerprint()}" for name, p in self.sources.items())

    def description(self) -> str:
        return f"UserData({', '.join(self.sources)})"

    def check_loss_fraction(self, split: str = "train") -> None:
        """Says when a run starts with an implausible share of tokens carrying loss: below
        1 %, or all of them in a chat (its assistant mask is then likely wrong)."""
        for name, p in self.sources.items():
            fraction = p.loss_fraction(split)
            c = p.info["splits"][split]
            log.info("%s: %d %s examples, %d tokens, %d (%.1f%%) carry loss", name,
                     c["examples"], split, c["tokens"], c["loss_tokens"], 100 * fraction)
            if fraction < 0.01:
                log.warning("%s: only %.2f%% of the %s tokens carry loss: check the "
                            "format's masks", name, 100 * fraction, split)
            elif fraction == 1.0 and "Chat(" in p.info["format"]:
                log.warning("%s: every token of the chats carries loss: the template's "
                            "assistant mask is likely wrong", name)


def texts(task, limit: int = 1_000_000) -> Iterator[str]:
    """The strings of the first `limit` training records of each source of `task` (what a
    vocabulary is trained on, where the run has none)."""
    for name, spec in task.data.items():
        fmt = spec.make_format()
        if not fmt.needs_tokenizer:
            raise DataError(f"source {name!r} is pre-tokenized: name its vocabulary "
                            f"(vocabulary.path, or start from an import)")
        for _, record in itertools.islice(spec.records("train"), limit):
            for text in fmt.texts(record):  # (the trainer skips sentences of more bytes)
                yield from [text] if len(text) <= 1000 else formats.chunks(text, 1000)


def _template(path: str, vocab) -> ChatTemplate:
    return ChatTemplate(epath.Path(path).read_text(), vocab, name=path)


def model_dir_template(model_dir: str, vocab) -> ChatTemplate | None:
    """The chat template of `model_dir` (an import keeps its folder's), if it has one."""
    path = ModelDir(model_dir).chat_template
    return _template(path, vocab) if epath.Path(path).exists() else None


def run_template(vocab, model_dir: str | None, init_from: str | None) -> ChatTemplate | None:
    """The chat template of a run: its model dir's (an import keeps its folder's), else that
    of the run it starts from (`init_from`), if either has one."""
    return next((t for t in (model_dir_template(d, vocab) for d in (model_dir, init_from) if d)
                 if t is not None), None)


def source_template(spec, vocab, template: ChatTemplate | None) -> ChatTemplate | None:
    """The chat template a source of files (`prepared.Files`) renders with: its own
    files.chat_template, else the run's `template`."""
    return _template(spec.chat_template, vocab) if spec.chat_template else template


def prepare_task(task, vocab, data_dir: str, template=None,
                 splits: dict | None = None, sequence_length: int | None = None) -> UserData:
    """Every source of `task` prepared with `vocab` (`template`: the chat template of the
    run, where a source has no `chat_template` of its own; `splits`: each source's
    `Files.splits`, where the caller has them; `sequence_length`: the run's, to which long
    texts are cut: `formats.piece_size`)."""
    sources = {}
    for name, spec in task.data.items():
        own = source_template(spec, vocab, template)
        if spec.format == "chat" and own is None:
            raise DataError("files.format='chat' needs a chat template: import a model that "
                            "has one (--mode=import keeps it in the model dir), or name a "
                            "file with files.chat_template")
        sources[name] = prepare(spec, spec.make_format(own), vocab, data_dir, name,
                                (splits or {}).get(name), formats.piece_size(sequence_length))
    return UserData(task, sources)


def prepare_run(task, vocab_config, data_dir: str, *, recorded: str | None,
                unrecorded: str | None, model_dir: str | None, eval_split: str,
                init_from: str | None = None, sequence_length: int | None = None):
    """(source, vocabulary) of a run of a task that reads files: the vocabulary (the model
    dir's `recorded` one, an import's, vocabulary.path, or one trained on the files' texts,
    cached by the files' identity: `VocabularyConfig.choose`), then every source prepared
    with it and the model dir's chat template (an import keeps its folder's; else that of
    the run it starts from, `init_from`). The eval split must be there, unless the files
    hold out nothing (files.validation=0): the run then evaluates nothing. A run refused
    leaves no prepared copy it made behind."""
    splits = {name: spec.splits() for name, spec in task.data.items()}
    identity = file_identity.identity([p for s in splits.values() for p in s.get("train", [])],
                                      data_dir)
    cached = os.path.join(data_dir, "vocab", f"{task.name}-{identity}",
                          f"spm_{vocab_config.size or DEFAULT_SIZE}.model")
    vocab = vocab_config.choose(recorded, cached, lambda: texts(task),
                                f"the {task.name} training files", where=model_dir,
                                unrecorded=unrecorded)
    template = run_template(vocab, model_dir, init_from)
    source = prepare_task(task, vocab, data_dir, template, splits, sequence_length)
    try:
        if not source.holds_out_nothing(eval_split):
            source.check_split(eval_split)
    except DataError:
        for p in source.sources.values():
            if p.made:
                shutil.rmtree(p.directory, ignore_errors=True)
        raise
    file_identity.remember(data_dir)  # (once the data is prepared: the next start reads none)
    return source, vocab
