"""Hugging Face folders in their other published forms, against ../shared/oracles: a
tokenizer.json without a sentencepiece file, tied embeddings, T5 v1.0, a vocabulary that is
not a multiple of 128, Mixtral routing to one expert, both forms of the RoPE settings; and
an import fine-tuned, resumed and exported. (The families' own folders in and out:
test_huggingface.)

Tolerances as test_huggingface's (logits 1e-4 absolute in float32, scores 1e-3).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_huggingface import (FAMILIES, _broken, _ragged, copy_folder, layout, params_of,
                              resumes_bit_for_bit)
from test_oracles import ORACLES, import_folder, load, oracle

from mtrain.__main__ import main
from mtrain.huggingface import families

safetensors = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")


def test_a_tokenizer_json_only_model_imports_with_the_same_ids(tmp_path):
    """A folder with tokenizer.json and no sentencepiece file (made here from T5's with the
    tokenizers package): the vocabulary is the tokenizers one, with the same ids."""
    import sys

    import sentencepiece.sentencepiece_model_pb2 as model_pb2

    sys.modules.setdefault("sentencepiece_model_pb2", model_pb2)  # what from_spm imports
    from tokenizers.implementations import SentencePieceUnigramTokenizer

    copy_folder("t5_1_1", tmp_path / "hf")
    tokenizer = SentencePieceUnigramTokenizer.from_spm(str(tmp_path / "hf" / "spiece.model"))
    os.remove(tmp_path / "hf" / "spiece.model")
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    import_folder(tmp_path / "hf", tmp_path / "m")
    _, _, vocab = load(tmp_path / "m")
    assert type(vocab).__name__ == "TokenizerVocabulary" and vocab.eos_id == 1
    o = oracle("t5_1_1")
    for i, text in enumerate(o["texts"]):
        assert vocab.encode(str(text)) == list(_ragged(o, "text_ids", i))
        assert vocab.decode(vocab.encode(str(text)) + [1, 5]) == str(text)
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}",
                 f"--output_dir={tmp_path / 'out'}"]) == 0
    assert "tokenizer.json" in os.listdir(tmp_path / "out")


@pytest.mark.slow
def test_fine_tuning_an_import_lowers_the_loss_resumes_and_exports(tmp_path, data_dir, capsys):
    """Imported with the user's training settings, trained on the shipped corpus from the
    imported parameters (a fresh optimizer); its checkpoint of step 8 lost (as if stopped
    after step 4's), run again to 8 it ends bit for bit where it had; then exports."""
    settings = [*[f"--gin_param={p}" for p in layout("batch:4;model:2", "llama_gqa")],
                "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=64",
                "--gin_param=run.data_workers=0", "--gin_param=run.log_every=1",
                "--gin_param=run.checkpoint_every=4", "--gin_param=run.eval_every=0",
                # Mesh-TF's optimizer, not the import's fine-tuning default (AdamW, 1e-4):
                "--gin_param=run.optimizer=@adafactor",
                "--gin_param=learning_rate_schedule.shape='rsqrt'",
                "--gin_param=learning_rate_schedule.constant=1.0",
                "--gin_param=learning_rate_schedule.warmup_steps=100"]  # a rate of 0.1
    model_dir = tmp_path / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir, *settings)
    argv = [f"--gin_file={model_dir / 'config.gin'}", f"--model_dir={model_dir}",
            "--gin_param=run.train_steps=8"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").open()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    # (measured: 6.75 -> 6.42; the batches alone move it by about 0.05)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.15, losses
    straight = resumes_bit_for_bit(capsys, argv, model_dir, newest=8, back_to=4)
    assert main(["--mode=export", f"--model_dir={model_dir}",
                 f"--output_dir={tmp_path / 'hf'}"]) == 0
    tensors = safetensors.load_file(tmp_path / "hf" / "model.safetensors")
    np.testing.assert_array_equal(tensors["model.norm.weight"], straight["final_norm/scale"])


def test_tied_llama_and_t5_v1_0_folders(tmp_path):
    """Two variants the oracles do not have, made from them: a Llama whose softmax is its
    embedding table (no lm_head.weight; it stays tied, its logits unscaled, and exports
    tied), and a T5 v1.0 (ReLU, one input projection `wi`, tied and rescaled logits:
    mtrain's shared softmax) that exports back to the same tensors and config."""
    weights = safetensors.load_file(os.path.join(ORACLES, "llama_gqa", "model.safetensors"))
    del weights["lm_head.weight"]
    folder = _broken(tmp_path / "llama", "llama_gqa", lambda c: c | {"tie_word_embeddings": True},
                     weights)
    import_folder(folder, tmp_path / "llama_m")
    params = params_of(tmp_path / "llama_m")
    assert "softmax" not in params
    np.testing.assert_array_equal(params["token_embedding/embedding"],
                                  weights["model.embed_tokens.weight"])
    assert main(["--mode=export", f"--model_dir={tmp_path / 'llama_m'}",
                 f"--output_dir={tmp_path / 'llama_out'}"]) == 0
    ours = safetensors.load_file(tmp_path / "llama_out" / "model.safetensors")
    assert sorted(ours) == sorted(weights)
    assert families.read_config(tmp_path / "llama_out")["tie_word_embeddings"] is True
    t5 = safetensors.load_file(os.path.join(ORACLES, "t5_1_1", "model.safetensors"))
    del t5["lm_head.weight"]
    for name in [n for n in t5 if "wi_1" in n]:
        del t5[name]
    t5 = {n.replace("wi_0", "wi"): v for n, v in t5.items()}
    folder = _broken(tmp_path / "t5", "t5_1_1", lambda c: c | {
        "feed_forward_proj": "relu", "tie_word_embeddings": True, "is_gated_act": False,
        "dense_act_fn": "relu", "scale_decoder_outputs": True}, t5)
    import_folder(folder, tmp_path / "t5_m")
    assert "transformer.shared_embedding_and_softmax = True" in (
        tmp_path / "t5_m" / "config.gin").read_text()
    assert main(["--mode=export", f"--model_dir={tmp_path / 't5_m'}",
                 f"--output_dir={tmp_path / 't5_out'}"]) == 0
    ours = safetensors.load_file(tmp_path / "t5_out" / "model.safetensors")
    assert sorted(ours) == sorted(t5)
    assert all(np.array_equal(ours[n], t5[n]) for n in t5)
    assert (families.settings(families.read_config(tmp_path / "t5_out")).architecture
            == families.settings(families.read_config(folder)).architecture)


def test_a_vocabulary_not_a_multiple_of_128_scores_as_hugging_face_does(tmp_path):
    """Qwen2.5's folder cut to 500 embedding rows (its tokenizer has 496 ids): mtrain pads
    the vocabulary to 512 rows, and those 12 must take no part in any softmax. The model's
    log-probabilities are then the oracle's logits' over their first 500 rows (a row of
    logits depends on no other table row: the rows cut are ids no input holds), while the 16
    rows Qwen itself has past its tokenizer (496-499) stay in the softmax. Tolerance as the
    logits' (1e-4; log-softmax of O(1) logits adds no more)."""
    weights = safetensors.load_file(os.path.join(ORACLES, "qwen2", "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:500]
    folder = _broken(tmp_path, "qwen2", lambda c: c | {"vocab_size": 500}, weights)
    o = oracle("qwen2")
    ids = o["input_ids"][0]
    # The model reads transformer.start_id first: the row's first id, so that it reads ids.
    import_folder(folder, tmp_path / "m", f"--gin_param=transformer.start_id={int(ids[0])}")
    exp, params, _ = load(tmp_path / "m")
    assert exp.trainer.model.config.vocab_size == 512
    batch = {k: np.zeros(exp.trainer.batch_shape, np.int32)
             for k in ("targets", "targets_segment_ids", "targets_positions")}
    n = len(ids) - 1
    batch["targets"][0, :n], batch["targets_segment_ids"][0, :n] = ids[1:], 1
    batch["targets_positions"][0, :n] = np.arange(n)
    got = np.asarray(exp.trainer.token_log_likelihoods(params, exp.trainer.place_batch(batch)))
    logits = o["logits"][0, :n, :500].astype(np.float64)
    expected = logits[np.arange(n), ids[1:]] - np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(got[0, :n], expected, atol=1e-4, rtol=0)
    # (with the padded rows in the softmax it would be off by their probability mass)
    padded = o["logits"][0, :n].astype(np.float64)
    assert np.abs(got[0, :n] - (padded[np.arange(n), ids[1:]]
                                - np.log(np.exp(padded).sum(-1)))).max() > 1e-3


def test_mixtral_renormalises_even_one_gate(tmp_path):
    """Hugging Face's Mixtral renormalises its top-k gates whatever k: with one expert per
    token the gate is 1, not Switch's probability. The import says so
    (moe.normalize_top_k), and the router then gives each token its expert's output whole."""
    from mtrain.models import moe

    folder = _broken(tmp_path, "mixtral", lambda c: c | {"num_experts_per_tok": 1})
    import_folder(folder, tmp_path / "m")
    exp, _, _ = load(tmp_path / "m")
    assert exp.trainer.model.config.moe.renormalizes
    logits = jax.random.normal(jax.random.key(0), (2, 8, 4))
    _, combine, _ = moe.route(logits, jnp.ones((2, 8)), 1, 8, normalize=True)
    np.testing.assert_allclose(combine.sum((2, 3)), 1.0, rtol=1e-6)
    _, switch, _ = moe.route(logits, jnp.ones((2, 8)), 1, 8)  # Switch: the probability
    assert float(switch.sum((2, 3)).max()) < 1.0


@pytest.mark.parametrize("family", FAMILIES[:1] + FAMILIES[2:])
def test_both_forms_of_rope_settings_read_the_same(family):
    """transformers 5's `rope_parameters` (per layer type for Gemma 3) and the older
    `rope_theta` + `rope_scaling` (+ Gemma's `rope_local_base_freq`) of the same model give
    the same settings (an export writes both; `test_export_writes_the_original_tensors_and_
    imports_back` reads its config.json back to the original's settings)."""
    new = families.read_config(os.path.join(ORACLES, family))
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    rope = new.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3
        old |= {"rope_theta": rope["full_attention"]["rope_theta"],
                "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    elif rope:
        old["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            old["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert families.settings(old).architecture == families.settings(new).architecture
    if family == "llama3":
        assert families.settings(old).architecture["rope_scaling.kind"] == "llama3"
