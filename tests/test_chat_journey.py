"""A user's chat fine-tune, from an empty HOME and data dir (no fixture prepares anything):
import Qwen2.5 (the oracle folder, as published), fine-tune it 50 steps on a chat JSONL,
run the same command again (nothing to do, nothing prepared again), evaluate with the
model dir's config.gin alone, answer a conversation, export. Every bad input on the way
stops in one line with exit 2 and leaves the model dir and the data dir as they were."""

import json
import os

import pytest

from model_dirs import digest
from test_oracles import ORACLES

from mtrain.__main__ import main
from mtrain.data.sources import BibleLM

pytestmark = [pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles"),
              pytest.mark.slow]

SYSTEM = {"role": "system", "content": "Answer in the words of the King James Bible."}


def write_chats(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def verses_as_chats(n=60):
    verses = list(BibleLM("en").texts("train", limit=n + 1))
    return [[SYSTEM, {"role": "user", "content": f"What follows: {a}"},
             {"role": "assistant", "content": b}] for a, b in zip(verses, verses[1:])]


def last_line(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_a_chat_fine_tune_from_an_empty_home(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MTRAIN_DATA_DIR", raising=False)
    data = home / ".cache" / "mtrain"  # the default data dir
    model = tmp_path / "qwen_chat"
    assert main(["--mode=import", f"--input_dir={ORACLES}/qwen2", f"--model_dir={model}"]) == 0
    chats = write_chats(tmp_path / "chats.jsonl", verses_as_chats())
    train = [f"--gin_file={model}/config.gin", f"--model_dir={model}",
             "--gin_param=run.task=@task()", "--gin_param=task.data=@files()",
             f"--gin_param=files.train='{chats}'", "--gin_param=files.validation=0.1",
             "--gin_param=files.format='chat'", "--gin_param=run.batch_size=8",
             "--gin_param=run.sequence_length=64", "--gin_param=run.mesh_shape='batch:4;model:2'",
             "--gin_param=run.checkpoint_every=50", "--gin_param=run.log_every=10"]
    capsys.readouterr()
    assert main([*train, "--gin_param=run.train_steps=50"]) == 0
    err = capsys.readouterr().err
    assert "carry loss" in err and "WARNING" not in err, err[-2000:]
    with open(model / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 5 and losses[-1] < losses[0], losses  # it learns the verses
    assert sorted(os.listdir(model / "checkpoints")) == ["0", "50"]
    prepared = sorted(os.listdir(data / "prepared"))
    assert len(prepared) == 1
    saved = {"data": digest(data), "checkpoints": digest(model / "checkpoints")}

    # The same command again: nothing to train, nothing prepared again.
    assert main([*train, "--gin_param=run.train_steps=50"]) == 0
    assert "nothing to train" in capsys.readouterr().err
    assert {"data": digest(data), "checkpoints": digest(model / "checkpoints")} == saved

    # Evaluated with the model dir's config.gin alone: it names the files and the format.
    assert main([f"--gin_file={model}/config.gin", f"--model_dir={model}", "--mode=eval",
                 "--gin_param=run.mesh_shape='batch:4;model:2'"]) == 0
    with open(model / "metrics.jsonl") as f:
        evaluated = [json.loads(line) for line in f if "eval/loss" in line][-1]
    assert evaluated["step"] == 50 and evaluated["eval/num_tokens"] > 0

    # A conversation answered, written back with the answer appended.
    ask = tmp_path / "ask.jsonl"
    ask.write_text(json.dumps({"messages": verses_as_chats(2)[1][:2]}) + "\n")
    answers = tmp_path / "answers.jsonl"
    assert main([f"--gin_file={model}/config.gin", f"--model_dir={model}", "--mode=infer",
                 f"--input_file={ask}", f"--output_file={answers}",
                 "--gin_param=run.mesh_shape='batch:4;model:2'",
                 "--gin_param=run.sequence_length=128",
                 "--gin_param=decoding.max_decode_length=16"]) == 0
    [answer] = [json.loads(line) for line in answers.read_text().splitlines()]
    assert answer["messages"][:2] == verses_as_chats(2)[1][:2]
    assert answer["messages"][2]["role"] == "assistant"
    assert isinstance(answer["messages"][2]["content"], str)

    # Exported as a Hugging Face folder, its chat template with it.
    out = tmp_path / "export"
    assert main(["--mode=export", f"--model_dir={model}", f"--output_dir={out}"]) == 0
    assert (out / "chat_template.jinja").read_text() == \
        (model / "chat_template.jinja").read_text()
    assert (out / "model.safetensors").exists() or list(out.glob("model-*.safetensors"))

    # Bad inputs: one line each, exit 2, the model dir and the data dir as they were.
    saved = {"data": digest(data), "model": digest(model)}
    robot = verses_as_chats(3)
    robot[2][1] = {"role": "robot", "content": "beep"}
    silent = verses_as_chats(3)
    silent[1] = silent[1][:2]  # no assistant: nothing to learn from it
    rejecting = tmp_path / "rejecting.jinja"
    rejecting.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    cases = {
        "unknown role": ([f"--gin_param=files.train='{write_chats(tmp_path / 'r.jsonl', robot)}'"],
                         "r.jsonl line 3: message 1 has an unknown role 'robot'"),
        "no assistant": ([f"--gin_param=files.train='{write_chats(tmp_path / 's.jsonl', silent)}'"],
                         "s.jsonl line 2: no assistant tokens in this conversation with"),
        "template rejects": ([f"--gin_param=files.chat_template='{rejecting}'"],
                             "rejects this conversation: System role not supported"),
    }
    capsys.readouterr()
    for name, (flags, message) in cases.items():
        assert main([*train, "--gin_param=run.train_steps=60", *flags]) == 2, name
        lines = last_line(capsys)
        assert len(lines) <= 3 and message in lines[-1], (name, lines)
        assert {"data": digest(data), "model": digest(model)} == saved, name
    bad_asks = {"not JSON": ("In the beginning\n", "--input_file line 1: a .jsonl file"),
                "unknown role": (json.dumps({"messages": [{"role": "robot", "content": "x"}]})
                                 + "\n", "message 0 has an unknown role 'robot'")}
    for name, (text, message) in bad_asks.items():
        ask.write_text(text)
        answers.unlink(missing_ok=True)
        assert main([f"--gin_file={model}/config.gin", f"--model_dir={model}", "--mode=infer",
                     f"--input_file={ask}", f"--output_file={answers}",
                     "--gin_param=run.mesh_shape='batch:4;model:2'"]) == 2, name
        lines = last_line(capsys)
        assert len(lines) <= 3 and message in lines[-1], (name, lines)
        assert not answers.exists()
        assert {"data": digest(data), "model": digest(model)} == saved, name
