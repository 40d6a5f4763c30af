"""A decoder-only family's experts (`record.Experts`) in its ``config.json`` as ``moe.*``
settings (`settings`) and back (`written`), and why a model's experts cannot be the
family's (`refusal`).

The routers, as transformers computes them: a softmax over the experts, the top-k gates
renormalised as the record says (Mixtral always, Qwen3-MoE by ``norm_topk_prob``; gpt-oss's
softmax over its top-k logits is that, with a bias on the logits: ``moe.router_bias``);
DeepSeek-V3's sigmoid scores (``moe.router_scoring='sigmoid'``), chosen by score plus
``e_score_correction_bias`` (``moe.choice_bias``) within the best ``topk_group`` of
``n_group`` groups (``moe.num_groups``, ``moe.top_groups``), weighted by the unbiased
scores, renormalised by ``norm_topk_prob``, times ``routed_scaling_factor``
(``moe.routed_scaling``), beside ``n_shared_experts`` shared experts
(``moe.num_shared_experts``), after ``first_k_dense_replace`` dense layers
(``transformer.first_dense_layers``). An import keeps DeepSeek's bias where it is
(``moe.bias_update_rate`` 0; a fine-tune may move it) and trains without Hugging Face's
auxiliary loss unless ``output_router_logits`` says otherwise.
"""

from __future__ import annotations

from mtrain.huggingface.common import get, refuse
from mtrain.huggingface.record import Family


def settings(config: dict, fam: Family, arch: dict, fields: dict, defaults: dict):
    """(arch, fields, defaults) with the family's experts read from `config`."""
    e = fam.experts
    experts_field = next((f for f in e.count_fields if f in config), e.count_fields[-1])
    experts, top_k = config[experts_field], config["num_experts_per_tok"]
    arch = arch | {"transformer.moe_every": get(config, e.every_field, 1) if e.every_field else 1,
                   "moe.num_experts": experts, "moe.top_k": top_k,
                   "moe.expert_d_ff": config[e.d_ff_field] if e.d_ff_field else 0,
                   "moe.normalize_top_k": bool(get(config, e.normalize_field, False))
                   if e.normalize_field else True}
    fields = fields | {"moe.num_experts": experts_field, "moe.top_k": "num_experts_per_tok",
                       "moe.normalize_top_k": e.normalize_field or "architectures",
                       "moe.expert_d_ff": e.d_ff_field or "intermediate_size",
                       "transformer.moe_every": e.every_field or "architectures"}
    # What only some families' routers have: bound where they do (an import of Mixtral
    # binds none of them)
    own = {"moe.router_scoring": e.scoring, "moe.choice_bias": e.choice_bias,
           "moe.router_bias": e.router_bias, "moe.expert_bias": e.fused}
    arch |= {k: v for k, v in own.items() if v not in ("softmax", False)}
    if e.choice_bias:  # the bias stays as trained until a fine-tune says otherwise
        defaults = defaults | {"moe.bias_update_rate": 0.0}
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


def refusal(fam: Family, c) -> str | None:
    """Why the experts of `c` (a `TransformerConfig`) cannot be `fam`'s (None: they can)."""
    e, m = fam.experts, c.moe
    if bool(c.moe_every) != bool(e):
        return f"{fam} {'has' if e else 'has no'} experts (transformer.moe_every)"
    if not e:
        return None
    if e.every_field is None and c.moe_every != 1:
        return f"{fam} has experts in every layer (transformer.moe_every)"
    if e.d_ff_field is None and m.expert_d_ff not in (0, c.d_ff):
        return f"{fam}'s experts are of d_ff (moe.expert_d_ff)"
    if e.normalize_field is None and not m.renormalizes:
        return f"{fam} renormalises its top_k gates (moe.normalize_top_k)"
    if m.router_scoring != e.scoring:
        return f"{fam}'s router scores by {e.scoring} (moe.router_scoring)"
    for ours, theirs, what in (
            (m.choice_bias, e.choice_bias, "a choice bias (moe.choice_bias)"),
            (m.router_bias, e.router_bias, "a router bias (moe.router_bias)"),
            (m.expert_bias, e.fused, "biases in its experts (moe.expert_bias)")):
        if bool(ours) != bool(theirs):
            return f"{fam} {'has' if theirs else 'has no'} {what}"
    return None


def written(fam: Family, c) -> dict:
    """The experts' fields of the config.json of `c` as `fam`."""
    e, m = fam.experts, c.moe
    config = {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
              "router_aux_loss_coef": m.load_balance_loss, "router_jitter_noise": 0.0,
              "output_router_logits": False, **{f: m.num_experts for f in e.count_fields},
              **{f: [] for f in e.refused}}
    for field, value in ((e.d_ff_field, m.expert_d_ff), (e.every_field, c.moe_every),
                         (e.normalize_field, m.renormalizes)):
        if field:
            config[field] = value
    return config


def check(config: dict, fam: Family) -> None:
    """Refuses the experts' fields of `config` that mtrain cannot honour."""
    if get(config, "router_jitter_noise", 0.0):
        refuse("router_jitter_noise", config["router_jitter_noise"], "mtrain's router adds "
               "no noise")
    for field in fam.experts.refused:
        if get(config, field, []):
            refuse(field, config[field], f"mtrain's experts are in every "
                   f"{fam.experts.every_field}-th layer")
