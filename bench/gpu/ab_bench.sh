#!/usr/bin/env bash
# `mxcomm bench` with another git revision's package and with this checkout's, alternating, in one call:
#
#   bash bench/gpu/ab_bench.sh REV ROUNDS BENCH_ARGS...
#   e.g. bash bench/gpu/ab_bench.sh HEAD~2 2 --ranks 4 --ranks-per-gpu 4 --mps start --impls mxcomm \
#            --transport push --tokens 128 --iters 50 --ops dispatch
#
# Each round runs the same `mxcomm bench` command twice: first with REV's `mxcomm` package (extracted with `git archive`
# into a temporary folder put first on PYTHONPATH; REV may also be a folder holding an extracted `mxcomm` package and
# `csrc` (the CUDA sources the put path builds), for a machine whose copy of the checkout has no git history), then with
# this checkout's. Every run starts in a neutral folder (`python -m` started from the repository root would import the
# checkout's package whatever PYTHONPATH says) and checks its outputs against the reference backend first, as `mxcomm
# bench` always does.
# Unlike bench/gpu/ab.sh (the sweep tool: CUDA events of the pull path), these are whole calls of any path.
# Output: OUT (default ~/.cache/mxcomm/gpu-ab-bench): one folder and log per run, and ab.txt with every run's op lines.
# LIMIT: seconds per run (default 150).
set -uo pipefail
cd "$(dirname "$0")/../.."
REV=${1:?usage: bash bench/gpu/ab_bench.sh REV ROUNDS BENCH_ARGS...}
ROUNDS=${2:?usage: bash bench/gpu/ab_bench.sh REV ROUNDS BENCH_ARGS...}
shift 2
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/mxcomm/gpu-ab-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
tmp=$(mktemp -d /tmp/mxcomm-ab-bench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
if [[ -d $REV/mxcomm ]]; then
  cp -r "$REV"/. "$tmp" || exit 1
else
  git archive "$REV" mxcomm csrc | tar -x -C "$tmp" || exit 1  # (csrc: the CUDA sources the put path builds)
fi
source bench/gpu/env.sh $((4 << 30)) || exit 1
here=$PYTHONPATH
: > "$OUT/ab.txt"
rc=0
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    pkg=$([[ $side == old ]] && echo "$tmp" || echo "$root")
    name="r${r}_$side"
    (cd /tmp && PYTHONPATH="$pkg:$here" timeout "${LIMIT:-150}" python3 -m mxcomm bench --no-progress --no-plot \
        --label "$name" --out "$OUT/$name" "$@") > "$OUT/$name.log" 2>&1
    code=$?
    where=$(cd /tmp && PYTHONPATH="$pkg:$here" python3 -c 'import mxcomm, os; print(os.path.dirname(mxcomm.__file__))')
    echo "=== $name ($([[ $side == old ]] && echo "$REV" || echo checkout): $where) rc=$code" | tee -a "$OUT/ab.txt"
    grep -E "^(dispatch|combine)|check vs" "$OUT/$name.log" | tee -a "$OUT/ab.txt"
    [[ $code -ne 0 ]] && rc=$code
  done
done
exit $rc
