"""Corpus BLEU with sacrebleu, the two ways translation papers report it.

- ``bleu``: sacrebleu's standard, detokenized and cased with the ``13a`` tokenizer; comes
  with sacrebleu's signature so the number can be reproduced
  (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...``).
- ``bleu_intl``: the ``intl`` tokenizer (Unicode punctuation and symbols split off), which
  gives the score of tensor2tensor's ``bleu_hook`` that Mesh-TF-era papers report.
"""

from __future__ import annotations

from collections.abc import Sequence

import sacrebleu


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """{"bleu", "bleu_intl", "signature", "signature_intl"} of one reference per hypothesis."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    scores = {}
    for key, tokenize in (("", "13a"), ("_intl", "intl")):
        metric = sacrebleu.metrics.BLEU(tokenize=tokenize)
        scores[f"bleu{key}"] = metric.corpus_score(list(hypotheses), [list(references)]).score
        scores[f"signature{key}"] = str(metric.get_signature())
    return scores
