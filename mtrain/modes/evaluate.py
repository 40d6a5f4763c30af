"""``--mode=eval``: the loss, perplexities (and BLEU) of the model dir's newest checkpoint
that can be read, on the run's eval split."""

from __future__ import annotations

import logging

from mtrain.evaluation.heldout import evaluate
from mtrain.training.start import restore_for_reading
from mtrain.io.metrics import MetricsWriter
from mtrain.io.model_dir import ModelDir
from mtrain.modes.experiment import Experiment

log = logging.getLogger("mtrain")


def evaluate_checkpoint(exp: Experiment, output_dir: str | None = None) -> dict:
    """Evaluates the newest readable checkpoint; the metrics (and decodes) go to
    `output_dir`, else to the model dir if it can be written (`ModelDir.outputs`)."""
    model_dir = ModelDir(exp.model_dir)
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.checkpoint_meta())
    log.info("evaluating the checkpoint of step %d", step)
    writer = MetricsWriter(model_dir.outputs(output_dir, "the metrics, events and decodes "
                                             "of this evaluation are"))
    results = evaluate(exp, state.params, step, writer)
    writer.close()
    return results
