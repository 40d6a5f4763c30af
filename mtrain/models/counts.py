"""The paper's counts of a Transformer (`TransformerConfig`): its matmul parameters and a
train step's model FLOPs, which the planner and the MFU a run logs use."""

from __future__ import annotations


def layer_parameters(c, encoder_layers: int, decoder_layers: int, active: bool = False) -> int:
    """Matmul parameters of the layer stacks: an encoder (or LM) layer has attention (2 d h
    d_kv for queries and outputs, 2 d g d_kv for g key/value heads: 4 d h d_kv with as many)
    and a feed-forward block ((a + 1) d d_ff for a activations: 2 d d_ff with one); a
    decoder layer two attentions. A layer with experts (every `moe_every`) has E of them,
    (a + 1) d expert_d_ff each, and the router, d E; `active`: only the top_k experts a
    token goes through (and the router) count, which is what a token computes."""
    attention = 2 * c.d_model * (c.num_heads + c.num_kv_heads) * c.d_kv
    ffn = (len(c.mlp_activations) + 1) * c.d_model * c.d_ff
    total = encoder_layers * (attention + ffn) + decoder_layers * (2 * attention + ffn)
    if c.moe_every:
        m = c.moe
        experts = m.top_k if active else m.num_experts
        moe = experts * (len(c.mlp_activations) + 1) * c.d_model * m.expert_d_ff \
            + c.d_model * m.num_experts
        moe_layers = encoder_layers // c.moe_every + decoder_layers // c.moe_every
        total += moe_layers * (moe - ffn)
    return total


def analytic_flops(c, stack_parameters: int, attention_layers: int, batch_size: int,
                   length: int, self_attention_layers: int = 0) -> float:
    """6 x matmul parameters x tokens (forward 2, backward 4; with experts, the active
    ones: `layer_parameters(..., active=True)`) plus attention's scores and
    weighted sums, 12 x length x heads x d_kv per token and layer of attention (grouped
    key/value heads save parameters, not these). The embedding lookup is no matmul; the
    softmax is (shared or not). Rotary positions add 9 x (heads + kv heads) x d_kv per token
    and self-attention layer (a rotation, 3 FLOPs per element, forward and backward)."""
    tokens = batch_size * length
    matmul = stack_parameters + c.vocab_size * c.d_model
    scores = 12 * length * c.num_heads * c.d_kv * tokens
    flops = 6 * matmul * tokens + attention_layers * scores
    if c.position_encoding == "rotary":
        flops += self_attention_layers * 9 * (c.num_heads + c.num_kv_heads) * c.d_kv * tokens
    return flops


def tables(c) -> int:
    """The embedding and softmax tables as the paper counts them (no position tables)."""
    return (1 if c.shared_embedding_and_softmax else 2) * c.vocab_size * c.d_model
