"""What the Hugging Face families share: their names, the error, what a config.json makes
of a run (`Settings`) and the helpers that read its fields."""

from __future__ import annotations

import dataclasses

from mtrain.errors import UserError


class ConversionError(UserError):
    """A Hugging Face model mtrain cannot be, or an mtrain model Hugging Face cannot read."""


LLAMA, MISTRAL, MIXTRAL, T5 = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                               "T5ForConditionalGeneration")
QWEN2, QWEN3, QWEN3_MOE, GEMMA3 = ("Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                   "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, GEMMA3, T5)
MODEL_TYPES = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3",
               QWEN3_MOE: "qwen3_moe", MIXTRAL: "mixtral", GEMMA3: "gemma3_text", T5: "t5"}
EXPERTS = (MIXTRAL, QWEN3_MOE)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a config.json makes of an mtrain run: `architecture` bindings (gin name ->
    value; a user binding that differs is an error, `source` names the config.json field
    each comes from), and `defaults` the user's gin may override."""

    family: str
    architecture: dict
    source: dict
    defaults: dict
    vocab_size: int  # config.json's: the rows of the embedding
    eos_id: int | None
    bos_id: int | None
    pad_id: int | None = None  # config.json's pad_token_id, where it has one


def refuse(field: str, value, why: str):
    raise ConversionError(f"config.json: {field}={value!r}: {why}")


def get(config: dict, field: str, default=None):
    """`config[field]`, or `default` where it is missing or null."""
    return config.get(field, default) if config.get(field) is not None else default


def first(value):
    """An id, or the first of a list of them (an eos_token_id may be a list)."""
    return value[0] if isinstance(value, list) and value else value
