"""The Hugging Face families mtrain reads and writes, one `record.Family` each (what a
record holds: `record`). Adding a family is adding its record here (and, where its layers
are new, the rows of `weights.parameters` that name their tensors and the settings of
`models/` they need): docs/architecture.md, "Adding a family".

`RECORDS` is in the order a model trained here without a record of its family (one not
imported) is matched in at export: the first whose settings it has (`decoders.refusal`).
"""

from __future__ import annotations

from mtrain.huggingface.common import ConversionError
from mtrain.huggingface.record import Experts, Family

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
                windows="layer_types", local_rope=True,
                norms=(("attention_norm", "input_layernorm"),
                       ("post_attention_norm", "post_attention_layernorm"),
                       ("mlp_norm", "pre_feedforward_layernorm"),
                       ("post_mlp_norm", "post_feedforward_layernorm")),
                tokenizer_class="GemmaTokenizer", legacy_tokenizer=False,
                constants=(("pad_token_id", 0), ("attn_logit_softcapping", None),
                           ("final_logit_softcapping", None)))
T5 = Family("T5ForConditionalGeneration", "t5",
            "T5 v1.0, T5.1.1, Flan-T5: encoder-decoder, relative position bias",
            kind="encoder_decoder", activation_field="feed_forward_proj", activation="relu",
            bos=False, sentencepiece="spiece.model", tokenizer_class="T5Tokenizer",
            legacy_tokenizer=False)

RECORDS = (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, GEMMA3, T5)
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
