"""What low-precision projections (``transformer.quantization``: 'fp8', 'int8') do to a
train step's time on a target, against the same step in bf16 (`--mode=plan`'s verdict).

The matmuls: those `models.quantization` quantizes, the projections (attention's q, k, v, o
and latent attention's, the feed-forward layers', a mixture of experts' shared experts and,
dispatched by capacity, its routed ones), forward and backward (the incoming gradient is
quantized too: all three matmuls of a projection, 6 FLOPs per weight and token). Not the
embeddings, the logits, attention's q.k and p.v, the router, the dropless experts' grouped
matmuls or the multi-token prediction's projection.

The plan compiles the bf16 program too (`planner.bf16_trainer`) and plans it as it would
without quantization: the verdict's bf16 step is that plan's. The quantized step is
``max(compute + traffic, memory) + casts + collectives``, from the bf16 plan's compute,
traffic (what does not overlap the matmuls: the einsum path's attention matrices) and
memory (what does), the quantized program's collectives:

- the projections' share s of the step's model FLOPs runs at the format's peak
  (`Target.peak_of`: an H100's fp8 1979 TFLOP/s against its bf16 989) at bf16's efficiency,
  the rest at the bf16 peak: compute x (1 - s + s x bf16 peak / format peak). A target
  with no rate of its own for the format runs it at its bf16 peak: no gain, and the casts.
- the casts: each quantized operand read twice at its precision (its absolute maximum, a
  reduction that must finish before the cast; then the cast) and written once as a 1-byte
  copy: memory-bound passes between the matmuls that overlap neither them nor the other
  memory traffic. qwix (`models.quantization`) casts a projection's input and weight
  forward, and the incoming gradient twice, once for each backward matmul (each scaled by
  the other operand's scales first). Projections that read one input (attention's q, k and
  v; latent attention's q and kv_a; SwiGLU's wi) share its cast (XLA merges them). Under
  remat 'dots' or 'full' the backward pass recomputes the forward's casts (XLA:CPU's program
  of a 2-layer model: the forward's cast elements twice over; 'none' keeps the copies). The
  weights are cast once per microbatch (not counted: that program casts attention's 3-D
  weights once more for the backward pass, and under 'full' once more again; a weight is
  small beside its tokens' activations at a training batch). Each operand per device as
  the layout rules split it (`split`): a replicated one is cast whole on every device that
  holds it (data parallelism's weights: each replica casts its copy); a weight under
  parameter layout rules (FSDP) as gathered for use (XLA may cast the stored shard before
  the gather: less).
  'rowwise', 'tensorwise' and 'delayed' cost the same here (rowwise's scaled matmuls are
  slower on GPUs than tensorwise's, as torchtitan measures; delayed's amaxes are reduced
  beside the products, not before them: neither modelled).
- the collectives: the quantized program's. Tensorwise scaling takes each split operand's
  absolute maximum over the devices that split it: an all-reduce of a scalar per operand
  (tests/test_plan_quantization.py's 2-layer model over ``batch:8``: 18 all-reduces in fp8
  tensorwise, 3 rowwise, 2 in bf16). Their bytes are counted; their latency is not (the
  plan has no per-collective latency), so the plan says how many more there are than in
  bf16.
- the memory that must fit is the quantized program's (its buffers hold the 1-byte copies);
  its traffic, the bf16 program's (XLA:CPU's buffers of a quantized program are not what a
  TPU or GPU runs; the copies the backward pass keeps in place of bf16 ones would shrink the
  saved activations a little: not counted).

The format pays where the step is at least `PAYS` times faster than in bf16; where not, the
verdict names what bounds the quantized step: memory traffic (its time above the compute's),
or the largest of the collectives, the unquantized matmuls (attention, the logits, the
experts in bf16) and the casts.
"""

from __future__ import annotations

import dataclasses
import math

from mtrain.models import counts

PAYS = 1.1  # a smaller gain is inside what the plan can tell apart


def stacks(c, kind: str) -> tuple[int, int]:
    """(encoder-like layers, decoder layers with cross attention) of a model of `kind`
    ('lm': its layers and multi-token prediction modules' layers; else encoder-decoder)."""
    if kind == "lm":
        return c.num_layers + getattr(c, "mtp_depth", 0), 0
    return c.num_encoder_layers or c.num_layers, c.num_layers


def _quantized_experts(c, active: bool) -> int:
    """The quantized matmul parameters of one layer's experts: the shared experts and,
    dispatched by capacity, the routed ones (a token's top_k with `active`)."""
    m, a = c.moe, len(c.mlp_activations)
    routed = (m.top_k if active else m.num_experts) if m.dispatch == "capacity" else 0
    return (a + 1) * c.d_model * m.expert_d_ff * (routed + m.num_shared_experts)


def projection_parameters(c, kind: str, active: bool = True) -> int:
    """The quantized projections' weights: with `active`, those one token goes through
    (what its FLOPs multiply), else all of them (what is cast)."""
    encoder, decoder = stacks(c, kind)
    total = counts.layer_parameters(c, encoder, decoder, active=active)
    if getattr(c, "moe_every", 0):
        layers = counts.moe_layers(c, encoder) + counts.moe_layers(c, decoder)
        total -= layers * (counts.experts_parameters(c, active) - _quantized_experts(c, active))
    return total


def flops(c, kind: str, batch_size: int, length: int) -> dict[str, float]:
    """A step's model FLOPs by who computes them: 'projections' (quantized), 'the logits',
    and with experts 'the experts (bf16)' (those not quantized: dropless routed ones, the
    router)."""
    tokens = batch_size * length
    out = {"projections": 6.0 * projection_parameters(c, kind) * tokens,
           "the logits": 6.0 * c.vocab_size * c.d_model * tokens
           * (1 + (getattr(c, "mtp_depth", 0) if kind == "lm" else 0))}
    if getattr(c, "moe_every", 0):
        layers = sum(counts.moe_layers(c, n) for n in stacks(c, kind))
        out["the experts (bf16)"] = 6.0 * tokens * layers * (
            counts.experts_parameters(c, True) - _quantized_experts(c, True))
    return out


TOKENS = ("batch", "length")  # the logical names a projection's tokens are split by


def projections(c, kind: str) -> list[tuple]:
    """The quantized projections of the whole stack, as (input width, output width, a
    token's passes through it: layers x its slots in them, its weights: layers x experts,
    the input's logical names, the output's, whether it casts its input (not where it shares
    the one cast for the projection before it: attention's k and v the q's, latent
    attention's kv_a the q's, SwiGLU's second wi the first's), the names splitting its
    tokens beyond ``TOKENS`` and its weights beyond input and output: a routed expert's
    ``experts``)."""
    d, h, k, g = c.d_model, c.num_heads, c.d_kv, c.num_kv_heads
    a = len(c.mlp_activations)
    heads = ("heads", "d_kv")
    kv = ("heads" if g == h else "kv_heads", "d_kv")
    model = ("d_model",)

    def attention(n, cross):  # q, k, v, o: self-attention's k and v read q's input
        return [(d, h * k, n, n, model, heads, True, ()),
                (d, g * k, n, n, model, kv, cross, ()), (d, g * k, n, n, model, kv, False, ()),
                (h * k, d, n, n, heads, model, True, ())]

    def latent(n):
        m = c.mla
        q = ([(d, m.q_lora_rank, n, n, model, ("q_lora",), True, ()),
              (m.q_lora_rank, h * m.qk_head_dim, n, n, ("q_lora",), heads, True, ())]
             if m.q_lora_rank else [(d, h * m.qk_head_dim, n, n, model, heads, True, ())])
        return q + [(d, m.kv_lora_rank + m.qk_rope_head_dim, n, n, model, ("kv_latent",),
                     False, ()),
                    (m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), n, n,
                     ("kv_lora",), heads, True, ()),
                    (h * m.v_head_dim, d, n, n, heads, model, True, ())]

    def ffn(width, n, weights, extra=()):  # wi (one per activation, one input), wo
        wi = [(d, width, n, weights, model, ("d_ff",), True, extra)]
        if a > 1:
            wi.append((d, width, (a - 1) * n, (a - 1) * weights, model, ("d_ff",), False,
                       extra))
        return wi + [(width, d, n, weights, ("d_ff",), model, True, extra)]

    encoder, decoder = stacks(c, kind)
    dense = encoder + decoder
    own = (latent(dense) if getattr(c, "latent_attention", False)
           else attention(dense, False))
    out = own + (attention(decoder, True) if decoder else [])
    if getattr(c, "moe_every", 0):
        m = c.moe
        experts = counts.moe_layers(c, encoder) + counts.moe_layers(c, decoder)
        dense -= experts
        if m.num_shared_experts:
            out += ffn(m.expert_d_ff * m.num_shared_experts, experts, experts)
        if m.dispatch == "capacity":  # a token's slots in its experts' capacity
            out += ffn(m.expert_d_ff, experts * m.top_k * m.capacity_factor_train,
                       experts * m.num_experts, ("experts",))
    return out + (ffn(c.d_ff, dense, dense) if dense else [])


def split(layout, names) -> int:
    """Into how many parts `layout` splits a tensor of logical `names` (a mesh dimension
    once); 1 without a layout."""
    if layout is None:
        return 1
    dims = {layout.mesh_dim_for(n) for n in names} - {None}
    return math.prod(layout.mesh_dims[m] for m in dims)


def cast_bytes(c, kind: str, batch_size: int, length: int, num_microbatches: int = 1,
               layout=None) -> float:
    """HBM bytes a step's casts move per device of `layout` (one device without; module
    doc)."""
    a = 2 if c.activation_dtype == "bfloat16" else 4
    again = 1 if c.remat_policy == "none" else 2  # the forward's casts redone backward
    tokens, elements = batch_size * length, 0.0
    for i, o, passes, weights, ins, outs, casts_input, extra in projections(c, kind):
        rows = tokens * passes
        if casts_input:
            elements += again * rows * i / split(layout, TOKENS + extra + ins)
        elements += 2 * rows * o / split(layout, TOKENS + extra + outs)  # dy, twice
        elements += (again * num_microbatches * weights * i * o
                     / split(layout, extra + ins + outs))
    return elements * (2 * a + 1)


def cast_seconds(c, kind: str, layout, batch_size: int, length: int, num_microbatches: int,
                 target) -> float:
    """The casts' time per device on `target` (module doc)."""
    return (cast_bytes(c, kind, batch_size, length, num_microbatches, layout)
            / target.hbm_bandwidth)


def rate_factor(c, kind: str, batch_size: int, length: int, model_flops: float,
                target) -> float:
    """What the step's matmul time is multiplied by with `c.quantization` on `target`."""
    peak, _ = target.peak_of(c.quantization)
    share = min(1.0, flops(c, kind, batch_size, length)["projections"] / model_flops)
    return 1.0 - share + share * target.peak_flops / peak


@dataclasses.dataclass
class Quantized:
    format: str
    scaling: str
    peak_flops: float  # the projections' peak on the target (its bf16 one without a rate)
    own_rate: bool  # whether the target has a rate of its own for the format
    projection_share: float  # of the step's model FLOPs
    compute_seconds: float  # the matmuls, projections at the format's rate
    cast_seconds: float
    bf16_step_seconds: float  # the bf16 program's plan's step
    step_seconds: float
    speedup: float  # bf16's step / this one
    pays: bool
    bound: str  # where it does not pay, why: what takes the most of the step, or no rate
    scale_all_reduces: int = 0  # all-reduces the quantized program has beyond bf16's


def compare(c, kind: str, layout, batch_size: int, length: int, num_microbatches: int, target,
            *, model_flops: float, compute: float, traffic: float, memory: float,
            bf16_collectives: float, collectives: float, bf16_step: float | None = None,
            scale_all_reduces: int = 0) -> Quantized:
    """The quantized step against bf16's, whose parts are `compute` (the matmuls at the bf16
    peak, of `model_flops`), `traffic` (not overlapped with them), `memory` (overlapped)
    and `bf16_collectives` (after them), and whose step is `bf16_step` (by default
    ``max(compute + traffic, memory) + bf16_collectives``). `collectives`: the quantized
    program's, with its `scale_all_reduces` more all-reduces than bf16's."""
    fmt = c.quantization
    peak, own = target.peak_of(fmt)
    parts = flops(c, kind, batch_size, length)
    share = min(1.0, parts.pop("projections") / model_flops)
    quantized = compute * rate_factor(c, kind, batch_size, length, model_flops, target)
    casts = cast_seconds(c, kind, layout, batch_size, length, num_microbatches, target)
    bf16 = (max(compute + traffic, memory) + bf16_collectives if bf16_step is None
            else bf16_step)
    busy = quantized + traffic
    step = max(busy, memory) + casts + collectives
    speedup = bf16 / step
    pays = speedup >= PAYS
    bound = ""
    if not own:
        bound = f"no {fmt} rate on {target.name}"
    elif not pays:  # the largest of what the format does not speed up
        if memory > busy:
            seconds = {"memory traffic": memory}
        else:
            seconds = {name: compute * f / model_flops for name, f in parts.items()}
            seconds["attention"] = traffic + compute * (1 - share) - sum(seconds.values())
        seconds[f"the casts to {fmt}"] = casts
        seconds["collectives"] = collectives
        bound = max(seconds, key=seconds.get)
    return Quantized(format=fmt, scaling=c.quantization_scaling, peak_flops=peak, own_rate=own,
                     projection_share=share, compute_seconds=quantized, cast_seconds=casts,
                     bf16_step_seconds=bf16, step_seconds=step, speedup=speedup, pays=pays,
                     bound=bound, scale_all_reduces=scale_all_reduces)


def lines(q: dict, target, tokens: int, seconds_text) -> list[str]:
    """The plan's lines for `q` (a `Quantized` as a dict) on `target`, a step of `tokens`."""
    fmt = q["format"]
    rate = (f"{fmt} at {q['peak_flops'] / 1e12:.0f} TFLOP/s against bf16's "
            f"{target.peak_flops / 1e12:.0f}" if q["own_rate"] else
            f"{target.name} has no {fmt} rate above its bf16 peak: {fmt} runs at the bf16 "
            f"rate ({target.peak_flops / 1e12:.0f} TFLOP/s)")
    out = [f"quantization {fmt} ({q['scaling']}): {rate}; projections "
           f"{100 * q['projection_share']:.0f}% of the model FLOPs, casts "
           f"+{seconds_text(q['cast_seconds'])}"]
    step = (f"step ~{seconds_text(q['step_seconds'])} against bf16's "
            f"{seconds_text(q['bf16_step_seconds'])}, {tokens / q['step_seconds']:,.0f} "
            f"tokens/s against {tokens / q['bf16_step_seconds']:,.0f}")
    if q["pays"]:
        out.append(f"  {fmt} pays: {q['speedup']:.2f}x on the step ({step})")
    else:
        why = q["bound"] if not q["own_rate"] else f"the step is bound by {q['bound']}"
        out.append(f"  {fmt} does not pay here: {why}, {q['speedup']:.2f}x ({step})")
    if q.get("scale_all_reduces"):
        out.append(f"  {q['scaling']} scaling: {q['scale_all_reduces']} all-reduces more than "
                   f"bf16 (operands' absolute maxima over the devices that split them: their "
                   f"bytes are in the collectives, their latency is not)")
    return out
