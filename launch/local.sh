#!/usr/bin/env bash
# Runs one mtrain run as several processes on this machine, as on several hosts: process i
# gets --process_id=i and its own simulated CPU devices (or GPU i), all meet at a
# coordinator on localhost. Output lines are prefixed with the process id. When one process
# fails, the others are stopped and the script exits with its code.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local.sh [--num_processes=2] [--cpu_devices=4 | --gpus] [--port=P] [--dry_run] \
                       -- MTRAIN_ARGS...

  --num_processes=N   processes to start (default 2)
  --cpu_devices=K     simulated CPU devices per process (default 4)
  --gpus              one GPU per process instead (CUDA_VISIBLE_DEVICES=i)
  --port=P            coordinator port on localhost (default: a free one)
  --dry_run           print the commands instead of running them
  --help              this text
Everything after -- goes to every `python -m mtrain`, e.g.
  launch/local.sh -- --gin_file=quickstart.gin --model_dir=runs/two_processes
EOF
}

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON="$(python312)"
NUM=2 CPU_DEVICES=4 GPUS=0 PORT="" DRY_RUN=0
MTRAIN_ARGS=()
while (($#)); do
  case "$1" in
    --num_processes=*) NUM="${1#*=}" ;;
    --cpu_devices=*) CPU_DEVICES="${1#*=}" ;;
    --gpus) GPUS=1 ;;
    --port=*) PORT="${1#*=}" ;;
    --dry_run) DRY_RUN=1 ;;
    --help | -h) usage; exit 0 ;;
    --) shift; MTRAIN_ARGS=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; mtrain's own flags go after --)" ;;
  esac
  shift
done
[[ "$NUM" =~ ^[1-9][0-9]*$ ]] || die "--num_processes must be a positive integer, got '$NUM'"
[[ "$CPU_DEVICES" =~ ^[1-9][0-9]*$ ]] || die "--cpu_devices must be a positive integer, got '$CPU_DEVICES'"
((${#MTRAIN_ARGS[@]})) || die "give mtrain's arguments after --, e.g. -- --gin_file=quickstart.gin"
if [[ -z "$PORT" ]]; then
  PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')"
fi
[[ "$PORT" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$PORT'"

command_of() {  # the command of process $1
  local devices=(--cpu_devices="$CPU_DEVICES")
  ((GPUS)) && devices=()
  COMMAND=("$PYTHON" -m mtrain "${MTRAIN_ARGS[@]}" "${devices[@]}"
           --coordinator_address="localhost:$PORT" --num_processes="$NUM" --process_id="$1")
}

if ((DRY_RUN)); then
  for ((i = 0; i < NUM; i++)); do
    command_of "$i"
    if ((GPUS)); then quote env CUDA_VISIBLE_DEVICES="$i" "${COMMAND[@]}"; else quote "${COMMAND[@]}"; fi
  done
  exit 0
fi

PIDS=()
stop_all() { kill "${PIDS[@]}" 2>/dev/null || true; }
trap stop_all INT TERM
for ((i = 0; i < NUM; i++)); do
  command_of "$i"
  if ((GPUS)); then
    (export CUDA_VISIBLE_DEVICES="$i"; exec "${COMMAND[@]}") > >(sed -u "s/^/[$i] /") 2>&1 &
  else
    "${COMMAND[@]}" > >(sed -u "s/^/[$i] /") 2>&1 &
  fi
  PIDS+=("$!")
done

# Wait for all; the first failure stops the rest. (Each one waited for leaves PIDS: bash
# says "no such job" for a pid it has already reaped.)
STATUS=0
while ((${#PIDS[@]})); do
  code=0
  DONE=""
  wait -n -p DONE "${PIDS[@]}" || code=$?
  REMAINING=()
  for pid in "${PIDS[@]}"; do [[ "$pid" == "$DONE" ]] || REMAINING+=("$pid"); done
  PIDS=("${REMAINING[@]}")
  if ((code != 0 && STATUS == 0)); then
    STATUS=$code
    echo "launch/local.sh: a process exited with code $code; stopping the others" >&2
    stop_all
  fi
done
exit "$STATUS"
