"""A whole run from a gin config: build the experiment, then train, evaluate, translate or
plan.

`run` is the gin configurable that Mesh-TF users know (``run.mesh_shape``,
``run.layout_rules``, ``run.train_steps``, ...). Everything a run needs is built and checked
by `build` before anything is written to the model dir, so a bad config never touches it.
The training loop is `training.train`, the metrics `evaluation.evaluate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import gin
import jax
import optax
from etils import epath

from mtrain import MODES, config
from mtrain.parallel import distributed
from mtrain.planning import planner
from mtrain.data import tasks as tasks_lib
from mtrain.modes import train as training
from mtrain.io.checkpoints import require_checkpoints
from mtrain.errors import ConfigError
from mtrain.experiment import Experiment
from mtrain.modes.infer import check_output_file, infer
from mtrain.parallel.layout import Layout, LayoutError
from mtrain.io.lock import check_data_dir, check_reachable, preparing_data
from mtrain.io.metrics import log
from mtrain.modes.score import score
from mtrain.training.sgp import SGPTrainer
from mtrain.parallel.targets import TARGETS
from mtrain.io.model_dir import VOCABULARY, ModelDir
from mtrain.training.trainer import Trainer
from mtrain.evaluation.translation import Translator
from mtrain.data.vocabulary import Vocabulary, get_or_train_vocabulary, load_vocabulary

parse_config, CONFIGS_DIR = config.parse, config.CONFIGS_DIR  # for the CLI, tests, benchmarks
DEFAULT_VOCAB_SIZE = 8192


@gin.configurable
def vocabulary(task: tasks_lib.Task, source, data_dir: str, size: int = DEFAULT_VOCAB_SIZE,
               path: str | None = None, model_dir: str | None = None) -> Vocabulary:
    """The task's sentencepiece vocabulary.

    A model dir whose runs recorded theirs (`<model_dir>/vocabulary.model`, written when
    training starts) uses it, never another: a ``vocabulary.path`` or ``vocabulary.size``
    that names a different one is a `ConfigError`. Otherwise `path` if given, else one
    trained once on the task's training text (every feature: one joint vocabulary for
    translation) and cached next to the data."""
    recorded = _recorded_vocabulary(model_dir)
    if recorded:
        vocab = load_vocabulary(recorded)
        if path and load_vocabulary(path).digest != vocab.digest:
            raise ConfigError(f"vocabulary.path={path} is not the vocabulary the checkpoints "
                              f"in {model_dir} were trained with ({recorded}); leave it unset, "
                              f"or start a new run in another --model_dir")
        bound_size = config.bound("vocabulary.size", None)
        if not path and bound_size is not None and bound_size != vocab.vocab_size:
            raise ConfigError(f"vocabulary.size={bound_size}, but the checkpoints in {model_dir} "
                              f"were trained with a vocabulary of {vocab.vocab_size} pieces "
                              f"({recorded}); leave it as it was, or start a new run in "
                              f"another --model_dir")
        return vocab
    if path:
        vocab = load_vocabulary(path)
    else:
        cached = os.path.join(source.cache_dir(data_dir), task.name, f"spm_{size}.model")
        vocab = get_or_train_vocabulary(cached, lambda: source.texts("train"), size,
                                        texts_name=f"the {task.name} training split")
    if model_dir and epath.Path(ModelDir(model_dir).checkpoints).is_dir():
        log.warning("the model dir %s has no %s: using %s (the checkpoints' own digest of "
                    "theirs is checked)", model_dir, VOCABULARY, vocab.path)
    return vocab


def planned_vocab_size(model_dir: str | None = None) -> int:
    """The vocabulary size a run would have, without data: that of the vocabulary recorded
    in `model_dir` if any (see `vocabulary`), else of ``vocabulary.path`` if bound, else
    ``vocabulary.size`` (sentencepiece trains exactly that many pieces)."""
    path = _recorded_vocabulary(model_dir) or config.bound("vocabulary.path", None)
    return load_vocabulary(path).vocab_size if path else config.bound("vocabulary.size",
                                                                      DEFAULT_VOCAB_SIZE)


def _recorded_vocabulary(model_dir: str | None) -> str | None:
    """The path of the vocabulary recorded in `model_dir`, if it has one."""
    recorded = ModelDir(model_dir).vocabulary if model_dir else None
    return recorded if recorded and epath.Path(recorded).exists() else None


def _padded(vocab_size: int) -> int:
    return 128 * math.ceil(vocab_size / 128)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"run.{name} must be a positive integer, got {value!r}")


@gin.configurable("run")
def build(
    model_dir: str,
    mode: str = "train",
    *,
    task: str = "bible_lm",
    data_dir: str | None = None,
    data_source: str | None = None,
    mesh_shape: str = "",
    layout_rules: str = "batch:batch;d_ff:model;heads:model;vocab:model",
    parameter_layout_rules: str = "",
    batch_size: int = 32,
    sequence_length: int = 128,
    train_steps: int = 1000,
    seed: int = 0,
    log_every: int = 50,
    eval_every: int = 0,
    checkpoint_every: int = 500,
    keep_checkpoints: int = 3,
    keep_checkpoint_every: int = 0,
    init_from: str | None = None,
    init_step: int | None = None,
    max_nonfinite_steps: int = 10,
    eval_split: str | None = None,
    activation_dtype: str | None = None,
    num_microbatches: int = 1,
    profile_steps: tuple[int, int] | None = None,
    data_parallel: str = "allreduce",
    sgp_overlap: int = 0,
    sgp_average_every: int = 0,
    model=None,
    optimizer=config.adafactor,
    restart: bool = False,
):
    """Builds and checks everything a run needs, writing nothing (gin: ``run.*``).

    `mode` is 'train', 'eval' (evaluate the latest checkpoint), 'infer' (translate with
    it), 'score' (the log-likelihood of lines of text with it) or 'plan' (compile the train
    step for the mesh and report its cost; needs no data and only as many devices as the
    mesh, simulated on CPU); see `run`.

    `eval_every` = 0 evaluates only at the end of training. `data_dir` (default
    $MTRAIN_DATA_DIR or ~/.cache/mtrain) holds prepared datasets and cached vocabularies.
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
    mesh's batch dimension every step; 'sgp' is Stochastic Gradient Push (`mtrain.sgp`): every
    replica along it keeps its own parameters and mixes them with one peer per step
    (`sgp_overlap` = tau: messages added tau steps late; `sgp_average_every` = H: an exact
    average every H steps). Evaluation and checkpoints use the replicas' average, so
    checkpoints of either kind restore into the other.

    `model` and `optimizer` are gin references (see `mtrain.config`): ``model(config)`` of
    the ``transformer.*`` settings builds the model (default: `@DecoderLM` for LM tasks,
    `@EncoderDecoder` for translation), ``optimizer(schedule)`` the optax optimizer
    (default `@adafactor`), wrapped to skip non-finite updates. `restart` (--restart):
    the model dir's recorded vocabulary does not bind this run, which starts afresh.
    """
    for name, value in [("batch_size", batch_size), ("sequence_length", sequence_length),
                        ("train_steps", train_steps), ("log_every", log_every),
                        ("checkpoint_every", checkpoint_every),
                        ("keep_checkpoints", keep_checkpoints),
                        ("max_nonfinite_steps", max_nonfinite_steps)]:
        _positive(name, value)
    _positive("num_microbatches", num_microbatches)
    if profile_steps is not None and not (
            len(profile_steps) == 2 and 0 < profile_steps[0] <= profile_steps[1]):
        raise ConfigError(f"run.profile_steps must be (first, last) steps with 0 < first <= "
                          f"last, got {profile_steps!r}")
    if data_parallel not in ("allreduce", "sgp"):
        raise ConfigError(f"run.data_parallel must be 'allreduce' or 'sgp', got "
                          f"{data_parallel!r}")
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    data_dir = data_dir or os.environ.get("MTRAIN_DATA_DIR") or os.path.expanduser("~/.cache/mtrain")
    task_obj = tasks_lib.get_task(task)
    if mode == "infer" and task_obj.kind != "translation":
        raise ConfigError(f"--mode=infer translates, but task {task!r} is a {task_obj.kind} task")
    if init_from:
        check_reachable(init_from, "run.init_from")
        if not epath.Path(init_from).is_dir():
            raise ConfigError(f"run.init_from={init_from!r} is not a directory; name the model "
                              f"dir of the run to start from")
    if mode != "plan":
        check_data_dir(data_dir)  # makes it: after the checks that write nothing
    eval_split = eval_split or task_obj.eval_split
    layout = Layout(mesh_shape, layout_rules, parameter_layout_rules, drop_unused_rules=True)
    for kind, dropped in (("layout rules", layout.dropped_rules),
                          ("parameter layout rules", layout.dropped_parameter_rules)):
        if dropped:
            missing = sorted({mesh_dim for _, mesh_dim in dropped})
            log.warning("%s %s ignored: the mesh %r has no dimension %s", kind,
                        ", ".join(f"'{t}:{m}'" for t, m in dropped), mesh_shape,
                        " or ".join(repr(m) for m in missing))
    planning = mode == "plan"
    try:
        mesh = layout.make_mesh(jax.devices()[:layout.size] if planning else None)
    except LayoutError as e:
        raise ConfigError(f"{e} — change run.mesh_shape (or, on CPU, --cpu_devices)") from None
    data_ways = layout.ways("batch")
    if num_microbatches > 1 and batch_size % (num_microbatches * data_ways):
        raise ConfigError(f"run.batch_size={batch_size} must split into run.num_microbatches="
                          f"{num_microbatches} microbatches of a multiple of {data_ways} rows "
                          f"(the mesh's batch dimension)")
    translation = task_obj.kind == "translation"

    def build_model(vocab_size: int):
        """The model, its schedule, trainer and SGP for a vocabulary of `vocab_size` pieces,
        padded to a multiple of 128 so that it splits over any mesh dimension up to 128 (the
        extra ids never occur in the data)."""
        try:
            model_config = config.transformer(vocab_size=_padded(vocab_size))
            if activation_dtype is not None:
                model_config = dataclasses.replace(model_config, activation_dtype=activation_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if model_config.max_length < sequence_length:
            raise ConfigError(f"run.sequence_length={sequence_length} is longer than "
                              f"transformer.max_length={model_config.max_length}")
        schedule = config.learning_rate_schedule(train_steps=train_steps)
        # Updates with a non-finite gradient leave parameters and optimizer state as they were.
        opt = optax.apply_if_finite(optimizer(schedule), max_nonfinite_steps)
        built = (model or config.MODELS[task_obj.kind])(model_config)
        features = ("inputs", "targets")[1 - translation:]
        if built.features != features:
            raise ConfigError(f"run.model {type(built).__name__} takes {built.features}, but "
                              f"task {task!r} gives {features}")
        trainer = Trainer(built, opt, layout, mesh, batch_size, sequence_length, seed=seed,
                          loss_config=config.loss(), num_microbatches=num_microbatches)
        sgp = None
        if data_parallel == "sgp":
            try:
                sgp = SGPTrainer(trainer, overlap=sgp_overlap, average_every=sgp_average_every)
            except ValueError as e:
                raise ConfigError(f"run.data_parallel='sgp': {e}") from None
        elif sgp_overlap or sgp_average_every:
            raise ConfigError("run.sgp_overlap and run.sgp_average_every need "
                              "run.data_parallel='sgp'")
        return model_config, built, schedule, trainer, sgp

    # What needs no data is built and checked before the data is prepared (minutes on a fresh
    # machine), for the vocabulary size the settings ask for; built again if the prepared
    # vocabulary has another.
    planned = planned_vocab_size(None if restart or planning else model_dir)
    model_config, built, schedule, trainer, sgp = build_model(planned)
    source = vocab = None
    if not planning:
        # Process 0 prepares the dataset and trains the vocabulary (once, into data_dir);
        # the others wait, then load what it made.
        for turn in ("first", "rest"):
            if (jax.process_index() == 0) == (turn == "first"):
                with preparing_data(data_dir):  # one run at a time (on a fresh machine)
                    source = task_obj.source(data_dir, data_source)
                    source.check_split(eval_split)
                    vocab = vocabulary(task_obj, source, data_dir,
                                       model_dir=None if restart else model_dir)
            distributed.sync(f"mtrain_data_prepared_{turn}")
        if _padded(vocab.vocab_size) != _padded(planned):
            model_config, built, schedule, trainer, sgp = build_model(vocab.vocab_size)
    translator = None
    if translation and not planning:
        try:
            translator = Translator(trainer, vocab, config.decoding())
        except (ValueError, LayoutError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    exp = Experiment(
        model_dir=model_dir, task=task_obj, source=source, vocab=vocab, model_config=model_config,
        layout=layout, trainer=trainer, batch_size=batch_size, sequence_length=sequence_length,
        train_steps=train_steps, seed=seed, log_every=log_every, eval_every=eval_every,
        checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
        keep_checkpoint_every=keep_checkpoint_every, init_from=init_from, init_step=init_step,
        max_nonfinite_steps=max_nonfinite_steps,
        eval_split=eval_split, schedule=schedule, mode=mode,
        optimizer_settings=config.settings(optimizer), config_text=config.operative(),
        translator=translator,
        flops_per_step=built.analytic_flops(batch_size, sequence_length),
        profile_steps=tuple(profile_steps) if profile_steps else None,
        sgp=sgp,
    )
    return exp


def run(input_file: str | None = None, output_file: str | None = None,
        plan_options: dict | None = None, restart: bool = False,
        output_dir: str | None = None, **overrides):
    """Trains (``run.mode='train'``; `restart`: from step 0 whatever the model dir holds,
    moved aside first), evaluates the latest checkpoint (``'eval'``), translates
    `input_file` to `output_file` with it (``'infer'``; None is stdin / stdout), scores the
    lines of `input_file` into `output_file` (``'score'``, `scoring.score`) or plans
    (``'plan'``, with `plan_options` for `plan`), as the gin config and `overrides` (e.g.
    model_dir from the command line) say. Eval and score write what they measure to
    `output_dir`, else into the model dir if it can be written (`ModelDir.outputs`)."""
    mode = overrides.get("mode") or config.bound("run.mode", "train")
    model_dir = overrides.get("model_dir") or config.bound("run.model_dir", None)
    # What can fail at once, before data and compilation: a bucket that cannot be reached,
    # another run in the model dir, no checkpoint to read, an output file that could not be
    # written.
    if mode != "plan" and model_dir:
        check_reachable(model_dir, "the model dir")
        if ModelDir(model_dir).is_file():
            raise ConfigError(f"the model dir {model_dir} is a file, not a directory; name a "
                              f"directory (a new one to train into)")
    if mode == "train" and model_dir:
        training.check_model_dir_free(model_dir)
    if mode in ("eval", "infer", "score") and model_dir:
        require_checkpoints(ModelDir(model_dir).checkpoints, "train first (--mode=train)")
    if mode in ("infer", "score"):
        check_output_file(output_file, input_file)
    exp = build(restart=restart, **overrides)
    auto_layout = (plan_options or {}).get("auto_layout")
    where = (f"searching layouts for {(plan_options or {}).get('devices') or jax.device_count()}"
             f" devices" if auto_layout else f"{exp.layout} over {jax.device_count()} devices")
    log.info("mtrain: task %s, model %s, %s", exp.task.name, _describe(exp.model_config), where)
    if exp.mode == "train":
        return training.train(exp, restart=restart)
    if exp.mode == "eval":
        return training.evaluate_checkpoint(exp, output_dir)
    if exp.mode == "plan":
        return plan(exp, **(plan_options or {}))
    if exp.mode == "score":
        return score(exp, input_file, output_file, output_dir)
    return infer(exp, input_file, output_file)


def plan(exp: Experiment, target: str = "tpu-v3", output_format: str = "text",
         auto_layout: bool = False, devices: int | None = None, top: int = 5,
         out=None) -> dict:
    """``--mode=plan``: compiles the train step for the configured mesh and prints what it
    needs per device and how long it would take on `target` (see `planner`); with
    `auto_layout`, ranks every mesh and layout of `devices` (default: the mesh's size)
    devices instead. Prints text or, with `output_format` 'json', one JSON object to `out`
    (default stdout); returns that object."""
    if target not in TARGETS:
        raise ConfigError(f"unknown --target {target!r}; use one of {', '.join(TARGETS)}")
    if output_format not in ("text", "json"):
        raise ConfigError(f"unknown --format {output_format!r}; use text or json")
    target_spec = TARGETS[target]
    describe = f"task {exp.task.name}, {_describe(exp.model_config)}"
    if auto_layout:
        devices = devices or exp.layout.size
        if devices > jax.device_count():
            raise ConfigError(f"--auto_layout for {devices} devices, but only "
                              f"{jax.device_count()} are available to compile for")
        results = planner.auto_layout(
            exp.trainer.with_layout, devices, target_spec, progress=lambda message: log.info("auto-layout %s", message))
        report = {"model": describe, "num_devices": devices, "target": target,
                  "candidates": [{"mesh_shape": c.mesh_shape, "layout_rules": c.layout_rules,
                                  "parameter_layout_rules": c.parameter_layout_rules,
                                  "rejected": c.rejected,
                                  "plan": c.plan.to_dict() if c.plan else None}
                                 for c in results]}
        text = planner.format_auto_layout(results, devices, target, top)
    else:
        compiled = exp.sgp.compile_train_step() if exp.sgp else None
        result = planner.plan(exp.trainer, target_spec, compiled=compiled)
        report = {"model": describe, **result.to_dict()}
        text = planner.format_plan(result, describe)
    out = out or sys.stdout
    out.write((json.dumps(report, indent=1) if output_format == "json" else text) + "\n")
    out.flush()
    return report


def _describe(c) -> str:
    return (f"{c.num_layers} layers d_model {c.d_model} d_ff {c.d_ff} heads {c.num_heads}x{c.d_kv} "
            f"vocab {c.vocab_size}")


def model_dir_is_bound() -> bool:
    return config.bound("run.model_dir", None) is not None
