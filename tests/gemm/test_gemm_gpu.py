"""GPU (H200, sm_90) checks of both emulated MXFP8 paths (``dequant``: Triton dequantize + BF16
``torch._grouped_mm``; ``triton``: in-load dequantize grouped GEMM) at model-like sizes against an fp64 oracle
on the dequantized operands, plus the BF16 GEMM, wgrad and autograd on the GPU. Run with
``python -m pytest -m gpu tests/gemm``."""
import pytest
import torch

from gemm_cases import INTERP, assert_close_gemm, fp32_grouped, fp32_wgrad, rand

from mxcomm import mx
from mxcomm.gemm import (
    GroupedGemmConfig,
    GroupedLinearConfig,
    MXWeightCache,
    grouped_linear,
    grouped_mm,
    grouped_mm_bf16,
    grouped_wgrad,
    select_backend,
    triton_grouped_mm,
)
from mxcomm.kernels import quantize_rows

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_kernels():
    if INTERP:
        pytest.fail("mxcomm.gemm was imported under TRITON_INTERPRET=1; run the GPU tests in a process without it")


def _offs(sizes, device="cuda"):
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


# (M_total, K, N, group sizes): unaligned sizes (not multiples of 16), an empty group, rows past the last group
SHAPES = [
    (4096, 4096, 1024, [700, 0, 1333, 511, 17, 900, 1, 600]),
    (2304, 7168, 2048, [129, 1000, 3, 1100]),
    (1024, 1536, 3072, [128] * 8),
]


@pytest.mark.parametrize("backend", ["dequant", "triton"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}" for s in SHAPES])
def test_gpu_emulated_paths_vs_fp64(shape, backend):
    M, K, N, sizes = shape
    G = len(sizes)
    offs = _offs(sizes)
    x = rand((M, K), 1, "cuda", dtype=torch.bfloat16)
    a = quantize_rows(x, layout="grouped_m", group_offs=offs)
    cache = MXWeightCache(rand((G, N, K), 2, "cuda", scale=0.05))
    assert select_backend(torch.device("cuda")) != "native" or torch.cuda.get_device_capability()[0] == 10
    got = grouped_mm(a, cache, offs, backend=backend)
    torch.cuda.synchronize()
    a32 = mx.dequantize(a, torch.float32)
    w32 = cache.forward_weight().dequantize(torch.float32)
    assert_close_gemm(got, fp32_grouped(a32, w32, offs), fp32_grouped(a32.abs(), w32.abs(), offs), K)
    assert bool((got[int(offs[-1]):] == 0).all())


def test_gpu_triton_paths_agree():
    """Triton: integer decode (int_round=True) and hardware casts give the same bits; dense BF16 operands
    (dequantized beforehand) and another tile config agree to accumulation order."""
    M, K, N, sizes = 2048, 2048, 1024, [300, 700, 0, 1000]
    offs = _offs(sizes)
    a = quantize_rows(rand((M, K), 3, "cuda", dtype=torch.bfloat16), layout="grouped_m", group_offs=offs)
    w = MXWeightCache(rand((4, N, K), 4, "cuda", scale=0.05)).forward_weight()
    hw = triton_grouped_mm(a, w, offs)
    assert torch.equal(hw, triton_grouped_mm(a, w, offs, int_round=True))
    dense = triton_grouped_mm(mx.dequantize(a), w.dequantize(), offs)
    assert torch.allclose(hw.float(), dense.float(), rtol=2 ** -7, atol=1e-3)
    other = triton_grouped_mm(a, w, offs, config=GroupedGemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4))
    assert torch.allclose(hw.float(), other.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("keep_bf16", [False, True])
def test_gpu_dgrad_orientation_and_bf16_copy(keep_bf16):
    M, K, N, sizes = 2048, 1024, 2048, [512, 512, 1000, 24]
    offs = _offs(sizes)
    cache = MXWeightCache(rand((4, N, K), 5, "cuda", scale=0.05), keep_bf16=keep_bf16)
    gq = quantize_rows(rand((M, N), 6, "cuda", dtype=torch.bfloat16), layout="grouped_m", group_offs=offs)
    g32 = mx.dequantize(gq, torch.float32)
    wd = cache.dgrad_weight().dequantize(torch.float32)
    for backend in ("dequant", "triton"):
        got = grouped_mm(gq, cache.dgrad_weight(), offs, backend=backend)
        assert_close_gemm(got, fp32_grouped(g32, wd, offs), fp32_grouped(g32.abs(), wd.abs(), offs), N)


def test_gpu_bf16_and_wgrad():
    M, K, N, sizes = 3000, 2048, 1536, [1000, 0, 999, 1000]
    offs = _offs(sizes)
    x = rand((M, K), 7, "cuda", dtype=torch.bfloat16)
    w = rand((4, N, K), 8, "cuda", dtype=torch.bfloat16, scale=0.05)
    y = grouped_mm_bf16(x, w, offs)
    assert_close_gemm(y, fp32_grouped(x.float(), w.float(), offs),
                      fp32_grouped(x.float().abs(), w.float().abs(), offs), K)
    assert bool((y[int(offs[-1]):] == 0).all())
    go = rand((M, N), 9, "cuda", dtype=torch.bfloat16)
    dw = grouped_wgrad(go, x, offs)
    assert dw.dtype == torch.float32
    assert_close_gemm(dw, fp32_wgrad(go.float(), x.float(), offs),
                      fp32_wgrad(go.float().abs(), x.float().abs(), offs), M)
    assert bool((dw[1] == 0).all())  # the empty group
    # Triton wgrad: fp32 result (no bf16 rounding), MX x decoded in the load path, accumulate into out
    xm = quantize_rows(x, layout="grouped_m", group_offs=offs)
    xm32 = mx.dequantize(xm, torch.float32)
    acc = torch.ones(4, N, K, device="cuda")
    dwt = grouped_wgrad(go, xm, offs, backend="triton", out=acc)
    assert dwt is acc
    assert_close_gemm(dwt - 1, fp32_wgrad(go.float(), xm32, offs), fp32_wgrad(go.float().abs(), xm32.abs(), offs) + 1,
                      M, out_rel=2.0 ** -20)
    assert bool((dwt[1] == 1).all())


@pytest.mark.parametrize("backend", ["dequant", "triton"])
def test_gpu_autograd(backend):
    M, K, N, sizes = 2048, 1024, 1536, [600, 0, 900, 500]
    offs = _offs(sizes)
    W = torch.nn.Parameter(rand((4, N, K), 10, "cuda", scale=0.05))
    cache = MXWeightCache(W)
    x = rand((M, K), 11, "cuda", dtype=torch.bfloat16).requires_grad_()
    gy = rand((M, N), 12, "cuda", dtype=torch.bfloat16)
    y = grouped_linear(x, W, offs, cache, GroupedLinearConfig(backend=backend))
    y.backward(gy)
    a32 = mx.dequantize(quantize_rows(x.detach(), layout="grouped_m", group_offs=offs), torch.float32)
    g32 = mx.dequantize(quantize_rows(gy, layout="grouped_m", group_offs=offs), torch.float32)
    wf = cache.forward_weight().dequantize(torch.float32)
    wd = cache.dgrad_weight().dequantize(torch.float32)
    assert_close_gemm(y, fp32_grouped(a32, wf, offs), fp32_grouped(a32.abs(), wf.abs(), offs), K)
    assert_close_gemm(x.grad, fp32_grouped(g32, wd, offs), fp32_grouped(g32.abs(), wd.abs(), offs), N)
    assert_close_gemm(W.grad, fp32_wgrad(gy.float(), a32, offs), fp32_wgrad(gy.float().abs(), a32.abs(), offs), M)
