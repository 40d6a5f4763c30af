"""What a run is made of: the task, its data and vocabulary, the model and its trainer on
the mesh, and the run's settings, built from the gin config by `run.build`; the training
loop, evaluation and inference take it from there.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from etils import epy

from mtrain.data import tasks as tasks_lib
from mtrain.io.checkpoints import state_signature
from mtrain.data.sources import TextSource
from mtrain.parallel.layout import Layout
from mtrain.models.base import shape_fields
from mtrain.models.transformer import TransformerConfig
from mtrain.training.sgp import SGPTrainer
from mtrain.training.trainer import Trainer
from mtrain.evaluation.translation import Translator
from mtrain.data.vocabulary import Vocabulary

with epy.lazy_imports():  # it imports TensorFlow, which a plan does not need
    from mtrain.data import pipeline


@dataclasses.dataclass
class Experiment:
    """Everything `train` and `evaluate` need, built from the gin config by `build`."""

    model_dir: str
    task: tasks_lib.Task
    source: TextSource | None  # None when planning: a plan needs no data
    vocab: Vocabulary | None
    model_config: TransformerConfig  # what run.model was built from
    layout: Layout
    trainer: Trainer
    batch_size: int
    sequence_length: int
    train_steps: int
    seed: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    keep_checkpoint_every: int
    init_from: str | None
    init_step: int | None
    max_nonfinite_steps: int
    eval_split: str
    schedule: optax.Schedule
    mode: str = "train"
    optimizer_settings: dict = dataclasses.field(default_factory=dict)  # for checkpoint meta
    config_text: str = ""  # the operative gin config, for <model_dir>/config.gin
    cache: dict = dataclasses.field(default_factory=dict)  # what evaluation computes once
    translator: Translator | None = None  # translation tasks: decodes for BLEU and infer
    flops_per_step: float = 0.0  # model FLOPs of one train step (the model's analytic_flops)
    profile_steps: tuple[int, int] | None = None
    sgp: SGPTrainer | None = None  # run.data_parallel='sgp': steps the trainer's model by SGP

    def train_batches(self):
        return self._batches("train", train=True)

    def eval_batches(self):
        return self._batches(self.eval_split, train=False)

    def _batches(self, split: str, train: bool):
        """This process's rows of each global batch (`Trainer.local_rows`)."""
        start, stop = self.trainer.local_rows()
        return pipeline.batches(
            self.source, self.vocab, split, self.task.features, self.sequence_length,
            self.batch_size, self.seed, train=train,
            shard=(start // (stop - start), self.batch_size // (stop - start)),
            process=(jax.process_index(), jax.process_count()),
        )

    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of the run that saved it, and a resumed run must share
        (`checkpoints.check_compatible`): the model's shape and vocabulary; the data, batch
        size, sequence length and seed, which decide the data and its order; and the train
        state's structure, with the optimizer settings that decide it. Everything else may
        change between the runs of a model dir (README, "Runs that survive")."""
        vocabulary = f"{self.vocab.vocab_size} pieces, sha256 {self.vocab.digest}"
        return {
            "model": {**shape_fields(self.trainer.model.config), "vocabulary": vocabulary},
            "task": self.task.name,
            "run": {"run.batch_size": self.batch_size,
                    "run.sequence_length": self.sequence_length,
                    "run.seed": self.seed, "data": self.source.fingerprint()},
            "optimizer": self.optimizer_settings,
            "state": state_signature(self.trainer.abstract_state),
        }
