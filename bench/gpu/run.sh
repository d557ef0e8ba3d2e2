#!/usr/bin/env bash
# GPU test suites and benchmarks in one call: set up the environment (bench/gpu/env.sh: wheels from .whl/,
# NVLink multicast off), print the machine, then run the stages asked for.
#
#   bash bench/gpu/run.sh STAGES [extra mxcomm bench options...]      STAGES: comma list, e.g. tests,loopback
#
# Stages:
#   tests     GPU tests: gpu/nvshmem-marked suites (GPU_TEST_WORKERS in parallel), the device-agnostic kernel tests on
#             CUDA, the mpirun NVSHMEM tests (serial), the put-signal transport tests (own MPS), then the 4-rank EP
#             tests and the fault tests (killed rank, bad ids, soak: 10000 calls per world or MXCOMM_SOAK_S seconds,
#             default 170)
#             under MPS (started and stopped here); TEST_K: extra pytest -k expression
#   cli       the nvshmem-marked CLI tests (tests/test_cli.py)
#   loopback  mxcomm bench, 1 rank: 8192 tokens x 7168, top-8, 256 experts (the GPU's own memory, no NVLink)
#   shared2   mxcomm bench, 2 ranks on one GPU under MPS (--mps start): protocol and traffic floor, NOT NVLink
#   shared4   mxcomm bench, 4 ranks on one GPU under MPS (1/4 of the SMs each, by MPS): protocol and floor, NOT NVLink
#   multi     mxcomm bench, one rank per visible GPU (NVLink), 4096 and 8192 tokens (needs 2+ GPUs)
#   latency   mxcomm bench, one rank per visible GPU, 128 tokens, mxcomm timed as CUDA graph replays
#   lab       the EP kernel lab (bench/bench_ep_kernels.py) and the loopback profile (bench/bench_ep_loopback.py)
#   quantize  the quantize kernel benchmark (bench/bench_quantize.py)
#   trace     where an eager call's time goes (python -m mxcomm.bench.tools.trace): 1 rank at 128 and 8192 tokens,
#             4 ranks on one GPU under MPS at 128 and 4096 tokens (TRACE_OPS: ops, default all four); host costs
#   all       tests, loopback, shared2, shared4, multi (when there are 2+ GPUs)
#
# Output: OUT (default ~/.cache/mxcomm/gpu-run): one folder per benchmark (JSON, table, PNGs) and a log per stage.
# Limits: BENCH_LIMIT (s per benchmark, default 540), GPU_TEST_TIMEOUT (540), UNMARKED_TIMEOUT (300), MPIRUN_TIMEOUT (300),
# TRANSPORT_TIMEOUT (200), MPS_TIMEOUT (570).
set -uo pipefail
cd "$(dirname "$0")/../.."
stages=${1:-all}
shift || true
[[ $stages == all ]] && stages=tests,loopback,shared2,shared4,multi
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/mxcomm/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/gpu/env.sh $((3 << 30)) || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" \
    | tee -a "$OUT/gpu.txt"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sms=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')
has() { [[ ",$stages," == *",$1,"* ]]; }
rc=0
note() {  # note NAME RC: report a stage's exit status and keep the worst
  echo "=== $1 rc=$2"
  [[ $2 -ne 0 ]] && rc=$2
}

bench() {  # bench LABEL ARGS...: one `mxcomm bench` run into $OUT/bench_LABEL
  local label=$1
  shift
  echo "=== mxcomm bench $label: $*"
  timeout "${BENCH_LIMIT:-540}" python3 -m mxcomm bench --label "$label" --out "$OUT/bench_$label" --no-progress "$@" \
      2>&1 | tee "$OUT/bench_$label.log" | tail -60
  note "bench $label" "${PIPESTATUS[0]}"
}

if has tests; then
  # Tests that start MPS (4 ranks) run alone afterwards; the rest in parallel (GPU_TEST_WORKERS, pytest-xdist).
  # mpirun NVSHMEM jobs run serially afterwards: next to many parallel NVSHMEM jobs one once died in NVSHMEM's
  # start-up ("Failed to open shared memory slab").
  kexpr=${TEST_K:-}
  k=(-k "not four_ranks and not mps and not faults_gpu and not mpirun_nvshmem${kexpr:+ and ($kexpr)}")
  par=()
  [[ ${GPU_TEST_WORKERS:-4} -gt 1 ]] && python3 -c 'import xdist' 2>/dev/null && par=(-n "${GPU_TEST_WORKERS:-4}")
  timeout "${GPU_TEST_TIMEOUT:-540}" python3 -m pytest -q -rs -m "gpu or nvshmem" -p no:cacheprovider "${par[@]}" "${k[@]}" \
      tests/kernels tests/ep tests/transport tests/gemm tests/mpi tests/nn tests/integrations tests/test_cli.py tests/bench 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -60
  note "gpu tests" "${PIPESTATUS[0]}"
  # Device-agnostic kernel tests (unmarked: on CUDA when there is a GPU, under the interpreter otherwise).
  timeout "${UNMARKED_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider "${par[@]}" -m "not gpu and not nvshmem" \
      ${kexpr:+-k "$kexpr"} tests/kernels tests/ep/test_plan_kernels.py tests/gemm 2>&1 \
      | tee "$OUT/gpu_tests_unmarked.log" | tail -15
  note "device-agnostic kernel tests on the GPU" "${PIPESTATUS[0]}"
  timeout "${MPIRUN_TIMEOUT:-300}" python3 -m pytest -q -m nvshmem -p no:cacheprovider -k "mpirun_nvshmem${kexpr:+ and ($kexpr)}" tests/mpi 2>&1 \
      | tee "$OUT/gpu_tests_mpirun.log" | tail -15
  r=${PIPESTATUS[0]}; [[ $r -eq 5 ]] && r=0  # 5: none collected
  note "gpu tests (mpirun nvshmem, serial)" "$r"
  timeout "${TRANSPORT_TIMEOUT:-200}" python3 -m pytest -q -m nvshmem -p no:cacheprovider -k "under_mps${kexpr:+ and ($kexpr)}" tests/transport 2>&1 \
      | tee "$OUT/gpu_tests_transport_mps.log" | tail -15
  note "gpu tests (transport/put-signal, own MPS)" "${PIPESTATUS[0]}"
  if mxcomm_mps_start 4; then  # 4 ranks of the EP tests need MPS
    MXCOMM_SOAK_S=${MXCOMM_SOAK_S:-170} timeout "${MPS_TIMEOUT:-570}" python3 -m pytest -q -rA -m nvshmem -p no:cacheprovider \
        -k "(four_ranks or mps or faults_gpu) and not under_mps${kexpr:+ and ($kexpr)}" tests/ep tests/mpi 2>&1 \
        | tee "$OUT/gpu_tests_mps.log" | tail -15
    r=${PIPESTATUS[0]}
    mxcomm_mps_stop
    note "gpu tests (4 ranks, MPS)" "$r"
  else
    note "gpu tests (4 ranks, MPS): MPS did not start" 1
  fi
fi
if has cli; then
  timeout 560 python3 -m pytest -q -m nvshmem -p no:cacheprovider tests/test_cli.py 2>&1 | tee "$OUT/cli_gpu_tests.log" | tail -30
  note "cli gpu tests" "${PIPESTATUS[0]}"
fi
has loopback && bench h200-loopback-t8192 --ranks 1 --tokens 8192 --hidden 7168 --topk 8 --experts 256 "$@"
has shared2 && bench h200-2ranks-1gpu-mps --ranks 2 --ranks-per-gpu 2 --mps start --tokens 4096 "$@"
has shared4 && bench h200-4ranks-1gpu-mps --ranks 4 --ranks-per-gpu 4 --mps start --tokens 4096 "$@"
if has multi; then
  if [[ $ngpu -ge 2 ]]; then
    bench "h200x${ngpu}-ep${ngpu}" --tokens 4096,8192 "$@"
  else
    echo "multi: needs 2+ GPUs (found $ngpu), skipped"
  fi
fi
has latency && bench "h200x${ngpu}-ep${ngpu}-latency" --mode latency --cuda-graph --iters 100 "$@"
if has lab; then
  timeout 240 python3 bench/bench_ep_kernels.py --programs 16,tokens --warps 4 --chunks 2048,4096 \
      --ops dispatch,naive,reduce --iters 20 --out "$OUT/ep_kernels.json" 2>&1 | tee "$OUT/ep_kernels.log" | tail -30
  note "lab (ep kernels)" "${PIPESTATUS[0]}"
  # the loopback lab holds 4 groups of the 8192x7168 top-8 config
  NVSHMEM_SYMMETRIC_SIZE=24G timeout 300 python3 bench/bench_ep_loopback.py --profile --out "$OUT/ep_loopback.json" \
      2>&1 | tee "$OUT/ep_loopback.log" | tail -40
  note "lab (ep loopback)" "${PIPESTATUS[0]}"
fi
if has quantize; then
  timeout 300 python3 bench/bench_quantize.py --out "$OUT/quantize.json" 2>&1 | tee "$OUT/quantize.log" | tail -30
  note "quantize" "${PIPESTATUS[0]}"
fi
if has trace; then
  timeout 120 python3 -m mxcomm.bench.tools.host_costs 2>&1 | tee "$OUT/host_costs.log" | tail -20
  for t in 128 8192; do
    timeout 200 python3 -m mxcomm.bench.tools.trace --tokens $t --no-cprofile --ops "${TRACE_OPS:-dispatch,combine,combine_bwd,dispatch_bwd}" \
        > "$OUT/trace_1rank_t$t.log" 2>&1
    note "trace 1 rank, $t tokens" $?
  done
  if mxcomm_mps_start 4; then
    for t in 128 4096; do
      timeout 240 torchrun --nproc-per-node 4 -m mxcomm.bench.tools.trace --tokens $t --no-cprofile \
          --ops "${TRACE_OPS:-dispatch,combine,combine_bwd,dispatch_bwd}" > "$OUT/trace_4ranks_t$t.log" 2>&1
      note "trace 4 ranks (MPS), $t tokens" $?
    done
    mxcomm_mps_stop
  fi
  grep -h "===" "$OUT"/trace_*.log
fi
echo "results in $OUT"
exit $rc
