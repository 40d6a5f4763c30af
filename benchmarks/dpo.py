"""DPO's train step against a plain SFT step on the same batch, measured.

Builds a Llama-style decoder (SwiGLU, rotary, grouped-query attention; default d_model 512,
4 layers, batch 8 x 256, AdamW) and one batch of preference pairs (each row 2 pairs, each
half 64 tokens of which the last 48 are the completion's, as `data.preference.Preference`
packs them). Times --steps jitted train steps (median, after a warm-up) of: SFT on those
rows (the cross-entropy of the completions' tokens, the baseline) and DPO on them (the
policy's forward and backward, and the reference's forward), with LoRA adapters (the
reference is the base without them) and with every parameter trained (the reference a
frozen copy). DPO costs one more forward pass than SFT: about 4/3 of its FLOPs with full
fine-tuning, and more with LoRA, whose backward pass forms no weight gradients. (XLA's FLOP
count counts a loop's body once: SFT's loss, made a slice of the sequence at a time, is
undercounted against DPO's, which forms its logits whole; the step times are the measure.)

    python benchmarks/dpo.py [--d_model 512] [--layers 4] [--rank 16] [--steps 10]
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

# (benchmarks/lora.py: the same model, flags and timed loop)
from lora import llama_config, parse_args, timed_steps

from mtrain.data.preference import CHOSEN, REJECTED, REJECTED_PROMPT
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS
from mtrain.models.lora import LoraConfig, is_adapter
from mtrain.models.transformer import DecoderLM
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.dpo import DpoConfig, Preference
from mtrain.training.trainer import Trainer


def pair_rows(batch: int, length: int, half: int = 64, prompt: int = 16) -> dict:
    """Rows of pairs as the pipeline packs them: halves as segments 2k - 1 and 2k."""
    rng = np.random.default_rng(0)
    shape = (batch, length)
    k = np.arange(length) // half  # the half of each position
    weights = np.where(k % 2 == 0, np.where(np.arange(length) % half < prompt, 0, CHOSEN),
                       np.where(np.arange(length) % half < prompt, REJECTED_PROMPT, REJECTED))
    tokens = rng.integers(1, 8192, shape).astype(np.int32)
    return {"targets": tokens, READ_INPUTS: np.roll(tokens, 1, axis=1),
            "targets_segment_ids": np.broadcast_to(k + 1, shape).astype(np.int32),
            "targets_positions": np.broadcast_to(np.arange(length) % half, shape).astype(np.int32),
            LOSS_WEIGHTS: np.broadcast_to(weights, shape).astype(np.int32)}


def measure(config, trainable, dpo, batch, steps):
    layout = Layout("", "")
    trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adamw(1e-4), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:1]),
                      batch_size=batch["targets"].shape[0],
                      sequence_length=batch["targets"].shape[1], trainable=trainable,
                      objective=Preference(dpo) if dpo else None)
    state = trainer.init_state()
    if trainer.objective.needs_start:  # (DPO's frozen reference)
        trainer.objective.set_start(state.params)
    placed = trainer.place_batch(batch)
    state, median = timed_steps(trainer, state, placed, steps)
    cost = trainer.compile_train_step(placed).cost_analysis()
    return median, (cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)


def main():
    args = parse_args(__doc__)
    config = llama_config(args)
    lora = dataclasses.replace(config, lora=LoraConfig(rank=args.rank))
    batch = pair_rows(args.batch, args.length)
    results = {}
    for name, cfg, trainable in (("LoRA", lora, is_adapter), ("full", config, None)):
        for objective, dpo in (("SFT", None), ("DPO", DpoConfig())):
            results[name, objective] = measure(cfg, trainable, dpo, batch, args.steps)
    print(f"model: d_model {args.d_model}, {args.layers} layers, batch {args.batch} x "
          f"{args.length} (2 pairs a row), AdamW; LoRA rank {args.rank}; "
          f"{jax.devices()[0].platform}")
    print(f"{'':24s} {'step ms':>9s} {'XLA GFLOPs':>11s}")
    for (name, objective), (t, flops) in results.items():
        print(f"{objective + ' ' + name:24s} {1e3 * t:9.1f} {flops / 1e9:11.1f}")
    for name in ("LoRA", "full"):
        (sft, sft_flops), (dpo, dpo_flops) = results[name, "SFT"], results[name, "DPO"]
        print(f"DPO / SFT, {name}: step time {dpo / sft:.2f}, FLOPs {dpo_flops / sft_flops:.2f}")


if __name__ == "__main__":
    main()
