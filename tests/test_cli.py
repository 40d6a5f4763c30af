"""`python -m mtrain` end to end: train, eval, overrides, errors, resume, metrics."""

import json
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from mtrain import MODES, config
from mtrain import run as run_lib
from conftest import split_import_times
from test_oracles import ORACLES
from mtrain.__main__ import main
from mtrain.errors import ConfigError
from mtrain.modes import dispatch
from mtrain.parallel import targets
from tiny_config import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(model_dir, *params, files=("tasks/bible_lm.gin", "layouts/dp4_mp2.gin"), mode=None):
    argv = [f"--gin_file={f}" for f in files] + [f"--gin_param={p}" for p in [*TINY, *params]]
    argv += [f"--model_dir={model_dir}"] + ([f"--mode={mode}"] if mode else [])
    return main(argv)


def records(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(model_dir):
    return {r["step"]: r["train/loss"] for r in records(model_dir) if "train/loss" in r}


@pytest.mark.slow  # (train, resume, eval through main(): about 30 s)
def test_train_then_eval(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    assert cli(model_dir, "run.train_steps=12", "run.log_every=4", "run.checkpoint_every=6",
               "run.eval_every=0") == 0
    recs = records(model_dir)
    assert [r["step"] for r in recs if "train/loss" in r] == [4, 8, 12]
    final = [r for r in recs if "eval/loss" in r]
    assert len(final) == 1 and final[0]["step"] == 12
    assert final[0]["eval/perplexity"] > 1 and final[0]["eval/num_tokens"] > 1000
    config = (model_dir / "config.gin").read_text()
    assert "run.mesh_shape = 'batch:4;model:2'" in config and "transformer.d_model = 32" in config
    assert sorted(os.listdir(model_dir / "checkpoints"))[:2] == ["12", "6"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(model_dir))
    # The README's `tensorboard --logdir runs/` is installed and reads them.
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    proc = subprocess.run([tensorboard, "--inspect", f"--logdir={model_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "train/loss" in proc.stdout and "eval/perplexity" in proc.stdout

    # --mode=eval restores the latest checkpoint and reproduces the final evaluation.
    assert cli(model_dir, "run.train_steps=12", mode="eval") == 0
    again = [r for r in records(model_dir) if "eval/loss" in r][-1]
    assert again["step"] == 12
    assert again["eval/loss"] == pytest.approx(final[0]["eval/loss"], rel=1e-6)


def test_the_event_files_are_written_without_importing_torch(tmp_path, monkeypatch):
    """tensorboardX imports torch, google-cloud-storage and boto3 wherever they are
    installed: 4-7 s of every run's start. mtrain's metrics use none of them through it and
    import it with them hidden. Stand-ins of torch and boto3 first on the path tell whether
    anything imported them, and that they import after."""
    from mtrain.io.metrics import MetricsWriter

    site = tmp_path / "site"
    for package in ("torch", "boto3"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    unused = ("torch", "boto3", "google.cloud.storage")
    for name in [n for n in sys.modules if n.startswith((*unused, "tensorboardX"))]:
        monkeypatch.delitem(sys.modules, name)  # (put back at the end)
    (tmp_path / "run").mkdir()
    writer = MetricsWriter(str(tmp_path / "run"))
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "run"))
    try:
        assert "tensorboardX.writer" in sys.modules
        assert [name for name in unused if name in sys.modules] == []
        import boto3
        import torch
        assert all(m.__file__.startswith(str(site)) for m in (torch, boto3))
    finally:
        for name in [n for n in sys.modules if n.startswith(("torch", "boto3"))]:
            sys.modules.pop(name)


def test_gin_param_overrides_file_and_relative_model_dir(data_dir, tmp_path, monkeypatch):
    config = tmp_path / "mine.gin"
    config.write_text("include 'tasks/bible_lm.gin'\ninclude 'layouts/dp4_mp2.gin'\n"
                      "run.train_steps = 50\nrun.log_every = 1\n")
    monkeypatch.chdir(tmp_path)  # a model dir relative to the working directory, as in the README
    assert cli("run", "run.train_steps=2", "run.eval_every=-1", files=("mine.gin",)) == 0
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]
    assert not [r for r in records(tmp_path / "run") if "eval/loss" in r]  # (-1: never)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "2" / "state" / "_METADATA")


@pytest.mark.slow
def test_layouts_give_the_same_first_step_loss(data_dir, tmp_path):
    first = ["run.train_steps=1", "run.log_every=1", "run.eval_split='test'"]
    losses = []
    # The quickstart's batch:4;model:2 (test_trainer checks every other 8-device layout).
    assert cli(tmp_path / "dp4mp2", *first, files=("quickstart.gin",)) == 0
    losses.append(train_losses(tmp_path / "dp4mp2")[1])
    # One device, in a process of its own made with --cpu_devices=1.
    proc = run_cli("--gin_file=quickstart.gin", "--cpu_devices=1", "--gin_param=run.mesh_shape=''",
                   *[f"--gin_param={p}" for p in [*TINY, *first]],
                   f"--model_dir={tmp_path / 'single'}")
    assert proc.returncode == 0, proc.stderr
    losses.append(train_losses(tmp_path / "single")[1])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, "-m", "mtrain", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_typo_in_binding_is_one_clear_error(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_cli("--gin_file=quickstart.gin", "--gin_param=run.trian_steps=5",
                   f"--model_dir={model_dir}")
    assert proc.returncode == 2
    assert "trian_steps" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("mtrain: error:") and len(proc.stderr.strip().splitlines()) == 1
    assert not model_dir.exists()


def test_missing_gin_file_and_too_many_devices(tmp_path):
    proc = run_cli("--gin_file=no_such.gin", f"--model_dir={tmp_path / 'a'}")
    assert proc.returncode == 2 and "no_such.gin" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("--gin_file=quickstart.gin", f"--model_dir={tmp_path / 'b'}")  # 1 CPU device
    assert proc.returncode == 2
    assert "needs 8 devices, but 1 are available" in proc.stderr and "--cpu_devices" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_settings_that_cannot_work_are_refused_before_the_data_is_prepared(tmp_path, capsys,
                                                                          monkeypatch):
    """On a fresh machine, preparing the data and training the vocabulary take minutes: a
    model or layout setting that cannot work is refused first, and nothing is written."""
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), XLA_FLAGS="--xla_backend_optimization_level=0")
    env.pop("MTRAIN_DATA_DIR", None)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mtrain",
                           "--gin_file=quickstart.gin", "--cpu_devices=8",
                           "--gin_param=transformer.remat_policy='most'",
                           f"--model_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    imported, lines = split_import_times(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "transformer.remat_policy must be one of" in lines[0]
    assert not [p for p in (home / ".cache").rglob("*") if p.is_file()]  # no data, no vocabulary
    # Nor did it spend seconds importing what only the input pipeline needs.
    assert "jax" in imported and not imported & {"tensorflow", "tensorflow_datasets"}
    # In this process, with an empty data dir: settings the trainer checks (the layout).
    data = tmp_path / "data"
    monkeypatch.setenv("MTRAIN_DATA_DIR", str(data))
    try:
        for bad, message in [("transformer.num_heads=3", "'heads' of size 3 is not divisible "
                                                         "by mesh dimension 'model' of size 2"),
                             ("run.sequence_length=64", "run.sequence_length=64 is longer than "
                                                        "transformer.max_length=32"),
                             ("run.mode='eval'", f"no checkpoints in {tmp_path / 'run'}/"
                                                 f"checkpoints; train first"),
                             # (a float where a shape wants an int: not jax's 62 lines)
                             ("lora.rank=2.5", "lora.rank must be int, got 2.5"),
                             ("transformer.d_model='big'", "transformer.d_model must be int, "
                                                           "got 'big'")]:
            capsys.readouterr()
            assert cli(tmp_path / "run", bad) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and message in lines[0], lines
            assert not list(data.rglob("*")), bad
        # The model is built once, before the data, for the vocabulary size the settings
        # plan: that of the vocabulary then prepared.
        built = []

        class Counted(run_lib.Trainer):
            def __init__(self, **kwargs):
                built.append(kwargs["model"].config.vocab_size)
                super().__init__(**kwargs)

        monkeypatch.setattr(run_lib, "Trainer", Counted)
        run_lib.parse_config(["tasks/bible_lm.gin", "layouts/dp4_mp2.gin"], TINY)
        exp = run_lib.build(model_dir=str(tmp_path / "run"))
        assert exp.vocab.vocab_size == 256 and built == [256]
        assert exp.model_config.vocab_size == exp.trainer.model.config.vocab_size == 256
    finally:
        gin.clear_config()


@pytest.mark.parametrize("params, said", [
    ([], None),  # the one-device mesh: every rule is dropped, as the import journey's
    (["run.mesh_shape='batch:8'"], None),  # the model rules, as on the paper's batch:32
    (["run.mesh_shape='data:4;model:2'"],  # batch:batch was meant for 'data'
     "layout rules 'batch:batch' ignored: the mesh 'data:4;model:2' has no dimension 'batch'; "
     "its dimension 'data' splits nothing"),
    (["run.mesh_shape='model:8'", "run.layout_rules='d_ff:model'",
      "run.parameter_layout_rules='d_model:batch'"],  # no FSDP at all
     "parameter layout rules 'd_model:batch' ignored: the mesh 'model:8' has no dimension "
     "'batch', so none of them applies")],
    ids=["one device", "batch:8", "data:4;model:2", "fsdp on model:8"])
def test_rules_the_mesh_lacks_are_dropped_in_silence_unless_a_split_is_lost(capsys, params,
                                                                           said):
    """The default rules name mesh dimensions `batch` and `model`, and one set of rules
    serves every mesh (Mesh-TF): a rule naming a dimension the mesh lacks is dropped without
    a word, unless a mesh dimension of several devices is then left splitting nothing, or
    no rule of a kind is left: one line says so."""
    argv = ["--mode=plan", "--gin_file=tasks/bible_lm.gin",
            *[f"--gin_param={p}" for p in [*TINY, *params]]]
    assert main(argv) == 0
    warned = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()
              if "ignored" in line]  # (after the time)
    assert warned == ([said] if said else [])


@pytest.mark.skipif(not os.path.isdir(ORACLES), reason="no ../shared/oracles")
@pytest.mark.slow  # (the fast tier exports in test_huggingface)
def test_export_and_import_lay_the_model_out_on_the_devices_there_are(data_dir, tmp_path):
    """A model dir trained on a batch:4;model:2 mesh exports from a process of one device
    (the README's export line gives no --cpu_devices) the folder a process of 8 exports; an
    import for a mesh of more devices than there are (batch:8;model:2: 16) reads the
    folder's parameters on a mesh of the 8 there are, and its config keeps the mesh asked
    for."""
    safetensors = pytest.importorskip("safetensors.numpy")
    rules = "batch:batch;d_ff:model;heads:model;kv_heads:model;vocab:model"
    settings = [f"run.layout_rules='{rules}'", "run.batch_size=8", "run.sequence_length=32",
                "run.data_workers=0", "run.eval_every=0"]
    folder = os.path.join(ORACLES, "llama_gqa")

    def imported(model_dir, mesh):
        assert main(["--mode=import", f"--input_dir={folder}", f"--model_dir={model_dir}",
                     *[f"--gin_param={p}" for p in [f"run.mesh_shape='{mesh}'", *settings]]]) == 0

    def tensors(path):
        return safetensors.load_file(os.path.join(path, "model.safetensors"))

    imported(tmp_path / "m", "batch:4;model:2")
    assert main([f"--gin_file={tmp_path / 'm' / 'config.gin'}", f"--model_dir={tmp_path / 'm'}",
                 "--gin_param=run.train_steps=1"]) == 0
    assert main(["--mode=export", f"--model_dir={tmp_path / 'm'}",
                 f"--output_dir={tmp_path / 'eight'}"]) == 0
    proc = run_cli("--cpu_devices=1", "--mode=export", f"--model_dir={tmp_path / 'm'}",
                   f"--output_dir={tmp_path / 'one'}")
    assert proc.returncode == 0, proc.stderr
    assert ("the mesh 'batch:4;model:2' needs 8 devices and this process has 1: the parameters "
            "are laid out on the mesh 'batch:1;model:1'") in proc.stderr
    assert "exported step 1 of" in proc.stderr
    eight, one = tensors(tmp_path / "eight"), tensors(tmp_path / "one")
    assert sorted(one) == sorted(eight) and all(np.array_equal(one[k], eight[k]) for k in eight)
    # Import for 16 devices, here on a batch:4;model:2 mesh of the 8; its export is the folder.
    imported(tmp_path / "big", "batch:8;model:2")
    assert "run.mesh_shape = 'batch:8;model:2'" in (tmp_path / "big" / "config.gin").read_text()
    assert main(["--mode=export", f"--model_dir={tmp_path / 'big'}",
                 f"--output_dir={tmp_path / 'again'}"]) == 0
    theirs, again = tensors(folder), tensors(tmp_path / "again")
    assert sorted(again) == sorted(theirs)
    assert all(np.array_equal(again[k], theirs[k]) for k in theirs)


def test_help_explains_every_flag():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for flag in ["--gin_file", "--gin_param", "--model_dir", "--mode", "--cpu_devices"]:
        assert flag in proc.stdout


@pytest.mark.slow  # (7-12 s: the fast tier keeps its siblings; issue 61's budget)
def test_speed_settings_profile_and_mfu_from_gin(data_dir, tmp_path):
    model_dir = tmp_path / "run"
    assert cli(model_dir, "run.train_steps=4", "run.log_every=2", "run.num_microbatches=2",
               "run.activation_dtype='bfloat16'", "transformer.remat_policy='dots'",
               "transformer.scan_layers=True", "run.profile_steps=(2, 3)") == 0
    logged = [r for r in records(model_dir) if "train/loss" in r]
    # Model FLOP/s per device over the tokens/s of the same steps (the time cancels): a
    # token's FLOPs, counted here (6 x the matmul parameters: attention 4 d h d_kv,
    # feed-forward 2 d d_ff, softmax V d; attention's 12 x length x h x d_kv), shared by the
    # 8 devices, over the share of positions that hold real tokens (verses packed into rows
    # of 32 fill nearly all: measured 99%). A count without the backward pass (1/3), without
    # attention (0.89), per microbatch (2x), or not shared by the devices (8x) falls outside.
    d, d_ff, heads, d_kv, vocab, length = 32, 64, 2, 16, 256, 32
    per_token = 6 * (4 * d * heads * d_kv + 2 * d * d_ff + vocab * d) + 12 * length * heads * d_kv
    peak, _ = targets.device_peak_flops()  # (measured once per process: the run's)
    for r in logged:
        flops = r["train/model_flops_per_second_per_device"]
        assert 1 - 1e-6 < flops / r["train/tokens_per_second"] / (per_token / 8) < 4 / 3, r
        # The MFU is those FLOP/s over one device's peak: on CPU, what a large float32
        # matmul reached on these cores at start-up, shared by the 8 devices. A step of small
        # matmuls among memory-bound work (here also compiling and profiling) runs below
        # that, so a correct MFU is under 1 (here about 5e-4; 0.03 in steady state).
        assert r["train/mfu"] == pytest.approx(flops / peak, rel=1e-9) and 0 < r["train/mfu"] < 1
    traces = [f for _, _, files in os.walk(model_dir / "profile") for f in files]
    assert any(f.endswith(".xplane.pb") for f in traces), traces
    config = (model_dir / "config.gin").read_text()
    assert "run.num_microbatches = 2" in config and "transformer.scan_layers = True" in config
    # Settings that cannot work are one clear error.
    assert cli(tmp_path / "bad", "run.num_microbatches=3") == 2
    assert cli(tmp_path / "bad", "transformer.remat_policy='most'") == 2
    gin.clear_config()  # TransformerConfig is gin-configurable: leave no bad binding behind


@pytest.mark.slow  # (the fast tier keeps its siblings; the full suite runs it)
def test_sgp_from_gin_with_checkpoints_either_way(data_dir, tmp_path):
    """run.data_parallel='sgp' trains on the mesh's 4 batch replicas, logs consensus and bytes,
    and its checkpoints (of the average) continue an all-reduce run and the other way round."""
    sgp = ("run.data_parallel='sgp'", "run.sgp_overlap=1", "run.sgp_average_every=4",
           "run.eval_every=0")
    model_dir = tmp_path / "run"
    assert cli(model_dir, *sgp, "run.train_steps=6", "run.log_every=3",
               "run.checkpoint_every=3") == 0
    logged = [r for r in records(model_dir) if "train/loss" in r]
    assert [r["step"] for r in logged] == [3, 6]
    assert all(r["train/consensus_distance_max"] >= r["train/consensus_distance_mean"] > 0
               for r in logged)
    assert logged[0]["train/bytes_sent_per_replica_per_step"] > 4 * 20_000  # the parameters
    first_eval = [r for r in records(model_dir) if "eval/loss" in r][-1]
    # The all-reduce run resumes from SGP's step 6 and trains on.
    assert cli(model_dir, "run.train_steps=9", "run.log_every=3", "run.eval_every=0") == 0
    after = [r for r in records(model_dir) if "eval/loss" in r][-1]
    assert after["step"] == 9 and after["eval/loss"] < first_eval["eval/loss"]
    assert "train/consensus_distance_max" not in records(model_dir)[-2]
    # ... and SGP resumes from the all-reduce run's step 9.
    assert cli(model_dir, *sgp, "run.train_steps=12", "run.log_every=3") == 0
    assert [r["step"] for r in records(model_dir) if "train/loss" in r][-1] == 12
    # SGP needs the batch split over the mesh, in a power of two.
    assert cli(tmp_path / "bad", "run.data_parallel='sgp'", "run.mesh_shape='model:8'",
               "run.layout_rules='heads:model'") == 2
    assert cli(tmp_path / "bad", "run.data_parallel='gossip'") == 2
    assert cli(tmp_path / "bad", "run.sgp_overlap=1") == 2
    assert not (tmp_path / "bad").exists()
    gin.clear_config()


def test_a_bare_command_is_one_line(capsys):
    """`python -m mtrain` with nothing to say what to run does not train 1,000 steps into
    runs/default: it says what to give."""
    assert main([]) == 2
    assert capsys.readouterr().err.strip() == (
        "mtrain: error: nothing to run: give a --gin_file (the quickstart's is "
        "--gin_file=quickstart.gin; see --help)")


def test_every_mode_has_its_row_in_the_table(tmp_path, capsys):
    """--mode's choices are the modes the run dispatches (`modes.dispatch.MODES`): a mode
    named in one and not the other would be refused by the flags or fail at dispatch. A
    mode gin names that is neither is one line."""
    assert tuple(dispatch.MODES) == MODES
    assert main(["--gin_file=quickstart.gin", f"--model_dir={tmp_path / 'run'}",
                 "--gin_param=run.mode='evall'"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mtrain: error: unknown mode 'evall'; use one of " + ", ".join(MODES))
    assert not (tmp_path / "run").exists()


def test_gin_macros_and_references_pass_the_type_check():
    """The type check of numeric settings reads a macro's value (``%N``) and leaves
    references to configurables, which are called only when the run builds them."""
    try:
        config.parse([], ["N = 3", "transformer.num_layers = %N", "run.model = @DecoderLM"])
        assert config.model_config(256).num_layers == 3
        with pytest.raises(ConfigError, match=r"^lora.rank must be int, got 2.5$"):
            config.parse([], ["M = 2.5", "lora.rank = %M"])
    finally:
        gin.clear_config()
