"""A Hugging Face family's tensors as mtrain's parameters, and back.

`parameters` pairs every mtrain parameter with the tensors it comes from and
the conversion between them, both ways (`sources.Source`), so that import and export share
one table; the tensors' names are the family's record's (`record.Family`: its attention,
feed-forward, norm and expert tensors), so that a family made of known layers adds no row:

- **Projections**: Hugging Face stores a linear layer as [out, in] (torch's), mtrain as
  [in, out]: transposed. Attention projections also split their heads: q/k/v [heads x d_kv,
  d_model] -> [d_model, heads, d_kv], o [d_model, heads x d_kv] -> [heads, d_kv, d_model].
- **Attention scale**: an import keeps its family's scale as a setting
  (``transformer.attention_scale``: Llama's d_kv^-0.5), so that its weights are the
  checkpoint's bit for bit and an optimizer step is its home framework's. A model trained
  here with another scale (Mesh-TF's unscaled logits) exports with the ratio folded into
  its queries.
- **Biases and q/k norms** (Qwen2, Qwen3, Gemma 3): q/k/v biases [heads x d_kv] split into
  heads, the per-head norms' scales [d_kv] as they are.
- **Rotary convention**: Hugging Face stores q/k for its half-split rotation (the first
  half of each head's dimensions paired with the second half; its conversion from Meta's
  interleaved checkpoints permuted them once), which is mtrain's rotation
  (`positions.rotary`): no permutation.
- **Embeddings**: a tied table stays tied (T5 v1.0's scaled logits, the decoder-only
  families' unscaled: ``transformer.shared_softmax_scaled``).
- **Norms**: Llama's ``post_attention_layernorm`` is the norm before the feed-forward
  layer (``mlp_norm``); Gemma 3's is the one after attention (``post_attention_norm``),
  its ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` the feed-forward
  layer's.
- **Experts**: Mixtral's per-expert w1 (gate), w3 (up), w2 (down) and Qwen3-MoE's and
  DeepSeek's gate_proj, up_proj, down_proj are stacked along mtrain's ``experts`` dimension
  (wi_0, wi_1, wo), the router [experts, d_model] transposed; DeepSeek's
  ``e_score_correction_bias`` is ``choice_bias``, its shared experts ``mlp/shared/...`` (a
  dense layer). gpt-oss stores its experts stacked as mtrain does ([experts, in, out]), gate
  and up interleaved in ``gate_up_proj`` (wi_0 = [..., 0::2], wi_1 = [..., 1::2]: a
  `sources.Strided` part each, joined again by the export), with biases, and a router bias.
- **Latent attention** (DeepSeek): q_a [q_lora, d] and kv_a_proj_with_mqa [kv_lora +
  qk_rope, d] transposed, q_b [heads x (nope + rope), q_lora] and kv_b [heads x (nope + v),
  kv_lora] split into heads as q is (each head's rows together), o as o; the norms of the
  latents as they are. Its interleaved rotary dimensions stay as stored (the model rotates
  them in pairs: ``mla.rope_interleaved``).
- **Sinks and the output bias** (gpt-oss): [heads] and [d_model] as they are.
- **Multi-token prediction** (DeepSeek): module j is Hugging Face's layer
  num_hidden_layers + j (enorm, hnorm, eh_proj [d, 2d] transposed, its decoder layer,
  shared_head.norm), with copies of the embedding and the output head, which mtrain shares
  with the trunk: the import reads none of them, the export writes them.
- **T5's relative bias** [buckets, heads] (in each stack's first layer) is mtrain's
  per-stack table [heads, buckets], transposed.
- **Scanned layers** (``transformer.scan_layers``): the layers' tensors stacked on the
  leading ``layers`` dimension (by groups where the layers repeat in groups: experts every
  few layers, Gemma's sliding and full layers, ``layers/layer_<i>/...``); DeepSeek's dense
  first layers a stack of their own (``dense_layers/...``).
- **Vocabulary rows**: mtrain pads the vocabulary dimension to a multiple of 128; rows past
  ``vocab_size`` are zeros on import and left out on export.
"""

from __future__ import annotations

from mtrain.huggingface import rotary
from mtrain.huggingface.record import Family
from mtrain.huggingface.sources import (Copied, HeadsIn, HeadsOut, Plain, Reshaped, Source,
                                        Stacked, Strided, Transposed, copies, entries, ranges,
                                        whole)
from mtrain.models.blocks import is_moe, period
from mtrain.models.feedforward import input_names

__all__ = ["ranges", "parameters", "adapters", "peft_name", "PEFT_PREFIX", "copies", "entries",
           "whole"]


def parameters(fam: Family, c, vocab_rows: int) -> dict[str, Source]:
    """Every mtrain parameter of the model `c` (`TransformerConfig`) of family `fam` (its
    record names its tensors), by its path ("layer_0/self_attention/q"), with the tensors it
    is made of (`vocab_rows`: the checkpoint's vocab_size)."""
    d, h, kv, k, f, v = c.d_model, c.num_heads, c.num_kv_heads, c.d_kv, c.d_ff, c.vocab_size
    rows = vocab_rows if vocab_rows != v else None

    def attention(prefix, names, scale=1.0):
        q, kk, vv, o = names
        return {f"{prefix}/q": HeadsIn(q, (d, h, k), scale),
                f"{prefix}/k": HeadsIn(kk, (d, kv, k)), f"{prefix}/v": HeadsIn(vv, (d, kv, k)),
                f"{prefix}/o": HeadsOut(o, (h, k, d))}

    def scale(name, size=d):
        return Plain(name, (size,))

    def softmax(name):
        return {} if c.shared_embedding_and_softmax else {"softmax": Transposed(name, (d, v), rows)}

    out = {}
    if fam.kind == "encoder_decoder":  # T5's stacks
        out["embed/embedding"] = Plain("shared.weight", (v, d), rows)
        out |= softmax("lm_head.weight")
        stacks = (("encoder", c.num_encoder_layers or c.num_layers), ("decoder", c.num_layers))
        for stack, layers in stacks:
            out[f"{stack}_norm/scale"] = scale(f"{stack}.final_layer_norm.weight")
            out[f"{stack}_relative_bias/relative_bias"] = Transposed(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                (h, c.relative_num_buckets))
            ff = 2 if stack == "decoder" else 1
            wi = list(input_names(len(c.mlp_activations)))
            for i in range(layers):
                hf, me = f"{stack}.block.{i}.layer.", f"{stack}_{i}"
                parts = [(f"{hf}0.SelfAttention.", "self_attention", "attention_norm", "0")]
                if stack == "decoder":
                    parts.append((f"{hf}1.EncDecAttention.", "encoder_decoder_attention",
                                  "encoder_decoder_attention_norm", "1"))
                for at, name, norm, n in parts:
                    out |= attention(f"{me}/{name}", [f"{at}{p}.weight" for p in "qkvo"])
                    out[f"{me}/{norm}/scale"] = scale(f"{hf}{n}.layer_norm.weight")
                out[f"{me}/mlp_norm/scale"] = scale(f"{hf}{ff}.layer_norm.weight")
                out |= _dense(f"{me}/mlp", [f"{hf}{ff}.DenseReluDense.{w}.weight"
                                            for w in [*wi, "wo"]], d, f)
        return _scanned(c, out, ("encoder", "decoder"))
    out["token_embedding/embedding"] = Plain("model.embed_tokens.weight", (v, d), rows)
    out |= softmax("lm_head.weight")
    out["final_norm/scale"] = scale("model.norm.weight")
    # The queries carry what the checkpoint's scale is not of this model's (1 on import).
    q_factor = c.attention_scale / rotary.attention_scale(fam, c)
    for i in range(c.num_layers):
        out |= _layer(fam, c, f"layer_{i}", f"model.layers.{i}.", i, q_factor)
    for j in range(c.mtp_depth):
        out |= _mtp(fam, c, j, q_factor)
    if c.mtp_depth:  # the MTP modules' copies of the tables, written beside them
        heads = [f"model.layers.{c.num_layers + j}." for j in range(c.mtp_depth)]
        tables = tuple(f"{h}embed_tokens.weight" for h in heads)
        outputs = tuple(f"{h}shared_head.head.weight" for h in heads)
        table = "token_embedding/embedding"
        if c.shared_embedding_and_softmax:
            out[table] = Copied(out[table], tables + outputs)
        else:
            out[table] = Copied(out[table], tables)
            out["softmax"] = Copied(out["softmax"], outputs)
    return _scanned(c, out, ("",))


def _layer(fam: Family, c, me: str, hf: str, i: int, q_factor: float) -> dict[str, Source]:
    """The parameters of decoder layer `i` (``<me>/...``) and its tensors (``<hf>...``)."""
    d, h, kv, k, f = c.d_model, c.num_heads, c.num_kv_heads, c.d_kv, c.d_ff
    attn, at = f"{hf}{fam.attention}", f"{me}/self_attention"
    q, kk, vv, o = fam.attention_projections
    if c.latent_attention:
        out = _latent(c, at, attn, q_factor)
    else:
        out = {f"{at}/q": HeadsIn(f"{attn}{q}.weight", (d, h, k), q_factor),
               f"{at}/k": HeadsIn(f"{attn}{kk}.weight", (d, kv, k)),
               f"{at}/v": HeadsIn(f"{attn}{vv}.weight", (d, kv, k)),
               f"{at}/o": HeadsOut(f"{attn}{o}.weight", (h, k, d))}
    if c.attention_bias:
        for p, theirs, heads in zip("qkv", (q, kk, vv), (h, kv, kv)):
            out[f"{at}/{p}_bias"] = Reshaped(f"{attn}{theirs}.bias", (heads, k))
    if c.attention_output_bias:
        out[f"{at}/o_bias"] = Plain(f"{attn}{o}.bias", (d,))
    if c.attention_sinks:
        out[f"{at}/sinks"] = Plain(f"{attn}sinks", (h,))
    if c.qk_norm:
        for p in "qk":
            out[f"{at}/{p}_norm/scale"] = Plain(f"{attn}{p}_norm.weight", (k,))
    for ours, theirs in fam.norms:
        out[f"{me}/{ours}/scale"] = Plain(f"{hf}{theirs}.weight", (d,))
    if is_moe(c, i):
        return out | _experts(fam, c, f"{me}/mlp", hf)
    wi = [f"{hf}{fam.mlp}{p}.weight" for p in fam.mlp_projections]
    return out | _dense(f"{me}/mlp", wi, d, f)


def _dense(prefix: str, names, d: int, f: int) -> dict[str, Source]:
    """A gated feed-forward layer's projections (gate, up, down)."""
    *wi, wo = names
    ours = {f"{prefix}/{w}": Transposed(n, (d, f)) for w, n in zip(input_names(len(wi)), wi)}
    return ours | {f"{prefix}/wo": Transposed(wo, (f, d))}


def _latent(c, at: str, attn: str, q_factor: float) -> dict[str, Source]:
    """DeepSeek's multi-head latent attention: the queries through q_a (its norm) and q_b, or
    q alone; kv_a's outputs the latent then the shared rotary key; kv_b [heads x (nope +
    v), kv_lora] each head's key rows then its value rows; o."""
    d, h, m = c.d_model, c.num_heads, c.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        out = {f"{at}/q_a": Transposed(f"{attn}q_a_proj.weight", (d, m.q_lora_rank)),
               f"{at}/q_a_norm/scale": Plain(f"{attn}q_a_layernorm.weight", (m.q_lora_rank,)),
               f"{at}/q_b": HeadsIn(f"{attn}q_b_proj.weight", (m.q_lora_rank, h, qk), q_factor)}
    else:
        out = {f"{at}/q": HeadsIn(f"{attn}q_proj.weight", (d, h, qk), q_factor)}
    return out | {
        f"{at}/kv_a": Transposed(f"{attn}kv_a_proj_with_mqa.weight",
                                 (d, m.kv_lora_rank + m.qk_rope_head_dim)),
        f"{at}/kv_a_norm/scale": Plain(f"{attn}kv_a_layernorm.weight", (m.kv_lora_rank,)),
        f"{at}/kv_b": HeadsIn(f"{attn}kv_b_proj.weight",
                              (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim)),
        f"{at}/o": HeadsOut(f"{attn}o_proj.weight", (h, m.v_head_dim, d))}


def _mtp(fam: Family, c, j: int, q_factor: float) -> dict[str, Source]:
    """DeepSeek-V3's multi-token prediction module `j`: Hugging Face's layer
    num_hidden_layers + j, its norms of the embedding and the hidden state, the projection
    of their concatenation (eh_proj [d, 2d]), a decoder layer and its output norm."""
    i, d = c.num_layers + j, c.d_model
    hf, me = f"model.layers.{i}.", f"mtp_{j}"
    return {f"{me}/embedding_norm/scale": Plain(f"{hf}enorm.weight", (d,)),
            f"{me}/hidden_norm/scale": Plain(f"{hf}hnorm.weight", (d,)),
            f"{me}/projection": Transposed(f"{hf}eh_proj.weight", (2 * d, d)),
            **_layer(fam, c, f"{me}/layer", hf, i, q_factor),
            f"{me}/output_norm/scale": Plain(f"{hf}shared_head.norm.weight", (d,))}


def _experts(fam: Family, c, prefix: str, hf: str) -> dict[str, Source]:
    """The router and the stacked experts of a layer of experts (`record.Experts`), with
    gpt-oss's biases and DeepSeek's correction bias and shared experts."""
    e, d, n, f = fam.experts, c.d_model, c.moe.num_experts, c.moe.expert_d_ff
    moe, router = f"{hf}{e.prefix}", f"{hf}{e.prefix}{e.router}"
    out = {f"{prefix}/router": Transposed(f"{router}.weight", (d, n))}
    if e.router_bias:
        out[f"{prefix}/router_bias"] = Plain(f"{router}.bias", (n,))
    if e.choice_bias:
        out[f"{prefix}/choice_bias"] = Plain(f"{router}.e_score_correction_bias", (n,))
    if e.fused:  # gate and up interleaved in one [experts, in, out] tensor, and its bias
        both, bias = f"{moe}experts.gate_up_proj", f"{moe}experts.gate_up_proj_bias"
        for j, w in enumerate(("wi_0", "wi_1")):
            out[f"{prefix}/{w}"] = Strided(both, (n, d, f), j, 2)
            out[f"{prefix}/{w}_bias"] = Strided(bias, (n, f), j, 2)
        return out | {f"{prefix}/wo": Plain(f"{moe}experts.down_proj", (n, f, d)),
                      f"{prefix}/wo_bias": Plain(f"{moe}experts.down_proj_bias", (n, d))}
    for ours, w, shape in zip(("wi_0", "wi_1", "wo"), e.projections, ((d, f), (d, f), (f, d))):
        out[f"{prefix}/{ours}"] = Stacked(
            [Transposed(f"{moe}experts.{j}.{w}.weight", shape) for j in range(n)])
    shared = c.moe.num_shared_experts if e.shared else 0
    if shared:
        out |= _dense(f"{prefix}/shared", [f"{moe}{e.shared}{w}.weight" for w in e.projections],
                      d, f * shared)
    return out


def _scanned(c, params: dict[str, Source], stacks) -> dict[str, Source]:
    """With ``transformer.scan_layers``, each stack's layers as one stacked parameter per
    name (``layers/...``; ``encoder/...`` and ``decoder/...``), stacked by groups of
    `blocks.period` layers where the layers repeat in groups (``layers/layer_<j>/...``);
    a decoder's first ``first_dense_layers`` layers as a stack of their own
    (``dense_layers/...``)."""
    if not c.scan_layers:
        return params
    group, dense = period(c), c.first_dense_layers
    out, stacked = {}, {}
    for path, source in params.items():
        head, _, rest = path.partition("/")
        stack, _, number = head.rpartition("_")
        if number.isdigit() and stack in [s or "layer" for s in stacks]:
            i = int(number)
            if stack == "layer" and i < dense:
                stacked.setdefault(f"dense_layers/{rest}", []).append(source)
                continue
            name = "layers" if stack == "layer" else stack
            j = i - dense if stack == "layer" else i
            inner = f"layer_{j % group}/" if group > 1 else ""
            stacked.setdefault(f"{name}/{inner}{rest}", []).append(source)
        else:
            out[path] = source
    return out | {path: Stacked(parts) for path, parts in stacked.items()}


# A PEFT adapter's tensors: the base model's module path under ``base_model.model.``, its
# ``weight`` replaced by ``lora_A.weight`` [rank, in] and ``lora_B.weight`` [out, rank].
PEFT_PREFIX = "base_model.model."


def peft_name(weight: str, which: str) -> str:
    """The PEFT tensor of LoRA matrix `which` ('A' or 'B') of the base tensor `weight`."""
    return f"{PEFT_PREFIX}{weight.removesuffix('.weight')}.lora_{which}.weight"


def adapters(params: dict[str, Source], lora) -> dict[str, Source]:
    """The adapters (`models.lora`: ``<path>_lora_a``, ``<path>_lora_b``) of the
    projections among `params` that `lora` (a `LoraConfig`) targets, each made of its PEFT
    tensors: with W = B A in torch's [out, in], mtrain's a = A^T and b = B^T, split into
    heads as the weight is (times the weight's factor: the queries' attention scale)."""
    out = {}
    for path, source in params.items():
        if lora.targets_path(path) and _projection(source):
            out[f"{path}_lora_a"], out[f"{path}_lora_b"] = _lora(source, lora.rank)
    return out


def _projection(source: Source) -> bool:
    if isinstance(source, Stacked):
        return _projection(source.parts[0])
    return isinstance(source, (HeadsIn, HeadsOut)) or (
        isinstance(source, Transposed) and source.rows is None)


def _lora(source: Source, r: int) -> tuple[Source, Source]:
    if isinstance(source, Stacked):
        pairs = [_lora(part, r) for part in source.parts]
        return Stacked([a for a, _ in pairs]), Stacked([b for _, b in pairs])
    a, b = peft_name(source.name, "A"), peft_name(source.name, "B")
    if isinstance(source, HeadsIn):  # [d, h, k]: A [r, d], B [h x k, r]
        d, h, k = source.shape
        return Transposed(a, (d, r)), HeadsIn(b, (r, h, k), source.scale)
    if isinstance(source, HeadsOut):  # [h, k, d]: A [r, h x k], B [d, r]
        h, k, d = source.shape
        return HeadsOut(a, (h, k, r)), Transposed(b, (r, d))
    i, o = source.shape  # Transposed [in, out]: A [r, in], B [out, r]
    return Transposed(a, (i, r)), Transposed(b, (r, o))
