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
import re
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


@pytest.mark.slow
@pytest.mark.parametrize("run, layout", [  # (each run on one layout, LoRA's on both: every
    # loss, beta and num_iterations one device and split; the 7 x 2 product took minutes)
    pytest.param(run, layout, id=f"{run}-{layout}") for run in RUNS for layout in (
        ("one_device", "split") if run.startswith("lora") else ("one_device",) if run in (
            "full_default_beta0.04_mu1", "full_dr_grpo_beta0.04_mu1", "full_grpo_beta0.04_mu2")
        else ("split",))])
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


# ---- prompts and rollouts as the user's files bring them ----

def flags_for(imported, tmp_path, train, fmt="prompts", *params):
    d = oracle("full_default_beta0.04_mu2")
    return [f"--gin_file={imported / 'full'}/config.gin", *grpo_flags(
        d, tmp_path / "m", train, tmp_path / "data", f"run.init_from='{imported / 'full'}'",
        f"files.format='{fmt}'", "grpo.rewards=[@matches()]", "matches.pattern='a'",
        *SPLIT, *params)]


def slow(*case):
    return pytest.param(*case, marks=pytest.mark.slow)


ONE_PROMPT = ['{"prompt": "In the"}']


@pytest.mark.parametrize("fmt, lines, params, message", [
    ("prompts", ['{"prompt": "In the"}', '["not", "an object"]'], [],
     r"prompts.jsonl line 2: not a JSON object"),
    slow("prompts", ['{"question": "In the"}'], [],
         r"prompts.jsonl:1: a prompts record is a JSON object with a 'prompt' field"),
    slow("prompts", ['{"prompt": 7}'], [], r"prompts.jsonl:1: a prompt must be a text"),
    ("rollouts", ['{"prompt": "a", "completions": ["b"], "rewards": [1]}'], [],
     r"prompts.jsonl:1: 1 completions and 1 rewards; grpo.num_generations is 4"),
    slow("rollouts", ['{"prompt": "a", "completions": ["b", "c", "d", "e"], '
                      '"rewards": [1, 0, 1, "x"]}'], [],
         r"prompts.jsonl:1: each reward must be a finite number"),
    ("prompts", ONE_PROMPT, ["grpo.loss='ppo'"],
     r"grpo.loss='ppo'; use one of dapo, grpo, dr_grpo"),
    slow("prompts", ONE_PROMPT, ["grpo.num_generations=1"],
         r"grpo.num_generations must be at least 2"),
    slow("prompts", ONE_PROMPT, ["grpo.num_generations=5"],
         r"run.batch_size=16 is not a whole number of groups of grpo.num_generations=5"),
    slow("prompts", ONE_PROMPT, ["grpo.max_completion_length=32"],
         r"grpo.max_completion_length=32 leaves no room for a prompt"),
    ("prompts", ONE_PROMPT, ["grpo.rewards=[]"], r"name at least one \(grpo.rewards"),
    slow("prompts", ONE_PROMPT, ["grpo.rewards=['nowhere.f']"],
         r"grpo.rewards: cannot load 'nowhere.f'"),
    slow("prompts", ONE_PROMPT, ["matches.pattern='('"],
         r"matches.pattern='\(' is not a regular expression"),
])
def test_bad_prompts_and_settings_are_one_line(imported, tmp_path, capsys, fmt, lines,
                                               params, message):
    """Each stops the run in one line on stderr, non-zero, before a step is saved."""
    train = tmp_path / "prompts.jsonl"
    train.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(flags_for(imported, tmp_path, train, fmt, *params)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 3 and re.search(message, err[-1]), err
    assert not (tmp_path / "m" / "checkpoints" / "1").exists()


def test_grpo_needs_a_model_to_improve(tmp_path, capsys):
    train = tmp_path / "prompts.jsonl"
    train.write_text('{"prompt": "In the"}\n')
    assert main(["--gin_file=configs/models/lm_tiny.gin", f"--model_dir={tmp_path / 'm'}",
                 "--gin_param=run.task=@task()", "--gin_param=task.data=@files()",
                 f"--gin_param=files.train='{train}'", "--gin_param=files.format='prompts'",
                 f"--gin_param=run.data_dir='{tmp_path / 'data'}'",
                 "--gin_param=grpo.rewards=[@matches()]", "--gin_param=run.batch_size=8",
                 "--gin_param=run.mesh_shape='batch:8'",
                 "--gin_param=run.layout_rules='batch:batch'"]) != 0
    assert "GRPO improves a model that exists" in capsys.readouterr().err


@pytest.mark.slow
def test_a_reward_that_raises_in_training_stops_the_run_in_one_line(imported, tmp_path,
                                                                     capsys):
    """A user's reward that fails on the first step's completions: one error line naming it
    and the example, no traceback, a non-zero exit, no checkpoint of a step."""
    (tmp_path / "flaky.py").write_text("def reward(record, completions):\n"
                                       "    return [1 / 0 for _ in completions]\n")
    train = tmp_path / "prompts.jsonl"
    train.write_text('{"prompt": "In the", "answer": 3}\n')
    capsys.readouterr()
    assert main(flags_for(imported, tmp_path, train, "prompts",
                          f"grpo.rewards=['{tmp_path / 'flaky.py'}:reward']")) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err
    assert re.search(r"reward reward raised ZeroDivisionError on .*prompts.jsonl:1: division "
                     r"by zero", errors[0])
    assert not (tmp_path / "m" / "checkpoints" / "1").exists()


@pytest.mark.slow
def test_conversations_are_prompted_by_the_chat_template(tmp_path, capsys):
    """TRL's conversational prompts on an import with a chat template (Qwen2.5's ChatML):
    each is rendered with its generation prompt and its completions end at the end of turn;
    a run trained in the import's own model dir takes its steps and logs TRL's metrics, and
    the same command again has nothing left to train."""
    from mtrain import run as run_lib
    from mtrain.data.user_data import model_dir_template

    model_dir = tmp_path / "qwen"
    assert main(["--mode=import", f"--input_dir={ORACLES}/qwen2",
                 f"--model_dir={model_dir}"]) == 0
    train = tmp_path / "chats.jsonl"
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Who said: let there be light?"}]
    train.write_text(json.dumps({"prompt": messages, "answer": "God"}) + "\n")
    params = ["run.task=@task()", "task.data=@files()", f"files.train='{train}'",
              "files.format='prompts'", "run.batch_size=8", "run.sequence_length=64",
              "run.train_steps=2", "run.log_every=1", f"run.data_dir='{tmp_path / 'data'}'",
              "grpo.num_generations=4", "grpo.max_completion_length=8",
              "grpo.rewards=[@answer_after()]", "answer_after.marker=''", *SPLIT]
    run_lib.parse_config([str(model_dir / "config.gin")], params)
    exp = run_lib.build(mode="train", model_dir=str(model_dir))
    template = model_dir_template(str(model_dir), exp.vocab)
    ids, stop = exp.stepper.prompt_ids(exp.source.records[0])
    assert ids == template.prompt(messages) and stop == template.end_of_turn
    assert exp.stepper.text([*exp.vocab.encode("God"), stop], stop) == "God"
    argv = [f"--gin_file={model_dir}/config.gin", f"--model_dir={model_dir}",
            *[f"--gin_param={p}" for p in params]]
    assert main(argv) == 0
    with open(model_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward", "reward_std", "rewards/answer_after/mean", "kl", "entropy",
                "clip_ratio/region_mean", "completions/mean_length",
                "completions/clipped_ratio", "frac_reward_zero_std", "generation_share"):
        assert np.isfinite(records[-1][f"train/{key}"]), key
    assert 1 <= records[-1]["train/completions/mean_length"] <= 8
    capsys.readouterr()
    assert main(argv) == 0  # (the same command: its checkpoint is at run.train_steps)
    assert "nothing to train" in capsys.readouterr().err
    assert main(["--mode=eval", *argv]) != 0  # (its rewards are logged as it trains)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a GRPO run evaluates its rewards as it trains" in err[0], err


def test_prompt_files_as_users_write_them(tmp_path):
    """Text lines, JSON Lines with the prompt under another field (files.columns), ids and
    conversations; every other field kept for the rewards; rollouts with texts or ids.
    The iterator's prompts are a function of the step: shuffled by the seed each epoch,
    each generation's for `num_iterations` steps, and a restored iterator goes on as the
    saved one would have."""
    from mtrain.data import prompts
    from mtrain.data.prepared import Files

    (tmp_path / "a.txt").write_text("In the beginning\n\nAnd God said\n")
    lines = [{"question": "Who?", "answer": "God"}, {"question": [1, 5, 9]},
             {"question": [{"role": "user", "content": "Hi"}], "id": 3}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = prompts.read(Files(train=str(tmp_path / "a.txt"), format="prompts"), 2)
    assert [r.prompt for r in text] == ["In the beginning", "And God said"]
    assert text[1].where.endswith("a.txt:3")
    records = prompts.read(Files(train=str(tmp_path / "b.jsonl"), format="prompts",
                                 columns={"prompt": "question"}), 2)
    assert [r.prompt for r in records] == [r["question"] for r in lines]
    assert records[0].record["answer"] == "God" and records[2].record["id"] == 3
    (tmp_path / "r.jsonl").write_text(json.dumps(
        {"prompt": "a", "completions": ["b", [7, 2]], "rewards": [1, 0.5]}) + "\n")
    rollout, = prompts.read(Files(train=str(tmp_path / "r.jsonl"), format="rollouts"), 2)
    assert rollout.completions == ("b", [7, 2]) and rollout.rewards == (1.0, 0.5)

    source = prompts.PromptSource(text + records, "prompts")
    batches = prompts.PromptBatches(source, per_step=2, iterations=2, seed=1, shuffle=True)
    steps = [next(batches) for _ in range(6)]
    assert [s.generation for s in steps] == [0, 0, 1, 1, 2, 2]
    assert [s.fresh for s in steps] == [True, False] * 3
    assert steps[0].records == steps[1].records
    epoch = steps[0].records + steps[2].records + steps[4].records[:1]
    assert len({r.where for r in epoch}) == 5  # (an epoch: a permutation of the 5)
    again = prompts.PromptBatches(source, per_step=2, iterations=2, seed=1, shuffle=True)
    batches.position = 3
    batches.pending = {"x": np.arange(3)}
    batches.save(tmp_path / "state")
    again.restore(tmp_path / "state")
    resumed = next(again)
    assert (resumed.number, resumed.fresh) == (3, False)
    assert resumed.records == steps[3].records
    np.testing.assert_array_equal(resumed.pending["x"], np.arange(3))
