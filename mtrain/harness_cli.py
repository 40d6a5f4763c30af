"""lm-evaluation-harness's own command line and API with mtrain's model: the model
registered with lm-eval as ``mtrain``, made from lm-eval's model_args (`ModelArgsLM`:
a model dir's newest checkpoint, built as ``python -m mtrain`` builds a run), and
``mtrain-lm-eval`` (`cli`), which hands every flag to lm-eval.

    mtrain-lm-eval --model mtrain --model_args model_dir=runs/x,mesh_shape=batch:8 \
        --tasks hellaswag --batch_size 16
    import mtrain.harness_cli; lm_eval.simple_evaluate(model="mtrain",
                                                       model_args="model_dir=runs/x", ...)

lm-eval 0.4 finds no model of another package by itself (`--model mtrain` is "Unknown
model" to its own ``lm_eval`` command), hence this entry point. It is part of the edge: it
reads a gin config and builds a run (`mtrain.run`).
"""

from __future__ import annotations

import os

from lm_eval.api.registry import MODEL_REGISTRY, register_model

from mtrain import run as run_lib
from mtrain.errors import UserError
from mtrain.evaluation.harness import NAME, MtrainLM
from mtrain.io.model_dir import ModelDir
from mtrain.io.reading import require_checkpoints
from mtrain.modes.lm_eval import harness_model
from mtrain.training.start import restore_for_reading


class ModelArgsLM(MtrainLM):
    """mtrain's lm-eval model made from lm-eval's model_args (`load`)."""

    def __init__(self, **model_args):
        super().__init__(model=load(**model_args))


def load(model_dir: str | None = None, gin_file: str | None = None, gin_param: str = "",
         mesh_shape: str | None = None, layout_rules: str | None = None,
         batch_size: int | str | None = None, max_length: int | None = None,
         seed: int | None = None, cpu_devices: int | None = None, max_batch_size=None,
         device=None, pretrained: str | None = None, **unknown):
    """A `harness.Model` from lm-eval's model_args: the newest checkpoint of `model_dir`
    with its config.gin (or `gin_file`) and `gin_param` bindings (``;``-separated, as
    lm-eval splits model_args at commas), in `mesh_shape` and `layout_rules` (default: the
    run's); `batch_size` requests a batch (lm-eval's ``--batch_size``; 'auto': the run's),
    `max_length` positions; `cpu_devices` simulated devices (before jax starts).
    `pretrained` (the hf backend's name, which lm-eval names its output folder after) is
    `model_dir` too. lm-eval's `device` and `max_batch_size` are Hugging Face's: jax places
    the model itself."""
    if unknown:
        raise UserError(f"mtrain's lm-eval model takes no {', '.join(sorted(unknown))}; its "
                        f"model_args: model_dir (or pretrained), gin_file, gin_param, mesh_shape, "
                        f"layout_rules, max_length, seed, cpu_devices")
    if model_dir and pretrained and model_dir != pretrained:
        raise UserError(f"model_dir={model_dir} and pretrained={pretrained} name two model dirs")
    model_dir = model_dir or pretrained
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
    model_dir=runs/x --tasks ...``. A user error, or a dataset the Hub could not give, is one
    line on stderr and exit 2; lm-eval's INFO lines show with LMEVAL_LOG_LEVEL=INFO."""
    import re
    import sys

    os.environ.setdefault("LMEVAL_LOG_LEVEL", "WARNING")  # (its INFO lines: LMEVAL_LOG_LEVEL=INFO)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # (no fork of jax's threads: `modes.lm_eval`)
    devices = re.search(r"(?:^|,)cpu_devices=(\d+)", " ".join(sys.argv))
    if devices:  # (before anything starts jax)
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(int(devices.group(1)))
    from lm_eval.__main__ import cli_evaluate

    from mtrain.io.metrics import setup_logging

    setup_logging()
    try:
        cli_evaluate()
    except (UserError, OSError) as e:  # OSError: a dataset the Hub could not give, a disk
        print(f"mtrain-lm-eval: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def register() -> None:
    """``mtrain`` in lm-eval's registry (after its built-in models: `harness` imports
    ``lm_eval.models`` first, since `get_model` imports them only while the registry is
    empty)."""
    if NAME not in MODEL_REGISTRY:
        register_model(NAME)(ModelArgsLM)


register()
