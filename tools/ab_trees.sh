#!/usr/bin/env bash
# An A/B of two versions of the code on one machine in one run: the same command run in a base
# tree (another commit's files) and in the working tree, alternating, so that both see the same
# GPU, clocks and load (timings compare only within one machine and one run).
#
#   bash tools/ab_trees.sh prepare REF     # here: REF's sonic_jax, benchmarks, tools, tests,
#                                          # examples and pyproject.toml into .cache/ab_base
#                                          # (git-ignored: copy it to the GPU host)
#   bash tools/ab_trees.sh run [--rounds=N] -- CMD ARGS...
#                                          # on the GPU machine: CMD in both trees, N rounds
#
# Each run executes CMD from its tree's root with PYTHONPATH there and AB_OUT set to
# $OUT/<tree>/<round> (created; $OUT defaults to ab_out), e.g.
#   bash tools/ab_trees.sh run -- python -m benchmarks.token_rounding_bench --modes=nearest \
#       --kernel_trace --thiek=40960,768,256,128,8 --out=\$AB_OUT
# Round r runs base then new when r is odd, new then base when even. First the new tree runs once
# as a warm-up, not a sample (AB_OUT=$OUT/warmup): a fresh machine's first process runs slow (the
# selection kernel at 85 against 50-55 us, docs/decisions.md).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${AB_BASE:-.cache/ab_base}  # the base tree's folder

case "${1:-}" in
  prepare)
    ref=${2:?"prepare needs a commit, e.g. main"}
    rm -rf "$base" && mkdir -p "$base"
    git archive "$ref" sonic_jax benchmarks tools tests examples pyproject.toml | tar -x -C "$base"
    rm -rf "$base/benchmarks/results"
    echo "$ref ($(git rev-parse --short "$ref")) in $base: copy it to the GPU host"
    ;;
  run)
    shift
    rounds=1
    if [[ "${1:-}" == --rounds=* ]]; then rounds=${1#--rounds=}; shift; fi
    [[ "${1:-}" == -- ]] && shift
    (( $# )) || { echo "run needs a command after --" >&2; exit 2; }
    [[ -d $base/sonic_jax ]] || { echo "$base is missing: run 'prepare REF' and copy it here" >&2
                                  exit 2; }
    out=${OUT:-ab_out}
    one() {  # tree name, tree root, round (0: the warm-up)
      local dir="$out/$1/$3"
      (( $3 )) || dir="$out/warmup"
      mkdir -p "$dir"
      dir=$(cd "$dir" && pwd)
      echo "== $1, $( (( $3 )) && echo "round $3" || echo "warm-up")"
      (cd "$2" && PYTHONPATH="$PWD" AB_OUT="$dir" bash -c "$CMD")
    }
    CMD=$(printf '%q ' "$@")
    CMD=${CMD//\\\$AB_OUT/\$AB_OUT}  # let \$AB_OUT in the arguments expand in each tree
    one new . 0
    for (( r = 1; r <= rounds; r++ )); do
      if (( r % 2 )); then one base "$base" "$r"; one new . "$r"
      else one new . "$r"; one base "$base" "$r"; fi
    done
    ;;
  *)
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
