"""Gin at the edge: the one module that binds gin names to mtrain's library.

The library (layout, models, trainer, optimizer, losses, decoding, data, checkpoints,
planner, sgp) knows nothing of gin. Here its configurable pieces get the names the gin
files use, and the run (`mtrain.run`) builds everything through them:

    run.*                     RunConfig (the run's settings: `run_config`)
    vocabulary.*              VocabularyConfig (size or path: `vocabulary_config`)
    transformer.*             TransformerConfig (the model's hyper-parameters; not vocab_size)
    moe.*                     MoEConfig (its experts, where transformer.moe_every > 0)
    mla.*                     LatentConfig (latent attention, where transformer.latent_attention)
    lora.*                    LoraConfig (low-rank adapters, where lora.rank > 0)
    pipeline.*                PipelineConfig (stages' schedule, where a rule splits layers)
    rope_scaling.*            RopeScaling (rotary frequencies stretched: Llama 3.1's, linear)
    loss.*                    LossConfig
    dpo.*                     DpoConfig (a task of preference pairs)
    grpo.*                    GrpoConfig (a task of prompts or rollouts); its rewards
                              @answer_after(), @matches() (`evaluation.rewards`) or your own
    decoding.*                DecodingConfig
    adafactor.*               optimizer.adafactor (the default run.optimizer)
    adamw.*                   optimizer.adamw (``run.optimizer = @adamw``)
    sgd.*                     optimizer.sgd (``run.optimizer = @sgd``)
    learning_rate_schedule.*  optimizer.learning_rate_schedule
    task.*, files.*, tfds_data.*, bible.*   the data a task names (``run.task = @task()``:
                              `data.tasks`, `data.prepared.Files`)
    @DecoderLM, @EncoderDecoder   models for run.model (default: by the task's kind)

A new model or optimizer is a new gin reference (``run.model = @MyModel`` after
``gin.external_configurable(MyModel)``), not an edit of `run.build`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import types
import typing

import gin

from mtrain.data import tasks as tasks_lib
from mtrain.data.prepared import Files
from mtrain.data.vocabulary import VocabularyConfig
from mtrain.errors import ConfigError
from mtrain.evaluation import rewards as rewards_lib
from mtrain.evaluation.translation import DecodingConfig
from mtrain.huggingface import adapters, families, origin
from mtrain.huggingface.vocabulary import folder_vocabulary
from mtrain.io.textfiles import check_reachable
from mtrain.models.latent_attention import LatentConfig
from mtrain.models.lora import LoraConfig
from mtrain.models.moe import MoEConfig
from mtrain.models.pipeline import PipelineConfig
from mtrain.models.positions import RopeScaling
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.modes.experiment import RunConfig
from mtrain.training import optimizer
from mtrain.training.dpo import DpoConfig
from mtrain.training.grpo import GrpoConfig
from mtrain.training.losses import LossConfig

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

run = gin.external_configurable(RunConfig, "run")
vocabulary = gin.external_configurable(VocabularyConfig, "vocabulary")
transformer = gin.external_configurable(TransformerConfig, "transformer",
                                        denylist=["vocab_size", "moe", "rope_scaling",
                                                  "real_vocab_size", "pipeline"])
moe = gin.external_configurable(MoEConfig, "moe")
mla = gin.external_configurable(LatentConfig, "mla")
lora = gin.external_configurable(LoraConfig, "lora")
pipeline = gin.external_configurable(PipelineConfig, "pipeline")
rope_scaling = gin.external_configurable(RopeScaling, "rope_scaling")
loss = gin.external_configurable(LossConfig, "loss")
dpo = gin.external_configurable(DpoConfig, "dpo")
grpo = gin.external_configurable(GrpoConfig, "grpo")
answer_after = gin.external_configurable(rewards_lib.answer_after, "answer_after")
matches = gin.external_configurable(rewards_lib.matches, "matches")
decoding = gin.external_configurable(DecodingConfig, "decoding")
adafactor = gin.external_configurable(optimizer.adafactor, "adafactor")
adamw = gin.external_configurable(optimizer.adamw, "adamw")
sgd = gin.external_configurable(optimizer.sgd, "sgd")
learning_rate_schedule = gin.external_configurable(optimizer.learning_rate_schedule,
                                                   "learning_rate_schedule")
task = gin.external_configurable(tasks_lib.task, "task")
files = gin.external_configurable(Files, "files")
tfds_data = gin.external_configurable(tasks_lib.tfds_data, "tfds_data")
bible = gin.external_configurable(tasks_lib.bible, "bible")
MODELS = {"lm": gin.external_configurable(DecoderLM, "DecoderLM"),
          "translation": gin.external_configurable(EncoderDecoder, "EncoderDecoder")}


def parse(gin_files: list[str], gin_params: list[str]) -> None:
    """Parses gin files (searched in the working dir, then configs/) and bindings."""
    gin.clear_config()
    gin.add_config_file_search_path(os.getcwd())
    gin.add_config_file_search_path(CONFIGS_DIR)
    root = logging.getLogger()
    level, root.level = root.level, logging.CRITICAL  # gin logs every search-path miss
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params, finalize_config=False)
    except (ValueError, OSError, SyntaxError, KeyError, TypeError) as e:
        message = " ".join(str(e).split())
        raise ConfigError(f"bad gin config: {message}") from None
    finally:
        root.level = level
    check_types()


# The configurables whose parameters declare their types: a binding of another type (a
# float where an int is meant: ``lora.rank=2.5``) is a one-line error when the config is
# parsed, before it reaches jax as a shape.
TYPED = {"run": RunConfig, "vocabulary": VocabularyConfig, "transformer": TransformerConfig,
         "moe": MoEConfig, "lora": LoraConfig, "pipeline": PipelineConfig,
         "rope_scaling": RopeScaling, "loss": LossConfig,
         "dpo": DpoConfig, "grpo": GrpoConfig, "decoding": DecodingConfig,
         "adafactor": optimizer.adafactor, "adamw": optimizer.adamw, "sgd": optimizer.sgd,
         "learning_rate_schedule": optimizer.learning_rate_schedule,
         "files": Files}


def _fits(value, hint) -> bool:
    """Whether `value` is of the declared numeric type `hint` (int, float, or one of them
    or None); any other hint fits anything (the settings' own checks say more of a string
    or a flag than a type would)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return True
    checks = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not all(o in checks or o is type(None) for o in options):
        return True
    return any(checks[o](value) for o in options if o in checks)


def _macro_value(reference):
    """The value a gin macro (``%N``) stands for; a reference to a configurable as it is."""
    if not reference.scoped_selector.endswith("/gin.macro"):
        return reference
    return gin.query_parameter(f"%{reference.scoped_selector.rsplit('/', 1)[0]}")


def check_types() -> None:
    """Raises ConfigError for the first binding of a `TYPED` configurable whose value is
    not of its parameter's declared type."""
    for name, target in TYPED.items():
        hints = typing.get_type_hints(target)
        for parameter, value in gin.get_bindings(name, resolve_references=False).items():
            hint = hints.get(parameter)
            if isinstance(value, gin.config.ConfigurableReference):
                value = _macro_value(value)
            if isinstance(value, gin.config.ConfigurableReference):
                continue  # (@fn(): known only when called)
            if hint is not None and not _fits(value, hint):
                wanted = " or ".join(getattr(o, "__name__", str(o)) for o in (
                    typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)))
                raise ConfigError(f"{name}.{parameter} must be {wanted.replace('NoneType', 'None')}, "
                                  f"got {value!r}")


def parse_import(gin_files: list[str], gin_params: list[str], settings) -> None:
    """Parses the gin config of ``--mode=import``, after `parse` of the user's files and
    bindings: those again, then the model settings of a Hugging Face config.json
    (`settings`: `huggingface.families.Settings`, its tokenizer's ``vocabulary.*`` among
    them). A user binding of an architecture setting that differs from config.json's is an
    error naming both values; the other settings (`settings.defaults`) apply where the user
    bound none, fine-tuning's optimizer and schedule (`families.FINE_TUNING`) only where the
    user names no optimizer."""
    bindings = []
    for name, value in settings.architecture.items():
        mine = bound(name, None)
        if mine is not None and _normal(mine) != _normal(value):
            field = settings.source.get(name, "its architecture")
            whose = field if ".json's " in field else f"config.json's {field}"
            raise ConfigError(f"{name}={mine!r} in the gin config contradicts {whose}="
                              f"{value!r}; leave it out (the import sets it)")
        bindings.append(f"{name} = {value!r}")
    own_optimizer = bound("run.optimizer", None) is not None
    for name, value in settings.defaults.items():
        if own_optimizer and name in families.FINE_TUNING:
            continue  # (an optimizer the user names keeps its own schedule's defaults too)
        if bound(name, None) is None:
            bindings.append(f"{name} = {value!r}")
    parse(gin_files, [*gin_params, *bindings])


def _normal(value):
    return tuple(value) if isinstance(value, list) else value


# The ``run.*`` settings the command line gives that are settings of the run, which its
# <model_dir>/config.gin must record so that ``--gin_file=<model_dir>/config.gin`` alone runs
# it again: where the data comes from. Not the mode, the model dir (where config.gin lies:
# a copied model dir must not point back at the original) nor, being no flag, the data dir
# ($MTRAIN_DATA_DIR is this machine's cache; a run.data_dir binding is recorded as any is).
RECORDED_OVERRIDES = ("data_source",)


def run_config(**overrides) -> RunConfig:
    """The run's settings: gin's ``run.*`` bindings, then `overrides` (the command line's).
    Those of `RECORDED_OVERRIDES` become gin bindings, so that `operative` records them."""
    for name in RECORDED_OVERRIDES:
        if name in overrides:
            gin.bind_parameter(f"run.{name}", overrides.pop(name))
    return dataclasses.replace(run(), **overrides)


def model_config(vocab_size: int, real_vocab_size: int = 0) -> TransformerConfig:
    """The ``transformer.*`` settings (and ``moe.*`` where its layers have experts,
    ``rope_scaling.*``) for a vocabulary dimension of `vocab_size` rows, of which the first
    `real_vocab_size` are real (0: all). Raises ValueError for settings that do not make a
    model, or ``moe.*`` settings without experts to apply to."""
    adapter = lora()
    model = transformer(vocab_size=vocab_size, rope_scaling=rope_scaling(),
                        real_vocab_size=real_vocab_size if real_vocab_size < vocab_size else 0,
                        lora=adapter if adapter.rank else None, pipeline=pipeline(),
                        # (the sizes of gin's mla.* from the start: the checks see them)
                        mla=mla() if bound("transformer.latent_attention", False) else None)
    if not model.latent_attention and gin.get_bindings("mla"):
        raise ValueError(f"mla.{sorted(gin.get_bindings('mla'))[0]} is set, but "
                         "transformer.latent_attention is False: no layer has latent attention")
    if not model.moe_every:
        if gin.get_bindings("moe"):
            raise ValueError(f"moe.{sorted(gin.get_bindings('moe'))[0]} is set, but "
                             "transformer.moe_every is 0: no layer has experts")
        return model
    return dataclasses.replace(model, moe=moe())


def vocabulary_config() -> VocabularyConfig:
    return vocabulary()


def bound(name: str, default):
    """The value gin binds to `name`, or `default` if it binds none."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def settings(configurable) -> dict:
    """A configurable's settings as the gin config gives them (its defaults, then bindings),
    named ``name.parameter``: what a checkpoint records of the optimizer."""
    name = configurable.__name__
    fn = getattr(configurable, "__wrapped__", configurable)
    values = {p: v.default for p, v in inspect.signature(fn).parameters.items()
              if v.default is not inspect.Parameter.empty}
    values.update(gin.get_bindings(configurable))
    return {f"{name}.{p}": v for p, v in sorted(values.items())}


def operative() -> str:
    """The gin settings the run used (for <model_dir>/config.gin)."""
    return gin.operative_config_str()


def parse_import_config(gin_files: list[str], gin_params: list[str], input_dir: str,
                        adapter_dir: str | None = None, ignore_adapter_base: bool = False):
    """Parses the gin config of ``--mode=import`` from the Hugging Face folder `input_dir`
    (`config.parse_import`), with the ``lora.*`` settings of the PEFT adapter folder
    `adapter_dir` if given (refused where it names another base, unless
    `ignore_adapter_base`); returns (its `families.Settings`, its vocabulary)."""
    parse(gin_files, gin_params)
    if bound("vocabulary.path", None) is not None:
        raise ConfigError("vocabulary.path is set, but an import's vocabulary is the model's "
                          "own tokenizer; leave it out")
    check_reachable(input_dir, "--input_dir")
    if not os.path.isdir(input_dir):
        raise ConfigError(f"--input_dir {input_dir} is not a directory: name a Hugging Face "
                          f"model folder (config.json, *.safetensors, its tokenizer)")
    hf_config = families.read_config(input_dir)
    settings = families.settings(hf_config)
    vocab = folder_vocabulary(input_dir, settings)
    vocabulary = {"vocabulary.size": vocab.vocab_size,
                  "vocabulary.model_size": settings.vocab_size}
    settings = dataclasses.replace(
        settings, architecture={**settings.architecture, **vocabulary},
        source={**settings.source, "vocabulary.size": "tokenizer's pieces",
                "vocabulary.model_size": "vocab_size"})
    if adapter_dir is not None:
        check_reachable(adapter_dir, "--adapter_dir")
        bases = [origin.location(input_dir), hf_config.get("_name_or_path")]  # ('.' named)
        peft = adapters.read_config(adapter_dir, None if ignore_adapter_base else bases)
        settings = dataclasses.replace(
            settings, architecture={**settings.architecture, **peft},
            source={**settings.source, **{name: f"{adapters.CONFIG}'s {field}" for name, field
                                          in adapters.FIELDS.items()}})
    parse_import(gin_files, gin_params, settings)
    return settings, vocab
