"""Prefill (`DecoderLM.prefill`, `decoding.sample(prefill=...)`): the prompts of a batch,
of mixed lengths, read in one pass into the cache, then decoded a token a step, give the
tokens of the token-by-token loop (greedy and sampled; rotary with grouped heads and a
sliding window's ring, learned positions, T5's relative bias, scanned layers, a flash
kernel, layouts) and Hugging Face's greedy ids; and the planner's figures of it.

Exact token equality: the two paths compute the same float32 values up to the order of a
few sums (a pass against a step), far below the gaps between the logits of these models'
likeliest tokens; the oracles' ids are what `transformers` decoded.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrain.evaluation import decoding, generation
from mtrain.evaluation.translation import DecodingConfig, empty_cache
from mtrain.models.moe import MoEConfig
from mtrain.models.transformer import DecoderLM, TransformerConfig
from mtrain.parallel.layout import Layout
from mtrain.training import optimizer
from mtrain.training.trainer import Trainer

BASE = dict(vocab_size=64, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2, d_kv=8,
            num_layers=2, max_length=24, position_encoding="rotary")
CONFIGS = {
    "rotary, a window of 4 on layer 0": dict(attention_windows=(4, 0)),
    "relative bias": dict(position_encoding="relative_bias", num_kv_heads=4),
    "learned, scanned, windows": dict(position_encoding="learned", scan_layers=True,
                                      attention_windows=(4, 0)),
    # (capacity dispatch: a decoding step's group is one token, which no capacity drops)
    "experts, capacity 0.5": dict(moe_every=1, moe=MoEConfig(
        num_experts=4, top_k=2, expert_d_ff=32, group_size=8, capacity_factor_eval=0.5)),
}


def _paths(config: TransformerConfig, lengths, temperature: float, prefill_length: int = 16):
    """The continuations of random prompts of `lengths` (in rows of 24) by the token loop and
    by prefill, and the cache index after the prefill."""
    model = DecoderLM(config)
    rows = len(lengths)
    ids = jnp.ones((rows, 24), jnp.int32)
    params = {"params": model.init(jax.random.key(1), ids, jnp.ones_like(ids),
                                   jnp.broadcast_to(jnp.arange(24), ids.shape))["params"]}
    lengths = jnp.asarray(lengths)
    prompts = jnp.asarray(np.random.default_rng(0).integers(2, 64, (rows, 24)), jnp.int32)
    prompts = jnp.where(jnp.arange(24)[None] < lengths[:, None], prompts, 0)

    def step(ids, cache):
        logits, v = model.apply({**params, "cache": cache}, ids, method=model.decode_step,
                                mutable=["cache"])
        return logits, v["cache"]

    filled = {}

    def prefill(ids, counts, cache):
        _, v = model.apply({**params, "cache": cache}, ids, counts, method=model.prefill,
                           mutable=["cache"])
        filled["index"] = v["cache"]["decode_index"]["index"]
        return v["cache"]

    cache = empty_cache(model, (), rows, 24)
    run = lambda **kw: jax.jit(lambda: decoding.sample(  # noqa: E731
        step, cache, prompts, 10, jax.random.key(3), temperature, eos_id=-1,
        prompt_lengths=lengths, **kw))()
    loop = run()
    once = jax.jit(lambda: (decoding.sample(
        step, cache, prompts, 10, jax.random.key(3), temperature, eos_id=-1,
        prompt_lengths=lengths, prefill=prefill, prefill_length=prefill_length),
        filled["index"]))()
    return loop, once[0], once[1]


FAST = {("rotary, a window of 4 on layer 0", 0.0)}
# Each model once, greedy and sampled twice each: `decoding.sample` reads the prompt (one
# pass or a token a step) whatever the temperature, which only chooses the next token from
# the logits (the same draw, keyed by row and position, in both paths); the other four
# combinations compiled the same prefills again.
CASES = [*FAST, ("experts, capacity 0.5", 1.0), ("relative bias", 1.0),
         ("learned, scanned, windows", 0.0)]


@pytest.mark.parametrize("name,temperature", [
    (n, t) if (n, t) in FAST else pytest.param(n, t, marks=pytest.mark.slow)
    for n, t in sorted(CASES, key=lambda c: list(CONFIGS).index(c[0]))])
def test_prefill_gives_the_tokens_of_the_token_loop(name, temperature):
    """Prompts of 9, 3, 0 and 20 ids (past the window; 20 past the 16 positions prefilled:
    its last 4 are read a token a step)."""
    config = TransformerConfig(**{**BASE, **CONFIGS[name]})
    loop, once, index = _paths(config, [9, 3, 0, 20], temperature)
    np.testing.assert_array_equal(index, [9, 3, 0, 16])
    np.testing.assert_array_equal(once, loop)
    assert len(set(np.asarray(loop)[0, 9:19].tolist())) > 1  # (a continuation, not a stutter)


@pytest.mark.slow  # (the kernels in Pallas's interpreter or emulated; the fast tier: einsum)
@pytest.mark.parametrize("kernel", ["splash", "triton"])
def test_the_flash_kernels_run_the_prefill_under_layouts(kernel, monkeypatch):
    """`attention='flash'`: the prefill runs the kernel (a decoding step keeps einsum):
    splash (TPU, interpreted here) on one device and on batch:4;model:2, Triton (GPU,
    interpreted: `accelerators`) on one device; the continuations of `Generator` are the
    token loop's. (cuDNN takes bfloat16 only, in which two paths' tokens may part on another
    CPU; the prefill calls it as training does, which test_flash_attention checks.)"""
    import accelerators

    calls = {"triton": accelerators.triton_interpreted}.get(kernel, lambda m: None)(monkeypatch)
    config = TransformerConfig(**{**BASE, "vocab_size": 128, "max_length": 32},
                               attention="flash", flash_kernel=kernel,
                               mlp_activations=("silu", "linear"))
    prompts = ["5 6 7", "9", "3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "20 21"]
    outputs = []
    layouts = [("", "")] + ([("batch:4;model:2", "batch:batch;heads:model")]
                            if kernel == "splash" else [])
    for mesh_shape, rules in layouts:
        layout = Layout(mesh_shape, rules)
        trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adafactor(1e-3),
                          layout=layout, mesh=layout.make_mesh(jax.devices()[:layout.size]),
                          batch_size=4, sequence_length=32, seed=3)
        params = trainer.init_state().params
        for prefill in (True, False):
            generator = generation.Generator(trainer, _Vocab(), DecodingConfig(prefill=prefill))
            outputs.append(generator(params, prompts))
            if calls is not None:  # the prefill called the kernel; the token loop did not
                assert bool(calls) == prefill, (kernel, calls)
                calls.clear()
        assert generator.prefill_length([3, 1, 18, 2]) == 0
        assert generation.Generator(trainer, _Vocab(), DecodingConfig()).prefill_length(
            [3, 1, 18, 2]) == 32
    assert all(o == outputs[0] for o in outputs[1:]), outputs


class _Vocab:
    vocab_size, eos_id = 120, 1

    def encode(self, text):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(str(i) for i in ids if i != self.eos_id)


ORACLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                       "shared", "oracles")


@pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
@pytest.mark.parametrize("family", ["mistral_sw", pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow),
                                    pytest.param("llama3", marks=pytest.mark.slow)])
def test_prefill_gives_hugging_faces_greedy_ids(tmp_path, family):
    """Imported (Mistral's window, Qwen3-MoE's dropless experts, Gemma's sliding and global
    layers, Llama 3's scaled rotary), the prompt prefilled then decoded greedily."""
    import test_oracles

    test_oracles.import_folder(os.path.join(ORACLES, family), tmp_path / "m")
    exp, params, _ = test_oracles.load(tmp_path / "m")
    model, expected = exp.trainer.model, test_oracles.oracle(family)
    prompt, greedy = list(expected["prompt_ids"]), list(expected["greedy_ids"])
    total = len(greedy)
    prompts = jnp.asarray([prompt[1:] + [0] * (total - len(prompt) + 1)], jnp.int32)

    def step(ids, cache):
        logits, v = model.apply({"params": params, "cache": cache}, ids,
                                method=model.decode_step, mutable=["cache"])
        return logits, v["cache"]

    def prefill(ids, counts, cache):
        return model.apply({"params": params, "cache": cache}, ids, counts,
                           method=model.prefill, mutable=["cache"])[1]["cache"]

    out = decoding.sample(step, empty_cache(model, (), 1, total), prompts,
                          total - len(prompt), None, eos_id=-1, start_id=prompt[0],
                          prompt_lengths=jnp.asarray([len(prompt) - 1]), prefill=prefill)
    assert [prompt[0]] + np.asarray(out)[0, :total - 1].tolist() == greedy


def test_the_planner_counts_prefill_and_decoding():
    """The roofline of generation for a told prompt length (`planning.inference`): the
    prefill is compute for its tokens, a step reads every weight and the cache, the first
    token comes sooner prefilled, a longer prompt costs more of both; the plan's text says
    it; --prompt_length goes with --mode=plan."""
    from mtrain.__main__ import main
    from mtrain.planning import inference, planner
    from mtrain.parallel.targets import TARGETS

    config = TransformerConfig(**{**BASE, "max_length": 2048, "d_model": 1024, "d_ff": 4096,
                                  "num_heads": 16, "d_kv": 64, "num_layers": 4})
    layout = Layout("batch:2", "batch:batch")
    h100 = TARGETS["h100"]
    weights = 4 * 60 * 2**20  # (float32, about as many as its 59M parameters)
    short, long = (inference.estimate(config, layout, h100, 8, 2048, p, weights)
                   for p in (128, 1024))
    assert short["new_tokens"] == 1920 and long["prompt_length"] == 1024
    assert short["decode_step_seconds"] >= weights / h100.hbm_bandwidth
    assert short["tokens_per_second"] == pytest.approx(8 / short["decode_step_seconds"])
    for e in (short, long):
        assert e["prefill_seconds"] < e["time_to_first_token"] < e["token_loop_time_to_first_token"]
    assert long["prefill_seconds"] > short["prefill_seconds"]
    assert long["token_loop_time_to_first_token"] > 7 * short["token_loop_time_to_first_token"]
    trainer = Trainer(model=DecoderLM(TransformerConfig(**BASE)),
                      optimizer=optimizer.adafactor(1e-3), layout=layout,
                      mesh=layout.make_mesh(jax.devices()[:2]), batch_size=4, sequence_length=24)
    p = planner.plan(trainer, h100, prompt_length=8)
    assert p.inference["prompt_length"] == 8 and p.inference["new_tokens"] == 16
    assert "inference (--prompt_length 8, then 16 new tokens, batch 4)" in planner.format_plan(p)
    assert main(["--mode=infer", "--gin_file=quickstart.gin", "--prompt_length=8"]) == 2
