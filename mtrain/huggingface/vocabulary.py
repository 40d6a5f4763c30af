"""A Hugging Face model folder's tokenizer as the run's vocabulary, and back.

A folder's sentencepiece file (``tokenizer.model``: Llama, Mistral, Mixtral;
``spiece.model``: T5) is loaded as mtrain's `Vocabulary`, with its own special ids; a folder
with only ``tokenizer.json`` (Llama 3, Mistral's newer releases) as a `TokenizerVocabulary`
(the `tokenizers` package), its EOS and BOS from config.json. Texts are encoded without
special tokens, and the family's conventions are the model's: EOS appended to every example
and target (both families), the Llama family's BOS read before each sequence
(``transformer.start_id``), T5's decoder started from the pad id 0.
"""

from __future__ import annotations

import json
import os

from mtrain.data.vocabulary import TokenizerVocabulary, Vocabulary, VocabularyError, load_vocabulary
from mtrain.huggingface.families import T5, ConversionError, Settings

SENTENCEPIECE = {T5: "spiece.model"}  # the others': tokenizer.model
TOKENIZER_JSON = "tokenizer.json"


def folder_vocabulary(folder: str, settings: Settings) -> Vocabulary:
    """The vocabulary of the model folder `folder`, checked against its config.json."""
    names = [SENTENCEPIECE.get(settings.family, "tokenizer.model"), "tokenizer.model",
             "spiece.model"]
    found = next((n for n in names if os.path.exists(os.path.join(folder, n))), None)
    try:
        if found:
            vocab = load_vocabulary(os.path.join(folder, found))
        elif os.path.exists(os.path.join(folder, TOKENIZER_JSON)):
            if settings.eos_id is None:
                raise ConversionError("config.json has no eos_token_id, which a tokenizer.json "
                                      "vocabulary needs")
            with open(os.path.join(folder, TOKENIZER_JSON), "rb") as f:
                vocab = TokenizerVocabulary.of(f.read(), settings.eos_id, settings.bos_id)
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


def write_tokenizer(vocab: Vocabulary, config: dict, folder: str) -> list[str]:
    """Writes `vocab` into the Hugging Face folder `folder` as the family of `config` reads
    it: its sentencepiece file or tokenizer.json, and tokenizer_config.json. Returns the
    names written."""
    t5 = config["model_type"] == "t5"
    if isinstance(vocab, TokenizerVocabulary):
        name = TOKENIZER_JSON
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(vocab.tokenizer_json())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        name = "spiece.model" if t5 else "tokenizer.model"
        vocab.save(os.path.join(folder, name))
        piece = vocab.piece
        if t5:
            extra = config["vocab_size"] - vocab.vocab_size
            settings = {"tokenizer_class": "T5Tokenizer", "eos_token": piece(vocab.eos_id),
                        "unk_token": piece(vocab.unk_id), "pad_token": piece(0),
                        "extra_ids": 100 if extra >= 100 else 0}
        else:
            settings = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                        "add_eos_token": False, "bos_token": piece(config["bos_token_id"]),
                        "eos_token": piece(vocab.eos_id), "unk_token": piece(vocab.unk_id),
                        "legacy": True}
    settings["model_max_length"] = config.get("max_position_embeddings",
                                              config.get("n_positions", 512))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    return [name, "tokenizer_config.json"]
