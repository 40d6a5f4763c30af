"""BLEU: sacrebleu's 13a and intl scores, checked against sacrebleu's command line."""

import subprocess
import sys

import pytest

from mtrain.evaluation.bleu import corpus_bleu
from mtrain.data.bible import bible_split_verses

REFERENCES = [v.fr for v in bible_split_verses("test")[:40]]
# Hypotheses that share some but not all n-grams with the references.
HYPOTHESES = [" ".join(r.split()[: max(1, len(r.split()) * 2 // 3)]) + " donc." for r in REFERENCES]


def test_a_reference_against_itself_scores_100():
    scores = corpus_bleu(REFERENCES, REFERENCES)
    assert scores["bleu"] == pytest.approx(100.0) and scores["bleu_intl"] == pytest.approx(100.0)
    assert "tok:13a" in scores["signature"] and "tok:intl" in scores["signature_intl"]


def test_matches_sacrebleus_command_line(tmp_path):
    (tmp_path / "ref.txt").write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    (tmp_path / "hyp.txt").write_text("\n".join(HYPOTHESES) + "\n", encoding="utf-8")
    scores = corpus_bleu(HYPOTHESES, REFERENCES)
    assert 5 < scores["bleu"] < 95
    for key, tokenize in (("bleu", "13a"), ("bleu_intl", "intl")):
        out = subprocess.run(
            [sys.executable, "-m", "sacrebleu", str(tmp_path / "ref.txt"), "-i",
             str(tmp_path / "hyp.txt"), "-tok", tokenize, "-b", "-w", "4"],
            capture_output=True, text=True, check=True).stdout
        assert float(out) == pytest.approx(scores[key], abs=1e-4), key


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        corpus_bleu(["a", "b"], ["a"])
