#!/usr/bin/env bash
# On a GPU machine, from the repository root: the compiled tests of token rounding's kernels (the
# selection, the layout with extra pairs, the extras sum), then BENCHMARKS.md's token-rounding
# table (`token_rounding_bench`, every default configuration, top-K beside each):
#   bash benchmarks/token_rounding_gpu.sh [token_rounding_bench flags...]
# Writes $OUT/<device>_<date>_token_rounding.json (for benchmarks/results/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
# (pytest-xdist, in the GPU host's Python as in `.[test]`, runs the tests as two processes.)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 python3 -m pytest -m gpu -n 2 -q -p no:cacheprovider \
  tests/test_token_rounding.py tests/test_gather_sum.py tests/test_layout_ranks.py 2>&1 | tail -5
tests=$?
python3 -m benchmarks.token_rounding_bench --modes=nearest --out="$out" "$@" 2>&1 \
  | grep -Ev "^[IW][0-9]{4} "
bench=$?
exit $(( tests || bench ))
