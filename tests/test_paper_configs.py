"""The paper's models (configs/paper/): every file parses, builds its model (abstractly: no
parameter is allocated), has the analytic number of parameters, and lays every parameter out
legally on its paper mesh."""

import dataclasses
import glob
import json
import math
import os

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import pytest

from conftest import no_compilation_cache
from mtrain import config as mtrain_config
from mtrain import run as run_lib
from mtrain.data import tasks
from mtrain.parallel.layout import Layout
from mtrain.models.transformer import DecoderLM, EncoderDecoder, TransformerConfig
from mtrain.models.base import batch_keys

PAPER = sorted(glob.glob(os.path.join(run_lib.CONFIGS_DIR, "paper", "*_size_*.gin")))


def build(path):
    """(model config, layout, task, batch size, abstract boxed variables) of a paper file."""
    run_lib.parse_config([path], [])
    vocab = gin.query_parameter("vocabulary.size")
    config = mtrain_config.transformer(vocab_size=128 * math.ceil(vocab / 128))
    task = tasks.get_task(mtrain_config.run_config().task)  # (a name, or @task())
    model = (EncoderDecoder if task.kind == "translation" else DecoderLM)(config)
    batch, length = gin.query_parameter("run.batch_size"), gin.query_parameter("run.sequence_length")
    ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    boxed = jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a),
                           *[ids] * len(batch_keys(model.features)))
    layout = Layout(gin.query_parameter("run.mesh_shape"), gin.query_parameter("run.layout_rules"),
                    drop_unused_rules=True)  # as runs do: batch:32 has no `model`
    return config, layout, task, batch, boxed


def analytic_params(c: TransformerConfig, kind: str) -> int:
    """Matmul and embedding parameters, as the paper counts them."""
    d, h, k, f, v, n = c.d_model, c.num_heads, c.d_kv, c.d_ff, c.vocab_size, c.num_layers
    if kind == "lm":  # 6 (4 d h d_kv + 2 d d_ff) + 2 V d: embedding and softmax
        return n * (4 * d * h * k + 2 * d * f) + 2 * v * d
    encoder = n * (4 * d * h * k + 2 * d * f)
    decoder = n * (8 * d * h * k + 2 * d * f)  # self- and encoder-decoder attention
    return encoder + decoder + 2 * v * d  # one shared embedding, one softmax


def extra_params(c: TransformerConfig, kind: str) -> int:
    """Learned position embeddings and RMSNorm scales, which the analytic count leaves out."""
    if kind == "lm":
        return c.max_length * c.d_model + (2 * c.num_layers + 1) * c.d_model
    return 2 * c.max_length * c.d_model + (5 * c.num_layers + 2) * c.d_model


@pytest.mark.parametrize("path", PAPER, ids=[os.path.basename(p) for p in PAPER])
def test_paper_config_builds_and_lays_out_legally(path):
    config, layout, task, batch, boxed = build(path)
    params = nn.unbox(boxed)["params"]
    total = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert total == analytic_params(config, task.kind) + extra_params(config, task.kind)
    # Every parameter is legal on the paper's mesh (LayoutError otherwise), and the batch
    # splits over the batch dimension.
    names = nn.get_partition_spec(boxed)["params"]
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    per_device = 0
    for (path_, spec), leaf in zip(jax.tree_util.tree_leaves_with_path(names, is_leaf=is_spec),
                                   jax.tree_util.tree_leaves(params)):
        split = layout.partition_spec(tuple(spec), leaf.shape, tensor=jax.tree_util.keystr(path_))
        per_device += leaf.size // math.prod(layout.mesh_dims[m] for m in split if m)
    layout.partition_spec(("batch", "length"), (batch, 256), tensor="batch")
    model_ways = layout.mesh_dims.get("model", 1)
    # Splitting d_ff, heads and vocab over `model` divides almost every parameter by it.
    assert per_device < 1.01 * total / model_ways + config.d_model * 4096


def test_the_largest_models_have_the_papers_sizes():
    config, layout, _, _, boxed = build(os.path.join(run_lib.CONFIGS_DIR, "paper", "lm_size_5.gin"))
    total = sum(x.size for x in jax.tree_util.tree_leaves(nn.unbox(boxed)["params"]))
    assert 4.85e9 < total < 4.95e9 and layout.size == 512  # "about 4.9B on 512 cores"
    _, layout, _, _, boxed = build(os.path.join(run_lib.CONFIGS_DIR, "paper", "tr_size_4.gin"))
    total = sum(x.size for x in jax.tree_util.tree_leaves(nn.unbox(boxed)["params"]))
    assert 2.8e9 < total < 2.95e9 and layout.size == 128  # "about 2.9B on 128 cores"


# Compiles every paper file's train step on its paper mesh, in one process that simulates
# 512 CPU devices. The largest LM and translation models compile at full depth; the others
# with one layer, which exercises every layout the full depth does, in a fraction of the time.
_COMPILE_ALL = """
import io, json, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 512)
from mtrain import run as run_lib
from mtrain.modes.plan import plan
for path in sys.argv[1:]:
    full = path.endswith(("lm_size_5.gin", "tr_size_4.gin"))
    run_lib.parse_config([path], [] if full else ["transformer.num_layers=1"])
    exp = run_lib.build(model_dir="unused", mode="plan")
    report = plan(exp, target="tpu-v3", output_format="json", out=io.StringIO())
    print(json.dumps({"path": path, "layers": exp.model_config.num_layers, **report}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.extended  # (its legality and sizes: the tests above)
def test_every_paper_config_compiles_its_train_step_on_its_paper_mesh():
    import subprocess
    import sys

    # Programs no other test compiles: caching them would only cost time.
    env = no_compilation_cache(dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0"))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL, *PAPER], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["path"] for r in reports] == PAPER
    for r in reports:
        config, layout, task, _, _ = build(r["path"])
        assert r["mesh_shape"] == ";".join(f"{n}:{s}" for n, s in layout.mesh_shape)
        assert r["num_devices"] == layout.size and r["xla_flops"] > 0 and r["temp_bytes"] > 0
        # The planner counts what the formula counts.
        config = dataclasses.replace(config, num_layers=r["layers"])
        assert r["analytic_parameters"] == analytic_params(config, task.kind)
        assert r["parameters"] == r["analytic_parameters"] + extra_params(config, task.kind)
    largest = {os.path.basename(r["path"]): r for r in reports if r["layers"] == 6}
    assert set(largest) == {"lm_size_5.gin", "tr_size_4.gin"}
    # Model parallelism is what lets them fit: 1/32 and 1/8 of the parameters per device.
    assert largest["lm_size_5.gin"]["parameter_bytes"] < 4 * 4.9e9 / 32 * 1.01
    assert largest["tr_size_4.gin"]["parameter_bytes"] < 4 * 2.9e9 / 8 * 1.01
    assert all(r["fits"] for r in largest.values())  # on a 16 GiB TPU v3 core
