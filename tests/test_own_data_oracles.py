"""A user's own data through the command line, against what transformers and torch computed
(../shared/oracles): chat and prompt/completion files evaluated by an imported Qwen2 with the
loss on the assistant's tokens (TRL's), and llama_gqa fine-tuned on a pre-tokenized file by
torch's AdamW steps (finetune.npz)."""

import json
import os

import jax
import numpy as np
import pytest

from test_finetune_exact import TORCH_ADAMW, finetune_oracle
from test_oracles import ORACLES, import_folder, lm_logits, load

from mtrain.__main__ import main
from mtrain.data.chat import ChatTemplate

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
SFT = os.path.join(ORACLES, "sft")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    import_folder(os.path.join(ORACLES, "qwen2"), root / "m")
    return root / "m"


def metrics(model_dir) -> list[dict]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def evaluate(model_dir, data_dir, *params) -> dict:
    args = [f"--gin_file={model_dir}/config.gin", "--mode=eval", f"--model_dir={model_dir}",
            f"--gin_param=run.data_dir='{data_dir}'", "--gin_param=run.task=@task()",
            "--gin_param=task.data=@files()", "--gin_param=run.batch_size=4",
            "--gin_param=run.sequence_length=128",
            "--gin_param=run.mesh_shape='batch:4;model:2'", *[f"--gin_param={p}" for p in params]]
    assert main(args) == 0
    return [m for m in metrics(model_dir) if "eval/loss" in m][-1]


def test_chat_file_evaluates_to_trls_assistant_only_loss(qwen2, tmp_path):
    """chat_qwen2.jsonl rendered by the import's own template, masked to the assistant's
    tokens: eval/loss is transformers' masked mean loss over its 76 tokens (1e-4: a mean of
    float32 log-probabilities against torch's)."""
    want = np.load(os.path.join(SFT, "chat_qwen2.npz"))
    got = evaluate(qwen2, tmp_path / "data", f"files.validation='{SFT}/chat_qwen2.jsonl'",
                   "files.format='chat'")
    assert got["eval/num_tokens"] == int(want["masked_tokens"])
    assert abs(got["eval/loss"] - float(want["masked_mean_loss"])) < 1e-4


def test_prompt_completion_file_evaluates_to_the_completions_loss(qwen2, tmp_path):
    want = np.load(os.path.join(SFT, "chat_qwen2.npz"))
    mask = want["pc_mask_flat"].astype(bool)
    loss = -want["pc_logprob_flat"][mask].mean()
    got = evaluate(qwen2, tmp_path / "data",
                   f"files.validation='{SFT}/chat_qwen2_prompt_completion.jsonl'",
                   "files.format='prompt_completion'")
    assert got["eval/num_tokens"] == mask.sum()
    assert abs(got["eval/loss"] - loss) < 1e-4


@pytest.mark.slow  # (test_finetune_exact holds the same steps in the fast tier)
def test_fine_tuning_on_a_pretokenized_file_takes_torchs_adamw_steps(tmp_path):
    """finetune.npz's batch as a JSONL of `input_ids`, read after the import's bos with
    nothing appended: three logged losses within 1e-5 relative of torch's (as
    test_finetune_exact, through the whole command line)."""
    want = finetune_oracle()
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n"
                            for row in want["targets"]))
    import_folder(os.path.join(ORACLES, "llama_gqa"), tmp_path / "m")
    args = [f"--gin_file={tmp_path}/m/config.gin", f"--model_dir={tmp_path}/m",
            f"--gin_param=run.data_dir='{tmp_path}/data'", "--gin_param=run.task=@task()",
            "--gin_param=task.data=@files()", f"--gin_param=files.train='{data}'",
            f"--gin_param=files.validation='{data}'", "--gin_param=files.format='pretokenized'",
            "--gin_param=run.train_steps=3", "--gin_param=run.log_every=1",
            "--gin_param=run.checkpoint_every=3", "--gin_param=run.data_workers=0",
            "--gin_param=run.mesh_shape='batch:2;model:4'",
            *[f"--gin_param={p}" for p in TORCH_ADAMW]]
    assert main(args) == 0
    losses = [m["train/loss"] for m in metrics(tmp_path / "m") if "train/loss" in m]
    np.testing.assert_allclose(losses, want["losses"], rtol=1e-5)


@pytest.mark.slow
def test_an_import_combines_with_a_task_file(qwen2, tmp_path):
    """A task file names data, not a vocabulary (its size is a default for runs that train
    one): an import's tokenizer and a shipped task go together (refused on ba310d7)."""
    args = [f"--gin_file={qwen2}/config.gin", "--gin_file=tasks/bible_lm.gin", "--mode=eval",
            f"--model_dir={qwen2}", f"--gin_param=run.data_dir='{tmp_path}/data'",
            "--gin_param=run.batch_size=8",
            "--gin_param=run.sequence_length=32", "--gin_param=run.mesh_shape='batch:8'"]
    assert main(args) == 0
    assert [m for m in metrics(qwen2) if "eval/loss" in m][-1]["eval/num_tokens"] > 1000


def test_infer_answers_conversations_as_the_template_renders_them(qwen2, tmp_path):
    """`--mode=infer` on a JSONL of conversations: each rendered by the import's ChatML
    template with its generation prompt, read as it is (no start id before it: Qwen has no
    bos), answered greedily up to <|im_end|> or EOS, and written back with the answer
    appended. The answers are recomputed here by teacher-forced passes of the same weights
    (the model's logits are transformers', test_oracles)."""
    conversations = [[{"role": "system", "content": "Answer in the words of Genesis."},
                      {"role": "user", "content": "Who made the heaven and the earth?"}],
                     [{"role": "user", "content": "And the earth was"}]]
    chats, answers = tmp_path / "chats.jsonl", tmp_path / "answers.jsonl"
    chats.write_text("".join(json.dumps({"id": k, "messages": c}) + "\n"
                             for k, c in enumerate(conversations)))
    flags = ["--gin_param=run.mesh_shape='batch:4;model:2'", "--gin_param=run.batch_size=4",
             "--gin_param=run.sequence_length=96", "--gin_param=decoding.max_decode_length=5"]
    assert main([f"--gin_file={qwen2}/config.gin", "--mode=infer", f"--model_dir={qwen2}",
                 f"--input_file={chats}", f"--output_file={answers}", *flags]) == 0
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    exp, params, vocab = load(qwen2, *[f[len("--gin_param="):] for f in flags])
    template = ChatTemplate((qwen2 / "chat_template.jinja").read_text(), vocab)
    assert vocab.piece(template.end_of_turn) == "<|im_end|>"
    # causal: padding after a sequence changes none of its logits, so one compiled length
    logits_of = jax.jit(lambda ids: lm_logits(exp.trainer.model, {"params": params}, ids))
    for k, (conversation, answer) in enumerate(zip(conversations, got, strict=True)):
        ids = template.prompt(conversation)
        read = len(ids)
        while len(ids) < read + 5 and ids[-1] not in (template.end_of_turn, vocab.eos_id):
            padded = np.zeros((1, 96), np.int32)
            padded[0, :len(ids)] = ids
            logits = np.asarray(logits_of(padded))[0, len(ids) - 1]
            ids.append(int(np.argmax(logits[:exp.trainer.classes or len(logits)])))
        new = ids[read:]
        new = new[:-1] if new[-1] in (template.end_of_turn, vocab.eos_id) else new
        assert answer == {"id": k, "messages": conversation + [
            {"role": "assistant", "content": vocab.decode(new + [vocab.eos_id])}]}
