"""GRPO's step split into generation and update, measured, against an SFT step on the same
rows (the update's baseline: what a step on those tokens costs without GRPO).

Builds the benchmarks' Llama-style decoder (benchmarks/lora.py; default d_model 512, 4
layers) with the 512 ids of ../shared/oracles/llama_gqa's sentencepiece file (EOS 2), and a
GRPO run's batch: --prompts prompts of --prompt_length random ids, each continued
--generations times by mtrain's generator (`evaluation.rollouts.GrpoStepper.sample`:
prefill, then a token a step with the key/value cache; a random model rarely samples EOS,
so nearly every completion runs to --completion_length). Times (median of --steps, after
a warm-up): the sampling; the generating policy's log-probabilities (the extra forward
pass of grpo.num_iterations > 1); the GRPO update (beta 0: the policy alone; beta 0.04: with
the reference's forward pass, a frozen copy); and the SFT step on the same rows (their
completions' cross-entropy). Prints each one's time and tokens/s, the share of the step
spent generating, and the update's time over SFT's.

    python benchmarks/grpo.py [--d_model 512] [--layers 4] [--prompts 8] [--generations 8]
        [--prompt_length 64] [--completion_length 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from lora import llama_config, timed_steps

from mtrain.data.vocabulary import load_vocabulary
from mtrain.evaluation.generation import Prompt
from mtrain.evaluation.rollouts import GrpoStepper, rows
from mtrain.models.transformer import DecoderLM
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.grpo import Grpo, GrpoConfig
from mtrain.training.trainer import Trainer

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "oracles",
                         "llama_gqa", "tokenizer.model")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("d_model", 512), ("layers", 4), ("prompts", 8), ("generations", 8),
                          ("prompt_length", 64), ("completion_length", 128), ("steps", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def median_seconds(run, steps: int) -> tuple[float, object]:
    out = run()  # compile and warm up
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = run()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def trainer_of(config, objective, batch_size, length):
    layout = Layout("", "")
    return Trainer(model=DecoderLM(config), optimizer=optimizer.adamw(1e-5), layout=layout,
                   mesh=layout.make_mesh(jax.devices()[:1]), batch_size=batch_size,
                   sequence_length=length, objective=objective)


def main():
    args = parse_args()
    vocab = load_vocabulary(TOKENIZER)
    length = args.prompt_length + args.completion_length + 1
    config = dataclasses.replace(llama_config(argparse.Namespace(
        d_model=args.d_model, layers=args.layers, length=length)), vocab_size=512)
    n = args.prompts * args.generations
    grpo = GrpoConfig(num_generations=args.generations,
                      max_completion_length=args.completion_length, beta=0.0)
    trainer = trainer_of(config, Grpo(grpo), n, length)
    stepper = GrpoStepper(trainer=trainer, vocab=vocab, config=grpo, reads_rollouts=True)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 512, args.prompt_length - 1).tolist()
               for _ in range(args.prompts) for _ in range(args.generations)]
    sampled = [Prompt(tuple(p), vocab.eos_id) for p in prompts]
    generation, completions = median_seconds(
        lambda: stepper.sample(state.params, sampled, 0), args.steps)
    new_tokens = sum(len(c) for c in completions)
    advantages = rng.standard_normal(n).astype(np.float32)
    batch = rows(prompts, completions, advantages, length)
    placed = trainer.place_batch(batch)
    logps, _ = median_seconds(lambda: trainer.token_log_likelihoods(state.params, placed),
                              args.steps)
    tokens = int((batch["targets_segment_ids"] > 0).sum())
    results = {"generation": (generation, new_tokens), "old log-probabilities": (logps, tokens)}
    for name, objective in (("GRPO update, beta 0", Grpo(grpo)),
                            ("GRPO update, beta 0.04", Grpo(dataclasses.replace(grpo, beta=0.04))),
                            ("SFT step (baseline)", None)):
        t = trainer_of(config, objective, n, length)
        start = t.init_state()
        if t.objective.needs_start:
            t.objective.set_start(start.params)
        sft = {k: v for k, v in batch.items() if objective is not None or k in (
            "targets", "targets_segment_ids", "targets_positions", "targets_inputs",
            "targets_weights")}
        _, median = timed_steps(t, start, t.place_batch(sft), args.steps)
        results[name] = (median, tokens)
    print(f"model: d_model {args.d_model}, {args.layers} layers, vocab 512; {args.prompts} "
          f"prompts x {args.generations} completions of {args.prompt_length} + at most "
          f"{args.completion_length} ids (sampled: {new_tokens} new ids); "
          f"{jax.devices()[0].platform}")
    print(f"{'':26s} {'ms':>9s} {'tokens/s':>10s}")
    for name, (seconds, count) in results.items():
        print(f"{name:26s} {1e3 * seconds:9.1f} {count / seconds:10.0f}")
    update = results["GRPO update, beta 0"][0]
    print(f"generation share of a step (beta 0, one iteration): "
          f"{generation / (generation + update):.2f}")
    sft = results["SFT step (baseline)"][0]
    print(f"GRPO update / SFT step: beta 0 {update / sft:.2f}, beta 0.04 "
          f"{results['GRPO update, beta 0.04'][0] / sft:.2f}")


if __name__ == "__main__":
    main()
