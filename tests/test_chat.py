"""Chat and prompt/completion examples (`mtrain.data.chat`) against what ``transformers`` made
of them with Qwen2.5's tokenizer and its chat template (../shared/oracles/sft: the rendered
text, the ids, ``return_assistant_tokens_mask``; TRL's prompt + completion + EOS), the same
masks from the template without its ``{% generation %}`` marks (rendered prefix by prefix),
Llama 3's template (a BOS in the text, <|eot_id|>), the errors, and both vocabularies'
character offsets."""

import json
import os
import pickle

import numpy as np
import pytest

from test_oracles import ORACLES

from mtrain.data.chat import ChatError, ChatTemplate, check_messages, prompt_completion
from mtrain.huggingface import families
from mtrain.huggingface.vocabulary import chat_template, folder_vocabulary

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
SFT = os.path.join(ORACLES, "sft")
MARKS = ("{% generation %}", "{% endgeneration %}")


def vocabulary(name):
    folder = os.path.join(ORACLES, name)
    return folder_vocabulary(folder, families.settings(families.read_config(folder)))


@pytest.fixture(scope="module")
def qwen():
    return vocabulary("qwen2"), chat_template(os.path.join(ORACLES, "qwen2"))


@pytest.fixture(scope="module")
def sft():
    with open(os.path.join(SFT, "chat_qwen2.jsonl")) as f:
        chats = [json.loads(line)["messages"] for line in f]
    with open(os.path.join(SFT, "chat_qwen2_prompt_completion.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    return chats, pairs, dict(np.load(os.path.join(SFT, "chat_qwen2.npz")))


def ragged(o, name, i):
    offsets = o[f"{name}_offsets"]
    return [int(x) for x in o[f"{name}_flat"][offsets[i]:offsets[i + 1]]]


def test_conversations_as_transformers_makes_them(qwen, sft):
    vocab, source = qwen
    chats, _, o = sft
    template = ChatTemplate(source, vocab)
    assert template.marked and len(chats) == len(o["rendered"]) == 3
    masked = 0
    for i, messages in enumerate(chats):
        text, spans = template.render(messages)
        assert text == str(o["rendered"][i])
        assert [text[a:b] for a, b in spans] == [m["content"] + "<|im_end|>" for m in messages
                                                 if m["role"] == "assistant"]
        ids, mask = template.encode(messages, where=f"chat_qwen2.jsonl:{i + 1}")
        assert ids == ragged(o, "ids", i)
        assert mask == ragged(o, "mask", i)
        masked += sum(mask)
    assert masked == int(o["masked_tokens"]) == 76
    assert template.end_of_turn == vocab.token_id("<|im_end|>") == 495
    prompt = template.prompt(chats[0][:1])
    assert prompt == ragged(o, "ids", 0)[:len(prompt)]
    tail = vocab.encode("<|im_start|>assistant\n")
    assert prompt[-len(tail):] == tail and tail[0] == vocab.token_id("<|im_start|>")


def test_prompt_completion_as_trl_makes_it(qwen, sft):
    vocab, _ = qwen
    _, pairs, o = sft
    assert vocab.bos_id is None and len(pairs) == 2
    for i, pair in enumerate(pairs):
        assert [pair["prompt"], pair["completion"]] == [str(o["pc_prompts"][i]),
                                                      str(o["pc_completions"][i])]
        ids, mask = prompt_completion(vocab, pair["prompt"], pair["completion"])
        assert ids == ragged(o, "pc_ids", i) and ids[-1] == vocab.eos_id
        assert mask == ragged(o, "pc_mask", i)


def test_without_generation_marks_the_prefix_rule_gives_the_same_masks(qwen, sft):
    vocab, source = qwen
    chats, _, o = sft
    assert all(mark in source for mark in MARKS)
    bare = ChatTemplate(source.replace(MARKS[0], "").replace(MARKS[1], ""), vocab)
    assert not bare.marked and bare.end_of_turn == 495
    for i, messages in enumerate(chats):
        assert bare.render(messages) == (str(o["rendered"][i]), [])
        assert bare.encode(messages) == (ragged(o, "ids", i), ragged(o, "mask", i))
    # a template whose earlier turns change with later ones cannot be read prefix by prefix
    shifty = ("{% for m in messages %}{{ m.role }}{{ messages | length }}: {{ m.content }}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatError, match=r"^f:3: the chat template does not render "
                                        r"conversations prefix by prefix") as e:
        ChatTemplate(shifty, vocab).encode(chats[0], where="f:3")
    assert "\n" not in str(e.value)


def test_errors_are_one_line(qwen, sft):
    vocab, source = qwen
    chats, _, _ = sft
    strict = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
              "{{ raise_exception('Only user and\nassistant roles are supported!') }}"
              "{% endif %}{{ m.content }}{% endfor %}")
    template = ChatTemplate(strict, vocab, name="strict.jinja")
    with pytest.raises(ChatError) as e:
        template.encode(chats[1], where="chats.jsonl:2")
    assert str(e.value) == ("chats.jsonl:2: strict.jinja rejects this conversation: Only user "
                            "and assistant roles are supported!")
    qwen_template = ChatTemplate(source, vocab)
    with pytest.raises(ChatError, match=r"^a:1: message 1 has an unknown role 'robot' "):
        qwen_template.encode([chats[0][0], {"role": "robot", "content": "hi"}], where="a:1")
    with pytest.raises(ChatError, match=r"^a:2: message 0 is not a"):
        check_messages([{"role": "user", "content": None}], "a:2")
    with pytest.raises(ChatError) as e:
        qwen_template.encode(chats[0][:1], where="chats.jsonl:9")
    assert str(e.value) == ("chats.jsonl:9: no assistant tokens in this conversation with the "
                            "chat template")
    with pytest.raises(ChatError, match=r"^broken.jinja is not a jinja2 template: .*\(line 1\)$"):
        ChatTemplate("{% for m in messages %}", vocab, name="broken.jinja")
    with pytest.raises(ChatError, match=r"^the chat template cannot render this conversation: "):
        ChatTemplate("{{ messages[0].content + 1 }}", vocab).render(chats[0])
    macro = ("{% macro say(m) %}: {% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}"
             "{% for m in messages %}<{{ m.role }}>{{ say(m) }}{% endfor %}")
    with pytest.raises(ChatError, match="inside a macro"):
        ChatTemplate(macro, vocab).encode(chats[0])


def test_llama3_template_has_a_bos_and_ends_turns_with_eot(sft):
    vocab = vocabulary("llama3")
    template = ChatTemplate(chat_template(os.path.join(ORACLES, "llama3")), vocab)
    chats, _, _ = sft
    text, spans = template.render(chats[0])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert template.end_of_turn == vocab.token_id("<|eot_id|>") != vocab.eos_id
    ids, mask = template.encode(chats[1])
    assert ids[0] == vocab.bos_id and ids.count(vocab.bos_id) == 1
    ends = [k for k, i in enumerate(ids) if i == template.end_of_turn]
    assert len(ends) == 5 and [mask[k] for k in ends] == [0, 0, 1, 0, 1]
    said = [vocab.decode([i for i, m in zip(ids, mask) if m and i != template.end_of_turn])]
    assert said == [chats[1][2]["content"] + chats[1][4]["content"]]
    again = pickle.loads(pickle.dumps(template))
    assert again.encode(chats[1]) == (ids, mask) and again.name == template.name


def test_character_offsets_of_both_vocabularies():
    text = "Théâtre — 日本語 ü  x</s>y"
    sp = vocabulary("llama_gqa")
    assert sp.token_id("</s>") == sp.eos_id and sp.token_id("no such piece") is None
    ids, offsets = sp.encode_with_offsets(text)
    assert ids == sp.encode(text)
    covered = [c for start, end in dict.fromkeys(offsets) for c in range(start, end)]
    assert covered == list(range(len(text)))  # in order, each character once
    spelled = {}
    for i, (start, end) in zip(ids, offsets):
        piece = sp.piece(i)
        if piece.startswith("<0x"):  # a byte of a character spelled byte by byte
            spelled.setdefault((start, end), bytearray()).append(int(piece[3:5], 16))
        else:
            assert piece.replace("\u2581", " ").strip() == text[start:end].strip()
    assert {text[a:b]: bytes(v) for (a, b), v in spelled.items()} == {
        c: c.encode() for c in "éâ—日本語ü<>/"}
    ids, offsets = sp.encode_with_offsets(text, specials=True)
    assert sp.eos_id in ids and text[slice(*offsets[ids.index(sp.eos_id)])] == "</s>"
    assert sp.is_special(sp.eos_id) and not sp.is_special(ids[0])

    bpe = vocabulary("qwen2")
    ids, offsets = bpe.encode_with_offsets(text + "<|im_end|>")
    assert ids == bpe.encode(text + "<|im_end|>") and ids[-1] == 495 and bpe.is_special(495)
    assert offsets[-1] == (len(text), len(text) + 10) and not bpe.is_special(ids[0])
    assert "".join(text[a:b] for a, b in dict.fromkeys(offsets[:-1])) == text
