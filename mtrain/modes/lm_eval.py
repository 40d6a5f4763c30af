"""``--mode=lm_eval``: lm-evaluation-harness's tasks on the model dir's newest checkpoint
(`evaluation.harness`), and the same from lm-eval's own command line (`cli`, installed as
``mtrain-lm-eval``) and from a training run (``run.lm_eval_tasks``: `during_training`).

    python -m mtrain --gin_file=runs/x/config.gin --model_dir=runs/x --mode=lm_eval \\
        --tasks=hellaswag,arc_easy [--include_path=DIR] [--limit=N] [--num_fewshot=K] \\
        [--apply_chat_template]

The task metrics go to the log, to ``metrics.jsonl`` and TensorBoard as
``lm_eval/<task>/<metric>`` at the checkpoint's step, and lm-eval's results (its config,
versions, n-samples: what it writes with ``--output_path``) to ``lm_eval_results.json``, in
``--output_dir`` else the model dir. Batches hold ``decoding.batch_size`` requests (0: the
run's batch size); rows ``transformer.max_length`` positions.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from mtrain.errors import ConfigError, UserError
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import write_atomically

RESULTS_FILE = "lm_eval_results.json"


@functools.cache
def task_manager(include_path: str | None, names: tuple[str, ...] = ()):
    """lm-eval's index of the tasks of `include_path`, where `names` are all there, else of
    those and every task it ships (made once: reading all its YAMLs takes seconds)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in own.all_tasks for name in names):
            return own
    return TaskManager(include_path=include_path)


@dataclasses.dataclass(frozen=True)
class Tasks:
    """What to evaluate: lm-eval's task (or group) names, a folder of task YAMLs besides
    its own, at most `limit` documents a task (None: all), `num_fewshot` examples (None: the
    task's), and whether prompts go through the chat template."""

    names: tuple[str, ...]
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = False

    @classmethod
    def parse(cls, names: str | tuple | list, **options) -> "Tasks":
        """The tasks of `names` (comma-separated, or a sequence), checked: lm-eval installed,
        a name given, `include_path` a folder, `limit` and `num_fewshot` not negative."""
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError("lm-evaluation-harness is not installed: pip install -e "
                              "'.[eval]'") from None
        for name in ("limit", "num_fewshot"):
            value = options.get(name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"lm-eval's {name} must be a whole number, got {value!r}")
        if isinstance(names, str):
            names = names.split(",")
        names = tuple(n.strip() for n in names if n.strip())
        if not names:
            raise ConfigError("no lm-eval task named: give --tasks=task1,task2 "
                              "(run.lm_eval_tasks in training)")
        include = options.get("include_path")
        if include and not os.path.isdir(include):
            raise ConfigError(f"--include_path {include} is not a directory of task YAMLs")
        include = options["include_path"] = include and os.path.abspath(include)
        unknown = [n for n in names if n not in task_manager(include, names).all_tasks]
        if unknown:
            raise ConfigError(f"lm-eval knows no task {', '.join(map(repr, unknown))}"
                              + ("" if include else
                                 " (a task of your own: --include_path=DIR of its YAML)"))
        return cls(names, **options)


    @classmethod
    def of_run(cls, settings) -> "Tasks":
        """The tasks a training run evaluates as it goes (``run.lm_eval_*``: `RunConfig`)."""
        every = settings.lm_eval_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ConfigError(f"run.lm_eval_every must be a whole number of steps (0: at the "
                              f"end), got {every!r}")
        return cls.parse(settings.lm_eval_tasks, include_path=settings.lm_eval_include_path,
                         limit=settings.lm_eval_limit)


def evaluate(model, tasks: Tasks) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` with mtrain's model around `model` (a
    `harness.Model`): its whole output (``results``, ``configs``, ...)."""
    import lm_eval

    from mtrain.evaluation.harness import MtrainLM

    try:
        return lm_eval.simple_evaluate(
            model=MtrainLM(model=model), tasks=list(tasks.names),
            task_manager=task_manager(tasks.include_path, tasks.names),
            limit=tasks.limit, num_fewshot=tasks.num_fewshot,
            apply_chat_template=tasks.apply_chat_template, log_samples=False)
    except (FileNotFoundError, ValueError) as e:  # a task's data files, a bad template
        raise ConfigError(f"lm-eval could not run {', '.join(tasks.names)}: "
                          f"{' '.join(str(e).split())}") from None


def harness_model(exp, params, *, max_length: int | None = None, rows: int | None = None):
    """The `harness.Model` of a built experiment and its parameters: the model dir's chat
    template, batches of decoding.batch_size (else the run's batch size) requests, rows of
    transformer.max_length positions (`max_length` overrides both)."""
    from mtrain import config
    from mtrain.data.user_data import model_dir_template
    from mtrain.evaluation.harness import Model

    longest = exp.model_config.max_length
    if max_length is not None and not 1 < max_length <= longest:
        raise ConfigError(f"max_length={max_length} must be in 2..{longest} "
                          f"(transformer.max_length)")
    return Model(trainer=exp.trainer, params=params, vocab=exp.vocab,
                 template=model_dir_template(exp.model_dir, exp.vocab) if exp.model_dir else None,
                 rows=rows or config.decoding().batch_size or exp.batch_size,
                 max_length=max_length or longest, seed=exp.config.seed)


def lm_eval_mode(exp, tasks: Tasks, output_dir: str | None = None) -> dict:
    """``--mode=lm_eval`` (module doc): returns the flat ``lm_eval/...`` metrics."""
    from mtrain.evaluation.harness import dumps, flat_metrics
    from mtrain.training.start import restore_for_reading

    model_dir = ModelDir(exp.model_dir)
    from mtrain.data.user_data import model_dir_template

    if tasks.apply_chat_template and model_dir_template(exp.model_dir, exp.vocab) is None:
        raise ConfigError(f"--apply_chat_template: {exp.model_dir} has no chat template (an "
                          f"import keeps its folder's)")
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(exp.vocab))
    log.info("lm-eval: %s with the checkpoint of step %d", ", ".join(tasks.names), step)
    out = evaluate(harness_model(exp, state.params), tasks)
    metrics = flat_metrics(out["results"])
    directory = model_dir.outputs(output_dir, "lm-eval's results are")
    writer = MetricsWriter(directory)
    writer.write(step, metrics)
    writer.close()
    if directory and writer.enabled:
        write_atomically(os.path.join(directory, RESULTS_FILE), dumps(
            {k: v for k, v in out.items() if k != "samples"}))
    return metrics


def during_training(exp, tasks: Tasks, write):
    """``evaluate(params, step)`` for a training run's hook (``run.lm_eval_tasks`` every
    ``run.lm_eval_every`` steps): the tasks on the current parameters, their flat metrics
    given to `write(step, metrics)` and returned."""
    from mtrain.evaluation.harness import flat_metrics

    def run(params, step: int) -> dict:
        log.info("lm-eval at step %d: %s", step, ", ".join(tasks.names))
        metrics = flat_metrics(evaluate(harness_model(exp, params), tasks)["results"])
        write(step, metrics)
        return metrics

    return run


def load(model_dir: str | None = None, gin_file: str | None = None, gin_param: str = "",
         mesh_shape: str | None = None, layout_rules: str | None = None,
         batch_size: int | str | None = None, max_length: int | None = None,
         seed: int | None = None, cpu_devices: int | None = None, max_batch_size=None,
         device=None, **unknown):
    """A `harness.Model` from lm-eval's model_args: the newest checkpoint of `model_dir`
    with its config.gin (or `gin_file`) and `gin_param` bindings (``;``-separated, as
    lm-eval splits model_args at commas), in `mesh_shape` and `layout_rules` (default: the
    run's); `batch_size` requests a batch (lm-eval's ``--batch_size``; 'auto': the run's),
    `max_length` positions; `cpu_devices` simulated devices (before jax starts). lm-eval's
    `device` and `max_batch_size` are Hugging Face's: jax places the model itself."""
    from mtrain import run as run_lib

    if unknown:
        raise UserError(f"mtrain's lm-eval model takes no {', '.join(sorted(unknown))}; its "
                        f"model_args: model_dir, gin_file, gin_param, mesh_shape, "
                        f"layout_rules, max_length, seed, cpu_devices")
    if not model_dir:
        raise UserError("mtrain's lm-eval model needs model_args=model_dir=DIR (a trained or "
                        "imported model dir)")
    if cpu_devices:
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(int(cpu_devices))
    if not os.path.isdir(model_dir):
        raise UserError(f"model_dir {model_dir} is not a directory (a trained or imported "
                        f"model dir)")
    gin_file = gin_file or ModelDir(model_dir).config
    if not os.path.isfile(gin_file):
        raise UserError(f"{model_dir} has no {os.path.basename(gin_file)}: give gin_file=")
    run_lib.parse_config([gin_file], [p for p in str(gin_param).split(";") if p.strip()])
    overrides = {k: v for k, v in (("mesh_shape", mesh_shape), ("layout_rules", layout_rules),
                                   ("seed", seed)) if v is not None}
    exp = run_lib.build(mode="lm_eval", model_dir=model_dir, **overrides)
    from mtrain.io.reading import require_checkpoints
    from mtrain.training.start import restore_for_reading

    require_checkpoints(ModelDir(model_dir).checkpoints, "train or import first")
    state, _ = restore_for_reading(ModelDir(model_dir).checkpoints,
                                   exp.trainer.sharded_abstract_state(), exp.reader_meta(exp.vocab))
    rows = None if batch_size in (None, "auto") or str(batch_size).startswith("auto") \
        else int(batch_size)
    return harness_model(exp, state.params, max_length=max_length and int(max_length),
                         rows=rows)


def cli() -> None:
    """``mtrain-lm-eval``: lm-eval's own command line (every flag as lm-eval parses it)
    with mtrain's model registered: ``mtrain-lm-eval --model mtrain --model_args
    model_dir=runs/x --tasks ...``. A user error is one line on stderr and exit 2."""
    import re
    import sys

    os.environ.setdefault("LMEVAL_LOG_LEVEL", "WARNING")  # (its INFO lines: LMEVAL_LOG_LEVEL=INFO)
    devices = re.search(r"(?:^|,)cpu_devices=(\d+)", " ".join(sys.argv))
    if devices:  # (before anything starts jax)
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(int(devices.group(1)))
    from lm_eval.__main__ import cli_evaluate

    from mtrain.evaluation import harness  # noqa: F401  (registers "mtrain")
    from mtrain.io.metrics import setup_logging

    setup_logging()
    try:
        cli_evaluate()
    except UserError as e:
        print(f"mtrain-lm-eval: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
