#!/usr/bin/env bash
# On a GPU machine of the device tool: the compiled kernel tests, then both gate/up layouts
# side by side (per-kernel and layer timings) on the given configurations.
#   bash benchmarks/interleaved_check.sh T,d,n,E,K [T,d,n,E,K ...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
filter() { grep -Ev '^[IWE][0-9]{4} '; }
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_mosaic_gpu.py 2>&1 | tail -15 | tee "$out/pytest_gpu.txt"
thiek=(); for c in "$@"; do thiek+=("--thiek=$c"); done
for layout in concat interleaved; do
  python3 -m benchmarks.kernel_bench --out="$out/kernels_$layout" --repeats=5 \
    --gate_up_layout=$layout "${thiek[@]}" 2>&1 | filter | tee "$out/kernels_$layout.txt"
  python3 -m benchmarks.moe_bench --out="$out/layer_$layout" --backends=mosaic_gpu --baselines= \
    --kernel_trace=false --repeats=5 --gate_up_layout=$layout "${thiek[@]}" 2>&1 | filter \
    | tee "$out/layer_$layout.txt"
done
