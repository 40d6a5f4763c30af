"""The paper's counts of a Transformer (`TransformerConfig`): its matmul parameters and a
train step's model FLOPs, which the planner and the MFU a run logs use."""

from __future__ import annotations


def layer_parameters(c, encoder_layers: int, decoder_layers: int, active: bool = False) -> int:
    """Matmul parameters of the layer stacks: an encoder (or LM) layer has attention (2 d h
    d_kv for queries and outputs, 2 d g d_kv for g key/value heads: 4 d h d_kv with as many)
    and a feed-forward block ((a + 1) d d_ff for a activations: 2 d d_ff with one); a
    decoder layer two attentions. A layer with experts (`moe_layers`) has
    `experts_parameters` in place of its feed-forward block; `active`: only what a token
    goes through counts (its top_k experts), which is what a token computes."""
    attention = 2 * c.d_model * (c.num_heads + c.num_kv_heads) * c.d_kv
    ffn = (len(c.mlp_activations) + 1) * c.d_model * c.d_ff
    own = latent_attention_parameters(c) if getattr(c, "latent_attention", False) \
        else attention  # (self-attention's; a decoder's cross attention is multi-head)
    total = encoder_layers * (own + ffn) + decoder_layers * (own + attention + ffn)
    if c.moe_every:
        total += (moe_layers(c, encoder_layers) + moe_layers(c, decoder_layers)) * (
            experts_parameters(c, active) - ffn)
    return total


def moe_layers(c, layers: int) -> int:
    """How many of a stack's first `layers` layers have experts: after the
    `first_dense_layers` k, every `moe_every`-th (`blocks.is_moe`)."""
    return max(layers - getattr(c, "first_dense_layers", 0), 0) // c.moe_every


def experts_parameters(c, active: bool = False) -> int:
    """The parameters of one layer's experts (`moe.MoeFeedForward`): E experts of (a + 1) d
    expert_d_ff each, and the router, d E; DeepSeek's shared experts, (a + 1) d expert_d_ff
    x num_shared_experts, and choice bias, E; gpt-oss's router bias, E, and expert biases,
    a expert_d_ff + d each. `active`: the top_k experts a token goes through, with the
    router, the shared experts and the biases that every token takes."""
    m, d, a = c.moe, c.d_model, len(c.mlp_activations)
    experts = m.top_k if active else m.num_experts
    per_expert = (a + 1) * d * m.expert_d_ff + (a * m.expert_d_ff + d if m.expert_bias else 0)
    return (experts * per_expert + d * m.num_experts
            + (a + 1) * d * m.expert_d_ff * m.num_shared_experts
            + m.num_experts * (int(m.router_bias) + int(m.choice_bias)))


def latent_attention_parameters(c) -> int:
    """Matmul parameters of one latent attention (`latent_attention`, ``c.mla``): queries
    d q_lora + q_lora h (nope + rope) (d h (nope + rope) without the low rank), ``kv_a``
    d (kv_lora + rope), ``kv_b`` kv_lora h (nope + v), the output h v d."""
    m, d, h = c.mla, c.d_model, c.num_heads
    queries = d * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank \
        else d * h * m.qk_head_dim
    return (queries + d * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d)


def analytic_flops(c, stack_parameters: int, attention_layers: int, batch_size: int,
                   length: int, self_attention_layers: int = 0) -> float:
    """6 x matmul parameters x tokens (forward 2, backward 4; with experts, the active
    ones: `layer_parameters(..., active=True)`) plus attention's scores and
    weighted sums, 12 x length x heads x d_kv per token and layer of attention (grouped
    key/value heads save parameters, not these). The embedding lookup is no matmul; the
    softmax is (shared or not). Rotary positions add 9 x (heads + kv heads) x d_kv per token
    and self-attention layer (a rotation, 3 FLOPs per element, forward and backward).
    Latent self-attention: 6 x length x heads x ((nope + rope) + v), its rotation 9 x (heads
    + 1) x rope (the shared key)."""
    tokens = batch_size * length
    matmul = stack_parameters + c.vocab_size * c.d_model
    scores = 12 * length * c.num_heads * c.d_kv * tokens
    flops = 6 * matmul * tokens + attention_layers * scores
    rotated = (c.num_heads + c.num_kv_heads) * c.d_kv
    if getattr(c, "latent_attention", False):  # scores of nope + rope, sums of v; one key
        m = c.mla
        flops += self_attention_layers * (
            6 * length * c.num_heads * (m.qk_head_dim + m.v_head_dim) * tokens - scores)
        rotated = (c.num_heads + 1) * m.qk_rope_head_dim
    if c.position_encoding == "rotary":
        flops += self_attention_layers * 9 * rotated * tokens
    return flops


def tables(c) -> int:
    """The embedding and softmax tables as the paper counts them (no position tables)."""
    return (1 if c.shared_embedding_and_softmax else 2) * c.vocab_size * c.d_model


def mtp_parameters(c, active: bool = False, heads: bool = False) -> int:
    """Matmul parameters of the `mtp_depth` multi-token prediction modules (`models.mtp`):
    each a projection [2 d, d] and a layer as layer num_layers + k of the stack would be
    (`layer_parameters`' count of it; `active` as there). Their tables are the model's.
    `heads`: also V d per module for its pass through the shared output head (FLOPs, not
    parameters: what `analytic_flops` multiplies by the tokens)."""
    total = 0
    for k in range(getattr(c, "mtp_depth", 0)):
        layer = c.num_layers + k
        total += 2 * c.d_model * c.d_model + layer_parameters(c, layer + 1, 0, active) \
            - layer_parameters(c, layer, 0, active)
        if heads:
            total += c.vocab_size * c.d_model
    return total
