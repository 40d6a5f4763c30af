"""The Hugging Face families mtrain's models can be: their ``config.json`` as mtrain settings
and back, and their tensors as mtrain's parameters and back.

Families (``config.json``'s ``architectures``):

- ``LlamaForCausalLM`` (Llama 2 and 3, TinyLlama, SmolLM; ``MistralForCausalLM`` without a
  sliding window reads as one): `DecoderLM` with RMSNorm (``rms_norm_eps``), SwiGLU,
  rotary positions (``rope_theta``), grouped-query attention, its BOS as
  ``transformer.start_id``.
- ``MixtralForCausalLM``: the same with every feed-forward layer ``num_local_experts``
  SwiGLU experts, ``num_experts_per_tok`` of them per token (the top-k renormalised:
  mtrain's top_k > 1 gates), without a capacity limit (``moe.capacity_factor_*`` =
  experts / top_k, so that no token is dropped).
- ``T5ForConditionalGeneration``: `EncoderDecoder` with relative position bias; v1.0
  (``feed_forward_proj`` 'relu', tied embedding and softmax, whose logits T5 scales by
  d_model^-0.5 as mtrain's shared softmax does) or T5.1.1 / Flan-T5 ('gated-gelu', untied).

`settings` turns a ``config.json`` into gin bindings, refusing in one line every field
whose value mtrain cannot honour (the field named); `hf_config` turns a model's settings
back into one. `parameters` pairs every mtrain parameter with the tensors it comes from and
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
import json
import os

import numpy as np

from mtrain.errors import UserError


class ConversionError(UserError):
    """A Hugging Face model mtrain cannot be, or an mtrain model Hugging Face cannot read."""


LLAMA, MIXTRAL, T5 = "LlamaForCausalLM", "MixtralForCausalLM", "T5ForConditionalGeneration"
ARCHITECTURES = {LLAMA: LLAMA, "MistralForCausalLM": LLAMA, MIXTRAL: MIXTRAL, T5: T5}
# README "Starting from a published model" lists what is read of each family's config.json.
_T5_ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu", "gelu": "gelu_exact", "silu": "silu"}


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{folder} has no config.json: not a Hugging Face model "
                              f"folder") from None
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path} cannot be read: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


def family(config: dict) -> str:
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ConversionError(f"config.json: architectures={names}: mtrain imports "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[names[0]]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a config.json makes of an mtrain run: `architecture` bindings (gin name ->
    value; a user binding that differs is an error, `source` names the config.json field
    each comes from), and `defaults` the user's gin may override."""

    family: str
    architecture: dict
    source: dict
    defaults: dict
    vocab_size: int  # config.json's: the rows of the embedding
    eos_id: int | None
    bos_id: int | None
    untied: bool = False  # a tied table whose logits mtrain computes with a separate softmax


def _refuse(field: str, value, why: str):
    raise ConversionError(f"config.json: {field}={value!r}: {why}")


def _get(config: dict, field: str, default=None):
    return config.get(field, default) if config.get(field) is not None else default


def settings(config: dict) -> Settings:
    """The mtrain settings of a Hugging Face `config` (raises ConversionError naming the
    field mtrain cannot honour)."""
    fam = family(config)
    return _t5(config) if fam == T5 else _decoder(config, fam)


def _decoder(config: dict, fam: str) -> Settings:
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            _refuse(field, config[field], "mtrain's projections have no biases")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        _refuse("sliding_window", config["sliding_window"], "mtrain attends to every earlier "
                "position (no sliding window)")
    if _get(config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", config["hidden_act"], "the Llama family's feed-forward layer "
                "is SwiGLU (silu) here")
    rope = dict(_get(config, "rope_parameters", {}) or {})
    if config.get("rope_scaling"):
        rope.update(config["rope_scaling"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        _refuse(f"{field}.rope_type", rope_type, "mtrain implements rotary positions "
                "without scaling (rope_type 'default') only")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", rope["partial_rotary_factor"], "mtrain rotates "
                "every dimension of a head")
    if fam == MIXTRAL and _get(config, "router_jitter_noise", 0.0):
        _refuse("router_jitter_noise", config["router_jitter_noise"], "mtrain's router adds "
                "no noise")
    theta = rope.get("rope_theta", _get(config, "rope_theta", 10000.0))
    heads = config["num_attention_heads"]
    fields = {
        "transformer.d_model": "hidden_size", "transformer.d_ff": "intermediate_size",
        "transformer.num_heads": "num_attention_heads",
        "transformer.num_kv_heads": "num_key_value_heads", "transformer.d_kv": "head_dim",
        "transformer.num_layers": "num_hidden_layers",
        "transformer.max_length": "max_position_embeddings",
        "transformer.rotary_max_wavelength": "rope_theta",
        "transformer.norm_epsilon": "rms_norm_eps", "transformer.start_id": "bos_token_id",
    }
    arch = {
        "transformer.d_model": config["hidden_size"],
        "transformer.d_ff": config["intermediate_size"],
        "transformer.num_heads": heads,
        "transformer.num_kv_heads": _get(config, "num_key_value_heads", heads),
        "transformer.d_kv": _get(config, "head_dim", config["hidden_size"] // heads),
        "transformer.num_layers": config["num_hidden_layers"],
        "transformer.max_length": _get(config, "max_position_embeddings", 2048),
        "transformer.mlp_activations": ("silu", "linear"),
        "transformer.position_encoding": "rotary",
        "transformer.rotary_max_wavelength": float(theta),
        "transformer.shared_embedding_and_softmax": False,
        "transformer.norm_epsilon": float(_get(config, "rms_norm_eps", 1e-6)),
        "transformer.start_id": int(_get(config, "bos_token_id", 1)),
    }
    defaults = {"transformer.dropout_rate": 0.0}
    if fam == MIXTRAL:
        experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
        arch |= {"transformer.moe_every": 1, "moe.num_experts": experts, "moe.top_k": top_k}
        fields |= {"moe.num_experts": "num_local_experts", "moe.top_k": "num_experts_per_tok"}
        dropless = experts / top_k  # capacity = every token of the group: none dropped
        defaults |= {"moe.capacity_factor_train": dropless, "moe.capacity_factor_eval": dropless,
                     "moe.load_balance_loss": float(_get(config, "router_aux_loss_coef", 0.0)),
                     "moe.router_z_loss": 0.0}
    return Settings(fam, arch, fields, defaults, config["vocab_size"],
                    _first(config.get("eos_token_id")), config.get("bos_token_id"),
                    untied=bool(_get(config, "tie_word_embeddings", False)))


def _t5(config: dict) -> Settings:
    proj = _get(config, "feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]
    if act not in _T5_ACTIVATIONS or proj.count("-") > 1 or (proj.count("-") and not gated):
        _refuse("feed_forward_proj", proj, "mtrain reads 'relu', 'gelu', 'silu' and their "
                "'gated-' forms")
    activations = (_T5_ACTIVATIONS[act], "linear") if gated else (_T5_ACTIVATIONS[act],)
    if _get(config, "decoder_start_token_id", 0) != 0:
        _refuse("decoder_start_token_id", config["decoder_start_token_id"], "mtrain's "
                "decoder starts from id 0, as T5's")
    tied = bool(_get(config, "tie_word_embeddings", True))
    # transformers 5 names the d_model^-0.5 scaling of the logits apart from the tying:
    # mtrain's shared softmax has it, its separate one does not.
    scaled = bool(_get(config, "scale_decoder_outputs", tied))
    if scaled and not tied:
        _refuse("scale_decoder_outputs", True, "mtrain scales the logits of a shared "
                "embedding and softmax only, and this model's are untied")
    fields = {
        "transformer.d_model": "d_model", "transformer.d_ff": "d_ff",
        "transformer.num_heads": "num_heads", "transformer.d_kv": "d_kv",
        "transformer.num_layers": "num_decoder_layers",
        "transformer.num_encoder_layers": "num_layers",
        "transformer.mlp_activations": "feed_forward_proj",
        "transformer.relative_num_buckets": "relative_attention_num_buckets",
        "transformer.relative_max_distance": "relative_attention_max_distance",
        "transformer.shared_embedding_and_softmax": "tie_word_embeddings",
        "transformer.norm_epsilon": "layer_norm_epsilon",
    }
    arch = {
        "transformer.d_model": config["d_model"], "transformer.d_ff": config["d_ff"],
        "transformer.num_heads": config["num_heads"], "transformer.num_kv_heads": 0,
        "transformer.d_kv": config["d_kv"],
        "transformer.num_layers": _get(config, "num_decoder_layers", config["num_layers"]),
        "transformer.num_encoder_layers": config["num_layers"],
        "transformer.mlp_activations": activations,
        "transformer.position_encoding": "relative_bias",
        "transformer.relative_num_buckets": _get(config, "relative_attention_num_buckets", 32),
        "transformer.relative_max_distance": _get(config, "relative_attention_max_distance", 128),
        "transformer.shared_embedding_and_softmax": tied and scaled,
        "transformer.norm_epsilon": float(_get(config, "layer_norm_epsilon", 1e-6)),
    }
    defaults = {"transformer.dropout_rate": float(_get(config, "dropout_rate", 0.0)),
                "transformer.max_length": _get(config, "n_positions", 512),
                "run.task": "bible_enfr"}
    return Settings(T5, arch, fields, defaults, config["vocab_size"],
                    _first(config.get("eos_token_id")), None, untied=tied and not scaled)


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def hf_config(model_config, vocab_rows: int, eos_id: int, bos_id: int | None) -> dict:
    """The config.json of an mtrain model (`TransformerConfig`), or ConversionError if no
    family here can be it."""
    c = model_config

    def refuse(why):
        raise ConversionError(f"this model has no Hugging Face family: {why}")

    if c.position_encoding == "relative_bias":
        if c.num_kv_heads != c.num_heads:
            refuse("T5 has no grouped-query attention (transformer.num_kv_heads)")
        if c.moe_every:
            refuse("T5 has no experts (transformer.moe_every)")
        acts = {v: k for k, v in _T5_ACTIVATIONS.items()}
        if c.mlp_activations[-1:] == ("linear",) and len(c.mlp_activations) == 2 \
                and c.mlp_activations[0] in acts:
            proj = "gated-gelu" if c.mlp_activations[0] == "gelu" else \
                f"gated-{acts[c.mlp_activations[0]]}"
        elif len(c.mlp_activations) == 1 and c.mlp_activations[0] in ("relu", "gelu_exact", "silu"):
            proj = acts[c.mlp_activations[0]]
        else:
            refuse(f"T5's feed_forward_proj cannot be transformer.mlp_activations="
                   f"{c.mlp_activations}")
        return {
            "architectures": [T5], "model_type": "t5", "d_model": c.d_model, "d_ff": c.d_ff,
            "d_kv": c.d_kv, "num_heads": c.num_heads,
            "num_layers": c.num_encoder_layers or c.num_layers,
            "num_decoder_layers": c.num_layers, "feed_forward_proj": proj,
            "is_gated_act": proj.startswith("gated-"),
            "dense_act_fn": "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1],
            "relative_attention_num_buckets": c.relative_num_buckets,
            "relative_attention_max_distance": c.relative_max_distance,
            "layer_norm_epsilon": c.norm_epsilon, "dropout_rate": c.dropout_rate,
            "tie_word_embeddings": c.shared_embedding_and_softmax,
            "scale_decoder_outputs": c.shared_embedding_and_softmax, "vocab_size": vocab_rows,
            "is_encoder_decoder": True, "decoder_start_token_id": 0, "pad_token_id": 0,
            "eos_token_id": eos_id, "n_positions": c.max_length, "initializer_factor": 1.0,
            "dtype": "float32",
        }
    if c.position_encoding != "rotary":
        refuse(f"the Llama family has rotary positions, and transformer.position_encoding="
               f"{c.position_encoding!r} (the 2018 Transformer has none in Hugging Face)")
    if c.mlp_activations != ("silu", "linear"):
        refuse(f"the Llama family's feed-forward layer is SwiGLU, not "
               f"transformer.mlp_activations={c.mlp_activations}")
    if c.shared_embedding_and_softmax:
        refuse("mtrain's shared softmax scales its logits by d_model^-0.5, Llama's tied one "
               "does not (transformer.shared_embedding_and_softmax)")
    config = {
        "architectures": [LLAMA], "model_type": "llama", "hidden_size": c.d_model,
        "intermediate_size": c.d_ff, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.d_kv,
        "num_hidden_layers": c.num_layers, "max_position_embeddings": c.max_length,
        "rms_norm_eps": c.norm_epsilon, "rope_theta": c.rotary_max_wavelength,
        "rope_parameters": {"rope_theta": c.rotary_max_wavelength, "rope_type": "default"},
        "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": vocab_rows,
        "bos_token_id": bos_id if bos_id is not None else c.start_id, "eos_token_id": eos_id,
        "initializer_range": 0.02, "dtype": "float32",
    }
    if c.moe_every:
        m = c.moe
        if c.moe_every != 1:
            refuse(f"Mixtral has experts in every layer, and transformer.moe_every="
                   f"{c.moe_every}")
        if m.top_k < 2 or m.expert_d_ff != c.d_ff:
            refuse("Mixtral renormalises top_k >= 2 gates of experts of d_ff "
                   "(moe.top_k, moe.expert_d_ff)")
        config |= {"architectures": [MIXTRAL], "model_type": "mixtral",
                   "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                   "router_aux_loss_coef": m.load_balance_loss, "router_jitter_noise": 0.0,
                   "sliding_window": None}
    return config


def generation_config(config: dict) -> dict:
    if config["model_type"] == "t5":
        return {"decoder_start_token_id": 0, "eos_token_id": config["eos_token_id"],
                "pad_token_id": 0}
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


# --- tensors -------------------------------------------------------------------------------


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
