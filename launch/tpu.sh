#!/usr/bin/env bash
# Runs mtrain on a Cloud TPU VM slice: create it (directly or as a queued resource), copy
# this checkout to every worker, install it (in a Python 3.12 environment), run the same `python -m mtrain` on all workers
# (JAX finds the other workers itself), stream the logs, and delete the slice.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu.sh --project=P --zone=Z --accelerator_type=T --model_dir=gs://... \
                     --gin_file=F [--gin_file=...] [--gin_param=B ...] [options]

Required:
  --project=P            Google Cloud project
  --zone=Z               zone with the accelerator, e.g. us-central2-b (v4), us-east5-a (v5p)
  --accelerator_type=T   v2-8 ... v2-512, v3-8 ... v3-2048, v4-8 ... v4-4096,
                         v5litepod-1 ... v5litepod-256 (or v5e-N), v5p-8 ... v5p-12288,
                         v6e-1 ... v6e-256
  --model_dir=gs://B/D   where checkpoints and metrics go (a bucket every worker can write)
  --gin_file=F           gin file(s) of the run, e.g. paper/lm_size_5.gin (repeatable)

Options:
  --gin_param=B          gin binding, e.g. run.train_steps=1000 (repeatable)
  --name=N               TPU (and queued resource) name (default: mtrain-$USER)
  --runtime_version=V    TPU VM image (default: by accelerator generation)
  --num_slices=N         N slices joined by the data-centre network (TPU multislice,
                         through queued-resources): nodes <name>-0 ... <name>-(N-1); the
                         run's outermost mesh dimension spans them (its layers:<dim> rule's
                         dimension first, then batch's: a pipeline stage, or a data
                         shard, per slice; plan it with --mode=plan --slices=N)
  --queued               create through queued-resources (waits for capacity)
  --spot                 use Spot capacity
  --keep                 do not delete the slice at the end
  --allow_dirty          ship the last commit even though the checkout has uncommitted
                         changes or untracked files (they are not shipped)
  --dry_run              print the commands instead of running them
  --help                 this text
EOF
}

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PROJECT="" ZONE="" ACCELERATOR="" RUNTIME="" MODEL_DIR="" NAME="mtrain-${USER:-user}"
QUEUED=0 SPOT=0 KEEP=0 DRY_RUN=0 ALLOW_DIRTY=0 SLICES=1
GIN_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --project=*) PROJECT="${arg#*=}" ;;
    --zone=*) ZONE="${arg#*=}" ;;
    --accelerator_type=*) ACCELERATOR="${arg#*=}" ;;
    --runtime_version=*) RUNTIME="${arg#*=}" ;;
    --model_dir=*) MODEL_DIR="${arg#*=}" ;;
    --name=*) NAME="${arg#*=}" ;;
    --num_slices=*) SLICES="${arg#*=}" ;;
    --gin_file=* | --gin_param=*) GIN_ARGS+=("$arg") ;;
    --queued) QUEUED=1 ;;
    --spot) SPOT=1 ;;
    --keep) KEEP=1 ;;
    --allow_dirty) ALLOW_DIRTY=1 ;;
    --dry_run) DRY_RUN=1 ;;
    --help | -h) usage; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

[[ -n "$PROJECT" ]] || die "--project is required"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ -n "$ACCELERATOR" ]] || die "--accelerator_type is required (e.g. v4-32)"
[[ "$MODEL_DIR" == gs://* ]] || die "--model_dir must be a gs:// path that every worker can write, got '$MODEL_DIR'"
[[ " ${GIN_ARGS[*]-} " == *" --gin_file="* ]] || die "at least one --gin_file is required"
[[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name '$NAME' must be lowercase letters, digits and dashes"
[[ "$SLICES" =~ ^[1-9][0-9]*$ ]] || die "--num_slices must be a positive whole number, got '$SLICES'"
# Multislice exists only through queued resources; its nodes are <name>-0, <name>-1, ...
NODES=("$NAME")
if ((SLICES > 1)); then
  QUEUED=1
  NODES=()
  for ((i = 0; i < SLICES; i++)); do NODES+=("$NAME-$i"); done
fi

# The workers get `git archive HEAD`: what is not committed (a new my_run.gin, an edit) is not
# there. Refuse rather than start a slice that runs other code or lacks a gin file.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIRTY="$(git -C "$REPO" status --porcelain --untracked-files=normal)"
if [[ -n "$DIRTY" ]]; then
  COUNT="$(echo "$DIRTY" | wc -l | tr -d ' ')"
  FILES="$(echo "$DIRTY" | head -n 3 | cut -c4- | paste -sd ' ' -)"
  ((COUNT > 3)) && FILES="$FILES and $((COUNT - 3)) more"
  if ((ALLOW_DIRTY)); then
    echo "launch/tpu.sh: warning: not shipping what is not committed: $FILES" >&2
  else
    die "not committed, so the workers would not get them: $FILES; commit them, or pass --allow_dirty to ship the last commit without them"
  fi
fi

ACCELERATOR="${ACCELERATOR/#v5e-/v5litepod-}"
if [[ ! "$ACCELERATOR" =~ ^(v2|v3|v4|v5litepod|v5p|v6e)-([0-9]+)$ ]]; then
  die "unknown --accelerator_type '$ACCELERATOR' (e.g. v4-32, v5p-128, v5litepod-16)"
fi
GENERATION="${BASH_REMATCH[1]}"
if [[ -z "$RUNTIME" ]]; then
  case "$GENERATION" in
    v2 | v3 | v4) RUNTIME="tpu-ubuntu2204-base" ;;
    v5p) RUNTIME="v2-alpha-tpuv5" ;;
    v5litepod) RUNTIME="v2-alpha-tpuv5-lite" ;;
    v6e) RUNTIME="v2-alpha-tpuv6e" ;;
  esac
fi

LOCATION=(--project="$PROJECT" --zone="$ZONE")
SPOT_FLAG=()
((SPOT)) && SPOT_FLAG=(--spot)

delete() {
  if ((QUEUED)); then
    run gcloud compute tpus queued-resources delete "$NAME" "${LOCATION[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$NAME" "${LOCATION[@]}" --quiet
  fi
}

# 1. The slice.
if ((QUEUED)); then
  NODE_FLAGS=(--node-id="$NAME")
  ((SLICES > 1)) && NODE_FLAGS=(--node-count="$SLICES" --node-prefix="$NAME")
  run gcloud compute tpus queued-resources create "$NAME" "${NODE_FLAGS[@]}" "${LOCATION[@]}" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME" "${SPOT_FLAG[@]}"
  if ((DRY_RUN)); then
    run gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}" --format='value(state.state)'
  else
    until [[ "$(gcloud compute tpus queued-resources describe "$NAME" "${LOCATION[@]}" \
                 --format='value(state.state)')" == ACTIVE ]]; do
      echo "launch/tpu.sh: waiting for $NAME to become ACTIVE" >&2
      sleep 30
    done
  fi
else
  run gcloud compute tpus tpu-vm create "$NAME" "${LOCATION[@]}" \
    --accelerator-type="$ACCELERATOR" --version="$RUNTIME" "${SPOT_FLAG[@]}"
fi
((KEEP)) || trap delete EXIT  # the slice goes away even if a step below fails

# 2. The code, on every worker: this checkout's committed tree.
TARBALL="${TMPDIR:-/tmp}/mtrain-$NAME.tar.gz"
run git -C "$REPO" archive --format=tar.gz --output="$TARBALL" HEAD
for node in "${NODES[@]}"; do
  run gcloud compute tpus tpu-vm scp "$TARBALL" "$node":mtrain.tar.gz --worker=all "${LOCATION[@]}"
done
# TPU VM images bring Python 3.10: uv (installed for the user) makes the environment with
# Python 3.12, which it downloads, as MaxText's setup does.
# shellcheck disable=SC2016  # $HOME is the worker's
UV='$HOME/.local/bin/uv'
for node in "${NODES[@]}"; do
  run gcloud compute tpus tpu-vm ssh "$node" --worker=all "${LOCATION[@]}" \
    --command="rm -rf mtrain && mkdir mtrain && tar -xzf mtrain.tar.gz -C mtrain && python3 -m pip install --quiet --user uv && $UV venv --quiet --python 3.12 mtrain/.venv && $UV pip install --quiet --python mtrain/.venv/bin/python -e ./mtrain 'jax[tpu]'"
done

# 3. The run: the same command on every worker of every slice, at once (the slices' runtime
# joins them: queued resources set its MEGASCALE_* variables); process 0 logs, the others
# only warn.
MTRAIN=(.venv/bin/python -m mtrain "${GIN_ARGS[@]}" --model_dir="$MODEL_DIR")
PIDS=()
for node in "${NODES[@]}"; do
  if ((DRY_RUN || SLICES == 1)); then
    run gcloud compute tpus tpu-vm ssh "$node" --worker=all "${LOCATION[@]}" \
      --command="cd mtrain && $(quote "${MTRAIN[@]}")"
  else
    gcloud compute tpus tpu-vm ssh "$node" --worker=all "${LOCATION[@]}" \
      --command="cd mtrain && $(quote "${MTRAIN[@]}")" &
    PIDS+=("$!")
  fi
done
for pid in ${PIDS[@]+"${PIDS[@]}"}; do wait "$pid"; done
