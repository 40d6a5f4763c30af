"""The decoder-only families' ``config.json`` as mtrain settings (`settings`) and back
(`hf_config`), each read off its record (`record.Family`: what it has and names);
`families`' module doc says what each family is. `refusal` says why a model cannot be a
family (None: it can), which export asks of the recorded family, or of each in turn for a
model trained here."""

from __future__ import annotations

import math

from mtrain.huggingface.common import ConversionError, Settings, first, get, refuse
from mtrain.huggingface.record import ACTIVATIONS, DECODER_FIELDS, Family
from mtrain.models.blocks import layer_window

ROPE_TYPES = ("default", "linear", "llama3")


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


def _windows(config: dict, fam: Family) -> tuple[int, ...]:
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
        if fam.use_sliding_window:
            refuse("use_sliding_window", True, f"without layer_types, {fam}'s windows follow "
                   "max_window_layers, which mtrain does not read")
        per_layer = [window] * layers
    else:
        return ()
    period = next(p for p in range(1, layers + 1)
                  if all(per_layer[i] == per_layer[i % p] for i in range(layers)))
    pattern = tuple(int(w) for w in per_layer[:period])
    return () if pattern == (0,) else pattern


def _refusals(config: dict, fam: Family) -> None:
    if not fam.qkv_bias and get(config, "attention_bias", False):
        refuse("attention_bias", True, "mtrain's attention output has no bias (the q, k and "
               "v biases of Qwen2 it has)")
    if get(config, "mlp_bias", False):
        refuse("mlp_bias", True, "mtrain's feed-forward projections have no biases")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(config, field) is not None:
            refuse(field, config[field], "mtrain caps no logits (Gemma 2's soft-capping)")
    if get(config, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", True, "mtrain's language models are causal")
    if fam.experts and get(config, "router_jitter_noise", 0.0):
        refuse("router_jitter_noise", config["router_jitter_noise"], "mtrain's router adds "
               "no noise")
    for field in fam.experts.refused if fam.experts else ():
        if get(config, field, []):
            refuse(field, config[field], f"mtrain's experts are in every "
                   f"{fam.experts.every_field}-th layer")


def settings(config: dict, fam: Family) -> Settings:
    """The mtrain settings of a decoder-only family's `config` (see `families.settings`)."""
    _refusals(config, fam)
    act_field = fam.activation_field
    act = get(config, act_field, fam.activation)
    if ACTIVATIONS.get(act) != fam.mtrain_activation:
        refuse(act_field, act, f"{fam}'s feed-forward layer is gated {fam.activation} here")
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
    scale = (get(config, fam.scale_field, head_dim) if fam.scale_field else head_dim) ** -0.5
    bos = config.get("bos_token_id")
    own = (*DECODER_FIELDS, *fam.fields)
    fields = {
        **{f.setting: f.field for f in own},
        "transformer.num_kv_heads": "num_key_value_heads", "transformer.d_kv": "head_dim",
        "transformer.rotary_max_wavelength": "rope_theta", "transformer.start_id": "bos_token_id",
        "transformer.attention_windows": "layer_types / sliding_window",
        "transformer.attention_scale": fam.scale_field or "head_dim",
        "transformer.shared_embedding_and_softmax": "tie_word_embeddings",
    }
    arch = {
        **{f.setting: f.read(config) for f in own},
        "transformer.num_kv_heads": get(config, "num_key_value_heads", heads),
        "transformer.d_kv": head_dim,
        "transformer.mlp_activations": (ACTIVATIONS[act], "linear"),
        "transformer.position_encoding": "rotary",
        "transformer.rotary_max_wavelength": float(full["rope_theta"]),
        "transformer.rotary_local_max_wavelength": local_wavelength,
        **_rope(full, rope_field),
        "transformer.attention_windows": windows,
        "transformer.attention_scale": float(scale),
        "transformer.attention_bias": fam.qkv_bias,
        "transformer.qk_norm": fam.qk_norm,
        "transformer.norm_scale_offset": fam.norm_scale_offset,
        "transformer.post_norms": fam.post_norms,
        "transformer.embedding_multiplier": float(d ** 0.5) if fam.scaled_embedding else 1.0,
        "transformer.shared_embedding_and_softmax": bool(get(config, "tie_word_embeddings",
                                                             fam.tied_by_default)),
        "transformer.shared_softmax_scaled": False,
    }
    # A family without a BOS (Qwen) reads its EOS (<|endoftext|>) first: a default.
    defaults = {"transformer.dropout_rate": 0.0}
    if bos is not None:
        arch["transformer.start_id"] = int(bos)
    else:
        defaults["transformer.start_id"] = int(first(config["eos_token_id"]))
    if fam.experts:
        arch, fields, defaults = _experts(config, fam, arch, fields, defaults)
    pad = config.get("pad_token_id")
    return Settings(fam.architecture, arch, fields, defaults, config["vocab_size"],
                    first(config.get("eos_token_id")), bos,
                    pad_id=pad if isinstance(pad, int) else None)


def _experts(config: dict, fam: Family, arch: dict, fields: dict, defaults: dict):
    e = fam.experts
    experts_field = next((f for f in e.count_fields if f in config), e.count_fields[-1])
    experts, top_k = config[experts_field], config["num_experts_per_tok"]
    arch = arch | {"transformer.moe_every": get(config, e.every_field, 1) if e.every_field else 1,
                   "moe.num_experts": experts, "moe.top_k": top_k,
                   "moe.expert_d_ff": config[e.d_ff_field] if e.d_ff_field else 0,
                   "moe.normalize_top_k": bool(get(config, e.normalize_field, False))
                   if e.normalize_field else True}
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


def _rope_out(c, wavelength: float, scaled: bool) -> dict:
    out = {"rope_type": "default", "rope_theta": wavelength}
    r = c.rope_scaling
    if scaled and r.kind != "none":
        out |= {"rope_type": r.kind, "factor": r.factor}
        if r.kind == "llama3":
            out |= {"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                    "original_max_position_embeddings": r.original_max_length}
    return out


def refusal(fam: Family, c) -> str | None:
    """Why the rotary `TransformerConfig` `c` cannot be the family `fam` (None: it can): each
    setting the record has or has not, in turn."""
    activations = (fam.mtrain_activation, "linear")
    if c.mlp_activations != activations:
        return (f"{fam}'s feed-forward layer is {activations}, not "
                f"transformer.mlp_activations={c.mlp_activations}")
    if c.shared_embedding_and_softmax and c.shared_softmax_scaled:
        return ("mtrain's shared softmax scales its logits by d_model^-0.5 here, Hugging "
                "Face's tied ones do not (transformer.shared_softmax_scaled)")
    has = lambda yes: "has" if yes else "has no"  # noqa: E731
    multiplier = c.d_model ** 0.5 if fam.scaled_embedding else 1.0
    for ours, theirs, setting in (
            (c.attention_bias, fam.qkv_bias, "biases on q, k and v (transformer.attention_bias)"),
            (c.qk_norm, fam.qk_norm, "q/k norms (transformer.qk_norm)"),
            (c.post_norms, fam.post_norms, "norms after each sublayer (transformer.post_norms)"),
            (c.norm_scale_offset == 1.0, fam.norm_scale_offset == 1.0,
             "(1 + w) norm scales (transformer.norm_scale_offset)"),
            (not math.isclose(c.embedding_multiplier, 1.0), fam.scaled_embedding,
             "embeddings times sqrt(d_model) (transformer.embedding_multiplier)"),
            (bool(c.moe_every), bool(fam.experts), "experts (transformer.moe_every)")):
        if bool(ours) != bool(theirs):
            return f"{fam} {has(theirs)} {setting}"
    if not math.isclose(c.embedding_multiplier, multiplier):
        return f"{fam}'s embedding multiplier is {multiplier} (transformer.embedding_multiplier)"
    if c.norm_scale_offset != fam.norm_scale_offset:
        return f"{fam}'s norms scale by {fam.norm_scale_offset} + w (transformer.norm_scale_offset)"
    if c.rotary_local_max_wavelength and not fam.local_rope:
        return (f"{fam} has no RoPE of its own for sliding layers "
                f"(transformer.rotary_local_max_wavelength)")
    windows = [layer_window(c, i) for i in range(c.num_layers)]
    sizes = sorted(set(windows) - {0})
    if sizes and fam.windows == "none":
        return f"{fam} has no sliding window (transformer.attention_windows={c.attention_windows})"
    if len(sizes) > 1 or (0 in windows and sizes and fam.windows == "every_layer"):
        return (f"{fam} has one sliding window, in every layer "
                f"(transformer.attention_windows={c.attention_windows})")
    e, m = fam.experts, c.moe
    if e and e.every_field is None and (c.moe_every != 1 or m.expert_d_ff != c.d_ff):
        return (f"{fam} has experts of d_ff in every layer (transformer.moe_every, "
                f"moe.expert_d_ff)")
    if e and e.normalize_field is None and not m.renormalizes:
        return f"{fam} renormalises its top_k gates (moe.normalize_top_k)"
    return None


def hf_config(fam: Family, c, vocab_rows: int, eos_id: int, bos_id: int | None) -> dict:
    """The config.json of a rotary decoder-only `TransformerConfig` `c` as the family `fam`
    (ConversionError where `refusal` finds it cannot be)."""
    why = refusal(fam, c)
    if why:
        raise ConversionError(f"this model has no Hugging Face family: {why}")
    windows = [layer_window(c, i) for i in range(c.num_layers)]
    sizes = sorted(set(windows) - {0})
    types = ["sliding_attention" if w else "full_attention" for w in windows]
    rope = _rope_out(c, c.rotary_max_wavelength, True)
    config = {
        "architectures": [fam.architecture], "model_type": fam.model_type,
        **{f.field: f.value(c) for f in (*DECODER_FIELDS, *fam.fields)},
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.d_kv,
        "rope_theta": c.rotary_max_wavelength,
        "rope_parameters": rope, "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "attention_bias": c.attention_bias and not fam.qkv_bias, "mlp_bias": False,
        "tie_word_embeddings": c.shared_embedding_and_softmax, "vocab_size": vocab_rows,
        "bos_token_id": (bos_id if bos_id is not None else c.start_id) if fam.bos else None,
        "eos_token_id": eos_id, "initializer_range": 0.02, "dtype": "float32",
        fam.activation_field: fam.activation, "sliding_window": sizes[0] if sizes else None,
    }
    if fam.windows == "layer_types":
        config["layer_types"] = types
    if fam.use_sliding_window:
        config |= {"use_sliding_window": bool(sizes), "max_window_layers": c.num_layers}
    if fam.scale_field:
        config[fam.scale_field] = _whole(c.attention_scale ** -2)
    if fam.local_rope:
        local = _rope_out(c, c.rotary_local_max_wavelength or c.rotary_max_wavelength,
                          not c.rotary_local_max_wavelength)
        config |= {"rope_parameters": {"full_attention": rope, "sliding_attention": local},
                   "rope_local_base_freq": local["rope_theta"]}
    config |= dict(fam.constants)
    if fam.experts:
        e, m = fam.experts, c.moe
        config |= {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                   "router_aux_loss_coef": m.load_balance_loss, "router_jitter_noise": 0.0,
                   "output_router_logits": False, **{f: m.num_experts for f in e.count_fields},
                   **{f: [] for f in e.refused}}
        for field, value in ((e.d_ff_field, m.expert_d_ff), (e.every_field, c.moe_every),
                             (e.normalize_field, m.renormalizes)):
            if field:
                config[field] = value
    return config


def _whole(x: float):
    """`x` as an int where it is one up to float rounding (Gemma's query_pre_attn_scalar)."""
    return round(x) if math.isclose(x, round(x), rel_tol=1e-9) else x
