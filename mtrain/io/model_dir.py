"""A model dir's files, named in one place.

    <model_dir>/
      checkpoints/<step>/       orbax checkpoints (`checkpoints.Checkpoints`)
      vocabulary.model          the vocabulary the checkpoints were trained with
      config.gin                the operative gin config of the last training run
      chat_template.jinja       an imported model's chat template (its folder's), exported back
      huggingface.json          what an import came from: its family, folder and adapter
                                (`huggingface.origin`), which export writes it back as
      metrics.jsonl             one JSON record per logged step (`metrics.MetricsWriter`)
      events.out.tfevents.*     TensorBoard events (the same records)
      decodes/<split>-<step>.tsv  translation: every decode of an evaluation with BLEU
      mtrain.lock               the training run that holds the dir (`lock.ModelDirLock`)
      profile/                  jax.profiler traces (run.profile_steps)
      before-restart-<n>/       what --restart moved aside (`RUN_FILES`)

Training writes all of them but the chat template and huggingface.json (an import's).
The readers (eval, score, infer, plan) never write the model dir's own files; what they
measure (metrics, events, decodes) goes to `outputs`: their
--output_dir, else the model dir when it can be written, else nowhere, which one line says.
"""

from __future__ import annotations

import dataclasses
import os

import itertools
import logging

import jax
from etils import epath

from mtrain.io.textfiles import is_writable
from mtrain.parallel import distributed

log = logging.getLogger("mtrain")

CHECKPOINTS = "checkpoints"
VOCABULARY = "vocabulary.model"
CONFIG = "config.gin"
CHAT_TEMPLATE = "chat_template.jinja"
HUGGINGFACE = "huggingface.json"
METRICS = "metrics.jsonl"
LM_EVAL_RESULTS = "lm_eval_results.json"  # --mode=lm_eval's, beside metrics.jsonl
DECODES = "decodes"
PROFILE = "profile"
LOCK = "mtrain.lock"
BEFORE_RESTART = "before-restart-{}"
EVENTS = "events.out.tfevents"  # the start of TensorBoard's event file names
# What --restart moves into before-restart-<n>/: what decides how a new run starts.
RUN_FILES = (CHECKPOINTS, METRICS, CONFIG, VOCABULARY)


@dataclasses.dataclass(frozen=True)
class ModelDir:
    """The files of the model dir `path` (local or gs://)."""

    path: str

    def __truediv__(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self / CHECKPOINTS

    @property
    def vocabulary(self) -> str:
        return self / VOCABULARY

    @property
    def config(self) -> str:
        return self / CONFIG

    @property
    def chat_template(self) -> str:
        return self / CHAT_TEMPLATE

    @property
    def huggingface(self) -> str:
        return self / HUGGINGFACE

    @property
    def profile(self) -> str:
        return self / PROFILE

    @property
    def lock(self) -> str:
        return self / LOCK

    def is_file(self) -> bool:
        return epath.Path(self.path).is_file()

    def has_checkpoints(self) -> bool:
        """Whether checkpoints/ holds a checkpoint (reads only)."""
        path = epath.Path(self.checkpoints)
        return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())

    def outputs(self, output_dir: str | None, what: str) -> str | None:
        """Where a reader (eval, score) writes `what` (its metrics, events and decodes):
        `output_dir` if given, else the model dir if it can be written, else None (they
        are not kept, which one line says)."""
        if output_dir:
            epath.Path(output_dir).mkdir(parents=True, exist_ok=True)
            return output_dir
        if is_writable(self.path):
            return self.path
        log.warning("the model dir %s cannot be written: %s not kept (give --output_dir to "
                    "keep them)", self.path, what)
        return None

    def move_aside_for_restart(self) -> None:
        """--restart: moves the run's files (`RUN_FILES` and TensorBoard's events) into a new
        ``before-restart-<n>/`` inside the model dir, with a ``RESTARTED`` file naming them
        (nothing is deleted). Process 0 moves, the others wait for it."""
        path = epath.Path(self.path)
        names = sorted(p.name for p in path.iterdir()
                       if p.name in RUN_FILES or p.name.startswith(EVENTS))
        if not names:
            return
        n = next(n for n in itertools.count(1)
                 if not (path / BEFORE_RESTART.format(n)).exists())
        target = path / BEFORE_RESTART.format(n)
        if jax.process_index() == 0:
            target.mkdir()  # and a file in it: in a bucket a directory is an object's prefix
            (target / "RESTARTED").write_text(f"moved here by --restart: {', '.join(names)}\n")
            for name in names:
                (path / name).rename(target / name)
        distributed.sync("mtrain_restart")
        log.warning("--restart: moved %s to %s; training from step 0", ", ".join(names), target)


def decodes_file(directory: str, split: str, step: int) -> str:
    return os.path.join(directory, DECODES, f"{split}-{step}.tsv")


def metrics_file(directory: str) -> str:
    return os.path.join(directory, METRICS)


def lm_eval_file(directory: str, task: str | None = None) -> str:
    """--mode=lm_eval's results (lm-eval's, whole), or with `task` its logged samples."""
    return os.path.join(directory, f"lm_eval_samples_{task}.jsonl" if task else LM_EVAL_RESULTS)
