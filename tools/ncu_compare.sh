#!/usr/bin/env bash
# Nsight Compute's counters for the GEMM kernels of the forward or the training step, SonicMoE's
# and sonic_jax's, on one GPU in one run, SonicMoE's input scales. From the repository
# root of a GPU machine:
#   bash tools/ncu_compare.sh "T,d,n,E,K T,d,n,E,K" [impls, default sonicmoe,concat,interleaved]
#       [phase: forward | step]
# An impl is sonicmoe (needs .sonic: `bash benchmarks/wheels.sh sonicmoe` on a CPU machine, copied
# to the GPU host), or a sonic_jax gate/up layout, concat or interleaved, optionally LAYOUT@TABLE to
# run with that tuning table (e.g. concat@/tmp/table.json from benchmarks.autotune), and
# optionally +MODE to route with that token rounding (e.g. concat+nearest).
# Each run calls the forward (or the step) 3 times (tools/ncu_forward.py) and profiles the last
# call's GEMM kernels with `--set full`, clocks left alone (--clock-control none). The reports go to
# $OUT/ncu_<layout>[-<table>][-<mode>]_<phase>_<config>.ncu-rep with a raw CSV beside each, and
# `ncu_forward --summarize` prints the counters side by side ($OUT/ncu_summary.txt). NCU_SOURCE=1
# also exports each report's source page (SASS with stall samples, $OUT/ncu_*_sass.csv) and
# summarises it ($OUT/ncu_stalls.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
configs="$1"
impls="${2:-sonicmoe,concat,interleaved}"
phase="${3:-forward}"
step_flag=$([ "$phase" = step ] && echo --step || echo --no-step)
count=$([ "$phase" = step ] && echo 8 || echo 2)
out="${OUT:-bench_out}"
mkdir -p "$out"
source benchmarks/wheels.sh install
filter='^[IWE][0-9]{4}|[Ww]arn'
ncu_bin="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
"$ncu_bin" --version | tail -1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # ncu saves and restores the buffers a kernel writes
csvs=()
for cfg in $configs; do
  for impl in ${impls//,/ }; do
    rounding=$([[ "$impl" == *+* ]] && echo "${impl##*+}" || echo "")
    base="${impl%%+*}"
    layout="${base%%@*}"
    table=$([ "$layout" != "$base" ] && echo "${base#*@}" || echo "")
    tag=$([ -n "$table" ] && basename "$table" .json | sed 's/^/-/' || echo "")
    tag="$tag${rounding:+-$rounding}"
    name="${layout}${tag}_${phase}_${cfg//,/_}"
    args=(--clock-control none --target-processes all --set full --profile-from-start off
          --launch-count "$count" -f -o "$out/ncu_$name")
    if [ "$impl" = sonicmoe ]; then
      args+=(--kernel-name regex:quackgemm python3 -m tools.ncu_forward --impl=sonicmoe)
    else
      args+=(--kernel-name 'regex:projection|weight_grad' python3 -m tools.ncu_forward
             --impl=sonic_jax --layout="$layout" ${table:+--tuning="$table"}
             ${rounding:+--token_rounding="$rounding"})
    fi
    timeout 400 "$ncu_bin" "${args[@]}" $step_flag --thiek="$cfg" 2>&1 | grep -Ev "$filter" \
      | tail -5
    if [ -f "$out/ncu_$name.ncu-rep" ]; then
      "$ncu_bin" --import "$out/ncu_$name.ncu-rep" --csv --page raw --print-units base \
        > "$out/ncu_$name.csv"
      csvs+=("$out/ncu_$name.csv")
      if [ "${NCU_SOURCE:-0}" = 1 ]; then
        "$ncu_bin" --import "$out/ncu_$name.ncu-rep" --csv --page source --print-source sass \
          > "$out/ncu_${name}_sass.csv" 2> "$out/ncu_${name}_sass.err" || true
      fi
    fi
  done
done
declare -F save_sonic_cache >/dev/null && save_sonic_cache "$out"
[ ${#csvs[@]} -gt 0 ] && python3 -m tools.ncu_forward --summarize "${csvs[@]}" \
  | tee "$out/ncu_summary.txt"
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  python3 -m tools.ncu_forward --stalls "$out"/ncu_*_sass.csv > "$out/ncu_stalls.txt"
fi
