set -u
source bench/gpu/env.sh $((4<<30)) || exit 1
mkdir -p $OUT/r
timeout 90 python3 -m mxcomm.bench.tools.trace --tokens 128 --ops dispatch,combine --conditions > $OUT/r/trace1_t128.log 2>&1
echo "trace1 rc=$? ($SECONDS s)"
timeout 120 python3 -m pytest -q -m "nvshmem or gpu" -p no:cacheprovider -k "soak_1000" tests/ep/test_nvshmem_gpu.py > $OUT/r/soak.log 2>&1
echo "soak rc=$? ($SECONDS s)"; tail -2 $OUT/r/soak.log
if mxcomm_mps_start 4; then
  timeout 130 python3 -m pytest -q -m nvshmem -p no:cacheprovider -k "put_path_four_ranks_one_gpu_mps" tests/ep/test_nvshmem_gpu.py > $OUT/r/put4.log 2>&1
  echo "put4 rc=$? ($SECONDS s)"; tail -2 $OUT/r/put4.log
  timeout 60 torchrun --nproc-per-node 4 -m mxcomm.bench.tools.trace --tokens 128 --ops dispatch,combine --no-cprofile > $OUT/r/trace4_t128.log 2>&1
  echo "trace4 rc=$? ($SECONDS s)"
  timeout $((560 - SECONDS)) python3 -m pytest -q -m nvshmem -p no:cacheprovider tests/ep/test_faults_gpu.py > $OUT/r/faults.log 2>&1
  echo "faults rc=$? ($SECONDS s)"; tail -3 $OUT/r/faults.log
  mxcomm_mps_stop
fi
