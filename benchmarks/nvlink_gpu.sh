#!/usr/bin/env bash
# The NVLink peer copies on a host with 2 or more GPUs: their compiled tests (outputs against
# NCCL's all-gather and a NumPy gather, bit for bit), then nvlink_bench with its arguments,
# results in $OUT:
#   bash benchmarks/nvlink_gpu.sh [--rows=16384,8192] [--num_blocks=16,64,128] [--stages=2,4]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_peer_copy.py 2>&1 | tail -5
tests=$?
python3 -m benchmarks.nvlink_bench --out="${OUT:-bench_out}" "$@" 2>&1 \
  | grep -Ev "^[IW][0-9]{4} "
bench=$?
exit $(( tests || bench ))
