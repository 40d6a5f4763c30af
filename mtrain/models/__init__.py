"""Flax modules: layers, the decoder-only LM and (later) the encoder-decoder."""
