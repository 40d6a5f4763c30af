"""DPO (`training.dpo`) against TRL's numbers (../shared/oracles/dpo: `llama_gqa` as the
reference, `llama_gqa` + the `lora_llama_gqa` adapter as the policy, beta 0.1): the pairs'
format and packing (`data.preference.Preference`), the first step's loss and rewards, training
raising the reward accuracy, a full fine-tune's frozen copy as the reference across a
resume, and bad pair files refused in one line.

Tolerance 1e-4: the oracle's per-pair log-probabilities are sums of ~25 float32 token
log-probabilities of O(1) logits (test_oracles: logits within 1e-4, the reference moving by
~2e-6); the loss and rewards are beta (0.1) times their differences.
"""

import dataclasses
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from model_dirs import digest
from test_oracles import ORACLES, import_folder

from mtrain.__main__ import main
from mtrain.data import preference
from mtrain.data.lanes import PackWindow, Stream
from mtrain.data.vocabulary import load_vocabulary
from mtrain.models.base import LOSS_WEIGHTS, READ_INPUTS

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
PAIRS = os.path.join(ORACLES, "dpo", "dpo_llama_gqa.jsonl")
ATOL = 1e-4


def oracle() -> dict:
    return dict(np.load(os.path.join(ORACLES, "dpo", "dpo_llama_gqa.npz")))


def ragged(d, name):
    offsets, values = d[f"{name}_offsets"], d[f"{name}_flat"]
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def records():
    with open(PAIRS) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("dpo") / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir,
                  f"--adapter_dir={os.path.join(ORACLES, 'lora_llama_gqa')}")
    return model_dir


def dpo_flags(model_dir, tmp_path, *more, pairs=PAIRS):
    """Train on the oracle's three pairs: one row of 144 holds exactly them (137 targets;
    the shortest pair has 43), so that every batch is the three pairs."""
    return [f"--gin_file={model_dir}/config.gin", f"--model_dir={model_dir}",
            "--gin_param=run.mesh_shape='batch:1;model:8'",
            "--gin_param=run.layout_rules='batch:batch;d_ff:model;vocab:model'",
            "--gin_param=run.task=@task()", "--gin_param=task.data=@files()",
            f"--gin_param=files.train='{pairs}'", f"--gin_param=files.validation='{pairs}'",
            "--gin_param=files.format='preference'", "--gin_param=run.batch_size=1",
            "--gin_param=run.sequence_length=144", "--gin_param=run.log_every=1",
            "--gin_param=run.data_workers=0", f"--gin_param=run.data_dir='{tmp_path / 'data'}'",
            *more]


def metrics(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_pairs_are_encoded_as_trl_makes_them_and_packed_in_halves(adapted):
    """Each half is [bos] + prompt + completion + [eos] as the oracle's ids; packed, a
    pair's halves are segments 2k - 1 and 2k of one row, each read from position 0."""
    want = oracle()
    vocab = load_vocabulary(os.path.join(adapted, "vocabulary.model"))
    fmt = preference.Preference()
    encoded = fmt.encode(records(), vocab)
    (values, splits), (read, _) = encoded.keys["targets"], encoded.keys[READ_INPUTS]
    for k, (chosen, rejected) in enumerate(zip(ragged(want, "chosen_ids"),
                                               ragged(want, "rejected_ids"))):
        pair = slice(splits[k], splits[k + 1])
        assert values[pair].tolist() == chosen[1:] + rejected[1:]
        assert read[pair].tolist() == chosen[:-1] + rejected[:-1]
        prompt = int(want["prompt_lens"][k])
        marks = [0] * (prompt - 1) + [preference.CHOSEN] * (len(chosen) - prompt) \
            + [preference.REJECTED_PROMPT] * (prompt - 1) \
            + [preference.REJECTED] * (len(rejected) - prompt)
        assert encoded.weights[pair].tolist() == marks
    rows = PackWindow([Stream("pairs", [records()[i] for i in (0, 1, 2)], fmt)], vocab, 144,
                      with_inputs=True)(np.arange(3))
    segments, positions = rows["targets_segment_ids"][0], rows["targets_positions"][0]
    assert len(rows["targets"]) == 1 and sorted(set(segments.tolist())) == [0, 1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert positions[segments == s].tolist() == list(range((segments == s).sum()))
    # the chosen halves hold the chosen marks alone, the rejected halves the rejected ones
    weights = rows[LOSS_WEIGHTS][0]
    assert set(weights[segments % 2 == 1].tolist()) == {0, preference.CHOSEN}
    assert set(weights[(segments > 0) & (segments % 2 == 0)].tolist()) == {
        preference.REJECTED_PROMPT, preference.REJECTED}


def test_long_pairs_keep_the_start_of_each_half(adapted):
    vocab = load_vocabulary(os.path.join(adapted, "vocabulary.model"))
    pair = {"prompt": "In the beginning", "chosen": " God created the heaven" * 6,
            "rejected": " and the earth" * 3}
    fmt = preference.Preference()
    encoded = fmt.encode([pair, {**pair, "prompt": "word " * 40}], vocab)
    keys, kept = preference.pieces(encoded, 40)
    assert kept.tolist() == [0]  # the second pair's prompt fills its halves: dropped
    values, splits = keys["targets"]
    weights = keys[LOSS_WEIGHTS][0]
    full = encoded.keys["targets"][0][encoded.keys["targets"][1][0]:
                                      encoded.keys["targets"][1][1]]
    chosen = int(np.sum(np.isin(encoded.weights[:len(full)], [0, preference.CHOSEN])))
    rejected = len(full) - chosen
    assert splits.tolist() == [0, 40]
    kept_chosen = 40 - rejected if 40 - rejected > 20 else 20
    assert values.tolist() == (full[:kept_chosen].tolist()
                               + full[chosen:chosen + 40 - kept_chosen].tolist())
    assert (weights == preference.CHOSEN).any() and (weights == preference.REJECTED).any()


def test_conversational_pairs_mark_the_answer_after_the_prompt():
    """TRL's conversational form: the prompt's messages rendered with the generation prompt
    (no mark), then each completion's assistant tokens (marked), by the model's template."""
    from mtrain.data.chat import ChatTemplate
    from mtrain.huggingface import families
    from mtrain.huggingface.vocabulary import chat_template, folder_vocabulary

    folder = os.path.join(ORACLES, "qwen2")
    vocab = folder_vocabulary(folder, families.settings(families.read_config(folder)))
    template = ChatTemplate(chat_template(folder), vocab)
    prompt = [{"role": "user", "content": "Who created the heaven?"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "God did."}],
              "rejected": "The waters."}
    encoded = preference.Preference(template=template).encode([record], vocab)
    head = template.prompt(prompt)
    ids, mask = template.encode(prompt + record["chosen"])
    n = len(ids) - 1
    assert encoded.keys["targets"][0][:n].tolist() == ids[1:]
    assert encoded.weights[:len(head) - 1].tolist() == [0] * (len(head) - 1)
    assert encoded.weights[len(head) - 1:n].tolist() == mask[len(head):]
    rejected = template.encode(prompt + [{"role": "assistant", "content": "The waters."}])[0]
    assert encoded.keys["targets"][0][n:].tolist() == rejected[1:]
    # the same pair with its prompt as "messages"
    again = preference.Preference(template=template).encode(
        [{"messages": prompt, **{k: record[k] for k in ("chosen", "rejected")}}], vocab)
    assert again.keys["targets"][0].tolist() == encoded.keys["targets"][0].tolist()


@pytest.mark.slow  # (its sibling in the fast tier: test_dpo_steps_on_the_trainer)
def test_dpo_takes_trls_first_step_and_raises_the_reward_accuracy_on_every_layout(tmp_path):
    """The policy (the import with its adapter) against the reference (the base without
    it: the same parameters, no copy): the first step's logged loss and rewards are TRL's
    (logged before its update: the optimizer's choice does not enter them). 30 steps on
    the three pairs: from there to every pair preferred, and the held-out pairs (here the
    same three) evaluated at the end with the trained parameters; the losses are the same
    with the model split and with its parameters stored split (FSDP)."""
    want = oracle()
    runs, evaluations = {}, {}
    import_folder(os.path.join(ORACLES, "llama_gqa"), tmp_path / "import",
                  f"--adapter_dir={os.path.join(ORACLES, 'lora_llama_gqa')}")
    for name, layout in (("model_parallel", ()),
                         ("fsdp", ("run.layout_rules='batch:batch'",
                                   "run.parameter_layout_rules='d_model:model'"))):
        model_dir = tmp_path / name / "m"
        shutil.copytree(tmp_path / "import", model_dir)
        assert main(dpo_flags(model_dir, tmp_path / name, *(f"--gin_param={x}" for x in layout),
                              "--gin_param=run.train_steps=30", "--gin_param=run.optimizer=@adamw",
                              "--gin_param=learning_rate_schedule.constant=0.01",
                              "--gin_param=learning_rate_schedule.shape='constant'",
                              "--gin_param=learning_rate_schedule.warmup_steps=1")) == 0
        runs[name] = [m for m in metrics(model_dir) if "train/loss" in m]
        (evaluations[name],) = [m for m in metrics(model_dir) if "eval/loss" in m]
    one = runs["model_parallel"]
    train = one[0]
    assert train["train/loss"] == pytest.approx(float(want["loss"]), abs=ATOL)
    assert train["train/rewards_chosen"] == pytest.approx(want["rewards_chosen"].mean(), abs=ATOL)
    assert train["train/rewards_rejected"] == pytest.approx(want["rewards_rejected"].mean(),
                                                            abs=ATOL)
    assert train["train/reward_accuracy"] == pytest.approx(float(want["reward_accuracy"]))
    assert train["train/logps_chosen"] == pytest.approx(want["policy_chosen"].mean(), abs=1e-3)
    assert one[0]["train/reward_accuracy"] < 0.5 and one[-1]["train/reward_accuracy"] == 1.0
    assert one[-1]["train/loss"] < 0.5 * one[0]["train/loss"]
    evaluation = evaluations["model_parallel"]
    assert evaluation["step"] == 30 and evaluation["eval/num_pairs"] == 3
    # evaluated after the last step, on the same pairs: its update lowered their loss
    assert evaluation["eval/loss"] < one[-1]["train/loss"]
    np.testing.assert_allclose([m["train/loss"] for m in runs["fsdp"]],
                               [m["train/loss"] for m in one], rtol=2e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.extended
def test_full_fine_tuning_dpo_resumes_against_its_starting_copy(tmp_path, capsys):
    """Without adapters the reference is a frozen copy of the parameters the run started
    from: the first loss is log 2 (policy = reference), and the run resumed from its
    checkpoint of step 2 (that of step 4 lost, as if stopped after step 2) reloads that
    copy from the import, taking steps 3 and 4 as the unbroken run did."""
    model_dir = tmp_path / "m"
    import_folder(os.path.join(ORACLES, "llama_gqa"), model_dir)
    flags = dpo_flags(model_dir, tmp_path, "--gin_param=run.train_steps=4",
                      "--gin_param=run.checkpoint_every=2",
                      "--gin_param=run.trainable='layer_1/.*'",
                      "--gin_param=run.optimizer=@adamw",
                      "--gin_param=learning_rate_schedule.constant=0.01",
                      "--gin_param=learning_rate_schedule.warmup_steps=1")
    assert main(flags) == 0
    unbroken = [m for m in metrics(model_dir) if "train/loss" in m]
    assert [m["step"] for m in unbroken] == [1, 2, 3, 4]
    assert unbroken[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert unbroken[-1]["train/loss"] < unbroken[0]["train/loss"]
    shutil.rmtree(model_dir / "checkpoints" / "4")
    capsys.readouterr()
    assert main(flags) == 0
    assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
    resumed = [m for m in metrics(model_dir) if "train/loss" in m]
    assert [m["train/loss"] for m in resumed] == [m["train/loss"] for m in unbroken]


@pytest.mark.parametrize("line, message", [
    ({"prompt": "And God said,", "chosen": " Let there be light."}, "no 'rejected' in this record"),
    ({"prompt": "And God said,", "chosen": " Let there be light.", "rejected": "  "},
     "'rejected' is empty"),
])
def test_a_bad_pair_file_is_one_line(adapted, tmp_path, capsys, line, message):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in [*records(), line]))
    unchanged = digest(adapted)
    capsys.readouterr()
    assert main(dpo_flags(adapted, tmp_path, "--gin_param=run.train_steps=1", pairs=pairs)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and message in lines[-1] and f"{pairs} line 4" in lines[-1], lines
    assert digest(adapted) == unchanged
    assert not os.path.exists(tmp_path / "data" / "prepared") or not any(
        p.name.endswith("preparing") for p in (tmp_path / "data" / "prepared").iterdir())


def test_the_losses_of_the_options():
    """`dpo.losses` on the oracle's log-probabilities: TRL's per-pair sigmoid losses; with
    label smoothing s the conservative loss, and IPO's on per-token averages."""
    import jax.numpy as jnp

    from mtrain.training import dpo

    want = oracle()
    policy = jnp.stack([want["policy_chosen"], want["policy_rejected"]], -1)[None]
    reference = jnp.stack([want["reference_chosen"], want["reference_rejected"]], -1)[None]
    counts = jnp.asarray([[[3.0, 5.0]] * 3])
    loss, stats, pairs = dpo.losses(policy, reference, counts, dpo.DpoConfig(beta=0.1))
    assert pairs == 3 and float(loss) / 3 == pytest.approx(float(want["loss"]), abs=1e-6)
    assert float(stats["reward_accuracy"]) == pytest.approx(3 * float(want["reward_accuracy"]))
    h = (want["policy_chosen"] - want["policy_rejected"]) - (
        want["reference_chosen"] - want["reference_rejected"])
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    smoothed = -(0.9 * np.log(sigmoid(0.1 * h)) + 0.1 * np.log(sigmoid(-0.1 * h)))
    loss, _, _ = dpo.losses(policy, reference, counts, dpo.DpoConfig(0.1, label_smoothing=0.1))
    assert float(loss) == pytest.approx(smoothed.sum(), rel=1e-5)
    per_token = (want["policy_chosen"] - want["reference_chosen"]) / 3 - (
        want["policy_rejected"] - want["reference_rejected"]) / 5
    loss, _, _ = dpo.losses(policy, reference, counts, dpo.DpoConfig(0.1, loss="ipo"))
    assert float(loss) == pytest.approx(((per_token - 5.0) ** 2).sum(), rel=1e-5)
    # a slot without a pair (no chosen targets) counts for nothing
    loss, _, pairs = dpo.losses(policy, reference, counts.at[0, 1].set(0.0), dpo.DpoConfig())
    assert pairs == 2
    with pytest.raises(Exception, match="dpo.loss='hinge'"):
        dpo.DpoConfig(loss="hinge")


def pair_rows(rows, length, half=4, prompt=1, seed=0):
    """Packed rows of pairs as `preference.split_pairs` leaves them: halves of `half`
    targets, each its first `prompt` unmarked."""
    k = np.arange(length) // half
    prompt_part = np.arange(length) % half < prompt
    weights = np.where(k % 2 == 0, np.where(prompt_part, 0, preference.CHOSEN),
                       np.where(prompt_part, preference.REJECTED_PROMPT, preference.REJECTED))
    tokens = np.random.default_rng(seed).integers(1, 50, (rows, length)).astype(np.int32)
    return {"targets": tokens, READ_INPUTS: np.roll(tokens, 1, axis=1),
            "targets_segment_ids": np.broadcast_to(k + 1, tokens.shape).astype(np.int32),
            "targets_positions": np.broadcast_to(np.arange(length) % half,
                                                 tokens.shape).astype(np.int32),
            LOSS_WEIGHTS: np.broadcast_to(weights, tokens.shape).astype(np.int32)}


@pytest.mark.slow  # (about 60 s)
def test_dpo_steps_on_the_trainer():
    """On the trainer: a policy that is its reference (fresh adapters, B zero; a full
    model and its copy; dropout off, as TRL's) starts at log 2 with zero rewards; steps
    lower the loss; a model-parallel layout with microbatches gives the losses of one
    device."""
    from test_trainer import CONFIG, L

    from mtrain.models.lora import LoraConfig

    from mtrain.training import optimizer
    from mtrain.training.dpo import DpoConfig, Preference
    from mtrain.training.trainer import Trainer

    # (dropout in the model and the adapters: DPO's policy runs without, as TRL's)
    lora_config = dataclasses.replace(CONFIG, lora=LoraConfig(rank=4, alpha=8.0, dropout=0.1))

    def run(mesh="", rules="", config=lora_config, trainable="lora", micro=1, steps=3):
        from mtrain.models.lora import is_adapter
        from mtrain.models.transformer import DecoderLM
        from mtrain.parallel.layout import Layout

        layout = Layout(mesh, rules)
        trainer = Trainer(model=DecoderLM(config), optimizer=optimizer.adamw(1e-2), layout=layout,
                          mesh=layout.make_mesh(jax.devices()[:layout.size]), batch_size=8,
                          sequence_length=L, seed=3, trainable=is_adapter if trainable else None,
                          num_microbatches=micro, objective=Preference(DpoConfig(beta=0.5)))
        trainer.lower_train_step()  # (what --mode=plan compiles: no copy made, no batch)
        state = trainer.init_state()
        assert trainer.objective.reference.is_base == bool(trainable)
        if trainer.objective.needs_start:
            trainer.objective.set_start(state.params)
        out = []
        for _ in range(steps):
            state, metrics = trainer.train_step(state, trainer.place_batch(pair_rows(8, L)))
            out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        return out

    lora = run()
    assert lora[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert lora[0]["rewards_chosen"] == 0 and lora[0]["reward_margin"] == 0
    assert lora[-1]["loss"] < lora[0]["loss"]
    split = run("batch:4;model:2", "batch:batch;d_ff:model;heads:model;vocab:model", micro=2)
    np.testing.assert_allclose([m["loss"] for m in split], [m["loss"] for m in lora],
                               rtol=1e-4, atol=1e-6)
    full = run(config=CONFIG, trainable=None, steps=2)
    assert full[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert full[1]["loss"] < full[0]["loss"]
