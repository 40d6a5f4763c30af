#!/usr/bin/env bash
# Runs mtrain on a Slurm GPU cluster: writes a batch script that starts one process per GPU
# (or per node) with srun, and submits it with sbatch. JAX reads the Slurm environment to
# find the coordinator, the number of processes and each one's id and GPU; srun's
# --kill-on-bad-exit stops every process when one fails, so a dead node never leaves the
# others waiting in a collective.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/slurm.sh --nodes=N --model_dir=DIR --gin_file=F [--gin_file=...] \
                       [--gin_param=B ...] [options]

Required:
  --nodes=N              nodes to run on
  --model_dir=DIR        checkpoints and metrics, on a file system every node mounts
  --gin_file=F           gin file(s) of the run (repeatable)

Options:
  --gin_param=B          gin binding (repeatable)
  --gpus_per_node=G      GPUs per node (default 8)
  --per=gpu|node         one process per GPU (default) or per node (each sees all its GPUs)
  --partition=P          Slurm partition
  --account=A            Slurm account
  --time=T               time limit (default 24:00:00)
  --job_name=J           job name (default mtrain)
  --python=PATH          the Python with mtrain installed, on every node
                         (default: this checkout's .venv/bin/python)
  --dry_run              print the batch script and the sbatch command instead of submitting
  --help                 this text
EOF
}

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODES="" MODEL_DIR="" GPUS=8 PER="gpu" PARTITION="" ACCOUNT="" TIME="24:00:00" JOB="mtrain"
PYTHON="$REPO/.venv/bin/python" DRY_RUN=0
GIN_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --nodes=*) NODES="${arg#*=}" ;;
    --model_dir=*) MODEL_DIR="${arg#*=}" ;;
    --gpus_per_node=*) GPUS="${arg#*=}" ;;
    --per=*) PER="${arg#*=}" ;;
    --partition=*) PARTITION="${arg#*=}" ;;
    --account=*) ACCOUNT="${arg#*=}" ;;
    --time=*) TIME="${arg#*=}" ;;
    --job_name=*) JOB="${arg#*=}" ;;
    --python=*) PYTHON="${arg#*=}" ;;
    --gin_file=* | --gin_param=*) GIN_ARGS+=("$arg") ;;
    --dry_run) DRY_RUN=1 ;;
    --help | -h) usage; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '$NODES'"
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || die "--gpus_per_node must be a positive integer, got '$GPUS'"
[[ "$PER" == gpu || "$PER" == node ]] || die "--per must be gpu or node, got '$PER'"
[[ -n "$MODEL_DIR" ]] || die "--model_dir is required"
[[ " ${GIN_ARGS[*]-} " == *" --gin_file="* ]] || die "at least one --gin_file is required"

if [[ "$PER" == gpu ]]; then
  TASKS_PER_NODE="$GPUS" SRUN_GPUS=(--gpus-per-task=1)
else
  TASKS_PER_NODE=1 SRUN_GPUS=()
fi
MTRAIN=(srun --kill-on-bad-exit=1 "${SRUN_GPUS[@]}" "$PYTHON" -m mtrain "${GIN_ARGS[@]}"
        --model_dir="$MODEL_DIR")

script() {
  echo "#!/bin/bash"
  echo "#SBATCH --job-name=$JOB"
  echo "#SBATCH --nodes=$NODES"
  echo "#SBATCH --ntasks-per-node=$TASKS_PER_NODE"
  echo "#SBATCH --gpus-per-node=$GPUS"
  echo "#SBATCH --time=$TIME"
  echo "#SBATCH --output=$JOB-%j.out"
  [[ -z "$PARTITION" ]] || echo "#SBATCH --partition=$PARTITION"
  [[ -z "$ACCOUNT" ]] || echo "#SBATCH --account=$ACCOUNT"
  echo "set -euo pipefail"
  echo "cd $(quote "$REPO")"
  quote "${MTRAIN[@]}"
}

if ((DRY_RUN)); then
  script
  echo "# submitted with:"
  echo "sbatch <the script above>"
else
  BATCH_SCRIPT="$(mktemp "${TMPDIR:-/tmp}/mtrain-slurm-XXXXXX.sh")"
  script > "$BATCH_SCRIPT"
  sbatch "$BATCH_SCRIPT"
fi
