"""The Hugging Face families mtrain's models can be: their ``config.json`` as mtrain settings
and back, and their tensors as mtrain's parameters and back.

Families (``config.json``'s ``architectures``):

- ``LlamaForCausalLM`` (Llama 2 and 3, TinyLlama, SmolLM; ``MistralForCausalLM`` without a
  sliding window reads as one): `DecoderLM` with RMSNorm (``rms_norm_eps``), SwiGLU,
  rotary positions (``rope_theta``), grouped-query attention, its BOS as
  ``transformer.start_id``.
- ``MixtralForCausalLM``: the same with every feed-forward layer ``num_local_experts``
  SwiGLU experts, ``num_experts_per_tok`` of them per token (the top-k renormalised:
  mtrain's top_k > 1 gates), without a capacity limit (``moe.capacity_factor_*`` =
  experts / top_k, so that no token is dropped).
- ``T5ForConditionalGeneration``: `EncoderDecoder` with relative position bias; v1.0
  (``feed_forward_proj`` 'relu', tied embedding and softmax, whose logits T5 scales by
  d_model^-0.5 as mtrain's shared softmax does) or T5.1.1 / Flan-T5 ('gated-gelu', untied).

`settings` turns a ``config.json`` into gin bindings, refusing in one line every field
whose value mtrain cannot honour (the field named); `hf_config` turns a model's settings
back into one. Their tensors are `weights`'.
"""

from __future__ import annotations

import dataclasses
import json
import os


from mtrain.errors import UserError


class ConversionError(UserError):
    """A Hugging Face model mtrain cannot be, or an mtrain model Hugging Face cannot read."""


LLAMA, MIXTRAL, T5 = "LlamaForCausalLM", "MixtralForCausalLM", "T5ForConditionalGeneration"
ARCHITECTURES = {LLAMA: LLAMA, "MistralForCausalLM": LLAMA, MIXTRAL: MIXTRAL, T5: T5}
# README "Starting from a published model" lists what is read of each family's config.json.
_T5_ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu", "gelu": "gelu_exact", "silu": "silu"}


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{folder} has no config.json: not a Hugging Face model "
                              f"folder") from None
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} cannot be read: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


def family(config: dict) -> str:
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ConversionError(f"config.json: architectures={names}: mtrain imports "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[names[0]]


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
    untied: bool = False  # a tied table whose logits mtrain computes with a separate softmax


def _refuse(field: str, value, why: str):
    raise ConversionError(f"config.json: {field}={value!r}: {why}")


def _get(config: dict, field: str, default=None):
    return config.get(field, default) if config.get(field) is not None else default


def settings(config: dict) -> Settings:
    """The mtrain settings of a Hugging Face `config` (raises ConversionError naming the
    field mtrain cannot honour)."""
    fam = family(config)
    try:
        return _t5(config) if fam == T5 else _decoder(config, fam)
    except KeyError as e:
        raise ConversionError(f"config.json has no {e.args[0]}, which a {fam} needs") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConversionError(f"config.json has a field of the wrong type: {e}") from None


def _decoder(config: dict, fam: str) -> Settings:
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            _refuse(field, config[field], "mtrain's projections have no biases")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        _refuse("sliding_window", config["sliding_window"], "mtrain attends to every earlier "
                "position (no sliding window)")
    if _get(config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", config["hidden_act"], "the Llama family's feed-forward layer "
                "is SwiGLU (silu) here")
    rope = dict(_get(config, "rope_parameters", {}) or {})
    if config.get("rope_scaling"):
        rope.update(config["rope_scaling"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        _refuse(f"{field}.rope_type", rope_type, "mtrain implements rotary positions "
                "without scaling (rope_type 'default') only")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", rope["partial_rotary_factor"], "mtrain rotates "
                "every dimension of a head")
    if fam == MIXTRAL and _get(config, "router_jitter_noise", 0.0):
        _refuse("router_jitter_noise", config["router_jitter_noise"], "mtrain's router adds "
                "no noise")
    theta = rope.get("rope_theta", _get(config, "rope_theta", 10000.0))
    heads = config["num_attention_heads"]
    fields = {
        "transformer.d_model": "hidden_size", "transformer.d_ff": "intermediate_size",
        "transformer.num_heads": "num_attention_heads",
        "transformer.num_kv_heads": "num_key_value_heads", "transformer.d_kv": "head_dim",
        "transformer.num_layers": "num_hidden_layers",
        "transformer.max_length": "max_position_embeddings",
        "transformer.rotary_max_wavelength": "rope_theta",
        "transformer.norm_epsilon": "rms_norm_eps", "transformer.start_id": "bos_token_id",
    }
    arch = {
        "transformer.d_model": config["hidden_size"],
        "transformer.d_ff": config["intermediate_size"],
        "transformer.num_heads": heads,
        "transformer.num_kv_heads": _get(config, "num_key_value_heads", heads),
        "transformer.d_kv": _get(config, "head_dim", config["hidden_size"] // heads),
        "transformer.num_layers": config["num_hidden_layers"],
        "transformer.max_length": _get(config, "max_position_embeddings", 2048),
        "transformer.mlp_activations": ("silu", "linear"),
        "transformer.position_encoding": "rotary",
        "transformer.rotary_max_wavelength": float(theta),
        "transformer.shared_embedding_and_softmax": False,
        "transformer.norm_epsilon": float(_get(config, "rms_norm_eps", 1e-6)),
        "transformer.start_id": int(_get(config, "bos_token_id", 1)),
    }
    defaults = {"transformer.dropout_rate": 0.0}
    if fam == MIXTRAL:
        experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
        arch |= {"transformer.moe_every": 1, "moe.num_experts": experts, "moe.top_k": top_k}
        fields |= {"moe.num_experts": "num_local_experts", "moe.top_k": "num_experts_per_tok"}
        dropless = experts / top_k  # capacity = every token of the group: none dropped
        defaults |= {"moe.capacity_factor_train": dropless, "moe.capacity_factor_eval": dropless,
                     "moe.load_balance_loss": float(_get(config, "router_aux_loss_coef", 0.0)),
                     "moe.router_z_loss": 0.0}
    return Settings(fam, arch, fields, defaults, config["vocab_size"],
                    _first(config.get("eos_token_id")), config.get("bos_token_id"),
                    untied=bool(_get(config, "tie_word_embeddings", False)))


def _t5(config: dict) -> Settings:
    proj = _get(config, "feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]
    if act not in _T5_ACTIVATIONS or proj.count("-") > 1 or (proj.count("-") and not gated):
        _refuse("feed_forward_proj", proj, "mtrain reads 'relu', 'gelu', 'silu' and their "
                "'gated-' forms")
    activations = (_T5_ACTIVATIONS[act], "linear") if gated else (_T5_ACTIVATIONS[act],)
    if _get(config, "decoder_start_token_id", 0) != 0:
        _refuse("decoder_start_token_id", config["decoder_start_token_id"], "mtrain's "
                "decoder starts from id 0, as T5's")
    tied = bool(_get(config, "tie_word_embeddings", True))
    # transformers 5 names the d_model^-0.5 scaling of the logits apart from the tying:
    # mtrain's shared softmax has it, its separate one does not.
    scaled = bool(_get(config, "scale_decoder_outputs", tied))
    if scaled and not tied:
        _refuse("scale_decoder_outputs", True, "mtrain scales the logits of a shared "
                "embedding and softmax only, and this model's are untied")
    fields = {
        "transformer.d_model": "d_model", "transformer.d_ff": "d_ff",
        "transformer.num_heads": "num_heads", "transformer.d_kv": "d_kv",
        "transformer.num_layers": "num_decoder_layers",
        "transformer.num_encoder_layers": "num_layers",
        "transformer.mlp_activations": "feed_forward_proj",
        "transformer.relative_num_buckets": "relative_attention_num_buckets",
        "transformer.relative_max_distance": "relative_attention_max_distance",
        "transformer.shared_embedding_and_softmax": "tie_word_embeddings",
        "transformer.norm_epsilon": "layer_norm_epsilon",
    }
    arch = {
        "transformer.d_model": config["d_model"], "transformer.d_ff": config["d_ff"],
        "transformer.num_heads": config["num_heads"], "transformer.num_kv_heads": 0,
        "transformer.d_kv": config["d_kv"],
        "transformer.num_layers": _get(config, "num_decoder_layers", config["num_layers"]),
        "transformer.num_encoder_layers": config["num_layers"],
        "transformer.mlp_activations": activations,
        "transformer.position_encoding": "relative_bias",
        "transformer.relative_num_buckets": _get(config, "relative_attention_num_buckets", 32),
        "transformer.relative_max_distance": _get(config, "relative_attention_max_distance", 128),
        "transformer.shared_embedding_and_softmax": tied and scaled,
        "transformer.norm_epsilon": float(_get(config, "layer_norm_epsilon", 1e-6)),
    }
    defaults = {"transformer.dropout_rate": float(_get(config, "dropout_rate", 0.0)),
                "transformer.max_length": _get(config, "n_positions", 512),
                "run.task": "bible_enfr"}
    return Settings(T5, arch, fields, defaults, config["vocab_size"],
                    _first(config.get("eos_token_id")), None, untied=tied and not scaled)


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def hf_config(model_config, vocab_rows: int, eos_id: int, bos_id: int | None) -> dict:
    """The config.json of an mtrain model (`TransformerConfig`), or ConversionError if no
    family here can be it."""
    c = model_config

    def refuse(why):
        raise ConversionError(f"this model has no Hugging Face family: {why}")

    if c.position_encoding == "relative_bias":
        if c.num_kv_heads != c.num_heads:
            refuse("T5 has no grouped-query attention (transformer.num_kv_heads)")
        if c.moe_every:
            refuse("T5 has no experts (transformer.moe_every)")
        acts = {v: k for k, v in _T5_ACTIVATIONS.items()}
        # (Hugging Face's 'gated-gelu' is the tanh GELU; a gated exact GELU has no spelling.)
        if c.mlp_activations[-1:] == ("linear",) and len(c.mlp_activations) == 2 \
                and c.mlp_activations[0] in ("relu", "gelu", "silu"):
            proj = "gated-gelu" if c.mlp_activations[0] == "gelu" else \
                f"gated-{acts[c.mlp_activations[0]]}"
        elif len(c.mlp_activations) == 1 and c.mlp_activations[0] in ("relu", "gelu_exact", "silu"):
            proj = acts[c.mlp_activations[0]]
        else:
            refuse(f"T5's feed_forward_proj cannot be transformer.mlp_activations="
                   f"{c.mlp_activations}")
        return {
            "architectures": [T5], "model_type": "t5", "d_model": c.d_model, "d_ff": c.d_ff,
            "d_kv": c.d_kv, "num_heads": c.num_heads,
            "num_layers": c.num_encoder_layers or c.num_layers,
            "num_decoder_layers": c.num_layers, "feed_forward_proj": proj,
            "is_gated_act": proj.startswith("gated-"),
            "dense_act_fn": "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1],
            "relative_attention_num_buckets": c.relative_num_buckets,
            "relative_attention_max_distance": c.relative_max_distance,
            "layer_norm_epsilon": c.norm_epsilon, "dropout_rate": c.dropout_rate,
            "tie_word_embeddings": c.shared_embedding_and_softmax,
            "scale_decoder_outputs": c.shared_embedding_and_softmax, "vocab_size": vocab_rows,
            "is_encoder_decoder": True, "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": eos_id, "n_positions": c.max_length, "initializer_factor": 1.0,
            "dtype": "float32",
        }
    if c.position_encoding != "rotary":
        refuse(f"the Llama family has rotary positions, and transformer.position_encoding="
               f"{c.position_encoding!r} (the 2018 Transformer has none in Hugging Face)")
    if c.mlp_activations != ("silu", "linear"):
        refuse(f"the Llama family's feed-forward layer is SwiGLU, not "
               f"transformer.mlp_activations={c.mlp_activations}")
    if c.shared_embedding_and_softmax:
        refuse("mtrain's shared softmax scales its logits by d_model^-0.5, Llama's tied one "
               "does not (transformer.shared_embedding_and_softmax)")
    config = {
        "architectures": [LLAMA], "model_type": "llama", "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.d_kv,
        "num_hidden_layers": c.num_layers, "max_position_embeddings": c.max_length,
        "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rotary_max_wavelength,
        "rope_parameters": {"rope_theta": c.rotary_max_wavelength, "rope_type": "default"},
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": vocab_rows,
        "bos_token_id": bos_id if bos_id is not None else c.start_id, "eos_token_id": eos_id,
        "initializer_range": 0.02, "dtype": "float32",
    }
    if c.moe_every:
        m = c.moe
        if c.moe_every != 1:
            refuse(f"Mixtral has experts in every layer, and transformer.moe_every="
                   f"{c.moe_every}")
        if m.top_k < 2 or m.expert_d_ff != c.d_ff:
            refuse("Mixtral renormalises top_k >= 2 gates of experts of d_ff "
                   "(moe.top_k, moe.expert_d_ff)")
        config |= {"architectures": [MIXTRAL], "model_type": "mixtral",
                   "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                   "router_aux_loss_coef": m.load_balance_loss, "router_jitter_noise": 0.0,
                   "sliding_window": None}
    return config


def generation_config(config: dict) -> dict:
    if config["model_type"] == "t5":
        return {"decoder_start_token_id": 0, "eos_token_id": config["eos_token_id"],
                "pad_token_id": 0}
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
