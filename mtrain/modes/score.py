"""``--mode=score``: the log-likelihood of each line of a file under a trained checkpoint.

Language models score each line as text; translation models score lines
``source<TAB>target`` (the target given the source). A line is tokenised as training and
evaluation see an example (`Vocabulary.encode_example`: EOS appended, cut to
run.sequence_length, with a warning that counts the lines cut) and scored in its own row of
a batch of run.batch_size rows, sharded by the run's mesh. Its words are counted as
evaluation counts them (whitespace-separated words plus one for the end of sentence; of a
cut line, the words of its kept tokens), so that scoring the held-out split's text gives
`--mode=eval`'s perplexities.

The output (``--output_file``, default stdout) has one JSON object per input line, in
order: ``{"line": n, "log_likelihood": natural-log sum over its tokens, "tokens": n,
"words": n, "unknown_pieces": n, "cut": bool}``. The summary (token and word perplexity,
counts, unknown pieces) goes to the log and to ``metrics.jsonl`` under ``score/``, at the
checkpoint's step.

Scoring reads the model dir's vocabulary (`run.build`) and no training data: nothing is
prepared, and the run's data source need not exist.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np

from mtrain.io.checkpoints import restore_for_reading
from mtrain.errors import ConfigError
from mtrain.evaluation.heldout import scored_words
from mtrain.modes.experiment import Experiment
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import read_lines, write_atomically


def _example(exp: Experiment, line: str, number: int) -> dict:
    """A line's features (ids per packed feature) and what is counted of it."""
    vocab, length = exp.vocab, exp.sequence_length
    if exp.task.kind == "translation":
        if line.count("\t") != 1:
            raise ConfigError(f"--input_file line {number}: a translation task scores lines "
                              f"'source<TAB>target', this one has {line.count(chr(9))} tabs")
        source, text = line.split("\t")
        inputs, _ = vocab.encode_example(source, length)
    else:
        text, inputs = line, None
    ids, cut = vocab.encode_example(text, length)
    return {"inputs": inputs, "targets": ids, "cut": cut,
            "words": scored_words(vocab, text, ids, cut),
            "unknown_pieces": int(sum(i == vocab.unk_id for i in ids))}


def _batch(exp: Experiment, examples: list[dict]) -> dict[str, np.ndarray]:
    """One example per row, padded to [batch_size, sequence_length]; the rows beyond the
    examples are padding."""
    shape = (exp.batch_size, exp.sequence_length)
    batch = {}
    for feature in exp.trainer.model.features:
        ids, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        for row, e in enumerate(examples):
            ids[row, :len(e[feature])], segments[row, :len(e[feature])] = e[feature], 1
        batch[feature], batch[f"{feature}_segment_ids"] = ids, segments
        batch[f"{feature}_positions"] = (np.arange(shape[1]) * segments).astype(np.int32)
    return batch


def score(exp: Experiment, input_file: str | None, output_file: str | None,
          output_dir: str | None = None) -> dict:
    """Scores every line of `input_file` with the latest checkpoint (see the module doc);
    returns the summary, which goes to the metrics of `output_dir`, else of the model dir
    if it can be written. No lines: nothing to write, an empty output."""
    lines = read_lines(input_file)
    examples = [_example(exp, line, n + 1) for n, line in enumerate(lines)]
    model_dir = ModelDir(exp.model_dir)
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(exp.vocab))  # (no data: exp.source None)
    trainer = exp.trainer
    start, stop = trainer.local_rows()
    scores = []
    for first in range(0, len(examples), exp.batch_size):
        chunk = examples[first:first + exp.batch_size]
        batch = {k: v[start:stop] for k, v in _batch(exp, chunk).items()}
        per_token = np.asarray(jax.device_get(
            trainer.token_log_likelihoods(state.params, trainer.place_batch(batch))))
        scores += [float(per_token[row].sum(dtype=np.float64)) for row in range(len(chunk))]
    cut = sum(e["cut"] for e in examples)
    if cut:
        log.warning("%d of %d lines were longer than %d tokens (run.sequence_length) and were "
                    "scored on their first %d", cut, len(lines), exp.sequence_length,
                    exp.sequence_length)
    rows = [{"line": n + 1, "log_likelihood": s, "tokens": len(e["targets"]),
             "words": e["words"], "unknown_pieces": e["unknown_pieces"], "cut": e["cut"]}
            for n, (s, e) in enumerate(zip(scores, examples))]
    total = -sum(scores)
    tokens, words = sum(r["tokens"] for r in rows), sum(r["words"] for r in rows)
    summary = {"score/token_perplexity": math.exp(min(total / max(tokens, 1), 50.0)),
               "score/word_perplexity": math.exp(min(total / max(words, 1), 50.0)),
               "score/log_likelihood": -total, "score/tokens": tokens, "score/words": words,
               "score/unknown_pieces": sum(r["unknown_pieces"] for r in rows),
               "score/lines": len(rows), "score/cut_lines": cut}
    if jax.process_index() == 0:
        write_atomically(output_file, "".join(json.dumps(r) + "\n" for r in rows))
    log.info("scored %d lines with the checkpoint of step %d", len(rows), step)
    if rows:
        writer = MetricsWriter(model_dir.outputs(output_dir, "the scores' summary is"))
        writer.write(step, summary)
        writer.close()
    return summary
