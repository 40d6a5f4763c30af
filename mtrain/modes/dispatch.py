"""The modes as a table: for each ``--mode``, what must hold before anything is built (the
model dir free, a new directory, a checkpoint to read, an output file that can be written)
and what it does with the built experiment. `run.run` checks and calls through it; a new
mode is a row here and a module beside this one."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mtrain.errors import ConfigError
from mtrain.io.lock import check_model_dir_free
from mtrain.io.model_dir import ModelDir
from mtrain.io.reading import require_checkpoints
from mtrain.modes import convert
from mtrain.modes.evaluate import evaluate_checkpoint
from mtrain.modes.experiment import Experiment
from mtrain.modes.infer import check_output_file, infer
from mtrain.modes.lm_eval import lm_eval_mode
from mtrain.modes.plan import plan
from mtrain.modes.score import score
from mtrain.modes.train import train


@dataclasses.dataclass(frozen=True)
class Request:
    """What the command line asks of a mode besides the run's settings: the files it reads
    and writes, the planner's and the export's options, the import's folder, --restart."""

    input_file: str | None = None
    output_file: str | None = None
    output_dir: str | None = None
    plan_options: dict = dataclasses.field(default_factory=dict)
    restart: bool = False
    imported: tuple | None = None  # (input dir, its settings, its vocabulary, adapter dir)
    export_options: dict = dataclasses.field(default_factory=dict)
    model_size: int = 0  # an export's vocabulary rows (vocabulary.model_size)
    lm_eval_tasks: object = None  # --mode=lm_eval's `modes.lm_eval.Tasks`


@dataclasses.dataclass(frozen=True)
class Mode:
    """One ``--mode``: `act` on the built experiment, after the checks it needs."""

    act: Callable[[Experiment, Request], Any]
    needs_model_dir: bool = False  # no default model dir (import, export)
    writes_model_dir: bool = False  # takes the model dir's lock (train)
    # The directory it creates, and what to call it: (path, description).
    new_dir: Callable[[Request, str | None], tuple[str | None, str]] | None = None
    reads_checkpoint: bool = False  # the model dir must hold one
    writes_output_file: bool = False  # --output_file (infer, score)


def _import(exp: Experiment, request: Request):
    input_dir, hf_settings, vocab, adapter_dir = request.imported
    return convert.import_model(exp, input_dir, hf_settings, vocab, adapter_dir)


MODES: dict[str, Mode] = {
    "train": Mode(lambda exp, r: train(exp, restart=r.restart), writes_model_dir=True),
    "eval": Mode(lambda exp, r: evaluate_checkpoint(exp, r.output_dir), reads_checkpoint=True),
    "infer": Mode(lambda exp, r: infer(exp, r.input_file, r.output_file),
                  reads_checkpoint=True, writes_output_file=True),
    "score": Mode(lambda exp, r: score(exp, r.input_file, r.output_file, r.output_dir),
                  reads_checkpoint=True, writes_output_file=True),
    "plan": Mode(lambda exp, r: plan(exp, **r.plan_options)),
    "import": Mode(_import, needs_model_dir=True,
                   new_dir=lambda r, model_dir: (model_dir, "the model dir")),
    "export": Mode(lambda exp, r: convert.export_model(exp, r.output_dir,
                                                       model_size=r.model_size,
                                                       **r.export_options),
                   needs_model_dir=True, reads_checkpoint=True,
                   new_dir=lambda r, model_dir: (r.output_dir, "--output_dir")),
    "lm_eval": Mode(lambda exp, r: lm_eval_mode(exp, r.lm_eval_tasks, r.output_dir),
                    reads_checkpoint=True),
}


def check(name: str, model_dir: str | None, request: Request) -> None:
    """What can fail at once for mode `name`, before data and compilation: another run in
    the model dir, a directory that must be new, no checkpoint to read, an output file that
    could not be written (the model dir's reachability is the caller's)."""
    if name not in MODES:
        raise ConfigError(f"unknown mode {name!r}; use one of {', '.join(MODES)}")
    mode = MODES[name]
    if mode.writes_model_dir and model_dir:
        check_model_dir_free(model_dir)
    if mode.needs_model_dir and not model_dir:
        raise ConfigError(f"--mode={name} needs a --model_dir")
    if mode.new_dir:
        convert.check_new_dir(*mode.new_dir(request, model_dir))
    if mode.reads_checkpoint and model_dir:
        require_checkpoints(ModelDir(model_dir).checkpoints, "train first (--mode=train)")
    if mode.writes_output_file:
        check_output_file(request.output_file, request.input_file)
