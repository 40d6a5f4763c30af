"""Context parallelism in training: a model with ``length`` split (the test trainer's LM,
a T5 encoder-decoder, an imported Llama 3 at 4x its context) trains as on one device,
through the command line too (resumes, and refuses what cannot split); the flash path as
the einsum one; the step model and the layout search know length splits, and the memory
they save.

Tolerances are each test's own (float32 on the CPU; the split's online softmax adds its
blocks' shares in another order than one softmax).
"""

import functools

import jax
import numpy as np
import pytest

from mtrain.models import context
from mtrain.parallel.layout import Layout


def train_lm(mode, mesh, rules):
    """The test trainer's LM (packed rows, rotary positions, grouped heads) 3 steps:
    (losses, the last batch's scores, the trainer)."""
    import dataclasses

    from test_trainer import CONFIG, make_trainer, packed_batches

    config = dataclasses.replace(CONFIG, dropout_rate=0.0, position_encoding="rotary",
                                 num_kv_heads=2, context_parallel=mode)
    trainer = make_trainer(mesh, rules, config=config)
    state, losses = trainer.init_state(), []
    for batch in packed_batches(3):
        placed = trainer.place_batch(batch)
        state, metrics = trainer.train_step(state, placed)
        losses.append(float(metrics["loss"]))
    scores = trainer.token_log_likelihoods(state.params, trainer.place_batch(batch))
    return losses, np.asarray(scores), trainer


@functools.cache
def one_device_lm():
    """`train_lm` on one device, once for every mode (a mode matters only where ``length``
    is split: `context.local_attention`)."""
    return train_lm(context.MODES[0], "", "")[:2]


@pytest.mark.parametrize("mesh, mode", [  # (each mesh once, each mode once)
    pytest.param("batch:1;model:8", "gather", marks=pytest.mark.slow),
    pytest.param("batch:4;model:2", "ring", marks=pytest.mark.slow),
])
def test_training_with_length_split_is_training_on_one_device(mesh, mode):
    """The language model's training losses and its scores (in the rows' own order) with
    ``length`` split equal one device's: packed rows, rotary positions, grouped heads."""
    want, want_scores = one_device_lm()
    got, got_scores, trainer = train_lm(mode, mesh, "batch:batch;length:model")
    assert trainer.length_order is not None
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_scores, want_scores, atol=1e-4)


@pytest.mark.slow
def test_a_run_with_length_split_trains_resumes_and_refuses_what_cannot_split(tmp_path, capsys):
    """Through the command line: ``length`` split over its own mesh dimension beside
    ``batch`` and ``model``, 4 steps, then (the checkpoint of step 4 lost) resumed from step
    2 to 4 with the same losses, and generation from it under the same layout; a sequence
    that does not cut into 2n chunks and ``length`` with ``d_ff`` on one mesh dimension are
    one line each, nothing written."""
    import json
    import os
    import shutil

    from tiny_config import TINY

    from mtrain.__main__ import main

    def argv(model_dir, *params):
        return ["--gin_file=tasks/bible_lm.gin", f"--model_dir={model_dir}",
                *(f"--gin_param={p}" for p in [
                    *TINY, "run.mesh_shape='batch:2;seq:2;model:2'",
                    "run.layout_rules='batch:batch;length:seq;d_ff:model;heads:model'",
                    "run.log_every=1", "run.checkpoint_every=2",
                    f"run.data_dir='{tmp_path / 'data'}'", *params])]

    def losses(model_dir):
        with open(model_dir / "metrics.jsonl") as f:
            return [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]

    assert main(argv(tmp_path / "once", "run.train_steps=4")) == 0
    once = losses(tmp_path / "once")
    shutil.rmtree(tmp_path / "once" / "checkpoints" / "4")  # (as if stopped after step 2)
    capsys.readouterr()
    assert main(argv(tmp_path / "once", "run.train_steps=4")) == 0
    assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
    assert losses(tmp_path / "once")[-2:] == once[-2:]
    # generation decodes a position a step: ``length`` splits nowhere there; a prompt
    # longer than the row keeps its end, and says so
    long = " ".join(["And God said, Let there be light: and there was light."] * 6)
    (tmp_path / "prompts.txt").write_text(f"In the beginning\n{long}\n")
    capsys.readouterr()
    assert main(argv(tmp_path / "once", "decoding.max_decode_length=4") + [
        "--mode=infer", f"--input_file={tmp_path / 'prompts.txt'}",
        f"--output_file={tmp_path / 'continued.txt'}"]) == 0
    assert len((tmp_path / "continued.txt").read_text().splitlines()) == 2
    assert ("1 of 2 input lines were longer than 32 tokens (run.sequence_length) and kept "
            "their last 28 tokens (what the continuation follows), leaving room for 4 new "
            "ones") in capsys.readouterr().err
    for bad, message in (("run.sequence_length=30", "multiple of 4"),
                         ("run.layout_rules='batch:batch;length:model;d_ff:model'",
                          "are both split over mesh dimension 'model'")):
        capsys.readouterr()
        assert main(argv(tmp_path / "bad", "run.train_steps=2", bad)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and message in lines[-1], lines
        assert not os.path.exists(tmp_path / "bad" / "checkpoints")


@pytest.mark.slow
def test_the_flash_path_with_length_split_trains_as_einsum(tmp_path):
    """Through the command line, 256 tokens a row with ``length`` split 2 ways (128 a
    device: splash's lanes, in Pallas' interpret mode): the flash path's losses, gathered or
    passed around the ring, are the einsum path's."""
    import json

    from tiny_config import TINY

    from mtrain.__main__ import main

    def losses(name, *params):
        model_dir = tmp_path / name
        assert main(["--gin_file=tasks/bible_lm.gin", f"--model_dir={model_dir}",
                     *(f"--gin_param={p}" for p in [
                         *TINY, "run.mesh_shape='batch:4;model:2'",
                         "run.layout_rules='batch:batch;length:model'", "run.train_steps=3",
                         "run.log_every=1", "run.sequence_length=256",
                         "transformer.max_length=256", "run.eval_every=0",
                         f"run.data_dir='{tmp_path / 'data'}'", *params])]) == 0
        with open(model_dir / "metrics.jsonl") as f:
            return [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]

    einsum = losses("einsum", "transformer.attention='einsum'")
    for mode in context.MODES:
        flash = losses(f"flash_{mode}", "transformer.attention='flash'",
                       f"transformer.context_parallel='{mode}'")
        np.testing.assert_allclose(flash, einsum, rtol=2e-5)


@pytest.mark.slow
def test_a_llama3_import_fine_tunes_at_4x_its_context_with_length_split(tmp_path):
    """`../shared/oracles/llama3` (rope_type llama3, max_position_embeddings 512) imported
    and fine-tuned on whole Bible books as single examples (`text_file`) at 2,048 tokens a
    row, its positions up to 2,047, with ``length`` split 4 ways beside ``batch``: the
    losses of a run with the rows' positions whole on every device."""
    import json
    import lzma
    import os

    from test_oracles import ORACLES, import_folder

    from mtrain.__main__ import main

    if not os.path.isdir(ORACLES):
        pytest.skip("no ../shared/oracles")
    corpus = os.path.join(os.path.dirname(__file__), "..", "data", "bible_kjv_lsg.tsv.xz")
    books = {}
    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        next(f)
        for line in f:
            book, _, _, english, _ = line.rstrip("\n").split("\t")
            books.setdefault(int(book), []).append(english)
    (tmp_path / "books").mkdir()
    for book in (1, 2):  # Genesis and Exodus: 38,000 and 32,000 words
        (tmp_path / "books" / f"{book}.txt").write_text(" ".join(books[book]), encoding="utf-8")
    (tmp_path / "held_out.txt").write_text(" ".join(books[66][:40]), encoding="utf-8")

    def losses(name, mesh, rules):
        model_dir = tmp_path / name
        import_folder(os.path.join(ORACLES, "llama3"), model_dir)
        assert "transformer.max_length = 512" in (model_dir / "config.gin").read_text()
        assert main([f"--gin_file={model_dir / 'config.gin'}", f"--model_dir={model_dir}",
                     *(f"--gin_param={p}" for p in [
                         "run.task=@task()", "task.data=@files()",
                         f"files.train='{tmp_path / 'books'}/*.txt'",
                         f"files.validation='{tmp_path / 'held_out.txt'}'",
                         "files.format='text_file'", "run.batch_size=2",
                         "run.sequence_length=2048", "transformer.max_length=2048",
                         "run.train_steps=2", "run.log_every=1", "run.eval_every=0",
                         f"run.mesh_shape='{mesh}'", f"run.layout_rules='{rules}'",
                         f"run.data_dir='{tmp_path / 'data'}'"])]) == 0
        with open(model_dir / "metrics.jsonl") as f:
            return [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]

    split = losses("split", "batch:2;seq:4", "batch:batch;length:seq")
    whole = losses("whole", "batch:2;model:4", "batch:batch")
    assert len(split) == 2 and np.all(np.isfinite(split))
    np.testing.assert_allclose(split, whole, rtol=2e-5)


def test_the_step_model_and_the_layout_search_know_length_splits():
    """At 131,072 tokens (llama_1b's size, batch 1, on H100s) the saved activations per
    device fall as ``length`` splits 1, 2, 4, 8 ways, the gathered form receives (n - 1)/n
    of a layer's keys and values and works on the whole row's, the ring on two blocks; the
    layout search tries ``length`` splits from `auto_layout.LONG` tokens on."""
    import dataclasses

    from mtrain.models.transformer import DecoderLM, TransformerConfig
    from mtrain.parallel.targets import TARGETS
    from mtrain.planning import auto_layout, step_model

    length = 131072
    config = TransformerConfig(vocab_size=32768, d_model=2048, d_ff=5504, num_heads=16,
                               num_kv_heads=4, d_kv=128, num_layers=16, max_length=length,
                               activation_dtype="bfloat16", remat_policy="dots",
                               position_encoding="rotary", attention="auto")

    def estimate(ways, mode="gather"):
        layout = Layout(f"seq:{ways}", "length:seq") if ways > 1 else Layout()
        return step_model.estimate(
            dataclasses.replace(config, context_parallel=mode), "lm", layout, 1, length, 1,
            16, 4e9, 4e9, 4e8, DecoderLM(config).analytic_flops(1, length), TARGETS["h100"])

    plans = [estimate(ways) for ways in (1, 2, 4, 8)]
    saved = [p.saved_activation_bytes for p in plans]
    assert all(a == pytest.approx(2 * b) for a, b in zip(saved, saved[1:]))
    kv_row = length * 4 * 128 * 2 * 2  # the whole row's keys and values, bfloat16
    assert plans[0].context_bytes == 0
    assert plans[3].context_bytes == pytest.approx(kv_row * 7 / 8)
    ring = estimate(8, "ring")
    assert ring.context_bytes == plans[3].context_bytes
    assert ring.working_bytes < plans[3].working_bytes - kv_row
    assert "length split 8 ways (ring)" in ring.attention
    long = auto_layout.candidate_layouts(8, long=True)
    assert ("batch:4;seq:2", "batch:batch;length:seq", "") in long
    assert ("seq:8", "length:seq", "") in long
    assert not any("length" in rules for _, rules, _ in auto_layout.candidate_layouts(8))


@pytest.mark.slow
def test_the_flash_path_with_length_split_8_ways_needs_a_quarter_of_the_memory():
    """The quickstart model at 4,096 tokens, batch 1, on ``batch:1;model:8`` with
    attention 'flash' (splash in interpret mode): the compiled step's temporaries per device
    with ``length`` split 8 ways (gathered) are at most 1/4 of the unsplit step's (issue 50
    measured 0.50 before attention split too); the ring's as well, at 16,384 tokens."""
    import contextlib
    import io
    import json

    from mtrain.__main__ import main

    def temporaries(rules, length=4096, mode="gather"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["--mode=plan", "--format=json", "--gin_file=quickstart.gin",
                         *(f"--gin_param={p}" for p in [
                             "run.mesh_shape='batch:1;model:8'", f"run.layout_rules='{rules}'",
                             "run.batch_size=1", f"run.sequence_length={length}",
                             f"transformer.max_length={length}", "transformer.attention='flash'",
                             f"transformer.context_parallel='{mode}'"])]) == 0
        report = json.loads(out.getvalue())
        return report["temp_bytes"], report["collectives"]

    whole, _ = temporaries("batch:batch")
    split, collectives = temporaries("batch:batch;length:model")
    assert split <= whole / 4, (split, whole)
    assert collectives["all-gather"]["count"] > 0  # (the keys and values, counted)
    ring, collectives = temporaries("batch:batch;length:model", 16384, "ring")
    assert ring <= temporaries("batch:batch", 16384)[0] / 4
    assert collectives["collective-permute"]["count"] > 0


def train_t5(mode, mesh_shape, rules):
    """T5 (relative position bias in both stacks) 3 steps of Adafactor on packed pairs:
    (losses, parameters)."""
    import dataclasses

    from test_encoder_decoder import B as ROWS, CONFIG as T5, L as LENGTH, packed_pairs

    from mtrain.models.transformer import EncoderDecoder
    from mtrain.training import optimizer
    from mtrain.training.trainer import Trainer

    config = dataclasses.replace(T5, dropout_rate=0.0, position_encoding="relative_bias",
                                 context_parallel=mode)
    layout = Layout(mesh_shape, rules)
    trainer = Trainer(model=EncoderDecoder(config), optimizer=optimizer.adafactor(1e-2),
                      layout=layout, mesh=layout.make_mesh(jax.devices()[:layout.size]),
                      batch_size=ROWS, sequence_length=LENGTH, seed=1)
    assert trainer.length_order is None
    state, losses = trainer.init_state(), []
    for batch in packed_pairs(3):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring"])
def test_a_t5_encoder_decoder_with_length_split_trains_as_on_one_device(mode):
    """T5's relative position bias in both stacks, ``length`` split 4 ways beside ``batch``
    (the encoder's and the decoder's self-attention split, their rows in order): the losses
    and parameters of one device. The ring; gathered with the bias: test_t5_relative_bias_...,
    in a trained model: test_training_with_length_split_... (the mode acts below the model)."""
    want, want_params = train_t5(context.MODES[0], "", "")
    got, params = train_t5(mode, "batch:2;model:4", "batch:batch;length:model")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                           params, want_params)
