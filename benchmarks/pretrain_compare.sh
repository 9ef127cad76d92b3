#!/usr/bin/env bash
# On a GPU machine of the device tool: the example pretraining script's h100 configuration with the
# mosaic_gpu backend, with token rounding, and with the xla backend (fewer steps: it is slow), from
# the same initialisation and data order. Metrics CSVs go to $OUT.
#   bash benchmarks/pretrain_compare.sh [steps] [xla_steps]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
steps="${1:-400}"
xla_steps="${2:-100}"
mkdir -p "$out"
run() {  # name, time limit (s), flags...
  local name=$1 limit=$2
  shift 2
  rm -rf "/tmp/pretrain_$name"
  timeout "$limit" python3 examples/pretrain/train.py --config=h100 --workdir="/tmp/pretrain_$name" \
      --plot=false "$@" 2>&1 | grep -v "^I[0-9]\{4\} \|^W[0-9]\{4\} " | tail -8
  cp "/tmp/pretrain_$name/metrics.csv" "$out/pretrain_${name}.csv" 2>/dev/null || true
}
run mosaic_gpu 200 --backend=mosaic_gpu --steps="$steps" --eval_every=100
run mosaic_gpu_tr_nearest 200 --backend=mosaic_gpu --token_rounding=nearest --steps="$steps" --eval_every=100
# The xla backend is about 8x slower: a short pair with its own warm-up, mosaic_gpu as its twin.
short=(--steps="$xla_steps" --warmup=$((xla_steps / 5)) --eval_every=$((xla_steps / 2)))
run xla_${xla_steps}steps 240 --backend=xla "${short[@]}"
run mosaic_gpu_${xla_steps}steps 120 --backend=mosaic_gpu "${short[@]}"
