"""A whole run from a gin config: check it, build the experiment, then do what its mode says.

`run` is what ``python -m mtrain`` calls. Its settings are `RunConfig` (``run.*`` in gin,
as Mesh-TF users know them: ``run.mesh_shape``, ``run.layout_rules``, ...), filled from
gin once by `config.run_config`; `build` makes the `Experiment` in phases, each checking
what it can before the next costs anything:

1. `_validate`: the settings alone (numbers, names, files that must exist);
2. `modes.meshes.layout_and_mesh`: the mesh and the layout rules;
3. `_model`: the model, optimizer and trainer (its sharded state and steps), for the
   vocabulary size the settings plan (the model dir's recorded vocabulary, vocabulary.path or
   vocabulary.size: known without data), so that the layout's legality and the model's
   settings are checked before any data is prepared, and the model is built once;
4. `_data`: the dataset (prepared once per data dir) and the vocabulary (trained once);
   infer and score, which read no training data, take the model dir's vocabulary alone.

Nothing is written to the model dir before the mode starts, so a bad config never touches
it. The modes are in `mtrain.modes`.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import optax
from etils import epath

from mtrain import MODES, config
from mtrain.data import tasks as tasks_lib
from mtrain.data import prompts, user_data
from mtrain.data.chat import ChatTemplate
from mtrain.data.vocabulary import DEFAULT_SIZE, load_vocabulary
from mtrain.errors import ConfigError
from mtrain.evaluation.translation import Translator
from mtrain.evaluation.generation import Generator
from mtrain.evaluation.rollouts import GrpoStepper
from mtrain.training import freezing
from mtrain.io.lock import check_data_dir, preparing_data
from mtrain.io.metrics import log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import check_reachable
from mtrain.modes import dispatch, meshes
from mtrain.modes.experiment import Experiment, RunConfig
from mtrain.modes.lm_eval import Tasks
from mtrain.modes.dispatch import Request
from mtrain.modes.plan import describe_model
from mtrain.parallel import distributed
from mtrain.models.blocks import check_stages
from mtrain.parallel.layout import Layout, LayoutError
from mtrain.training.dpo import Preference
from mtrain.training.grpo import Grpo
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.sgp import SGPTrainer
from mtrain.training.trainer import Trainer

parse_config, CONFIGS_DIR = config.parse, config.CONFIGS_DIR  # for the CLI, tests, benchmarks
NO_DATA = meshes.NO_DATA  # the modes that build the model without its data
# The modes that read a checkpoint with the model dir's vocabulary and no training data:
# they never build the data source (no dataset prepared, no vocabulary trained).
READERS = ("infer", "score", "lm_eval")


def run(restart: bool = False, **options):
    """Does what the run's mode says (``run.mode``: `modes.dispatch.MODES`) with the
    experiment the gin config builds: trains (`restart`: from step 0 whatever the model dir
    holds, moved aside first), evaluates the latest checkpoint (``'eval'``), continues or
    translates the lines of `input_file` into `output_file` (``'infer'``; None is stdin /
    stdout), scores them (``'score'``), plans (``'plan'``, with `plan_options` for
    `modes.plan.plan`), imports a Hugging Face folder (``'import'``; `imported`: (input
    dir, its settings, its vocabulary, adapter dir), after `config.parse_import_config`) or
    exports a checkpoint to the folder `output_dir` (``'export'``; `export_options`: step,
    dtype, adapter). Eval and score write what they measure to `output_dir`, else into the
    model dir if it can be written. The other `options` override ``run.*`` settings (the
    model dir from the command line, ...)."""
    fields = {f.name for f in dataclasses.fields(Request)}
    request = Request(restart=restart, **{k: v for k, v in options.items() if k in fields})
    settings = config.run_config(**{k: v for k, v in options.items() if k not in fields})
    mode, model_dir = settings.mode, settings.model_dir
    # What can fail at once, before data and compilation: a bucket that cannot be reached,
    # a model dir that is a file, then what the mode needs (`dispatch.check`).
    if mode != "plan" and model_dir:
        check_reachable(model_dir, "the model dir")
        if ModelDir(model_dir).is_file():
            raise ConfigError(f"the model dir {model_dir} is a file, not a directory; name a "
                              f"directory (a new one to train into)")
    dispatch.check(mode, model_dir, request)
    exp = build(settings, restart=restart)
    auto_layout = request.plan_options.get("auto_layout")
    where = (f"searching layouts for {request.plan_options.get('devices') or jax.device_count()}"
             f" devices" if auto_layout else f"{exp.layout} over {jax.device_count()} devices")
    log.info("mtrain: task %s, model %s, %s", exp.task.name, describe_model(exp.model_config),
             where)
    if mode == "export":  # (known once the config is parsed)
        request = dataclasses.replace(request,
                                      model_size=config.vocabulary_config().model_size)
    return dispatch.MODES[mode].act(exp, request)


def build(settings: RunConfig | None = None, restart: bool = False, **overrides) -> Experiment:
    """The `Experiment` of `settings` (default: the gin config's, with `overrides`), in the
    phases of the module doc. `restart`: the model dir's recorded vocabulary does not bind
    this run, which starts afresh."""
    settings = settings or config.run_config(**overrides)
    task = _validate(settings)
    settings = dataclasses.replace(settings, eval_split=settings.eval_split or task.eval_split)
    layout, mesh = meshes.layout_and_mesh(settings)
    planning = settings.mode in NO_DATA
    vocab_config = config.vocabulary_config()
    recorded = (None if restart or settings.mode in ("plan", "import")
                else _recorded_vocabulary(settings.model_dir))
    started = _recorded_vocabulary(settings.init_from) if settings.init_from else None
    if not recorded and started and vocab_config.path is None and vocab_config.size in (
            None, load_vocabulary(started).vocab_size):
        # a run started from another's parameters reads them with that run's vocabulary
        vocab_config = dataclasses.replace(vocab_config, path=started)
    if not recorded and task.vocabulary_size and vocab_config.size is None \
            and not vocab_config.path:  # a task file names the size it trains by default
        vocab_config = dataclasses.replace(vocab_config, size=task.vocabulary_size)
    planned = vocab_config.planned_size(recorded)
    trainer, stepper, schedule = _model(settings, task, layout, mesh, planned)
    source = vocab = translator = generator = None
    if not planning:
        if settings.mode in READERS:
            vocab = _reader_vocabulary(settings, vocab_config, recorded)
        else:
            source, vocab = _data(settings, task, vocab_config, recorded, restart)
        if settings.mode == "train":
            source.check_loss_fraction()
        if _padded(vocab_config.rows(vocab.vocab_size)) != _padded(planned):  # sentencepiece fell short
            raise ConfigError(f"the vocabulary has {vocab.vocab_size} pieces, where "
                              f"{planned} were asked for (vocabulary.size)")
        try:
            if task.reinforcement and settings.mode == "train":
                stepper = GrpoStepper(trainer=trainer, vocab=vocab, config=config.grpo(),
                                      seed=settings.seed, template=_template(settings, task,
                                                                             vocab),
                                      reads_rollouts=source.format == "rollouts")
            if task.kind == "translation":
                translator = Translator(trainer, vocab, config.decoding())
            elif settings.mode == "infer":
                generator = Generator(trainer, vocab, config.decoding(), settings.seed)
        except (ValueError, LayoutError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    return Experiment(
        config=settings, task=task, source=source, vocab=vocab, trainer=trainer,
        stepper=stepper, schedule=schedule, translator=translator, generator=generator,
        optimizer_settings={**config.settings(settings.optimizer or config.adafactor),
                            **config.settings(config.learning_rate_schedule)},
        config_text=config.operative(),
        flops_per_step=trainer.model.analytic_flops(settings.batch_size,
                                                    settings.sequence_length))


def _validate(s: RunConfig) -> tasks_lib.Task:
    """Phase 1: the settings alone; returns the task."""
    for name in ("batch_size", "sequence_length", "train_steps", "log_every",
                 "checkpoint_every", "keep_checkpoints", "max_nonfinite_steps",
                 "num_microbatches"):
        value = getattr(s, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"run.{name} must be a positive integer, got {value!r}")
    if not isinstance(s.eval_every, int) or isinstance(s.eval_every, bool) or s.eval_every < -1:
        raise ConfigError(f"run.eval_every must be a number of steps (0: at the end only, -1: "
                          f"never), got {s.eval_every!r}")
    if s.profile_steps is not None and not (
            len(s.profile_steps) == 2 and 0 < s.profile_steps[0] <= s.profile_steps[1]):
        raise ConfigError(f"run.profile_steps must be (first, last) steps with 0 < first <= "
                          f"last, got {s.profile_steps!r}")
    if s.data_workers is not None and (not isinstance(s.data_workers, int)
                                       or isinstance(s.data_workers, bool)
                                       or s.data_workers < 0):
        raise ConfigError(f"run.data_workers must be a whole number of processes (0: in this "
                          f"process), got {s.data_workers!r}")
    if s.data_parallel not in ("allreduce", "sgp"):
        raise ConfigError(f"run.data_parallel must be 'allreduce' or 'sgp', got "
                          f"{s.data_parallel!r}")
    if s.data_parallel != "sgp" and (s.sgp_overlap or s.sgp_average_every):
        raise ConfigError("run.sgp_overlap and run.sgp_average_every need "
                          "run.data_parallel='sgp'")
    if s.mode not in MODES:
        raise ConfigError(f"unknown mode {s.mode!r}; use one of {', '.join(MODES)}")
    task = tasks_lib.get_task(s.task)
    if s.lm_eval_tasks and s.mode == "train":
        Tasks.of_run(s)  # (checked before anything is built)
    if task.kind == "translation" and (s.mode == "lm_eval" or s.lm_eval_tasks):
        raise ConfigError("lm-evaluation-harness evaluates language models; this run's task "
                          f"{task.name!r} is translation (an encoder-decoder)")
    if s.init_from:
        check_reachable(s.init_from, "run.init_from")
        if not epath.Path(s.init_from).is_dir():
            raise ConfigError(f"run.init_from={s.init_from!r} is not a directory; name the "
                              f"model dir of the run to start from")
    if s.mode not in (*NO_DATA, *READERS):
        check_data_dir(_data_dir(s))  # makes it: after the checks that write nothing
    return task


def _model(s: RunConfig, task: tasks_lib.Task, layout: Layout, mesh, vocab_size: int):
    """Phase 3: (trainer, stepper, schedule) of the model for a vocabulary of `vocab_size`
    pieces, padded to a multiple of 128 so that it splits over any mesh dimension up to 128
    (the extra ids never occur in the data)."""
    try:
        model_config = config.model_config(_padded(vocab_size), vocab_size)
        if s.activation_dtype is not None:
            model_config = dataclasses.replace(model_config, activation_dtype=s.activation_dtype)
        schedule = config.learning_rate_schedule(train_steps=s.train_steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model_config.max_length < s.sequence_length:
        raise ConfigError(f"run.sequence_length={s.sequence_length} is longer than "
                          f"transformer.max_length={model_config.max_length}")
    # Updates with a non-finite gradient leave parameters and optimizer state as they were.
    optimizer = s.optimizer or config.adafactor
    opt = optax.apply_if_finite(optimizer(schedule), s.max_nonfinite_steps)
    model = (s.model or config.MODELS[task.kind])(model_config)
    features = ("inputs", "targets")[task.kind != "translation":]
    if model.features != features:
        raise ConfigError(f"run.model {type(model).__name__} takes {model.features}, but "
                          f"task {s.task!r} gives {features}")
    if s.mode != "import":  # (the stages a stack runs over: see models.pipeline)
        check_stages(model_config, layout.ways("layers"), s.batch_size // s.num_microbatches,
                     layout.ways("batch"), encoder_decoder=task.kind == "translation")
    trainable = freezing.trainable(s.trainable, model_config.lora is not None)
    objective = (Preference(config.dpo()) if task.preference else  # (GRPO's: what it trains;
                 Grpo(config.grpo()) if task.reinforcement and s.mode in ("train", "plan")
                 else LanguageModeling(config.loss()))  # its readers score as an LM does)
    trainer = Trainer(model=model, optimizer=opt, objective=objective, layout=layout, mesh=mesh,
                      batch_size=s.batch_size, sequence_length=s.sequence_length, seed=s.seed,
                      num_microbatches=s.num_microbatches, trainable=trainable)
    stepper = trainer
    if s.data_parallel == "sgp":
        if trainer.partial or task.preference or task.reinforcement:
            raise ConfigError("run.data_parallel='sgp' trains every parameter on a token "
                              "loss: it takes no frozen ones (run.trainable, LoRA), no "
                              "balancing bias (moe.choice_bias), no delayed fp8 scaling "
                              "(transformer.quantization_scaling), DPO nor GRPO")
        try:
            stepper = SGPTrainer(trainer, overlap=s.sgp_overlap,
                                 average_every=s.sgp_average_every)
        except ValueError as e:
            raise ConfigError(f"run.data_parallel='sgp': {e}") from None
    return trainer, stepper, schedule


def _data(s: RunConfig, task: tasks_lib.Task, vocab_config, recorded: str | None,
          restart: bool):
    """Phase 4: (source, vocabulary). Process 0 prepares the dataset and trains the
    vocabulary (once, into the data dir); the others wait, then load what it made."""
    data_dir = _data_dir(s)
    unrecorded = None
    if not recorded and not restart and s.model_dir and ModelDir(s.model_dir).has_checkpoints():
        unrecorded = ModelDir(s.model_dir).vocabulary
    source = vocab = None
    for turn in ("first", "rest"):
        if (jax.process_index() == 0) == (turn == "first"):
            with preparing_data(data_dir):  # one run at a time (on a fresh machine)
                source, vocab = _prepare(s, task, vocab_config, data_dir, recorded,
                                         unrecorded)
        distributed.sync(f"mtrain_data_prepared_{turn}")
    return source, vocab


def _prepare(s: RunConfig, task: tasks_lib.Task, vocab_config, data_dir: str,
             recorded: str | None, unrecorded: str | None):
    if task.reinforcement:  # prompts or rollouts, read whole (`data.prompts`)
        if not recorded and not vocab_config.path:
            raise ConfigError("GRPO improves a model that exists: import one (--mode=import) "
                              "into the model dir, or start from a run's (run.init_from)")
        (spec,) = task.data.values()
        source = prompts.PromptSource(prompts.read(spec, config.grpo().num_generations),
                                      spec.format)
        return source, vocab_config.choose(recorded, "", lambda: (), "", where=s.model_dir,
                                           unrecorded=unrecorded)
    if task.data is not None:  # a user's files
        return user_data.prepare_run(task, vocab_config, data_dir, recorded=recorded,
                                     unrecorded=unrecorded, model_dir=s.model_dir,
                                     eval_split=s.eval_split, init_from=s.init_from,
                                     sequence_length=s.sequence_length)
    source = task.source(data_dir, s.data_source)
    source.check_split(s.eval_split)
    cached = os.path.join(source.cache_dir(data_dir), task.name,
                          f"spm_{vocab_config.size or DEFAULT_SIZE}.model")
    vocab = vocab_config.choose(recorded, cached, lambda: source.texts("train"),
                                f"the {task.name} training split", where=s.model_dir,
                                unrecorded=unrecorded)
    return source, vocab


def _template(s: RunConfig, task: tasks_lib.Task, vocab) -> ChatTemplate | None:
    """The chat template a GRPO run renders conversations with: files.chat_template, else
    the model dir's (an import keeps its folder's), else that of run.init_from."""
    (spec,) = task.data.values()
    return user_data.source_template(spec, vocab,
                                     user_data.run_template(vocab, s.model_dir, s.init_from))


def _reader_vocabulary(s: RunConfig, vocab_config, recorded: str | None):
    """The vocabulary of infer and score: the model dir's recorded one (else
    vocabulary.path), never one trained from the data, which they do not read."""
    if not recorded and not vocab_config.path:
        where = ModelDir(s.model_dir).vocabulary if s.model_dir else "a model dir"
        raise ConfigError(f"--mode={s.mode} reads the vocabulary the model was trained with, "
                          f"and {where} is missing: train first (--mode=train), or name it "
                          f"with vocabulary.path")
    unrecorded = ModelDir(s.model_dir).vocabulary if s.model_dir and not recorded else None
    return vocab_config.choose(recorded, "", lambda: (), "", where=s.model_dir,
                               unrecorded=unrecorded)


def _data_dir(s: RunConfig) -> str:
    return (s.data_dir or os.environ.get("MTRAIN_DATA_DIR")
            or os.path.expanduser("~/.cache/mtrain"))


def _recorded_vocabulary(model_dir: str | None) -> str | None:
    """The path of the vocabulary recorded in `model_dir`, if it has one."""
    recorded = ModelDir(model_dir).vocabulary if model_dir else None
    return recorded if recorded and epath.Path(recorded).exists() else None


def _padded(vocab_size: int) -> int:
    return 128 * math.ceil(vocab_size / 128)


def model_dir_is_bound() -> bool:
    return config.bound("run.model_dir", None) is not None
