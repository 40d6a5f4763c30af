"""DeepSeek-V3 (Kimi K2) and gpt-oss in and out through `mtrain.huggingface`, against
../shared/oracles/deepseek_v3 and gpt_oss: what is theirs alone. Their logits and greedy
ids are test_oracles' (DECODERS); their import in layouts (batch:4;model:2 with experts and
key/value heads split; DeepSeek's FSDP and scanned, gpt-oss's model:8 and scanned), score,
infer and bfloat16 export test_huggingface's (FAMILIES); a PEFT adapter on every projection
(DeepSeek's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj among them)
test_lora_families'. Here: the export is the oracle's folder (tensors bit for bit, gpt-oss's
interleaved gate_up_proj joined from its two parameters, config.json's fields transformers
reads, the tokenizer and chat template), DeepSeek's multi-token prediction modules round
trip, config.json refusals in one line, and fine-tuning an import (in full and LoRA) trains
and resumes bit for bit."""

import json
import os
import shutil

import numpy as np
import pytest

from test_huggingface import _refused, copy_folder, layout, params_of, resumes_bit_for_bit
from test_oracles import ORACLES, import_folder

from mtrain.__main__ import main
from mtrain.huggingface import sources, tensors

safetensors = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
FRONTIER = ("deepseek_v3", "gpt_oss")
# config.json fields transformers 5 reads with their default, or reads only to train with
# (gpt-oss's router_aux_loss_coef, without output_router_logits), or that name its version
UNREAD = {"transformers_version", "attention_dropout", "pretraining_tp", "use_cache",
          "router_aux_loss_coef"}


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_strided_parts_read_a_slice_and_export_joined_once():
    """gpt-oss's gate_up_proj [experts, d, 2f] is two parameters (every other column from 0
    and from 1): a slice of each reads its columns alone, and the export writes the tensor
    once, when its last part comes, after the tensors before it."""
    rng = np.random.default_rng(0)
    both = rng.normal(size=(3, 4, 10)).astype(np.float32)

    class Folder:
        def read(self, name, start, stop):
            return {"t": both, "u": both[0]}[name][start:stop]

    gate, up = sources.Strided("t", (3, 4, 5), 0, 2), sources.Strided("t", (3, 4, 5), 1, 2)
    np.testing.assert_array_equal(gate.read(Folder(), [(1, 3), (0, 4), (1, 4)]),
                                  both[1:3, :, 2:8:2])
    np.testing.assert_array_equal(up.read(Folder(), [(0, 3), (2, 3), (0, 5)]),
                                  both[:, 2:3, 1::2])
    other = sources.Plain("u", (4, 10))
    listed = [gate, other, up]
    assert sources.entries(listed) == [("u", (4, 10)), ("t", (3, 4, 10))]
    made = list(sources.whole(t for s, v in zip(listed, (both[..., 0::2], both[0], both[..., 1::2]))
                              for t in s.to_hf(v)))
    assert [n for n, _ in made] == ["u", "t"]
    np.testing.assert_array_equal(made[1][1], both)


@pytest.mark.parametrize("family", [  # (about 10 s each)
    "deepseek_v3", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_export_is_the_oracle_folder(tmp_path, family):
    """Imported and exported: the oracle's tensors bit for bit (gpt-oss's gate_up_proj
    joined again), its config.json in every field transformers reads (DeepSeek's YaRN and
    mscale, q_lora_rank, its router's constants; gpt-oss's sinks-free config, layer_types,
    pad), generation_config.json's ids, its tokenizer.json and chat template; imported
    again, the same parameters."""
    oracle = os.path.join(ORACLES, family)
    import_folder(oracle, tmp_path / "m")
    out = tmp_path / "hf"
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}", f"--output_dir={out}"]) == 0
    theirs = safetensors.load_file(os.path.join(oracle, "model.safetensors"))
    ours = safetensors.load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    want, got = read_json(os.path.join(oracle, "config.json")), read_json(out / "config.json")
    for field in sorted(set(want) - UNREAD):
        assert got.get(field) == want[field], (field, got.get(field), want[field])
    generation = read_json(out / "generation_config.json")
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation.get(field) == read_json(os.path.join(
            oracle, "generation_config.json")).get(field), field
    assert read_json(out / "tokenizer.json") == read_json(os.path.join(oracle, "tokenizer.json"))
    assert (out / "chat_template.jinja").read_text() == open(
        os.path.join(oracle, "chat_template.jinja")).read()
    tokens = read_json(out / "tokenizer_config.json")
    for field in ("bos_token", "eos_token", "pad_token"):
        assert tokens[field] == read_json(os.path.join(oracle, "tokenizer_config.json"))[field]
    import_folder(out, tmp_path / "again")
    first, again = params_of(tmp_path / "m"), params_of(tmp_path / "again")
    assert sorted(first) == sorted(again)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def mtp_folder(target, rng):
    """deepseek_v3 with one multi-token prediction module as DeepSeek-V3 ships one: layer 3
    (enorm, hnorm, eh_proj, a layer of experts, shared_head.norm) with its copies of the
    embedding and the output head."""
    weights = safetensors.load_file(os.path.join(ORACLES, "deepseek_v3", "model.safetensors"))
    mtp = {name.replace("model.layers.2.", "model.layers.3."): value + rng.normal(
        0, 0.01, value.shape).astype(np.float32)
           for name, value in weights.items() if name.startswith("model.layers.2.")}
    d = weights["model.norm.weight"].shape[0]
    mtp |= {f"model.layers.3.{n}.weight": rng.normal(1, 0.2, d).astype(np.float32)
            for n in ("enorm", "hnorm", "shared_head.norm")}
    mtp["model.layers.3.eh_proj.weight"] = rng.normal(0, (2 * d) ** -0.5, (d, 2 * d)).astype(
        np.float32)
    mtp["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    mtp["model.layers.3.shared_head.head.weight"] = weights["lm_head.weight"]
    copy_folder("deepseek_v3", target, weights | mtp)
    config = read_json(target / "config.json") | {"num_nextn_predict_layers": 1}
    (target / "config.json").write_text(json.dumps(config))
    return weights | mtp


def test_deepseeks_multi_token_prediction_modules_round_trip(tmp_path):
    """A DeepSeek-V3 folder with an MTP module (Hugging Face's layer num_hidden_layers): the
    import keeps it (``mtp_0/...``, its copies of the tables not read: mtrain shares them)
    and fine-tunes without its loss (transformers never trains it); the export writes every
    tensor back, the copies those of the trunk's tables."""
    weights = mtp_folder(tmp_path / "hf", np.random.default_rng(0))
    import_folder(tmp_path / "hf", tmp_path / "m")
    written = (tmp_path / "m" / "config.gin").read_text()
    assert "transformer.mtp_depth = 1" in written
    assert "transformer.mtp_loss_weight = 0.0" in written
    params = params_of(tmp_path / "m")
    np.testing.assert_array_equal(params["mtp_0/projection"],
                                  weights["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(params["mtp_0/layer/mlp/choice_bias"],
                                  weights["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}",
                 f"--output_dir={tmp_path / 'out'}"]) == 0
    ours = safetensors.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    assert read_json(tmp_path / "out" / "config.json")["num_nextn_predict_layers"] == 1


def _edited(tmp_path, family, edit):
    copy_folder(family, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(edit(read_json(path))))
    return tmp_path / "hf"


def _rope(config, **fields):
    rope = {k: v for k, v in config["rope_parameters"].items() if fields.get(k, 0) is not None}
    return config | {"rope_parameters": rope | {k: v for k, v in fields.items() if v is not None}}


@pytest.mark.parametrize("family, edit, fragment", [
    ("deepseek_v3", lambda c: c | {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3", lambda c: c | {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", lambda c: c | {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3", lambda c: c | {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ("deepseek_v3", lambda c: c | {"head_dim": 24}, "head_dim=24"),
    ("deepseek_v3", lambda c: _rope(c, factor=None, original_max_position_embeddings=None),
     "rope_parameters.factor"),
    ("deepseek_v3", lambda c: c | {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", lambda c: c | {"quantization_config": {"quant_method": "fp8"}},
     "quantization_config.quant_method='fp8'"),
    ("gpt_oss", lambda c: c | {"quantization_config": {"quant_method": "mxfp4"}}, "dequantize"),
    ("gpt_oss", lambda c: _rope(c, rope_type="dynamic"), "rope_parameters.rope_type='dynamic'"),
    ("gpt_oss", lambda c: c | {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("gpt_oss", lambda c: c | {"router_jitter_noise": 0.1}, "router_jitter_noise")])
def test_config_refusals_are_one_line(tmp_path, capsys, family, edit, fragment):
    """What mtrain cannot honour (a router transformers would not compute either, a layout
    of latent attention it does not have, quantized weights, YaRN without its factor) is
    refused in one line naming the field, with nothing written."""
    folder = _edited(tmp_path, family, edit)
    _refused(capsys, ["--mode=import", f"--input_dir={folder}",
                      f"--model_dir={tmp_path / 'm'}"], fragment)
    assert not os.path.exists(tmp_path / "m")


def test_yarn_reads_as_transformers_fills_it_in():
    """YaRN's missing fields as transformers fills them in: the factor from
    max_position_embeddings / original_max_position_embeddings, beta_fast 32, beta_slow 1,
    truncate true; DeepSeek's softmax scale qk_head_dim^-0.5 x (1 + 0.1 ln 4)^2."""
    from mtrain.huggingface import families

    config = read_json(os.path.join(ORACLES, "deepseek_v3", "config.json"))
    arch = families.settings(config).architecture
    assert arch["transformer.attention_scale"] == pytest.approx(0.26464, abs=1e-5)
    bare = _rope(config, factor=None, beta_fast=None, beta_slow=None, mscale=None,
                 mscale_all_dim=None)
    got = families.settings(bare).architecture
    assert got["rope_scaling.factor"] == 4.0 and got["rope_scaling.truncate"] is True
    assert (got["rope_scaling.beta_fast"], got["rope_scaling.beta_slow"]) == (32.0, 1.0)
    assert got["transformer.attention_scale"] == pytest.approx(24 ** -0.5)
    assert families.settings(config | {"q_lora_rank": None}).architecture[
        "mla.q_lora_rank"] == 0


# (a verse repeated: every batch the same text, so that four steps lower the loss whatever
# the batch)
TRAIN = ["--gin_param=run.task=@task()", "--gin_param=task.data=@files()",
         "--gin_param=files.validation=0.25", "--gin_param=files.format='text'",
         "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=32",
         "--gin_param=run.data_workers=0", "--gin_param=run.log_every=1",
         "--gin_param=run.checkpoint_every=2", "--gin_param=run.eval_every=0",
         "--gin_param=learning_rate_schedule.warmup_steps=1",
         "--gin_param=learning_rate_schedule.constant=0.003"]


# (not full x lora x both families: each case compiles a run, a resume or exports. DeepSeek
# in full (its choice bias moved, the resume bit for bit) and LoRA (its latent projections'
# adapters exported); gpt-oss in LoRA, through all its layers (sinks, biases, the clamp) to
# its experts' adapters, exported merged and refused as PEFT. gpt-oss's sinks and output
# bias train in test_attention_sinks, its experts' gradients in test_gpt_oss_experts.)
@pytest.mark.slow
@pytest.mark.parametrize("lora, family", [
    pytest.param(False, "deepseek_v3", marks=pytest.mark.extended), (True, "deepseek_v3"),
    pytest.param(True, "gpt_oss", marks=pytest.mark.extended)],
                         ids=["full-deepseek_v3", "lora-deepseek_v3", "lora-gpt_oss"])
def test_fine_tuning_an_import_trains_and_resumes_bit_for_bit(tmp_path, data_dir, capsys,
                                                              family, lora):
    """An import fine-tuned on a text file with its AdamW (in full, DeepSeek's choice
    bias moved by a rate; or LoRA on every projection, gpt-oss's experts' parameters too):
    the loss falls. In full, its checkpoint of step 4 lost (as if stopped after step 2's),
    run again from step 2 it ends bit for bit where the uninterrupted run did (a LoRA run's
    checkpoint, adapters and their state, resumes so in test_lora; each resume compiles for
    ~20 s). The LoRA run exports merged; gpt-oss's expert adapters have no PEFT module, and
    ``--adapter`` says so in one line."""
    verses = tmp_path / "verses.txt"
    verses.write_text("In the beginning God created the heaven and the earth.\n" * 64)
    settings = [*[f"--gin_param={p}" for p in layout("batch:4;model:2", family)], *TRAIN,
                f"--gin_param=files.train='{verses}'"]
    if lora:
        settings.append("--gin_param=lora.rank=4")
    elif family == "deepseek_v3":
        settings.append("--gin_param=moe.bias_update_rate=0.01")
    model_dir = tmp_path / "run"
    import_folder(os.path.join(ORACLES, family), model_dir, *(
        s for s in settings if "lora" not in s))
    argv = [f"--gin_file={model_dir / 'config.gin'}", f"--model_dir={model_dir}", *settings,
            "--gin_param=run.train_steps=4"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").open()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    straight = (params_of(model_dir) if lora else
                resumes_bit_for_bit(capsys, argv, model_dir, newest=4, back_to=2))
    if family == "deepseek_v3" and not lora:  # the choice bias moved, by the rate
        base = safetensors.load_file(os.path.join(ORACLES, family, "model.safetensors"))
        moved = straight["layer_1/mlp/choice_bias"] - base[
            "model.layers.1.mlp.gate.e_score_correction_bias"]
        assert np.abs(moved).max() > 0
    if lora:
        assert any(k.endswith("_lora_a") for k in straight)
        assert main(["--mode=export", f"--model_dir={model_dir}",
                     f"--output_dir={tmp_path / 'merged'}"]) == 0
        assert tensors.Folder(str(tmp_path / "merged")).names() == tensors.Folder(
            os.path.join(ORACLES, family)).names()
        export = ["--mode=export", f"--model_dir={model_dir}",
                  f"--output_dir={tmp_path / 'adapter'}", "--adapter"]
        if family == "gpt_oss":
            _refused(capsys, export, "--adapter", "target_parameters")
            assert not os.path.exists(tmp_path / "adapter")
        else:
            assert main(export) == 0
            modules = read_json(tmp_path / "adapter" / "adapter_config.json")["target_modules"]
            assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"} <= set(modules)


def test_an_mtp_folder_without_its_copies_imports(tmp_path):
    """The copies of the tables an MTP module holds are not read: a folder without them
    imports, and the export writes them."""
    weights = mtp_folder(tmp_path / "full", np.random.default_rng(1))
    shutil.copytree(tmp_path / "full", tmp_path / "bare")
    bare = {k: v for k, v in weights.items()
            if not k.endswith(("layers.3.embed_tokens.weight", "shared_head.head.weight"))}
    safetensors.save_file(bare, tmp_path / "bare" / "model.safetensors")
    import_folder(tmp_path / "bare", tmp_path / "m")
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}",
                 f"--output_dir={tmp_path / 'out'}"]) == 0
    assert sorted(safetensors.load_file(tmp_path / "out" / "model.safetensors")) == sorted(
        weights)


def test_a_null_q_lora_rank_projects_the_queries_directly(tmp_path):
    """DeepSeek-V2-Lite's layout (q_lora_rank null: q_proj [heads x (nope + rope), d], no
    q_a/q_b): imported as ``mla.q_lora_rank = 0`` and exported back to its tensors and its
    null."""
    weights = safetensors.load_file(os.path.join(ORACLES, "deepseek_v3", "model.safetensors"))
    rng = np.random.default_rng(2)
    for i in range(3):
        at = f"model.layers.{i}.self_attn."
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj"):
            del weights[f"{at}{name}.weight"]
        weights[f"{at}q_proj.weight"] = rng.normal(0, 0.125, (4 * 24, 64)).astype(np.float32)
    copy_folder("deepseek_v3", tmp_path / "hf", weights)
    config = read_json(tmp_path / "hf" / "config.json") | {"q_lora_rank": None}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    import_folder(tmp_path / "hf", tmp_path / "m")
    assert "mla.q_lora_rank = 0" in (tmp_path / "m" / "config.gin").read_text()
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}",
                 f"--output_dir={tmp_path / 'out'}"]) == 0
    ours = safetensors.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(weights)
    assert all(np.array_equal(ours[n], weights[n]) for n in weights)
    assert read_json(tmp_path / "out" / "config.json")["q_lora_rank"] is None
