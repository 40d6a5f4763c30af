"""The decoder-only families' ``config.json`` as mtrain settings (`settings`) and back
(`hf_config`); `families`' module doc says what each family is."""

from __future__ import annotations

import math

from mtrain.huggingface.common import (EXPERTS, GEMMA3, LLAMA, MISTRAL, MIXTRAL, MODEL_TYPES,
                                       QWEN2, QWEN3, QWEN3_MOE, ConversionError, Settings,
                                       first, get, refuse)
from mtrain.models.blocks import layer_window

ROPE_TYPES = ("default", "linear", "llama3")
_QWEN = (QWEN2, QWEN3, QWEN3_MOE)
# The feed-forward activation of each family (Gemma's field is hidden_activation).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}


def _rope(params: dict, field: str) -> dict:
    """The ``rope_scaling.*`` bindings of one layer type's RoPE parameters (`field`: where
    they were read, for the error)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"{field}.rope_type", kind, f"mtrain implements rope types "
               f"{', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", params["partial_rotary_factor"], "mtrain rotates "
               "every dimension of a head")
    out = {"rope_scaling.kind": "none" if kind == "default" else kind}
    if kind != "default":
        out["rope_scaling.factor"] = float(params["factor"])
    if kind == "llama3":
        out |= {"rope_scaling.low_freq_factor": float(params["low_freq_factor"]),
                "rope_scaling.high_freq_factor": float(params["high_freq_factor"]),
                "rope_scaling.original_max_length":
                    int(params["original_max_position_embeddings"])}
    return out


def _rope_parameters(config: dict) -> tuple[dict, dict, str]:
    """(full layers' RoPE parameters, sliding layers', the field read) from either form:
    transformers 5's ``rope_parameters`` (per layer type for Gemma 3), or ``rope_theta`` +
    ``rope_scaling`` (+ Gemma's ``rope_local_base_freq``, its sliding layers unscaled)."""
    new = config.get("rope_parameters") or {}
    if new and all(isinstance(v, dict) for v in new.values()):
        full = new.get("full_attention") or new["sliding_attention"]
        return full, new.get("sliding_attention", full), "rope_parameters"
    params, field = dict(new), "rope_parameters"
    if config.get("rope_scaling"):
        params, field = {**params, **config["rope_scaling"]}, "rope_scaling"
    params.setdefault("rope_theta", get(config, "rope_theta", 10000.0))
    local = get(config, "rope_local_base_freq")
    return params, ({"rope_theta": local} if local else params), field


def _windows(config: dict, fam: str) -> tuple[int, ...]:
    """``transformer.attention_windows``: the shortest pattern of the layers' windows that
    repeats over them (0: a full layer), from ``layer_types`` where given, else
    ``sliding_window`` in every layer."""
    layers, window = config["num_hidden_layers"], get(config, "sliding_window")
    types = config.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if len(types) != layers or unknown:
            refuse("layer_types", types, f"mtrain reads one of 'full_attention' and "
                   f"'sliding_attention' for each of the {layers} layers")
        if "sliding_attention" in types and not window:
            refuse("sliding_window", window, "layer_types has sliding layers")
        per_layer = [window if t == "sliding_attention" else 0 for t in types]
    elif window and get(config, "use_sliding_window", True):
        if fam in _QWEN:
            refuse("use_sliding_window", True, "without layer_types, Qwen's windows follow "
                   "max_window_layers, which mtrain does not read")
        per_layer = [window] * layers
    else:
        return ()
    period = next(p for p in range(1, layers + 1)
                  if all(per_layer[i] == per_layer[i % p] for i in range(layers)))
    pattern = tuple(int(w) for w in per_layer[:period])
    return () if pattern == (0,) else pattern


def _refusals(config: dict, fam: str) -> None:
    if fam != QWEN2 and get(config, "attention_bias", False):
        refuse("attention_bias", True, "mtrain's attention output has no bias (the q, k and "
               "v biases of Qwen2 it has)")
    if get(config, "mlp_bias", False):
        refuse("mlp_bias", True, "mtrain's feed-forward projections have no biases")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(config, field) is not None:
            refuse(field, config[field], "mtrain caps no logits (Gemma 2's soft-capping)")
    if get(config, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", True, "mtrain's language models are causal")
    if fam in EXPERTS and get(config, "router_jitter_noise", 0.0):
        refuse("router_jitter_noise", config["router_jitter_noise"], "mtrain's router adds "
               "no noise")
    if fam == QWEN3_MOE and get(config, "mlp_only_layers", []):
        refuse("mlp_only_layers", config["mlp_only_layers"], "mtrain's experts are in every "
               "decoder_sparse_step-th layer")


def settings(config: dict, fam: str) -> Settings:
    """The mtrain settings of a decoder-only family's `config` (see `families.settings`)."""
    _refusals(config, fam)
    gemma = fam == GEMMA3
    act_field = "hidden_activation" if gemma else "hidden_act"
    act = get(config, act_field, "gelu_pytorch_tanh" if gemma else "silu")
    if _ACTIVATIONS.get(act) != ("gelu" if gemma else "silu"):
        refuse(act_field, act, f"{fam}'s feed-forward layer is "
               f"{'GeGLU (gelu_pytorch_tanh)' if gemma else 'SwiGLU (silu)'} here")
    heads, d = config["num_attention_heads"], config["hidden_size"]
    head_dim = get(config, "head_dim", d // heads)
    full, local, rope_field = _rope_parameters(config)
    windows = _windows(config, fam)
    local_wavelength = 0.0
    if windows and local is not full:
        if _rope(local, f"{rope_field}.sliding_attention")["rope_scaling.kind"] != "none":
            refuse(f"{rope_field}.sliding_attention.rope_type", local.get("rope_type"),
                   "mtrain's sliding layers rotate unscaled")
        local_wavelength = float(local["rope_theta"])
    scale = get(config, "query_pre_attn_scalar", head_dim) ** -0.5 if gemma else head_dim ** -0.5
    bos = config.get("bos_token_id")
    fields = {
        "transformer.d_model": "hidden_size", "transformer.d_ff": "intermediate_size",
        "transformer.num_heads": "num_attention_heads",
        "transformer.num_kv_heads": "num_key_value_heads", "transformer.d_kv": "head_dim",
        "transformer.num_layers": "num_hidden_layers",
        "transformer.max_length": "max_position_embeddings",
        "transformer.rotary_max_wavelength": "rope_theta",
        "transformer.norm_epsilon": "rms_norm_eps", "transformer.start_id": "bos_token_id",
        "transformer.attention_windows": "layer_types / sliding_window",
        "transformer.attention_scale": "query_pre_attn_scalar" if gemma else "head_dim",
        "transformer.shared_embedding_and_softmax": "tie_word_embeddings",
    }
    arch = {
        "transformer.d_model": d, "transformer.d_ff": config["intermediate_size"],
        "transformer.num_heads": heads,
        "transformer.num_kv_heads": get(config, "num_key_value_heads", heads),
        "transformer.d_kv": head_dim, "transformer.num_layers": config["num_hidden_layers"],
        "transformer.max_length": get(config, "max_position_embeddings", 2048),
        "transformer.mlp_activations": (_ACTIVATIONS[act], "linear"),
        "transformer.position_encoding": "rotary",
        "transformer.rotary_max_wavelength": float(full["rope_theta"]),
        "transformer.rotary_local_max_wavelength": local_wavelength,
        **_rope(full, rope_field),
        "transformer.attention_windows": windows,
        "transformer.attention_scale": float(scale),
        "transformer.attention_bias": fam == QWEN2,
        "transformer.qk_norm": fam in (QWEN3, QWEN3_MOE, GEMMA3),
        "transformer.norm_scale_offset": 1.0 if gemma else 0.0,
        "transformer.post_norms": gemma,
        "transformer.embedding_multiplier": float(d ** 0.5) if gemma else 1.0,
        "transformer.shared_embedding_and_softmax": bool(get(config, "tie_word_embeddings",
                                                             gemma)),
        "transformer.shared_softmax_scaled": False,
        "transformer.norm_epsilon": float(get(config, "rms_norm_eps", 1e-6)),
    }
    # A family without a BOS (Qwen) reads its EOS (<|endoftext|>) first: a default.
    defaults = {"transformer.dropout_rate": 0.0}
    if bos is not None:
        arch["transformer.start_id"] = int(bos)
    else:
        defaults["transformer.start_id"] = int(first(config["eos_token_id"]))
    if fam in EXPERTS:
        arch, fields, defaults = _experts(config, fam, arch, fields, defaults)
    pad = config.get("pad_token_id")
    return Settings(fam, arch, fields, defaults, config["vocab_size"],
                    first(config.get("eos_token_id")), bos,
                    pad_id=pad if isinstance(pad, int) else None)


def _experts(config: dict, fam: str, arch: dict, fields: dict, defaults: dict):
    qwen = fam == QWEN3_MOE
    experts_field = "num_experts" if qwen and "num_experts" in config else "num_local_experts"
    experts, top_k = config[experts_field], config["num_experts_per_tok"]
    arch = arch | {"transformer.moe_every": get(config, "decoder_sparse_step", 1) if qwen else 1,
                   "moe.num_experts": experts, "moe.top_k": top_k,
                   "moe.expert_d_ff": config["moe_intermediate_size"] if qwen else 0,
                   "moe.normalize_top_k": bool(get(config, "norm_topk_prob", False))
                   if qwen else True}
    fields = fields | {"moe.num_experts": experts_field, "moe.top_k": "num_experts_per_tok",
                       "moe.normalize_top_k": "norm_topk_prob",
                       "moe.expert_d_ff": "moe_intermediate_size",
                       "transformer.moe_every": "decoder_sparse_step"}
    # Hugging Face drops no token: dropless dispatch (grouped matmuls); a capacity that
    # holds every token of a group where a user picks moe.dispatch = 'capacity'
    dropless = experts / top_k
    # Hugging Face adds its auxiliary loss only where output_router_logits says so.
    aux = get(config, "router_aux_loss_coef", 0.0) if get(
        config, "output_router_logits", False) else 0.0
    defaults = defaults | {"moe.dispatch": "dropless", "moe.capacity_factor_train": dropless,
                           "moe.capacity_factor_eval": dropless,
                           "moe.load_balance_loss": float(aux), "moe.router_z_loss": 0.0}
    return arch, fields, defaults


def family_of(c) -> str:
    """The decoder-only family a rotary `TransformerConfig` exports as."""
    if c.moe_every:
        return QWEN3_MOE if c.qk_norm else MIXTRAL
    if c.post_norms or c.norm_scale_offset:
        return GEMMA3
    if c.qk_norm:
        return QWEN3
    if c.attention_bias:
        return QWEN2
    return MISTRAL if c.attention_windows else LLAMA


def _rope_out(c, wavelength: float, scaled: bool) -> dict:
    out = {"rope_type": "default", "rope_theta": wavelength}
    r = c.rope_scaling
    if scaled and r.kind != "none":
        out |= {"rope_type": r.kind, "factor": r.factor}
        if r.kind == "llama3":
            out |= {"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                    "original_max_position_embeddings": r.original_max_length}
    return out


def hf_config(c, vocab_rows: int, eos_id: int, bos_id: int | None) -> dict:
    """The config.json of a rotary decoder-only `TransformerConfig` `c`."""
    fam = family_of(c)

    def refuse_(why):
        raise ConversionError(f"this model has no Hugging Face family: {why}")

    gemma = fam == GEMMA3
    activations = ("gelu", "linear") if gemma else ("silu", "linear")
    if c.mlp_activations != activations:
        refuse_(f"{fam}'s feed-forward layer is {activations}, not "
                f"transformer.mlp_activations={c.mlp_activations}")
    if c.shared_embedding_and_softmax and c.shared_softmax_scaled:
        refuse_("mtrain's shared softmax scales its logits by d_model^-0.5 here, Hugging "
                "Face's tied ones do not (transformer.shared_softmax_scaled)")
    if gemma and not (c.post_norms and c.norm_scale_offset == 1.0 and c.qk_norm
                      and math.isclose(c.embedding_multiplier, c.d_model ** 0.5)):
        refuse_("Gemma 3 has post-sublayer (1 + w) norms, q/k norms and embeddings times "
                "sqrt(d_model) together")
    if not gemma and (c.embedding_multiplier != 1.0 or c.rotary_local_max_wavelength):
        refuse_(f"{fam} has no embedding multiplier or RoPE of its own for sliding layers")
    windows = [layer_window(c, i) for i in range(c.num_layers)]
    sizes = sorted(set(windows) - {0})
    if len(sizes) > 1 or (0 in windows and sizes and fam in (MISTRAL, MIXTRAL)):
        refuse_(f"{fam} has one sliding window, in every layer "
                f"(transformer.attention_windows={c.attention_windows})")
    types = ["sliding_attention" if w else "full_attention" for w in windows]
    rope = _rope_out(c, c.rotary_max_wavelength, True)
    config = {
        "architectures": [fam], "model_type": MODEL_TYPES[fam], "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.d_kv,
        "num_hidden_layers": c.num_layers, "max_position_embeddings": c.max_length,
        "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rotary_max_wavelength,
        "rope_parameters": rope, "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "attention_bias": c.attention_bias and fam != QWEN2, "mlp_bias": False,
        "tie_word_embeddings": c.shared_embedding_and_softmax, "vocab_size": vocab_rows,
        "bos_token_id": None if fam in _QWEN else (bos_id if bos_id is not None else c.start_id),
        "eos_token_id": eos_id, "initializer_range": 0.02, "dtype": "float32",
        "hidden_act": "silu", "sliding_window": sizes[0] if sizes else None,
    }
    if fam in _QWEN:
        config |= {"layer_types": types, "use_sliding_window": bool(sizes),
                   "max_window_layers": c.num_layers}
    if gemma:
        local = _rope_out(c, c.rotary_local_max_wavelength or c.rotary_max_wavelength,
                          not c.rotary_local_max_wavelength)
        config |= {"layer_types": types, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": _whole(c.attention_scale ** -2),
                   "rope_parameters": {"full_attention": rope, "sliding_attention": local},
                   "rope_local_base_freq": local["rope_theta"], "pad_token_id": 0,
                   "attn_logit_softcapping": None, "final_logit_softcapping": None}
        del config["hidden_act"]
    if c.moe_every:
        m = c.moe
        if fam == MIXTRAL and (c.moe_every != 1 or m.expert_d_ff != c.d_ff):
            refuse_("Mixtral has experts of d_ff in every layer (transformer.moe_every, "
                    "moe.expert_d_ff)")
        if fam == MIXTRAL and not m.renormalizes:
            refuse_("Mixtral renormalises its top_k gates (moe.normalize_top_k)")
        config |= {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                   "router_aux_loss_coef": m.load_balance_loss, "router_jitter_noise": 0.0,
                   "output_router_logits": False}
        if fam == QWEN3_MOE:
            config |= {"num_experts": m.num_experts, "moe_intermediate_size": m.expert_d_ff,
                       "decoder_sparse_step": c.moe_every, "mlp_only_layers": [],
                       "norm_topk_prob": m.renormalizes}
    return config


def _whole(x: float):
    """`x` as an int where it is one up to float rounding (Gemma's query_pre_attn_scalar)."""
    return round(x) if math.isclose(x, round(x), rel_tol=1e-9) else x
