"""lm-evaluation-harness requests/s: mtrain's backend (`mtrain.evaluation.harness`, ``--model
mtrain``) against lm-eval's own Hugging Face backend (``--model hf``, torch), on the same CPU,
model and requests, with the ratio mtrain/hf (above 1: mtrain is faster).

A folder of ../shared/oracles (``--model llama3|qwen2``: a tiny random Llama 3 / Qwen2, float32)
is imported into a temporary model dir for mtrain (``python -m mtrain --mode=import``); the hf
backend reads the folder itself (``HFLM(pretrained=<folder>, dtype=float32, device=cpu)``).
lm-eval builds the requests once, from the oracle's local tasks (`TaskManager` and
``task.build_all_requests`` in a temporary copy of its ``tasks/`` and ``data/``):

- loglikelihood: kjv_next_verse, multiple choice with acc_mutual_info (40 docs x 8 requests);
- loglikelihood_rolling: kjv_psalms_rolling (21 documents, some of several 512-id windows);
- generate_until: kjv_genesis_greedy (21 prompts, greedy, at most 16 new ids).

Each backend's request method (``lm.loglikelihood(instances)``, ...) is called directly on the
same `Instance`s: once cold (mtrain's jit compiles, a program per length bucket and prefill
bucket; torch's first calls), then ``--repeats`` more times, the two backends taking turns
so that a busy spell of a shared machine slows both; req/s is of the fastest of those passes
(steady state; tokenizing the requests is part of what is timed, loading the model is not).
Both backends take ``--batch_size`` requests a batch. Torch runs ``torch.set_num_threads(
--threads)`` (default: every core); XLA's CPU backend uses every core (not set here). On a
shared machine torch's threads suffer most from other jobs (an OpenMP barrier waits for a
descheduled thread): ``--threads 1`` is how the oracle ran lm-eval, and the steadier figure.
The two backends' answers are compared (the largest |log-likelihood difference|, equal greedy
flags and generations), so that they cannot do different work unnoticed.

Needs torch and transformers (lm-eval's ``hf`` extra) besides mtrain's ``eval`` extra:

    pip install -e '.[eval]' 'lm-eval[hf]'
    python benchmarks/lm_eval.py [--model llama3|qwen2] [--batch_size 8] [--threads N] \\
        [--repeats 3] [--oracles ../shared/oracles]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

# (this file is lm_eval.py: its folder, first on sys.path, would hide the lm_eval package)
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = (("loglikelihood", "kjv_next_verse"), ("loglikelihood_rolling", "kjv_psalms_rolling"),
         ("generate_until", "kjv_genesis_greedy"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama3", "qwen2"), default="llama3")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch.set_num_threads (default: every core)")
    p.add_argument("--repeats", type=int, default=3,
                   help="steady-state passes of each backend, taking turns (the fastest counts)")
    p.add_argument("--oracles", default=os.path.join(REPO, "..", "shared", "oracles"))
    return p.parse_args(argv)


def build_requests(oracle: str) -> dict[str, list]:
    """lm-eval's `Instance`s of each request type, made in a copy of the oracle's tasks."""
    from lm_eval.tasks import TaskManager

    here = os.getcwd()
    with tempfile.TemporaryDirectory() as work:
        for name in ("tasks", "data"):
            shutil.copytree(os.path.join(oracle, name), os.path.join(work, name))
        os.chdir(work)  # (data_files are relative to the working directory)
        try:
            tasks = TaskManager(include_path="tasks").load([t for _, t in TASKS])["tasks"]
            out = {}
            for kind, name in TASKS:
                tasks[name].build_all_requests(limit=None, rank=0, world_size=1)
                out[kind] = [i for i in tasks[name].instances for _ in range(i.repeats)]
        finally:
            os.chdir(here)
    return out


def timed(lm, kind: str, instances) -> tuple[list, float]:
    """`lm`'s answers to `instances` of request type `kind` and the seconds they took."""
    start = time.perf_counter()
    out = getattr(lm, kind)(instances, disable_tqdm=True)
    return out, time.perf_counter() - start


def compare(backends: dict, kind: str, instances, repeats: int) -> dict:
    """{backend: (answers, cold seconds, steady seconds)}: a cold pass of each, then
    `repeats` rounds in turn (a busy spell of a shared machine hits both), the fastest."""
    cold = {name: timed(lm, kind, instances) for name, lm in backends.items()}
    steady = {name: [] for name in backends}
    for _ in range(repeats):
        for name, lm in backends.items():
            steady[name].append(timed(lm, kind, instances)[1])
    return {name: (*cold[name], min(steady[name])) for name in backends}


def difference(kind: str, hf, mt) -> str:
    """How far the two backends' answers are apart."""
    if kind == "loglikelihood":
        worst = max(abs(a[0] - b[0]) for a, b in zip(hf, mt))
        greedy = sum(a[1] == b[1] for a, b in zip(hf, mt))
        return f"max |dLL| {worst:.1e}, greedy equal {greedy}/{len(hf)}"
    if kind == "loglikelihood_rolling":
        return f"max |dLL| {max(abs(a - b) for a, b in zip(hf, mt)):.1e}"
    return f"generations equal {sum(a == b for a, b in zip(hf, mt))}/{len(hf)}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import transformers  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401  (the hf backend)
    except ImportError as e:
        print(f"benchmarks/lm_eval.py needs torch, transformers and lm-eval[hf] ({e.name} is "
              f"missing): pip install -e '.[eval]' 'lm-eval[hf]'", file=sys.stderr)
        return 1
    import jax
    from lm_eval.api.registry import get_model

    import mtrain.harness_cli  # noqa: F401  (registers "mtrain" with lm-eval)

    folder = os.path.join(args.oracles, args.model)
    oracle = os.path.join(args.oracles, "lm_eval")
    if not os.path.isdir(folder) or not os.path.isdir(oracle):
        print(f"no {folder} or {oracle} (--oracles)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # (its notes on each task's metrics)
    requests = build_requests(oracle)
    with tempfile.TemporaryDirectory() as model_dir:
        imported = subprocess.run([sys.executable, "-m", "mtrain", "--mode=import",
                                   f"--input_dir={folder}", f"--model_dir={model_dir}"],
                                  capture_output=True, text=True)
        if imported.returncode:
            print(f"importing {folder} failed:\n{imported.stderr}", file=sys.stderr)
            return 1
        # (as lm-eval's command line makes them: --model NAME --model_args ... --batch_size B)
        backends = {name: get_model(name).create_from_arg_string(
            model_args, {"batch_size": args.batch_size, "device": "cpu"}) for name, model_args in
            (("hf", f"pretrained={folder},dtype=float32"), ("mtrain", f"model_dir={model_dir}"))}
        results = {kind: compare(backends, kind, instances, args.repeats)
                   for kind, instances in requests.items()}

    print(f"{args.model}: batch {args.batch_size}, {os.cpu_count()} cores, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__} "
          f"({jax.default_backend()}); steady state: the fastest of {args.repeats} passes after "
          f"the cold one")
    print(f"{'request type':>22s} {'requests':>8s} {'hf cold s':>9s} {'mtrain cold s':>13s} "
          f"{'hf req/s':>9s} {'mtrain req/s':>12s} {'mtrain/hf':>9s}  agreement")
    row = "{:>22s} {:8d} {:9.2f} {:13.2f} {:9.1f} {:12.1f} {:9.2f}  {}"
    for kind, instances in requests.items():
        (hf, hf_cold, hf_s), (mt, mt_cold, mt_s) = results[kind].values()
        n = len(instances)
        print(row.format(kind, n, hf_cold, mt_cold, n / hf_s, n / mt_s, hf_s / mt_s,
                         difference(kind, hf, mt)))
    (hf_cold, hf_s), (mt_cold, mt_s) = (
        [sum(r[name][i] for r in results.values()) for i in (1, 2)] for name in backends)
    n = sum(len(i) for i in requests.values())
    print(row.format("total", n, hf_cold, mt_cold, n / hf_s, n / mt_s, hf_s / mt_s, "").rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
