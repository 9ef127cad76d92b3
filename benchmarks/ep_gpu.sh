#!/bin/bash
# Expert parallelism on one machine of several GPUs (nvidia-h100-x2 / -x4): ep_bench with its
# arguments, results in $OUT; about 4 minutes for the two configurations below on 2 GPUs.
#   bash benchmarks/ep_gpu.sh --thiek=16384,4096,1024,64,4 --thiek=8192,4096,512,128,8 --repeats=5
set -eo pipefail
export PYTHONPATH=$PWD
python3 -m benchmarks.ep_bench --out="${OUT:-bench_out}" "$@" 2>&1 \
  | grep -v "^[IW][0-9]\{4\} \|FallbackWarning\|^  [a-z_, ]* = backend\."
