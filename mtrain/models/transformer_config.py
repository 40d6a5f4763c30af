"""The Transformers' hyper-parameters (`TransformerConfig`, gin's ``transformer.*``) and
their checks: the 2018 model by default, and each later block a setting of it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtrain.models import attention, context, feedforward, quantization
from mtrain.models.attention import CUDNN_MAX_SEGMENTS
from mtrain.models.base import shape_field
from mtrain.models.blocks import dense_period, period
from mtrain.models.latent_attention import LatentConfig
from mtrain.models.lora import LoraConfig
from mtrain.models.moe import MoEConfig
from mtrain.models.pipeline import PipelineConfig
from mtrain.models.positions import RopeScaling
from mtrain.models.remat import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model hyper-parameters (Mesh-TF names; gin: ``transformer.d_model = 512``). The
    vocabulary size comes from the task's vocabulary. The `shape_field`s change parameter
    shapes; the rest (dropout, dtype, remat, attention) may change between runs of a model."""

    vocab_size: int = shape_field(8192)
    d_model: int = shape_field(256)
    d_ff: int = shape_field(1024)
    num_heads: int = shape_field(4)
    d_kv: int = shape_field(64)
    num_layers: int = shape_field(2)
    num_encoder_layers: int = shape_field(0)  # encoder-decoder only; 0: as many as num_layers
    dropout_rate: float = 0.0
    shared_embedding_and_softmax: bool = shape_field(False)
    # (the positions a learned table holds; with any other encoding, shapes nothing)
    max_length: int = shape_field(512, when=lambda c: c.position_encoding == "learned")
    activation_dtype: str = "float32"  # 'bfloat16': activations and matmuls (params stay f32)
    remat_policy: str = "none"  # per layer: 'none', 'full' (recompute all), 'dots' (keep matmuls)
    scan_layers: bool = shape_field(False)  # each layer stack one scanned Block: compile time flat in depth
    # 'einsum', 'dot_product' (jax.nn.dot_product_attention), 'flash' (packed flash
    # attention; no attention dropout) or 'auto' (flash on GPU and TPU where its kernel
    # takes the activations: cuDNN's, bfloat16; einsum on CPU and elsewhere).
    attention: str = "auto"
    # 'auto' (cudnn on GPU, splash elsewhere), 'cudnn' (cuDNN given the packed mask),
    # 'cudnn_segments' (cuDNN's packed-segment layout, Hopper on), 'splash', 'triton'.
    flash_kernel: str = "auto"
    # cudnn_segments' table: packed examples per row at most.
    flash_max_segments: int = CUDNN_MAX_SEGMENTS
    # Self-attention with ``length`` split (a layout rule length:<mesh dim>, `context`):
    # 'gather' (keys and values all-gathered along it) or 'ring' (passed around it).
    context_parallel: str = "gather"
    # The feed-forward layer's activations: ('relu',) one input projection; several
    # (('gelu', 'linear'): GeGLU as T5.1.1, ('silu', 'linear'): SwiGLU as Llama) one
    # projection each, multiplied (`feedforward.ACTIVATIONS` has the names).
    mlp_activations: tuple[str, ...] = shape_field(("relu",))
    # 'learned' (a position table per stack), 'rotary' (RoPE on queries and keys) or
    # 'relative_bias' (T5's bucketed relative position bias, a table per stack).
    position_encoding: str = shape_field("learned")
    rotary_max_wavelength: float = 10_000.0
    relative_num_buckets: int = shape_field(32)
    relative_max_distance: int = 128
    # Key/value heads: 0 (default) as many as num_heads; 1 multi-query; between, grouped-query
    # attention (it divides num_heads). Fewer lie on their own dimension, ``kv_heads``.
    num_kv_heads: int = shape_field(0)
    # Mixture of experts: 0 (none) or N, every N-th layer's feed-forward layer is `moe`'s
    # experts (the last of each N layers; with scan_layers the scan repeats a group of N).
    moe_every: int = shape_field(0)
    moe: MoEConfig | None = shape_field(None)  # None while moe_every is 0
    norm_epsilon: float = 1e-6  # the RMSNorms' (T5's 1e-6; Llama 2 and 3 use 1e-5)
    start_id: int = 0  # what a decoder-only LM reads first: 0 (Mesh-TF, T5) or Llama's BOS
    # What today's published families add (`huggingface.families` sets them on import):
    # the attention logits' factor (1: Mesh-TF's, whose query initialiser has d_kv^-0.5;
    # Llama's d_kv^-0.5, Gemma's query_pre_attn_scalar^-0.5), q/k/v biases (Qwen2), an
    # RMSNorm of each query and key head (Qwen3, Gemma 3), norms that scale by offset + w
    # (Gemma's 1 + w), a second norm after each sublayer (Gemma 2 and 3), the embeddings
    # times a factor (Gemma's sqrt(d_model)), and a shared softmax without Mesh-TF's
    # d_model^-0.5 (the tied Llama 3.2, Qwen2.5, Gemma).
    attention_scale: float = 1.0
    attention_bias: bool = shape_field(False)
    qk_norm: bool = shape_field(False)
    norm_scale_offset: float = 0.0
    post_norms: bool = shape_field(False)
    embedding_multiplier: float = 1.0
    shared_softmax_scaled: bool = True
    # Sliding-window attention: each layer's window, repeated over the layers (0: a full
    # layer; () none): (4096,) Mistral 7B v0.1, (512,) * 5 + (0,) Gemma 3. A windowed
    # layer of a model with rotary_local_max_wavelength rotates by it, unscaled (Gemma 3).
    attention_windows: tuple[int, ...] = ()
    rotary_local_max_wavelength: float = 0.0
    rope_scaling: RopeScaling | None = None  # None: RopeScaling() (no scaling)
    # The vocabulary rows that are real (the pieces, or a checkpoint's vocab_size): the
    # rows past it, mtrain's padding of vocab_size to a multiple of 128, are left out of
    # every softmax. 0: all of them.
    real_vocab_size: int = 0
    # Low-rank adapters on the projections it targets (`lora.LoraConfig`, gin's lora.*;
    # None or rank 0: none).
    lora: LoraConfig | None = shape_field(None)
    # The frontier's layers (issue 60; each off by default):
    # multi-head latent attention in place of self-attention's q, k, v (DeepSeek-V2, V3;
    # `latent_attention.LatentConfig`, gin ``mla.*``);
    latent_attention: bool = shape_field(False)
    mla: LatentConfig | None = shape_field(None)  # None while latent_attention is False
    # a learned logit per head in each self-attention softmax's denominator, and a bias on
    # the attention's output projection (gpt-oss);
    attention_sinks: bool = shape_field(False)
    attention_output_bias: bool = shape_field(False)
    # the first layers dense, experts every moe_every layers after them (DeepSeek's
    # first_k_dense_replace);
    first_dense_layers: int = shape_field(0)
    # multi-token prediction modules (DeepSeek-V3), their loss's weight;
    mtp_depth: int = shape_field(0)
    mtp_loss_weight: float = 0.3
    # gpt-oss's clamped SwiGLU (``mlp_activations = ("clamped_swish",
    # "clamped_linear_plus_one")``): the clamp and the swish's alpha.
    activation_limit: float = 0.0
    swish_alpha: float = 1.702
    # Low-precision matmuls in the projections (`quantization`): 'none', 'fp8' (Hopper and
    # newer GPUs) or 'int8' (TPU v5e); one scale per operand ('tensorwise') or per row
    # ('rowwise'), or fp8's from an amax history of `quantization_history` steps ('delayed':
    # state beside each projection's weight). Parameters and checkpoints keep their dtype: it
    # may change between runs.
    quantization: str = "none"
    quantization_scaling: str = "tensorwise"
    quantization_history: int = 1024
    # How a stack split over pipeline stages (a layout rule layers:<mesh dim>) runs
    # (`pipeline.PipelineConfig`, gin's pipeline.*; None: its defaults, GPipe).
    pipeline: PipelineConfig | None = None

    @property
    def dtype(self):
        return jnp.dtype(self.activation_dtype)

    @property
    def attention_head_dim(self) -> int:
        """The head width self-attention's kernels see (what `attention.flash_refusal`
        judges): d_kv, or latent attention's query/key head (nope + rope; its value heads
        zero-padded to it: `LatentConfig.head_width`)."""
        return self.mla.head_width if self.latent_attention else self.d_kv

    def __post_init__(self):
        object.__setattr__(self, "mlp_activations", tuple(self.mlp_activations))
        object.__setattr__(self, "attention_windows", tuple(self.attention_windows))
        object.__setattr__(self, "rope_scaling", self.rope_scaling or RopeScaling())
        if self.lora is not None and not self.lora.rank:
            object.__setattr__(self, "lora", None)
        if any(not isinstance(w, int) or w < 0 for w in self.attention_windows):
            raise ValueError(f"transformer.attention_windows must be windows of at least 1 "
                             f"position, or 0 for a full layer, got {self.attention_windows}")
        if not 0 <= self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"the real vocabulary ({self.real_vocab_size} rows) must fit the "
                             f"model's ({self.vocab_size})")
        if self.moe_every < 0:
            raise ValueError(f"transformer.moe_every must be 0 (no experts) or positive, got "
                             f"{self.moe_every}")
        moe = None
        if self.moe_every:
            moe = self.moe or MoEConfig()
            moe = dataclasses.replace(moe, expert_d_ff=moe.expert_d_ff or self.d_ff)
        object.__setattr__(self, "moe", moe)
        object.__setattr__(self, "mla", (self.mla or LatentConfig()) if self.latent_attention
                           else None)
        object.__setattr__(self, "pipeline", self.pipeline or PipelineConfig())
        stacks = {self.num_layers, self.num_encoder_layers or self.num_layers}
        k = self.first_dense_layers
        if k and not self.moe_every:
            raise ValueError(f"transformer.first_dense_layers={k} keeps the first layers "
                             "dense before experts, and transformer.moe_every is 0: no experts")
        if not 0 <= k < min(stacks):
            raise ValueError(f"transformer.first_dense_layers={k} must be 0 or more and leave "
                             f"a layer of each stack ({min(stacks)} layers) after them")
        if self.scan_layers and (any((n - k) % period(self) for n in stacks)
                                 or k % dense_period(self)):
            raise ValueError(f"transformer.scan_layers scans groups of {period(self)} layers "
                             f"(moe_every={self.moe_every}, {len(self.attention_windows)} "
                             f"attention_windows): that must divide the number of layers of "
                             f"each stack ({', '.join(map(str, sorted(stacks)))})"
                             + (f" less first_dense_layers={k}, and {dense_period(self)} "
                                f"divide {k}" if k else ""))
        if not self.num_kv_heads:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"transformer.num_kv_heads={self.num_kv_heads} must divide "
                             f"transformer.num_heads={self.num_heads}")
        unknown = [a for a in self.mlp_activations if a not in feedforward.ACTIVATIONS]
        if unknown or not self.mlp_activations:
            raise ValueError(f"transformer.mlp_activations: {unknown or 'none given'}; the "
                             f"names are {', '.join(feedforward.ACTIVATIONS)}")
        if self.activation_limit < 0 or (self.activation_limit and not any(
                a in feedforward.CLAMPED for a in self.mlp_activations)):
            raise ValueError(f"transformer.activation_limit={self.activation_limit} must be 0 "
                             f"(no clamp) or positive, and clamps only "
                             f"{' and '.join(feedforward.CLAMPED)} (mlp_activations)")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(f"transformer.position_encoding must be one of "
                             f"{', '.join(POSITION_ENCODINGS)}, got {self.position_encoding!r}")
        if self.position_encoding == "rotary" and self.d_kv % 2:
            raise ValueError(f"transformer.position_encoding='rotary' rotates pairs: d_kv "
                             f"must be even, got {self.d_kv}")
        if self.position_encoding == "relative_bias" and self.attention == "flash":
            raise ValueError("transformer.position_encoding='relative_bias' adds a bias no "
                             "flash kernel here takes: use attention 'auto', 'einsum' or "
                             "'dot_product'")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"transformer.remat_policy must be one of {sorted(REMAT_POLICIES)}, "
                             f"got {self.remat_policy!r}")
        if self.attention not in ("auto", "einsum", "dot_product", "flash"):
            raise ValueError(f"transformer.attention must be 'auto', 'einsum', 'dot_product' or "
                             f"'flash', got {self.attention!r}")
        if self.flash_kernel not in attention.FLASH_KERNELS:
            raise ValueError(f"transformer.flash_kernel must be one of "
                             f"{', '.join(attention.FLASH_KERNELS)}, got {self.flash_kernel!r}")
        if self.context_parallel not in context.MODES:
            raise ValueError(f"transformer.context_parallel must be one of "
                             f"{', '.join(context.MODES)}, got {self.context_parallel!r}")
        if self.flash_max_segments < 1:
            raise ValueError(f"transformer.flash_max_segments must be at least 1, got "
                             f"{self.flash_max_segments}")
        if self.attention == "flash" and self.dropout_rate > 0:
            raise ValueError("transformer.attention='flash' has no attention dropout, and "
                             f"transformer.dropout_rate is {self.dropout_rate}: set it to 0, or "
                             "use attention 'auto' (flash where no dropout is applied)")
        if self.activation_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"activation_dtype must be 'float32' or 'bfloat16', got "
                             f"{self.activation_dtype!r}")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"transformer.mtp_depth must be 0 (no multi-token prediction) or "
                             f"a number of modules, got {self.mtp_depth!r}")
        if self.mtp_depth and self.num_encoder_layers:
            raise ValueError(f"transformer.mtp_depth={self.mtp_depth}: multi-token prediction "
                             "is a decoder-only LM's, and num_encoder_layers is set")
        if not self.mtp_loss_weight >= 0:
            raise ValueError(f"transformer.mtp_loss_weight must be 0 or more, got "
                             f"{self.mtp_loss_weight}")
        if self.attention_sinks and self.attention == "dot_product":
            raise ValueError("transformer.attention='dot_product' (jax.nn.dot_product_"
                             "attention) takes no attention sinks (transformer.attention_sinks):"
                             " use attention 'auto', 'einsum', or 'flash' with 'splash'")
        if self.attention_sinks and self.latent_attention:
            raise ValueError("transformer.attention_sinks are multi-head attention's, not "
                             "latent_attention's: set one of them False")
        if self.latent_attention:
            _check_latent_attention(self)
        quantization.check(self.quantization, self.quantization_scaling,
                           self.quantization_history)
        if self.attention == "flash" and (why := attention.flash_refusal(
                self.flash_kernel, jax.default_backend(), self.dtype, self.attention_head_dim,
                self.attention_sinks)):
            raise ValueError(f"transformer.attention='flash': {why} (attention 'auto' uses "
                             "flash attention where it can run, einsum elsewhere)")


POSITION_ENCODINGS = ("learned", "rotary", "relative_bias")


def _check_latent_attention(c: TransformerConfig) -> None:
    """What latent attention (``transformer.latent_attention``) does not combine with: one
    line each, naming the setting."""
    refused = [("position_encoding", c.position_encoding != "rotary",
                "its positions are the rotary key's: set it to 'rotary'"),
               ("attention_windows", any(c.attention_windows),
                "no sliding window with latent attention (no published model has one)"),
               ("attention_output_bias", c.attention_output_bias,
                "no output bias with latent attention (no published model has one)"),
               ("attention_bias", c.attention_bias, "no q/k/v biases with latent attention"),
               ("qk_norm", c.qk_norm, "latent attention norms its latents, not its heads"),
               ("num_kv_heads", c.num_kv_heads != c.num_heads,
                "latent attention's heads share one latent: leave it at num_heads")]
    for name, bad, why in refused:
        if bad:
            raise ValueError(f"transformer.{name}={getattr(c, name)!r} with "
                             f"transformer.latent_attention: {why}")
