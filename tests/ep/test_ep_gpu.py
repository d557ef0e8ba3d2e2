"""GPU checks of the shared plan and the torch reference backend (run on an H200:
``python -m pytest -m "gpu or nvshmem" tests/ep``)."""
import pytest
import torch

from _dist import run_world
from ep_cases import gpu_cases_worker
from mxcomm.ep import build_plan, local_counts, recv_rows

pytestmark = pytest.mark.gpu

# NVLink multicast stays off on the shared GPU hosts (see shared/GPU.md).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _assert_clean(results):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    assert all(r["combine_checks"] > 0 for r in results)


def test_plan_on_cuda_has_no_host_sync_and_matches_cpu():
    g = torch.Generator().manual_seed(0)
    W, El, k, T = 4, 3, 4, 300
    E = W * El
    idxs = [torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k] for _ in range(W)]
    idxs[1][::3, 1] = -1
    cpu_counts = torch.stack([local_counts(i, E) for i in idxs])
    dev = torch.device("cuda")
    gpu_idx = [i.to(dev) for i in idxs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = torch.stack([local_counts(i, E) for i in gpu_idx])
        plans = [build_plan(counts, gpu_idx[s], s, 128) for s in range(W)]
        rows = [recv_rows(p, 4 * T * k) for p in plans]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s in range(W):
        ref = build_plan(cpu_counts, idxs[s], s, 128)
        for name in ("dest_rank", "dest_row", "send_pos", "send_order", "offs", "src_row_start", "src_send_pos",
                     "expert_counts", "recv_splits", "send_splits", "num_rows"):
            a = getattr(plans[s], name)
            assert a.is_cuda and a.dtype == torch.int32 and torch.equal(a.cpu(), getattr(ref, name)), name
        assert torch.equal(rows[s].cpu(), recv_rows(ref, 4 * T * k))


def test_reference_cuda_tensors_one_rank_nccl():
    _assert_clean(run_world(1, gpu_cases_worker, backend="nccl", env=GPU_ENV, timeout=300))


def test_reference_cuda_tensors_two_ranks_gloo_one_gpu():
    """Two ranks sharing one GPU (NCCL refuses that): gloo stages CUDA tensors through the host."""
    _assert_clean(run_world(2, gpu_cases_worker, backend="gloo", env=GPU_ENV, timeout=300))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_reference_nccl_two_gpus():
    _assert_clean(run_world(2, gpu_cases_worker, backend="nccl", env=GPU_ENV, timeout=300))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs for NCCL")
def test_reference_nccl_four_gpus():
    _assert_clean(run_world(4, gpu_cases_worker, backend="nccl", env=GPU_ENV, timeout=300))
