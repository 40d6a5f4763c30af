"""``--mode=lm_eval``: lm-evaluation-harness's tasks on the model dir's newest checkpoint
(`evaluation.harness`), and from a training run (``run.lm_eval_tasks``: `during_training`).

    python -m mtrain --gin_file=runs/x/config.gin --model_dir=runs/x --mode=lm_eval \\
        --tasks=hellaswag,arc_easy [--include_path=DIR] [--limit=N] [--num_fewshot=K] \\
        [--apply_chat_template]

The task metrics go to the log, to ``metrics.jsonl`` and TensorBoard as
``lm_eval/<task>/<metric>`` at the checkpoint's step, and lm-eval's results (its config,
versions, n-samples: what it writes with ``--output_path``) to ``lm_eval_results.json``, in
``--output_dir`` else the model dir. Batches hold ``decoding.batch_size`` requests (0: the
run's batch size); rows ``transformer.max_length`` positions. lm-eval's own command line
and its model_args are the edge's (`mtrain.harness_cli`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from mtrain.errors import ConfigError
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import ModelDir, lm_eval_file
from mtrain.io.textfiles import write_atomically



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
    task's), whether prompts go through the chat template, and how many requests a batch
    holds (0: the run's batch size; ``--mode=lm_eval``: decoding.batch_size)."""

    names: tuple[str, ...]
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    batch_size: int = 0
    log_samples: bool = False

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

    # lm-eval bootstraps a perplexity's stderr in a pool of forked processes, which a
    # process running jax's threads must not fork: in this process instead.
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    try:
        return lm_eval.simple_evaluate(
            model=MtrainLM(model=model), tasks=list(tasks.names),
            task_manager=task_manager(tasks.include_path, tasks.names),
            limit=tasks.limit, num_fewshot=tasks.num_fewshot,
            apply_chat_template=tasks.apply_chat_template, log_samples=tasks.log_samples)
    except (FileNotFoundError, ValueError) as e:  # a task's data files, a bad template
        raise ConfigError(f"lm-eval could not run {', '.join(tasks.names)}: "
                          f"{' '.join(str(e).split())}") from None


def harness_model(exp, params, *, max_length: int | None = None, rows: int = 0,
                  template=None):
    """The `harness.Model` of a built experiment and its parameters: the model dir's chat
    template, batches of `rows` requests (0: the run's batch size), rows of `max_length`
    positions (default transformer.max_length, the most); `template` if read already."""
    from mtrain.data.user_data import model_dir_template
    from mtrain.evaluation.harness import Model

    longest = exp.model_config.max_length
    if max_length is not None and not 1 < max_length <= longest:
        raise ConfigError(f"max_length={max_length} must be in 2..{longest} "
                          f"(transformer.max_length)")
    return Model(trainer=exp.trainer, params=params, vocab=exp.vocab,
                 template=template or (model_dir_template(exp.model_dir, exp.vocab)
                                       if exp.model_dir else None),
                 rows=rows or exp.batch_size,
                 max_length=max_length or longest, seed=exp.config.seed)


def lm_eval_mode(exp, tasks: Tasks, output_dir: str | None = None) -> dict:
    """``--mode=lm_eval`` (module doc): returns the flat ``lm_eval/...`` metrics."""
    from mtrain.evaluation.harness import dumps, flat_metrics
    from mtrain.training.start import restore_for_reading

    model_dir = ModelDir(exp.model_dir)
    from mtrain.data.user_data import model_dir_template

    template = model_dir_template(exp.model_dir, exp.vocab)
    if tasks.apply_chat_template and template is None:
        raise ConfigError(f"--apply_chat_template: {exp.model_dir} has no chat template (an "
                          f"import keeps its folder's)")
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(exp.vocab))
    log.info("lm-eval: %s with the checkpoint of step %d", ", ".join(tasks.names), step)
    out = evaluate(harness_model(exp, state.params, rows=tasks.batch_size, template=template),
                   tasks)
    metrics = flat_metrics(out["results"])
    directory = model_dir.outputs(output_dir, "lm-eval's results are")
    writer = MetricsWriter(directory)
    writer.write(step, metrics)
    writer.close()
    if directory and writer.enabled:
        write_atomically(lm_eval_file(directory), dumps(
            {k: v for k, v in out.items() if k != "samples"}))
        for task, samples in out.get("samples", {}).items():  # (--log_samples)
            write_atomically(lm_eval_file(directory, task), "".join(
                dumps(s, indent=None) + "\n" for s in samples))
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
