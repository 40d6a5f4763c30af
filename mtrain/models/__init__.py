"""Flax modules: layers, the decoder-only LM and the encoder-decoder."""
