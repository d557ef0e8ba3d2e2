#!/usr/bin/env bash
# A/B of eager MXFP8 dispatch + combine (exact sizes), this tree against an older one, ALTERNATED over rounds: the
# spread between runs of the same code (10-20 % on the 2-GPU machine) is as large as most changes, so one run of
# each tells nothing. One rank on GPU 0 (AB_RANKS=1, 8192 x 7168 loopback) or one rank per visible GPU (AB_RANKS=0).
#
#   AB_OLD=bench/results/tmp/old bash scripts/gpu_ab_alternate.sh      # $OUT gets one log per run
#
# Make the old tree with `git archive <commit> mxcomm pyproject.toml | tar -x -C bench/results/tmp/old` (git-ignored:
# pass `carry: [".whl", "bench/results/tmp"]`). env: AB_RANKS (1), AB_ORDER ("old new"), AB_ROUNDS (2), AB_ITERS (20).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mxcomm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh 0 >/dev/null || exit 1
new=$PWD old=$(cd "${AB_OLD:?set AB_OLD to the old tree}" && pwd)
ranks=(); [[ ${AB_RANKS:-1} == 1 ]] && ranks=(--ranks 1)
rc=0
for round in $(seq "${AB_ROUNDS:-2}"); do
  for t in ${AB_ORDER:-old new}; do
    tree=$new; [[ $t == old ]] && tree=$old
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 150 python3 -m mxcomm bench "${ranks[@]}" --tokens 8192 \
        --hidden 7168 --topk 8 --experts 256 --ops dispatch,combine --iters "${AB_ITERS:-20}" --warmup 5 --no-progress \
        --impls mxcomm --precision mxfp8 --no-check --label "ab-$t-$round" --out "$OUT/ab_$t$round" > "$OUT/ab_$t$round.log" 2>&1)
    r=$?
    echo "round $round $t rc=$r"
    [[ $r -ne 0 ]] && rc=$r
    grep -E "^(dispatch|combine)" "$OUT/ab_$t$round.log"
    rm -rf "$OUT/ab_$t$round"
  done
done
exit $rc
