"""A whole run from a gin config: check it, build the experiment, then do what its mode says.

`run` is what ``python -m mtrain`` calls. Its settings are `RunConfig` (``run.*`` in gin,
as Mesh-TF users know them: ``run.mesh_shape``, ``run.layout_rules``, ...), filled from
gin once by `config.run_config`; `build` makes the `Experiment` in phases, each checking
what it can before the next costs anything:

1. `_validate`: the settings alone (numbers, names, files that must exist);
2. `_layout`: the mesh and the layout rules;
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
import itertools
import math
import os

import jax
import optax
from etils import epath

from mtrain import MODES, config
from mtrain.data import tasks as tasks_lib
from mtrain.data import user_data
from mtrain.data.vocabulary import DEFAULT_SIZE, load_vocabulary
from mtrain.errors import ConfigError
from mtrain.evaluation.translation import Translator
from mtrain.evaluation.generation import Generator
from mtrain.io.reading import require_checkpoints
from mtrain.training import freezing
from mtrain.io.lock import check_data_dir, check_model_dir_free, preparing_data
from mtrain.io.metrics import log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import check_reachable
from mtrain.modes.evaluate import evaluate_checkpoint
from mtrain.modes import convert
from mtrain.modes.experiment import Experiment, RunConfig
from mtrain.modes.infer import check_output_file, infer
from mtrain.modes.plan import describe_model, plan
from mtrain.modes.score import score
from mtrain.modes.train import train
from mtrain.parallel import distributed
from mtrain.parallel.layout import Layout, LayoutError
from mtrain.training.sgp import SGPTrainer
from mtrain.training.trainer import Trainer

parse_config, CONFIGS_DIR = config.parse, config.CONFIGS_DIR  # for the CLI, tests, benchmarks
NO_DATA = ("plan", "import", "export")  # the modes that build the model without its data
# The modes that read a checkpoint with the model dir's vocabulary and no training data:
# they never build the data source (no dataset prepared, no vocabulary trained).
READERS = ("infer", "score")


def run(input_file: str | None = None, output_file: str | None = None,
        plan_options: dict | None = None, restart: bool = False,
        output_dir: str | None = None, imported=None, export_options: dict | None = None,
        **overrides):
    """Trains (``run.mode='train'``; `restart`: from step 0 whatever the model dir holds,
    moved aside first), evaluates the latest checkpoint (``'eval'``), translates
    `input_file` to `output_file` with it (``'infer'``; None is stdin / stdout), scores the
    lines of `input_file` into `output_file` (``'score'``) or plans (``'plan'``, with
    `plan_options` for `modes.plan.plan`), as the gin config and `overrides` of its ``run.*``
    settings (e.g. model_dir from the command line) say. Eval and score write what they
    measure to `output_dir`, else into the model dir if it can be written. ``'import'``
    writes the model dir from a Hugging Face folder (`imported`: (input dir, its settings,
    its vocabulary), after `config.parse_import_config`); ``'export'`` writes a checkpoint of it
    to the folder `output_dir` (`export_options`: step, dtype)."""
    settings = config.run_config(**overrides)
    mode, model_dir = settings.mode, settings.model_dir
    # What can fail at once, before data and compilation: a bucket that cannot be reached,
    # another run in the model dir, no checkpoint to read, an output file that could not be
    # written.
    if mode != "plan" and model_dir:
        check_reachable(model_dir, "the model dir")
        if ModelDir(model_dir).is_file():
            raise ConfigError(f"the model dir {model_dir} is a file, not a directory; name a "
                              f"directory (a new one to train into)")
    if mode == "train" and model_dir:
        check_model_dir_free(model_dir)
    if mode in ("import", "export") and not model_dir:
        raise ConfigError(f"--mode={mode} needs a --model_dir")
    if mode == "import":
        convert.check_new_dir(model_dir, "the model dir")
    if mode == "export":
        convert.check_new_dir(output_dir, "--output_dir")
    if mode in ("eval", "infer", "score", "export") and model_dir:
        require_checkpoints(ModelDir(model_dir).checkpoints, "train first (--mode=train)")
    if mode in ("infer", "score"):
        check_output_file(output_file, input_file)
    exp = build(settings, restart=restart)
    auto_layout = (plan_options or {}).get("auto_layout")
    where = (f"searching layouts for {(plan_options or {}).get('devices') or jax.device_count()}"
             f" devices" if auto_layout else f"{exp.layout} over {jax.device_count()} devices")
    log.info("mtrain: task %s, model %s, %s", exp.task.name, describe_model(exp.model_config),
             where)
    if mode == "train":
        return train(exp, restart=restart)
    if mode == "eval":
        return evaluate_checkpoint(exp, output_dir)
    if mode == "plan":
        return plan(exp, **(plan_options or {}))
    if mode == "score":
        return score(exp, input_file, output_file, output_dir)
    if mode == "import":
        input_dir, hf_settings, vocab, adapter_dir = imported
        return convert.import_model(exp, input_dir, hf_settings, vocab, adapter_dir)
    if mode == "export":
        return convert.export_model(exp, output_dir, model_size=config.vocabulary_config().model_size,
                                    **export_options)
    return infer(exp, input_file, output_file)


def build(settings: RunConfig | None = None, restart: bool = False, **overrides) -> Experiment:
    """The `Experiment` of `settings` (default: the gin config's, with `overrides`), in the
    phases of the module doc. `restart`: the model dir's recorded vocabulary does not bind
    this run, which starts afresh."""
    settings = settings or config.run_config(**overrides)
    task = _validate(settings)
    settings = dataclasses.replace(settings, eval_split=settings.eval_split or task.eval_split)
    layout, mesh = _layout(settings)
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
        if isinstance(source, user_data.UserData) and settings.mode == "train":
            source.check_loss_fraction()
        if _padded(vocab_config.rows(vocab.vocab_size)) != _padded(planned):  # sentencepiece fell short
            raise ConfigError(f"the vocabulary has {vocab.vocab_size} pieces, where "
                              f"{planned} were asked for (vocabulary.size)")
        try:
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
    if s.init_from:
        check_reachable(s.init_from, "run.init_from")
        if not epath.Path(s.init_from).is_dir():
            raise ConfigError(f"run.init_from={s.init_from!r} is not a directory; name the "
                              f"model dir of the run to start from")
    if s.mode not in (*NO_DATA, *READERS):
        check_data_dir(_data_dir(s))  # makes it: after the checks that write nothing
    return task


def _layout(s: RunConfig) -> tuple[Layout, jax.sharding.Mesh]:
    """Phase 2: the mesh and the layout rules."""
    layout = Layout(s.mesh_shape, s.layout_rules, s.parameter_layout_rules,
                    drop_unused_rules=True)
    _warn_of_dropped_rules(layout)
    try:
        mesh = _mesh(s, layout)
    except LayoutError as e:
        raise ConfigError(f"{e} — change run.mesh_shape (or, on CPU, --cpu_devices)") from None
    data_ways = layout.ways("batch")
    if s.num_microbatches > 1 and s.batch_size % (s.num_microbatches * data_ways):
        raise ConfigError(f"run.batch_size={s.batch_size} must split into "
                          f"run.num_microbatches={s.num_microbatches} microbatches of a "
                          f"multiple of {data_ways} rows (the mesh's batch dimension)")
    return layout, mesh


def _warn_of_dropped_rules(layout: Layout) -> None:
    """Rules naming a mesh dimension the mesh lacks are dropped (Mesh-TF's way: one set of
    rules serves every mesh, the one-device mesh included), in silence unless the drop
    probably loses something the user meant: on a mesh of several devices, a mesh
    dimension that no rule left splits over (its devices would all do the same work: the
    dropped rule was likely meant for it, under another name), or rules of which none is
    left (``d_model:batch`` on a ``model:8`` mesh: no FSDP at all)."""
    kept = {m for _, m in [*layout.layout_rules, *layout.parameter_rules]}
    idle = [name for name, size in layout.mesh_shape if size > 1 and name not in kept]
    for kind, dropped, rules in (
            ("layout rules", layout.dropped_rules, layout.layout_rules),
            ("parameter layout rules", layout.dropped_parameter_rules, layout.parameter_rules)):
        if not dropped or layout.size == 1 or (rules and not idle):
            continue
        missing = " or ".join(repr(m) for m in sorted({m for _, m in dropped}))
        why = (f"; its dimension {' and '.join(repr(m) for m in idle)} splits nothing"
               if idle else ", so none of them applies")
        log.warning("%s %s ignored: the mesh %r has no dimension %s%s", kind,
                    ", ".join(f"'{t}:{m}'" for t, m in dropped), layout.mesh_text, missing, why)


def _mesh(s: RunConfig, layout: Layout) -> jax.sharding.Mesh:
    """The mesh of `layout`: over every device of every process, but for the modes that
    only lay the model out. A plan lays it out on the mesh's first devices, however many
    the machine has (`__main__` simulates enough). An import or export in one process
    needs no mesh of the training run's shape (it reads or gathers each parameter whole):
    on the first devices where there are enough, else on a mesh of the same dimension
    names shrunk to fit the devices there are (`_shrunk`): each size a divisor of the
    configured one, so that every split the layout checked still divides. The layout (its
    legality checks, the config written) stays the configured one."""
    if s.mode == "plan" or (s.mode in NO_DATA and jax.process_count() == 1):
        devices = jax.devices()
        if s.mode == "plan" or layout.size <= len(devices):
            return layout.make_mesh(devices[:layout.size])
        shrunk = _shrunk(layout, len(devices))
        log.info("--mode=%s: the mesh %r needs %d devices and this process has %d: the "
                 "parameters are laid out on the mesh %r", s.mode, layout.mesh_text,
                 layout.size, len(devices), shrunk.mesh_text or "(one device)")
        return shrunk.make_mesh(devices[:shrunk.size])
    return layout.make_mesh()


def _shrunk(layout: Layout, devices: int) -> Layout:
    """`layout`'s mesh with each dimension cut to a divisor of its size, on as many of
    `devices` as such a mesh can use (of equals, the one whose trailing dimensions, where
    Mesh-TF puts `model`, are largest: the one that splits parameters most); rules as
    `layout`'s."""
    best: tuple = ()
    for sizes in itertools.product(*[[d for d in range(1, n + 1) if n % d == 0]
                                     for _, n in layout.mesh_shape]):
        if math.prod(sizes) <= devices:
            best = max(best, (math.prod(sizes), sizes[::-1]))
    sizes = best[1][::-1] if best else ()
    mesh = ";".join(f"{name}:{size}" for (name, _), size in zip(layout.mesh_shape, sizes))
    return Layout(mesh, layout.rules_text, layout.parameter_rules_text)


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
    trainable = freezing.trainable(s.trainable, model_config.lora is not None)
    trainer = Trainer(model, opt, layout, mesh, s.batch_size, s.sequence_length, seed=s.seed,
                      loss_config=config.loss(), num_microbatches=s.num_microbatches,
                      trainable=trainable, dpo=config.dpo() if task.preference else None)
    stepper = trainer
    if s.data_parallel == "sgp":
        if trainer.frozen or trainer.dpo:
            raise ConfigError("run.data_parallel='sgp' trains every parameter on a token "
                              "loss: it takes no frozen ones (run.trainable, LoRA) nor DPO")
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
    if task.data is not None:  # a user's files
        return user_data.prepare_run(task, vocab_config, data_dir, recorded=recorded,
                                     unrecorded=unrecorded, model_dir=s.model_dir,
                                     eval_split=s.eval_split, init_from=s.init_from)
    source = task.source(data_dir, s.data_source)
    source.check_split(s.eval_split)
    cached = os.path.join(source.cache_dir(data_dir), task.name,
                          f"spm_{vocab_config.size or DEFAULT_SIZE}.model")
    vocab = vocab_config.choose(recorded, cached, lambda: source.texts("train"),
                                f"the {task.name} training split", where=s.model_dir,
                                unrecorded=unrecorded)
    return source, vocab


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
