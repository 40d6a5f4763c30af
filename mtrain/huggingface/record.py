"""What a Hugging Face family is to mtrain: one frozen record (`Family`) that import
(`families.settings`), export (`families.hf_config`), the weight table (`weights.parameters`),
the tokenizer (`vocabulary`) and the refusals all read; the records themselves are in
`records`. No module of this package compares a family's name: each asks its record.

A record says

- **who it is**: ``architectures`` (the name config.json gives), ``model_type``, and its
  ``kind``: a decoder-only ``'decoder'`` (`DecoderLM`, read by `decoders`) or T5's
  ``'encoder_decoder'`` (`EncoderDecoder`, read by `families`);
- **its config.json fields** read as they are (`Field`: the setting, the field, its default;
  `DECODER_FIELDS` every decoder-only family's, `fields` a family's own);
- **its block**, each a `TransformerConfig` setting it has or has not: the feed-forward
  activation and the config.json field naming it (or mtrain's activations where the family
  fixes them: gpt-oss's clamped SwiGLU), q/k/v biases (or q/k/v/o biases as config.json's
  ``attention_bias`` says: gpt-oss), q/k norms, Gemma's norms after each sublayer, (1 + w)
  scales and embeddings times sqrt(d_model), the field of its attention scale (else
  head_dim^-0.5; latent attention's is DeepSeek's, `rotary.attention_scale`), latent
  attention, attention sinks, how its sliding windows are laid out, its experts (`Experts`:
  their fields, routers and tensors);
- **its tensors**: the names of its layers' attention, feed-forward and norm tensors (the
  rows of `weights.parameters`);
- **its tokenizer's habits**: whether it has a BOS (sequences start after it; else after
  EOS), its sentencepiece file and tokenizer class;
- **what export writes of it** beyond the settings (``constants``: Gemma's empty
  soft-capping fields; ``fixed``: fields whose value the import also checks, DeepSeek's
  ``topk_method``), and whether its config.json names the pad (``config_pad``).
"""

from __future__ import annotations

import dataclasses

# How a family's sliding windows are laid out: none at all (Llama), one window in every
# layer from ``sliding_window`` (Mistral, Mixtral), or per layer by ``layer_types`` (Qwen's
# behind ``use_sliding_window``, Gemma 3's).
WINDOWS = ("none", "every_layer", "layer_types")


REQUIRED = object()  # a `Field` config.json must have


@dataclasses.dataclass(frozen=True)
class Field:
    """A setting read 1:1 from a config.json field and written back to it: `setting` (its
    gin name: ``transformer.d_model``, ``moe.top_k``, ``mla.kv_lora_rank``), `field`, the
    `default` where the field is missing or null (`REQUIRED`: none, the import is refused),
    `kind` its type; `null`, the setting's value a null field means, and is written as."""

    setting: str
    field: str
    default: object = REQUIRED
    kind: type = int
    null: object = REQUIRED  # the setting's value written as null (DeepSeek's q_lora_rank 0)

    def read(self, config: dict):
        value = config.get(self.field)
        if value is None and self.field in config and self.null is not REQUIRED:
            return self.null
        if value is None:
            if self.default is REQUIRED:
                raise KeyError(self.field)
            value = self.default
        return self.kind(value)

    def value(self, model_config):
        """The setting's value in a `TransformerConfig` (``moe.*``: its `MoEConfig`)."""
        group, name = self.setting.split(".")
        return self.kind(getattr(model_config if group == "transformer" else
                                 getattr(model_config, group), name))

    def written(self, model_config):
        """The field's value in the config.json of `model_config` (null where `null` says)."""
        value = self.value(model_config)
        return None if self.null is not REQUIRED and value == self.null else value


# The fields every decoder-only family reads as they are (a record adds its own: `fields`)
DECODER_FIELDS = (
    Field("transformer.d_model", "hidden_size"),
    Field("transformer.d_ff", "intermediate_size"),
    Field("transformer.num_heads", "num_attention_heads"),
    Field("transformer.num_layers", "num_hidden_layers"),
    Field("transformer.max_length", "max_position_embeddings", 2048),
    Field("transformer.norm_epsilon", "rms_norm_eps", 1e-6, float),
)


@dataclasses.dataclass(frozen=True)
class Experts:
    """A family's mixture-of-experts layers: the config.json fields of their count (the
    first found), their width (None: ``intermediate_size``), their period (None: every
    layer) and the gates' renormalisation (None: always renormalised), the fields it
    refuses, its router (softmax or DeepSeek's sigmoid scores with a correction bias for
    the choice; gpt-oss's bias on the logits), and the tensors: ``<layer><prefix><router>``
    (``.weight``, ``.bias``, ``.e_score_correction_bias``) and
    ``<layer><prefix>experts.<j>.<name>.weight`` for the gate, up and down projections, or
    gpt-oss's (`fused`) ``experts.gate_up_proj`` [experts, d_model, 2 x d_ff] (gate and up
    interleaved), ``experts.down_proj`` [experts, d_ff, d_model] and their biases;
    DeepSeek's shared experts under ``<layer><prefix><shared>``."""

    count_fields: tuple[str, ...] = ("num_local_experts",)
    d_ff_field: str | None = None
    every_field: str | None = None
    normalize_field: str | None = None
    refused: tuple[str, ...] = ()  # list fields that must be empty (Qwen3-MoE's mlp_only_layers)
    prefix: str = "mlp."
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router: str = "gate"
    scoring: str = "softmax"  # ``moe.router_scoring``: 'softmax' or DeepSeek's 'sigmoid'
    choice_bias: bool = False  # DeepSeek's e_score_correction_bias (``moe.choice_bias``)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    shared: str | None = None  # the shared experts' module ("shared_experts.": DeepSeek)
    fused: bool = False  # gpt-oss's stacked experts, with biases


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family (see the module doc); the defaults are Llama's."""

    architecture: str  # config.json's architectures[0]
    model_type: str
    description: str  # for the README and errors: what it is, by its best-known releases
    kind: str = "decoder"  # 'decoder' | 'encoder_decoder'
    # The block
    activation_field: str = "hidden_act"
    activation: str = "silu"  # Hugging Face's name; the layer is gated (SwiGLU, GeGLU)
    mlp_activations: tuple[str, ...] | None = None  # mtrain's, where the family fixes them
    qkv_bias: bool = False  # biases on q, k and v (Qwen2); the output projection has none
    # config.json's attention_bias puts biases on q, k, v and o (gpt-oss)
    attention_bias_field: bool = False
    latent_attention: bool = False  # DeepSeek's multi-head latent attention (``mla.*``)
    sinks: bool = False  # a learned sink logit per head (gpt-oss)
    qk_norm: bool = False  # an RMSNorm of each query and key head
    post_norms: bool = False  # norms after each sublayer too (Gemma 3)
    norm_scale_offset: float = 0.0  # RMSNorm scales by offset + w
    scaled_embedding: bool = False  # embeddings times sqrt(d_model)
    tied_by_default: bool = False  # tie_word_embeddings where config.json omits it
    scale_field: str | None = None  # the field of the attention scale (else head_dim^-0.5)
    windows: str = "none"  # one of WINDOWS
    use_sliding_window: bool = False  # Qwen's switch: windows only where it says so
    # without layer_types, every sliding_pattern-th layer full and the others sliding, as
    # transformers fills them in (Gemma 3's 6, gpt-oss's 2); 0: every layer sliding
    sliding_pattern: int = 0
    local_rope: bool = False  # sliding layers with a RoPE of their own (Gemma 3)
    experts: Experts | None = None
    fields: tuple[Field, ...] = ()  # its own 1:1 fields, beside `DECODER_FIELDS`
    # Its tensors (decoder-only): under ``<layer>`` = model.layers.<i>.
    attention: str = "self_attn."
    attention_projections: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp: str = "mlp."
    mlp_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    norms: tuple[tuple[str, str], ...] = (("attention_norm", "input_layernorm"),
                                          ("mlp_norm", "post_attention_layernorm"))
    # Its tokenizer
    bos: bool = True  # a BOS read before each sequence (else its EOS: Qwen)
    sentencepiece: str = "tokenizer.model"
    tokenizer_class: str = "LlamaTokenizer"
    legacy_tokenizer: bool = True  # tokenizer_config.json's ``legacy`` (Llama's)
    # What export writes beyond the settings; fixed: fields the import refuses another
    # value of (missing: as given); config_pad: config.json names the pad (gpt-oss)
    constants: tuple[tuple[str, object], ...] = ()
    fixed: tuple[tuple[str, object], ...] = ()
    config_pad: bool = False

    def __post_init__(self):
        assert self.kind in ("decoder", "encoder_decoder"), self.kind
        assert self.windows in WINDOWS, self.windows

    def __str__(self) -> str:
        return self.architecture

    @property
    def mtrain_activation(self) -> str:
        """mtrain's name of the gated layer's activation (`ACTIVATIONS`)."""
        return ACTIVATIONS[self.activation]

    @property
    def activations(self) -> tuple[str, ...]:
        """``transformer.mlp_activations`` of the family's feed-forward layers."""
        return self.mlp_activations or (self.mtrain_activation, "linear")


# Hugging Face's activation names of the decoder-only families -> mtrain's
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}
