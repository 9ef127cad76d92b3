#!/usr/bin/env bash
# On a GPU machine, from the repository root: the compiled test suite (`pytest -m gpu`), then the
# per-kernel benchmark (BENCHMARKS.md's kernel table):
#   bash benchmarks/gpu_check.sh [kernel_bench flags...]       # e.g. --thiek=32768,4096,1024,64,4
# The tests run as four pytest processes sharing the GPU (compiling is most of their time), each
# with 18% of its memory. Writes $OUT/pytest_gpu.txt (pytest's output), then
# $OUT/<device>_<date>_kernels.json (for benchmarks/results/) and $OUT/kernels.txt; exits non-zero
# when the tests or the kernel table fail.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader || true
XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider tests \
  > "$out/pytest_gpu.txt" 2>&1
status=$?
tail -40 "$out/pytest_gpu.txt"
python3 -m benchmarks.kernel_bench --out="$out" "$@" 2>&1 | grep -Ev "^[IW][0-9]{4} " \
  | tee "$out/kernels.txt"
bench=$?
exit $(( status || bench ))
