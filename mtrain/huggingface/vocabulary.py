"""A Hugging Face model folder's tokenizer as the run's vocabulary, and back.

A folder's sentencepiece file (``tokenizer.model``: Llama, Mistral, Mixtral;
``spiece.model``: T5) is loaded as mtrain's `Vocabulary`, with its own special ids; a folder
with only ``tokenizer.json`` (Llama 3, Mistral's newer releases) as a `TokenizerVocabulary`
(the `tokenizers` package), its EOS and BOS from config.json. Texts are encoded without
special tokens, and the family's conventions are the model's: EOS appended to every example
and target (both families), the Llama family's BOS read before each sequence
(``transformer.start_id``), T5's decoder started from the pad id 0.

Tokenizers as they ship: id 0 may be an ordinary piece (Llama 3's, Qwen's, DeepSeek's and
gpt-oss's byte-level BPE), the specials the last ids, no BOS (Qwen) and no unknown piece;
none of that matters to mtrain (`mtrain.data.vocabulary`). Whether a tokenizer adds its BOS
itself (Llama 3's and DeepSeek's do; gpt-oss's names ``<|startoftext|>`` and never adds it)
does not either: the model reads config.json's BOS first (``transformer.start_id``), which
is what lm-evaluation-harness scores a text after, and the export writes tokenizer.json as
it came. The pad, where the model has one (config.json's
``pad_token_id``, else tokenizer_config.json's ``pad_token``), is kept for export.

A folder's chat template (`chat_template`: ``chat_template.jinja``, where transformers 5
writes it, else tokenizer_config.json's ``chat_template``, where older folders keep it) is
kept in the model dir by the import and written back by the export in both places.
"""

from __future__ import annotations

import json
import logging
import os

from mtrain.data.tokenizer_vocabulary import TokenizerVocabulary
from mtrain.data.vocabulary import Vocabulary, VocabularyError, load_vocabulary
from mtrain.huggingface import records
from mtrain.huggingface.common import ConversionError, Settings

log = logging.getLogger("mtrain")
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"


def _tokenizer_config(folder: str) -> dict:
    """The folder's tokenizer_config.json ({} if it has none), or ConversionError."""
    path = os.path.join(folder, TOKENIZER_CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} cannot be read: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


def _token(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or (older files) an AddedToken's
    ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_json_vocabulary(folder: str, eos_id: int, bos_id: int | None,
                              pad: int | None = None) -> TokenizerVocabulary:
    """The tokenizer.json of `folder` as a vocabulary with the model's EOS and BOS (its
    config.json's) and its pad: `pad` (config.json's ``pad_token_id``), else the id of
    tokenizer_config.json's ``pad_token``, else none."""
    with open(os.path.join(folder, TOKENIZER_JSON), "rb") as f:
        data = f.read()
    vocab = TokenizerVocabulary.of(data, eos_id, bos_id)
    if pad is None:
        token = _token(_tokenizer_config(folder).get("pad_token"))
        pad = vocab.token_id(token) if isinstance(token, str) else None
    return vocab if pad is None else TokenizerVocabulary.of(data, eos_id, bos_id, pad)


def chat_template(folder: str) -> str | None:
    """The chat template of the Hugging Face folder `folder`: its chat_template.jinja, else
    tokenizer_config.json's ``chat_template`` (a string, or a list of named templates of
    which the one named "default" is kept), else None."""
    path = os.path.join(folder, CHAT_TEMPLATE)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} cannot be read: {' '.join(str(e).split())}") from None
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if set(named) - {"default"}:
            log.warning("%s: of the chat templates %s, only 'default' is kept",
                        TOKENIZER_CONFIG, ", ".join(map(str, named)))
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConversionError(f"{os.path.join(folder, TOKENIZER_CONFIG)}: chat_template is "
                              f"not a string")
    return template


def folder_vocabulary(folder: str, settings: Settings) -> Vocabulary:
    """The vocabulary of the model folder `folder`, checked against its config.json."""
    names = [records.named(settings.family).sentencepiece, "tokenizer.model", "spiece.model"]
    found = next((n for n in names if os.path.exists(os.path.join(folder, n))), None)
    try:
        if found:
            vocab = load_vocabulary(os.path.join(folder, found))
        elif os.path.exists(os.path.join(folder, TOKENIZER_JSON)):
            if settings.eos_id is None:
                raise ConversionError("config.json has no eos_token_id, which a tokenizer.json "
                                      "vocabulary needs")
            vocab = tokenizer_json_vocabulary(folder, settings.eos_id, settings.bos_id,
                                              settings.pad_id)
        else:
            raise ConversionError(f"{folder} has no tokenizer.model, spiece.model or "
                                  f"tokenizer.json")
    except VocabularyError as e:
        raise ConversionError(str(e)) from None
    if settings.eos_id is not None and vocab.eos_id != settings.eos_id:
        raise ConversionError(f"config.json: eos_token_id={settings.eos_id}, but the "
                              f"tokenizer's EOS is {vocab.eos_id}")
    start = settings.architecture.get("transformer.start_id")
    if start is not None and vocab.bos_id is not None and vocab.bos_id != start:
        raise ConversionError(f"config.json: bos_token_id={start}, but the tokenizer's BOS "
                              f"is {vocab.bos_id}")
    if vocab.vocab_size > settings.vocab_size:
        raise ConversionError(f"config.json: vocab_size={settings.vocab_size}, but the "
                              f"tokenizer has {vocab.vocab_size} pieces")
    return vocab


def write_tokenizer(vocab: Vocabulary, config: dict, folder: str,
                    template: str | None = None) -> list[str]:
    """Writes `vocab` into the Hugging Face folder `folder` as the family of `config` reads
    it: its sentencepiece file or tokenizer.json, and tokenizer_config.json (the special
    tokens' strings, and the chat `template` if any, which also goes to chat_template.jinja:
    transformers 5 reads that file first, older readers tokenizer_config.json). Returns the
    names written."""
    fam = records.of_model_type(config["model_type"])
    piece = vocab.piece

    def token(i):
        return piece(i) if i is not None else None

    if isinstance(vocab, TokenizerVocabulary):
        name = TOKENIZER_JSON
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(vocab.tokenizer_json())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": token(vocab.bos_id),
                    "eos_token": token(vocab.eos_id), "pad_token": token(vocab.pad_id),
                    "unk_token": token(vocab.unk_id)}
    else:
        name = fam.sentencepiece
        vocab.save(os.path.join(folder, name))
        if fam.kind == "encoder_decoder":  # (T5's: EOS appended, pad 0, its extra ids)
            extra = config["vocab_size"] - vocab.vocab_size
            settings = {"tokenizer_class": fam.tokenizer_class, "eos_token": piece(vocab.eos_id),
                        "unk_token": piece(vocab.unk_id), "pad_token": piece(0),
                        "extra_ids": 100 if extra >= 100 else 0}
        else:
            settings = {"tokenizer_class": fam.tokenizer_class,
                        "add_bos_token": True, "add_eos_token": False,
                        "bos_token": piece(config["bos_token_id"]),
                        "eos_token": piece(vocab.eos_id), "unk_token": piece(vocab.unk_id)}
            if vocab.pad_id is not None:
                settings["pad_token"] = piece(vocab.pad_id)
            if fam.legacy_tokenizer:
                settings["legacy"] = True
    settings["model_max_length"] = config.get("max_position_embeddings",
                                              config.get("n_positions", 512))
    written = [name, TOKENIZER_CONFIG]
    if template is not None:
        settings["chat_template"] = template
        with open(os.path.join(folder, CHAT_TEMPLATE), "w", encoding="utf-8") as f:
            f.write(template)
        written.append(CHAT_TEMPLATE)
    with open(os.path.join(folder, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2, ensure_ascii=False)
    return written
