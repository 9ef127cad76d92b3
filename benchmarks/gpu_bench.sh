#!/usr/bin/env bash
# Run the benchmark harness on a GPU machine of the device tool (no network there):
#   bash benchmarks/gpu_bench.sh [moe_bench flags...]
# Installs the tokamax / jax-triton wheels from .whl (fetched here by ../shared/bench/device-wheels.sh
# and carried with the call) when present, then writes results under $OUT/bench.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  # tokamax imports xprof only for its own profiler; a stub avoids carrying 30 MB of wheels.
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo 'get_kernel_stats_tool = None' > /tmp/site/xprof/cli/tools.py
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}/bench"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || true
python3 -m benchmarks.moe_bench --out="$out" "$@" 2>&1 | grep -v "^I[0-9]\{4\} \|^W[0-9]\{4\} " | tee "$out/log.txt"
