#!/usr/bin/env bash
# A/B of whole calls: `mxcomm bench` of this tree and of an older tree in one device call.
#
#   AB_OLD=bench/results/tmp/old bash scripts/gpu_ab_loopback.sh            # $OUT gets JSON + logs
#   AB_OLD=bench/results/tmp/old bash scripts/gpu_ab_loopback.sh alternate  # $OUT gets one log per run
#
# Default: the loopback (1 rank, 8192 x 7168, top-8, 256 experts) back to back - eager exact sizes, then CUDA-graph
# replays; $OUT keeps each run's JSON and log (8 files: what the device tool brings back).
# env: AB_OPS (default dispatch,combine), AB_ITERS (20), AB_IMPLS (this tree's eager run).
# `alternate`: eager MXFP8 dispatch + combine of the two trees ALTERNATED over rounds (the spread between runs of the
# same code, 10-30 % on the 2-GPU machine, is as large as most changes: one run of each tells nothing). env: AB_RANKS
# (1: loopback on GPU 0; 0: one rank per visible GPU), AB_ORDER ("old new"), AB_ROUNDS (2), AB_ITERS (20).
#
# Make the old tree with `git archive <commit> mxcomm pyproject.toml | tar -x -C bench/results/tmp/old` (git-ignored:
# pass `carry: [".whl", "bench/results/tmp"]`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mxcomm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh 0 >/dev/null || exit 1
new=$PWD old=$(cd "${AB_OLD:?set AB_OLD to the old tree}" && pwd)
rc=0
if [[ ${1:-} == alternate ]]; then
  ranks=(); [[ ${AB_RANKS:-1} == 1 ]] && ranks=(--ranks 1)
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for t in ${AB_ORDER:-old new}; do
      tree=$new; [[ $t == old ]] && tree=$old
      (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 150 python3 -m mxcomm bench "${ranks[@]}" --tokens 8192 \
          --hidden 7168 --topk 8 --experts 256 --ops dispatch,combine --iters "${AB_ITERS:-20}" --warmup 5 \
          --no-progress --impls mxcomm --precision mxfp8 --no-check --label "ab-$t-$round" --out "$OUT/ab_$t$round" \
          > "$OUT/ab_$t$round.log" 2>&1)
      r=$?
      echo "round $round $t rc=$r"
      [[ $r -ne 0 ]] && rc=$r
      grep -E "^(dispatch|combine)" "$OUT/ab_$t$round.log"
      rm -rf "$OUT/ab_$t$round"
    done
  done
  exit $rc
fi
run() {  # run LABEL TREE [extra mxcomm bench options]
  local label=$1 tree=$2
  shift 2
  (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout "${AB_LIMIT:-150}" python3 -m mxcomm bench --ranks 1 \
      --tokens 8192 --hidden 7168 --topk 8 --experts 256 --ops "${AB_OPS:-dispatch,combine}" --iters "${AB_ITERS:-20}" \
      --warmup 5 --no-progress --label "loopback-$label" --out "$OUT/bench_$label" "$@" > "$OUT/bench_$label.log" 2>&1)
  local r=$?
  echo "=== $label rc=$r"
  [[ $r -ne 0 ]] && { rc=$r; tail -5 "$OUT/bench_$label.log"; }
  # the device tool brings back at most 8 files: keep each run's JSON (next to its log), drop tables and plots
  mv "$OUT/bench_$label"/*.json "$OUT/" 2>/dev/null
  rm -rf "$OUT/bench_$label"
  grep -E "^(dispatch|combine)|ceiling|loopback traffic|check vs" "$OUT/bench_$label.log" | head -16
}
run new "$new" --impls "${AB_IMPLS:-mxcomm,reference,a2a}"
run old "$old" --impls mxcomm
run new-graph "$new" --impls mxcomm --cuda-graph
run old-graph "$old" --impls mxcomm --cuda-graph
exit $rc
