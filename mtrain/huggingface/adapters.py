"""PEFT LoRA adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``, as
`peft` saves them) in and out: their settings as gin's ``lora.*`` and back. The tensors'
names and conversion are `weights.adapters`'.

A folder that asks for what mtrain's adapters do not do (DoRA, per-module ranks or alphas,
LoRA biases, layers left out, modules that are not attention or feed-forward projections)
is refused in one line rather than imported as something else; so is an adapter whose
``base_model_name_or_path`` names another model than the one imported with it (`same_base`:
by their last names, so that a Hub name and a local copy of it agree), unless the user
insists (``--ignore_adapter_base``). Exported adapters name the Hugging Face folder the
model dir was imported from (`origin`) as their base.
"""

from __future__ import annotations

import json
import os
import re

from mtrain.errors import ConfigError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# PEFT's module names -> mtrain's projections (Llama, Mistral, Qwen, Gemma, gpt-oss's
# attention; Mixtral's experts w1/w3/w2; DeepSeek's latent attention and its experts' and
# shared experts' gate/up/down; T5 names its own as mtrain does). gpt-oss's experts are
# parameters, not modules (PEFT's target_parameters): mtrain trains adapters on them and
# exports them merged.
MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "wi_0",
           "up_proj": "wi_1", "down_proj": "wo", "w1": "wi_0", "w3": "wi_1", "w2": "wo",
           "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
           "kv_b_proj": "kv_b",
           **{n: n for n in ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")}}
# gin's lora.* settings and the adapter_config.json fields they come from
FIELDS = {"lora.rank": "r", "lora.alpha": "lora_alpha", "lora.targets": "target_modules",
          "lora.rslora": "use_rslora"}
_UNSUPPORTED = {"use_dora": "DoRA", "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)",
                "layers_to_transform": "adapters on some layers only (layers_to_transform)",
                "modules_to_save": "fully trained modules (modules_to_save)",
                "lora_bias": "LoRA biases (lora_bias)", "fan_in_fan_out": "fan_in_fan_out",
                "target_parameters": "adapters on parameters (target_parameters: gpt-oss's "
                                     "experts)"}


def _name(path: str) -> str:
    """A model's last name: a Hub name's (``Qwen/Qwen2.5-0.5B``), a folder's, or the model a
    Hub cache's snapshot is of (``.../models--Qwen--Qwen2.5-0.5B/snapshots/<hash>``)."""
    path = path.replace("\\", "/").rstrip("/")
    cached = re.search(r"models--[^/]+--([^/]+)/snapshots/", path + "/")
    return cached.group(1) if cached else path.rsplit("/", 1)[-1]


def same_base(named: str | None, bases: list[str]) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` `named` is one of `bases` (the
    imported folder, the name its config.json gives): by their last names. An adapter that
    names none is taken to be of any base."""
    return not named or any(_name(named) == _name(b) for b in bases if b)


def read_config(adapter_dir: str, bases: list[str] | None = None) -> dict:
    """The gin bindings (``lora.rank``, ...) of the PEFT adapter folder `adapter_dir`;
    `bases`: the names of the model it goes onto, which its config must name (None: any)."""
    path = os.path.join(adapter_dir, CONFIG)
    if not os.path.isdir(adapter_dir):
        raise ConfigError(f"--adapter_dir {adapter_dir} is not a directory: name a PEFT "
                          f"adapter folder ({CONFIG}, {WEIGHTS})")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read: {' '.join(str(e).split())}") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type {config.get('peft_type')!r}; mtrain imports "
                          f"LoRA adapters")
    for key, what in _UNSUPPORTED.items():
        if config.get(key) not in (None, False, {}, [], "none"):
            raise ConfigError(f"{path} asks for {what}, which mtrain's LoRA does not do")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{path} trains biases (bias={config['bias']!r}), which mtrain's "
                          f"LoRA does not do")
    named = config.get("base_model_name_or_path")
    if bases is not None and not same_base(named, bases):
        raise ConfigError(f"the adapter in {adapter_dir} is of {named!r} ({CONFIG}'s "
                          f"base_model_name_or_path), not of {bases[0]}: import it with its "
                          f"base, or pass --ignore_adapter_base to put it on this one")
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        raise ConfigError(f"{path}: target_modules is the pattern {modules!r}; mtrain imports "
                          f"adapters that list their modules")
    unknown = sorted(set(modules) - set(MODULES))
    if unknown:
        raise ConfigError(f"{path} adapts {unknown[0]}, which is not an attention or "
                          f"feed-forward projection mtrain adapts ({', '.join(sorted(MODULES))})")
    return {"lora.rank": int(config["r"]), "lora.alpha": float(config["lora_alpha"]),
            "lora.targets": tuple(sorted({MODULES[m] for m in modules})),
            "lora.rslora": bool(config.get("use_rslora", False))}


def write_config(path: str, lora, base: str, targets: list[str]) -> None:
    """Writes ``adapter_config.json`` of `lora` (a `LoraConfig`) into the folder `path`;
    `targets` the PEFT module names it adapts, `base` the base model's name or path."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "use_rslora": lora.rslora, "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
