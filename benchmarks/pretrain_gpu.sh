#!/bin/bash
# The pretraining comparison on one machine of 4 Hopper GPUs (H100 or H200): pretrain_bench with
# its arguments, results in $OUT. The corpus is the .py source of the GPU host's site-packages
# (torch, transformers, ...), its first $CORPUS_BYTES (default 256 MiB); $COMMON adds flags to
# every run (a --common among the arguments would replace the corpus flags). The BPE and token
# arrays are cached in .cache/bpe and the results kept in .cache/bench, which a later run on the
# same machine reuses and appends to:
#   COMMON=--warmup=10 bash benchmarks/pretrain_gpu.sh --config=olmoe_1b_7b --steps=30 \
#       --baseline="tokamax ragged_dot" --run="ep4=--expert_parallel=4 --remat=none" \
#       --run="tokamax ragged_dot=--moe_impl=tokamax_ragged_dot --expert_parallel=1 --fsdp \
#              --bias_update_rate=0"
#   bash benchmarks/pretrain_gpu.sh --config=olmoe_1b_7b --steps=300 --log_every=10 \
#       --run="ep4 curve=--expert_parallel=4 --eval_every=25 --profile_step=0" \
#       --append=.cache/bench/<the first run's results file>
# The wheels in .whl (tokamax, tensorboardX) are installed when present.
set -eo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  source benchmarks/wheels.sh install
fi
site=$(python3 -c 'import os, numpy; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
mkdir -p .cache/bpe .cache/bench "${OUT:-bench_out}"
status=0
python3 -m benchmarks.pretrain_bench --out=.cache/bench \
  --common="--corpus_dir='$site' --corpus_bytes=${CORPUS_BYTES:-268435456} \
--data_cache='$PWD/.cache/bpe' $COMMON" "$@" || status=$?
cp .cache/bench/*_pretrain.json "${OUT:-bench_out}/" 2>/dev/null || true
exit $status
