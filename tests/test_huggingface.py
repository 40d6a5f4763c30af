"""Hugging Face checkpoints in and out (``--mode=import`` / ``--mode=export``) against
../shared/oracles: imports in several layouts, bfloat16 and sharded copies, the tokenizer,
infer and score through the command line, export bit for bit, and every refusal in one
line with the model dir untouched. (Folders in their other published forms, and an import
fine-tuned: test_hf_folders.)

Tolerances: logits as test_oracles (1e-4 absolute in float32); scores 1e-3 (the issue's:
sums of ~20 log-probabilities accumulated in float32); bfloat16 copies are compared by
their parameters, which must equal the float32 ones rounded to bfloat16 exactly (the
import's conversions are exact: transposes, reshapes, and the queries' factor 16^-0.5 =
1/4, a power of two).
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_oracles import ORACLES, Imports, import_folder, lm_logits, load, oracle, t5_logits

from mtrain.__main__ import main
from mtrain.evaluation.generation import Generator
from mtrain.modes.infer import one_line
from mtrain.huggingface import families

safetensors = pytest.importorskip("safetensors.numpy")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
FAMILIES = ("llama_gqa", "t5_1_1", "mixtral", "llama3", "qwen2", "qwen3", "mistral_sw",
            "gemma3", "qwen3_moe", "deepseek_v3", "gpt_oss")


def params_of(model_dir, *gin_params) -> dict:
    _, params, _ = load(model_dir, *gin_params)
    return {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def logits_of(family, model_dir, *gin_params):
    """The oracle inputs' logits of an imported model, computed in its layout (the batch
    of 2 repeated to 4 rows, which every layout's batch dimension divides)."""
    exp, params, _ = load(model_dir, *gin_params)
    model, o = exp.trainer.model, oracle(family)
    with exp.trainer.layout.activate(exp.trainer.mesh):
        if family == "t5_1_1":
            fn = jax.jit(lambda p, x, y: t5_logits(model, {"params": p}, x, y))
            out = fn(params, np.tile(o["encoder_ids"], (2, 1)),
                     np.tile(o["decoder_input_ids"], (2, 1)))
        else:
            fn = jax.jit(lambda p, x: lm_logits(model, {"params": p}, x))
            out = fn(params, np.tile(o["input_ids"], (2, 1)))
    return np.asarray(out)[:2]


def resumes_bit_for_bit(capsys, argv, model_dir, *, newest: int, back_to: int) -> dict:
    """The parameters of `model_dir` after its run `argv`; that run, with checkpoint
    `newest` lost, run again must resume from `back_to` and end with the same ones."""
    straight = params_of(model_dir)
    shutil.rmtree(model_dir / "checkpoints" / str(newest))
    capsys.readouterr()
    assert main(argv) == 0
    assert f"resuming from the checkpoint of step {back_to}" in capsys.readouterr().err
    resumed = params_of(model_dir)
    assert sorted(resumed) == sorted(straight)
    assert all(np.array_equal(straight[k], resumed[k]) for k in straight)
    return straight


def copy_folder(family, target, weights: dict | None = None, files: int = 1, dtype=None):
    """A copy of an oracle folder (config, tokenizer) with `weights` (default: its own),
    as `files` safetensors shards with an index, of `dtype` (default: as they are)."""
    source = os.path.join(ORACLES, family)
    os.makedirs(target)
    for name in os.listdir(source):
        if not name.endswith((".safetensors", ".npz")):
            shutil.copy(os.path.join(source, name), target)
    weights = weights or safetensors.load_file(os.path.join(source, "model.safetensors"))
    names = sorted(weights)
    chunks = [names[i::files] for i in range(files)]
    if files == 1:
        out = [(chunks[0], "model.safetensors")]
    else:
        out = [(c, f"model-{i + 1:05d}-of-{files:05d}.safetensors") for i, c in enumerate(chunks)]
        with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: file for c, file in out for n in c}}, f)
    for chunk, file in out:
        part = {n: weights[n] for n in chunk}
        if dtype is not None:  # safetensors' flax writer takes bfloat16
            from safetensors.flax import save_file
            save_file({n: jnp.asarray(v, dtype) for n, v in part.items()},
                      os.path.join(target, file))
        else:
            safetensors.save_file(part, os.path.join(target, file))


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    return Imports(tmp_path_factory.mktemp("hf"))


# Each family's own dimensions split too: key/value heads (Llama, Mixtral), experts (Mixtral);
# DeepSeek's latent attention has no key/value heads (its heads split, and its experts).
EXTRA_RULES = {"llama_gqa": ";kv_heads:model", "t5_1_1": "",
               "mixtral": ";kv_heads:model;experts:model", "llama3": ";kv_heads:model",
               "qwen2": ";kv_heads:model", "qwen3": ";kv_heads:model",
               "mistral_sw": ";kv_heads:model", "gemma3": ";kv_heads:model",
               "qwen3_moe": ";kv_heads:model;experts:model", "deepseek_v3": ";experts:model",
               "gpt_oss": ";kv_heads:model;experts:model"}


def layout(name, family) -> list[str]:
    rules = "batch:batch;d_ff:model;heads:model;vocab:model"
    return {
        "model:8": ["run.mesh_shape='model:8'", "run.layout_rules='d_ff:model;vocab:model'"],
        "batch:4;model:2": ["run.mesh_shape='batch:4;model:2'",
                            f"run.layout_rules='{rules}{EXTRA_RULES[family]}'"],
        "fsdp": ["run.mesh_shape='batch:4;model:2'", f"run.layout_rules='{rules}'",
                 "run.parameter_layout_rules='d_model:batch'"],
        "scanned": ["run.mesh_shape='batch:4;model:2'", f"run.layout_rules='{rules}'",
                    "transformer.scan_layers=True"],
    }[name]


# Pairwise, not every family in every layout (each an import and a compile): every family in
# batch:4;model:2 (its own heads, kv heads, experts, d_ff, vocab split: each of its `sources`
# read by slices); model:8's 8-way d_ff and vocab: gpt-oss's Strided gate/up, Gemma's Copied
# table; fsdp's d_model: DeepSeek's latent projections and experts, Qwen2's Reshaped biases
# and tied table; scanned, each branch of `weights._scanned`: T5's two stacks, DeepSeek's
# dense first layers, gpt-oss's layers in groups (sliding, full).
LAYOUT_CASES = [*[(f, "batch:4;model:2") for f in FAMILIES],
                ("gpt_oss", "model:8"), ("gemma3", "model:8"), ("deepseek_v3", "fsdp"),
                ("qwen2", "fsdp"), ("t5_1_1", "scanned"), ("deepseek_v3", "scanned"),
                ("gpt_oss", "scanned")]


@pytest.mark.slow  # the single-device logits are test_oracles' (fast tier)
@pytest.mark.parametrize("family, name", LAYOUT_CASES)
def test_the_layout_of_an_import_changes_no_logit(tmp_path, family, name):
    """Imported in the layout (each device's slice read and converted on its own), the
    logits computed in it are Hugging Face's."""
    import_folder(os.path.join(ORACLES, family), tmp_path / "m",
                  *[f"--gin_param={p}" for p in layout(name, family)])
    np.testing.assert_allclose(logits_of(family, tmp_path / "m"), oracle(family)["logits"],
                               atol=1e-4, rtol=0)


@pytest.mark.slow  # (20 s: the full suite reads bfloat16 and sharded folders; the fast tier writes bfloat16 in the export test)
def test_bfloat16_and_sharded_copies_import_as_the_original(imports, tmp_path):
    for family in ("llama_gqa", "t5_1_1", "mixtral", "gemma3"):  # (the conversions' kinds)
        original = params_of(imports / family)
        copy_folder(family, tmp_path / f"{family}_shards", files=3)
        import_folder(tmp_path / f"{family}_shards", tmp_path / f"{family}_from_shards")
        shards = params_of(tmp_path / f"{family}_from_shards")
        assert all(np.array_equal(original[k], shards[k]) for k in original), family
        copy_folder(family, tmp_path / f"{family}_bf16", dtype=jnp.bfloat16)
        import_folder(tmp_path / f"{family}_bf16", tmp_path / f"{family}_from_bf16")
        halves = params_of(tmp_path / f"{family}_from_bf16")
        for name, value in original.items():
            rounded = value.astype(jnp.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(halves[name], rounded, err_msg=f"{family} {name}")


def tiered(*fast):
    """FAMILIES, those not in `fast` in the slow tier (the fast one keeps a folder of each
    kind of what a test checks)."""
    return [f if f in fast else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


# (fast: Mixtral's experts; test_lora exports a Llama; Gemma's norms and T5's encoder-decoder
# in the full suite)
@pytest.mark.parametrize("family", tiered("mixtral"))
def test_export_writes_the_original_tensors_and_imports_back(imports, tmp_path, family):
    out = tmp_path / "hf"
    assert main(["--mode=export", f"--model_dir={imports / family}", f"--output_dir={out}"]) == 0
    theirs = safetensors.load_file(os.path.join(ORACLES, family, "model.safetensors"))
    ours = safetensors.load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    read = families.read_config
    assert (families.settings(read(out)).architecture
            == families.settings(read(os.path.join(ORACLES, family))).architecture)
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= set(os.listdir(out))
    import_folder(out, tmp_path / "again")
    first, again = params_of(imports / family), params_of(tmp_path / "again")
    assert all(np.array_equal(first[k], again[k]) for k in first)
    # bfloat16 export: the same tensors rounded; sharded when over the shard size
    assert main(["--mode=export", f"--model_dir={imports / family}", f"--output_dir={out}_bf16",
                 "--dtype=bfloat16"]) == 0
    from safetensors.flax import load_file

    halves = load_file(f"{out}_bf16/model.safetensors")
    for name in theirs:
        assert halves[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(halves[name], np.float32),
                                      theirs[name].astype(jnp.bfloat16).astype(np.float32))


def test_exported_shards_have_an_index(imports, tmp_path):
    """Past the shard size, safetensors shards with the index file (the import reads them
    back identically)."""
    from mtrain import run as run_lib
    from mtrain.modes import convert

    run_lib.parse_config([str(imports / "llama_gqa" / "config.gin")], [])
    exp = run_lib.build(mode="export", model_dir=str(imports / "llama_gqa"))
    written = convert.export_model(exp, str(tmp_path / "hf"), None, "float32",
                                   max_shard_bytes=200_000)["files"]
    assert "model.safetensors.index.json" in written and "model.safetensors" not in written
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    import_folder(tmp_path / "hf", tmp_path / "again")
    first, again = params_of(imports / "llama_gqa"), params_of(tmp_path / "again")
    assert all(np.array_equal(first[k], again[k]) for k in first)


def _texts(tmp_path, family, pairs=False):
    texts = [str(t) for t in oracle(family)["texts"]]
    path = tmp_path / f"{family}.txt"
    path.write_text("".join(f"{t}\t{t}\n" if pairs else f"{t}\n" for t in texts))
    return path


def _ragged(o, name, i):
    offsets = o[f"{name}_offsets"]
    return o[f"{name}_flat"][offsets[i]:offsets[i + 1]]


def test_infer_writes_a_continuation_holding_a_newline_on_one_line(imports, tmp_path,
                                                                    monkeypatch):
    """A continuation that holds a newline (a model may generate one) is written escaped
    (`infer.one_line`): the output keeps one line per input line, and reads back."""
    made = []

    def with_newlines(self, params, texts):
        for batch in original(self, params, texts):
            made.extend(f"{t}\nsecond line\\n\r" for t in batch)
            yield made[-len(batch):]
    original = Generator.batches
    monkeypatch.setattr(Generator, "batches", with_newlines)
    out = tmp_path / "out.txt"
    model = imports / "llama_gqa"
    assert main([f"--gin_file={model / 'config.gin'}", f"--model_dir={model}", "--mode=infer",
                 f"--input_file={_texts(tmp_path, 'llama_gqa')}", f"--output_file={out}",
                 "--gin_param=decoding.max_decode_length=4",
                 *[f"--gin_param={p}" for p in layout("batch:4;model:2", "llama_gqa")]]) == 0
    lines = out.read_text().split("\n")[:-1]
    assert len(lines) == len(made) == len(oracle("llama_gqa")["texts"])
    unescape = {"\\\\": "\\", "\\n": "\n", "\\r": "\r"}
    assert [re.sub(r"\\[\\nr]", lambda m: unescape[m[0]], line) for line in lines] == made


# Every family's tokenizer; infer and score through the command line for a family of each
# kind: Llama's sentencepiece (fast), T5's pairs, Qwen's rows past its tokenizer, and the
# frontier's latent attention and sinks. (The other families' greedy ids and logits are
# test_oracles', through the same decoding code, scores being sums of those logits' log-
# probabilities; their layouts are this file's.)
THROUGH_THE_COMMAND_LINE = ("llama_gqa", "t5_1_1", "qwen2", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("family", tiered("llama_gqa"))
def test_tokenizer_infer_score_eval_and_plan_through_the_command_line(imports, tmp_path,
                                                                       data_dir, family):
    """The folder's tokenizer gives the oracle's ids; --mode=infer continues (translates)
    each text with the oracle's greedy ids, and --mode=score gives the sums of its
    log-probabilities; eval and plan run on the imported dir as on a trained one."""
    _, _, vocab = load(imports / family)
    o = oracle(family)
    for i, text in enumerate(o["texts"]):
        assert vocab.encode(str(text)) == list(_ragged(o, "text_ids", i))
    if "text_prefix" in o:  # what the texts are read after: the BOS, Qwen's <|endoftext|>
        assert f"transformer.start_id = {int(o['text_prefix'][0])}" in (
            imports / family / "config.gin").read_text()
    if family not in THROUGH_THE_COMMAND_LINE:
        return
    config = f"--gin_file={imports / family / 'config.gin'}"
    common = [config, f"--model_dir={imports / family}",
              *[f"--gin_param={p}" for p in layout("batch:4;model:2", family)]]
    out = tmp_path / "out.txt"
    assert main([*common, "--mode=infer", f"--input_file={_texts(tmp_path, family)}",
                 f"--output_file={out}", "--gin_param=decoding.max_decode_length=12",
                 "--gin_param=decoding.beam_size=1"]) == 0
    expected = [vocab.decode(list(_ragged(o, "text_greedy", i))) for i in range(len(o["texts"]))]
    # (random weights: the continuations hold control characters, a newline even: written
    # escaped, one line per input line)
    assert out.read_text() == "".join(f"{one_line(line)}\n" for line in expected)
    assert out.read_text().count("\n") == len(o["texts"])
    scores = tmp_path / "scores.jsonl"
    assert main([*common, "--mode=score", f"--input_file={_texts(tmp_path, family, family == 't5_1_1')}",
                 f"--output_file={scores}", f"--output_dir={tmp_path / 'measured'}"]) == 0
    got = [json.loads(line)["log_likelihood"] for line in scores.read_text().splitlines()]
    want = [float(_ragged(o, "text_logprobs", i).sum()) for i in range(len(o["texts"]))]
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    if family == "llama_gqa":  # (the others' eval and plan are the same code)
        assert main([*common, "--mode=eval", f"--output_dir={tmp_path / 'measured'}"]) == 0
        records = [json.loads(x) for x in (tmp_path / "measured" / "metrics.jsonl").open()]
        assert records[-1]["step"] == 0 and records[-1]["eval/perplexity"] > 1
        assert main([config, f"--model_dir={imports / family}", "--mode=plan",
                     "--target=h100", "--format=json"]) == 0


def _broken(tmp_path, family, edit=None, weights=None):
    copy_folder(family, tmp_path / "hf", weights=weights)
    if edit:
        path = tmp_path / "hf" / "config.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return tmp_path / "hf"


def _refused(capsys, argv, *fragments):
    """Exit 2 and at most 3 lines on stderr (the run's start-up lines, where it got that
    far), the last the error naming each of `fragments`."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and lines[-1].startswith("mtrain: error:"), lines
    assert not any("Traceback" in line for line in lines)
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def test_every_refusal_is_one_line_and_writes_nothing(tmp_path, capsys, imports):
    weights = safetensors.load_file(os.path.join(ORACLES, "llama_gqa", "model.safetensors"))
    cases = [
        ("llama_gqa", lambda c: c | {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}},
         None, "rope_scaling.rope_type"),
        ("llama3", lambda c: c | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
         None, "rope_parameters.rope_type"),
        ("qwen2", lambda c: c | {"use_sliding_window": True, "sliding_window": 8,
                                 "layer_types": None}, None, "max_window_layers"),
        ("gemma3", lambda c: c | {"final_logit_softcapping": 30.0}, None,
         "final_logit_softcapping"),
        ("qwen3_moe", lambda c: c | {"mlp_only_layers": [0]}, None, "mlp_only_layers"),
        ("llama_gqa", lambda c: c | {"attention_bias": True}, None, "attention_bias"),
        ("llama_gqa", lambda c: c | {"architectures": ["GPT2LMHeadModel"]}, None, "architectures"),
        ("llama_gqa", lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, None,
         "config.json has no hidden_size"),
        ("llama_gqa", lambda c: c | {"num_hidden_layers": 3}, None,
         "model.layers.2.self_attn.q_proj.weight"),
        ("llama_gqa", None, weights | {"model.layers.0.mlp.up_proj.weight": np.zeros((7, 64), np.float32)},
         "shape [7, 64]"),
        ("llama_gqa", None, weights | {"model.layers.0.mlp.up_proj.weight":
                                       weights["model.layers.0.mlp.up_proj.weight"].astype(np.int32)},
         "I32"),
        ("llama_gqa", None, weights | {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)},
         "q_proj.bias"),
    ]
    for i, (family, edit, tensors, fragment) in enumerate(cases):
        folder = _broken(tmp_path / str(i), family, edit, tensors)
        _refused(capsys, ["--mode=import", f"--input_dir={folder}",
                          f"--model_dir={tmp_path / str(i) / 'm'}"], fragment)
        assert not os.path.exists(tmp_path / str(i) / "m")
        assert not os.path.exists(tmp_path / str(i) / "m.importing")
    # a truncated file; a missing one; a contradicting gin setting
    folder = _broken(tmp_path / "cut", "llama_gqa")
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(folder / "model.safetensors") - 100)
    _refused(capsys, ["--mode=import", f"--input_dir={folder}", f"--model_dir={tmp_path / 'm'}"],
             "is truncated")
    os.remove(folder / "model.safetensors")
    _refused(capsys, ["--mode=import", f"--input_dir={folder}", f"--model_dir={tmp_path / 'm'}"],
             "no model.safetensors")
    _refused(capsys, ["--mode=import", f"--input_dir={os.path.join(ORACLES, 'llama_gqa')}",
                      f"--model_dir={tmp_path / 'm'}", "--gin_param=transformer.d_model=128"],
             "transformer.d_model=128", "hidden_size=64")
    assert not os.path.exists(tmp_path / "m")
    # the same import again: the model dir is there, and stays as it was
    before = sorted(p.name for p in (imports / "llama_gqa").iterdir())
    _refused(capsys, ["--mode=import", f"--input_dir={os.path.join(ORACLES, 'llama_gqa')}",
                      f"--model_dir={imports / 'llama_gqa'}"], "not empty")
    assert sorted(p.name for p in (imports / "llama_gqa").iterdir()) == before
    # exports of settings no Hugging Face family has
    for family, setting, fragment in (
            ("llama_gqa", "transformer.position_encoding='learned'", "no Hugging Face family"),
            ("mixtral", "moe.normalize_top_k=False", "renormalises"),
            ("t5_1_1", "transformer.mlp_activations=('gelu_exact', 'linear')", "feed_forward_proj")):
        _refused(capsys, ["--mode=export", f"--model_dir={imports / family}",
                          f"--output_dir={tmp_path / 'out'}",
                          f"--gin_file={imports / family / 'config.gin'}",
                          f"--gin_param={setting}"], fragment)
        assert not os.path.exists(tmp_path / "out")
