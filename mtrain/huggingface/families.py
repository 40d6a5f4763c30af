"""The Hugging Face families mtrain's models can be: their ``config.json`` as mtrain settings
and back (their tensors are `weights`').

Families (``config.json``'s ``architectures``), each a set of `TransformerConfig` settings
of `DecoderLM` or `EncoderDecoder`, not a model of its own:

- ``LlamaForCausalLM`` (Llama 2, 3, 3.1-3.3 with ``rope_type`` 'llama3' or 'linear';
  TinyLlama, SmolLM): RMSNorm, SwiGLU, rotary positions, grouped-query attention, logits
  scaled by head_dim^-0.5 (``transformer.attention_scale``), its BOS read before each
  sequence (``transformer.start_id``), tied or not (a tied table's logits are unscaled:
  ``shared_softmax_scaled=False``).
- ``MistralForCausalLM``: Llama's, with a sliding window in every layer (``sliding_window``:
  ``transformer.attention_windows``) where it has one.
- ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5): Llama's with biases on q, k and v
  (``transformer.attention_bias``); no BOS: sequences start after its EOS
  (``<|endoftext|>``), as lm-evaluation-harness scores them.
- ``Qwen3ForCausalLM``: Llama's with an RMSNorm of each query and key head
  (``transformer.qk_norm``), whose head_dim need not be hidden_size / heads.
- ``Qwen3MoeForCausalLM``: Qwen3's with experts every ``decoder_sparse_step`` layers
  (``moe_intermediate_size`` each), the top-k gates renormalised as ``norm_topk_prob`` says.
- ``MixtralForCausalLM``: Llama's with experts in every layer, the top-k gates always
  renormalised (``moe.normalize_top_k``); no token dropped: ``moe.dispatch='dropless'``
  (grouped matmuls), and where a user picks ``'capacity'``, ``moe.capacity_factor_*`` =
  experts / top_k.
- ``Gemma3ForCausalLM`` (text): sliding and full layers by ``layer_types`` (each with its
  RoPE: ``transformer.rotary_local_max_wavelength`` for the sliding ones), RMSNorms that
  scale by 1 + w (``norm_scale_offset``) before and after each sublayer (``post_norms``),
  q/k norms, logits scaled by query_pre_attn_scalar^-0.5, embeddings times sqrt(d_model)
  (``embedding_multiplier``), GeGLU (tanh), tied.
- ``T5ForConditionalGeneration``: `EncoderDecoder` with relative position bias; v1.0
  (``feed_forward_proj`` 'relu', tied embedding and softmax, whose logits T5 scales by
  d_model^-0.5 as mtrain's shared softmax does) or T5.1.1 / Flan-T5 ('gated-gelu', untied).

RoPE is read from both forms found on the Hub: transformers 5's ``rope_parameters`` (per
layer type for Gemma 3) and the older ``rope_theta`` + ``rope_scaling`` (+ Gemma's
``rope_local_base_freq``); rope types 'default', 'linear' and 'llama3' are honoured,
others ('yarn', 'dynamic', 'longrope') refused.

`settings` turns a ``config.json`` into gin bindings, refusing in one line every field
whose value mtrain cannot honour (the field named); `hf_config` turns a model's settings
back into one (its family read off the settings: `family_of`).
"""

from __future__ import annotations

import json
import os

from mtrain.huggingface import decoders
from mtrain.huggingface.common import (ARCHITECTURES, T5, ConversionError, Settings, first,
                                       get, refuse)

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
    return names[0]


def settings(config: dict) -> Settings:
    """The mtrain settings of a Hugging Face `config` (raises ConversionError naming the
    field mtrain cannot honour)."""
    fam = family(config)
    try:
        return _t5(config) if fam == T5 else decoders.settings(config, fam)
    except KeyError as e:
        raise ConversionError(f"config.json has no {e.args[0]}, which a {fam} needs") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConversionError(f"config.json has a field of the wrong type: {e}") from None


def _t5(config: dict) -> Settings:
    proj = get(config, "feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]
    if act not in _T5_ACTIVATIONS or proj.count("-") > 1 or (proj.count("-") and not gated):
        refuse("feed_forward_proj", proj, "mtrain reads 'relu', 'gelu', 'silu' and their "
                "'gated-' forms")
    activations = (_T5_ACTIVATIONS[act], "linear") if gated else (_T5_ACTIVATIONS[act],)
    if get(config, "decoder_start_token_id", 0) != 0:
        refuse("decoder_start_token_id", config["decoder_start_token_id"], "mtrain's "
                "decoder starts from id 0, as T5's")
    tied = bool(get(config, "tie_word_embeddings", True))
    # transformers 5 names the d_model^-0.5 scaling of the logits apart from the tying:
    # mtrain's shared softmax has it, its separate one does not.
    scaled = bool(get(config, "scale_decoder_outputs", tied))
    if scaled and not tied:
        refuse("scale_decoder_outputs", True, "mtrain scales the logits of a shared "
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
        "transformer.num_layers": get(config, "num_decoder_layers", config["num_layers"]),
        "transformer.num_encoder_layers": config["num_layers"],
        "transformer.mlp_activations": activations,
        "transformer.position_encoding": "relative_bias",
        "transformer.relative_num_buckets": get(config, "relative_attention_num_buckets", 32),
        "transformer.relative_max_distance": get(config, "relative_attention_max_distance", 128),
        "transformer.shared_embedding_and_softmax": tied,
        "transformer.shared_softmax_scaled": scaled,
        "transformer.norm_epsilon": float(get(config, "layer_norm_epsilon", 1e-6)),
    }
    defaults = {"transformer.dropout_rate": float(get(config, "dropout_rate", 0.0)),
                "transformer.max_length": get(config, "n_positions", 512),
                "run.task": "bible_enfr"}
    return Settings(T5, arch, fields, defaults, config["vocab_size"],
                    first(config.get("eos_token_id")), None)


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
            "scale_decoder_outputs": c.shared_embedding_and_softmax and c.shared_softmax_scaled,
            "vocab_size": vocab_rows,
            "is_encoder_decoder": True, "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": eos_id, "n_positions": c.max_length, "initializer_factor": 1.0,
            "dtype": "float32",
        }
    if c.position_encoding != "rotary":
        refuse(f"the decoder-only families have rotary positions, and "
               f"transformer.position_encoding={c.position_encoding!r} (the 2018 "
               f"Transformer has none in Hugging Face)")
    return decoders.hf_config(c, vocab_rows, eos_id, bos_id)


def generation_config(config: dict) -> dict:
    if config["model_type"] == "t5":
        return {"decoder_start_token_id": 0, "eos_token_id": config["eos_token_id"],
                "pad_token_id": 0}
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config.get("pad_token_id")}
