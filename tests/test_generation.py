"""Generation from an LM (`evaluation.generation`): the sampling loop on a model written
out here, then a real decoder-only model through `Generator` on several layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.evaluation import decoding, generation
from mtrain.evaluation.translation import DecodingConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer

V = 16


def counting_model(ids, cache):
    """A 'model' whose logits favour (previous token + 1) mod V, never 0, with a little
    spread; its cache counts the steps (a leaf per row, as a model's)."""
    nxt = (ids[:, 0] + 1) % V
    nxt = jnp.where(nxt == 0, 2, nxt)
    logits = jnp.where(jnp.arange(V)[None, :] == nxt[:, None], 3.0, 0.0) + \
        0.1 * jnp.arange(V)[None, :]
    return logits, cache + 1


PROMPTS = jnp.array([[5, 6, 0, 0, 0, 0, 0, 0],
                     [9, 0, 0, 0, 0, 0, 0, 0],
                     [3, 4, 5, 6, 7, 8, 9, 10]])


PROMPT_LENGTHS = jnp.array([2, 1, 8])


def run(prompts=PROMPTS, prompt_lengths=PROMPT_LENGTHS, **kwargs):
    kwargs = {"max_decode_len": 8, "rng": jax.random.key(0), "eos_id": 1, **kwargs}
    return np.asarray(decoding.sample(counting_model, jnp.zeros((3,), jnp.int32), prompts,
                                      prompt_lengths=prompt_lengths, **kwargs))


def test_greedy_keeps_the_prompt_and_continues_it():
    out = run()
    np.testing.assert_array_equal(out[0], [5, 6, 7, 8, 9, 10, 11, 12])
    np.testing.assert_array_equal(out[1], [9, 10, 11, 12, 13, 14, 15, 2])
    np.testing.assert_array_equal(out[2], PROMPTS[2])  # a full prompt: nothing to add
    np.testing.assert_array_equal(run(max_decode_len=2)[0], [5, 6, 7, 8, 0, 0, 0, 0])


def test_a_prompt_holding_id_0_is_continued_after_all_of_it():
    """Id 0 is an ordinary token of many tokenizers (Llama 3's and Qwen's "!", Llama 2's
    unknown piece): the prompt's length says where it ends, never its ids."""
    prompts = jnp.array([[5, 0, 6, 0, 0, 0, 0, 0],
                         [0, 3, 0, 0, 0, 0, 0, 0],
                         [0, 4, 0, 0, 0, 0, 0, 0]])
    out = run(prompts, jnp.array([3, 2, 0]), max_decode_len=3)
    np.testing.assert_array_equal(out[0], [5, 0, 6, 7, 8, 9, 0, 0])  # the prompt whole
    np.testing.assert_array_equal(out[1], [0, 3, 4, 5, 6, 0, 0, 0])
    # an empty prompt, whatever its row holds: the start id 0, then 1 (EOS) ends it
    np.testing.assert_array_equal(out[2], [1, 0, 0, 0, 0, 0, 0, 0])


def test_rows_read_their_own_start_and_end_at_any_of_their_stop_ids():
    """A prompt read as it is (a rendered chat) starts its row with its own first id, and a
    chat's continuation ends at its end-of-turn id as well as at EOS."""
    out = run(jnp.zeros((3, 8), jnp.int32), jnp.array([0, 0, 0]), start_id=jnp.array([4, 9, 14]),
              eos_id=jnp.array([[7, 1], [12, 1], [1, 1]]))
    np.testing.assert_array_equal(out[0], [5, 6, 7, 0, 0, 0, 0, 0])  # after 4; ends at 7
    np.testing.assert_array_equal(out[1], [10, 11, 12, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(out[2], [15, 2, 3, 4, 5, 6, 7, 8])  # 16 % 16 = 0 -> 2


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    hot = dict(temperature=5.0)
    assert (run(**hot) == run(**hot)).all()
    assert (run(**hot) != run(**hot, rng=jax.random.key(1))).any()
    np.testing.assert_array_equal(run(temperature=5.0, top_k=1), run())
    np.testing.assert_array_equal(run(temperature=5.0, top_p=1e-6), run())
    # Sampling keeps each prompt as it is and samples what follows it: over a few seeds the
    # prompts' tokens never change, and the first token after each short prompt does.
    samples = np.stack([run(**hot, rng=jax.random.key(seed)) for seed in range(4)])
    np.testing.assert_array_equal(samples[:, 0, :2], [[5, 6]] * 4)
    np.testing.assert_array_equal(samples[:, 1, :1], [[9]] * 4)
    np.testing.assert_array_equal(samples[:, 2], [PROMPTS[2]] * 4)
    assert len(set(samples[:, 0, 2])) > 1 and len(set(samples[:, 1, 1])) > 1, samples[:, :2]


def test_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(decoding.filter_logits(logits, top_k=2)).tolist() == \
        [[True, True, False, False]]
    # top_p: the smallest set of the likeliest tokens whose mass reaches p
    assert np.isfinite(decoding.filter_logits(logits, top_p=0.7)).tolist() == \
        [[True, True, False, False]]
    assert np.isfinite(decoding.filter_logits(logits, top_p=0.5)).tolist() == \
        [[True, False, False, False]]
    assert np.isfinite(decoding.filter_logits(logits, top_p=0.81)).sum() == 3


class Vocab:
    """What `Generator` uses of a sentencepiece vocabulary, on ids written as words."""

    vocab_size, eos_id = 60, 1

    def encode(self, text):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        ids = list(ids)
        return " ".join(str(i) for i in ids[:ids.index(1)] if i)


CONFIG = TransformerConfig(vocab_size=128, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2,
                           d_kv=8, num_layers=2, max_length=16, position_encoding="rotary",
                           mlp_activations=("silu", "linear"))


@pytest.mark.slow  # (about 12 s each)
@pytest.mark.parametrize("scan", [False, True])
def test_layouts_never_change_the_generated_tokens(scan):
    """float32 greedy decoding of a (randomly initialised) rotary GQA LM, scanned or not:
    the same tokens on one device and batch:4;model:2 with the key/value heads whole while
    the query heads are split; scanned also model:8, the key/value heads split too, and the
    prompts fed a token a step (`decoding.prefill = False`). (batch:8 went: every mesh
    here but model:8 splits the batch.)"""
    config = TransformerConfig(**{**CONFIG.__dict__, "scan_layers": scan})
    prompts = ["5 6 7", "9", "3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18", "20 21"]
    outputs = []
    layouts = [("", ""), ("batch:4;model:2", "batch:batch;heads:model")]
    if scan:  # (scanned: the key/value heads split too, and model:8)
        layouts += [("model:8", "d_ff:model;vocab:model"),
                    ("batch:4;model:2", "batch:batch;heads:model;kv_heads:model")]
    for mesh_shape, rules in layouts:
        layout = Layout(mesh_shape, rules)
        mesh = layout.make_mesh(jax.devices()[:layout.size])
        trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adafactor(1e-3),
                          layout=layout, mesh=mesh, batch_size=8, sequence_length=16, seed=3)
        params = trainer.init_state().params
        generator = generation.Generator(trainer, Vocab(), DecodingConfig(), seed=0)
        outputs.append(generator(params, prompts))
        assert generator.truncated == 1  # the 16-token prompt, cut to its last 8
        if scan and not mesh_shape:
            outputs.append(generation.Generator(trainer, Vocab(), DecodingConfig(prefill=False),
                                                seed=0)(params, prompts))
    assert all(o == outputs[0] for o in outputs[1:]), outputs
    assert max(len(o.split()) for o in outputs[0]) > 1


def test_a_prompt_longer_than_the_row_keeps_its_end():
    """A prompt of 20 ids in rows of 16, with decoding.max_decode_length 5: its last 11 ids
    (the continuation follows them), 5 positions left for new ones; with the default (the
    whole row) half the row is left. Prompts that fit are kept whole."""
    layout = Layout()
    trainer = Trainer(model=DecoderLM(CONFIG), optimizer=optimizer.adafactor(1e-3), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:1]), batch_size=8, sequence_length=16,
                      seed=3)
    prompt = " ".join(str(i) for i in range(2, 22))
    for config, kept in ((DecodingConfig(max_decode_length=5), 11), (DecodingConfig(), 8)):
        generator = generation.Generator(trainer, Vocab(), config, seed=0)
        ids, lengths, _, _ = generator.encode_batch([prompt, "5 6 7"])
        assert lengths == [kept, 3] and generator.truncated == 1
        assert ids[0, :kept].tolist() == list(range(22 - kept, 22))
        assert "kept their last %d tokens" % kept in generator.truncation_note()
    continued = generator(trainer.init_state().params, [prompt])[0]
    assert 1 <= len(continued.split()) <= 8


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_the_generator_continues_a_prompt_holding_id_0_as_the_model_does():
    """A prompt whose ids include 0 (and a continuation that may) through `Generator`:
    the ids the model's own argmax gives after the whole prompt, recomputed here by
    teacher-forced forward passes over the growing sequence."""
    layout = Layout("batch:4;model:2", "batch:batch;heads:model")
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    trainer = Trainer(model=DecoderLM(CONFIG), optimizer=optimizer.adafactor(1e-3), layout=layout,
                      mesh=mesh, batch_size=8, sequence_length=16, seed=3)
    params = trainer.init_state().params
    generator = generation.Generator(trainer, Vocab(), DecodingConfig(max_decode_length=5))
    prompts = [[3, 0, 4], [0], [0, 0, 7, 0]]
    ids = np.zeros((8, 16), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    got = generator.continuations(params, ids, [len(p) for p in prompts])
    model = DecoderLM(CONFIG)
    for prompt, new in zip(prompts, got):
        seq = list(prompt)
        while len(seq) < len(prompt) + 5 and (len(seq) == len(prompt) or seq[-1] != 1):
            targets = np.zeros((1, 16), np.int32)
            targets[0, :len(seq)] = seq
            segments = (np.arange(16) <= len(seq)).astype(np.int32)[None]
            logits = model.apply({"params": params}, targets, segments,
                                 np.arange(16)[None] * segments)
            seq.append(int(np.argmax(np.asarray(logits)[0, len(seq)])))
        assert new == seq[len(prompt):], (prompt, new, seq)


@pytest.mark.slow  # (about 10 s)
def test_a_prompt_read_as_it_is_is_continued_as_the_model_reads_it():
    """`Prompt`s (a conversation rendered with its generation prompt) are read as their ids
    are, the first one first, with no start id before them, and end at their stop id: the
    ids the model's argmax gives reading `inputs` as they are, recomputed by teacher-forced
    passes; a text in the same batch is still read after the start id."""
    layout = Layout("batch:4;model:2", "batch:batch;heads:model")
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    trainer = Trainer(model=DecoderLM(CONFIG), optimizer=optimizer.adafactor(1e-3), layout=layout,
                      mesh=mesh, batch_size=8, sequence_length=16, seed=3)
    params = trainer.init_state().params
    generator = generation.Generator(trainer, Vocab(), DecodingConfig(max_decode_length=6))
    model = DecoderLM(CONFIG)

    def greedy(read, stops, limit=6):
        seq = list(read)
        while len(seq) < len(read) + limit and (len(seq) == len(read) or seq[-1] not in stops):
            inputs = np.zeros((1, 16), np.int32)
            inputs[0, :len(seq)] = seq
            segments = (np.arange(16) < len(seq)).astype(np.int32)[None]
            logits = model.apply({"params": params}, inputs, segments,
                                 np.arange(16)[None] * segments, inputs=inputs)
            seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
        return seq[len(read):]

    prompts = [generation.Prompt((7, 3, 9), stop=1), generation.Prompt((5,), stop=1)]
    expected = [greedy(p.ids, (1,)) for p in prompts]
    # a stop id the model does emit: the first id of the first continuation
    prompts.append(generation.Prompt((7, 3, 9), stop=expected[0][0]))
    expected.append(expected[0][:1])
    prompts.append("3 9")  # read after the start id 0
    expected.append(greedy((0, 3, 9), (1,)))
    ids, lengths, starts, stops = generator.encode_batch(prompts)
    got = generator.continuations(params, ids, lengths, starts, stops)
    assert got == expected
    texts = generator(params, prompts)
    assert texts[2] == ""  # the stop id ended it and is not text
    assert texts[3] == Vocab().decode(expected[3] + [1])
