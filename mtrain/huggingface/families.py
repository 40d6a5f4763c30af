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

- ``DeepseekV3ForCausalLM`` (DeepSeek-V3, V3.1, R1; Kimi K2, the same architecture):
  multi-head latent attention (``transformer.latent_attention``, ``mla.*``: queries through
  ``q_lora_rank`` (null: directly), keys and values from a ``kv_lora_rank`` latent and a
  rotary key of ``qk_rope_head_dim`` shared by the heads, rotated in interleaved pairs
  where ``rope_interleave`` says), YaRN with DeepSeek's mscale on the softmax scale
  (``transformer.attention_scale`` = qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2),
  ``first_k_dense_replace`` dense layers (``transformer.first_dense_layers``), then experts
  in every layer: sigmoid scores, a correction bias for the choice, group-limited top-k,
  ``routed_scaling_factor``, ``n_shared_experts`` shared experts (`experts`' module doc);
  ``num_nextn_predict_layers`` multi-token prediction modules (``transformer.mtp_depth``),
  kept by the import and written by the export, their loss off (``mtp_loss_weight`` 0)
  unless the user weighs it in: transformers neither runs nor trains them. Only
  ``topk_method`` 'noaux_tc' and ``scoring_func`` 'sigmoid' (all transformers computes).
- ``GptOssForCausalLM`` (gpt-oss): attention sinks (``transformer.attention_sinks``),
  biases on q, k, v and o as ``attention_bias`` says (``transformer.attention_bias``,
  ``attention_output_bias``), sliding and full layers by ``layer_types``, YaRN, experts in
  every layer with a router bias and biases of their own, the clamped SwiGLU
  (``transformer.mlp_activations = ('clamped_swish', 'clamped_linear_plus_one')``,
  ``activation_limit`` = ``swiglu_limit``, ``swish_alpha`` = ``swiglu_alpha``), a pad in
  config.json; the BOS ``<|startoftext|>`` its tokenizer never adds is what texts are read
  after, as lm-evaluation-harness reads them.

Published DeepSeek-V3 (fp8) and gpt-oss (MXFP4) checkpoints are quantized: the import refuses
a ``quantization_config`` in one line; transformers dequantizes them (its quantization
config's ``dequantize=True``) into a folder mtrain imports.

RoPE is read from both forms found on the Hub: transformers 5's ``rope_parameters`` (per
layer type for Gemma 3) and the older ``rope_theta`` + ``rope_scaling`` (+ Gemma's
``rope_local_base_freq``); rope types 'default', 'linear', 'llama3' and 'yarn' are honoured
(`rotary`), others ('dynamic', 'longrope') refused.

Each family is a record (`records`, what one holds: `record`) that the functions here loop
over. `settings` turns a ``config.json`` into gin bindings, refusing in one line every field
whose value mtrain cannot honour (the field named); `hf_config` turns a model's settings
back into one as the family its model dir recorded at import (`origin`), or, for a model
trained here, as the first family of `records.RECORDS` whose settings it has (`of_model`).
"""

from __future__ import annotations

import json
import os

from mtrain.huggingface import decoders, records
import dataclasses

from mtrain.huggingface.common import (ConversionError, GinReference, Settings, first, get,
                                       refuse)
from mtrain.huggingface.record import Family

# What an import's config.gin trains with where the user's gin says otherwise: a
# fine-tuning's optimizer, not Mesh-TF's pretraining one (Adafactor, rsqrt decay after 10,000
# warmup steps, which leaves a fine-tune of a few hundred steps at a rate of ~1e-5). AdamW
# with torch's and Hugging Face Trainer's betas (0.9, 0.999) and its weight decay of 0 (the
# Trainer's and TRL's default), clipped to norm 1.0 as the Trainer clips; a constant rate
# (the Trainer's `constant_with_warmup`) after a short warmup of 10 steps, so that a run of
# any length trains at the same rate, and its peak 1e-4: the top of full fine-tuning's usual
# range (TRL's SFT 2e-5, the Trainer's 5e-5, 1e-4 for models of a few billion parameters or
# less) and the bottom of LoRA's (1e-4 to 2e-4), one rate that trains both. A large model
# fine-tuned in full may want 2e-5 (learning_rate_schedule.constant), a short LoRA 2e-4.
FINE_TUNING = {"run.optimizer": GinReference("adamw"), "adamw.b2": 0.999,
               "adamw.weight_decay": 0.0, "learning_rate_schedule.shape": "constant",
               "learning_rate_schedule.warmup_steps": 10,
               "learning_rate_schedule.constant": 1e-4}
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


def family(config: dict) -> Family:
    """The record of the family config.json's ``architectures`` names."""
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in records.ARCHITECTURES:
        raise ConversionError(f"config.json: architectures={names}: mtrain imports "
                              f"{', '.join(sorted(records.ARCHITECTURES))}")
    return records.named(names[0])


def settings(config: dict) -> Settings:
    """The mtrain settings of a Hugging Face `config` (raises ConversionError naming the
    field mtrain cannot honour)."""
    fam = family(config)
    try:
        read = {"encoder_decoder": _t5, "decoder": decoders.settings}[fam.kind]
        imported = read(config, fam)
    except KeyError as e:
        raise ConversionError(f"config.json has no {e.args[0]}, which a {fam} needs") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConversionError(f"config.json has a field of the wrong type: {e}") from None
    return dataclasses.replace(imported, defaults={**FINE_TUNING, **imported.defaults})


def _t5(config: dict, fam: Family) -> Settings:
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
    return Settings(fam.architecture, arch, fields, defaults, config["vocab_size"],
                    first(config.get("eos_token_id")), None)


def of_model(c) -> Family:
    """The family a model trained here (no record of an import) exports as: T5 for relative
    position bias, else the first decoder-only family of `records.RECORDS` whose settings
    it has (ConversionError naming, for each, the setting it has not)."""
    if c.position_encoding == "relative_bias":
        return records.of_kind("encoder_decoder")[0]
    if c.position_encoding != "rotary":
        raise ConversionError(f"this model has no Hugging Face family: the decoder-only "
                              f"families have rotary positions, and transformer."
                              f"position_encoding={c.position_encoding!r} (the 2018 "
                              f"Transformer has none in Hugging Face)")
    why = {}
    for fam in records.of_kind("decoder"):
        why[fam] = decoders.refusal(fam, c)
        if why[fam] is None:
            return fam
    raise ConversionError("this model has no Hugging Face family: " + "; ".join(
        why.values()))


def hf_config(fam: Family, model_config, vocab_rows: int, eos_id: int,
              bos_id: int | None, pad_id: int | None = None) -> dict:
    """The config.json of an mtrain model (`TransformerConfig`) as the family `fam`, or
    ConversionError if it cannot be (the setting named); `pad_id` its tokenizer's pad."""
    c = model_config
    positions = {"decoder": "rotary", "encoder_decoder": "relative_bias"}[fam.kind]
    if c.position_encoding != positions:
        raise ConversionError(f"this model has no Hugging Face family: {fam} has "
                              f"transformer.position_encoding={positions!r}, and this model "
                              f"{c.position_encoding!r}")
    if fam.kind == "decoder":
        return decoders.hf_config(fam, c, vocab_rows, eos_id, bos_id, pad_id)
    return _t5_config(fam, c, vocab_rows, eos_id)


def _t5_config(fam: Family, c, vocab_rows: int, eos_id: int) -> dict:
    def refuse(why):
        raise ConversionError(f"this model has no Hugging Face family: {why}")

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
        "architectures": [fam.architecture], "model_type": fam.model_type,
        "d_model": c.d_model, "d_ff": c.d_ff,
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


def generation_config(fam: Family, config: dict) -> dict:
    if fam.kind == "encoder_decoder":
        return {"decoder_start_token_id": 0, "eos_token_id": config["eos_token_id"],
                "pad_token_id": 0}
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config.get("pad_token_id")}
