"""The planner's step model (`planning.step_model`): a GPU or TPU step's memory and time
from the model's settings, against one H100's measurements, and what the newer blocks
(grouped key/value heads, gates, relative bias, rotary positions, experts) add to it."""

import dataclasses

import pytest

from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.parallel.targets import TARGETS
from mtrain.planning import auto_layout


# One H100, jax 0.11.2, the 1B decoder of benchmarks/throughput.py's GPU preset (issue 17):
# (attention, batch rows of 2048, loss slices, measured peak GiB, measured step seconds).
H100_MEASURED = [
    ("flash", 16, 1, 28.2, 32768 / 95086),  # plain jax.jit + optax, cuDNN is_causal
    ("flash", 4, 1, 10.0, 8192 / 77745),
    ("dot_product", 4, 16, 26.2, 8192 / 45747),  # mtrain with the dense packed mask
    ("dot_product", 16, 16, 93.0, None),  # XLA's out-of-memory report: the step needs 93 GiB
    ("flash", 16, 16, 23.39, 32768 / 85404),  # mtrain, flash 'cudnn' (benchmarks/gpu.sh)
    ("flash", 4, 16, 8.86, 8192 / 70914),
    # benchmarks/gpu.sh of 2026-11-24 (docs/plan_vs_measured.md): 'auto' (cuDNN's packed
    # layout, table 4), its scanned stack, and tokamax's Triton kernel
    ("flash", 16, 16, 23.27, 32768 / 94215),
    ("flash", 4, 16, 8.87, 8192 / 77151),
    ("flash", 16, 16, 28.47, 32768 / 85955),
    ("flash", 16, 16, 23.33, 32768 / 83884),
]


@pytest.mark.parametrize("attention,rows,chunks,peak_gib,seconds", H100_MEASURED)
def test_step_model_is_within_reach_of_the_h100_measurements(attention, rows, chunks, peak_gib,
                                                             seconds):
    """The GPU plan's memory within 25% of the measured peak, its step within 50%."""
    from mtrain.planning import step_model

    config = TransformerConfig(vocab_size=32768, d_model=2048, d_ff=8192, num_heads=16,
                               d_kv=128, num_layers=16, max_length=2048, attention=attention,
                               activation_dtype="bfloat16", remat_policy="dots")
    params = 943_785_984 * 4
    model = step_model.estimate(
        config, "lm", Layout(), rows, 2048, 1, chunks, params + 10_789_000, params,
        32768 * 2048 * 4, DecoderLM(config).analytic_flops(rows, 2048), TARGETS["h100"])
    assert model.total_bytes / 2**30 == pytest.approx(peak_gib, rel=0.25)
    if seconds:
        assert model.step_seconds == pytest.approx(seconds, rel=0.5)
    assert model.attention == ("flash" if attention == "flash" else "dense")
    auto = dataclasses.replace(config, attention="auto")
    assert step_model.attention_kernel(auto) == "flash"
    assert step_model.attention_kernel(dataclasses.replace(auto, dropout_rate=0.1)) == "dense"
    # cuDNN takes no float32 activations: a float32 model's 'auto' attention is einsum there.
    assert step_model.attention_kernel(dataclasses.replace(auto, activation_dtype="float32")) == "dense"


def test_step_model_counts_the_new_blocks():
    """Grouped key/value heads save activations (smaller keys and values); gates add a
    feed-forward projection's; a relative bias makes the attention dense (no flash kernel
    takes it); rotary positions add their FLOPs to the model's."""
    from mtrain.planning import step_model

    base = TransformerConfig(vocab_size=32768, d_model=2048, d_ff=5504, num_heads=16, d_kv=128,
                             num_layers=16, max_length=2048, activation_dtype="bfloat16",
                             remat_policy="none", attention="auto")

    def saved(**changes):
        config = dataclasses.replace(base, **changes)
        return step_model.estimate(
            config, "lm", Layout(), 16, 2048, 1, 16, 4e9, 4e9, 4e8,
            DecoderLM(config).analytic_flops(16, 2048), TARGETS["h100"]).saved_activation_bytes

    assert saved(num_kv_heads=4) < saved() < saved(mlp_activations=("silu", "linear"))
    # per token and layer, 2 x (16 - 4) x 128 bf16 key and value elements less
    assert saved() - saved(num_kv_heads=4) == 16 * 2048 * 16 * 2 * 12 * 128 * 2
    assert step_model.attention_kernel(dataclasses.replace(base, position_encoding="relative_bias")) == "dense"
    rotary = dataclasses.replace(base, position_encoding="rotary")
    assert DecoderLM(rotary).analytic_flops(16, 2048) > DecoderLM(base).analytic_flops(16, 2048)


def test_experts_in_the_step_model_and_the_layout_search():
    """A mixture of experts keeps its tokens' slots and the dispatch tensors (more saved
    activations than the dense layer it replaces, which scale with the capacity factor);
    the layout search tries the experts split over each mesh dimension."""
    from mtrain.models.moe import MoEConfig
    from mtrain.planning import step_model

    base = TransformerConfig(vocab_size=32768, d_model=1024, d_ff=4096, num_heads=8, d_kv=128,
                             num_layers=4, max_length=1024, activation_dtype="bfloat16")

    def saved(**moe):
        config = dataclasses.replace(base, moe_every=2 if moe else 0,
                                     moe=MoEConfig(num_experts=8, **moe) if moe else None)
        return step_model.estimate(
            config, "lm", Layout("batch:8", "batch:batch;experts:batch"), 16, 1024, 1, 16,
            4e9, 4e9, 4e8, DecoderLM(config).analytic_flops(16, 1024),
            TARGETS["h100"]).saved_activation_bytes

    assert saved() < saved(capacity_factor_train=1.0) < saved(capacity_factor_train=2.0)
    layouts = auto_layout.candidate_layouts(8, experts=True)
    assert ("batch:8", "batch:batch;experts:batch", "") in layouts
    assert ("batch:2;model:4", "batch:batch;d_ff:model;heads:model;experts:model", "") in layouts
    assert not any("experts" in rules for _, rules, _ in auto_layout.candidate_layouts(8))
