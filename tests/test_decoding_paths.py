"""Decoding on every attention path: a translation's greedy and beam search give the einsum
path's tokens with 'dot_product', splash and Triton (interpreted), scanned and unrolled, on
one device and on an 8-device layout.

A decoding step's attention (one query) runs the einsum path whatever the setting
(`attention`'s module doc); the encoder runs the configured path over its inputs. So the
decoded tokens can differ from einsum's only through the encoder's outputs, which the
kernels compute in float32 to ~1e-6 of the reference (test_flash_attention): a token
changes only where two candidates' scores are that close, which these runs do not meet
(the tokens are compared exactly)."""

import dataclasses

import jax
import pytest

from mtrain.training import optimizer
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import EncoderDecoder
from mtrain.training.trainer import Trainer
from mtrain.evaluation.translation import DecodingConfig, Translator

from accelerators import triton_interpreted
from test_encoder_decoder import CONFIG, L, SENTENCES, joint_vocab  # noqa: F401 (a fixture)

PATHS = {  # name -> (transformer settings, whether the GPU is emulated for it)
    "dot_product": ({"attention": "dot_product"}, False),
    "splash": ({"attention": "flash", "flash_kernel": "splash"}, False),
    "triton": ({"attention": "flash", "flash_kernel": "triton"}, True),
}
LAYOUTS = {False: ("", ""), True: ("batch:2;model:4", "batch:batch;d_ff:model;heads:model")}


def decode(vocab, settings, scanned, beam_sizes=(1, 3)):
    """beam size -> the translations of SENTENCES (a padded second batch too) with
    `settings`; the same parameters for every setting of one structure (seed 5), initialized
    once for every beam size."""
    config = dataclasses.replace(CONFIG, vocab_size=384, dropout_rate=0.0, scan_layers=scanned,
                                 **settings)
    layout = Layout(*LAYOUTS[scanned])
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    trainer = Trainer(model=EncoderDecoder(config), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=4, sequence_length=L, seed=5)
    params = trainer.init_state().params
    translators = {beam: Translator(trainer, vocab, DecodingConfig(beam_size=beam,
                                                                   max_decode_length=10))
                   for beam in beam_sizes}
    return {beam: translate(params, SENTENCES) for beam, translate in translators.items()}


# Greedy unrolled on one device, the beam scanned on the mesh: every path with each search
# and each structure once (a path differs only in the encoder's outputs, which both
# searches read alike; the other two combinations compiled the same searches again. The
# beam on a mesh, unrolled, on every path: test_accelerator_modes' translation).
@pytest.mark.parametrize("scanned, beam", [(False, 1), (True, 3)],
                         ids=["unrolled, one device", "scanned, batch:2;model:4"])
@pytest.mark.slow
def test_every_attention_path_decodes_the_einsum_path_tokens(joint_vocab, monkeypatch, scanned,
                                                             beam):
    expected = decode(joint_vocab, {"attention": "einsum"}, scanned, (beam,))
    assert any(expected[beam])
    for name, (settings, on_gpu) in PATHS.items():
        with monkeypatch.context() as m:
            if on_gpu:
                calls = triton_interpreted(m)
            got = decode(joint_vocab, settings, scanned, (beam,))
            assert got[beam] == expected[beam], (name, beam)
            if on_gpu:
                assert calls and set(calls) == {"triton"}, calls  # the encoder's
