#!/bin/bash
# Expert parallelism on one machine of several GPUs (nvidia-h100-x2 / -x4): the compiled test of
# the persistent kernels with reserved SMs, then ep_bench with its arguments; results in $OUT.
#   bash benchmarks/ep_gpu.sh --thiek=16384,4096,1024,64,4 --thiek=8192,4096,512,128,8
set -eo pipefail
export PYTHONPATH=$PWD
out=${OUT:-bench_out}
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mosaic_gpu.py -k reserved_sms 2>&1 \
  | tail -3
python3 -m benchmarks.ep_bench --out="$out" "$@" 2>&1 | grep -v "^[IW][0-9]\{4\} "
