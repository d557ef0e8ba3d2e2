#!/usr/bin/env bash
# EP dispatch/combine benchmarks on the GPU machine through `mxcomm bench` (results: JSON, table, PNGs).
#
#   bash bench/run_ep_bench.sh [loopback|shared2|shared4|multi|gputest|all] [extra mxcomm bench options...]
#
#   loopback: 1 rank, 8192 tokens x 7168, top-8, 256 experts (all local): the GPU's own memory, no NVLink
#   shared2:  2 ranks on one GPU (gloo side channel, no MPS): protocol check, NOT an NVLink measurement
#   shared4:  4 ranks on one GPU under MPS (25 % of the SMs each): protocol check, NOT an NVLink measurement
#   multi:    one rank per visible GPU (NVLink), 4096 and 8192 tokens
#   latency:  one rank per visible GPU, latency mode (128 tokens)
#   gputest:  the nvshmem-marked CLI tests (tests/test_cli.py)
#   all:      loopback, shared2, shared4 (and multi when there are 2+ GPUs)
#
# Needs the nvshmem4py wheel in .whl/ (carry it with the call). Output goes to $OUT (default /tmp/mxcomm-out)
# under bench_<label>/; each run is bounded by `timeout`.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
OUT=${OUT:-/tmp/mxcomm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh 0 || exit 1   # wheels, PYTHONPATH, multicast off; mxcomm bench sizes the heap itself
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sms=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
rc=0

bench() {  # bench LABEL TIMEOUT_S ARGS...
  local label=$1 limit=$2
  shift 2
  echo "=== mxcomm bench $label: $*"
  timeout "${BENCH_LIMIT:-$limit}" python3 -m mxcomm bench --label "$label" --out "$OUT/bench_$label" --no-progress "$@" \
      2>&1 | tee "$OUT/bench_$label.log" | tail -60
  local r=${PIPESTATUS[0]}
  echo "=== $label rc=$r"
  [[ $r -ne 0 ]] && rc=$r
}

case $what in
  loopback|all)
    bench h200-loopback-t8192 540 --ranks 1 --tokens 8192 --hidden 7168 --topk 8 --experts 256 "$@" ;;
esac
case $what in
  shared2|all)
    bench h200-2ranks-1gpu 540 --ranks 2 --ranks-per-gpu 2 --tokens 4096 "$@" ;;
esac
case $what in
  shared4|all)
    if mxcomm_mps_start 4; then
      bench h200-4ranks-1gpu-mps 540 --ranks 4 --ranks-per-gpu 4 --tokens 4096 --num-sms $((sms / 4)) "$@"
      mxcomm_mps_stop
    else
      echo "shared4: MPS did not start"; rc=1
    fi ;;
esac
case $what in
  multi|all)
    if [[ $ngpu -ge 2 ]]; then
      bench "h200x${ngpu}-ep${ngpu}" 540 --tokens 4096,8192 "$@"
    elif [[ $what == multi ]]; then
      echo "multi: needs 2+ GPUs (found $ngpu)"; rc=1
    fi ;;
esac
if [[ $what == latency ]]; then
  bench "h200x${ngpu}-ep${ngpu}-latency" 540 --mode latency "$@"
fi
if [[ $what == gputest ]]; then
  timeout 560 python3 -m pytest -q -m nvshmem -p no:cacheprovider tests/test_cli.py 2>&1 | tee "$OUT/cli_gpu_tests.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
exit $rc
