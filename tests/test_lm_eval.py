"""mtrain's lm-evaluation-harness model (`mtrain.evaluation.harness`) against what lm-eval
0.4.13's own Hugging Face backend computed on the same imported folders
(../shared/oracles/lm_eval: five local tasks, one per request type, on `llama3` and `qwen2`,
with and without ``--apply_chat_template``; every sample logged, every request's ids kept).

Tolerances: a request's log-likelihood is a float32 sum of up to 512 float32 log-probabilities
on both sides (the oracle's are float32 sums, a rolling document's several of them), so two
correct sums differ by their rounding: 1e-4 absolute (the per-token error of float32 logits,
as the oracles' README says) plus 2 float32 ulps (2.4e-7 relative) of the sum. Accuracies
and exact matches are counts: equal. Perplexities (exponentials of such sums' means) and
bits per byte: 1e-5 relative.
"""

import json
import os
import shutil

import pytest

from test_oracles import ORACLES, import_folder, load

lm_eval = pytest.importorskip("lm_eval")
from mtrain.data.chat import ChatTemplate  # noqa: E402
from mtrain.evaluation import harness_requests as requests_lib  # noqa: E402
from mtrain.huggingface import families  # noqa: E402
from mtrain.huggingface.vocabulary import chat_template, folder_vocabulary  # noqa: E402

ORACLE = os.path.join(ORACLES, "lm_eval")
pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLE), reason="no ../shared/oracles/lm_eval")
TASKS = ("kjv_next_verse", "kjv_psalms_rolling", "kjv_genesis_greedy", "kjv_exodus_last_word",
         "kjv_genesis_stops")


def _vocabulary(name):
    folder = os.path.join(ORACLES, name)
    return folder_vocabulary(folder, families.settings(families.read_config(folder)))


def _tokens(result, task):
    with open(os.path.join(ORACLE, "results", result, f"tokens_{task}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _samples(result, task):
    with open(os.path.join(ORACLE, "results", result, f"samples_{task}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-4 + 2.4e-7 * abs(want)


@pytest.mark.parametrize("result", ["llama3", "qwen2", "llama3_chat", "qwen2_chat"])
def test_requests_become_the_ids_and_texts_of_the_hf_backend(result):
    """The encoding (BOS or not, a rendered chat's BOS not doubled), the rolling windows and
    the rows they are scored in, and the generations' stop rule and text, on every request
    the oracle kept."""
    name = result.split("_")[0]
    vocab = _vocabulary(name)
    prefix = requests_lib.prefix_id(vocab)
    assert prefix == {"llama3": 507, "qwen2": 493}[name]
    for doc in _tokens(result, "kjv_psalms_rolling"):
        (request,) = doc["requests"]
        assert request["prefix_token_id"] == prefix and request["max_length"] == 512
        rows = requests_lib.rolling_rows(request["token_ids"], prefix, 512)
        assert len(rows) == len(request["windows"])
        for row, window in zip(rows, request["windows"]):
            whole = (window["context_ids"] + window["continuation_ids"])[-513:]
            assert list(row.inputs) == whole[:-1] and list(row.targets) == whole[1:]
            assert list(row.targets[len(row) - row.scored:]) == window["continuation_ids"]
    stopped = 0
    for task in ("kjv_genesis_greedy", "kjv_genesis_stops"):
        samples = _samples(result, task)
        for doc, sample in zip(_tokens(result, task), samples):
            (request,) = doc["requests"]
            context = sample["arguments"]["gen_args_0"]["arg_0"]
            ids = requests_lib.encode(vocab, context, prefix)
            assert ids[-(512 - 16):] == request["input_ids"]
            new = request["generated_ids"]
            # What came after a stop does not change what was kept.
            longer = new + [new[-1]] * (16 - len(new)) if len(new) < 16 else new
            assert requests_lib.kept_ids(vocab, longer, request["stop"]) == new
            stopped += len(new) < 16
            text = requests_lib.generated_text(vocab, longer, request["stop"])
            assert text == request["text"] == sample["resps"][0][0]
    assert stopped >= 7  # (the stops task ends early often: the stop rule is exercised)


def test_a_rendered_chat_gets_no_second_bos():
    vocab = _vocabulary("llama3")
    template = ChatTemplate(chat_template(os.path.join(ORACLES, "llama3")), vocab)
    text = template.render([{"role": "user", "content": "In the beginning"}], True)[0]
    assert text.startswith("<|begin_of_text|>")
    ids = requests_lib.encode(vocab, text, 507)
    assert ids[0] == 507 and ids[1] != 507
    assert requests_lib.encode(vocab, "In", 507)[0] == 507  # (a plain text gets one)
    assert requests_lib.encode(_vocabulary("qwen2"), "In", 493)[0] != 493  # (Qwen's none)


# ---- the model through lm-eval (slow: each run is five tasks, 15-20 s) ----


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_imports")
    for name in ("llama3", "qwen2"):
        import_folder(os.path.join(ORACLES, name), root / name)
    return root


@pytest.fixture()
def tasks_dir(tmp_path, monkeypatch):
    """The oracle's tasks and data in a folder of the test's (the YAMLs' data files are
    relative to the working directory, as lm-eval reads them), the working directory."""
    for part in ("tasks", "data"):
        shutil.copytree(os.path.join(ORACLE, part), tmp_path / part)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "tasks"


def check_against_oracle(out: dict, result: str, tasks=TASKS) -> None:
    """Every sample's responses and every task metric as the hf backend's (module doc)."""
    want = json.load(open(os.path.join(ORACLE, "results", result, "results.json")))["results"]
    for task in tasks:
        got = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        expected = _samples(result, task)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert [list(a) for a in g["arguments"]] == [
                list(a.values()) for a in e["arguments"].values()]
            for (mine,), (theirs,) in zip(g["resps"], e["resps"]):
                if task == "kjv_psalms_rolling":
                    assert _close(float(mine), float(theirs)), (task, g["doc_id"])
                elif isinstance(theirs, str):
                    assert mine == theirs, (task, g["doc_id"])
                else:
                    assert _close(float(mine[0]), float(theirs[0])), (task, g["doc_id"])
                    assert str(mine[1]) == theirs[1], (task, g["doc_id"])
        for metric, value in want[task].items():
            if not isinstance(value, float) or "stderr" in metric:
                continue
            mine = out["results"][task][metric]
            if metric.startswith(("acc", "exact_match")):  # (counts of examples)
                assert mine == pytest.approx(value, abs=1e-12), (task, metric)
            else:  # perplexities, bits per byte
                assert abs(mine - value) <= 1e-5 * value, (task, metric)


@pytest.fixture(scope="module")
def one_device_lm(imported):
    """name -> lm-eval's model of its import loaded on one device (the import's mesh: this
    process has 8 devices), built once for the module: a model's runs with and without its
    chat template share it, and the programs its scorer and generators compiled. Its
    config.gin is parsed again at each call, as a fresh load parses it."""
    from mtrain import run as run_lib
    from mtrain.data.user_data import model_dir_template
    from mtrain.evaluation.harness import Model, MtrainLM

    lms = {}

    def lm_of(name):
        if name not in lms:
            exp, params, vocab = load(imported / name)
            lms[name] = MtrainLM(model=Model(
                trainer=exp.trainer, params=params, vocab=vocab,
                template=model_dir_template(str(imported / name), vocab), rows=8,
                max_length=512))
        else:
            run_lib.parse_config([os.path.join(imported / name, "config.gin")], [])
        return lms[name]

    return lm_of


@pytest.mark.slow
@pytest.mark.parametrize("result,mesh", [  # (llama3's runs with and without its chat
    # template on one device, which share their programs; qwen2's with it, split, its query,
    # key and value biases split too: a split run compiles its own. qwen2's plain run: its
    # requests' ids and texts in the test above, its model in the chat run)
    ("llama3", None), pytest.param("llama3_chat", None, marks=pytest.mark.extended),
    ("qwen2_chat", "batch:4;model:2")])
def test_every_sample_as_lm_evals_hf_backend(imported, one_device_lm, tasks_dir, result,
                                              mesh):
    """lm-eval's `simple_evaluate` with mtrain's model on the import: each sample's
    log-likelihoods, greedy flags and generations, and the task metrics, as the hf backend
    computed them; on one device and split over batch:4;model:2 (heads, d_ff, vocab and
    key/value heads split, batches of 8 rows over 4 batch shards)."""
    name, chat = result.split("_")[0], result.endswith("_chat")
    if mesh:  # lm-eval's model_args, as its command line gives them
        rules = "batch:batch;d_ff:model;heads:model;vocab:model;kv_heads:model"
        from mtrain.harness_cli import ModelArgsLM

        lm = ModelArgsLM(model_dir=str(imported / name), batch_size=8, mesh_shape=mesh,
                         layout_rules=rules)
    else:  # a loaded model (the import's one-device mesh: this process has 8 devices)
        lm = one_device_lm(name)
    assert lm.prefix_token_id == {"llama3": 507, "qwen2": 493}[name]  # (the model's start_id)
    assert lm.scorer.trainer.mesh.size == (8 if mesh else 1)
    assert lm.scorer.trainer.layout.ways("batch") == (4 if mesh else 1)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(TASKS), task_manager=lm_eval.tasks.TaskManager(
            include_path=str(tasks_dir)), log_samples=True, apply_chat_template=chat,
        bootstrap_iters=0)
    check_against_oracle(out, result)


@pytest.mark.slow
def test_sampled_generations_are_the_seeds_and_stop_at_the_stop_strings(imported):
    """generate_until with do_sample: the same seed gives the same texts (the k-th batch's
    key is fold_in(seed, k)), another seed others, greedy others still; every text is cut
    before its stop strings; requests of two kinds of kwargs go in their own batches."""
    from lm_eval.api.instance import Instance

    from mtrain.evaluation.harness import Model, MtrainLM

    exp, params, vocab = load(imported / "qwen2")
    prompts = ["In the beginning God created", "And God said, Let there be", "Genesis 1:3",
               "The LORD is my shepherd"]
    sampled = {"until": ["th", "\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    greedy = {"until": ["th", "\n"], "max_gen_toks": 12, "do_sample": False}

    def generate(seed, kwargs_of=lambda i: sampled):
        lm = MtrainLM(model=Model(trainer=exp.trainer, params=params, vocab=vocab, rows=4,
                                  max_length=512, seed=seed))
        return lm.generate_until([
            Instance(request_type="generate_until", doc={}, arguments=(p, kwargs_of(i)),
                     idx=i) for i, p in enumerate(prompts)], disable_tqdm=True)

    first, again, other = generate(0), generate(0), generate(1)
    assert first == again and first != other
    mixed = generate(0, lambda i: sampled if i % 2 else greedy)
    assert mixed != first and mixed[0] == generate(0, lambda i: greedy)[0]
    for text in first + other + mixed:
        assert "th" not in text and "\n" not in text


@pytest.mark.slow
def test_length_buckets_and_the_cpu_cap_score_the_same(imported):
    """Rows padded to four lengths a doubling, and split into calls of fewer rows where a
    call would hold more attention scores than `scores_per_call` (the CPU's cap): the same
    sums and greedy flags as one call a batch (float32 sums of the same terms: 1e-4)."""
    import random

    from mtrain.evaluation.harness_requests import Row
    from mtrain.evaluation.harness_scoring import Scorer

    exp, params, _ = load(imported / "qwen2")
    whole = Scorer(exp.trainer, rows=8, max_length=512)
    capped = Scorer(exp.trainer, rows=8, max_length=512, scores_per_call=2 * 128 ** 2)
    assert [whole.bucket(n) for n in (3, 17, 64, 65, 129, 500, 512)] == [
        16, 24, 64, 80, 160, 512, 512]
    assert (capped.per_call(64), capped.per_call(128), capped.per_call(512)) == (8, 2, 1)
    rng = random.Random(0)
    rows = []
    for n in (5, 40, 70, 130, 300, 511, 20, 90, 250, 512, 33):
        ids = [rng.randrange(496) for _ in range(n + 1)]
        rows.append(Row.of(ids[:n // 2 + 1], ids[n // 2 + 1:], 512))
    got, want = capped(params, rows), whole(params, rows)
    assert [g for _, g in got] == [g for _, g in want]
    for (a, _), (b, _) in zip(got, want):
        assert abs(a - b) <= 1e-4 + 2.4e-7 * abs(b)
