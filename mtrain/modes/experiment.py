"""What a run is made of: its settings (`RunConfig`, ``run.*`` in gin) and what `run.build`
makes of them (`Experiment`): the task, its data and vocabulary, the model's trainer on the
mesh and the stepper that trains it. The modes (train, eval, score, infer, plan) take it
from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from etils import epy

from mtrain.data import prompts
from mtrain.data import tasks as tasks_lib
from mtrain.data.streams import DataSource
from mtrain.data.vocabulary import Vocabulary
from mtrain.evaluation.translation import Translator
from mtrain.evaluation.generation import Generator
from mtrain.io.compatibility import state_signature
from mtrain.models.base import shape_fields
from mtrain.training.loop import Stepper
from mtrain.training.trainer import Trainer

with epy.lazy_imports():  # Grain, which a plan does not need
    from mtrain.data import pipeline


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run's settings: ``run.*`` in gin (filled once, at the edge: `mtrain.config`).

    `mode` is 'train', 'eval' (evaluate the latest checkpoint), 'infer' (translate with it),
    'score' (the log-likelihood of lines of text with it) or 'plan' (compile the train step
    for the mesh and report its cost; needs no data and only as many devices as the mesh,
    simulated on CPU).

    `eval_every` = 0 evaluates only at the end of training; -1 never (as files.validation=0
    does; `--mode=eval` still evaluates).
    `data_dir` (default $MTRAIN_DATA_DIR or ~/.cache/mtrain) holds prepared datasets and
    cached vocabularies.
    `data_source` (TFDS tasks): a directory of raw files laid out as the official archives,
    or 'shipped' to make them from the shipped corpus; None downloads. `eval_split`
    defaults to the task's.

    Checkpoints: the last `keep_checkpoints` are kept, and every multiple of
    `keep_checkpoint_every` (0: none). A model dir with checkpoints resumes from its newest
    intact one. `init_from` (another run's model dir) starts a new run from the parameters of
    its checkpoint `init_step` (default: the latest), with a fresh optimizer: fine-tuning.
    A step with a non-finite loss or gradient is skipped; `max_nonfinite_steps` in a row
    stop the run.

    Layout: `mesh_shape` and `layout_rules` as in Mesh-TF; `parameter_layout_rules` (e.g.
    'd_model:batch') store parameters and optimizer state split further, on top of the
    layout rules, while activations follow `layout_rules` alone: fully sharded data
    parallelism (parameters gathered where used, gradients reduce-scattered).

    Speed and memory: `activation_dtype` 'bfloat16' computes activations and matmuls in
    bfloat16 (parameters, optimizer state, attention softmax and loss stay float32; default:
    transformer.activation_dtype); `num_microbatches` accumulates gradients over that many
    slices of the batch (same update, less activation memory); with `profile_steps` (first,
    last) a jax.profiler trace of those steps goes to <model_dir>/profile. See also
    transformer.remat_policy and transformer.scan_layers.

    Data parallelism: `data_parallel` 'allreduce' (default) averages the gradients over the
    mesh's batch dimension every step; 'sgp' is Stochastic Gradient Push (`training.sgp`):
    every replica along it keeps its own parameters and mixes them with one peer per step
    (`sgp_overlap` = tau: messages added tau steps late; `sgp_average_every` = H: an exact
    average every H steps). Evaluation and checkpoints use the replicas' average, so
    checkpoints of either kind restore into the other.

    Input: `data_workers` Grain worker processes tokenise and pack the batches (0: a
    thread of this process; None: a quarter of the host's cores, at most 8); the batches
    are the same for any number.

    Fine-tuning: `trainable`, a regular expression of parameter paths
    ("layer_[0-3]/.*|final_norm/scale"), trains those alone; the others are frozen: no
    gradient, no optimizer state (`training.freezing`). A model with LoRA adapters
    (``lora.rank``) trains its adapters alone unless `trainable` says otherwise.

    Downstream evaluation during training: `lm_eval_tasks` (lm-evaluation-harness's task
    names, comma-separated; `lm_eval_include_path` a folder of task YAMLs of one's own) run
    on the parameters every `lm_eval_every` steps (0: at the end only), at most
    `lm_eval_limit` documents a task; their metrics go to metrics.jsonl as
    ``lm_eval/<task>/<metric>`` (`modes.lm_eval`).

    `model` and `optimizer` are gin references: ``model(config)`` of the ``transformer.*``
    settings builds the model (None: `@DecoderLM` for LM tasks, `@EncoderDecoder` for
    translation), ``optimizer(schedule)`` the optax optimizer (None: `@adafactor`), wrapped
    to skip non-finite updates.
    """

    model_dir: str = ""
    mode: str = "train"
    task: "str | tasks_lib.Task" = "bible_lm"  # a shipped task's name, or @task()
    data_dir: str | None = None
    data_source: str | None = None
    mesh_shape: str = ""
    layout_rules: str = "batch:batch;d_ff:model;heads:model;vocab:model"
    parameter_layout_rules: str = ""
    batch_size: int = 32
    sequence_length: int = 128
    train_steps: int = 1000
    seed: int = 0
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    keep_checkpoint_every: int = 0
    init_from: str | None = None
    init_step: int | None = None
    max_nonfinite_steps: int = 10
    eval_split: str | None = None
    activation_dtype: str | None = None
    num_microbatches: int = 1
    profile_steps: tuple[int, int] | None = None
    data_parallel: str = "allreduce"
    sgp_overlap: int = 0
    sgp_average_every: int = 0
    data_workers: int | None = None
    trainable: str | None = None
    lm_eval_tasks: str | None = None
    lm_eval_every: int = 0
    lm_eval_include_path: str | None = None
    lm_eval_limit: int | None = None
    model: Callable | None = None
    optimizer: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A built run: its settings (`config`, the eval split resolved) and what they made."""

    config: RunConfig
    task: tasks_lib.Task
    source: DataSource | None  # None for the modes that read no data: plan, import,
    # export, and infer and score (the model dir's vocabulary is all they read of it)
    vocab: Vocabulary | None
    trainer: Trainer  # the model and its sharded steps on the mesh
    stepper: Stepper  # what trains it: the trainer, or SGP around it
    schedule: optax.Schedule
    optimizer_settings: dict  # for the checkpoints' meta
    config_text: str  # the operative gin config, for <model_dir>/config.gin
    flops_per_step: float  # model FLOPs of one train step (the model's analytic_flops)
    translator: Translator | None = None  # translation tasks: decodes for BLEU and infer
    generator: Generator | None = None  # LM tasks: continues prompts for infer

    def __post_init__(self):
        if self.config.mode == "eval" and not self.evaluates:  # (files.validation=0)
            self.source.check_split(self.eval_split)

    @property
    def evaluates(self) -> bool:
        """Whether the run has held-out data to evaluate (files.validation=0: none)."""
        return self.source is None or not self.source.holds_out_nothing(self.eval_split)

    @property
    def model_dir(self) -> str:
        return self.config.model_dir

    @property
    def eval_split(self) -> str:
        return self.config.eval_split

    @property
    def batch_size(self) -> int:
        return self.trainer.batch_shape[0]

    @property
    def sequence_length(self) -> int:
        return self.trainer.batch_shape[1]

    @property
    def model_config(self) -> Any:
        return self.trainer.model.config

    @property
    def layout(self):
        return self.trainer.layout

    def train_batches(self):
        return self._batches("train", train=True)

    def eval_batches(self):
        return self._batches(self.eval_split, train=False)

    def _batches(self, split: str, train: bool):
        """This process's rows of each global batch (`Trainer.local_rows`)."""
        if isinstance(self.source, prompts.PromptSource):  # GRPO's (`data.prompts`)
            return prompts.PromptBatches(
                self.source, per_step=self.stepper.prompts_per_step,
                iterations=self.stepper.config.num_iterations, seed=self.config.seed,
                shuffle=self.source.format == "prompts", process=jax.process_index())
        start, stop = self.trainer.local_rows()
        return pipeline.batches(self.source, self.vocab, split, pipeline.BatchSettings(
            sequence_length=self.sequence_length, batch_size=self.batch_size,
            seed=self.config.seed, train=train,
            shard=(start // (stop - start), self.batch_size // (stop - start)),
            process=(jax.process_index(), jax.process_count()),
            workers=(pipeline.default_workers() if self.config.data_workers is None
                     else self.config.data_workers),
            start_id=getattr(self.model_config, "start_id", 0)))

    def model_meta(self, vocab: Vocabulary) -> dict:
        """What every checkpoint of this model records of it: its shape settings and
        vocabulary (`vocab`), which any run that restores it must share."""
        vocabulary = f"{vocab.vocab_size} pieces, sha256 {vocab.digest}"
        return {**shape_fields(self.trainer.model.config), "vocabulary": vocabulary}

    def reader_meta(self, vocab: Vocabulary) -> dict:
        """What a reader of this model's checkpoints (without its data) must share with
        the run that saved them: `checkpoint_meta` less the data's."""
        return {"model": self.model_meta(vocab), "task": self.task.name,
                "optimizer": self.optimizer_settings,
                "state": state_signature(self.trainer.abstract_state)}

    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of the run that saved it, and a resumed run must share
        (`compatibility.check_compatible`): the model's shape and vocabulary; the data, batch
        size, sequence length and seed, which decide the data and its order; and the train
        state's structure, with the optimizer settings that decide it. Everything else may
        change between the runs of a model dir (README, "Runs that survive")."""
        return {
            "model": self.model_meta(self.vocab),
            "task": self.task.name,
            "run": {"run.batch_size": self.batch_size,
                    "run.sequence_length": self.sequence_length,
                    "run.seed": self.config.seed, "data": self.source.fingerprint()},
            "optimizer": self.optimizer_settings,
            "state": state_signature(self.trainer.abstract_state),
        }
