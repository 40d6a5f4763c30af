"""A Hugging Face family's tensors as mtrain's parameters, and back.

`parameters` pairs every mtrain parameter with the tensors it comes from and
the conversion between them, both ways (`Source`), so that import and export share one
table:

- **Projections**: Hugging Face stores a linear layer as [out, in] (torch's), mtrain as
  [in, out]: transposed. Attention projections also split their heads: q/k/v [heads x d_kv,
  d_model] -> [d_model, heads, d_kv], o [d_model, heads x d_kv] -> [heads, d_kv, d_model].
- **Attention scale**: mtrain's attention logits are unscaled (Mesh-TF's and T5's
  convention), Llama's are scaled by d_kv^-0.5: the queries take that factor on import and
  give it back on export (exact in float32 where d_kv is a power of 4: 16, 64, 256).
- **Rotary convention**: Hugging Face stores q/k for its half-split rotation (the first
  half of each head's dimensions paired with the second half; its conversion from Meta's
  interleaved checkpoints permuted them once), which is mtrain's rotation
  (`positions.rotary`): no permutation.
- **Embeddings**: T5 v1.0's tied table stays tied; a tied Llama (SmolLM, Llama 3.2 1B),
  whose logits are not scaled, is imported untied (the softmax a copy of the table, the
  same logits) and exports untied.
- **Experts**: Mixtral's per-expert w1 (gate), w3 (up), w2 (down) are stacked along
  mtrain's ``experts`` dimension (wi_0, wi_1, wo), its router [experts, d_model] transposed.
- **T5's relative bias** [buckets, heads] (in each stack's first layer) is mtrain's
  per-stack table [heads, buckets], transposed.
- **Scanned layers** (``transformer.scan_layers``): the layers' tensors stacked on the
  leading ``layers`` dimension.
- **Vocabulary rows**: mtrain pads the vocabulary dimension to a multiple of 128; rows past
  ``vocab_size`` are zeros on import and left out on export.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrain.huggingface.families import MIXTRAL, T5, ConversionError


def ranges(index, shape) -> list[tuple[int, int]]:
    """A `jax.make_array_from_callback` index (slices, maybe open) as (start, stop) ranges."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


class Source:
    """An mtrain parameter of `shape` made of Hugging Face tensors: `read` makes a slice of
    it (ranges per axis) from a `tensors.Folder`, reading only the rows the slice needs;
    `tensors` are the (name, shape) it comes from, `to_hf` makes them from the whole
    parameter (export)."""

    shape: tuple[int, ...]

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    def read(self, folder, ranges) -> np.ndarray:
        raise NotImplementedError

    def to_hf(self, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
        raise NotImplementedError


@dataclasses.dataclass
class Plain(Source):
    """The tensor as it is ([rows, ...]: norm scales, embedding tables); mtrain's rows
    past the tensor's `rows` (a padded vocabulary) are zeros."""

    name: str
    shape: tuple[int, ...]
    rows: int | None = None

    def tensors(self):
        return [(self.name, (self.rows or self.shape[0], *self.shape[1:]))]

    def read(self, folder, ranges):
        (start, stop), rest = ranges[0], ranges[1:]
        have = min(stop, self.rows or self.shape[0])
        out = np.zeros((stop - start, *[b - a for a, b in rest]), np.float32)
        if have > start:
            out[:have - start] = folder.read(self.name, start, have)[
                (slice(None), *[slice(a, b) for a, b in rest])]
        return out

    def to_hf(self, value):
        return [(self.name, value[:self.rows or self.shape[0]])]


@dataclasses.dataclass
class Transposed(Source):
    """mtrain [a, b] = the tensor [b, a] transposed (a linear layer's kernel; the untied
    softmax, whose b past `rows` are zeros; T5's relative bias)."""

    name: str
    shape: tuple[int, int]
    rows: int | None = None

    def tensors(self):
        return [(self.name, (self.rows or self.shape[1], self.shape[0]))]

    def read(self, folder, ranges):
        (a0, a1), (b0, b1) = ranges
        have = min(b1, self.rows or self.shape[1])
        out = np.zeros((a1 - a0, b1 - b0), np.float32)
        if have > b0:
            out[:, :have - b0] = folder.read(self.name, b0, have)[:, a0:a1].T
        return out

    def to_hf(self, value):
        return [(self.name, value[:, :self.rows or self.shape[1]].T)]


@dataclasses.dataclass
class HeadsIn(Source):
    """mtrain's q/k/v [d_model, heads, d_kv] = the projection [heads x d_kv, d_model],
    transposed and split into heads, times `scale` (Llama's d_kv^-0.5 on the queries)."""

    name: str
    shape: tuple[int, int, int]
    scale: float = 1.0

    def tensors(self):
        d, h, k = self.shape
        return [(self.name, (h * k, d))]

    def read(self, folder, ranges):
        (d0, d1), (h0, h1), (k0, k1) = ranges
        k = self.shape[2]
        rows = folder.read(self.name, h0 * k, h1 * k)[:, d0:d1]  # [heads x d_kv, d]
        out = rows.reshape(h1 - h0, k, d1 - d0)[:, k0:k1].transpose(2, 0, 1)
        return out * np.float32(self.scale) if self.scale != 1.0 else out

    def to_hf(self, value):
        d, h, k = self.shape
        if self.scale != 1.0:
            value = value / np.float32(self.scale)
        return [(self.name, value.reshape(d, h * k).T)]


@dataclasses.dataclass
class HeadsOut(Source):
    """mtrain's o [heads, d_kv, d_model] = the projection [d_model, heads x d_kv],
    transposed and split into heads."""

    name: str
    shape: tuple[int, int, int]

    def tensors(self):
        h, k, d = self.shape
        return [(self.name, (d, h * k))]

    def read(self, folder, ranges):
        (h0, h1), (k0, k1), (d0, d1) = ranges
        k = self.shape[1]
        rows = folder.read(self.name, d0, d1)[:, h0 * k:h1 * k]  # [d, heads x d_kv]
        return rows.reshape(d1 - d0, h1 - h0, k)[:, :, k0:k1].transpose(1, 2, 0)

    def to_hf(self, value):
        h, k, d = self.shape
        return [(self.name, value.reshape(h * k, d).T)]


@dataclasses.dataclass
class Stacked(Source):
    """mtrain [n, ...] = `parts` stacked (Mixtral's experts; scanned layers)."""

    parts: list
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        self.shape = (len(self.parts), *self.parts[0].shape)

    def tensors(self):
        return [t for part in self.parts for t in part.tensors()]

    def read(self, folder, ranges):
        (n0, n1), rest = ranges[0], ranges[1:]
        return np.stack([self.parts[i].read(folder, rest) for i in range(n0, n1)])

    def to_hf(self, value):
        return [t for part, v in zip(self.parts, value) for t in part.to_hf(v)]


def parameters(fam: str, c, vocab_rows: int, untied: bool = False) -> dict[str, Source]:
    """Every mtrain parameter of the model `c` (`TransformerConfig`) of family `fam`, by its
    path ("layer_0/self_attention/q"), with the tensors it is made of (`untied`: the
    softmax is a copy of the tied embedding table; import only)."""
    d, h, kv, k, f, v = c.d_model, c.num_heads, c.num_kv_heads, c.d_kv, c.d_ff, c.vocab_size
    rows = vocab_rows if vocab_rows != v else None

    def attention(prefix, names, scale):
        q, kk, vv, o = names
        return {f"{prefix}/q": HeadsIn(q, (d, h, k), scale),
                f"{prefix}/k": HeadsIn(kk, (d, kv, k)), f"{prefix}/v": HeadsIn(vv, (d, kv, k)),
                f"{prefix}/o": HeadsOut(o, (h, k, d))}

    def mlp(prefix, names):
        *wi, wo = names
        ours = {f"{prefix}/wi" if len(wi) == 1 else f"{prefix}/wi_{i}": Transposed(n, (d, f))
                for i, n in enumerate(wi)}
        return ours | {f"{prefix}/wo": Transposed(wo, (f, d))}

    def scale(name):
        return Plain(name, (d,))

    out = {}
    if fam == T5:
        out["embed/embedding"] = Plain("shared.weight", (v, d), rows)
        if not c.shared_embedding_and_softmax:
            out["softmax"] = Transposed("shared.weight" if untied else "lm_head.weight",
                                        (d, v), rows)
        stacks = (("encoder", c.num_encoder_layers or c.num_layers), ("decoder", c.num_layers))
        for stack, layers in stacks:
            out[f"{stack}_norm/scale"] = scale(f"{stack}.final_layer_norm.weight")
            out[f"{stack}_relative_bias/relative_bias"] = Transposed(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                (h, c.relative_num_buckets))
            ff = 2 if stack == "decoder" else 1
            wi = ["wi"] if len(c.mlp_activations) == 1 else ["wi_0", "wi_1"]
            for i in range(layers):
                hf, me = f"{stack}.block.{i}.layer.", f"{stack}_{i}"
                parts = [(f"{hf}0.SelfAttention.", "self_attention", "attention_norm", "0")]
                if stack == "decoder":
                    parts.append((f"{hf}1.EncDecAttention.", "encoder_decoder_attention",
                                  "encoder_decoder_attention_norm", "1"))
                for at, name, norm, n in parts:
                    out |= attention(f"{me}/{name}", [f"{at}{p}.weight" for p in "qkvo"], 1.0)
                    out[f"{me}/{norm}/scale"] = scale(f"{hf}{n}.layer_norm.weight")
                out[f"{me}/mlp_norm/scale"] = scale(f"{hf}{ff}.layer_norm.weight")
                out |= mlp(f"{me}/mlp", [f"{hf}{ff}.DenseReluDense.{w}.weight"
                                         for w in [*wi, "wo"]])
        return _scanned(c, out, ("encoder", "decoder"))
    out["token_embedding/embedding"] = Plain("model.embed_tokens.weight", (v, d), rows)
    out["softmax"] = Transposed("model.embed_tokens.weight" if untied else "lm_head.weight",
                                (d, v), rows)
    out["final_norm/scale"] = scale("model.norm.weight")
    for i in range(c.num_layers):
        hf, me = f"model.layers.{i}.", f"layer_{i}"
        out |= attention(f"{me}/self_attention",
                         [f"{hf}self_attn.{p}_proj.weight" for p in "qkvo"], k**-0.5)
        out[f"{me}/attention_norm/scale"] = scale(f"{hf}input_layernorm.weight")
        out[f"{me}/mlp_norm/scale"] = scale(f"{hf}post_attention_layernorm.weight")
        if fam == MIXTRAL:
            moe, e = f"{hf}block_sparse_moe.", c.moe.num_experts
            out[f"{me}/mlp/router"] = Transposed(f"{moe}gate.weight", (d, e))
            for ours, w, shape in (("wi_0", "w1", (d, f)), ("wi_1", "w3", (d, f)),
                                   ("wo", "w2", (f, d))):
                out[f"{me}/mlp/{ours}"] = Stacked(
                    [Transposed(f"{moe}experts.{j}.{w}.weight", shape) for j in range(e)])
        else:
            out |= mlp(f"{me}/mlp", [f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up", "down")])
    return _scanned(c, out, ("",))


def _scanned(c, params: dict[str, Source], stacks) -> dict[str, Source]:
    """With ``transformer.scan_layers``, each stack's layers as one stacked parameter per
    name (``layers/...``; ``encoder/...`` and ``decoder/...``)."""
    if not c.scan_layers:
        return params
    if c.moe_every > 1:
        raise ConversionError("importing or exporting scanned groups of experts "
                              "(transformer.moe_every > 1 with scan_layers) is not supported")
    out, stacked = {}, {}
    for path, source in params.items():
        head, _, rest = path.partition("/")
        stack, _, number = head.rpartition("_")
        if number.isdigit() and stack in [s or "layer" for s in stacks]:
            name = "layers" if stack == "layer" else stack
            stacked.setdefault(f"{name}/{rest}", []).append(source)
        else:
            out[path] = source
    return out | {path: Stacked(parts) for path, parts in stacked.items()}
