"""A family is a record (`mtrain.huggingface.records`): import, export and the refusals read
it; the model dir records the family it was imported as, and export reads that, never
guessing. And the user's paths through it, from an empty HOME and data dir as typed: an
import's config.gin fine-tunes (AdamW at a fine-tuning rate: the eval loss falls), an
adapter of another base is refused in one line (``--ignore_adapter_base`` insists), and an
exported adapter names the Hugging Face folder its base came from."""

import ast
import json
import os
import shutil

import pytest

from test_oracles import ORACLES

from mtrain.__main__ import main
from mtrain.huggingface import adapters, families, records

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mtrain")
MESH = "run.mesh_shape='batch:4;model:2'"  # (the tests' 8 simulated devices)
CHAT = {"role": "system", "content": "Answer in the words of the King James Bible."}


@pytest.fixture
def home(fresh_home, tmp_path, monkeypatch):
    """An empty HOME, no data dir set (`conftest.fresh_home`), in a new working directory:
    the user's first command."""
    monkeypatch.chdir(tmp_path)
    return fresh_home


def refused(capsys, argv, *fragments):
    capsys.readouterr()
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3, lines
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


def chats(path, n=64):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [
                CHAT, {"role": "user", "content": f"Say verse {i}."},
                {"role": "assistant", "content": "In the beginning God created the heaven "
                                                 "and the earth."}]}) + "\n")
    return path


def test_no_module_of_huggingface_names_a_family_but_the_records():
    """No string of a family's name (its architecture or model_type) in huggingface/ outside
    records.py, and no family guessed from settings (``family_of``) anywhere."""
    names = {n for r in records.RECORDS for n in (r.architecture, r.model_type)}
    folder = os.path.join(PACKAGE, "huggingface")
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".py") or file == "records.py":
            continue
        tree = ast.parse(open(os.path.join(folder, file)).read())
        found = [n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value in names]
        assert not found, (file, found)
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                assert "family_of" not in open(os.path.join(root, file)).read(), file


@pytest.mark.parametrize("folder, family", [
    ("llama_gqa", "LlamaForCausalLM"), ("llama3", "LlamaForCausalLM"),
    ("mistral_sw", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ("mixtral", "MixtralForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"), ("gpt_oss", "GptOssForCausalLM"),
    ("t5_1_1", "T5ForConditionalGeneration")])
def test_a_model_trained_here_exports_as_the_first_family_with_its_settings(folder, family):
    """With no record of an import, a model's settings pick the family (`of_model`): each
    oracle's settings give back its own family, and each record accepts its own settings."""
    from mtrain import config

    settings, vocab = config.parse_import_config([], [], os.path.join(ORACLES, folder))
    c = config.model_config(512)
    assert settings.family == family
    assert families.of_model(c).architecture == family
    hf = families.hf_config(records.named(family), c, 512, vocab.eos_id, vocab.bos_id)
    assert hf["architectures"] == [family]
    if family == "Qwen2ForCausalLM":  # another family's record refuses it, naming why
        with pytest.raises(families.ConversionError, match="transformer.attention_bias"):
            families.hf_config(records.named("LlamaForCausalLM"), c, 512, vocab.eos_id, 1)


def test_adapter_bases_are_compared_by_their_last_names():
    bases = ["../shared/oracles/llama_gqa", None]
    assert adapters.same_base("llama_gqa", bases)
    assert adapters.same_base("someone/llama_gqa", bases)
    assert adapters.same_base("/x/models--someone--llama_gqa/snapshots/0123abc", bases)
    assert adapters.same_base(None, bases) and adapters.same_base("", bases)
    assert not adapters.same_base("qwen2", bases)
    assert adapters.same_base("Qwen/Qwen2.5-0.5B", ["runs/hf/Qwen2.5-0.5B/", "qwen"])


def test_an_adapter_of_another_base_is_refused_and_exports_name_the_real_base(
        home, tmp_path, capsys):
    """The issue's command (a Llama adapter onto Qwen2, whose shapes match) is refused in one
    line, nothing written; --ignore_adapter_base insists. An adapter imported with its base
    exports naming that folder (not the model dir); without huggingface.json (an older
    mtrain's import) the step-0 checkpoint says which family it is. The import's config.gin
    fine-tunes: AdamW at a constant rate."""
    qwen, llama = os.path.join(ORACLES, "qwen2"), os.path.join(ORACLES, "llama_gqa")
    adapter = os.path.join(ORACLES, "lora_llama_gqa")
    refused(capsys, ["--mode=import", f"--input_dir={qwen}", f"--adapter_dir={adapter}",
                     "--model_dir=runs/wrong"],
            "is of 'llama_gqa'", "not of", "--ignore_adapter_base")
    assert not os.path.exists("runs/wrong")
    assert main(["--mode=import", f"--input_dir={qwen}", f"--adapter_dir={adapter}",
                 "--model_dir=runs/insisted", "--ignore_adapter_base"]) == 0
    # a renamed copy of the right base: another name, refused the same way
    shutil.copytree(llama, tmp_path / "my_llama")
    refused(capsys, ["--mode=import", f"--input_dir={tmp_path / 'my_llama'}",
                     f"--adapter_dir={adapter}", "--model_dir=runs/copy"], "is of 'llama_gqa'")
    assert main(["--mode=import", f"--input_dir={llama}", f"--adapter_dir={adapter}",
                 "--model_dir=runs/adapted"]) == 0
    written = (tmp_path / "runs" / "adapted" / "config.gin").read_text()
    for line in ("run.optimizer = @adamw", "learning_rate_schedule.shape = 'constant'",
                 "learning_rate_schedule.constant = 0.0001", "adamw.weight_decay = 0.0"):
        assert line in written, line
    record = json.loads((tmp_path / "runs" / "adapted" / "huggingface.json").read_text())
    assert record == {"architecture": "LlamaForCausalLM", "source": os.path.abspath(llama),
                      "adapter": os.path.abspath(adapter)}
    assert main(["--mode=export", "--model_dir=runs/adapted", "--output_dir=runs/out",
                 "--adapter"]) == 0
    config = json.loads((tmp_path / "runs" / "out" / adapters.CONFIG).read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(llama)
    # An import of an older mtrain (no huggingface.json): its step 0's meta is the record.
    os.remove(tmp_path / "runs" / "adapted" / "huggingface.json")
    assert main(["--mode=export", "--model_dir=runs/adapted", "--output_dir=runs/older"]) == 0
    config = json.loads((tmp_path / "runs" / "older" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow  # (two runs of one step)
def test_a_run_started_from_an_import_exports_its_base_and_one_from_scratch_its_dir(
        home, tmp_path, capsys):
    """A run started from an import with its adapter (``run.init_from``, as DPO starts from
    an SFT run) has no record of its own: its adapter names the import's folder. The same
    model trained here from scratch exports as the first family with its settings."""
    llama, adapter = os.path.join(ORACLES, "llama_gqa"), os.path.join(ORACLES, "lora_llama_gqa")
    assert main(["--mode=import", f"--input_dir={llama}", f"--adapter_dir={adapter}",
                 "--model_dir=runs/adapted"]) == 0
    # A run started from it (as DPO starts from an SFT run), one step on a text file.
    (tmp_path / "verses.txt").write_text("In the beginning God created the heaven.\n" * 16)
    one_step = ["--gin_file=runs/adapted/config.gin", "--gin_param=run.task=@task()",
                "--gin_param=task.data=@files()", "--gin_param=files.train='verses.txt'",
                "--gin_param=files.validation=0.25", "--gin_param=files.format='text'",
                "--gin_param=run.batch_size=8", "--gin_param=run.sequence_length=64",
                f"--gin_param={MESH}", "--gin_param=run.train_steps=1",
                "--gin_param=run.eval_every=0", "--gin_param=run.data_workers=0"]
    assert main([*one_step, "--model_dir=runs/next",
                 "--gin_param=run.init_from='runs/adapted'"]) == 0
    assert not (tmp_path / "runs" / "next" / "huggingface.json").exists()
    assert main(["--mode=export", "--model_dir=runs/next", "--output_dir=runs/next_out",
                 "--adapter"]) == 0
    config = json.loads((tmp_path / "runs" / "next_out" / adapters.CONFIG).read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(llama)
    # The same model trained here from scratch: no record; its settings are a Llama's, and
    # its adapter names the model dir as its base (a line says so).
    assert main([*one_step, "--model_dir=runs/scratch",  # (the import's tokenizer)
                 "--gin_param=vocabulary.path='runs/adapted/vocabulary.model'"]) == 0
    capsys.readouterr()
    assert main(["--mode=export", "--model_dir=runs/scratch", "--output_dir=runs/s_out"]) == 0
    config = json.loads((tmp_path / "runs" / "s_out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert main(["--mode=export", "--model_dir=runs/scratch", "--output_dir=runs/s_adapter",
                 "--adapter"]) == 0
    assert "records no Hugging Face import" in capsys.readouterr().err
    config = json.loads((tmp_path / "runs" / "s_adapter" / adapters.CONFIG).read_text())
    assert config["base_model_name_or_path"] == os.path.abspath("runs/scratch")


@pytest.mark.slow  # (20 LoRA steps; the config it trains with is checked in the fast tier)
def test_an_imports_fine_tuning_defaults_lower_the_eval_loss(home, tmp_path, capsys):
    """The README's LoRA fine-tune as typed: the import's config.gin trains with AdamW at
    a fine-tuning rate (not Adafactor's rsqrt warmup of 10,000 steps, under which 20 steps
    moved the eval loss by 1e-4), and 20 steps lower the held-out loss by more than 0.05
    (measured: 6.7162 -> 6.5965; the rsqrt schedule's run: 6.7161)."""
    assert main(["--mode=import", f"--input_dir={ORACLES}/qwen2",
                 "--model_dir=runs/qwen_lora"]) == 0
    written = (tmp_path / "runs" / "qwen_lora" / "config.gin").read_text()
    assert "run.optimizer = @adamw" in written
    assert "learning_rate_schedule.shape = 'constant'" in written
    chats(tmp_path / "runs" / "chat.jsonl")
    data = ["--gin_param=run.task=@task()", "--gin_param=task.data=@files()",
            "--gin_param=files.train='runs/chat.jsonl'", "--gin_param=files.validation=0.1",
            "--gin_param=files.format='chat'", "--gin_param=run.batch_size=8",
            "--gin_param=run.sequence_length=64", f"--gin_param={MESH}"]
    model = ["--gin_file=runs/qwen_lora/config.gin", "--model_dir=runs/qwen_lora"]
    assert main([*model, "--mode=eval", *data]) == 0  # the import, step 0
    assert main([*model, "--gin_param=lora.rank=8", *data,
                 "--gin_param=run.train_steps=20"]) == 0
    with open(tmp_path / "runs" / "qwen_lora" / "metrics.jsonl") as f:
        evals = [json.loads(line) for line in f if "eval/loss" in line]
    before, after = evals[0]["eval/loss"], evals[-1]["eval/loss"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 20
    assert after < before - 0.05, (before, after)
