# shellcheck shell=bash
# Environment for mxcomm on a GPU machine. SOURCE it from anywhere (it finds the repository itself):
#
#   source bench/gpu/env.sh [HEAP_BYTES]     # HEAP_BYTES: symmetric bytes per rank (default 0 -> 256M heap)
#   python3 -m pytest -m nvshmem tests/transport
#
# What it does:
#   1. installs the wheels in .whl/ built for this Python (e.g. nvshmem4py-cu13 on a machine without a package
#      registry; the folder is git-ignored) into /tmp/site with --no-index --no-deps, and puts /tmp/site and the
#      repository on PYTHONPATH;
#   2. exports mxcomm.transport.launcher_env(HEAP_BYTES): NVLink multicast off
#      (NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0), single node
#      (NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1) and NVSHMEM_SYMMETRIC_SIZE;
#   3. defines mxcomm_mps_start [NRANKS] / mxcomm_mps_stop for several ranks on one GPU under MPS
#      (pipe/log folders under /tmp; always stop it at the end of the command). `mxcomm bench --mps start` does the
#      same for one benchmark run by itself.
# The transport tests start (and stop) their own MPS daemon for the 4-rank case: do not start one before them.

_mx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
_mx_py=${PYTHON:-python3}

# Only the wheels this interpreter can install (its cpXY tag, or pure Python): .whl/ may hold builds for several
# Pythons (e.g. cp311 for a CPU machine, cp312 for a GPU machine); a skipped one is named with how to fetch the right one.
_mx_tag=$("$_mx_py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
_mx_whls=()
for _mx_w in "$_mx_root"/.whl/*.whl; do
  [[ -e $_mx_w ]] || continue
  case ${_mx_w##*/} in
    *-"$_mx_tag"-*|*-py3-none-*|*-py2.py3-none-*) _mx_whls+=("$_mx_w") ;;
    *) echo "env.sh: skipped ${_mx_w##*/} (not for $_mx_tag; e.g. pip download --no-deps --only-binary=:all:" \
            "--python-version ${_mx_tag:2:1}.${_mx_tag:3} -d .whl nvshmem4py-cu13)" >&2 ;;
  esac
done
if [[ ${#_mx_whls[@]} -gt 0 ]]; then
  "$_mx_py" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "${_mx_whls[@]}" \
    || { echo "env.sh: installing ${_mx_whls[*]} failed" >&2; return 1; }
else
  echo "env.sh: no wheels for $_mx_tag in $_mx_root/.whl; nvshmem4py may be missing" >&2
fi
unset _mx_tag _mx_whls _mx_w
export PYTHONPATH="/tmp/site:$_mx_root${PYTHONPATH:+:$PYTHONPATH}"

_mx_exports=$("$_mx_py" -c '
import sys
from mxcomm.transport.env import launcher_env
for k, v in launcher_env(int(sys.argv[1])).items():
    print(f"export {k}={v}")
' "${1:-0}") || { echo "env.sh: could not compute the environment from mxcomm.transport.env" >&2; return 1; }
eval "$_mx_exports"
unset _mx_exports

# Start an MPS control daemon for NRANKS ranks on one GPU (each gets 100/NRANKS % of the SMs).
mxcomm_mps_start() {
  local nranks=${1:-4}
  local dir=/tmp/mxcomm-mps
  export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / nranks))
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "mxcomm_mps_start: could not start the MPS daemon" >&2; return 1; }
  local i
  for i in $(seq 100); do
    echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "mxcomm_mps_start: MPS daemon does not answer" >&2
  return 1
}

# Stop the daemon started by mxcomm_mps_start and drop the client variables.
mxcomm_mps_stop() {
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
}
