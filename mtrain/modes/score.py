"""``--mode=score``: the log-likelihood of each line of a file under a trained checkpoint.

Language models score each line as text; translation models score lines
``source<TAB>target`` (the target given the source). A line is tokenised as training and
evaluation see an example (EOS appended; a text longer than run.sequence_length scored in
pieces, as evaluation cuts it, with a warning that counts such lines) and scored in rows of
a batch of run.batch_size rows, sharded by the run's mesh. Its words are counted as
evaluation counts them (whitespace-separated words plus one for the end of sentence), so
that scoring the held-out split's text gives `--mode=eval`'s perplexities. A ``.jsonl``
file holds ``{"text"}`` or ``{"prompt", "completion"}`` objects (`_example`).

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
import os

import jax
import numpy as np

from mtrain.training.start import restore_for_reading
from mtrain.errors import ConfigError
from mtrain.evaluation.heldout import scored_words
from mtrain.models.base import LOSS_WEIGHTS
from mtrain.modes.experiment import Experiment
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import read_lines, write_atomically


def _example(exp: Experiment, line: str, number: int, jsonl: bool) -> dict:
    """A line's rows (ids per packed feature, loss weights) and what is counted of it. A
    language model's text longer than the sequence is scored in pieces, each read as
    evaluation reads it (`data.formats.pieces`); a JSONL line is a ``text``, or a
    ``prompt`` and ``completion`` (the completion's log-likelihood given the prompt, as
    lm-evaluation-harness's `loglikelihood`: no EOS; a prompt too long loses its start)."""
    vocab, length = exp.vocab, exp.sequence_length
    lm = exp.task.kind != "translation"
    record = (_record(line, number) if jsonl else {"text": line}) if lm else None
    if not lm:
        if line.count("\t") != 1:
            raise ConfigError(f"--input_file line {number}: a translation task scores lines "
                              f"'source<TAB>target', this one has {line.count(chr(9))} tabs")
        source, text = line.split("\t")
        inputs, _ = vocab.encode_example(source, length)
        ids, cut = vocab.encode_example(text, length)
        rows = [{"inputs": inputs, "targets": ids}]
    elif "prompt" in record:
        text = record["completion"]
        prompt, completion = vocab.encode(record["prompt"]), vocab.encode(text)
        both = (prompt + completion)[-length:]
        cut = len(both) < len(prompt) + len(completion)
        ids = completion[-length:]  # what is scored of the completion
        rows = [{"targets": both, "weights": [0] * (len(both) - len(ids)) + [1] * len(ids)}]
    else:
        text = record["text"]
        ids = vocab.encode(text) + [vocab.eos_id]
        cut = len(ids) > length
        rows = [{"targets": ids[i:i + length]} for i in range(0, len(ids), length)]
    return {"rows": rows, "tokens": len(ids), "cut": cut,
            "words": scored_words(vocab, text, ids, cut and not lm),
            "unknown_pieces": int(sum(i == vocab.unk_id for i in ids))}


def _record(line: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not (
            isinstance(record.get("text"), str) or (isinstance(record.get("prompt"), str)
                                                    and isinstance(record.get("completion"), str))):
        raise ConfigError(f"--input_file line {number}: a .jsonl file scores JSON objects with "
                          f"a 'text', or a 'prompt' and a 'completion' (strings)")
    return record


def _batch(exp: Experiment, rows: list[dict]) -> dict[str, np.ndarray]:
    """One row each, padded to [batch_size, sequence_length]; the rows beyond are padding."""
    shape = (exp.batch_size, exp.sequence_length)
    batch = {}
    for feature in exp.trainer.model.features:
        ids, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        for row, e in enumerate(rows):
            ids[row, :len(e[feature])], segments[row, :len(e[feature])] = e[feature], 1
        batch[feature], batch[f"{feature}_segment_ids"] = ids, segments
        batch[f"{feature}_positions"] = (np.arange(shape[1]) * segments).astype(np.int32)
    if any("weights" in r for r in rows):
        weights = np.zeros(shape, np.int32)
        for row, e in enumerate(rows):
            weights[row, :len(e["targets"])] = e.get("weights", 1)
        batch[LOSS_WEIGHTS] = weights
    return batch


def score(exp: Experiment, input_file: str | None, output_file: str | None,
          output_dir: str | None = None) -> dict:
    """Scores every line of `input_file` with the latest checkpoint (see the module doc);
    returns the summary, which goes to the metrics of `output_dir`, else of the model dir
    if it can be written. No lines: nothing to write, an empty output."""
    lines = read_lines(input_file)
    jsonl = bool(input_file) and ".jsonl" in os.path.basename(input_file)
    examples = [_example(exp, line, n + 1, jsonl) for n, line in enumerate(lines)]
    pieces = [(i, row) for i, e in enumerate(examples) for row in e["rows"]]
    model_dir = ModelDir(exp.model_dir)
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(exp.vocab))  # (no data: exp.source None)
    trainer = exp.trainer
    start, stop = trainer.local_rows()
    scores = [0.0] * len(examples)
    weighted = any("weights" in row for _, row in pieces)
    for first in range(0, len(pieces), exp.batch_size):
        chunk = pieces[first:first + exp.batch_size]
        rows = [row if not weighted else {"weights": 1, **row} for _, row in chunk]
        batch = {k: v[start:stop] for k, v in _batch(exp, rows).items()}
        per_token = np.asarray(jax.device_get(
            trainer.token_log_likelihoods(state.params, trainer.place_batch(batch))))
        for row, (i, _) in enumerate(chunk):
            scores[i] += float(per_token[row].sum(dtype=np.float64))
    cut = sum(e["cut"] for e in examples)
    if cut:
        log.warning("%d of %d lines were longer than %d tokens (run.sequence_length): scored "
                    "in pieces of %d (a translation: its first %d; a prompt: its end)", cut,
                    len(lines), exp.sequence_length, exp.sequence_length, exp.sequence_length)
    rows = [{"line": n + 1, "log_likelihood": s, "tokens": e["tokens"],
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
