"""Low-rank adapters (`models.lora`): a PEFT adapter imported onto its base gives what
`peft` computed (../shared/oracles/lora_llama_gqa) on every layout, the adapters are laid out
by their dimension names (``lora_rank`` among them), and an adapter that does not fit its
base is refused in one line."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from test_oracles import ORACLES, import_folder, lm_logits, load

from mtrain.__main__ import main
from mtrain.huggingface.adapters import WEIGHTS
from mtrain.models import parameters
from mtrain.parallel.layout_syntax import LayoutError

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
ADAPTER = os.path.join(ORACLES, "lora_llama_gqa")
ATOL = 1e-4  # float32 logits against torch's (test_oracles: the reference moves by ~2e-6)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lora") / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir, f"--adapter_dir={ADAPTER}")
    return model_dir


def oracle():
    return dict(np.load(os.path.join(ADAPTER, "oracle.npz")))


@pytest.mark.parametrize("layout", [
    (),
    pytest.param(("run.mesh_shape='batch:4;model:2'",
                  "run.layout_rules='batch:batch;heads:model;kv_heads:model;d_ff:model;"
                  "vocab:model'"), marks=pytest.mark.slow),  # (fsdp below splits them too)
    pytest.param(("run.mesh_shape='batch:4;model:2'",
                  "run.layout_rules='batch:batch;lora_rank:model'"), marks=pytest.mark.slow),
    ("run.mesh_shape='batch:4;model:2'",
     "run.layout_rules='batch:batch;d_ff:model;heads:model;vocab:model'",
     "run.parameter_layout_rules='d_model:batch'"),
], ids=["one_device", "model_parallel", "lora_rank_split", "fsdp"])
def test_an_imported_peft_adapter_gives_peft_logits(adapted, layout):
    exp, params, _ = load(adapted, *layout)
    got = lm_logits(exp.trainer.model, {"params": params}, oracle()["input_ids"])
    np.testing.assert_allclose(got, oracle()["logits"], atol=ATOL, rtol=0)


def test_adapters_are_named_parameters_the_rules_lay_out(adapted):
    mesh = "run.mesh_shape='batch:4;model:2'"
    exp, params, _ = load(adapted, mesh, "run.layout_rules='batch:batch;d_ff:model'")
    names, shardings = exp.trainer.param_names["layer_0"], exp.trainer.state_shardings.params
    assert tuple(names["mlp"]["wi_0_lora_a"]) == ("d_model", "lora_rank")
    assert tuple(names["mlp"]["wi_0_lora_b"]) == ("lora_rank", "d_ff")
    assert tuple(names["self_attention"]["o_lora_a"]) == ("heads", "d_kv", "lora_rank")
    # the adapters of a d_ff:model weight split as it does
    assert tuple(shardings["layer_0"]["mlp"]["wi_0_lora_b"].spec) == (None, "model")
    assert tuple(shardings["layer_0"]["mlp"]["wo_lora_a"].spec) == ("model", None)
    exp, params, _ = load(adapted, mesh, "run.layout_rules='batch:batch;lora_rank:model'")
    shardings = exp.trainer.state_shardings.params["layer_0"]
    assert tuple(shardings["self_attention"]["q_lora_a"].spec) == (None, "model")
    assert tuple(shardings["mlp"]["wo_lora_b"].spec) == ("model", None)
    # a mesh dimension splits one dimension of a tensor: lora_rank and d_ff both on model
    # would split wi_0_lora_b twice
    with pytest.raises(LayoutError, match="wi_0_lora_b .*'lora_rank' and 'd_ff' are both"):
        load(adapted, mesh, "run.layout_rules='batch:batch;d_ff:model;lora_rank:model'")


def test_scoring_with_the_adapter_gives_peft_text_scores(adapted, tmp_path):
    want = oracle()
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(str(t) + "\n" for t in want["texts"]))
    out = tmp_path / "scores.jsonl"
    assert main([f"--gin_file={adapted}/config.gin", f"--model_dir={adapted}", "--mode=score",
                 f"--input_file={texts}", f"--output_file={out}",
                 f"--output_dir={tmp_path / 'metrics'}",
                 "--gin_param=run.mesh_shape='batch:4;model:2'"]) == 0
    got = [json.loads(line)["log_likelihood"] for line in out.read_text().splitlines()]
    offsets, flat = want["text_logprobs_offsets"], want["text_logprobs_flat"]
    expected = [flat[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])]
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_an_adapter_that_does_not_fit_is_one_line(tmp_path, capsys):
    other = tmp_path / "other_base"  # an adapter of another base: its projections' shapes
    shutil.copytree(ADAPTER, other)
    config = json.loads((other / "adapter_config.json").read_text())
    wrong = dict(config, target_modules=["q_proj", "lm_head"])
    # (qwen3's queries are 4 heads of 32 on d_model 64, llama_gqa's 4 of 16)
    # (another base by its name: test_family_records; here insisted on, its shapes refuse it)
    cases = {"another base": (os.path.join(ORACLES, "qwen3"), ADAPTER, "is not of this base"),
             "a module it cannot adapt": (os.path.join(ORACLES, "llama_gqa"), wrong,
                                          "adapts lm_head, which is not"),
             "DoRA": (os.path.join(ORACLES, "llama_gqa"), dict(config, use_dora=True),
                      "asks for DoRA")}
    for name, (base, adapter, message) in cases.items():
        if isinstance(adapter, dict):
            (other / "adapter_config.json").write_text(json.dumps(adapter))
            adapter = other
        capsys.readouterr()
        model_dir = tmp_path / name.replace(" ", "_")
        assert main(["--mode=import", f"--input_dir={base}", f"--adapter_dir={adapter}",
                     f"--model_dir={model_dir}", "--ignore_adapter_base"]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and message in lines[-1], (name, lines)
        assert not model_dir.exists()


@pytest.mark.slow  # (the trainer's side in the fast tier: test_freezing)
def test_lora_training_moves_the_adapters_alone(tmp_path, capsys):
    """A LoRA run on an import without adapters: fresh ones (B at zero, so that the model
    starts as its base: step 0's logits are the base's), the base weights bit for bit as
    imported after the steps, optimizer state for the adapters alone."""
    from model_dirs import digest, saved_state

    model_dir = tmp_path / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir)
    mesh = "run.mesh_shape='batch:4;model:2'"
    exp, base_params, _ = load(model_dir, mesh)
    want = np.asarray(lm_logits(exp.trainer.model, {"params": base_params},
                                oracle()["input_ids"]))
    exp, params, _ = load(model_dir, mesh, "lora.rank=4", "lora.alpha=8.0")
    got = lm_logits(exp.trainer.model, {"params": params}, oracle()["input_ids"])
    np.testing.assert_array_equal(got, want)  # B = 0: the base, exactly
    train = [f"--gin_file={model_dir}/config.gin", f"--model_dir={model_dir}",
             f"--gin_param={mesh}", "--gin_param=lora.rank=4", "--gin_param=lora.alpha=8.0",
             "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=32",
             "--gin_param=run.train_steps=4", "--gin_param=run.checkpoint_every=4",
             "--gin_param=run.log_every=1", "--gin_param=run.data_workers=0",
             "--gin_param=learning_rate_schedule.warmup_steps=1",
             f"--gin_param=run.data_dir='{tmp_path / 'data'}'"]
    capsys.readouterr()
    unchanged = digest(model_dir)
    for bad, message in (("lora.targets=('qq',)", "no parameter of the model trains"),
                         ("run.trainable='layer_[0'", "run.trainable='layer_[0' is not a "
                                                      "regular expression")):
        assert main([*train, f"--gin_param={bad}"]) == 2, bad
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and message in lines[-1], lines
        assert digest(model_dir) == unchanged
    assert main(train) == 0
    # stored once: the checkpoint holds the adapters alone, its meta names the base (step 0)
    before, after = saved_state(model_dir, 0), saved_state(model_dir, 4)
    base, stored = parameters.paths(before["params"]), parameters.paths(after["params"])
    assert stored and all(p.endswith(("_lora_a", "_lora_b")) for p in stored), list(stored)
    assert all(np.abs(v).max() > 0 for p, v in stored.items() if p.endswith("_lora_b"))
    # restored, the base weights are bit for bit the imported ones
    _, trained, _ = load(model_dir, mesh, "lora.rank=4", "lora.alpha=8.0")
    trained = parameters.paths(jax.device_get(trained))
    assert set(trained) == set(base) | set(stored)
    for path, value in base.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=path)
    for path, value in stored.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=path)
    # optimizer state: the adapters' alone (and scalars: the step count)
    state = [(jax.tree_util.keystr(p), leaf) for p, leaf in
             jax.tree_util.tree_leaves_with_path(after["opt_state"]) if np.ndim(leaf)]
    assert state and all("_lora_" in p for p, _ in state), [p for p, _ in state][:5]


@pytest.mark.slow  # (about 11 s)
def test_exported_adapter_and_merged_model_are_peft_s(adapted, tmp_path):
    """--mode=export --adapter writes the adapter as peft saved it (every tensor equal);
    without --adapter the merged weights, which give peft's merged logits once imported."""
    from mtrain.huggingface.tensors import Folder

    out = tmp_path / "adapter"
    assert main(["--mode=export", f"--model_dir={adapted}", f"--output_dir={out}",
                 "--adapter"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((open(os.path.join(ADAPTER, "adapter_config.json")).read()))
    for key in ("r", "lora_alpha", "use_rslora", "peft_type"):
        assert config[key] == theirs[key], key
    assert sorted(config["target_modules"]) == sorted(theirs["target_modules"])
    mine, peft = Folder(str(out), WEIGHTS), Folder(ADAPTER, WEIGHTS)
    assert mine.names() == peft.names()
    for name in peft.names():  # float32 copied and transposed: exactly
        np.testing.assert_array_equal(mine.read(name), peft.read(name), err_msg=name)

    merged = tmp_path / "merged"
    assert main(["--mode=export", f"--model_dir={adapted}", f"--output_dir={merged}"]) == 0
    import_folder(merged, tmp_path / "merged_import")
    exp, params, _ = load(tmp_path / "merged_import")
    got = lm_logits(exp.trainer.model, {"params": params}, oracle()["input_ids"])
    np.testing.assert_allclose(got, oracle()["merged_logits"], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.extended  # (a killed run resumed: test_signals')
def test_a_killed_lora_run_resumes_as_an_unbroken_one(tmp_path):
    """`python -m mtrain` with adapters, killed (SIGKILL) once its checkpoint of step 2 is
    written, then the same command: step 6 as an unbroken run's, bit for bit (the adapters,
    their optimizer state, the frozen base; with adapter dropout)."""
    from model_dirs import saved_state
    from test_user_paths import killed_when, mtrain

    home = tmp_path / "home"
    home.mkdir()
    import_folder(os.path.join(ORACLES, "llama_gqa"), tmp_path / "base")
    params = ["run.mesh_shape='batch:4;model:2'", "lora.rank=4", "lora.dropout=0.1",
              "run.batch_size=8", "run.sequence_length=32", "run.train_steps=6",
              "run.checkpoint_every=2", "run.data_workers=0"]
    states = {}
    for name in ("unbroken", "killed"):
        model_dir = tmp_path / name
        shutil.copytree(tmp_path / "base", model_dir)
        files = [f"--gin_file={model_dir}/config.gin"]
        if name == "killed":
            killed_when(model_dir / "checkpoints" / "2" / "meta", home, files, params, model_dir)
            assert "6" not in os.listdir(model_dir / "checkpoints")
        proc = mtrain(home, files, params, model_dir)
        assert proc.returncode == 0, proc.stderr[-2000:]
        states[name] = saved_state(model_dir, 6)
    jax.tree_util.tree_map(np.testing.assert_array_equal, states["unbroken"], states["killed"])


@pytest.mark.slow
def test_infer_with_the_adapter_continues_as_its_logits_say(adapted, tmp_path):
    """The decoding path (a key/value cache filled through adapted projections) gives the
    greedy continuation the adapted model's teacher-forced logits give."""
    prompt = str(oracle()["texts"][0])
    lines, out = tmp_path / "prompt.txt", tmp_path / "out.txt"
    lines.write_text(prompt + "\n")
    mesh = "run.mesh_shape='batch:4;model:2'"
    assert main([f"--gin_file={adapted}/config.gin", f"--model_dir={adapted}", "--mode=infer",
                 f"--input_file={lines}", f"--output_file={out}", f"--gin_param={mesh}",
                 "--gin_param=decoding.max_decode_length=6"]) == 0
    exp, params, vocab = load(adapted, mesh)
    logits_of = jax.jit(lambda ids: lm_logits(exp.trainer.model, {"params": params}, ids))
    ids = [exp.trainer.model.config.start_id, *vocab.encode(prompt)]
    read = len(ids)
    while len(ids) < read + 6 and ids[-1] != vocab.eos_id:
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(logits_of(padded))[0, len(ids) - 1])))
    assert out.read_text().splitlines() == [vocab.decode(ids[read:] + [vocab.eos_id])]


def _perturbed_folder(folder, out):
    """A copy of the Hugging Face folder `folder` whose first tensor is moved by 0.01."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + np.float32(0.01)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_a_lora_run_stores_its_base_once(tmp_path, capsys):
    """A LoRA run's checkpoints hold its adapters and optimizer state, and name the import
    they were trained on (kept whatever keep_checkpoints says); readers put the base back;
    resuming on another base is one line and changes nothing; init_from an import into a
    LoRA model stores its base once too."""
    from model_dirs import digest, saved_state

    model_dir = tmp_path / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir)
    flags = [f"--gin_file={model_dir}/config.gin", f"--model_dir={model_dir}",
             "--gin_param=run.mesh_shape='batch:4;model:2'", "--gin_param=lora.rank=4",
             "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=32",
             "--gin_param=run.checkpoint_every=2", "--gin_param=run.keep_checkpoints=1",
             "--gin_param=run.data_workers=0", f"--gin_param=run.data_dir='{tmp_path / 'd'}'"]
    assert main([*flags, "--gin_param=run.train_steps=4"]) == 0
    checkpoints = model_dir / "checkpoints"
    assert sorted(int(p) for p in os.listdir(checkpoints) if p.isdigit()) == [0, 4]
    meta = json.loads((checkpoints / "4" / "meta" / "metadata").read_text())
    assert meta["base"]["checkpoints"] == "" and meta["base"]["step"] == 0
    size = lambda step: sum(np.asarray(x).nbytes for x in  # noqa: E731
                            jax.tree.leaves(saved_state(model_dir, step)))
    # the adapters and their state (rank 4 of d_model 64: 9% of the weights they adapt;
    # the base's weights would make it over 100%)
    assert size(4) < 0.2 * size(0), (size(4), size(0))
    # (a reader merges the base back: test_lora_training_moves_the_adapters_alone's `load`,
    # bit for bit, and --mode=eval of the init_from run below)
    # another model imported in the base's place: resuming is refused, nothing changes
    other = tmp_path / "other"
    import_folder(_perturbed_folder(os.path.join(ORACLES, "llama_gqa"), tmp_path / "hf"), other)
    os.rename(checkpoints / "0", tmp_path / "kept0")
    shutil.copytree(other / "checkpoints" / "0", checkpoints / "0")
    unchanged = digest(model_dir)
    capsys.readouterr()
    assert main([*flags, "--gin_param=run.train_steps=6"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and "trained on other frozen parameters" in lines[-1], lines
    assert digest(model_dir) == unchanged
    shutil.rmtree(checkpoints / "0")
    os.rename(tmp_path / "kept0", checkpoints / "0")
    assert main([*flags, "--gin_param=run.train_steps=6"]) == 0
    # run.init_from an import, into a LoRA model: its checkpoints name that import
    tuned = tmp_path / "tuned"
    assert main([f"--gin_file={model_dir}/config.gin", f"--model_dir={tuned}",
                 *flags[2:], f"--gin_param=run.init_from='{model_dir}'",
                 f"--gin_param=vocabulary.path='{model_dir}/vocabulary.model'",
                 "--gin_param=run.init_step=0", "--gin_param=run.train_steps=2"]) == 0
    meta = json.loads((tuned / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["base"]["checkpoints"] == str(checkpoints) and meta["base"]["step"] == 0
    assert main([f"--gin_file={model_dir}/config.gin", f"--model_dir={tuned}", *flags[2:],
                 "--mode=eval"]) == 0
