#!/usr/bin/env bash
# SonicMoE's kernels and sonic_jax's, one by one, on the same GPU in one device call, on SonicMoE's
# data (x, dO ~ 0.2 N(0, 1), weights std 0.02):
#   bash benchmarks/sonic_kernels_same_gpu.sh "T,d,n,E,K T,d,n,E,K" [seconds for SonicMoE, 330]
#       [warm-up ms before each profile, 0]
# SonicMoE: benchmarks/sonic_profile.py (torch.profiler, 5 back-to-back forwards, then 5 training
# steps, per kernel; with a warm-up, right after that many ms of back-to-back calls, the GPU at
# its power cap); sonic_jax: benchmarks/step_timeline.py over 5 back-to-back calls, forward
# alone and training step. Needs .sonic as sonic_same_gpu.sh does (benchmarks/sonic_env.sh); the
# updated CuTe DSL caches go to $OUT/sonic_cache.tgz. Writes $OUT/sonic_profile.json and
# $OUT/ours/timeline_*.json.
set -uo pipefail
cd "$(dirname "$0")/.."
configs="$1"
sonic_s="${2:-330}"
warm_ms="${3:-0}"
source benchmarks/sonic_env.sh
mkdir -p "$out/ours"
thiek=""
for c in $configs; do thiek="$thiek --thiek=$c"; done
sonic_python benchmarks/sonic_profile.py $thiek --calls=5 --warm_ms="$warm_ms" --out="$out" 2>&1 \
  | grep -Ev "$filter" | cut -c1-160
save_sonic_cache "$out"
for phase in --forward_only --noforward_only; do
  PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 -m benchmarks.step_timeline $thiek --calls=5 \
    --data=sonicmoe --warm_ms="$warm_ms" $phase --out="$out/ours" 2>&1 | grep -Ev "$filter" \
    | grep -v "  gap "
done
