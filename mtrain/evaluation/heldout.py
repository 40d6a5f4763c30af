"""Evaluation of a model's parameters on the run's held-out split: token loss, perplexity
and accuracy; word perplexity and the unigram baseline for language models; BLEU of beam
search translations for translation tasks."""

from __future__ import annotations

import functools
import itertools
import math
import time

import jax
import numpy as np
from etils import epath

from mtrain.evaluation.bleu import corpus_bleu
from mtrain.io.metrics import MetricsWriter, log
from mtrain.io.model_dir import decodes_file
from mtrain.io.textfiles import write_atomically


def evaluate(exp, params, step: int, writer: MetricsWriter) -> dict:
    """The objective's metrics over the whole held-out split (`Objective.eval_results`: of a
    language model token-level loss, perplexity and accuracy; of preference pairs DPO's loss
    and rewards); where it scores tokens, for language models the word-level perplexity and
    the unigram baseline, for translation BLEU."""
    objective = exp.trainer.objective
    totals = _sums(exp, params)
    results = objective.eval_results(totals)
    if objective.token_metrics and "word_perplexity" in exp.task.metrics:
        stats = heldout_statistics(exp)
        xent = totals.get("xent_sum", 0.0)
        results["eval/word_perplexity"] = math.exp(min(xent / stats["words"], 50.0))
        results["eval/num_words"] = stats["words"]
        results["eval/unigram_perplexity"] = stats["unigram_perplexity"]
    if objective.token_metrics and "bleu" in exp.task.metrics:
        results.update(bleu(exp, params, step, writer.directory))
    writer.write(step, results)
    return results


def _sums(exp, params) -> dict:
    """The eval step's sums over the held-out split."""
    totals = None

    def add(sums):  # in float64 on the host: token counts stay exact past 2**24
        sums = jax.device_get(sums)
        return {k: (totals or {}).get(k, 0.0) + float(sums[k]) for k in sums}

    # At most two batches in flight, as in training: the host prepares and places the next
    # batch while the devices evaluate the previous one, then fetches the previous sums.
    previous = None
    for batch in exp.eval_batches():
        sums = exp.trainer.eval_step(params, exp.trainer.place_batch(batch))
        if previous is not None:
            totals = add(previous)
        previous = sums
    if previous is not None:
        totals = add(previous)
    return totals or {}


def bleu(exp, params, step: int, directory: str | None) -> dict:
    """BLEU of the model's translations of the first decoding.num_examples (0: all) of the
    eval split in its stored order. Every decode is kept (where `directory` is given, that
    of the metrics): `<directory>/decodes/<split>-<step>.tsv` holds source, reference and
    hypothesis, one example per line in that order (tabs and line breaks inside a text
    become spaces), and sacrebleu on its last two columns gives the logged eval/bleu."""
    limit = exp.translator.config.num_examples or None
    size = exp.source.num_examples(exp.eval_split)
    examples = list(exp.source.examples(exp.eval_split, limit))
    log.info("BLEU on the first %d of the %d %s examples, in their stored order",
             len(examples), size, exp.eval_split)
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
    if jax.process_index() == 0 and directory is not None:
        path = decodes_file(directory, exp.eval_split, step)
        epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
        flat = lambda text: " ".join(text.replace("\t", " ").splitlines())  # noqa: E731
        write_atomically(path, "".join(f"{flat(s)}\t{flat(r)}\t{flat(h)}\n" for s, r, h in
                                       zip(inputs, references, hypotheses)))
        log.info("decodes: %s", path)
    return {"eval/bleu": scores["bleu"], "eval/bleu_intl": scores["bleu_intl"],
            "eval/bleu_examples": len(inputs)}


def scored_words(vocab, text: str, ids: list[int], cut: bool) -> int:
    """The words of `text` whose tokens `ids` (`Vocabulary.encode_example`) are scored: its
    whitespace-separated words plus one for the end of sentence, as LM1B's evaluation counts
    ``</S>``; of a text `cut` to the sequence length, the words (the last one perhaps in
    part) of its kept tokens."""
    return len(vocab.decode(ids).split()) if cut else len(text.split()) + 1


def heldout_statistics(exp, max_texts: int = 200_000) -> dict:
    """Counts over the held-out split of a language-modelling task, computed once per
    source, vocabulary and split (a run evaluates many times).

    - ``words``: the words whose tokens the evaluation scores (`scored_words`). Word-level
      perplexity is exp(total token log-loss / words), the number T2T and the Mesh-TF paper
      report for lm1b.
    - ``unigram_perplexity``: perplexity of the held-out tokens under the (add-one) unigram
      model of at most `max_texts` training texts: the baseline a language model must beat.
    """
    return _heldout(exp.source, exp.vocab, exp.eval_split, max_texts)


@functools.lru_cache(maxsize=4)
def _heldout(source, vocab, split: str, max_texts: int) -> dict:
    """(Evaluation cuts a text longer than the sequence into pieces and scores every token,
    `data.formats.pieces`: the counts do not depend on the sequence length.)"""
    train_ids = np.fromiter(itertools.chain.from_iterable(
        vocab.encode(text) + [vocab.eos_id]
        for text in source.texts("train", limit=max_texts)), np.int64)
    counts = 1.0 + np.bincount(train_ids, minlength=vocab.vocab_size)
    log_p = np.log(counts / counts.sum())
    log_loss, tokens, words = 0.0, 0, 0
    for text in source.texts(split):
        ids = vocab.encode(text) + [vocab.eos_id]
        log_loss -= log_p[ids].sum()
        tokens += len(ids)
        words += scored_words(vocab, text, ids, False)
    return {"words": max(words, 1), "unigram_perplexity": math.exp(log_loss / max(tokens, 1))}
