"""A decoder-only family's rotary positions in its ``config.json`` as ``rope_scaling.*``
settings (`settings`, from either form found on the Hub: `parameters`) and back
(`written`), and the attention scale its Hugging Face model computes (`attention_scale`).

Rope types 'default', 'linear', 'llama3' and 'yarn' are honoured, others ('dynamic',
'longrope') refused. YaRN (DeepSeek-V3, gpt-oss, Qwen's long contexts) is read as
transformers reads it (`_compute_yarn_parameters`): ``factor`` (where missing,
max_position_embeddings / original_max_position_embeddings), ``original_max_position_
embeddings`` (where missing, max_position_embeddings), ``beta_fast`` 32 and ``beta_slow`` 1
where missing, ``truncate`` (true where missing: the correction range floored and ceiled),
and the factor on cos and sin: ``attention_factor`` where given, else
mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given, else
0.1 ln(factor) + 1 (``rope_scaling.attention_factor`` 0: the model computes it so).
DeepSeek's attention also multiplies its softmax scale by mscale(factor, mscale_all_dim)²
(transformers' `DeepseekV3Attention`): an import's ``transformer.attention_scale``.
"""

from __future__ import annotations

import math

from mtrain.huggingface.common import get, refuse
from mtrain.huggingface.record import Family

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def settings(params: dict, field: str, max_length: int) -> dict:
    """The ``rope_scaling.*`` bindings of one layer type's RoPE parameters (`field`: where
    they were read, for the error; `max_length`: max_position_embeddings)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"{field}.rope_type", kind, f"mtrain implements rope types "
               f"{', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", params["partial_rotary_factor"], "mtrain rotates "
               "every dimension of a head")
    out = {"rope_scaling.kind": "none" if kind == "default" else kind}
    if kind in ("linear", "llama3"):
        out["rope_scaling.factor"] = float(params["factor"])
    if kind == "llama3":
        out |= {"rope_scaling.low_freq_factor": float(params["low_freq_factor"]),
                "rope_scaling.high_freq_factor": float(params["high_freq_factor"]),
                "rope_scaling.original_max_length":
                    int(params["original_max_position_embeddings"])}
    if kind == "yarn":
        out |= _yarn(params, field, max_length)
    return out


def _yarn(params: dict, field: str, max_length: int) -> dict:
    original = get(params, "original_max_position_embeddings")
    factor = get(params, "factor")
    if factor is None:
        if original is None:
            refuse(f"{field}.factor", None, "YaRN needs a factor, or an "
                   "original_max_position_embeddings that max_position_embeddings stretches")
        factor = max_length / original
    return {"rope_scaling.factor": float(factor),
            "rope_scaling.original_max_length": int(original or max_length),
            "rope_scaling.beta_fast": float(get(params, "beta_fast") or 32.0),
            "rope_scaling.beta_slow": float(get(params, "beta_slow") or 1.0),
            "rope_scaling.mscale": float(get(params, "mscale") or 0.0),
            "rope_scaling.mscale_all_dim": float(get(params, "mscale_all_dim") or 0.0),
            "rope_scaling.truncate": bool(get(params, "truncate", True)),
            "rope_scaling.attention_factor": float(get(params, "attention_factor") or 0.0)}


def parameters(config: dict) -> tuple[dict, dict, str]:
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


def written(c, wavelength: float, scaled: bool) -> dict:
    """The ``rope_parameters`` of a `TransformerConfig` `c`'s layers rotating by
    `wavelength`, scaled by ``rope_scaling`` where `scaled`."""
    out = {"rope_type": "default", "rope_theta": wavelength}
    r = c.rope_scaling
    if scaled and r.kind != "none":
        out |= {"rope_type": r.kind, "factor": r.factor}
        if r.kind == "llama3":
            out |= {"low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
                    "original_max_position_embeddings": r.original_max_length}
        if r.kind == "yarn":
            out |= {"original_max_position_embeddings": r.original_max_length,
                    "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
            out |= {k: getattr(r, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                    if getattr(r, k)}
            if not r.truncate:
                out["truncate"] = False
    return out


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's magnitude scale of a context stretched by `factor` (transformers'
    `yarn_get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def attention_scale(fam: Family, c) -> float:
    """What the Hugging Face model of family `fam` with the settings of `c` multiplies q.k
    by: its scale field's (Gemma's, which export writes from ``transformer.attention_scale``
    itself), DeepSeek's (q.k width^-0.5, times mscale(factor, mscale_all_dim)² under a
    scaled RoPE), else head_dim^-0.5."""
    if fam.scale_field:
        return c.attention_scale
    if fam.latent_attention:
        r, m = c.rope_scaling, c.mla
        scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
        if r.kind != "none" and getattr(r, "mscale_all_dim", 0.0):
            scale *= mscale(r.factor, r.mscale_all_dim) ** 2
        return scale
    return c.d_kv ** -0.5


def latent_scale(settings: dict) -> float:
    """DeepSeek's attention scale of the settings read from its config.json (``mla.*``,
    ``rope_scaling.*``)."""
    scale = (settings["mla.qk_nope_head_dim"] + settings["mla.qk_rope_head_dim"]) ** -0.5
    if settings["rope_scaling.kind"] != "none" and settings.get("rope_scaling.mscale_all_dim"):
        scale *= mscale(settings["rope_scaling.factor"],
                        settings["rope_scaling.mscale_all_dim"]) ** 2
    return scale
