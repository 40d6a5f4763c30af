"""Tokenizers as published models ship them (../shared/oracles): byte-level BPE
``tokenizer.json`` files whose id 0 is an ordinary piece ("!") and whose specials are the
last ids (Llama 3; Qwen, with no BOS and 496 ids under 512 rows), Gemma's sentencepiece
ids (pad 0, EOS 1, BOS 2, UNK 3), a sentencepiece model whose id 0 is an ordinary piece;
texts holding id 0 scored and continued whole through the command line; the chat template
kept by the import and written back by the export, from either place a folder keeps it;
and the work dirs of imports and exports (`mtrain.io.work_dirs`): what a killed one leaves
is cleared by the next, what the user made is never touched.

Texts holding id 0 go through `llama_gqa`'s weights (vocabulary 512) with Llama 3's
tokenizer.json in place of its sentencepiece file (a tokenizer whose id 0 is "!"), checked
against the model's own forward passes; today's families' folders (Llama 3, Qwen2.5, Qwen3,
Qwen3-MoE, Gemma 3, Mistral with a window) are imported and their texts continued and
scored through the command line as Hugging Face did (`oracle.npz`).
"""

import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import sentencepiece as spm

from test_oracles import ORACLES, import_folder, lm_logits, load, oracle

from mtrain.__main__ import main
from mtrain.data.vocabulary import Vocabulary, load_vocabulary
from mtrain.huggingface.vocabulary import chat_template, tokenizer_json_vocabulary
from mtrain.io import work_dirs

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
TOKENIZER_JSON_FOLDERS = ("llama3", "qwen2", "qwen3", "qwen3_moe")
BANG = "Let there be light!"  # "!" is id 0 of every tokenizer.json folder
LAYOUT = ["--gin_param=run.mesh_shape='batch:4;model:2'",
          "--gin_param=run.layout_rules='batch:batch;d_ff:model;heads:model;vocab:model'"]


def ragged(o, name, i):
    offsets = o[f"{name}_offsets"]
    return [int(x) for x in o[f"{name}_flat"][offsets[i]:offsets[i + 1]]]


def config_of(name) -> dict:
    with open(os.path.join(ORACLES, name, "config.json")) as f:
        return json.load(f)


def folder_vocab(name):
    config = config_of(name)
    pad = config.get("pad_token_id")
    return tokenizer_json_vocabulary(os.path.join(ORACLES, name), config["eos_token_id"],
                                     config.get("bos_token_id"),
                                     pad if isinstance(pad, int) else None)


@pytest.mark.parametrize("name", TOKENIZER_JSON_FOLDERS)
def test_tokenizer_json_folders_encode_to_the_oracle_ids_and_decode_back(name, tmp_path):
    vocab, o, config = folder_vocab(name), oracle(name), config_of(name)
    qwen = name.startswith("qwen")
    assert (vocab.vocab_size, vocab.eos_id, vocab.bos_id) == (
        (496, 493, None) if qwen else (512, 508, 507))
    assert vocab.pad_id == (493 if qwen else None)  # tokenizer_config.json's pad_token
    assert vocab.unk_id is None and vocab.piece(0) == "!"  # a byte-level BPE's
    for i, text in enumerate(map(str, o["texts"])):
        ids = ragged(o, "text_ids", i)
        assert vocab.encode(text) == ids
        assert vocab.decode(ids) == text
        assert vocab.decode(ids + [vocab.eos_id] + ids) == text  # stops at the EOS
        assert isinstance(vocab.decode(ragged(o, "text_greedy", i)), str)
    ids = vocab.encode(BANG)
    assert ids[-1] == 0 and vocab.decode(ids) == BANG
    assert vocab.encode_example(BANG, 64) == (ids + [vocab.eos_id], False)  # (score's)
    values, splits = vocab.encode_batch([BANG, str(o["texts"][0])], add_eos=True)
    assert values[:splits[1]].tolist() == ids + [vocab.eos_id]
    # its file, read back; and as Grain's workers receive it
    vocab.save(tmp_path / "vocabulary.model")
    again = load_vocabulary(tmp_path / "vocabulary.model")
    assert again.digest == vocab.digest and again.pad_id == vocab.pad_id
    assert pickle.loads(pickle.dumps(vocab)).encode(BANG) == ids
    assert config["vocab_size"] >= vocab.vocab_size


def test_qwen3_continuations_past_the_tokenizer_decode_to_nothing():
    """Qwen's spare rows (496-511) have no token; Hugging Face's greedy picks them here
    (the oracle's): they decode to nothing rather than fail."""
    vocab, o = folder_vocab("qwen3"), oracle("qwen3")
    greedy = ragged(o, "text_greedy", 1)
    assert 507 in greedy and 0 in greedy
    assert vocab.decode(greedy) == vocab.decode([i for i in greedy if i < 496])


def test_gemma3_sentencepiece_ids():
    vocab, o = load_vocabulary(os.path.join(ORACLES, "gemma3", "tokenizer.model")), oracle("gemma3")
    assert (vocab.pad_id, vocab.eos_id, vocab.bos_id, vocab.unk_id) == (0, 1, 2, 3)
    assert list(o["text_prefix"]) == [2]
    for i, text in enumerate(map(str, o["texts"])):
        assert vocab.encode(text) == ragged(o, "text_ids", i)
        assert vocab.decode(ragged(o, "text_ids", i) + [1, 5, 6]) == text


def test_a_sentencepiece_model_whose_id_0_is_an_ordinary_piece():
    """No pad, UNK 1, EOS 2: id 0 is the piece "he" (refused before: id 0 had to be the pad
    or the unknown piece). A text holding it keeps it, encoded and decoded."""
    model = io.BytesIO()
    texts = ["In the beginning God created the heaven and the earth!",
             "And God said, Let there be light: and there was light."] * 50
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                   model_type="bpe", vocab_size=60, pad_id=-1, bos_id=-1,
                                   unk_id=1, eos_id=2, minloglevel=2)
    vocab = Vocabulary(model.getvalue())
    assert vocab.piece(0) == "he" and vocab.pad_id is None and vocab.unk_id == 1
    ids, cut = vocab.encode_example("the heaven", 16)
    assert 0 in ids and ids[-1] == 2 and not cut
    assert vocab.decode(ids) == "the heaven"
    assert vocab.decode([0, 0, 2, 0]) == "hehe"


def test_mtrains_own_vocabulary_still_skips_its_pad(tmp_path):
    """T5's conventions (pad 0, EOS 1, UNK 2): decoding skips the pad as before."""
    from mtrain.data.vocabulary import train_vocabulary

    vocab = train_vocabulary(["In the beginning God created the heaven and the earth."] * 20,
                             20, tmp_path / "v.model")
    ids = vocab.encode("the earth")
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    assert vocab.decode([0] + ids + [0, 1] + ids) == "the earth"


# --- through the command line: llama_gqa's weights with Llama 3's tokenizer.json ---------


def bang_folder(tmp_path, template="jinja"):
    """llama_gqa with llama3's tokenizer (BOS 507, EOS 508; id 0 "!") and chat template:
    as `template` 'jinja' (chat_template.jinja), 'config' (tokenizer_config.json's
    chat_template, as older folders keep it) or None."""
    folder = tmp_path / "hf"
    shutil.copytree(os.path.join(ORACLES, "llama_gqa"), folder,
                    ignore=shutil.ignore_patterns("*.npz", "tokenizer.model"))
    llama3 = os.path.join(ORACLES, "llama3")
    shutil.copy(os.path.join(llama3, "tokenizer.json"), folder)
    shutil.copy(os.path.join(llama3, "tokenizer_config.json"), folder)
    text = open(os.path.join(llama3, "chat_template.jinja"), encoding="utf-8").read()
    if template == "jinja":
        shutil.copy(os.path.join(llama3, "chat_template.jinja"), folder)
    elif template == "config":
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"chat_template": text}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"bos_token_id": 507,
                                                              "eos_token_id": 508}))
    return folder, text


def greedy_after(model, params, prefix, new, eos):
    """At most `new` ids after `prefix` by the model's argmax, recomputed over the whole
    sequence each time (no cache), ending after `eos`."""
    seq = list(prefix)
    for _ in range(new):
        seq.append(int(np.argmax(np.asarray(lm_logits(model, {"params": params}, [seq]))[0, -1])))
        if seq[-1] == eos:
            break
    return seq[len(prefix):]


@pytest.mark.slow  # (fast siblings: id 0 through sampling and qwen3_moe's infer; export in test_huggingface)
def test_texts_holding_id_0_are_scored_and_continued_whole(tmp_path, data_dir):
    """--mode=score scores every id of a text whose ids include 0 (the log-probabilities
    the model gives, after the BOS), and --mode=infer continues it after all of it."""
    folder, _ = bang_folder(tmp_path)
    import_folder(folder, tmp_path / "m")
    exp, params, vocab = load(tmp_path / "m")
    model = exp.trainer.model
    texts = [BANG, "In the beginning!!"]
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in texts))
    common = [f"--gin_file={tmp_path / 'm' / 'config.gin'}", f"--model_dir={tmp_path / 'm'}",
              f"--input_file={tmp_path / 'in.txt'}", *LAYOUT]
    assert main([*common, "--mode=score", f"--output_file={tmp_path / 'scores.jsonl'}",
                 f"--output_dir={tmp_path / 'measured'}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    for text, row in zip(texts, rows):
        ids = vocab.encode(text) + [508]
        assert 0 in ids and row["tokens"] == len(ids) and row["unknown_pieces"] == 0
        logits = np.asarray(lm_logits(model, {"params": params}, [[507] + ids[:-1]]))[0]
        logp = jax.nn.log_softmax(logits.astype(np.float64), axis=-1)
        want = float(sum(logp[i, t] for i, t in enumerate(ids)))
        assert abs(row["log_likelihood"] - want) < 1e-3, (text, row, want)
    assert main([*common, "--mode=infer", f"--output_file={tmp_path / 'out.txt'}",
                 "--gin_param=decoding.max_decode_length=6"]) == 0
    want = [vocab.decode(greedy_after(model, params, [507] + vocab.encode(t), 6, 508))
            for t in texts]
    assert (tmp_path / "out.txt").read_text() == "".join(f"{w}\n" for w in want)


@pytest.mark.parametrize("form", ["jinja", "config"])
def test_the_chat_template_is_kept_and_exported(tmp_path, form):
    """From chat_template.jinja (transformers 5) or tokenizer_config.json (older folders)
    into the model dir's chat_template.jinja; exported back to both, with the tokenizer's
    special tokens named in tokenizer_config.json; the export imports again."""
    folder, text = bang_folder(tmp_path, form)
    import_folder(folder, tmp_path / "m")
    assert (tmp_path / "m" / "chat_template.jinja").read_text(encoding="utf-8") == text
    out = tmp_path / "new" / "dirs" / "out"  # (the parents made as they are needed)
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}", f"--output_dir={out}"]) == 0
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == text
    settings = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert settings["chat_template"] == text
    assert (settings["tokenizer_class"], settings["bos_token"], settings["eos_token"]) == (
        "PreTrainedTokenizerFast", "<|begin_of_text|>", "<|end_of_text|>")
    assert settings["pad_token"] is None and settings["unk_token"] is None
    assert chat_template(out) == text
    import_folder(out, tmp_path / "again")
    assert (tmp_path / "again" / "chat_template.jinja").read_text(encoding="utf-8") == text
    assert (load_vocabulary(tmp_path / "again" / "vocabulary.model").digest
            == load_vocabulary(tmp_path / "m" / "vocabulary.model").digest)


def test_chat_template_forms(tmp_path):
    """None without one; a list of named templates keeps the one named 'default'; one
    that is not a string is refused in one line."""
    assert chat_template(os.path.join(ORACLES, "llama_gqa")) is None
    assert chat_template(os.path.join(ORACLES, "gemma3")).startswith("{{ bos_token }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert chat_template(tmp_path) == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(Exception, match="chat_template is not a string"):
        chat_template(tmp_path)


# --- work dirs ----------------------------------------------------------------------------


def gone_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def work_dir(path, **owner):
    os.makedirs(path)
    record = {"host": socket.gethostname(), "pid": os.getpid(), **owner}
    (path / work_dirs.OWNER).write_text(json.dumps(record))
    (path / "checkpoints").mkdir()
    return path


def test_only_work_dirs_of_processes_that_are_gone_are_cleared(tmp_path):
    stale = work_dir(tmp_path / "a.importing", pid=gone_pid())
    exported = work_dir(tmp_path / "b.exporting", pid=gone_pid())
    live = work_dir(tmp_path / "c.importing")  # this process's
    elsewhere = work_dir(tmp_path / "d.importing", host="another-host", pid=gone_pid())
    os.makedirs(tmp_path / "mine.importing")  # the user's: no owner record
    (tmp_path / "e.exporting").mkdir()
    (tmp_path / "e.exporting" / work_dirs.OWNER).write_text("{cut sho")  # unreadable
    reused = work_dir(tmp_path / "f.importing", started=-1)  # a pid now another process's
    assert sorted(work_dirs.clear_stale(str(tmp_path))) == sorted(map(str, (stale, exported, reused)))
    assert sorted(os.listdir(tmp_path)) == ["c.importing", "d.importing", "e.exporting",
                                           "mine.importing"]
    assert live.exists() and elsewhere.exists()


def test_a_work_dir_in_the_way_is_refused_in_one_line(tmp_path, capsys):
    """The user's directory named like a work dir, and a live import's, are left as they
    are; a stale one of the same name is cleared and the import goes on."""
    folder = os.path.join(ORACLES, "llama_gqa")
    (tmp_path / "m.importing").mkdir()
    (tmp_path / "m.importing" / "notes.txt").write_text("mine")
    work_dir(tmp_path / "n.importing")  # a live process's (this one's)
    for name, fragment in (("m", "not an unfinished mtrain work dir"),
                           ("n", f"pid {os.getpid()}")):
        capsys.readouterr()
        assert main(["--mode=import", f"--input_dir={folder}",
                     f"--model_dir={tmp_path / name}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) <= 3 and fragment in lines[-1], lines
        assert not (tmp_path / name).exists()
    assert (tmp_path / "m.importing" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "n.importing" / "checkpoints").is_dir()


def test_exported_tokenizer_configs_name_the_special_tokens(tmp_path):
    """Qwen's tokenizer.json (no BOS; pad = EOS = <|endoftext|>) and Gemma's sentencepiece
    model (pad 0, EOS 1, BOS 2, UNK 3; its chat template kept in tokenizer_config.json) as
    the export writes them."""
    from mtrain.huggingface.vocabulary import write_tokenizer

    qwen = folder_vocab("qwen2")
    (tmp_path / "qwen").mkdir()
    written = write_tokenizer(qwen, {"model_type": "qwen2", "max_position_embeddings": 256},
                              str(tmp_path / "qwen"))
    assert written == ["tokenizer.json", "tokenizer_config.json"]
    settings = json.loads((tmp_path / "qwen" / "tokenizer_config.json").read_text())
    assert (settings["bos_token"], settings["eos_token"], settings["pad_token"]) == (
        None, "<|endoftext|>", "<|endoftext|>")
    gemma = os.path.join(ORACLES, "gemma3")
    (tmp_path / "gemma").mkdir()
    written = write_tokenizer(load_vocabulary(os.path.join(gemma, "tokenizer.model")),
                              {"model_type": "gemma3_text", "bos_token_id": 2},
                              str(tmp_path / "gemma"), chat_template(gemma))
    assert written == ["tokenizer.model", "tokenizer_config.json", "chat_template.jinja"]
    settings = json.loads((tmp_path / "gemma" / "tokenizer_config.json").read_text())
    theirs = json.loads(open(os.path.join(gemma, "tokenizer_config.json")).read())
    assert settings["chat_template"] == theirs["chat_template"]
    assert (tmp_path / "gemma" / "chat_template.jinja").read_text() == theirs["chat_template"]
    # (the pieces of this tiny model's ids 0-3 are <pad> </s> <s> <unk>, which its folder's
    # tokenizer_config.json calls <pad> <eos> <bos> <unk>: the export names the pieces)
    assert [settings[k] for k in ("pad_token", "eos_token", "bos_token", "unk_token")] == [
        "<pad>", "</s>", "<s>", "<unk>"]
    assert settings["tokenizer_class"] == "GemmaTokenizer"
