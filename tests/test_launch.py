"""launch/: the TPU, Slurm and local launch scripts. Their --dry_run output is the exact
commands they would run; bad arguments are refused; shellcheck finds nothing; and the local
launcher really runs a two-process training."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import no_compilation_cache
from test_multiprocess import SUBPROCESS_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")
SCRIPTS = sorted(os.path.join(LAUNCH, f) for f in os.listdir(LAUNCH) if f.endswith(".sh")) + [
    os.path.join(REPO, "benchmarks", "gpu.sh"), os.path.join(REPO, ".ci", "run")]


def launch(script, *args, env=None):
    proc = subprocess.run([os.path.join(LAUNCH, script), *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable),
                                                            "shellcheck")
    proc = subprocess.run([shellcheck, "-x", *SCRIPTS], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout
    assert {os.path.basename(s) for s in SCRIPTS} >= {"tpu.sh", "slurm.sh", "local.sh"}


TPU = ["--project=my-proj", "--zone=us-central2-b", "--model_dir=gs://bucket/lm5",
       "--gin_file=paper/lm_size_5.gin", "--gin_param=run.train_steps=1000", "--name=lm5",
       "--allow_dirty"]  # a developer's checkout may have uncommitted files: see below


def test_tpu_refuses_a_checkout_with_files_it_would_not_ship(tmp_path):
    """The workers get `git archive HEAD`: an uncommitted my_run.gin (the README's example)
    would be missing there while the command line names it."""
    repo = tmp_path / "repo"
    shutil.copytree(LAUNCH, repo / "launch")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "launch"], check=True)
    script = str(repo / "launch" / "tpu.sh")
    args = [a for a in TPU if a != "--allow_dirty"] + ["--accelerator_type=v4-8", "--dry_run"]
    clean = subprocess.run([script, *args], capture_output=True, text=True)
    assert clean.returncode == 0 and clean.stderr == "", clean.stderr
    (repo / "my_run.gin").write_text("run.train_steps = 10\n")
    dirty = subprocess.run([script, *args], capture_output=True, text=True)
    assert dirty.returncode == 2 and dirty.stdout == ""  # nothing was created
    assert "my_run.gin" in dirty.stderr and "--allow_dirty" in dirty.stderr
    assert len(dirty.stderr.strip().splitlines()) == 1
    allowed = subprocess.run([script, *args, "--allow_dirty"], capture_output=True, text=True)
    assert allowed.returncode == 0 and allowed.stdout == clean.stdout
    assert allowed.stderr.strip() == ("launch/tpu.sh: warning: not shipping what is not "
                                      "committed: my_run.gin")


def test_tpu_dry_run_prints_the_gcloud_commands():
    code, out, err = launch("tpu.sh", *TPU, "--accelerator_type=v4-512", "--dry_run")
    assert code == 0, err
    lines = out.splitlines()
    where = "--project=my-proj --zone=us-central2-b"
    assert lines[0] == (f"gcloud compute tpus tpu-vm create lm5 {where} "
                        f"--accelerator-type=v4-512 --version=tpu-ubuntu2204-base")
    assert lines[1].startswith(f"git -C {REPO} archive --format=tar.gz")
    assert lines[2].endswith(f"lm5:mtrain.tar.gz --worker=all {where}")
    # Python 3.12 on every worker (TPU VM images have 3.10), mtrain installed in it.
    assert ("venv --quiet --python 3.12 mtrain/.venv" in lines[3] and
            "pip install --quiet --python mtrain/.venv/bin/python -e ./mtrain" in lines[3] and
            "--worker=all" in lines[3])
    assert lines[4] == (f"gcloud compute tpus tpu-vm ssh lm5 --worker=all {where} '--command=cd "
                        f"mtrain && .venv/bin/python -m mtrain --gin_file=paper/lm_size_5.gin "
                        f"--gin_param=run.train_steps=1000 --model_dir=gs://bucket/lm5'")
    assert lines[5] == f"gcloud compute tpus tpu-vm delete lm5 {where} --quiet"
    assert len(lines) == 6


def test_tpu_queued_spot_v5e_with_keep():
    code, out, _ = launch("tpu.sh", *TPU, "--accelerator_type=v5e-256", "--queued", "--spot",
                          "--keep", "--dry_run")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("gcloud compute tpus queued-resources create lm5 --node-id=lm5")
    assert "--accelerator-type=v5litepod-256 --runtime-version=v2-alpha-tpuv5-lite --spot" in lines[0]
    assert lines[1].startswith("gcloud compute tpus queued-resources describe lm5")
    assert not any("delete" in line for line in lines)  # --keep
    code, out, _ = launch("tpu.sh", *TPU, "--accelerator_type=v5p-1024", "--dry_run")
    assert "--version=v2-alpha-tpuv5" in out.splitlines()[0]


def test_tpu_multislice_makes_the_slices_and_runs_on_all():
    """--num_slices=2: one queued resource of 2 nodes (multislice exists only so), the code
    copied to and installed on each, the run started on every worker of both at once."""
    code, out, err = launch("tpu.sh", *TPU, "--accelerator_type=v4-256", "--num_slices=2",
                            "--dry_run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("gcloud compute tpus queued-resources create lm5 "
                               "--node-count=2 --node-prefix=lm5 ")
    for node in ("lm5-0", "lm5-1"):
        assert sum(f" {node}:mtrain.tar.gz " in line for line in lines) == 1
        assert sum(line.startswith(f"gcloud compute tpus tpu-vm ssh {node} --worker=all")
                   and "-m mtrain --gin_file=paper/lm_size_5.gin" in line for line in lines) == 1
    assert lines[-1].startswith("gcloud compute tpus queued-resources delete lm5")
    code, out, err = launch("tpu.sh", *TPU, "--accelerator_type=v4-8", "--num_slices=0",
                            "--dry_run")
    assert code == 2 and "--num_slices must be a positive whole number, got '0'" in err


@pytest.mark.parametrize("args, message", [
    (["--accelerator_type=v9-8"], "unknown --accelerator_type 'v9-8'"),
    (["--accelerator_type=v4-8", "--model_dir=/local/dir"], "--model_dir must be a gs:// path"),
    (["--accelerator_type=v4-8", "--bogus"], "unknown argument '--bogus'"),
    (["--accelerator_type=v4-8", "--name=Bad_Name"], "--name 'Bad_Name' must be lowercase"),
])
def test_tpu_bad_arguments_are_refused(args, message):
    code, out, err = launch("tpu.sh", *TPU, *args, "--dry_run")
    assert code == 2 and message in err and out == ""
    code, _, err = launch("tpu.sh", "--zone=z", "--dry_run")
    assert code == 2 and "--project is required" in err


def test_slurm_dry_run_prints_the_batch_script():
    code, out, err = launch("slurm.sh", "--nodes=4", "--gpus_per_node=8", "--partition=a100",
                            "--model_dir=/shared/runs/lm5", "--gin_file=paper/lm_size_5.gin",
                            "--dry_run")
    assert code == 0, err
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=a100",
                 f"srun --kill-on-bad-exit=1 --gpus-per-task=1 {REPO}/.venv/bin/python -m mtrain "
                 f"--gin_file=paper/lm_size_5.gin --model_dir=/shared/runs/lm5"]:
        assert line in out.splitlines()
    code, out, _ = launch("slurm.sh", "--nodes=2", "--per=node", "--model_dir=/m",
                          "--gin_file=f.gin", "--python=/opt/py/bin/python", "--dry_run")
    assert "#SBATCH --ntasks-per-node=1" in out and "srun --kill-on-bad-exit=1 /opt/py/bin/python" in out
    for bad, message in [("--nodes=0", "--nodes must be a positive integer"),
                         ("--per=core", "--per must be gpu or node")]:
        code, _, err = launch("slurm.sh", "--nodes=1", bad, "--model_dir=/m", "--gin_file=f",
                              "--dry_run")
        assert code == 2 and message in err


def test_local_dry_run_and_bad_arguments():
    code, out, _ = launch("local.sh", "--num_processes=3", "--port=1234", "--dry_run", "--",
                          "--gin_file=quickstart.gin", "--model_dir=runs/x")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    assert lines[2].endswith("-m mtrain --gin_file=quickstart.gin --model_dir=runs/x "
                             "--cpu_devices=4 --coordinator_address=localhost:1234 "
                             "--num_processes=3 --process_id=2")
    code, _, err = launch("local.sh", "--dry_run")
    assert code == 2 and "give mtrain's arguments after --" in err
    code, _, err = launch("local.sh", "--num_processes=x", "--", "--gin_file=q")
    assert code == 2 and "--num_processes must be a positive integer" in err


@pytest.mark.slow
def test_local_launcher_runs_two_processes(data_dir, tmp_path):
    from tiny_config import TINY

    env = no_compilation_cache(dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS,
                                    PYTHON=sys.executable))
    code, out, err = launch(
        "local.sh", "--num_processes=2", "--cpu_devices=4", "--",
        "--gin_file=tasks/bible_lm.gin", "--gin_param=run.mesh_shape='batch:4;model:2'",
        *[f"--gin_param={p}" for p in TINY], "--gin_param=run.train_steps=3",
        f"--model_dir={tmp_path / 'run'}", env=env)
    assert code == 0, out[-3000:] + err[-3000:]
    assert err == ""  # the processes' output is on stdout, tagged; the launcher says nothing
    assert "[0] " in out and "step 3" in out
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f][-1] == 3


def test_python312_is_found_on_path_or_through_pyenv(tmp_path):
    """`.ci/run` and local.sh make or use mtrain's environment with Python 3.12: python3.12
    on PATH, else pyenv's newest 3.12, else one line that says what to install."""
    def find(path):
        proc = subprocess.run(["bash", "-c", "source launch/common.sh; python312"], cwd=REPO,
                              capture_output=True, text=True, env={"PATH": path})
        return proc.returncode, proc.stdout.strip(), proc.stderr.strip()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    system = f"{bin_dir}:/usr/bin:/bin"
    code, out, err = find(system)
    assert code == 2 and out == "" and err.splitlines() == [
        "bash: error: no Python 3.12 here (mtrain needs it): install python3.12 (e.g. apt "
        "install python3.12-venv, or pyenv install 3.12)"]
    # pyenv's shims: python3.12 on PATH fails until a version is chosen; the newest 3.12 wins.
    (bin_dir / "python3.12").write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    (bin_dir / "pyenv").write_text(f"#!/bin/sh\ncase $1 in root) echo {tmp_path}/pyenv ;; "
                                   "versions) printf '3.11.7\\n3.12.1\\n3.12.10\\n3.13.0\\n' ;; esac\n")
    for f in ("python3.12", "pyenv"):
        (bin_dir / f).chmod(0o755)
    assert find(system) == (0, f"{tmp_path}/pyenv/versions/3.12.10/bin/python3.12", "")
    (bin_dir / "python3.12").write_text("#!/bin/sh\nexit 0\n")
    assert find(system) == (0, f"{bin_dir}/python3.12", "")


def test_an_environment_of_an_older_python_is_one_line():
    """A .venv made by an earlier quickstart with Python 3.11 (current jax needs 3.12): the
    command says so in one line, and how to make it again."""
    old = shutil.which("python3.11")
    if old is None:
        pytest.skip("no python3.11 here")
    proc = subprocess.run([old, "-m", "mtrain", "--gin_file=quickstart.gin"], cwd=REPO,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    executable, version = subprocess.check_output(
        [old, "-c", "import sys, platform; print(sys.executable, platform.python_version())"],
        text=True).split()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"mtrain: error: mtrain needs Python 3.12 or later, and {executable} is {version}: make "
        "the environment again with python3.12 (rm -rf .venv, then the README's quickstart)"]
