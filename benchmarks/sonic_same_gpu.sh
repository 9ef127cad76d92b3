#!/usr/bin/env bash
# SonicMoE and sonic_jax on the same GPU in one device call, both timed as SonicMoE's anchors were
# (triton do_bench style, SonicMoE's input scales):
#   bash benchmarks/sonic_same_gpu.sh "10,11,8" [seconds for SonicMoE, default 330]
# The argument lists grid indices (benchmarks/grid.py's PAPER_GRID order, as sonic_ref.py takes
# them). Needs .sonic (../shared/bench/sonic-wheels.sh) with a copy of ../shared/bench/sonic_ref.py
# in it, carried with the call; .sonic/cache/sonic_cache.tgz, when present, holds the CuTe DSL
# caches of an earlier call (a cold first SonicMoE call compiles for minutes), and the call
# writes the updated caches to $OUT/sonic_cache.tgz for the next one. Writes $OUT/sonic_ref.json
# (SonicMoE, the configurations it reached in its time) and $OUT/ours/results.json (sonic_jax on
# those configurations: moe_bench --do_bench --data=sonicmoe).
set -uo pipefail
cd "$(dirname "$0")/.."
indices="$1"
sonic_s="${2:-330}"
source benchmarks/sonic_env.sh
OUT="$out" sonic_python .sonic/sonic_ref.py "$indices" 2>&1 | grep -E "^T|first|Error"
save_sonic_cache "$out"
# Our rows for the configurations SonicMoE finished.
thiek=$(python3 - "$out/sonic_ref.json" <<'EOF'
import json, re, sys
try:
  done = json.load(open(sys.argv[1]))
except OSError:
  done = {}
for name, r in done.items():
  if "fwdbwd_ms" in r:
    t, d, n, e, k = map(int, re.findall(r"\d+", name))
    print(f"--thiek={t},{d},{n},{e},{k}", end=" ")
EOF
)
[ -z "$thiek" ] && { echo "SonicMoE finished no configuration"; exit 1; }
PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 -m benchmarks.moe_bench --backends=mosaic_gpu \
  --baselines= --kernel_trace=false --repeats=3 --do_bench --data=sonicmoe --out="$out/ours" \
  $thiek 2>&1 | grep -Ev "$filter" | grep -E "^   sonic|^=="
