"""GRPO (`training.grpo`, `evaluation.rollouts`) against TRL 1.16's `GRPOTrainer`
(../shared/oracles/grpo: `llama_gqa`, full and with the `lora_llama_gqa` adapter, two steps
of each of seven settings): the oracle's prompts, completions and rewards fed to
``--mode=train`` as rollouts from a file (``files.format='rollouts'``), on one device and
in ``batch:4;model:2``; the logged loss, KL, clip ratios, entropy and gradient norm, and the
SGD updates of the exported checkpoints, are TRL's.

Tolerances (ORACLE.md): the advantages, loss and KL recomputed from the oracle's arrays
within 1e-6 (what another float32 implementation of the formula meets); recomputed from
the weights, the log-probabilities move by ~1e-6 (RoPE over TRL's left padding, float32
sums in another order), so the loss, KL and entropy within 1e-5 absolute (each an average
of O(1) terms of those log-probabilities), the gradient norm and updates within 1e-5
relative to their largest element (float32 gradients summed in another order: the
oracle's own torch recomputation agrees to 9e-7) plus the rounding of an update read as the
difference of two float32 weights (two spacings of the weight), the clip ratios exactly
(shares of 126 tokens: no ratio lies within 1e-5 of a clip bound).
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from test_oracles import ORACLES

from mtrain.__main__ import main
from mtrain.training import grpo

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
GRPO = os.path.join(ORACLES, "grpo")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
RUNS = sorted(f[:-4] for f in os.listdir(GRPO) if f.endswith(".npz")) if os.path.isdir(
    GRPO) else []
SPLIT = ["run.mesh_shape='batch:4;model:2'",
         "run.layout_rules='batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model'"]


def oracle(run: str) -> dict:
    return dict(np.load(os.path.join(GRPO, f"{run}.npz")))


def config_of(d: dict) -> grpo.GrpoConfig:
    return grpo.GrpoConfig(num_generations=int(d["num_generations"]),
                           max_completion_length=int(d["max_completion_length"]),
                           loss=str(d["loss_type"]), beta=float(d["beta"]),
                           num_iterations=int(d["num_iterations"]),
                           epsilon=float(d["epsilon"]), epsilon_high=float(d["epsilon_high"]))


def logged(d: dict, step: int) -> dict:
    return json.loads(str(d["logs_json"]))[step - 1]


@pytest.mark.parametrize("run", RUNS)
def test_the_formula_is_trls_on_its_own_arrays(run):
    """From the oracle's log-probabilities and rewards: the advantages, the loss (each
    normalisation), the KL, the clip ratios and the entropy TRL logged, within 1e-6."""
    d = oracle(run)
    c = config_of(d)
    assert c.loss == ("dapo" if "default" in run else c.loss)
    for s in (1, 2):
        p = f"s{s}_"
        np.testing.assert_allclose(grpo.advantages(d[p + "rewards"], c.num_generations),
                                   d[p + "advantages"], atol=1e-6)
        mask = jnp.asarray(d[p + "completion_mask"], jnp.float32)
        logps = jnp.asarray(d[p + "per_token_logps"])
        old = jnp.asarray(d.get(p + "old_per_token_logps", d[p + "per_token_logps"]))
        ref = jnp.asarray(d[p + "ref_per_token_logps"]) if c.beta else None
        adv = jnp.asarray(d[p + "advantages"])[:, None] * jnp.ones_like(mask)
        per_token, rho, k3 = grpo.token_losses(logps, old, ref, adv, c)
        loss, count = grpo.aggregate(per_token, mask, c)
        assert float(loss / count) == pytest.approx(float(d[p + "loss"]), abs=1e-6)
        means = grpo.token_means(grpo.token_statistics(
            rho, k3, jnp.asarray(d[p + "entropies"]), adv, mask, c))
        want = logged(d, s)
        for key in grpo.TOKEN_SUMS:
            if key in want:  # (beta 0 logs no kl)
                assert float(means[key]) == pytest.approx(want[key], abs=1e-6, rel=1e-6), key


def rollouts_file(d: dict, path) -> None:
    """The oracle's generations as a rollouts file: a record per group, the prompt's ids
    ([bos] + its pieces) and each completion's up to and including its EOS."""
    steps = [1, 2] if int(d["num_iterations"]) == 1 else [1]  # (mu 2: step 2 reuses 1's)
    group = int(d["num_generations"])
    with open(path, "w") as f:
        for s in steps:
            p = f"s{s}_"
            for first in range(0, len(d[p + "rewards"]), group):
                ids = lambda key, r: [int(i) for i, m in zip(d[p + key + "_ids"][r],  # noqa: E731
                                                             d[p + key + "_mask"][r]) if m]
                rows = range(first, first + group)
                f.write(json.dumps({"prompt": ids("prompt", first),
                                    "completions": [ids("completion", r) for r in rows],
                                    "rewards": [float(d[p + "rewards"][r]) for r in rows]})
                        + "\n")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The oracle's policies imported once: 'full' (llama_gqa) and 'lora' (+ the adapter)."""
    root = tmp_path_factory.mktemp("grpo_imports")
    for name, more in (("full", []), ("lora", [f"--adapter_dir={ORACLES}/lora_llama_gqa"])):
        assert main(["--mode=import", f"--input_dir={ORACLES}/llama_gqa",
                     f"--model_dir={root / name}", *more]) == 0
    return root


def grpo_flags(d: dict, model_dir, rollouts, data_dir, *params: str) -> list[str]:
    """TRL's settings of the oracle (ORACLE.md) as a user writes them."""
    settings = [
        "run.task=@task()", "task.data=@files()", f"files.train='{rollouts}'",
        "files.format='rollouts'", "run.batch_size=16", "run.sequence_length=32",
        "run.train_steps=2", "run.log_every=1", "run.checkpoint_every=1",
        f"run.data_dir='{data_dir}'", "run.optimizer=@sgd",
        "learning_rate_schedule.shape='constant'", "learning_rate_schedule.warmup_steps=1",
        f"learning_rate_schedule.constant={float(d['learning_rate'])}",
        f"grpo.num_generations={int(d['num_generations'])}",
        f"grpo.max_completion_length={int(d['max_completion_length'])}",
        f"grpo.loss='{d['loss_type']}'", f"grpo.beta={float(d['beta'])}",
        f"grpo.num_iterations={int(d['num_iterations'])}", *params]
    return [f"--model_dir={model_dir}", *[f"--gin_param={p}" for p in settings]]


def exported(model_dir, step: int, out, adapter: bool) -> dict:
    assert main(["--mode=export", f"--model_dir={model_dir}", f"--checkpoint_step={step}",
                 f"--output_dir={out}", *(["--adapter"] if adapter else [])]) == 0
    return load_file(os.path.join(out, "adapter_model.safetensors" if adapter
                                  else "model.safetensors"))


def hf_name(name: str, lora: bool) -> str:
    """The oracle's name of a tensor as an export writes it (PEFT's without the adapter's
    own name)."""
    return name.replace(".default", "") if lora else name


FAST = {("full_default_beta0.04_mu2", "one_device"), ("lora_default_beta0.04_mu2", "split")}


@pytest.mark.parametrize("run, layout", [
    pytest.param(run, layout, id=f"{run}-{layout}",
                 marks=() if (run, layout) in FAST else pytest.mark.slow)
    for run in RUNS for layout in ("one_device", "split")])
def test_rollouts_from_a_file_take_trls_steps(imported, tmp_path, run, layout):
    """Two steps of each oracle run from its generations (`rollouts_file`), through the
    command line as a user runs them (the import as run.init_from): TRL's logged numbers,
    and its updates in the checkpoints exported after each step."""
    d, lora = oracle(run), bool(oracle(run)["lora"])
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts_file(d, rollouts)
    model_dir = tmp_path / "m"
    start = imported / ("lora" if lora else "full")
    args = [f"--gin_file={start}/config.gin", *grpo_flags(
        d, model_dir, rollouts, tmp_path / "data", f"run.init_from='{start}'",
        *(SPLIT if layout == "split" else []))]
    if layout == "split":  # (this process simulates 8 devices)
        assert main(args) == 0
    else:  # one device: a process of its own
        done = subprocess.run([sys.executable, "-m", "mtrain", "--cpu_devices=1", *args],
                              capture_output=True, text=True, env=ENV)
        assert done.returncode == 0, done.stderr[-2000:]
    with open(model_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    before = (load_file(f"{ORACLES}/lora_llama_gqa/adapter_model.safetensors") if lora else
              load_file(f"{ORACLES}/llama_gqa/model.safetensors"))
    for s, record in zip((1, 2), records):
        want = logged(d, s)
        assert record["step"] == s
        for key in ("loss", "kl", "entropy"):
            if key in want:
                assert record[f"train/{key}"] == pytest.approx(want[key], abs=1e-5), (s, key)
        assert record["train/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert record[f"train/{key}"] == pytest.approx(want[key], abs=1e-6), (s, key)
        assert record["train/reward"] == pytest.approx(float(d[f"s1_rewards" if s == 2 and int(
            d["num_iterations"]) == 2 else f"s{s}_rewards"].mean()), abs=1e-6)
        after = exported(model_dir, s, tmp_path / f"export{s}", lora)
        for key in (k for k in d if k.startswith(f"s{s}_update.")):
            name = hf_name(key[len(f"s{s}_update."):], lora)
            got = after[name] - before[name]
            # each update is a difference of float32 weights: rounded to their spacing, in
            # TRL's and in ours (ulp(|w|) ~6e-8 for these O(1) weights, more than 1e-5 of
            # the largest update, ~1e-3)
            rounding = 2 * np.spacing(np.abs(after[name]).astype(np.float32))
            far = np.abs(got - d[key]) > 1e-5 * np.abs(d[key]).max() + rounding
            assert not far.any(), (s, name, np.abs(got - d[key]).max())
        before = after
