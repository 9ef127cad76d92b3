#!/usr/bin/env bash
# SonicMoE and sonic_jax on the same GPU in one run, both timed as SonicMoE's benchmark
# times (triton's do_bench method) on SonicMoE's input scales:
#   bash benchmarks/sonic_same_gpu.sh ["T,d,n,E,K T,d,n,E,K ..."] [seconds for SonicMoE, 330]
# Default: the paper's 12 configurations. Beforehand, on a CPU machine: `bash benchmarks/wheels.sh
# sonicmoe` (the ignored folder .sonic), and copy .sonic to the GPU host with the tree. SonicMoE
# compiles its kernels on its opening calls, which can take more than 400 s on an H100 without
# caches: the run writes the caches to $OUT/sonic_cache.tgz; put that file in .sonic/cache/ for the
# next run (a run of one configuration fills them before a long one). SonicMoE runs at the start,
# for at most the given seconds (benchmarks/sonicmoe_bench.py:
# $OUT/<device>_<date>_layer_sonicmoe.json); then benchmarks.moe_bench times sonic_jax's layer on
# the configurations SonicMoE finished ($OUT/<device>_<date>_layer.json). Copy both into
# benchmarks/results/ for BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
configs="${1:-}"
out="${OUT:-bench_out}"
mkdir -p "$out"
source benchmarks/wheels.sh install
thiek=()
for c in $configs; do thiek+=("--thiek=$c"); done
timeout "${2:-330}" python3 benchmarks/sonicmoe_bench.py --out="$out" "${thiek[@]}" 2>&1 \
  | grep -Ev "^[IWE][0-9]{4}|[Ww]arn"
save_sonic_cache "$out"
# sonic_jax on the configurations SonicMoE finished.
done_flags=$(python3 - "$out" <<'PY'
import glob, json, sys
for path in glob.glob(f"{sys.argv[1]}/*_layer_sonicmoe.json"):
  for c in json.load(open(path))["configs"]:
    if "fwdbwd_ms" in c["rows"][0]:
      print("--thiek=" + ",".join(map(str, c["config"])), end=" ")
PY
)
[ -z "$done_flags" ] && { echo "SonicMoE finished no configuration"; exit 1; }
python3 -m benchmarks.moe_bench --backends=mosaic_gpu --baselines= --out="$out" $done_flags 2>&1 \
  | grep -Ev "^[IWE][0-9]{4}|[Ww]arn"
