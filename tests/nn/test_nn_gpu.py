"""GPU runs of the MoE layer (NOT run on CPU: marked ``gpu`` / ``nvshmem``, skipped without a GPU).

CUDA tensors select the GPU paths by device: Triton SwiGLU+quantize (``swiglu_impl="auto"``), Triton
quantize/dequantize inside the grouped GEMMs and weight caches, the grouped-GEMM backend by compute capability
(native ``torch._scaled_grouped_mm`` on sm_100/103 only, ``dequant`` on sm_90), BF16 ``torch._grouped_mm``.
Outputs and every gradient are compared, over the whole world, with the float64 reference on the CPU using the
thresholds of test_nn_moe.py (plain reference and the simulated-rounding reference).

    python -m pytest -q -m gpu tests/nn/test_nn_gpu.py        # reference EP backend (NCCL world 1, gloo 2 ranks)
    source bench/gpu/env.sh && python -m pytest -q -m nvshmem tests/nn/test_nn_gpu.py   # nvshmem EP backend
"""
import pytest
import torch

from _dist import run_world
from nn_cases import GRAD_KEYS, NNCase, gather_world, global_weights, gpu_extras_worker, inputs, reference_step, \
    sqnr_db, world_worker
from test_nn_moe import _want

# NVLink multicast stays off on the shared GPU hosts (see shared/GPU.md).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _cases(world: int) -> list:
    def T(*per):
        return tuple(per[r % len(per)] for r in range(world))

    return [
        NNCase("gpu_bf16_shared", "bf16", tokens=T(200, 130), dim=128, ffn_dim=256, shared_ffn_dim=128, seed=41),
        NNCase("gpu_mx_shared_aux", "mxfp8", tokens=T(256, 77), dim=128, ffn_dim=256, shared_ffn_dim=128,
               aux_loss_coef=0.01, seed=42),
        NNCase("gpu_mx_floor_sigmoid", "mxfp8", tokens=T(96, 0), dim=256, ffn_dim=128, num_experts=16, topk=4,
               scale_mode="floor", score_func="sigmoid", route_scale=2.5, seed=43),
    ]


def _check(results: list, cases: list) -> None:
    report, bad = [], []
    for case in cases:
        w, inp = global_weights(case), inputs(case)
        x, G = torch.cat(inp["xs"]), torch.cat(inp["gs"])
        idx = gather_world(case, results, "idx")
        refs = {"ref": reference_step(case, w, x, G, topk_idx=idx),
                "sim": reference_step(case, w, x, G, topk_idx=idx, simulate=True, ep_size=len(results))}
        for key in ("y",) + GRAD_KEYS:
            if results[0][case.name].get(key) is None:
                continue
            got = gather_world(case, results, key)
            for kind, ref in refs.items():
                db, want = sqnr_db(got, ref[key]), _want(case, kind, key)
                report.append(f"{case.name}.{key} vs {kind}: {db:.1f} dB (want >= {want})")
                if db < want:
                    bad.append(report[-1])
    print("\n".join(report))
    assert not bad, "\n".join(bad)


def _nvshmem_env():
    from mxcomm.transport import launcher_env

    env = dict(GPU_ENV)
    env.update(launcher_env(2 << 30))
    return env


@pytest.mark.gpu
def test_layer_cuda_one_rank_nccl():
    res = run_world(1, world_worker, _cases(1), "cuda", "torch", backend="nccl", env=GPU_ENV, timeout=600)
    _check(res, _cases(1))


@pytest.mark.gpu
def test_layer_cuda_two_ranks_gloo():
    res = run_world(2, world_worker, _cases(2), "cuda", "torch", backend="gloo", env=GPU_ENV, timeout=600)
    _check(res, _cases(2))


@pytest.mark.gpu
def test_swiglu_kernel_path_and_cache_refresh_on_cuda():
    res = run_world(1, gpu_extras_worker, backend="nccl", env=GPU_ENV, timeout=600)
    assert not res[0]["failures"], "\n".join(res[0]["failures"])


@pytest.mark.nvshmem
@pytest.mark.parametrize("world", [1, 2])
def test_layer_nvshmem_backend(world):
    res = run_world(world, world_worker, _cases(world), "cuda", "nvshmem", env=_nvshmem_env(), timeout=900)
    _check(res, _cases(world))
