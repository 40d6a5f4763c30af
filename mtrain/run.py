"""A whole run from a gin config: build the experiment, then train or evaluate.

`run` is the gin configurable that Mesh-TF users know (``run.mesh_shape``,
``run.layout_rules``, ``run.train_steps``, ...). Everything a run needs is built and checked
by `build` before anything is written to the model dir, so a bad config never touches it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time

import gin
import jax
import numpy as np
import optax

from mtrain import distributed
from mtrain import optimizer as optimizer_lib
from mtrain import planner
from mtrain import tasks as tasks_lib
from mtrain.bleu import corpus_bleu
from mtrain.checkpoints import Checkpoints, CheckpointError
from mtrain.data.pipeline import batches
from mtrain.errors import ConfigError, TrainingDiverged
from mtrain.layout import Layout
from mtrain.metrics import MetricsWriter, log
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.sgp import SGPTrainer
from mtrain.trainer import LossConfig, Trainer
from mtrain.translation import DecodingConfig, Translator
from mtrain.vocabulary import Vocabulary, get_or_train_vocabulary, load_vocabulary

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# Model settings that change parameter shapes: a checkpoint must agree on all of them.
SHAPE_FIELDS = ("vocab_size", "d_model", "d_ff", "num_heads", "d_kv", "num_layers",
                "num_encoder_layers", "max_length", "shared_embedding_and_softmax",
                "scan_layers")
MODES = ("train", "eval", "infer", "plan")
DEFAULT_VOCAB_SIZE = 8192

def parse_config(gin_files: list[str], gin_params: list[str]) -> None:
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


@gin.configurable
def vocabulary(task: tasks_lib.Task, source, data_dir: str, size: int = DEFAULT_VOCAB_SIZE,
               path: str | None = None) -> Vocabulary:
    """The task's sentencepiece vocabulary: `path` if given, else trained once on the task's
    training text (every feature: one joint vocabulary for translation) and cached next to
    the data."""
    if path:
        return load_vocabulary(path)
    cached = os.path.join(source.cache_dir(data_dir), task.name, f"spm_{size}.model")
    return get_or_train_vocabulary(
        cached, lambda: source.texts("train"), size,
        texts_name=f"the {task.name} training split",
    )


def planned_vocab_size() -> int:
    """The vocabulary size a run would have, without data: that of ``vocabulary.path`` if
    bound, else ``vocabulary.size`` (sentencepiece trains exactly that many pieces)."""
    def bound(name, default):
        try:
            return gin.query_parameter(f"vocabulary.{name}")
        except ValueError:
            return default

    path = bound("path", None)
    return load_vocabulary(path).vocab_size if path else bound("size", DEFAULT_VOCAB_SIZE)


@dataclasses.dataclass
class Experiment:
    """Everything `train` and `evaluate` need, built from the gin config by `build`."""

    model_dir: str
    task: tasks_lib.Task
    source: object  # None when planning: a plan needs no data
    vocab: Vocabulary | None
    model_config: TransformerConfig
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
    schedule: object
    mode: str = "train"
    translator: Translator | None = None  # translation tasks: decodes for BLEU and infer
    flops_per_step: float = 0.0  # model FLOPs of one train step (planner.analytic_flops)
    profile_steps: tuple[int, int] | None = None
    sgp: SGPTrainer | None = None  # run.data_parallel='sgp': steps the trainer's model by SGP

    def train_batches(self):
        return self._batches("train", train=True)

    def eval_batches(self):
        return self._batches(self.eval_split, train=False)

    def _batches(self, split: str, train: bool):
        """This process's rows of each global batch (`Trainer.local_rows`)."""
        start, stop = self.trainer.local_rows()
        return batches(
            self.source, self.vocab, split, self.task.features, self.sequence_length,
            self.batch_size, self.seed, train=train,
            shard=(start // (stop - start), self.batch_size // (stop - start)),
            process=(jax.process_index(), jax.process_count()),
        )

    def checkpoint_meta(self) -> dict:
        config = dataclasses.asdict(self.model_config)
        return {"model": {k: config[k] for k in SHAPE_FIELDS}, "task": self.task.name}


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
):
    """Builds and checks everything a run needs, writing nothing (gin: ``run.*``).

    `mode` is 'train', 'eval' (evaluate the latest checkpoint), 'infer' (translate with
    it) or 'plan' (compile the train step for the mesh and report its cost; needs no data
    and only as many devices as the mesh, simulated on CPU); see `run`. Translation tasks get the encoder-decoder, LM tasks the decoder-only LM.

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
    if init_from and not os.path.isdir(init_from):
        raise ConfigError(f"run.init_from={init_from!r} is not a directory; name the model dir "
                          f"of the run to start from")
    eval_split = eval_split or task_obj.eval_split
    layout = Layout(mesh_shape, layout_rules, drop_unused_rules=True)
    for tensor_dim, mesh_dim in layout.dropped_rules:
        log.warning("layout rule '%s:%s' ignored: the mesh %r has no dimension %r",
                    tensor_dim, mesh_dim, mesh_shape, mesh_dim)
    planning = mode == "plan"
    mesh = layout.make_mesh(jax.devices()[:layout.size] if planning else None)
    data_ways = layout.ways("batch")
    if num_microbatches > 1 and batch_size % (num_microbatches * data_ways):
        raise ConfigError(f"run.batch_size={batch_size} must split into run.num_microbatches="
                          f"{num_microbatches} microbatches of a multiple of {data_ways} rows "
                          f"(the mesh's batch dimension)")
    source = vocab = None
    if not planning:
        # Process 0 prepares the dataset and trains the vocabulary (once, into data_dir);
        # the others wait, then load what it made.
        for turn in ("first", "rest"):
            if (jax.process_index() == 0) == (turn == "first"):
                source = task_obj.source(data_dir, data_source)
                source.check_split(eval_split)
                vocab = vocabulary(task_obj, source, data_dir)
            distributed.sync(f"mtrain_data_prepared_{turn}")
    vocab_size = planned_vocab_size() if planning else vocab.vocab_size
    # Pad the model's vocabulary to a multiple of 128 so that it splits over any mesh
    # dimension up to 128; the extra ids never occur in the data.
    try:
        model_config = TransformerConfig(vocab_size=128 * math.ceil(vocab_size / 128))
        if activation_dtype is not None:
            model_config = dataclasses.replace(model_config, activation_dtype=activation_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model_config.max_length < sequence_length:
        raise ConfigError(
            f"run.sequence_length={sequence_length} is longer than "
            f"transformer.max_length={model_config.max_length}"
        )
    schedule = optimizer_lib.learning_rate_schedule(train_steps=train_steps)
    # Updates with a non-finite gradient leave parameters and optimizer state as they were.
    opt = optax.apply_if_finite(optimizer_lib.adafactor(schedule), max_nonfinite_steps)
    translation = task_obj.kind == "translation"
    model = EncoderDecoder(model_config) if translation else DecoderLM(model_config)
    trainer = Trainer(model, opt, layout, mesh, batch_size, sequence_length, seed=seed,
                      loss_config=LossConfig(), num_microbatches=num_microbatches)
    sgp = None
    if data_parallel == "sgp":
        try:
            sgp = SGPTrainer(trainer, overlap=sgp_overlap, average_every=sgp_average_every)
        except ValueError as e:
            raise ConfigError(f"run.data_parallel='sgp': {e}") from None
    elif sgp_overlap or sgp_average_every:
        raise ConfigError("run.sgp_overlap and run.sgp_average_every need "
                          "run.data_parallel='sgp'")
    exp = Experiment(
        model_dir=model_dir, task=task_obj, source=source, vocab=vocab, model_config=model_config,
        layout=layout, trainer=trainer, batch_size=batch_size, sequence_length=sequence_length,
        train_steps=train_steps, seed=seed, log_every=log_every, eval_every=eval_every,
        checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
        keep_checkpoint_every=keep_checkpoint_every, init_from=init_from, init_step=init_step,
        max_nonfinite_steps=max_nonfinite_steps,
        eval_split=eval_split, schedule=schedule, mode=mode,
        translator=(Translator(trainer, vocab, DecodingConfig())
                    if translation and not planning else None),
        flops_per_step=planner.analytic_flops(model_config, task_obj.kind, batch_size,
                                              sequence_length),
        profile_steps=tuple(profile_steps) if profile_steps else None,
        sgp=sgp,
    )
    log.info("mtrain: task %s, model %s, %s over %d devices", task, _describe(model_config),
             layout, jax.device_count())
    return exp


def run(input_file: str | None = None, output_file: str | None = None,
        plan_options: dict | None = None, **overrides):
    """Trains (``run.mode='train'``), evaluates the latest checkpoint (``'eval'``),
    translates `input_file` to `output_file` with it (``'infer'``; None is stdin / stdout)
    or plans (``'plan'``, with `plan_options` for `plan`), as the gin config and `overrides`
    (e.g. model_dir from the command line) say."""
    exp = build(**overrides)
    if exp.mode == "train":
        return train(exp)
    if exp.mode == "eval":
        return evaluate_checkpoint(exp)
    if exp.mode == "plan":
        return plan(exp, **(plan_options or {}))
    return infer(exp, input_file, output_file)


def plan(exp: Experiment, target: str = "tpu-v3", output_format: str = "text",
         auto_layout: bool = False, devices: int | None = None, top: int = 5,
         out=None) -> dict:
    """``--mode=plan``: compiles the train step for the configured mesh and prints what it
    needs per device and how long it would take on `target` (see `planner`); with
    `auto_layout`, ranks every mesh and layout of `devices` (default: the mesh's size)
    devices instead. Prints text or, with `output_format` 'json', one JSON object to `out`
    (default stdout); returns that object."""
    if target not in planner.TARGETS:
        raise ConfigError(f"unknown --target {target!r}; use one of {', '.join(planner.TARGETS)}")
    if output_format not in ("text", "json"):
        raise ConfigError(f"unknown --format {output_format!r}; use text or json")
    target_spec, kind = planner.TARGETS[target], exp.task.kind
    analytic = planner.analytic_parameters(exp.model_config, kind)
    describe = f"task {exp.task.name}, {_describe(exp.model_config)}"
    if auto_layout:
        devices = devices or exp.layout.size
        if devices > jax.device_count():
            raise ConfigError(f"--auto_layout for {devices} devices, but only "
                              f"{jax.device_count()} are available to compile for")
        results = planner.auto_layout(
            exp.trainer.with_layout, exp.model_config, kind, devices, target_spec, analytic,
            progress=lambda message: log.info("auto-layout %s", message))
        report = {"model": describe, "num_devices": devices, "target": target,
                  "candidates": [{"mesh_shape": c.mesh_shape, "layout_rules": c.layout_rules,
                                  "rejected": c.rejected,
                                  "plan": c.plan.to_dict() if c.plan else None}
                                 for c in results]}
        text = planner.format_auto_layout(results, devices, target, top)
    else:
        compiled = exp.sgp.compile_train_step() if exp.sgp else None
        result = planner.plan(exp.trainer, exp.model_config, kind, target_spec, analytic,
                              compiled=compiled)
        report = {"model": describe, **result.to_dict()}
        text = planner.format_plan(result, describe)
    out = out or sys.stdout
    out.write((json.dumps(report, indent=1) if output_format == "json" else text) + "\n")
    out.flush()
    return report


def _describe(c: TransformerConfig) -> str:
    return (f"{c.num_layers} layers d_model {c.d_model} d_ff {c.d_ff} heads {c.num_heads}x{c.d_kv} "
            f"vocab {c.vocab_size}")


def _restore_or_init(exp: Experiment, checkpoints: Checkpoints, iterator):
    """(state, step): resumed from the model dir's newest intact checkpoint, else started
    from `init_from`'s parameters, else freshly initialised."""
    if checkpoints.all_steps():
        state, step = checkpoints.restore_intact(exp.trainer.sharded_abstract_state(),
                                                 iterator, exp.checkpoint_meta())
        log.info("resuming from the checkpoint of step %d in %s", step, checkpoints.directory)
        return state, step
    state = exp.trainer.init_state()
    if exp.init_from:
        params, step, where = _params_from(exp)
        log.info("starting from the parameters of step %d of %s", step, where)
        state = state.replace(params=params)
    return state, 0


def _params_from(exp: Experiment):
    """The parameters of checkpoint `init_step` (default: the latest) of run `init_from`."""
    where = exp.init_from
    if os.path.isdir(os.path.join(where, "checkpoints")):
        where = os.path.join(where, "checkpoints")
    state, step = _restore_from(exp, where, exp.init_step,
                                missing="run.init_from must name the model dir of a run")
    return state.params, step, where


def _restore_from(exp: Experiment, directory: str, step: int | None = None,
                  missing: str = "train first (--mode=train)"):
    """(state, step) of checkpoint `step` (default: the latest) in `directory`, into this
    run's shardings, without the input position: for eval, infer and init_from. Reads only;
    `missing` says what to do when `directory` holds no checkpoint."""
    if not os.path.isdir(directory):  # Checkpoints would create it
        raise CheckpointError(f"no checkpoints in {directory}; {missing}")
    checkpoints = Checkpoints(directory, exp.keep_checkpoints)
    try:
        steps = checkpoints.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {directory}; {missing}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {directory} (it has {steps})")
        state = checkpoints.restore(step, exp.trainer.sharded_abstract_state(), None,
                                    exp.checkpoint_meta())
        return state, step
    finally:
        checkpoints.close()


def train(exp: Experiment) -> dict:
    """The training loop: log, evaluate and checkpoint on schedule; returns the last eval."""
    try:
        os.makedirs(exp.model_dir, exist_ok=True)
        if not os.access(exp.model_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ConfigError(f"cannot write the model dir {exp.model_dir}: {e.strerror}") from None
    checkpoints = Checkpoints(os.path.join(exp.model_dir, "checkpoints"), exp.keep_checkpoints,
                              exp.keep_checkpoint_every)
    batches = exp.train_batches()
    state, start = _restore_or_init(exp, checkpoints, batches)
    if jax.process_index() == 0:
        with open(os.path.join(exp.model_dir, "config.gin"), "w") as f:
            f.write(gin.operative_config_str())
    writer = MetricsWriter(exp.model_dir)
    try:
        results = _train_loop(exp, state, start, batches, checkpoints, writer)
    finally:  # a run that stops on an error still completes the checkpoints it started
        try:
            checkpoints.wait()
        finally:
            checkpoints.close()
            writer.close()
    log.info("metrics: %s  checkpoints: %s", writer.path, checkpoints.directory)
    return results


def _train_loop(exp: Experiment, state, start: int, batches, checkpoints: Checkpoints,
                writer: MetricsWriter) -> dict:
    trainer, pending, results = exp.trainer, [], {}
    # With SGP the loop steps replicas of the state; evaluation and checkpoints get their
    # average, a Trainer state.
    stepper, as_trainer_state = exp.trainer, lambda state: state  # noqa: E731
    if exp.sgp:
        stepper, as_trainer_state = exp.sgp, exp.sgp.train_state
        state = exp.sgp.init_state(state)
        log.info("SGP over %d replicas (overlap %d, exact average every %s steps): each sends "
                 "%.3g MB per step", exp.sgp.num_replicas, exp.sgp.overlap,
                 exp.sgp.average_every or "no", exp.sgp.bytes_sent_per_step() / 1e6)
    peak, source = planner.device_peak_flops()
    log.info("model FLOPs per step %.3g; MFU against %.3g FLOP/s per device (%s)",
             exp.flops_per_step, peak, source)
    guard, tick, preempted = _FiniteGuard(exp.max_nonfinite_steps), time.time(), False
    with _Preemption() as preemption:
        for step in range(start + 1, exp.train_steps + 1):
            if exp.profile_steps and step == exp.profile_steps[0]:
                jax.profiler.start_trace(os.path.join(exp.model_dir, "profile"))
            state, metrics = stepper.train_step(state, trainer.place_batch(next(batches)))
            if exp.profile_steps and step == exp.profile_steps[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                log.info("profile of steps %d-%d: %s", *exp.profile_steps,
                         os.path.join(exp.model_dir, "profile"))
            guard.add(step, metrics["finite"])
            # At most two steps in flight: this one is queued behind the previous one, which
            # we wait for here. More buys nothing (the devices are busy either way) and, with
            # simulated CPU devices, a deep queue of multi-device programs can deadlock
            # XLA's collectives.
            guard.check(until=step - 1)
            pending.append(metrics)
            if step % exp.log_every == 0 or step == exp.train_steps:
                _log_train(exp, step, jax.device_get(pending), time.time() - tick, guard, writer,
                           peak, state)
                pending, tick = [], time.time()
            if exp.eval_every and step % exp.eval_every == 0 and step != exp.train_steps:
                results = evaluate(exp, _params(exp, state), step, writer)
                tick = time.time()
            preempted = preemption.reached(step)
            if step % exp.checkpoint_every == 0 or step == exp.train_steps or preempted:
                guard.check(until=step)  # never save a state that is about to be rejected
                checkpoints.save(step, as_trainer_state(state), batches, exp.checkpoint_meta())
            if preempted:
                log.warning("SIGTERM: stopped after step %d and saved its checkpoint; run the "
                            "same command to resume", step)
                return results
    if start < exp.train_steps or not results:
        results = evaluate(exp, _params(exp, state), exp.train_steps, writer)
    return results


def _params(exp: Experiment, state):
    """The parameters to evaluate: with SGP the replicas' average."""
    return exp.sgp.average(state) if exp.sgp else state.params


def _log_train(exp: Experiment, step: int, fetched: list[dict], elapsed: float,
               guard: "_FiniteGuard", writer: MetricsWriter, peak_flops: float = 0.0,
               state=None) -> None:
    """One record of training metrics, averaged over the steps since the last one (the
    skipped, non-finite ones left out), with the model FLOP/s each device achieved and its
    MFU against `peak_flops`; with SGP, also how far the replicas of `state` are from
    consensus and what each sends per step."""
    finite = [m for m in fetched if m["finite"]] or [{k: np.nan for k in fetched[0]}]
    flops = exp.flops_per_step * len(fetched) / max(elapsed, 1e-9) / jax.device_count()
    writer.write(step, {
        "train/loss": np.mean([m["loss"] for m in finite]),
        "train/cross_entropy": np.mean([m["cross_entropy"] for m in finite]),
        "train/grad_norm": np.mean([m["grad_norm"] for m in finite]),
        # The schedule counts updates from 0: step s was produced by update s - 1.
        "train/learning_rate": float(exp.schedule(step - 1)),
        "train/tokens_per_second": sum(float(m["num_tokens"]) for m in fetched) / max(elapsed, 1e-9),
        "train/skipped_steps": guard.skipped,
        "train/model_flops_per_second_per_device": flops,
        "train/mfu": flops / peak_flops if peak_flops else np.nan,
        **(_sgp_metrics(exp.sgp, state) if exp.sgp else {}),
    })


def _sgp_metrics(sgp: SGPTrainer, state) -> dict:
    distance = jax.device_get(sgp.consensus_distance(state))
    return {"train/consensus_distance_max": float(distance["max"]),
            "train/consensus_distance_mean": float(distance["mean"]),
            "train/bytes_sent_per_replica_per_step": sgp.bytes_sent_per_step()}


class _FiniteGuard:
    """Counts the steps whose loss or gradient was not finite (optax.apply_if_finite skipped
    their updates), and stops the run after `limit` of them in a row."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.skipped = limit, 0, 0
        self._unchecked: collections.deque = collections.deque()

    def add(self, step: int, finite: jax.Array) -> None:
        self._unchecked.append((step, finite))

    def check(self, until: int) -> None:
        """Waits for the steps up to `until` and counts them."""
        while self._unchecked and self._unchecked[0][0] <= until:
            step, finite = self._unchecked.popleft()
            if float(finite):
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            self.skipped += 1
            log.warning("step %d: non-finite loss or gradient; its update was skipped (%d in "
                        "a row)", step, self.in_a_row)
            if self.in_a_row >= self.limit:
                raise TrainingDiverged(
                    f"training diverged: {self.limit} steps in a row, up to step {step}, had a "
                    f"non-finite loss or gradient (run.max_nonfinite_steps); nothing after "
                    f"the last checkpoint was saved. Lower the learning rate and resume")


class _Preemption:
    """Notes SIGTERM (what Cloud TPU, Kubernetes and Slurm send before they stop a job) so
    that the loop can save a checkpoint and stop, instead of dying mid-step.

    With several processes, JAX's coordination service catches the signal on whichever
    processes get it and agrees with all of them on a step to stop at
    (`reached_preemption_sync_point`), so that they all save the same one.
    """

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (call it at every step, on every process)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __enter__(self):
        self.requested = False
        self._previous = None
        if jax.process_count() > 1:
            return self  # the coordination service owns SIGTERM
        try:
            self._previous = signal.signal(signal.SIGTERM, self._note)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _note(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def evaluate(exp: Experiment, params, step: int, writer: MetricsWriter) -> dict:
    """Token-level loss, perplexity and accuracy over the whole held-out split, and for
    language models the word-level perplexity and the unigram baseline."""
    totals = {"xent_sum": 0.0, "correct": 0.0, "num_tokens": 0.0}
    for batch in exp.eval_batches():
        sums = jax.device_get(exp.trainer.eval_step(params, exp.trainer.place_batch(batch)))
        totals = {k: totals[k] + float(sums[k]) for k in totals}
    n = max(totals["num_tokens"], 1.0)
    loss = totals["xent_sum"] / n
    results = {
        "eval/loss": loss,
        "eval/perplexity": math.exp(min(loss, 50.0)),
        "eval/accuracy": totals["correct"] / n,
        "eval/num_tokens": totals["num_tokens"],
    }
    if "word_perplexity" in exp.task.metrics:
        stats = heldout_statistics(exp)
        results["eval/word_perplexity"] = math.exp(min(totals["xent_sum"] / stats["words"], 50.0))
        results["eval/num_words"] = stats["words"]
        results["eval/unigram_perplexity"] = stats["unigram_perplexity"]
    if "bleu" in exp.task.metrics:
        results.update(bleu(exp, params))
    writer.write(step, results)
    return results


def bleu(exp: Experiment, params) -> dict:
    """BLEU of the model's translations of (the first decoding.num_examples of) the eval split."""
    limit = exp.translator.config.num_examples or None
    examples = list(exp.source.examples(exp.eval_split, limit))
    features = exp.task.features
    inputs = [e[features["inputs"]] for e in examples]
    references = [e[features["targets"]] for e in examples]
    t0 = time.time()
    hypotheses = exp.translator(params, inputs)
    scores = corpus_bleu(hypotheses, references)
    log.info("translated %d %s examples in %.0f s (beam %d, alpha %.1f); e.g. %r -> %r "
             "(reference %r); BLEU signature %s", len(inputs), exp.eval_split, time.time() - t0,
             exp.translator.config.beam_size, exp.translator.config.alpha, inputs[0],
             hypotheses[0], references[0], scores["signature"])
    return {"eval/bleu": scores["bleu"], "eval/bleu_intl": scores["bleu_intl"],
            "eval/bleu_examples": len(inputs)}


_HELDOUT_CACHE: dict = {}


def heldout_statistics(exp: Experiment, max_texts: int = 200_000) -> dict:
    """Counts over the held-out split of a language-modelling task, computed once per run.

    - ``words``: the words whose tokens the evaluation scores: the whitespace-separated words
      of each example plus one for the end of sentence, as LM1B's own evaluation counts
      ``</S>``; of an example trimmed to the sequence length, the words of its kept tokens. Word-level
      perplexity is exp(total token log-loss / words), the number T2T and the Mesh-TF paper
      report for lm1b.
    - ``unigram_perplexity``: perplexity of the held-out tokens under the (add-one) unigram
      model of at most `max_texts` training texts: the baseline a language model must beat.
    """
    vocab = exp.vocab
    key = (exp.source.description(), exp.eval_split, vocab.model_proto, exp.sequence_length)
    if key not in _HELDOUT_CACHE:
        def kept(text):
            return (vocab.encode(text) + [vocab.eos_id])[: exp.sequence_length]

        counts = np.ones(vocab.vocab_size)
        for text in exp.source.texts("train", limit=max_texts):
            np.add.at(counts, kept(text), 1)
        log_p = np.log(counts / counts.sum())
        log_loss, tokens, words = 0.0, 0, 0
        for text in exp.source.texts(exp.eval_split):
            ids = kept(text)
            log_loss -= log_p[ids].sum()
            tokens += len(ids)
            if ids[-1] == vocab.eos_id:  # kept whole
                words += len(text.split()) + 1
            else:  # trimmed: the words (the last one perhaps in part) of the kept tokens
                words += len(vocab.decode(ids).split())
        _HELDOUT_CACHE[key] = {"words": max(words, 1),
                               "unigram_perplexity": math.exp(log_loss / max(tokens, 1))}
    return _HELDOUT_CACHE[key]


def evaluate_checkpoint(exp: Experiment) -> dict:
    """``--mode=eval``: evaluates the latest checkpoint in the model dir."""
    state, step = _restore_from(exp, os.path.join(exp.model_dir, "checkpoints"))
    writer = MetricsWriter(exp.model_dir)
    results = evaluate(exp, state.params, step, writer)
    writer.close()
    return results


def infer(exp: Experiment, input_file: str | None, output_file: str | None) -> int:
    """``--mode=infer``: translates the lines of `input_file` (or stdin) with the latest
    checkpoint, one line out per line in, to `output_file` (or stdout)."""
    if input_file in (None, "-"):
        lines = sys.stdin.read().splitlines()
    else:
        try:
            with open(input_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ConfigError(f"cannot read --input_file {input_file}: {e.strerror}") from None
    state, step = _restore_from(exp, os.path.join(exp.model_dir, "checkpoints"))
    translations = exp.translator(state.params, lines) if lines else []
    text = "".join(t + "\n" for t in translations)
    if output_file in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(output_file, "w", encoding="utf-8") as f:
            f.write(text)
    log.info("translated %d lines with the checkpoint of step %d", len(lines), step)
    return len(lines)


def model_dir_is_bound() -> bool:
    try:
        gin.query_parameter("run.model_dir")
        return True
    except ValueError:
        return False
