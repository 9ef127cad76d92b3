#!/usr/bin/env bash
# On a GPU machine of the device tool: the compiled kernel tests, then per-kernel timings.
#   bash benchmarks/gpu_check.sh [kernel_bench flags...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader || true
# Four test processes share the GPU (compiling is most of the time), each with a fifth of its memory.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider \
    tests/test_mosaic_gpu.py tests/test_router_topk.py 2>&1 | tail -40 | tee "$out/pytest_gpu.txt"
python3 -m benchmarks.kernel_bench --out="$out" "$@" 2>&1 | grep -v "^I[0-9]\{4\} \|^W[0-9]\{4\} " | tee "$out/kernels.txt"
