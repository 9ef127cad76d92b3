#!/bin/bash
# Expert parallelism on one machine of several Hopper GPUs (2 or 4: H100 or H200): ep_bench with
# its arguments, results in $OUT; about 3-4 minutes for the two configurations below.
#   bash benchmarks/ep_gpu.sh --thiek=16384,4096,1024,64,4 --thiek=8192,4096,512,128,8 --repeats=5
set -eo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m benchmarks.ep_bench --out="${OUT:-bench_out}" "$@" 2>&1 \
  | grep -v "^[IW][0-9]\{4\} \|FallbackWarning\|^  [a-z_, ]* = backend\."
