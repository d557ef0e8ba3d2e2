#!/usr/bin/env bash
# The EP engine of another git revision against this checkout's, alternating, in one call on one GPU (H200):
#
#   bash bench/gpu/ab.sh REV [ROUNDS]       e.g. bash bench/gpu/ab.sh HEAD~3 2   (ROUNDS: default 1)
#   NEW=REV2 CASES=t4096_graph bash bench/gpu/ab.sh REV 2     two revisions, the 4096-token replays only
#   SWEEP="--ops combine_bwd --profile" CASES=t4096_graph bash bench/gpu/ab.sh A,B,C   a bisect: three revisions and
#                                                   the checkout, combine backward alone with rank 0's kernel table
#
# Each round runs the sweep tool (python -m mxcomm.bench.tools.sweep: CUDA events, median of the iterations, the
# slowest rank; Triton plan, MXFP8) with REV's package (with each of REV's comma-separated revisions in turn), then
# with this checkout's (or NEW's); SWEEP's arguments are appended to every sweep's (the last word wins): four ranks on the GPU
# under MPS, the cases in CASES (default all three): t128_graph and t128 (128 tokens, dispatch and combine, graph
# replays and eager), t4096_graph (4096 tokens, the four ops, graph replays).
# A revision's `mxcomm` package is extracted with `git archive` into a temporary folder put first on PYTHONPATH, and
# every run starts in a neutral folder: `python -m` started from the repository root imports the checkout's package
# whatever PYTHONPATH says, and both sides would then be this checkout.
# Output: OUT (default ~/.cache/mxcomm/gpu-ab): a log per run and ab.txt, the SWEEP lines of every run in order.
set -uo pipefail
cd "$(dirname "$0")/../.."
REV=${1:?usage: bash bench/gpu/ab.sh REV [ROUNDS]}
ROUNDS=${2:-1}
CASES=${CASES:-t128_graph t128 t4096_graph}
for c in $CASES; do
  if [[ " t128_graph t128 t4096_graph " != *" $c "* ]]; then
    echo "ab.sh: unknown case $c (t128_graph, t128, t4096_graph)" >&2
    exit 2
  fi
done
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/mxcomm/gpu-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$PWD
IFS=, read -r -a listed <<< "$REV"
revs=()
for r in "${listed[@]}"; do [[ -n $r ]] && revs+=("$r"); done
(( ${#revs[@]} )) || { echo "ab.sh: no revision in '$REV'" >&2; exit 2; }
tmp=$(mktemp -d /tmp/mxcomm-ab.XXXXXX)
cleanup() { rm -rf "$tmp"; }
sides=()  # NAME=FOLDER: each revision's package in its own folder, then the checkout's (or NEW's)
for i in "${!revs[@]}"; do
  mkdir "$tmp/$i"
  git archive "${revs[$i]}" mxcomm | tar -x -C "$tmp/$i" || { cleanup; exit 1; }
  sides+=("old$i-${revs[$i]//[^A-Za-z0-9_.-]/_}=$tmp/$i")
done
if [[ -n ${NEW:-} ]]; then
  mkdir "$tmp/new"
  git archive "$NEW" mxcomm | tar -x -C "$tmp/new" || { cleanup; exit 1; }
  sides+=("new=$tmp/new")
else
  sides+=("new=$root")
fi
read -r -a extra <<< "${SWEEP:-}"
source bench/gpu/env.sh $((4 << 30)) || { cleanup; exit 1; }
here=$PYTHONPATH
mxcomm_mps_start 4 || { cleanup; exit 1; }
trap 'mxcomm_mps_stop; cleanup' EXIT
sweep() {  # sweep NAME PYPATH ARGS...: one sweep run from a neutral folder
  local name=$1 path=$2
  shift 2
  (cd /tmp && PYTHONPATH=$path timeout 240 torchrun --nproc-per-node 4 -m mxcomm.bench.tools.sweep \
      --precision mxfp8 --plan-impl triton "$@" "${extra[@]}") > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$?"
  grep "^SWEEP" "$OUT/$name.log" | sed "s/^/$name /" | tee -a "$OUT/ab.txt"
  # with --profile: rank 0's kernel table(s), indented under the run's name
  sed -n '/^--- profile/,/^$/p' "$OUT/$name.log" | head -n 40 | sed 's/^/    /' | tee -a "$OUT/ab.txt"
}
: > "$OUT/ab.txt"
for r in $(seq 1 "$ROUNDS"); do
  for entry in "${sides[@]}"; do
    side=${entry%%=*}
    path="${entry#*=}:$here"
    for c in $CASES; do
      case $c in
        t128_graph) sweep "r${r}_${side}_$c" "$path" --tokens 128 --ops dispatch,combine --iters 60 --graph ;;
        t128) sweep "r${r}_${side}_$c" "$path" --tokens 128 --ops dispatch,combine --iters 60 ;;
        t4096_graph) sweep "r${r}_${side}_$c" "$path" --tokens 4096 --iters 20 --graph ;;
      esac
    done
  done
done
echo "results in $OUT/ab.txt"
