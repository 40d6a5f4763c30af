"""A user's JSONL corpus read, tokenised and packed, beside what a train step consumes.

Makes a JSONL corpus of --megabytes (default 200) of `{"text": ...}` documents (10 to 40
verses of the shipped King James Bible each, drawn at random), trains a SentencePiece
vocabulary of --vocabulary_size pieces on its first documents (what a run without an
import does), then measures on one core (the preparation and the packer are one thread):

* **baseline**: `json.loads` of every line and SentencePiece's batch encoding (one
  thread, as the pipeline's), nothing kept: the least any pipeline must do per token;
* **first pass**: `data.prepared.prepare`, what a run's first start does: stream the file,
  parse, tokenise, hold out 1% for validation, write the ArrayRecord cache;
* **from the cache**: `pipeline.batches` over the prepared records, as every later epoch
  and run reads them: shuffled windows cut, packed and batched at 16 x 2048 (llama_1b's
  batch), in this process (`run.data_workers=0`);

each in tokens/s per core (tokens over the process's CPU seconds; wall-clock beside it),
the ratio first pass / baseline, and, against the planner's figure for a train step of
`configs/models/llama_1b.gin` on an H100 (`--mode=plan --target=h100`, run here), how many
host cores keep one H100 fed by each path (an 8-GPU host has ~100 to 200 cores).

    python benchmarks/user_data.py [--megabytes 200] [--vocabulary_size 8000]
        [--batches 300] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=200)
    p.add_argument("--vocabulary_size", type=int, default=8000)
    p.add_argument("--batches", type=int, default=300, help="packed batches timed")
    p.add_argument("--dir", default=None, help="where the corpus goes (default: a temp dir)")
    return p.parse_args()


def make_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Writes the corpus; returns its number of documents."""
    from mtrain.data.sources import BibleLM

    verses = list(BibleLM("en").texts("train"))
    rng = np.random.default_rng(seed)
    budget, documents = int(megabytes * 2**20), 0
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < budget:
            picks = rng.integers(0, len(verses), size=(512, 40))
            sizes = rng.integers(10, 41, size=512)
            for row, n in zip(picks, sizes):
                f.write(json.dumps({"text": " ".join(verses[i] for i in row[:n])}) + "\n")
            documents += 512
    return documents


class Timer:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def baseline(path: str, vocab) -> tuple[int, Timer]:
    import itertools

    tokens = 0
    with Timer() as t, open(path, encoding="utf-8") as f:
        for block in itertools.batched(f, 1024):
            texts = [json.loads(line)["text"] for line in block]
            values, _ = vocab.encode_batch(texts, add_eos=True)
            tokens += len(values)
    return tokens, t


def planned_h100_tokens_per_second() -> float:
    """The planner's tokens/s of llama_1b's train step at 16 x 2048 on one H100."""
    out = subprocess.run([sys.executable, "-m", "mtrain", "--mode=plan", "--target=h100",
                          "--gin_file=configs/tasks/lm1b.gin",
                          "--gin_file=configs/models/llama_1b.gin"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    found = re.search(r"step ~[\d.]+ \w+, ([\d,]+) tokens/s", out.stdout + out.stderr)
    if out.returncode or not found:
        raise SystemExit(f"--mode=plan failed: {(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1).replace(",", ""))


def main():
    args = parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from mtrain.data import pipeline, prepared
    from mtrain.data.streams import Stream, Streams
    from mtrain.data.vocabulary import train_vocabulary

    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        corpus = os.path.join(work, "corpus.jsonl")
        with Timer() as t:
            documents = make_corpus(corpus, args.megabytes)
        size = os.path.getsize(corpus)
        print(f"corpus: {size / 2**20:.0f} MB, {documents:,} documents (made in {t.wall:.0f} s)")

        def first_texts(n=20000):
            with open(corpus, encoding="utf-8") as f:
                for _, line in zip(range(n), f):
                    yield json.loads(line)["text"]

        with Timer() as t:
            vocab = train_vocabulary(first_texts(), args.vocabulary_size,
                                     os.path.join(work, "spm.model"))
        print(f"vocabulary: {args.vocabulary_size} pieces trained in {t.wall:.0f} s")

        base_tokens, base = baseline(corpus, vocab)
        print(f"{size / base_tokens:.2f} bytes per token, {base_tokens:,} tokens")

        spec = prepared.Files(train=corpus, validation=0.01)
        with Timer() as first:
            source = prepared.prepare(spec, spec.make_format(), vocab,
                                      os.path.join(work, "data"), "corpus")
        splits = source.info["splits"]
        first_tokens = sum(s["tokens"] for s in splits.values())
        cache_mb = sum(os.path.getsize(os.path.join(source.directory, f))
                       for f in os.listdir(source.directory)) / 2**20

        stream = Stream("corpus", source.records("train"), source.format, 1.0,
                        source.fingerprint())
        packed = 0
        with Timer() as cached:  # (the CPU time of the pipeline's thread included)
            batches = pipeline.batches(Streams([stream]), vocab, "train", pipeline.BatchSettings(
                sequence_length=2048, batch_size=16, seed=0, train=True, workers=0))
            for _ in range(args.batches):
                batch = next(batches)
                packed += int((batch["targets_segment_ids"] > 0).sum())
        batches.close()
        fill = packed / (args.batches * 16 * 2048)

    h100 = planned_h100_tokens_per_second()
    rows = [("baseline: json.loads + SentencePiece", base_tokens, base),
            ("first pass: prepare (parse, tokenise, write)", first_tokens, first),
            ("from the cache: shuffle, cut, pack, batch", packed, cached)]
    print(f"\n{'path':48s} {'tokens':>12s} {'wall s':>8s} {'cpu s':>8s} {'tokens/s/core':>14s}"
          f" {'cores per H100':>15s}")
    rates = {}
    for name, n, t in rows:
        rates[name] = rate = n / t.cpu
        print(f"{name:48s} {n:12,d} {t.wall:8.1f} {t.cpu:8.1f} {rate:14,.0f} {h100 / rate:15.2f}")
    print(f"\nprepared cache: {cache_mb:.0f} MB for {size / 2**20:.0f} MB of JSONL; "
          f"rows filled {100 * fill:.1f}% by packing")
    print(f"llama_1b on one H100 (the planner, 16 x 2048): {h100:,.0f} tokens/s")
    first_rate = rates[rows[1][0]]
    print(f"first pass / baseline: {first_rate / rates[rows[0][0]]:.2f}; "
          f"from the cache / H100 step: {rates[rows[2][0]] / h100:.2f} per core; "
          f"first pass of this corpus on one core: {first.wall:.0f} s, "
          f"{first_tokens / h100:.0f} s of H100 training")


if __name__ == "__main__":
    main()
