#!/usr/bin/env bash
# One device call on a machine with one or more GPUs: EP benchmarks through `mxcomm bench` and the GPU
# test suite, with what comes back kept to a few files (the device tool returns at most 8):
#
#   bash scripts/gpu_multi.sh [STEPS]     STEPS: comma list of bench,latency,tests,profile (default all)
#
#   bench    one rank per GPU, 4096 and 8192 tokens, forward + backward, MXFP8 + BF16 + baselines (eager)
#   latency  one rank per GPU, 128 tokens, mxcomm timed as CUDA graph replays (--cuda-graph)
#   tests    scripts/gpu_check.sh tests (GPU_TEST_WORKERS in parallel, then the MPS ones)
#   profile  kernel-time table of one rank's dispatch/combine (bench/bench_ep_loopback.py --profile)
#
# Results: $OUT/<label>.json per benchmark, $OUT/console.log (tables, summaries), $OUT/tests.log.
# Limits per step: BENCH_S (default 230), LAT_S (120), TEST_S (230) seconds. Extra `mxcomm bench`
# options for both benchmarks: BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-bench,latency,tests,profile}
FINAL=${OUT:-/tmp/mxcomm-final}
WORK=/tmp/mxcomm-work
mkdir -p "$FINAL" "$WORK"
export PYTHONUNBUFFERED=1
log="$FINAL/console.log"
has() { [[ ",$steps," == *",$1,"* ]]; }
rc=0
if has bench; then
  OUT=$WORK BENCH_LIMIT=${BENCH_S:-230} bash bench/run_ep_bench.sh multi --iters 20 ${BENCH_ARGS:-} >>"$log" 2>&1 || rc=1
fi
if has latency; then
  OUT=$WORK BENCH_LIMIT=${LAT_S:-120} bash bench/run_ep_bench.sh latency --cuda-graph --iters 100 ${BENCH_ARGS:-} \
      >>"$log" 2>&1 || rc=1
fi
if has profile; then
  (source scripts/gpu_env.sh 0 && NVSHMEM_SYMMETRIC_SIZE=24G timeout 120 python3 bench/bench_ep_loopback.py --profile) \
      >>"$log" 2>&1 || rc=1
fi
if has tests; then
  OUT=$WORK GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-6} GPU_TEST_TIMEOUT=${TEST_S:-230} bash scripts/gpu_check.sh tests \
      >>"$log" 2>&1 || rc=1
  cat "$WORK"/gpu.txt "$WORK"/gpu_tests*.log >"$FINAL/tests.log" 2>/dev/null
fi
for f in "$WORK"/bench_*/*.json; do [[ -e $f ]] && cp "$f" "$FINAL/"; done
echo "gpu_multi.sh rc=$rc" | tee -a "$log"
exit $rc
