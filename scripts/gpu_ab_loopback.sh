#!/usr/bin/env bash
# A/B of whole calls on one GPU: the loopback `mxcomm bench` (1 rank, 8192 x 7168, top-8, 256 experts) of this tree
# and of an older tree, back to back in one device call (eager exact sizes, then CUDA-graph replays).
#
#   AB_OLD=bench/results/tmp/old bash scripts/gpu_ab_loopback.sh      # $OUT gets JSON + logs
#
# Make the old tree with `git archive <commit> mxcomm pyproject.toml | tar -x -C bench/results/tmp/old` (git-ignored:
# pass `carry: [".whl", "bench/results/tmp"]`). env: AB_OPS (default dispatch,combine), AB_ITERS (20).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mxcomm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh 0 >/dev/null || exit 1
new=$PWD old=$(cd "${AB_OLD:?set AB_OLD to the old tree}" && pwd)
rc=0
run() {  # run LABEL TREE [extra mxcomm bench options]
  local label=$1 tree=$2
  shift 2
  (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout "${AB_LIMIT:-150}" python3 -m mxcomm bench --ranks 1 \
      --tokens 8192 --hidden 7168 --topk 8 --experts 256 --ops "${AB_OPS:-dispatch,combine}" --iters "${AB_ITERS:-20}" \
      --warmup 5 --no-progress --label "loopback-$label" --out "$OUT/bench_$label" "$@" > "$OUT/bench_$label.log" 2>&1)
  local r=$?
  echo "=== $label rc=$r"
  [[ $r -ne 0 ]] && { rc=$r; tail -5 "$OUT/bench_$label.log"; }
  grep -E "^(dispatch|combine)|ceiling|loopback traffic|check vs" "$OUT/bench_$label.log" | head -16
}
run new "$new" --impls "${AB_IMPLS:-mxcomm,reference,a2a}"
run old "$old" --impls mxcomm
run new-graph "$new" --impls mxcomm --cuda-graph
run old-graph "$old" --impls mxcomm --cuda-graph
exit $rc
