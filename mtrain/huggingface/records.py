"""The Hugging Face families mtrain reads and writes, one `record.Family` each (what a
record holds: `record`). Adding a family is adding its record here (and, where its layers
are new, the rows of `weights.parameters` that name their tensors and the settings of
`models/` they need): docs/architecture.md, "Adding a family".

`RECORDS` is in the order a model trained here without a record of its family (one not
imported) is matched in at export: the first whose settings it has (`decoders.refusal`).
"""

from __future__ import annotations

from mtrain.huggingface.common import ConversionError
from mtrain.huggingface.record import Experts, Family, Field

LLAMA = Family("LlamaForCausalLM", "llama",
               "Llama 2, 3, 3.1-3.3, TinyLlama, SmolLM: RMSNorm, SwiGLU, RoPE, grouped-query "
               "attention")
MISTRAL = Family("MistralForCausalLM", "mistral",
                 "Mistral 7B: Llama's, with a sliding window in every layer",
                 windows="every_layer")
QWEN2 = Family("Qwen2ForCausalLM", "qwen2",
               "Qwen2, Qwen2.5: Llama's with biases on q, k and v; no BOS",
               qkv_bias=True, windows="layer_types", use_sliding_window=True, bos=False)
QWEN3 = Family("Qwen3ForCausalLM", "qwen3",
               "Qwen3: Llama's with an RMSNorm of each query and key head; no BOS",
               qk_norm=True, windows="layer_types", use_sliding_window=True, bos=False)
QWEN3_MOE = Family("Qwen3MoeForCausalLM", "qwen3_moe",
                   "Qwen3-MoE: Qwen3's with experts every decoder_sparse_step layers",
                   qk_norm=True, windows="layer_types", use_sliding_window=True, bos=False,
                   experts=Experts(count_fields=("num_experts", "num_local_experts"),
                                   d_ff_field="moe_intermediate_size",
                                   every_field="decoder_sparse_step",
                                   normalize_field="norm_topk_prob",
                                   refused=("mlp_only_layers",)))
MIXTRAL = Family("MixtralForCausalLM", "mixtral",
                 "Mixtral: Llama's with experts in every layer, gates renormalised",
                 windows="every_layer",
                 experts=Experts(prefix="block_sparse_moe.", projections=("w1", "w3", "w2")))
GEMMA3 = Family("Gemma3ForCausalLM", "gemma3_text",
                "Gemma 3 (text): GeGLU, sliding and full layers, (1 + w) norms before and "
                "after each sublayer, q/k norms, embeddings times sqrt(d_model), tied",
                activation_field="hidden_activation", activation="gelu_pytorch_tanh",
                qk_norm=True, post_norms=True, norm_scale_offset=1.0, scaled_embedding=True,
                tied_by_default=True, scale_field="query_pre_attn_scalar",
                windows="layer_types", local_rope=True, sliding_pattern=6,
                norms=(("attention_norm", "input_layernorm"),
                       ("post_attention_norm", "post_attention_layernorm"),
                       ("mlp_norm", "pre_feedforward_layernorm"),
                       ("post_mlp_norm", "post_feedforward_layernorm")),
                tokenizer_class="GemmaTokenizer", legacy_tokenizer=False,
                constants=(("pad_token_id", 0), ("attn_logit_softcapping", None),
                           ("final_logit_softcapping", None)))
# transformers' defaults where config.json leaves a field out
DEEPSEEK_V3 = Family(
    "DeepseekV3ForCausalLM", "deepseek_v3",
    "DeepSeek-V3, R1, Kimi K2: multi-head latent attention, YaRN, dense first layers, then "
    "sigmoid-routed experts with a correction bias and shared experts; multi-token prediction",
    latent_attention=True,
    experts=Experts(count_fields=("n_routed_experts",), d_ff_field="moe_intermediate_size",
                    normalize_field="norm_topk_prob", shared="shared_experts.",
                    scoring="sigmoid", choice_bias=True),
    fields=(Field("mla.q_lora_rank", "q_lora_rank", 1536, null=0),
            Field("mla.kv_lora_rank", "kv_lora_rank", 512),
            Field("mla.qk_nope_head_dim", "qk_nope_head_dim", 128),
            Field("mla.qk_rope_head_dim", "qk_rope_head_dim", 64),
            Field("mla.v_head_dim", "v_head_dim", 128),
            Field("mla.rope_interleaved", "rope_interleave", True, bool),
            Field("transformer.first_dense_layers", "first_k_dense_replace", 3),
            Field("moe.num_shared_experts", "n_shared_experts", 1),
            Field("moe.num_groups", "n_group", 8), Field("moe.top_groups", "topk_group", 4),
            Field("moe.routed_scaling", "routed_scaling_factor", 2.5, float),
            Field("transformer.mtp_depth", "num_nextn_predict_layers", 0)),
    tokenizer_class="PreTrainedTokenizerFast",
    fixed=(("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)))
GPT_OSS = Family(
    "GptOssForCausalLM", "gpt_oss",
    "gpt-oss: attention sinks, biases on q, k, v and o, sliding and full layers, YaRN, "
    "biased experts with a clamped SwiGLU",
    mlp_activations=("clamped_swish", "clamped_linear_plus_one"), attention_bias_field=True,
    sinks=True, windows="layer_types", sliding_pattern=2,
    experts=Experts(router="router", router_bias=True, fused=True),
    fields=(Field("transformer.activation_limit", "swiglu_limit", 7.0, float),
            Field("transformer.swish_alpha", "swiglu_alpha", 1.702, float)),
    tokenizer_class="PreTrainedTokenizerFast", config_pad=True)
T5 = Family("T5ForConditionalGeneration", "t5",
            "T5 v1.0, T5.1.1, Flan-T5: encoder-decoder, relative position bias",
            kind="encoder_decoder", activation_field="feed_forward_proj", activation="relu",
            bos=False, sentencepiece="spiece.model", tokenizer_class="T5Tokenizer",
            legacy_tokenizer=False)

RECORDS = (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, GEMMA3, DEEPSEEK_V3, GPT_OSS, T5)
ARCHITECTURES = tuple(r.architecture for r in RECORDS)
_BY_ARCHITECTURE = {r.architecture: r for r in RECORDS}
_BY_MODEL_TYPE = {r.model_type: r for r in RECORDS}


def named(architecture: str) -> Family:
    """The record of the family config.json names `architecture` (ConversionError if none)."""
    if architecture not in _BY_ARCHITECTURE:
        raise ConversionError(f"config.json: architectures=[{architecture!r}]: mtrain imports "
                              f"{', '.join(sorted(_BY_ARCHITECTURE))}")
    return _BY_ARCHITECTURE[architecture]


def of_model_type(model_type: str) -> Family:
    """The record of config.json's ``model_type`` (what export wrote)."""
    if model_type not in _BY_MODEL_TYPE:
        raise ConversionError(f"config.json: model_type={model_type!r}: mtrain writes "
                              f"{', '.join(sorted(_BY_MODEL_TYPE))}")
    return _BY_MODEL_TYPE[model_type]


def of_kind(kind: str) -> tuple[Family, ...]:
    return tuple(r for r in RECORDS if r.kind == kind)
