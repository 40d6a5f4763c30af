"""Every command-line mode with the attention an accelerator runs, on this CPU.

- The paths compared: on one float32 checkpoint (trained with einsum), 'dot_product' (the
  call a GPU's cuDNN gets, with the packed mask; XLA here), splash and tokamax's Triton
  kernel (Pallas interpret mode, the latter behind an emulated GPU: `accelerators`) give
  einsum's BLEU and decodes exactly, its translations, and its scores to float32 rounding
  (sums of the same terms in another order: rtol 1e-5).
- What a TPU runs (`attention='auto'` there: splash, with bfloat16 activations) and what a
  Hopper GPU runs ('auto' there: cuDNN, its packed layout with a table fitted to each batch,
  emulated here) go through every mode: train (with evaluation, and BLEU for translation),
  eval, infer (translation), score and plan, each from the checkpoint the last one left.

The models attend within a sliding window of 8 positions (``transformer.attention_windows``,
the rows are 32 long) with logits scaled by 0.5 (``transformer.attention_scale``), so that
every path's own window and scale are what is compared, decoding's ring cache included.
"""

import json
import math
import shutil

import pytest

from mtrain.__main__ import main
from mtrain.data.bible import bible_split_verses

from accelerators import on_a_hopper_gpu_emulated, triton_interpreted
from tiny_config import TINY

LAYOUT = "layouts/dp4_mp2.gin"
TASKS = {
    "lm": ("tasks/bible_lm.gin", ["run.eval_split='test'"]),
    "translation": ("tasks/bible_enfr.gin", [
        "vocabulary.size=300", "run.eval_split='test'", "decoding.num_examples=8",
        "decoding.max_decode_length=8", "decoding.beam_size=2"]),
}
PATHS = {  # name -> (gin bindings, emulate a GPU for tokamax's kernel)
    "dot_product": (["transformer.attention='dot_product'"], False),
    "splash": (["transformer.attention='flash'", "transformer.flash_kernel='splash'"], False),
    "triton": (["transformer.attention='flash'", "transformer.flash_kernel='triton'"], True),
}
BF16 = "run.activation_dtype='bfloat16'"
WINDOWED = ["transformer.attention_windows=(8,)", "transformer.attention_scale=0.5"]


def cli(task, model_dir, *params, mode=None, extra=()):
    gin_file, task_params = TASKS[task]
    argv = [f"--gin_file={gin_file}", f"--gin_file={LAYOUT}", f"--model_dir={model_dir}"]
    argv += [f"--gin_param={p}" for p in [*TINY, *task_params, *WINDOWED, "run.train_steps=4",
                                          "run.log_every=2", "run.checkpoint_every=2", *params]]
    return main(argv + ([f"--mode={mode}"] if mode else []) + list(extra))


def records(model_dir):
    with open(model_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def last(model_dir, key):
    return [r for r in records(model_dir) if key in r][-1]


def lines_for(task, tmp_path):
    """A file of lines to score, and (translation) one to translate."""
    verses = bible_split_verses("test")[:6]
    score = tmp_path / "score.txt"
    score.write_text("".join((f"{v.en}\t{v.fr}" if task == "translation" else v.en) + "\n"
                             for v in verses), encoding="utf-8")
    source = tmp_path / "source.txt"
    source.write_text("".join(v.en + "\n" for v in verses), encoding="utf-8")
    return score, source


def outputs(task, model_dir, tmp_path, name, *params, ran=lambda mode: None):
    """What eval, score and infer write with `params` on the model dir's checkpoint;
    `ran(mode)` is called after each."""
    assert cli(task, model_dir, *params, mode="eval") == 0
    ran("eval")
    evaluated = last(model_dir, "eval/loss")
    score_file, source = lines_for(task, tmp_path)
    scores = tmp_path / f"scores-{name}.jsonl"
    assert cli(task, model_dir, *params, mode="score",
               extra=[f"--input_file={score_file}", f"--output_file={scores}"]) == 0
    ran("score")
    result = {"eval": evaluated,
              "scores": [json.loads(line) for line in scores.read_text().splitlines()]}
    if task == "translation":
        result["decodes"] = (model_dir / "decodes" / "test-4.tsv").read_text(encoding="utf-8")
        translated = tmp_path / f"translated-{name}.txt"
        assert cli(task, model_dir, *params, mode="infer",
                   extra=[f"--input_file={source}", f"--output_file={translated}"]) == 0
        ran("infer")
        result["infer"] = translated.read_text(encoding="utf-8")
    return result


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """task -> a model dir trained 4 steps with einsum in float32 (once a task: each test
    process trains what its tests ask for)."""
    runs = {}

    def run(task):
        if task not in runs:
            runs[task] = tmp_path_factory.mktemp(task) / "run"
            assert cli(task, runs[task], "transformer.attention='einsum'") == 0
        return runs[task]
    return run


# Translation only: its encoder (not causal), decoder (causal, packed) and cross-attention
# run every path with the window and scale, through eval, score, BLEU's decodes and infer;
# the LM's decoder is that decoder's self-attention (the same layer and settings: the CPU
# time of comparing it again through the command line went; its model with flash against
# einsum: test_flash_attention's test_flash_trains_like_einsum_on_the_mesh).
@pytest.mark.slow
@pytest.mark.parametrize("task", ["translation"])
def test_every_attention_path_gives_the_einsum_results(trained, tmp_path, monkeypatch, task):
    model_dir = trained(task)
    expected = outputs(task, model_dir, tmp_path, "einsum", "transformer.attention='einsum'")
    for name, (params, emulated) in PATHS.items():
        with monkeypatch.context() as m:
            calls = triton_interpreted(m) if emulated else []
            got = outputs(task, model_dir, tmp_path, name, *params)
        if emulated:
            assert calls and set(calls) == {"triton"}, calls
        metrics = {k for k in expected["eval"] if k.startswith("eval/") and k != "eval/bleu_signature"}
        for key in metrics:
            assert got["eval"][key] == pytest.approx(expected["eval"][key], rel=1e-5), (name, key)
        assert len(got["scores"]) == len(expected["scores"])
        for row, ref in zip(got["scores"], expected["scores"]):
            assert row["log_likelihood"] == pytest.approx(ref["log_likelihood"], rel=1e-5), name
            assert row["tokens"] == ref["tokens"]
        if task == "translation":
            assert got["eval"]["eval/bleu"] == expected["eval"]["eval/bleu"], name
            assert got["decodes"] == expected["decodes"], name
            assert got["infer"] == expected["infer"], name


# Every task once and every accelerator once, plus the translation on the Hopper GPU (the
# only case whose decoding, BLEU and infer, runs cuDNN's masked kernel). The LM on the TPU
# went: the translation on the TPU runs splash in bfloat16 through every mode the LM has
# (train, eval, score, plan) and more, its decoder the LM's layer.
@pytest.mark.slow
@pytest.mark.parametrize("task, accelerator", [
    ("lm", "hopper gpu"), ("translation", "tpu"), ("translation", "hopper gpu")])
def test_every_mode_runs_with_the_accelerators_attention(trained, tmp_path, monkeypatch,
                                                         task, accelerator):
    model_dir = tmp_path / "run"
    shutil.copytree(trained(task), model_dir)
    if accelerator == "tpu":
        params, calls = ["transformer.attention='flash'", "transformer.flash_kernel='splash'"], []
    else:
        params, calls = [], on_a_hopper_gpu_emulated(monkeypatch)  # 'auto' is flash there

    def ran(mode):
        """On the Hopper GPU, the kernels each mode traced: where batches are placed
        (training, evaluation, scoring), cuDNN's packed layout with a table fitted to each
        batch of packed rows (the LM's text), its causal kernel with no mask for rows of one
        example each (scoring's, the translations' pairs); the masked kernel where they are
        not placed (a translation's encoder in decoding: BLEU and infer; and the parameters'
        initialisation) and for the attention that is not causal self-attention."""
        kinds = {c if isinstance(c, str) else c[0] for c in calls}
        calls.clear()
        if accelerator == "tpu":
            return
        packed = task == "lm" and mode in ("train", "eval")
        needed = {"cudnn"} if mode == "infer" else {"cudnn_causal"} | (
            {"cudnn_segments"} if packed else set())
        assert needed <= kinds, (mode, kinds)

    params += [BF16, "run.train_steps=6", "run.eval_every=0"]
    assert cli(task, model_dir, *params) == 0  # from the checkpoint of step 4
    ran("train")
    trained_records = [r for r in records(model_dir) if r["step"] == 6]
    assert any("train/loss" in r for r in trained_records)
    evaluated = [r for r in trained_records if "eval/loss" in r]
    assert evaluated and math.isfinite(evaluated[-1]["eval/loss"])
    if task == "translation":
        assert 0 <= evaluated[-1]["eval/bleu"] <= 100
    got = outputs(task, model_dir, tmp_path, accelerator, *params, ran=ran)
    assert got["eval"]["step"] == 6 and math.isfinite(got["eval"]["eval/loss"])
    assert all(r["log_likelihood"] < 0 for r in got["scores"])
    if task == "translation":
        assert got["infer"].count("\n") == 6
    assert cli(task, model_dir, *params, mode="plan") == 0
