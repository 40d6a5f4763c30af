"""The decoder-only families' ``config.json`` as mtrain settings (`settings`) and back
(`hf_config`), each read off its record (`record.Family`: what it has and names; its RoPE
is `rotary`'s, its experts `experts`'); `families`' module doc says what each family is.
`refusal` says why a model cannot be a family (None: it can), which export asks of the
recorded family, or of each in turn for a model trained here."""

from __future__ import annotations

import math

from mtrain.huggingface import experts, rotary
from mtrain.huggingface.common import ConversionError, Settings, first, get, refuse
from mtrain.huggingface.record import ACTIVATIONS, DECODER_FIELDS, Family
from mtrain.models.blocks import layer_window

# Settings only some families have (a config.json field of theirs: `Family.fields`), with
# the value that means a model has none of it; a model trained here with another value
# exports only as a family that has it.
OPTIONAL = (("transformer.first_dense_layers", 0, "dense first layers before its experts"),
            ("transformer.mtp_depth", 0, "multi-token prediction modules"),
            ("moe.num_shared_experts", 0, "shared experts"),
            ("moe.num_groups", 1, "group-limited routing"),
            ("moe.top_groups", 1, "group-limited routing"),
            ("moe.routed_scaling", 1.0, "a scale on its routed experts' weights"))


def _windows(config: dict, fam: Family) -> tuple[int, ...]:
    """``transformer.attention_windows``: the shortest pattern of the layers' windows that
    repeats over them (0: a full layer), from ``layer_types`` where given, else
    ``sliding_window`` in every layer (in all but every `Family.sliding_pattern`-th)."""
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
        pattern = get(config, "sliding_window_pattern", fam.sliding_pattern)
        per_layer = [window if not pattern or (i + 1) % pattern else 0 for i in range(layers)]
    else:
        return ()
    period = next(p for p in range(1, layers + 1)
                  if all(per_layer[i] == per_layer[i % p] for i in range(layers)))
    pattern = tuple(int(w) for w in per_layer[:period])
    return () if pattern == (0,) else pattern


def _refusals(config: dict, fam: Family) -> None:
    if not (fam.qkv_bias or fam.attention_bias_field) and get(config, "attention_bias", False):
        refuse("attention_bias", True, f"mtrain reads {fam} without biases on its attention "
               "projections")
    if get(config, "mlp_bias", False):
        refuse("mlp_bias", True, "mtrain's feed-forward projections have no biases")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(config, field) is not None:
            refuse(field, config[field], "mtrain caps no logits (Gemma 2's soft-capping)")
    if get(config, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", True, "mtrain's language models are causal")
    quantized = get(config, "quantization_config")
    if quantized:
        refuse("quantization_config.quant_method", quantized.get("quant_method"),
               "mtrain imports unquantized weights: load them dequantized in transformers "
               "(its quantization config's dequantize=True) and save_pretrained them first")
    for field, value in fam.fixed:
        if get(config, field, value) != value:
            refuse(field, config[field], f"mtrain's {fam} has {value!r} only, as "
                   "transformers' does")
    if fam.experts:
        experts.check(config, fam)


def settings(config: dict, fam: Family) -> Settings:
    """The mtrain settings of a decoder-only family's `config` (see `families.settings`)."""
    _refusals(config, fam)
    act_field = fam.activation_field
    act = get(config, act_field, fam.activation)
    if fam.mlp_activations is None and ACTIVATIONS.get(act) != fam.mtrain_activation:
        refuse(act_field, act, f"{fam}'s feed-forward layer is gated {fam.activation} here")
    heads, d = config["num_attention_heads"], config["hidden_size"]
    head_dim = get(config, "head_dim", d // heads)
    full, local, rope_field = rotary.parameters(config)
    max_length = get(config, "max_position_embeddings", 2048)
    rope = rotary.settings(full, rope_field, max_length)
    windows = _windows(config, fam)
    local_wavelength = 0.0
    if windows and local is not full:
        local_rope = rotary.settings(local, f"{rope_field}.sliding_attention", max_length)
        if local_rope["rope_scaling.kind"] != "none":
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
        "transformer.attention_scale": fam.scale_field or ("qk_head_dim, rope mscale_all_dim"
                                                           if fam.latent_attention else "head_dim"),
        "transformer.shared_embedding_and_softmax": "tie_word_embeddings",
        "transformer.attention_bias": "attention_bias",
        **{f"transformer.{k}": "attention_bias"
           for k in ("attention_output_bias",) if fam.attention_bias_field},
    }
    biases = fam.qkv_bias or (fam.attention_bias_field and bool(get(config, "attention_bias",
                                                                    True)))
    arch = {
        **{f.setting: f.read(config) for f in own},
        "transformer.num_kv_heads": get(config, "num_key_value_heads", heads),
        "transformer.d_kv": head_dim,
        "transformer.mlp_activations": fam.mlp_activations or (ACTIVATIONS[act], "linear"),
        "transformer.position_encoding": "rotary",
        "transformer.rotary_max_wavelength": float(full["rope_theta"]),
        "transformer.rotary_local_max_wavelength": local_wavelength,
        **rope,
        "transformer.attention_windows": windows,
        "transformer.attention_scale": float(scale),
        "transformer.attention_bias": biases,
        "transformer.qk_norm": fam.qk_norm,
        "transformer.norm_scale_offset": fam.norm_scale_offset,
        "transformer.post_norms": fam.post_norms,
        "transformer.embedding_multiplier": float(d ** 0.5) if fam.scaled_embedding else 1.0,
        "transformer.shared_embedding_and_softmax": bool(get(config, "tie_word_embeddings",
                                                             fam.tied_by_default)),
        "transformer.shared_softmax_scaled": False,
    }
    # What only some families have: bound where they have it (an import of Llama binds none)
    if fam.attention_bias_field:
        arch["transformer.attention_output_bias"] = biases
    if fam.sinks:
        arch["transformer.attention_sinks"] = True
    if fam.latent_attention:
        arch |= _latent(config, heads, arch["mla.qk_rope_head_dim"])
        arch["transformer.attention_scale"] = rotary.latent_scale(arch)
    # A family without a BOS (Qwen) reads its EOS (<|endoftext|>) first: a default.
    defaults = {"transformer.dropout_rate": 0.0}
    if bos is not None:
        arch["transformer.start_id"] = int(bos)
    else:
        defaults["transformer.start_id"] = int(first(config["eos_token_id"]))
    if arch.get("transformer.mtp_depth"):
        # transformers never trains (nor runs) the MTP modules: an import fine-tunes as it
        # would, keeping them as they are, unless the user weighs their loss in
        defaults["transformer.mtp_loss_weight"] = 0.0
    if fam.experts:
        arch, fields, defaults = experts.settings(config, fam, arch, fields, defaults)
    pad = config.get("pad_token_id")
    return Settings(fam.architecture, arch, fields, defaults, config["vocab_size"],
                    first(config.get("eos_token_id")), bos,
                    pad_id=pad if isinstance(pad, int) else None)


def _latent(config: dict, heads: int, rope: int) -> dict:
    """DeepSeek's latent attention beside its ``mla.*`` fields: one key/value head per query
    head, the rotary dimensions (`rope`) transformers' ``head_dim``."""
    if get(config, "num_key_value_heads", heads) != heads:
        refuse("num_key_value_heads", config["num_key_value_heads"], "latent attention's keys "
               "and values have a head per query head (num_attention_heads)")
    if get(config, "head_dim", rope) != rope:
        refuse("head_dim", config["head_dim"], f"transformers rotates head_dim dimensions, and "
               f"latent attention its qk_rope_head_dim={rope}")
    return {"transformer.latent_attention": True, "transformer.num_kv_heads": heads,
            "transformer.d_kv": rope}


def refusal(fam: Family, c) -> str | None:
    """Why the rotary `TransformerConfig` `c` cannot be the family `fam` (None: it can): each
    setting the record has or has not, in turn."""
    if c.mlp_activations != fam.activations:
        return (f"{fam}'s feed-forward layer is {fam.activations}, not "
                f"transformer.mlp_activations={c.mlp_activations}")
    if c.shared_embedding_and_softmax and c.shared_softmax_scaled:
        return ("mtrain's shared softmax scales its logits by d_model^-0.5 here, Hugging "
                "Face's tied ones do not (transformer.shared_softmax_scaled)")
    has = lambda yes: "has" if yes else "has no"  # noqa: E731
    multiplier = c.d_model ** 0.5 if fam.scaled_embedding else 1.0
    biases = c.attention_bias if fam.attention_bias_field else fam.qkv_bias
    for ours, theirs, setting in (
            (c.attention_bias, biases, "biases on q, k and v (transformer.attention_bias)"),
            (c.attention_output_bias, fam.attention_bias_field and c.attention_bias,
             "a bias on the attention output (transformer.attention_output_bias)"),
            (c.latent_attention, fam.latent_attention,
             "multi-head latent attention (transformer.latent_attention)"),
            (c.attention_sinks, fam.sinks, "attention sinks (transformer.attention_sinks)"),
            (c.qk_norm, fam.qk_norm, "q/k norms (transformer.qk_norm)"),
            (c.post_norms, fam.post_norms, "norms after each sublayer (transformer.post_norms)"),
            (c.norm_scale_offset == 1.0, fam.norm_scale_offset == 1.0,
             "(1 + w) norm scales (transformer.norm_scale_offset)"),
            (not math.isclose(c.embedding_multiplier, 1.0), fam.scaled_embedding,
             "embeddings times sqrt(d_model) (transformer.embedding_multiplier)")):
        if bool(ours) != bool(theirs):
            return f"{fam} {has(theirs)} {setting}"
    why = experts.refusal(fam, c)
    if why:
        return why
    own = {f.setting for f in fam.fields}
    for setting, default, what in OPTIONAL:
        group, name = setting.split(".")
        value = getattr(c if group == "transformer" else c.moe, name) \
            if group == "transformer" or c.moe_every else default
        if value != default and setting not in own:
            return f"{fam} has no {what} ({setting}={value})"
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
    return None


def hf_config(fam: Family, c, vocab_rows: int, eos_id: int, bos_id: int | None,
              pad_id: int | None = None) -> dict:
    """The config.json of a rotary decoder-only `TransformerConfig` `c` as the family `fam`
    (ConversionError where `refusal` finds it cannot be); `pad_id` the tokenizer's pad."""
    why = refusal(fam, c)
    if why:
        raise ConversionError(f"this model has no Hugging Face family: {why}")
    windows = [layer_window(c, i) for i in range(c.num_layers)]
    sizes = sorted(set(windows) - {0})
    types = ["sliding_attention" if w else "full_attention" for w in windows]
    rope = rotary.written(c, c.rotary_max_wavelength, True)
    config = {
        "architectures": [fam.architecture], "model_type": fam.model_type,
        **{f.field: f.written(c) for f in (*DECODER_FIELDS, *fam.fields)},
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.d_kv,
        "rope_theta": c.rotary_max_wavelength,
        "rope_parameters": rope, "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "attention_bias": c.attention_bias and not fam.qkv_bias, "mlp_bias": False,
        "tie_word_embeddings": c.shared_embedding_and_softmax, "vocab_size": vocab_rows,
        "bos_token_id": (bos_id if bos_id is not None else c.start_id) if fam.bos else None,
        "eos_token_id": eos_id, "initializer_range": 0.02, "dtype": "float32",
        fam.activation_field: fam.activation, "sliding_window": sizes[0] if sizes else None,
    }
    if fam.latent_attention:  # (transformers' head_dim: the rotary dimensions)
        m = c.mla
        config |= {"num_key_value_heads": c.num_heads, "head_dim": m.qk_rope_head_dim,
                   "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim}
    if fam.windows == "layer_types":
        config["layer_types"] = types
    if fam.use_sliding_window:
        config |= {"use_sliding_window": bool(sizes), "max_window_layers": c.num_layers}
    if fam.scale_field:
        config[fam.scale_field] = _whole(c.attention_scale ** -2)
    if fam.local_rope:
        local = rotary.written(c, c.rotary_local_max_wavelength or c.rotary_max_wavelength,
                               not c.rotary_local_max_wavelength)
        config |= {"rope_parameters": {"full_attention": rope, "sliding_attention": local},
                   "rope_local_base_freq": local["rope_theta"]}
    if fam.config_pad:
        config["pad_token_id"] = pad_id
    config |= dict(fam.constants) | dict(fam.fixed)
    if fam.experts:
        config |= experts.written(fam, c)
    return config


def _whole(x: float):
    """`x` as an int where it is one up to float rounding (Gemma's query_pre_attn_scalar)."""
    return round(x) if math.isclose(x, round(x), rel_tol=1e-9) else x
