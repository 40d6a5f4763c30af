"""LoRA adapters of every kind of family mtrain imports (Llama 2, Qwen2, Gemma 3, the experts
of Mixtral and Qwen3-MoE, DeepSeek-V3, gpt-oss, T5.1.1's encoder and decoder): a PEFT adapter folder
with random A and B on every projection, imported onto its base, computes what the base with
W + alpha/r x B A merged into its weights computes (that folder written here, imported
plain); exported again, the adapter is the same tensors, and the merged export those
merged weights."""

import functools
import json
import os
import shutil

import jax
import numpy as np
import pytest

from test_oracles import DECODERS, ORACLES, import_folder, load

from mtrain.__main__ import main
from mtrain.huggingface import tensors
from mtrain.huggingface.adapters import MODULES, WEIGHTS

pytestmark = [pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles"),
              pytest.mark.slow]
RANK, ALPHA = 2, 6.0


def write_adapter(base, folder, rng):
    """A PEFT adapter of `base` on every projection, and the merged weights it means."""
    weights = tensors.Folder(base)
    merged, adapter, modules = {}, {}, set()
    for name in weights.names():
        parts = name.split(".")
        value = weights.read(name)
        if parts[-1] == "weight" and parts[-2] in MODULES and value.ndim == 2:
            out, inp = value.shape
            a = rng.normal(0, 0.1, (RANK, inp)).astype(np.float32)
            b = rng.normal(0, 0.1, (out, RANK)).astype(np.float32)
            stem = f"base_model.model.{name.removesuffix('.weight')}"
            adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"] = a, b
            value = value + np.float32(ALPHA / RANK) * (b @ a)
            modules.add(parts[-2])
        merged[name] = value
    os.makedirs(folder)
    write(folder, adapter, WEIGHTS)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(modules),
        "bias": "none", "use_rslora": False, "use_dora": False}))
    return merged, adapter


def write(folder, arrays, single=tensors.SINGLE):
    tensors.write_folder(str(folder), [(k, v.shape) for k, v in arrays.items()], np.float32,
                         lambda: iter(arrays.items()), single=single)


def logits(model_dir, ids):
    exp, params, _ = load(model_dir)
    model = exp.trainer.model
    # (jitted: one compile of the call, not each op dispatched alone)
    if "inputs" in model.features:  # T5: the encoder reads ids, the decoder ids again
        from test_oracles import t5_logits
        return np.asarray(jax.jit(functools.partial(t5_logits, model))({"params": params},
                                                                     ids, ids))
    from test_oracles import lm_logits
    return np.asarray(jax.jit(functools.partial(lm_logits, model))({"params": params}, ids))


# (Llama 3, Mistral and Qwen3 left out: their adapters are Llama 2's (llama_gqa) tensors by
# the same conversions (`weights.adapters`: q/k/v HeadsIn with Llama's scale, o HeadsOut, the
# feed-forward Transposed), and Qwen2 keeps a tied table and biases beside its adapters.)
@pytest.mark.parametrize("family", ["t5_1_1", *(f for f in DECODERS
                                                if f not in ("llama3", "mistral_sw", "qwen3"))])
def test_a_peft_adapter_of_every_family_in_and_out(family, tmp_path):
    base = os.path.join(ORACLES, family)
    merged, adapter = write_adapter(base, tmp_path / "adapter", np.random.default_rng(0))
    plain = tmp_path / "merged_folder"
    shutil.copytree(base, plain, ignore=shutil.ignore_patterns("*.safetensors*", "*.npz"))
    write(plain, merged)
    import_folder(base, tmp_path / "adapted", f"--adapter_dir={tmp_path / 'adapter'}")
    import_folder(plain, tmp_path / "merged")
    ids = np.random.default_rng(1).integers(3, 200, (2, 12)).astype(np.int32)
    want = logits(tmp_path / "merged", ids)
    # the factored path gives the merged weights' logits (float32, as test_oracles), and
    # the adapter does move them
    assert np.abs(logits(tmp_path / "adapted", ids) - want).max() < 1e-4
    import_folder(base, tmp_path / "base")
    assert np.abs(logits(tmp_path / "base", ids) - want).max() > 1e-2

    out = tmp_path / "out"
    assert main(["--mode=export", f"--model_dir={tmp_path / 'adapted'}", f"--output_dir={out}",
                 "--adapter"]) == 0
    exported = tensors.Folder(str(out), WEIGHTS)
    assert exported.names() == sorted(adapter)
    for name, value in adapter.items():
        np.testing.assert_array_equal(exported.read(name), value, err_msg=name)
    assert main(["--mode=export", f"--model_dir={tmp_path / 'adapted'}",
                 f"--output_dir={tmp_path / 'out_merged'}"]) == 0
    again = tensors.Folder(str(tmp_path / "out_merged"))
    for name, value in merged.items():
        if name in again:  # (a tied model's copy of its table is not written back)
            np.testing.assert_allclose(again.read(name), value, atol=1e-5, err_msg=name)
