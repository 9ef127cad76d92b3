#!/usr/bin/env bash
# On a GPU machine, from the repository root: the pretraining example's h100 configuration for
# 150 steps (learning-rate warm-up 20 steps), trained with plain top-K, then with token rounding
# (nearest), same data and initialisation, and each run's tokens/s (median of its metrics rows
# after the first, which holds compilation) and held-out loss at the last step:
#   bash benchmarks/token_rounding_example.sh [train.py flags...]
# The runs' workdirs go to $OUT/example_<mode>.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench_out}"
mkdir -p "$out"
for mode in none nearest; do
  rm -rf "$out/example_$mode"
  python3 examples/pretrain/train.py --config=h100 --workdir="$out/example_$mode" --plot=false \
    --steps=150 --warmup=20 --eval_every=150 --log_every=25 --token_rounding="$mode" "$@" 2>&1 \
    | grep -Ev "^[IW][0-9]{4} " | tail -2
done
python3 - "$out" <<'PY'
import csv, math, statistics, sys
print("| routing | tokens/s (median) | held-out loss |\n|---|---|---|")
for mode in ("none", "nearest"):
  with open(f"{sys.argv[1]}/example_{mode}/metrics.csv") as f:
    rows = list(csv.DictReader(f))
  rates = [float(r["tokens_per_s"]) for r in rows[1:] if r["tokens_per_s"]]
  rate = statistics.median(r for r in rates if not math.isnan(r))
  loss = [r["heldout_loss"] for r in rows if r["heldout_loss"] not in ("", "nan")]
  print(f"| {'top-K' if mode == 'none' else mode} | {rate:.0f} | "
        + (f"{float(loss[-1]):.3f}" if loss else "-") + " |")
PY
