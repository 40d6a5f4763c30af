"""What the Hugging Face families share: the error, what a config.json makes
of a run (`Settings`) and the helpers that read its fields."""

from __future__ import annotations

import dataclasses

from mtrain.errors import UserError


class ConversionError(UserError):
    """A Hugging Face model mtrain cannot be, or an mtrain model Hugging Face cannot read."""


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


class GinReference(str):
    """A `Settings` value that is a gin reference (``@adamw``), written as one."""

    def __repr__(self) -> str:
        return f"@{self}"


def refuse(field: str, value, why: str):
    raise ConversionError(f"config.json: {field}={value!r}: {why}")


def get(config: dict, field: str, default=None):
    """`config[field]`, or `default` where it is missing or null."""
    return config.get(field, default) if config.get(field) is not None else default


def first(value):
    """An id, or the first of a list of them (an eos_token_id may be a list)."""
    return value[0] if isinstance(value, list) and value else value
