"""Import and export of a Llama the size of configs/models/llama_1b.gin, in the Hugging Face
layout as published models are (random weights, bfloat16, 3 safetensors shards with the
index; the tokenizer of ../shared/oracles/llama_gqa): wall time and peak host memory (RSS,
from the kernel's accounting of each `python -m mtrain` process) of ``--mode=import`` and
``--mode=export --dtype=bfloat16``, against the size of the model and of its largest tensor.
The baseline in the same run: reading every tensor of the folder whole with the
safetensors package (flax), the least any import must do.

    python benchmarks/hf_import.py [--dir /tmp/hf_1b] [--vocab 32000] [--like llama3]

``--like llama3``: the folder as Llama 3.x ships (../shared/oracles/llama3's config.json:
rope_type llama3, its bos/eos, and its byte-level BPE tokenizer.json whose id 0 is an
ordinary piece) in place of Llama 2's (sentencepiece tokenizer.model); the same tensors.

On CPU the devices are the host: the imported parameters (float32, twice the bfloat16
file) live in the same process's memory, so the RSS of an import is at least the model in
float32; what the import adds on top of that is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLES = os.path.join(ROOT, "..", "shared", "oracles")


def llama_folder(path: str, vocab: int, shards: int = 3,
                 like: str = "llama_gqa") -> tuple[int, int]:
    """Writes the folder; returns (bytes of weights, bytes of the largest tensor)."""
    from mtrain.huggingface import tensors

    d, f, h, kv, k, layers = 2048, 5504, 16, 4, 128, 16
    shapes = [("model.embed_tokens.weight", (vocab, d)), ("lm_head.weight", (vocab, d)),
              ("model.norm.weight", (d,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (d,)),
                   (p + "post_attention_layernorm.weight", (d,)),
                   (p + "self_attn.q_proj.weight", (h * k, d)),
                   (p + "self_attn.k_proj.weight", (kv * k, d)),
                   (p + "self_attn.v_proj.weight", (kv * k, d)),
                   (p + "self_attn.o_proj.weight", (d, h * k)),
                   (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                   (p + "mlp.down_proj.weight", (d, f))]
    total = sum(2 * int(np.prod(s)) for _, s in shapes)
    rng = np.random.default_rng(0)

    def produce():
        for name, shape in shapes:
            scale = 1.0 if len(shape) == 1 else shape[1] ** -0.5
            yield name, (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16)

    os.makedirs(path)
    tensors.write_folder(path, shapes, ml_dtypes.bfloat16, produce, -(-total // shards))
    oracle = os.path.join(ORACLES, like)
    config = json.load(open(os.path.join(oracle, "config.json")))
    config |= {"hidden_size": d, "intermediate_size": f, "num_attention_heads": h,
               "num_key_value_heads": kv, "head_dim": k, "num_hidden_layers": layers,
               "vocab_size": vocab, "max_position_embeddings": 2048, "dtype": "bfloat16",
               "tie_word_embeddings": False}
    json.dump(config, open(os.path.join(path, "config.json"), "w"), indent=2)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        if os.path.exists(os.path.join(oracle, name)):
            shutil.copy(os.path.join(oracle, name), path)
    return total, max(2 * int(np.prod(s)) for _, s in shapes)


_PEAK = "import resource, sys; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"


def child(code: str) -> tuple[float, float]:
    """(seconds, the child's own peak RSS in GB) of python `code`."""
    start = time.time()
    run = subprocess.run([sys.executable, "-c", f"{code}\n{_PEAK}"], cwd=ROOT,
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"failed: {code}\n{run.stderr[-2000:]}")
    return time.time() - start, int(run.stderr.strip().splitlines()[-1]) / 2**20


def timed(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GB) of `python -m mtrain argv` in a child process."""
    return child(f"from mtrain.__main__ import main; assert main({argv!r}) == 0")


def baseline(path: str) -> tuple[float, float]:
    return child("import glob; from safetensors.flax import load_file\n"
                 f"[load_file(f) for f in sorted(glob.glob('{path}/*.safetensors'))]")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/mtrain_hf_1b")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--like", default="llama_gqa", choices=["llama_gqa", "llama3"],
                   help="the oracle folder whose config.json and tokenizer the folder takes")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, model_dir, out = (os.path.join(args.dir, n) for n in ("hf", "model", "exported"))
    start = time.time()
    size, largest = llama_folder(hf, args.vocab, like=args.like)
    print(f"folder: {size / 1e9:.2f} GB of bfloat16 in 3 shards (largest tensor "
          f"{largest / 1e9:.3f} GB), written in {time.time() - start:.0f} s")
    read_s, read_rss = baseline(hf)
    print(f"safetensors.flax reads it whole: {read_s:.1f} s, peak RSS {read_rss:.2f} GB")
    import_s, import_rss = timed(["--mode=import", f"--input_dir={hf}", f"--model_dir={model_dir}"])
    print(f"--mode=import: {import_s:.1f} s, peak RSS {import_rss:.2f} GB (float32 parameters "
          f"{2 * size / 1e9:.2f} GB), {import_s / read_s:.2f}x the whole read")
    export_s, export_rss = timed(["--mode=export", f"--model_dir={model_dir}",
                                  f"--output_dir={out}", "--dtype=bfloat16"])
    print(f"--mode=export --dtype=bfloat16: {export_s:.1f} s, peak RSS {export_rss:.2f} GB")
    written = sorted(os.listdir(out))
    print("exported:", ", ".join(written))


if __name__ == "__main__":
    main()
