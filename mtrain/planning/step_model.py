"""An analytic model of a train step's peak memory and time on an accelerator.

`--mode=plan` compiles the step with XLA:CPU, whose buffer assignment is exact for the CPU
but not for a GPU: there bfloat16 stays bfloat16, attention is a flash kernel, and XLA's
scheduler frees activations as the backward pass goes. Measured on one H100 (issue 17: the
1B decoder below, jax 0.11.2), XLA:CPU said 76 GiB where the GPU used 26 GiB. This model
counts instead what a step keeps:

- parameters, optimizer state and the batch (from their shardings: exact);
- the activations each layer saves for the backward pass (a mixture of experts': its
  tokens' slots at the training capacity, and the dispatch and combine tensors), by remat
  policy
  (``none``: everything; ``dots``: the matmul outputs, a flash kernel's output and
  log-sum-exp, and the layer input; ``full``: the layer input) and by attention kernel (a
  flash kernel saves its output and log-sum-exp and recomputes the rest; the einsum path's
  logits are a matmul: [heads, memory_length] float32 per token, saved under ``dots``);
- the gradients (float32, sharded like the parameters), which replace the saved
  activations as the backward pass goes: the peak holds the larger of the two;
- one layer's backward working set, the loss's logits (a slice of them with `loss.chunks`)
  and the largest parameter's optimizer update;
- with ``length`` split (context parallelism, `models.context`), the keys and values a
  layer receives: all-gathered, the whole row's and their float32 gradients (on a GPU also
  the mask of global positions its kernel takes); passed around the ring, two blocks of
  them and a sub-block's float32 logits;
- under parameter layout rules (FSDP), one layer's parameters gathered for use and their
  float32 gradient before it is reduce-scattered.

Time: model FLOPs (plus what remat recomputes) at the efficiency a well-written step
reaches on the target, and the einsum path's [length, memory_length] attention matrices
moved through HBM (softmax is memory-bound and does not overlap the matmuls). With
``transformer.quantization`` the projections' FLOPs run at the format's peak and their
operands' casts move through HBM (`planning.quantized`).

Checked against the four H100 measurements of issue 17 in docs/plan_vs_measured.md.
"""

from __future__ import annotations

import dataclasses

from mtrain.parallel.layout import Layout
from mtrain.models import attention
from mtrain.models.blocks import is_moe
from mtrain.models.transformer import TransformerConfig
from mtrain.planning import quantized

# The fraction of the target's peak bf16 FLOP/s that the model FLOPs of a large, well-fused
# training step reach. h100/h200: 0.58, the plain jax.jit + optax 1B decoder of
# benchmarks/throughput.py at 16 x 2048 with cuDNN flash attention and remat dots (95,086
# tokens/s, issue 17; H200 assumed the same: same compute, more bandwidth). TPUs: not
# measured by this project; 0.5, below what MaxText reports for its tuned Llama runs.
EFFICIENCY = {"h100": 0.58, "h200": 0.58}
DEFAULT_EFFICIENCY = 0.5


@dataclasses.dataclass
class StepModel:
    attention: str  # 'flash' or 'dense' (einsum / dot_product with a [l, m] mask)
    saved_activation_bytes: float
    gradient_bytes: float
    working_bytes: float  # one layer's backward working set
    context_bytes: float  # a layer's keys and values received with ``length`` split
    logits_bytes: float
    update_bytes: float
    total_bytes: float
    compute_seconds: float  # the matmuls (the projections at the quantized rate, if any)
    attention_traffic_seconds: float
    step_seconds: float
    efficiency: float
    cast_seconds: float = 0.0  # the quantized operands' casts (`quantized`)


HOPPER = ("h100", "h200")  # the GPU targets whose cuDNN takes heads up to 256


def attention_kernel(c: TransformerConfig, hopper: bool = False) -> str:
    """'flash' or 'dense': what the model's attention is on a GPU (see
    `layers.MultiHeadAttention`), a `hopper` one or not (cuDNN's head limit: 256, else 128):
    'auto' is flash there unless training applies attention dropout or the kernel does not
    take the activations (cuDNN: float32) or the model's attention sinks."""
    dropping = c.attention == "auto" and c.dropout_rate > 0.0
    if c.position_encoding == "relative_bias":  # a bias no flash kernel takes
        return "dense"
    if attention.uses_flash(c.attention, c.flash_kernel, "gpu", c.dtype, c.attention_head_dim,
                            c.attention_sinks, hopper) and not dropping:
        return "flash"
    return "dense"


def estimate(c: TransformerConfig, kind: str, layout: Layout, batch_size: int, length: int,
             num_microbatches: int, loss_chunks: int, fixed_bytes: float, gradient_bytes: float,
             largest_parameter_bytes: float, model_flops: float, target) -> StepModel:
    """Peak bytes and step time per device. `fixed_bytes`: parameters, optimizer state and
    batch per device; `gradient_bytes`: the parameters' bytes per device (float32);
    `model_flops`: the step's analytic FLOPs on all devices."""
    a = 2 if c.activation_dtype == "bfloat16" else 4
    kernel = attention_kernel(c, hopper=target.name in HOPPER)
    # ``length`` split (`models.context`): the ring is a custom VJP that saves what a flash
    # kernel saves and works a sub-block of at most 512 keys at a time
    split = layout.ways("length")
    context = c.context_parallel if split > 1 else None
    if context == "ring":
        kernel = "flash"

    def per(name: str, size: int) -> float:
        return size / layout.ways(name)

    d, f = per("d_model", c.d_model), per("d_ff", c.d_ff)
    heads = per("heads", c.num_heads)
    width = c.attention_head_dim  # (latent attention's expanded heads: values padded)
    hk = heads * width
    # key/value heads: grouped ones (fewer, on ``kv_heads``) make smaller keys and values
    gk = (per("heads", c.num_heads) if c.num_kv_heads == c.num_heads
          else per("kv_heads", c.num_kv_heads)) * width
    gates = len(c.mlp_activations)  # feed-forward input projections
    rotated = (hk + gk) * a if c.position_encoding == "rotary" else 0.0
    tokens = batch_size * length / num_microbatches / layout.ways("batch") / layout.ways("length")

    m = c.moe
    if m:  # an expert's slots per token, and its d_ff where `experts` leaves it split
        slots = m.top_k * m.capacity_factor_train
        if m.dispatch == "dropless":  # rows for the most that could arrive: all devices'
            e_axis = layout.mesh_dim_for("experts")
            exchanged = e_axis is not None and e_axis in (layout.mesh_dim_for("batch"),
                                                          layout.mesh_dim_for("length"))
            slots = m.top_k * (layout.ways("experts") if exchanged else 1)
        fe = m.expert_d_ff / (1 if layout.mesh_dim_for("experts") == layout.mesh_dim_for("d_ff")
                              else layout.ways("d_ff"))
        group = m.group_length(length)

    def layer(cross: bool, experts: bool = False) -> tuple[float, float]:
        """(bytes saved for the backward pass, bytes of its working set) per token of one
        layer: self-attention over `length` positions (and encoder-decoder attention over
        as many), then the feed-forward block, or with `experts` the mixture of experts:
        each token in top_k x capacity_factor slots (inputs, hidden, outputs), and the
        dispatch and combine tensors, group x slots per token (float32); dropless, top_k
        rows (experts exchanged by all-to-all: as many per device of `experts`: the most
        that could arrive) and no dispatch tensors."""
        attentions = 2 if cross else 1
        ffn = gates * f + d  # wi, wo
        routing = 0.0
        if experts:
            ffn = slots * (d + gates * fe + d) + d
            routing = 2 * group * slots * 4 if m.dispatch == "capacity" else 0.0
        matmul_outputs = attentions * (hk + 2 * gk + d) + ffn  # q k v, o; the feed-forward
        residuals = attentions * (hk * a + heads * 4)  # a flash kernel's output and lse
        if kernel == "dense":  # logits (float32) and weights @ values are matmuls too
            matmul_outputs += attentions * hk
            logits = attentions * heads * length * 4
        else:
            logits = 0.0
        dots = d * a + matmul_outputs * a + logits  # with the layer's input
        # norms, activations (and their product), rotated queries and keys
        everything = (dots + (1 + attentions) * d * 4 + gates * (slots * fe if experts else f) * a
                      + residuals + rotated + routing)
        if kernel == "dense":
            everything += attentions * heads * length * a  # the softmax weights
        else:  # remat 'dots' keeps a flash kernel's output and lse too (`models.remat`)
            dots += residuals
        saved = {"none": everything, "dots": dots, "full": d * a}[c.remat_policy]
        # with ``length`` split, per token of this device: gathered, the whole row's keys
        # and values and their float32 gradients (and on a GPU the mask of global positions
        # its kernel takes, with the bias cuDNN makes of it); in the ring, two blocks of
        # them and a sub-block of float32 logits, probabilities and their gradients
        if context == "gather":
            logits += split * 2 * gk * (a + 4)
            if kernel == "flash" and target.device == "GPU":
                logits += length * (1 + a)
        elif context == "ring":
            logits += 2 * 2 * gk * (a + 4) + 4 * heads * min(512, length // split) * 4
        return saved, everything + logits  # + the logits' gradient while it runs

    # (an LM's multi-token prediction modules: a layer each, as the stack's next would be)
    decoder = [layer(kind != "lm", is_moe(c, i))
               for i in range(c.num_layers + (c.mtp_depth if kind == "lm" else 0))]
    encoder = [] if kind == "lm" else [layer(False, is_moe(c, i)) for i in
                                       range(c.num_encoder_layers or c.num_layers)]
    stack = encoder + decoder
    saved = tokens * sum(s for s, _ in stack)
    working = tokens * max(w for _, w in stack)
    if layout.parameter_rules:  # a layer's weights gathered, and their gradient unreduced
        attentions = 1 if kind == "lm" else 2
        ffn = (gates + 1) * d * f
        if m:  # the experts of this device's share
            ffn = max(ffn, (gates + 1) * d * fe * m.num_experts / layout.ways("experts"))
        working += (attentions * 2 * d * (hk + gk) + ffn) * (a + 4)
    vocab = per("vocab", c.vocab_size)
    # A slice of the logits and their gradient (the float32 softmax fuses into the reduction);
    # an LM's multi-token prediction modules form theirs beside the trunk's.
    logits = tokens / loss_chunks * vocab * 2 * a * (1 + (c.mtp_depth if kind == "lm" else 0))
    accumulator = gradient_bytes if num_microbatches > 1 else 0.0
    update = 3 * largest_parameter_bytes
    total = (fixed_bytes + max(saved, gradient_bytes) + accumulator + working + logits + update)

    recompute = {"none": 0.0, "dots": 0.0, "full": 1 / 3}[c.remat_policy]
    efficiency = EFFICIENCY.get(target.name, DEFAULT_EFFICIENCY)
    compute = model_flops * (1 + recompute) / layout.size / (target.peak_flops * efficiency)
    casts = 0.0
    if c.quantization != "none":
        compute *= quantized.rate_factor(c, kind, batch_size, length, model_flops, target)
        casts = quantized.cast_seconds(c, kind, layout, batch_size, length, num_microbatches,
                                       target)
    traffic = 0.0
    if kernel == "dense" or context == "ring":  # logits written and read, weights written
        # and read, x3 for backward (the ring: its einsum blocks, this device's queries)
        rows = batch_size / layout.ways("batch") * heads * length * length / split
        passes = 3 * (4 + 4 + a + a)
        traffic = len(stack) * rows * passes / target.hbm_bandwidth
    received = (batch_size / num_microbatches / layout.ways("batch") * length
                * (split - 1) / split * 2 * gk * a) if context else 0.0
    return StepModel(
        attention=f"{kernel}, length split {split} ways ({context})" if context else kernel,
        saved_activation_bytes=saved, gradient_bytes=gradient_bytes,
        working_bytes=working, context_bytes=received, logits_bytes=logits,
        update_bytes=update, total_bytes=total,
        compute_seconds=compute, attention_traffic_seconds=traffic,
        step_seconds=compute + casts + traffic, efficiency=efficiency,
        cast_seconds=casts)
