"""The encoder-decoder: layouts never change results, packed pairs stay apart, incremental
decoding equals recomputation, and translation end to end (beam search, BLEU, infer)."""

import io
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mtrain.training import optimizer
from mtrain.parallel.layout import Layout
from mtrain.training.language_modeling import LanguageModeling
from mtrain.training.losses import LossConfig
from mtrain.models.transformer import EncoderDecoder, TransformerConfig
from mtrain.training.trainer import Trainer

CONFIG = TransformerConfig(vocab_size=128, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                           num_layers=2, dropout_rate=0.1, max_length=16)
B, L = 8, 16


def packed_pairs(n, seed=0):
    """Random batches of 1-2 packed (inputs, targets) pairs per row, with padding."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = {}
        for key in ("inputs", "targets"):
            seg, pos = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
            for r in range(B):
                cut = int(rng.integers(3, L - 4))
                end = L - int(rng.integers(0, 3))
                seg[r, :cut], pos[r, :cut] = 1, np.arange(cut)
                seg[r, cut:end], pos[r, cut:end] = 2, np.arange(end - cut)
            tokens = rng.integers(2, CONFIG.vocab_size, (B, L)).astype(np.int32) * (seg > 0)
            batch.update({key: tokens, f"{key}_segment_ids": seg, f"{key}_positions": pos})
        out.append(batch)
    return out


def train(mesh_shape, rules, steps=3, parameter_rules=""):
    layout = Layout(mesh_shape, rules, parameter_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    trainer = Trainer(model=EncoderDecoder(CONFIG), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=B, sequence_length=L, seed=1,
                      objective=LanguageModeling(LossConfig(label_smoothing=0.1)))
    state, losses = trainer.init_state(), []
    for batch in packed_pairs(steps):
        state, metrics = trainer.train_step(state, trainer.place_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_same_loss_on_one_device_and_on_a_2x4_mesh():
    ref_losses, ref_params = train("", "")
    assert ref_losses[-1] < ref_losses[0]
    rules = "batch:batch;d_ff:model;heads:model;vocab:model"
    for parameter_rules in ("", "d_model:batch"):  # and with the parameters sharded (FSDP)
        losses, params = train("batch:2;model:4", rules, parameter_rules=parameter_rules)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=parameter_rules)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                               params, ref_params)


def init_params(config=CONFIG):
    ids = jnp.zeros((1, L), jnp.int32)
    variables = EncoderDecoder(config).init(jax.random.key(0), *[ids] * 6)
    return nn.unbox(variables)["params"]


def test_every_parameter_has_logical_names():
    ids = jnp.zeros((1, L), jnp.int32)
    boxed = jax.eval_shape(lambda: EncoderDecoder(CONFIG).init(jax.random.key(0), *[ids] * 6))
    specs = nn.get_partition_spec(boxed)["params"]
    flat = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    names = {jax.tree_util.keystr(p): tuple(s) for p, s in flat}
    assert names["['decoder_1']['encoder_decoder_attention']['k']"] == ("d_model", "heads", "d_kv")
    assert names["['encoder_0']['mlp']['wi']"] == ("d_model", "d_ff")
    assert names["['embed']['embedding']"] == ("vocab", "d_model")  # one table, both sides
    assert all(all(n is not None for n in s) for s in names.values())


def test_packed_pairs_do_not_see_each_other():
    params = init_params()
    model = EncoderDecoder(CONFIG)
    batch = packed_pairs(1, seed=4)[0]
    args = [batch[k][:1] for k in ("inputs", "inputs_segment_ids", "inputs_positions", "targets",
                                   "targets_segment_ids", "targets_positions")]
    packed = np.asarray(model.apply({"params": params}, *args))
    # The second pair of the row, alone in a row of its own.
    alone = []
    for key in ("inputs", "targets"):
        where = batch[f"{key}_segment_ids"][0] == 2
        n = int(where.sum())
        alone += [np.pad(batch[key][0][where], (0, L - n))[None],
                  np.pad(np.ones(n, np.int32), (0, L - n))[None],
                  np.pad(np.arange(n, dtype=np.int32), (0, L - n))[None]]
    single = np.asarray(model.apply({"params": params}, *alone))
    where = batch["targets_segment_ids"][0] == 2
    np.testing.assert_allclose(single[0, : where.sum()], packed[0, where], atol=1e-5)


def test_incremental_decoding_equals_full_recomputation():
    config = TransformerConfig(**{**CONFIG.__dict__, "dropout_rate": 0.0})
    params, model = init_params(config), EncoderDecoder(config)
    rng = np.random.default_rng(2)
    n, m, steps = 3, 10, 7
    inputs = rng.integers(2, 128, (n, m)).astype(np.int32)
    inputs[:, 8:] = 0  # padding
    segments = (inputs > 0).astype(np.int32)
    positions = np.where(segments > 0, np.arange(m), 0).astype(np.int32)
    targets = rng.integers(2, 128, (n, steps)).astype(np.int32)
    full = model.apply({"params": params}, inputs, segments, positions, targets,
                       np.ones_like(targets), np.tile(np.arange(steps, dtype=np.int32), (n, 1)))
    encoded = model.apply({"params": params}, inputs, segments, positions, method=model.encode)
    cache = jax.eval_shape(lambda: model.init(jax.random.key(0), encoded, segments,
                                              jnp.zeros((n, 12), jnp.int32),
                                              method=model.decode_step))["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
    previous = np.zeros((n, 1), np.int32)  # decoding starts from token 0
    for t in range(steps):
        logits, variables = model.apply({"params": params, "cache": cache}, encoded, segments,
                                        previous, method=model.decode_step, mutable=["cache"])
        cache = variables["cache"]
        np.testing.assert_allclose(logits, full[:, t], atol=1e-4, err_msg=f"step {t}")
        previous = targets[:, t:t + 1]
    assert int(cache["decode_index"]["index"]) == steps


# --- translation: sharded beam search, eval with BLEU, infer ----------------------------

@pytest.fixture(scope="module")
def joint_vocab(tmp_path_factory):
    import itertools

    from mtrain.data.sources import BibleTranslation
    from mtrain.data.vocabulary import train_vocabulary

    texts = itertools.islice(BibleTranslation().texts("train"), 3000)
    return train_vocabulary(texts, 300, tmp_path_factory.mktemp("vocab") / "joint.model")


def make_translator(mesh_shape, rules, vocab, beam_size, parameter_rules=""):
    from mtrain.evaluation.translation import DecodingConfig, Translator

    config = TransformerConfig(**{**CONFIG.__dict__, "vocab_size": 384, "dropout_rate": 0.0})
    layout = Layout(mesh_shape, rules, parameter_rules)
    mesh = layout.make_mesh(jax.devices()[: layout.size])
    opt = optimizer.adafactor(optimizer.learning_rate_schedule(warmup_steps=10))
    trainer = Trainer(model=EncoderDecoder(config), optimizer=opt, layout=layout, mesh=mesh,
                      batch_size=4, sequence_length=L, seed=5)
    translator = Translator(trainer, vocab, DecodingConfig(beam_size=beam_size, max_decode_length=10))
    return translator, trainer.init_state().params


SENTENCES = ["In the beginning God created the heaven and the earth.", "And God said,",
             "Let there be light: and there was light.", "Amen.", "The LORD is my shepherd."]


@pytest.mark.slow  # (12 s; sharded decoding in the fast tier: test_generation's layouts)
def test_sharded_beam_search_decodes_as_on_one_device(joint_vocab):
    one, params = make_translator("", "", joint_vocab, beam_size=3)
    mesh, mesh_params = make_translator("batch:2;model:4", "batch:batch;d_ff:model;heads:model",
                                        joint_vocab, beam_size=3)
    expected = one(params, SENTENCES)  # 5 sentences: two batches of 4, the last one padded
    assert len(expected) == 5 and any(expected)
    assert mesh(mesh_params, SENTENCES) == expected
    # With the parameters stored sharded over the batch dimension too (FSDP).
    fsdp, fsdp_params = make_translator("batch:2;model:4", "batch:batch;d_ff:model;heads:model",
                                        joint_vocab, beam_size=3, parameter_rules="d_model:batch")
    assert fsdp_params["decoder_0"]["mlp"]["wi"].sharding.spec == P("batch", "model")
    assert fsdp(fsdp_params, SENTENCES) == expected
    # (beam 1, greedy search, on one device: test_decoding_paths, on every attention path)


@pytest.mark.slow
def test_translation_cli_train_eval_and_infer(tmp_path, monkeypatch, capsys):
    from mtrain.__main__ import main

    monkeypatch.setenv("MTRAIN_DATA_DIR", str(tmp_path / "data"))
    model_dir = tmp_path / "run"
    params = ["transformer.d_model=32", "transformer.d_ff=64", "transformer.num_heads=2",
              "transformer.d_kv=16", "transformer.num_layers=1", "transformer.max_length=32",
              "vocabulary.size=300", "run.batch_size=8", "run.sequence_length=32",
              "run.train_steps=4", "run.log_every=2", "learning_rate_schedule.warmup_steps=2",
              "decoding.num_examples=12", "decoding.max_decode_length=8", "decoding.beam_size=2"]
    argv = ["--gin_file=tasks/bible_enfr.gin", "--gin_file=layouts/dp4_mp2.gin",
            f"--model_dir={model_dir}"] + [f"--gin_param={p}" for p in params]
    assert main(argv) == 0
    assert main(argv + ["--mode=eval", "--gin_param=run.eval_split='test'"]) == 0
    with open(model_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    final = [r for r in records if "eval/bleu" in r]
    assert len(final) == 2 and all(r["step"] == 4 and r["eval/bleu_examples"] == 12 for r in final)
    assert {"eval/loss", "eval/accuracy", "eval/bleu_intl"} <= final[1].keys()
    assert 0 <= final[1]["eval/bleu"] <= 100
    # Every decode is kept, in the evaluated order, and sacrebleu on them gives eval/bleu.
    import sacrebleu

    from mtrain.data.bible import bible_split_verses

    rows = [line.split("\t") for line in
            (model_dir / "decodes" / "test-4.tsv").read_text(encoding="utf-8").splitlines()]
    verses = bible_split_verses("test")[:12]
    assert [r[:2] for r in rows] == [[v.en, v.fr] for v in verses]  # the first 12, in order
    recomputed = sacrebleu.corpus_bleu([r[2] for r in rows], [[r[1] for r in rows]]).score
    assert recomputed == pytest.approx(final[1]["eval/bleu"], abs=1e-9)
    assert (model_dir / "decodes" / "validation-4.tsv").is_file()  # training's own eval

    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'in.txt'}",
                        f"--output_file={tmp_path / 'out.txt'}"]) == 0
    lines = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")
    assert len(lines) == len(SENTENCES) + 1 and lines[-1] == ""  # one line per sentence
    # decoding.batch_size: other batches, the same translations; one that the mesh's batch
    # dimension (4) does not divide is one clear error.
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'in.txt'}",
                        f"--output_file={tmp_path / 'out4.txt'}",
                        "--gin_param=decoding.batch_size=4"]) == 0
    assert (tmp_path / "out4.txt").read_text(encoding="utf-8").split("\n") == lines
    capsys.readouterr()
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'in.txt'}",
                        "--gin_param=decoding.batch_size=6"]) == 2
    assert "not divisible by mesh dimension 'batch' of size 4" in capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Amen.\nAnd God said,\n"))
    assert main(argv + ["--mode=infer"]) == 0
    out = capsys.readouterr()
    assert out.out == f"{lines[3]}\n{lines[1]}\n"  # as from the file
    assert "were longer than" not in out.err  # no input was too long
    # An input longer than the model's 32 tokens is cut, with one warning that counts them.
    monkeypatch.setattr("sys.stdin", io.StringIO(" ".join(SENTENCES * 3) + "\nAmen.\n"))
    assert main(argv + ["--mode=infer"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 2
    assert "1 of 2 input lines were longer than 32 tokens" in out.err
    # An empty file translates to an empty one, as it scores to one.
    (tmp_path / "empty.txt").write_text("")
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'empty.txt'}",
                        f"--output_file={tmp_path / 'empty_out.txt'}"]) == 0
    assert (tmp_path / "empty_out.txt").read_text() == ""
    capsys.readouterr()
    # The output file is checked before anything is read or translated: its directory must
    # exist, and the file that is there stays as it was.
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'in.txt'}",
                        f"--output_file={tmp_path / 'no' / 'out.txt'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mtrain: error: --output_file {tmp_path / 'no' / 'out.txt'}: the directory "
                   f"{tmp_path / 'no'} does not exist"]
    assert main(argv + ["--mode=infer", f"--input_file={tmp_path / 'no_such.txt'}",
                        f"--output_file={tmp_path / 'out.txt'}"]) == 2
    assert "cannot read --input_file" in capsys.readouterr().err
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n") == lines
    # An LM model dir with no checkpoint to continue prompts with: one clear error.
    assert main(["--gin_file=tasks/bible_lm.gin", "--gin_file=layouts/dp4_mp2.gin",
                 f"--model_dir={tmp_path / 'lm'}", "--mode=infer"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
