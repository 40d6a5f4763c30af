"""The blocks and the import against Hugging Face's own numbers (../shared/oracles): the tiny
Llama (RMSNorm, SwiGLU, RoPE, 2 of 4 key/value heads), T5.1.1 (gated GELU, relative
position bias) and Mixtral (4 SwiGLU experts, top-2) imported by ``--mode=import``
(`mtrain.huggingface`). The logits must match what `transformers` computed, teacher forced
and on the long inputs (rotary angles far from 0; distances past T5's last bucket), and
greedy decoding must give its tokens.

Tolerance: the README of the oracles: within about 1e-4 absolute in float32 (logits of
O(1); the reference itself moves by ~2e-6 between torch's attention implementations).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain import run as run_lib
from mtrain.__main__ import main
from mtrain.data.vocabulary import load_vocabulary
from mtrain.training.start import restore_for_reading
from mtrain.io.model_dir import ModelDir
from mtrain.models.blocks import layer_window
from mtrain.models.transformer import DecoderLM, EncoderDecoder

ORACLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                       "shared", "oracles")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
ATOL = 1e-4
# The decoder-only folders: Llama 2 and 3.2, Mistral with a window, Qwen2.5, Qwen3, Gemma 3,
# the experts of Mixtral and Qwen3-MoE, DeepSeek-V3 (latent attention, YaRN, shared and
# bias-balanced experts) and gpt-oss (sinks, biases, YaRN, the clamped SwiGLU).
DECODERS = ("llama_gqa", "mixtral", "llama3", "qwen2", "qwen3", "mistral_sw", "gemma3",
            "qwen3_moe", "deepseek_v3", "gpt_oss")


def oracle(family) -> dict:
    return dict(np.load(os.path.join(ORACLES, family, "oracle.npz")))


def import_folder(folder, model_dir, *flags) -> None:
    assert main(["--mode=import", f"--input_dir={folder}", f"--model_dir={model_dir}",
                 *flags]) == 0


def load(model_dir, *gin_params):
    """(experiment, parameters, vocabulary) of an imported model dir, laid out by its
    config.gin and `gin_params` (no data: the export mode's build)."""
    run_lib.parse_config([os.path.join(model_dir, "config.gin")], list(gin_params))
    exp = run_lib.build(mode="export", model_dir=str(model_dir))
    vocab = load_vocabulary(ModelDir(str(model_dir)).vocabulary)
    state, _ = restore_for_reading(ModelDir(str(model_dir)).checkpoints,
                                   exp.trainer.sharded_abstract_state(),
                                   exp.reader_meta(vocab))
    return exp, state.params, vocab


class Imports(dict):
    """family -> its model dir (``imports[family]``, or ``imports / family`` as a folder's),
    imported when a test first asks for it: a test process that runs some of a module's
    tests imports only their families."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, family):
        import_folder(os.path.join(ORACLES, family), self.root / family)
        self[family] = self.root / family
        return self[family]

    __truediv__ = dict.__getitem__


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return Imports(tmp_path_factory.mktemp("imported"))


def lm_logits(model, params, ids):
    """Logits of every position of `ids` as the model's inputs (no start token: the oracle's
    input_ids are what the model reads): the decoding path's call over the whole sequence."""
    logits, _ = model.apply(params, jnp.asarray(ids), None, None, decode=True, mutable=["cache"])
    return logits


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_only_logits_are_hugging_faces(imported, family):
    exp, params, _ = load(imported[family])
    model, expected = exp.trainer.model, oracle(family)
    # (jitted: one compile of the call, not each op dispatched alone)
    logits = jax.jit(lambda params, ids: lm_logits(model, {"params": params}, ids))
    np.testing.assert_allclose(logits(params, expected["input_ids"]),
                               expected["logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits(params, expected["long_input_ids"]),
                               expected["long_logits"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family,setting", [
    ("mixtral", "moe.grouped_kernel='megablox'"),
    *[pytest.param(f, s, marks=pytest.mark.slow) for f, s in (
        ("mixtral", "moe.grouped_kernel='ragged_dot'"),
        ("qwen3_moe", "moe.dispatch='capacity'"))]])
def test_imported_experts_are_dropless_on_every_kernel(imported, family, setting):
    """An import of experts dispatches dropless (the test above: its logits); Megablox's
    kernel (Pallas's interpreter) and XLA's ragged_dot give them too, and so does capacity
    dispatch with its slot for every token. (Each kernel and dispatch once, not for both
    families: the kernels compute whatever the family's routing chose; both families'
    routing is the test above's, by this CPU's default kernel.)"""
    assert "moe.dispatch = 'dropless'" in (imported[family] / "config.gin").read_text()
    expected = oracle(family)
    exp, params, _ = load(imported[family], setting)
    logits = jax.jit(lambda params, ids: lm_logits(exp.trainer.model, {"params": params}, ids))
    np.testing.assert_allclose(logits(params, expected["input_ids"]),
                               expected["logits"], atol=ATOL, rtol=0)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
@pytest.mark.parametrize("family", DECODERS)
def test_decoder_only_greedy_tokens_are_hugging_faces(imported, family):
    """By the incremental decoding path (`decode_step`: the prompt fed a token at a time
    into the cache of 2 key/value heads and rotated keys, then its own argmax; a windowed
    layer's cache a ring of its window, which the 20 ids of Mistral's, Gemma's and gpt-oss's
    pass; DeepSeek's latent attention caches its latent, not keys)."""
    exp, params, _ = load(imported[family])
    model, params, expected = exp.trainer.model, {"params": params}, oracle(family)
    prompt, total = list(expected["prompt_ids"]), len(expected["greedy_ids"])
    cache = model.init(jax.random.key(0), jnp.zeros((1, total), jnp.int32),
                       method=DecoderLM.decode_step)["cache"]
    for i in range(model.config.num_layers):  # a sliding layer's cache: its window alone
        window = layer_window(model.config, i)
        attention = cache[f"layer_{i}"]["self_attention"]
        keys = attention["cached_latent" if model.config.latent_attention else "cached_key"]
        assert keys.shape[1] == (window or total), (i, keys.shape)
    # (jitted once: the same decode_step, a token at a time, without dispatching each op)
    step = jax.jit(lambda params, cache, token: model.apply(
        {**params, "cache": cache}, token, method=DecoderLM.decode_step, mutable=["cache"]))
    ids = prompt[:1]
    for i in range(total - 1):
        logits, variables = step(params, cache, jnp.asarray([[ids[i]]]))
        cache = variables["cache"]
        ids.append(prompt[i + 1] if i + 1 < len(prompt) else int(jnp.argmax(logits[0])))
    assert ids == list(expected["greedy_ids"])


def t5(imported):
    exp, params, _ = load(imported["t5_1_1"])
    return exp.trainer.model, {"params": params}, oracle("t5_1_1")


def t5_logits(model, params, encoder_ids, decoder_input_ids):
    """Teacher-forced logits: mtrain's targets are the decoder inputs shifted left (it
    shifts them right again, after the start id 0)."""
    inputs = jnp.asarray(encoder_ids)
    targets = jnp.pad(jnp.asarray(decoder_input_ids)[:, 1:], ((0, 0), (0, 1)), constant_values=3)
    rows = lambda x: (x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape))  # noqa: E731
    return model.apply(params, *rows(inputs), *rows(targets))


def test_t5_1_1_logits_are_hugging_faces(imported):
    model, params, oracle = t5(imported)
    # (jitted: one compile of the call, not each op dispatched alone)
    logits = jax.jit(functools.partial(t5_logits, model))
    np.testing.assert_allclose(logits(params, oracle["encoder_ids"], oracle["decoder_input_ids"]),
                               oracle["logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        logits(params, oracle["long_encoder_ids"], oracle["long_decoder_input_ids"]),
        oracle["long_logits"], atol=ATOL, rtol=0)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_t5_1_1_greedy_tokens_are_hugging_faces(imported):
    """By the incremental decoding path (`decode_step`, its cache and the relative bias of
    each decoded position)."""
    model, params, oracle = t5(imported)
    inputs = jnp.asarray(oracle["encoder_ids"][:1])
    segments = jnp.ones_like(inputs)
    positions = jnp.arange(inputs.shape[1])[None]
    encoded = model.apply(params, inputs, segments, positions, method=EncoderDecoder.encode)
    cache = model.init(jax.random.key(0), encoded, segments, jnp.zeros((1, 16), jnp.int32),
                       method=EncoderDecoder.decode_step)["cache"]
    ids = [0]
    while len(ids) < len(oracle["greedy_ids"]):
        logits, variables = model.apply({**params, "cache": cache}, encoded, segments,
                                        jnp.asarray([[ids[-1]]]),
                                        method=EncoderDecoder.decode_step, mutable=["cache"])
        cache = variables["cache"]
        ids.append(int(jnp.argmax(logits[0])))
    assert ids == list(oracle["greedy_ids"])
