#!/usr/bin/env bash
# The layer benchmark on a GPU machine (no network there), from the repository root:
#   bash benchmarks/gpu_bench.sh [moe_bench flags...]
# sonic_jax's rows of BENCHMARKS.md's layer table, the paper's 12 configurations on one H100:
#   bash benchmarks/gpu_bench.sh --backends=mosaic_gpu --baselines=
# With the tokamax baseline: `bash benchmarks/wheels.sh tokamax` on a CPU machine beforehand, then
# copy .whl to the GPU host with the tree (installed here by `source benchmarks/wheels.sh install`).
# Writes $OUT/bench/<device>_<date>_layer.json (for benchmarks/results/) and the log beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/wheels.sh install
out="${OUT:-bench_out}/bench"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
python3 -m benchmarks.moe_bench --out="$out" "$@" 2>&1 | grep -Ev "^[IW][0-9]{4} " \
  | tee "$out/log.txt"
