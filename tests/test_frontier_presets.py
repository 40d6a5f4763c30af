"""The frontier's presets at their published sizes (`configs/models/deepseek_v3_671b.gin`,
`gpt_oss_120b.gin`) and their pods (`configs/experiments/*_lm.gin`): the parameter counts
the model cards give, and the README's plans (`--mode=plan --format=json`) on a TPU v5p
slice and on H100 nodes, which compile the real train step for 1024 and 64 simulated
devices."""

import dataclasses
import json
import os
import subprocess
import sys

import gin
import pytest

from conftest import no_compilation_cache
from mtrain import config as config_lib
from mtrain.models.transformer import DecoderLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (experiment, model cards' parameters: all and active, the vocabulary rows)
PRESETS = {"deepseek_v3_671b": (6.71e11, 3.7e10, 129280),
           "gpt_oss_120b": (1.168e11, 5.13e9, 201088)}


def model(name: str, vocab: int) -> DecoderLM:
    gin.clear_config()
    gin.parse_config_files_and_bindings([os.path.join(REPO, "configs", "models", f"{name}.gin")],
                                        [], skip_unknown=False)
    try:
        return DecoderLM(config_lib.model_config(vocab))
    finally:
        gin.clear_config()


@pytest.mark.parametrize("name", PRESETS)
def test_the_presets_have_their_model_cards_parameters(name):
    """DeepSeek-V3: 671B, and 685B with its multi-token prediction module (a layer of
    experts and a projection: 11.5B here, 14B on the model card, which counts its copies of
    the embedding and output tables); 37B active. gpt-oss-120b: 116.8B, 5.13B active
    (the card leaves the embedding lookup out of the active count; the plan counts it)."""
    total, active, vocab = PRESETS[name]
    m = model(name, vocab)
    c = m.config
    if name == "deepseek_v3_671b":
        trunk = DecoderLM(dataclasses.replace(c, mtp_depth=0))
        assert trunk.analytic_parameters() == pytest.approx(total, rel=0.005)
        assert 6.82e11 < m.analytic_parameters() < 6.86e11
        assert trunk.active_parameters() - vocab * c.d_model == pytest.approx(active, rel=0.02)
    else:
        assert m.analytic_parameters() == pytest.approx(total, rel=0.005)
        assert m.active_parameters() - vocab * c.d_model == pytest.approx(active, rel=0.01)


def plan(name: str, target: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "mtrain", "--mode=plan", f"--gin_file=experiments/{name}_lm.gin",
         f"--target={target}", "--format=json"], capture_output=True, text=True, cwd=REPO,
        timeout=900, env=no_compilation_cache(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # (four programs of 64 and 1024 devices: ~2 minutes)
@pytest.mark.parametrize("name", PRESETS)
def test_the_presets_fit_a_tpu_v5p_slice_and_h100_nodes(name):
    """The README's plans: each fits both targets in the layout of its experiment, and
    latent attention's decoding cache is (kv_lora + rope) values a token and layer, 576
    against the 40,960 of multi-head attention of its heads (bfloat16)."""
    for target in ("tpu-v5p", "h100"):
        report = plan(name, target)
        assert report["fits"], (target, report["total_bytes"])
        assert report["step_seconds"] > 0
        cache = report["inference"]
        if name == "deepseek_v3_671b":
            assert report["num_devices"] == 1024
            # 61 layers (the multi-token prediction module decodes nothing)
            assert cache["cache_bytes_per_token"] == 61 * (512 + 64) * 2
            assert cache["mha_cache_bytes_per_token"] == 61 * 128 * (192 + 128) * 2
        else:
            assert report["num_devices"] == 64
            # the 18 full layers' keys and values (a sliding layer's ring stays 128 long)
            assert cache["cache_bytes_per_token"] == 18 * 2 * 8 * 64 * 2
