"""``--mode=plan``: what the configured run's compiled train step needs per device and how
long it would take on an accelerator (`planning.planner`), or the best layouts of a number
of devices (``--auto_layout``), as a report for people or one JSON object."""

from __future__ import annotations

import json
import logging
import sys

import jax

from mtrain.errors import ConfigError
from mtrain.modes.experiment import Experiment
from mtrain.models.transformer import TransformerConfig
from mtrain.parallel.targets import TARGETS
from mtrain.planning import auto_layout as auto_layout_lib
from mtrain.planning import planner

log = logging.getLogger("mtrain")


def describe_model(c) -> str:
    """The model in a line; the blocks of today's models where they are not the 2018 ones."""
    out = (f"{c.num_layers} layers d_model {c.d_model} d_ff {c.d_ff} heads {c.num_heads}x{c.d_kv} "
           f"vocab {c.vocab_size}")
    extras = []
    if getattr(c, "num_kv_heads", c.num_heads) != c.num_heads:
        extras.append(f"{c.num_kv_heads} key/value heads")
    if tuple(getattr(c, "mlp_activations", ("relu",))) != ("relu",):
        extras.append("feed-forward " + "*".join(c.mlp_activations))
    if getattr(c, "latent_attention", False):
        m = c.mla
        extras.append(f"latent attention (q_lora {m.q_lora_rank}, kv_lora {m.kv_lora_rank}, "
                      f"heads {m.qk_nope_head_dim}+{m.qk_rope_head_dim}/{m.v_head_dim})")
    if getattr(c, "moe_every", 0):
        m = c.moe
        extras.append(f"{m.num_experts} experts (d_ff {m.expert_d_ff}, top-{m.top_k}) every "
                      + (f"{c.moe_every} layers" if c.moe_every > 1 else "layer"))
    encoding = getattr(c, "position_encoding", "learned")
    if encoding == "rotary":
        extras.append("rotary positions")
    elif encoding == "relative_bias":
        path = "einsum" if c.attention == "auto" else c.attention
        extras.append(f"relative position bias (attention {path}: no flash kernel takes a bias)")
    return out + "".join(f", {e}" for e in extras)


def _with_cache_line(text: str, e: dict) -> str:
    """The plan's `text` with the decoding cache's bytes a token (`inference.estimate`)
    after its inference figures, beside those of multi-head attention with the same heads."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("inference (")), None)
    if at is None or "cache_bytes_per_token" not in e:
        return text
    lines.insert(at + 2, f"  decoding cache {planner.size_text(e['cache_bytes_per_token'])} a "
                         f"token, all layers (multi-head attention of the same heads: "
                         f"{planner.size_text(e['mha_cache_bytes_per_token'])})")
    return "\n".join(lines)


def pipelines(model) -> int:
    """The layers of `model`'s stack that a split over pipeline stages cuts: its layers
    where it can pipeline (a decoder-only Transformer of scanned layers), else 0."""
    c = model.config
    if not isinstance(c, TransformerConfig) or "inputs" in model.features \
            or not c.scan_layers:
        return 0
    return c.num_layers


def plan(exp: Experiment, target: str = "tpu-v3", output_format: str = "text",
         auto_layout: bool = False, devices: int | None = None, top: int = 5,
         out=None, prompt_length: int | None = None, slices: int = 1) -> dict:
    """``--mode=plan``: compiles the train step for the configured mesh and prints what it
    needs per device and how long it would take on `target` (see `planner`); with
    `auto_layout`, ranks every mesh and layout of `devices` (default: the mesh's size)
    devices instead. Prints text or, with `output_format` 'json', one JSON object to `out`
    (default stdout); returns that object. `prompt_length`: the prompts of a decoder-only
    LM's generation figures (default: half the row). `slices`: the slices (TPU multislice, GPU
    nodes) the first mesh dimension spans, joined by the data-centre network."""
    if target not in TARGETS:
        raise ConfigError(f"unknown --target {target!r}; use one of {', '.join(TARGETS)}")
    if output_format not in ("text", "json"):
        raise ConfigError(f"unknown --format {output_format!r}; use text or json")
    target_spec = TARGETS[target]
    if slices < 1:
        raise ConfigError(f"--slices must be at least 1, got {slices}")
    if slices > 1 and not target_spec.dcn_bandwidth:
        raise ConfigError(f"--slices={slices}: no data-centre network bandwidth is known for "
                          f"{target}")
    describe = f"task {exp.task.name}, {describe_model(exp.model_config)}"
    if auto_layout:
        devices = devices or exp.layout.size
        if devices > jax.device_count():
            raise ConfigError(f"--auto_layout for {devices} devices, but only "
                              f"{jax.device_count()} are available to compile for")
        if devices % slices:
            raise ConfigError(f"--slices={slices} does not divide the {devices} devices")
        results = auto_layout_lib.auto_layout(
            exp.trainer.with_layout, devices, target_spec,
            progress=lambda message: log.info("auto-layout %s", message),
            experts=bool(getattr(exp.model_config, "moe_every", 0)),
            sequence_length=exp.trainer.batch_shape[1], slices=slices,
            pipelines=pipelines(exp.trainer.model))
        report = {"model": describe, "num_devices": devices, "target": target, "slices": slices,
                  "candidates": [{"mesh_shape": c.mesh_shape, "layout_rules": c.layout_rules,
                                  "parameter_layout_rules": c.parameter_layout_rules,
                                  "rejected": c.rejected,
                                  "plan": c.plan.to_dict() if c.plan else None}
                                 for c in results]}
        text = auto_layout_lib.format_auto_layout(results, devices, target, top, slices)
    else:
        compiled = exp.stepper.compile_train_step() if exp.stepper is not exp.trainer else None
        result = planner.plan(exp.trainer, target_spec, compiled=compiled,
                              prompt_length=prompt_length, slices=slices)
        report = {"model": describe, **result.to_dict()}
        text = _with_cache_line(planner.format_plan(result, describe), result.inference)
    out = out or sys.stdout
    out.write((json.dumps(report, indent=1) if output_format == "json" else text) + "\n")
    out.flush()
    return report
