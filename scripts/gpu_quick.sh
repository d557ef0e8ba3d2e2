#!/usr/bin/env bash
# One short call on the GPU machine for EP kernel work: the kernel lab, the core nvshmem EP tests (1 and 2 ranks on
# one GPU, every transport), and the loopback `mxcomm bench` of dispatch/combine for each transport.
#
#   bash scripts/gpu_quick.sh [lab,tests,bench]  (default all three; $OUT gets the JSON and logs)
#   env: LAB_PROGRAMS, LAB_CHUNKS, LAB_OPS (kernel lab), GPU_TESTS, GPU_MARK, TESTS_LIMIT (tests), BENCH_TRANSPORTS,
#        BENCH_IMPLS, BENCH_OPS (bench)
#
# Needs the nvshmem4py wheel in .whl/ (carry it with the call).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-lab,tests,bench}
OUT=${OUT:-/tmp/mxcomm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh 0 >/dev/null || exit 1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
rc=0
if [[ $what == *lab* ]]; then
  timeout 240 python3 bench/bench_ep_kernels.py --programs ${LAB_PROGRAMS:-16,tokens} --warps 4 \
      --chunks ${LAB_CHUNKS:-2048,4096} --ops ${LAB_OPS:-dispatch,naive,reduce} --iters 20 \
      --out "$OUT/ep_kernels.json" > "$OUT/ep_kernels.log" 2>&1
  r=$?; echo "lab rc=$r"; [[ $r -ne 0 ]] && { tail -5 "$OUT/ep_kernels.log"; rc=$r; }
  python3 - "$OUT/ep_kernels.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"copy ceiling {d.get('copy_ceiling_gbps', 0):.0f} GB/s")
for r in d["results"]:
    p = ",".join(f"{k}={r[k]}" for k in ("programs", "warps", "chunk", "scales", "word") if k in r)
    print(f"{r['op']:14s} {r['impl'][-14:]:14s} {p:40s} {r['us']:8.1f} us {100 * r.get('vs_copy_ceiling', 0):5.1f}% ok={r['correct']}")
PY
fi
if [[ $what == *tests* ]]; then
  # GPU_TESTS: test files (default: the core nvshmem EP tests)
  timeout ${TESTS_LIMIT:-420} python3 -m pytest -q -m "${GPU_MARK:-nvshmem}" -p no:cacheprovider -n 4 ${GPU_TESTS:-tests/ep/test_nvshmem_gpu.py} \
      -k "not four_ranks and not soak" 2>&1 | tee "$OUT/tests.log" | tail -8
  r=${PIPESTATUS[0]}; echo "tests rc=$r"; [[ $r -ne 0 ]] && rc=$r
fi
if [[ $what == *bench* ]]; then
  # BENCH_TRANSPORTS: transports to run, each optionally with "+graph" (mxcomm calls timed as CUDA graph replays)
  for run in ${BENCH_TRANSPORTS:-auto push auto+graph}; do
    tr=${run%+graph}; extra=(); label=$tr
    [[ $run == *+graph ]] && { extra=(--cuda-graph); label=$tr-graph; }
    impls=mxcomm; [[ $run == auto ]] && impls=${BENCH_IMPLS:-mxcomm,reference,a2a}
    timeout 300 python3 -m mxcomm bench --ranks 1 --tokens 8192 --hidden 7168 --topk 8 --experts 256 \
        --ops ${BENCH_OPS:-dispatch,combine} --impls "$impls" --transport "$tr" --iters 10 --warmup 3 --no-progress \
        --label "loopback-$label" --out "$OUT/bench_$label" "${extra[@]}" > "$OUT/bench_$label.log" 2>&1
    r=$?; echo "bench $run rc=$r"; [[ $r -ne 0 ]] && { rc=$r; tail -5 "$OUT/bench_$label.log"; }
    grep -E "^(dispatch|combine)|ceiling|check vs" "$OUT/bench_$label.log" | head -30
  done
fi
exit $rc
