"""GPU runs of the backward / autograd checks (same cases as test_autograd.py, CUDA tensors).

Reference backend: ``python -m pytest -m gpu tests/ep/test_autograd_gpu.py``.
nvshmem backend (needs EPGroup's backend to implement combine_for_backward / combine_backward /
dispatch_backward, see mxcomm/ep/group.py): ``python -m pytest -m nvshmem tests/ep/test_autograd_gpu.py``.
"""
import pytest
import torch

from _dist import run_world
from autograd_cases import gpu_world_worker
from test_autograd import _check_world
from autograd_cases import moe_cases

# NVLink multicast stays off on the shared GPU hosts (see shared/GPU.md).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _nvshmem_env():
    from mxcomm.transport import launcher_env

    return launcher_env(2 << 30)


@pytest.mark.gpu
def test_reference_backward_cuda_one_rank_nccl():
    res = run_world(1, gpu_world_worker, "torch", backend="nccl", env=GPU_ENV, timeout=600)
    _check_world(res, moe_cases(1, seed=3))


@pytest.mark.gpu
def test_reference_backward_cuda_two_ranks_gloo_one_gpu():
    res = run_world(2, gpu_world_worker, "torch", backend="gloo", env=GPU_ENV, timeout=600)
    _check_world(res, moe_cases(2, seed=3))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_reference_backward_nccl_two_gpus():
    res = run_world(2, gpu_world_worker, "torch", backend="nccl", env=GPU_ENV, timeout=600)
    _check_world(res, moe_cases(2, seed=3))


@pytest.mark.nvshmem
def test_nvshmem_backward_one_rank():
    res = run_world(1, gpu_world_worker, "nvshmem", env=_nvshmem_env(), timeout=900)
    _check_world(res, moe_cases(1, seed=3))


@pytest.mark.nvshmem
def test_nvshmem_backward_two_ranks_one_gpu():
    res = run_world(2, gpu_world_worker, "nvshmem", env=_nvshmem_env(), timeout=900)
    _check_world(res, moe_cases(2, seed=3))


@pytest.mark.nvshmem
@pytest.mark.parametrize("world", [1, 2])
def test_nvshmem_backward_with_an_sm_budget(world):
    """EPConfig(num_sms=8): grids sized for 8 SMs (per_sm * 8 programs, other launch counts than the default); the
    same cases match."""
    res = run_world(world, gpu_world_worker, "nvshmem", None, "auto", 8, env=_nvshmem_env(), timeout=900)
    _check_world(res, moe_cases(world, seed=3))


@pytest.mark.nvshmem
def test_nvshmem_put_path_backward_two_ranks_one_gpu():
    """The put-with-signal path (transport="put") through every backward op and the MoE block."""
    res = run_world(2, gpu_world_worker, "nvshmem", None, "put", env=_nvshmem_env(), timeout=900)
    _check_world(res, moe_cases(2, seed=3))
