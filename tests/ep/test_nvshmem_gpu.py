"""GPU tests of the nvshmem backend: several ranks on ONE GPU (GPU.md), each rank's dispatch output
bit-exact against the single-process oracle (payload, scales, offs, counts) and combine within fp32
reduction-order tolerance. Run on the H200 with nvshmem4py importable:
``python -m pytest -m nvshmem tests/ep``."""
import os
import shutil

import pytest
import torch

from _dist import run_world
from ep_cases import nvshmem_cases_worker, nvshmem_replay_worker, nvshmem_soak_worker
from mxcomm.transport import launcher_env

pytestmark = pytest.mark.nvshmem

ENV = launcher_env(2 << 30)


def _assert_clean(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    assert all(r["combine_checks"] > 0 for r in results)


def test_nvshmem_one_rank():
    _assert_clean(run_world(1, nvshmem_cases_worker, 10, env=ENV, timeout=900))


def test_nvshmem_two_ranks_one_gpu():
    _assert_clean(run_world(2, nvshmem_cases_worker, 10, env=ENV, timeout=900))


def _mps_running() -> bool:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return bool(pipe) and os.path.exists(os.path.join(pipe, "control")) and shutil.which("nvidia-cuda-mps-control")


@pytest.mark.skipif(not _mps_running(), reason="4 ranks on one GPU need an MPS daemon (CUDA_MPS_PIPE_DIRECTORY)")
def test_nvshmem_four_ranks_one_gpu_mps():
    env = dict(ENV, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25")
    _assert_clean(run_world(4, nvshmem_cases_worker, 4, env=env, timeout=900))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (one rank per GPU, over NVLink)")
@pytest.mark.parametrize("transport", ["auto", "push", "put"])
def test_nvshmem_four_ranks_four_gpus(transport):
    _assert_clean(run_world(4, nvshmem_cases_worker, 4, transport, env=ENV, timeout=900))


def test_nvshmem_soak_1000_iterations_no_corruption_no_memory_growth():
    _assert_clean(run_world(1, nvshmem_soak_worker, 1000, env=ENV, timeout=900))


@pytest.mark.parametrize("world,transport", [(1, "auto"), (2, "auto"), (2, "guessed"), (2, "staged"), (2, "push")])
def test_nvshmem_replayed_dispatches_and_old_handles_stay_exact(world, transport):
    """Dispatches replayed from a captured graph (one token count: the whole call on one rank and on the pull path;
    ``guessed``: the pull path above ``peer_call_tokens``, its output sized from the call before, so the routing
    that sends every token to one expert overflows it and is gathered after the sync; ``staged``: the pull path
    with ``peer_guess_pct=0`` too, its middle captured alone, as the push path's) are exact, a bad id on a replay
    raises, and handles of earlier dispatches still combine exactly after later replays (their plans are the
    caller's copies)."""
    _assert_clean(run_world(world, nvshmem_replay_worker, transport, env=ENV, timeout=600))


# The push dispatch (EPConfig(transport="push"): rows stored into the receivers' buffers, then copied out), the
# design the default pull dispatch replaced; same cases, same oracle.
def test_nvshmem_push_dispatch_two_ranks_one_gpu():
    _assert_clean(run_world(2, nvshmem_cases_worker, 4, "push", env=ENV, timeout=900))


# The put-with-signal path (EPConfig(transport="put")): the path for peers on other nodes, forced on one GPU.
# Same cases, same single-process oracle: bit-exact dispatch, combine within fp32 reduction-order tolerance.
def test_nvshmem_put_path_one_rank():
    _assert_clean(run_world(1, nvshmem_cases_worker, 4, "put", env=ENV, timeout=900))


def test_nvshmem_put_path_two_ranks_one_gpu():
    _assert_clean(run_world(2, nvshmem_cases_worker, 4, "put", env=ENV, timeout=900))


@pytest.mark.parametrize("transport", ["push", "put"])
def test_nvshmem_two_ranks_one_gpu_dispatch_in_rounds(transport):
    """The push and put dispatches through a receive window of 40 rows: most cases move in several rounds."""
    _assert_clean(run_world(2, nvshmem_cases_worker, 2, transport, 40, env=ENV, timeout=900))


@pytest.mark.skipif(not _mps_running(), reason="4 ranks on one GPU need an MPS daemon (CUDA_MPS_PIPE_DIRECTORY)")
def test_nvshmem_put_path_four_ranks_one_gpu_mps():
    env = dict(ENV, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25")
    _assert_clean(run_world(4, nvshmem_cases_worker, 2, "put", env=env, timeout=900))
