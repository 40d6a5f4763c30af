"""Evaluation: held-out loss and perplexity, BLEU, decoding and translation."""
