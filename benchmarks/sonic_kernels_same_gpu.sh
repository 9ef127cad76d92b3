#!/usr/bin/env bash
# SonicMoE's kernels and sonic_jax's, one by one, on the same GPU in one device call, on SonicMoE's
# data (x, dO ~ 0.2 N(0, 1), weights std 0.02):
#   bash benchmarks/sonic_kernels_same_gpu.sh "T,d,n,E,K T,d,n,E,K" [seconds for SonicMoE, 330]
#       [warm-up ms before each profile, 0 | burst] [phases with burst: forward,step]
# SonicMoE: benchmarks/sonic_profile.py (torch.profiler, 5 back-to-back forwards, then 5 training
# steps, per kernel; with a warm-up, right after that many ms of back-to-back calls, the GPU at
# its power cap); sonic_jax: benchmarks/step_timeline.py over 5 back-to-back calls, forward
# alone and training step. With "burst" instead of a warm-up, both inside do_bench bursts (200 ms
# of calls, each after a 256 MB L2 flush, as SonicMoE's anchors are timed): `sonic_profile.py
# --burst`, then benchmarks/burst_kernels.py (each kernel in the burst, under a sustained flushed
# load and under a sustained load), for the phases named. Needs .sonic as sonic_same_gpu.sh does
# (benchmarks/sonic_env.sh); the updated CuTe DSL caches go to $OUT/sonic_cache.tgz. Writes
# $OUT/sonic_profile.json and $OUT/ours/timeline_*.json (burst: $OUT/ours/burst_kernels_PHASE.json).
set -uo pipefail
cd "$(dirname "$0")/.."
configs="$1"
sonic_s="${2:-330}"
mode="${3:-0}"
source benchmarks/sonic_env.sh
mkdir -p "$out/ours"
thiek=$(thiek_flags "$configs")
if [ "$mode" = burst ]; then
  phases="${4:-forward,step}"
  sonic_python benchmarks/sonic_profile.py $thiek --burst --phases="$phases" --out="$out" 2>&1 \
    | grep -Ev "$filter" | cut -c1-160
  save_sonic_cache "$out"
  for phase in ${phases//,/ }; do
    flag=$([ "$phase" = step ] && echo --step || echo --nostep)
    PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 timeout 300 python3 -m benchmarks.burst_kernels $thiek \
      $flag --out="$out/ours" 2>&1 | grep -Ev "$filter"
    mv "$out/ours/burst_kernels.json" "$out/ours/burst_kernels_$phase.json"
  done
  exit 0
fi
sonic_python benchmarks/sonic_profile.py $thiek --calls=5 --warm_ms="$mode" --out="$out" 2>&1 \
  | grep -Ev "$filter" | cut -c1-160
save_sonic_cache "$out"
for phase in --forward_only --noforward_only; do
  PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 -m benchmarks.step_timeline $thiek --calls=5 \
    --data=sonicmoe --warm_ms="$mode" $phase --out="$out/ours" 2>&1 | grep -Ev "$filter" \
    | grep -v "  gap "
done
