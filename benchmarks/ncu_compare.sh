#!/usr/bin/env bash
# Nsight Compute's counters for the GEMM kernels of the forward or the training step, SonicMoE's
# and sonic_jax's (both gate/up layouts), on one GPU in one device call, SonicMoE's data:
#   bash benchmarks/ncu_compare.sh "T,d,n,E,K T,d,n,E,K" [impls: sonicmoe,concat,interleaved]
#       [phase: forward | step]
# An impl LAYOUT@TABLE runs sonic_jax with that tuning table (SONIC_JAX_TUNED_CONFIGS=TABLE, e.g.
# concat@benchmarks/experiments/full_band_table.json).
# Each run calls the forward (or the training step) 3 times (benchmarks/ncu_forward.py) and
# profiles the last call's GEMM kernels with `--set full` (clocks left alone: --clock-control
# none); the reports go to $OUT/ncu_<impl>_<phase>_<config>.ncu-rep, a raw CSV beside each, and
# `ncu_forward.py --summarize` prints the counters side by side. Needs .sonic for SonicMoE
# (benchmarks/sonic_env.sh). Run from the repository root. NCU_SOURCE=1 also exports each report's
# source page (SASS instructions with their stall samples) to $OUT/ncu_<impl>_<phase>_<config>_sass.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
configs="$1"
impls="${2:-sonicmoe,concat,interleaved}"
phase="${3:-forward}"
step_flag=$([ "$phase" = step ] && echo --step || echo --no-step)
count=$([ "$phase" = step ] && echo 8 || echo 2)
source benchmarks/sonic_env.sh
ncu_bin="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
"$ncu_bin" --version | tail -1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # ncu saves and restores the buffers a kernel writes
csvs=()
for cfg in $configs; do
  for impl in ${impls//,/ }; do
    layout="${impl%%@*}"
    table=$([ "$layout" != "$impl" ] && echo "${impl#*@}" || echo "")
    tag=$([ -n "$table" ] && basename "$table" .json | sed 's/^/-/' || echo "")
    name="${layout}${tag}_${phase}_${cfg//,/_}"
    ncu_args=(--clock-control none --target-processes all --set full --profile-from-start off
              --launch-count "$count" -f -o "$out/ncu_$name")
    # ncu wraps the python process: sonic_python's environment has to reach it.
    if [ "$impl" = sonicmoe ]; then
      PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:$PWD PYTHONUNBUFFERED=1 \
        timeout 400 "$ncu_bin" "${ncu_args[@]}" --kernel-name regex:quackgemm \
        python3 benchmarks/ncu_forward.py --impl=sonicmoe $step_flag --thiek="$cfg" 2>&1 \
        | grep -Ev "$filter" | tail -5
    else
      SONIC_JAX_TUNED_CONFIGS="${table:-sonic_jax/mosaic_gpu/tuned_configs.json}" \
      PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 timeout 400 "$ncu_bin" "${ncu_args[@]}" \
        --kernel-name 'regex:projection|weight_grad' python3 benchmarks/ncu_forward.py \
        --impl=sonic_jax --layout="$layout" $step_flag --thiek="$cfg" 2>&1 \
        | grep -Ev "$filter" | tail -5
    fi
    if [ -f "$out/ncu_$name.ncu-rep" ]; then
      "$ncu_bin" --import "$out/ncu_$name.ncu-rep" --csv --page raw --print-units base \
        > "$out/ncu_$name.csv"
      csvs+=("$out/ncu_$name.csv")
      if [ "${NCU_SOURCE:-0}" = 1 ]; then  # per-SASS-instruction counters and stall samples
        "$ncu_bin" --import "$out/ncu_$name.ncu-rep" --csv --page source --print-source sass \
          > "$out/ncu_${name}_sass.csv" 2> "$out/ncu_${name}_sass.err" || true
      fi
    fi
  done
done
save_sonic_cache "$out"
[ ${#csvs[@]} -gt 0 ] && python3 benchmarks/ncu_forward.py --summarize "${csvs[@]}" \
  | tee "$out/ncu_summary.txt"
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  python3 benchmarks/ncu_forward.py --stalls "$out"/ncu_*_sass.csv > "$out/ncu_stalls.txt"
fi
