"""grouped_mm (every backend that runs here), grouped_mm_bf16 and grouped_wgrad against an fp64 oracle on the
dequantized operands; the Triton grouped GEMM runs under the interpreter on CPU."""
import pytest
import torch

from gemm_cases import DEV, INTERP, OFFS_PATTERNS, assert_close_gemm, fp32_grouped, fp32_wgrad, make_offs, rand

from mxcomm import mx
from mxcomm.gemm import (
    GroupedGemmConfig,
    MXWeight,
    MXWeightCache,
    default_gemm_config,
    fit_k_step,
    grouped,
    grouped_mm,
    grouped_mm_bf16,
    grouped_wgrad,
    reference_grouped_mm,
    reference_grouped_wgrad,
    triton_grouped_mm,
    zero_rows_past_end,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

BACKENDS = ["reference", "dequant", "triton"]  # native: see test_gemm_backend.py (gate + plumbing)


def _operands(M, K, N, G, pattern, seed, a_layout="grouped_m"):
    offs = make_offs(pattern, M)
    x = rand((M, K), seed, dtype=torch.bfloat16)
    a = mx.quantize(x, layout=a_layout, group_offs=offs if a_layout == "grouped_m" else None)
    master = rand((G, N, K), seed + 1, scale=0.1)
    return a, master, offs


def _oracle(a, w, offs):
    a32 = mx.dequantize(a, torch.float32) if isinstance(a, mx.MXTensor) else a.float()
    w32 = w.dequantize(torch.float32) if isinstance(w, MXWeight) else w.float()
    return fp32_grouped(a32, w32, offs), fp32_grouped(a32.abs(), w32.abs(), offs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(OFFS_PATTERNS))
def test_grouped_mm_backends(backend, pattern):
    M, K, N, G = 150, 96, 64, 4
    a, master, offs = _operands(M, K, N, G, pattern, seed=10)
    cache = MXWeightCache(master)
    got = grouped_mm(a, cache, offs, backend=backend)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    want, bound = _oracle(a, cache.forward_weight(), offs)
    assert_close_gemm(got, want, bound, K)
    assert bool((got[int(offs[-1]):] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a_layout", ["row", "blocked"])
def test_grouped_mm_activation_layouts(backend, a_layout):
    M, K, N, G = 100, 128, 32, 4
    a, master, offs = _operands(M, K, N, G, "uneven", seed=11, a_layout=a_layout)
    w = MXWeight.from_dense(master, layout="blocked")
    got = grouped_mm(a, w, offs, backend=backend)
    ref = grouped_mm(a.with_layout("grouped_m", offs), w.with_layout("row"), offs, backend=backend)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_dense_weights_and_dgrad_orientation(backend):
    """Dense weights (cast to bf16, not quantized) and the dgrad copy ``[G, K, N]`` read as a weight."""
    M, K, N, G = 90, 64, 96, 4
    a, master, offs = _operands(M, K, N, G, "first_last_empty", seed=12)
    wd = master.to(torch.bfloat16)
    got = grouped_mm(a, wd, offs, backend=backend)
    want, bound = _oracle(a, wd, offs)
    assert_close_gemm(got, want, bound, K)
    # dgrad: grad_y [M, N] quantized along N times the dgrad copy [G, K, N] -> [M, K]
    cache = MXWeightCache(master)
    gy = mx.quantize(rand((M, N), 13, dtype=torch.bfloat16), layout="grouped_m", group_offs=offs)
    got = grouped_mm(gy, cache.dgrad_weight(), offs, backend=backend)
    want, bound = _oracle(gy, cache.dgrad_weight(), offs)
    assert got.shape == (M, K)
    assert_close_gemm(got, want, bound, N)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_special_values(backend):
    """A NaN block in ``a`` poisons exactly the rows of that block's row; other rows stay exact."""
    M, K, N, G = 64, 64, 32, 2
    offs = torch.tensor([30, 64], dtype=torch.int32, device=DEV)
    x = rand((M, K), 14, dtype=torch.bfloat16)
    x[5, 40] = float("nan")
    x[7, :32] = 0.0
    a = mx.quantize(x, layout="grouped_m", group_offs=offs)
    cache = MXWeightCache(rand((G, N, K), 15))
    got = grouped_mm(a, cache, offs, backend=backend).float().cpu()
    assert torch.isnan(got[5]).all()
    others = torch.ones(M, dtype=torch.bool)
    others[5] = False
    assert torch.isfinite(got[others]).all()


@pytest.mark.parametrize("block_k", [None, 64])
def test_triton_matches_dequant_bitwise_operands(block_k):
    """The Triton kernel's in-load dequantize gives the same BF16 operands as the dequantize kernel: with
    K = one k-step the products and sums are the same fp32 dot, so results agree to accumulation order.
    ``block_k=64`` > K = 32: the launcher narrows the step (an MX weight gave NaN there on an H200)."""
    M, K, N, G = 64, 32, 32, 4
    a, master, offs = _operands(M, K, N, G, "uneven", seed=16)
    w = MXWeight.from_dense(master)
    cfg = None if block_k is None else GroupedGemmConfig(block_m=64, block_n=128, block_k=block_k, num_warps=4)
    t = triton_grouped_mm(a, w, offs, config=cfg)
    d = triton_grouped_mm(mx.dequantize(a, torch.bfloat16), w.dequantize(torch.bfloat16), offs, config=cfg)
    assert torch.equal(t, d)


def test_triton_mx_operand_near_bf16_max_decodes_saturated():
    """An MX activation whose block max rounds to 2**128 (rceil) loads as the bf16 max (dequantize's saturation,
    in the GEMM's load path), not Inf: y stays finite and equals the GEMM of the dequantized operand; with one
    non-zero weight per output (a power of two) the result is exact."""
    M, K, N = 32, 64, 32
    bmax = torch.finfo(torch.bfloat16).max
    x = torch.linspace(-1.0, 1.0, M * K).view(M, K)
    x[0, 3], x[1, 3], x[2, 40], x[3, 3] = bmax, -3.39e38, 3.0e38, -bmax
    offs = torch.tensor([M], dtype=torch.int32, device=DEV)
    a = mx.quantize(x.to(torch.bfloat16).to(DEV), layout="grouped_m", group_offs=offs)
    w = torch.zeros(1, N, K, dtype=torch.bfloat16, device=DEV)
    w[0, 0, 3] = 2.0 ** -10
    w[0, 1, 40] = 2.0 ** -20
    t = triton_grouped_mm(a, w, offs)
    d = triton_grouped_mm(mx.dequantize(a, torch.bfloat16), w, offs)
    assert torch.isfinite(t).all()
    assert torch.equal(t, d)
    assert t[0, 0].item() == bmax * 2.0 ** -10 and t[3, 0].item() == -bmax * 2.0 ** -10


def test_fit_k_step():
    cfg = GroupedGemmConfig(block_k=128)
    assert fit_k_step(cfg, 32).block_k == 32 and fit_k_step(cfg, 96).block_k == 128
    assert fit_k_step(cfg, 64).block_k == 64 and fit_k_step(cfg, 7168) is cfg
    assert fit_k_step(cfg, 64).block_m == cfg.block_m


@pytest.mark.parametrize("cfg", [GroupedGemmConfig(block_m=16, block_n=16, block_k=32, group_m=1),
                                 GroupedGemmConfig(block_m=64, block_n=32, block_k=64, group_m=3)])
def test_triton_configs(cfg):
    M, K, N, G = 130, 96, 48, 4
    a, master, offs = _operands(M, K, N, G, "tail_unused", seed=17)
    w = MXWeight.from_dense(master)
    got = triton_grouped_mm(a, w, offs, config=cfg)
    want, bound = _oracle(a, w, offs)
    assert_close_gemm(got, want, bound, K)
    assert bool((got[int(offs[-1]):] == 0).all())


def test_config_validation_and_defaults():
    with pytest.raises(ValueError):
        GroupedGemmConfig(block_m=24)
    with pytest.raises(ValueError):
        GroupedGemmConfig(block_k=16)
    with pytest.raises(ValueError):
        GroupedGemmConfig(group_m=0)
    assert default_gemm_config(4096, 4096, 4096, 8, False).block_m == 128
    assert default_gemm_config(512, 4096, 4096, 8, False).block_m == 64


def test_zero_rows_past_end():
    out = torch.ones(70, 40, dtype=torch.bfloat16, device=DEV)
    zero_rows_past_end(out, torch.tensor([10, 33], dtype=torch.int32, device=DEV))
    assert bool((out[:33] == 1).all()) and bool((out[33:] == 0).all())
    out = torch.ones(5, 8, device=DEV)
    zero_rows_past_end(out, torch.zeros(0, dtype=torch.int32, device=DEV))
    assert bool((out == 0).all())


def test_empty_inputs():
    K, N, G = 64, 32, 3
    a = mx.quantize(torch.zeros(0, K, dtype=torch.bfloat16, device=DEV))
    offs = torch.zeros(G, dtype=torch.int32, device=DEV)
    cache = MXWeightCache(rand((G, N, K), 18))
    for backend in BACKENDS:
        assert grouped_mm(a, cache, offs, backend=backend).shape == (0, N)


# ------------------------------------------------------------------------------------------------
# BF16 grouped GEMM
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_torch", [True, False])
@pytest.mark.parametrize("pattern", ["uneven", "tail_unused"])
def test_grouped_mm_bf16(pattern, use_torch, monkeypatch):
    if not use_torch:  # the loop fallback (a CPU build without torch._grouped_mm)
        monkeypatch.setattr(grouped, "_torch_grouped_mm_on", lambda device_type: False)
    M, K, N, G = 120, 64, 64, 4
    offs = make_offs(pattern, M)
    a = rand((M, K), 20, dtype=torch.bfloat16)
    w = rand((G, N, K), 21, dtype=torch.bfloat16)
    got = grouped_mm_bf16(a, w, offs)
    want = fp32_grouped(a.float(), w.float(), offs)
    bound = fp32_grouped(a.float().abs(), w.float().abs(), offs)
    assert_close_gemm(got, want, bound, K)
    assert bool((got[int(offs[-1]):] == 0).all())
    # MX weights are dequantized
    cache = MXWeightCache(w.float())
    got = grouped_mm_bf16(a, cache, offs)
    w32 = cache.forward_weight().dequantize(torch.float32)
    assert_close_gemm(got, fp32_grouped(a.float(), w32, offs), fp32_grouped(a.float().abs(), w32.abs(), offs), K)


def test_cpu_grouped_mm_probe():
    has = grouped._torch_grouped_mm_on("cpu")
    assert has == hasattr(torch, "_grouped_mm") or not has


# ------------------------------------------------------------------------------------------------
# wgrad
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [None, "reference", "dequant", "triton"])
@pytest.mark.parametrize("pattern", list(OFFS_PATTERNS))
def test_grouped_wgrad(backend, pattern):
    M, K, N, G = 140, 64, 32, 4
    offs = make_offs(pattern, M)
    go = rand((M, N), 30, dtype=torch.bfloat16)
    x = rand((M, K), 31, dtype=torch.bfloat16)
    got = grouped_wgrad(go, x, offs, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (G, N, K)
    want = fp32_wgrad(go.float(), x.float(), offs)
    bound = fp32_wgrad(go.float().abs(), x.float().abs(), offs)
    assert_close_gemm(got, want, bound, M)
    sizes = torch.diff(offs.cpu(), prepend=torch.zeros(1, dtype=torch.int32))
    assert bool((got[sizes.to(got.device) == 0] == 0).all())


@pytest.mark.parametrize("x_layout", ["grouped_m", "row"])
@pytest.mark.parametrize("backend", [None, "triton"])
def test_grouped_wgrad_mx_inputs_and_accumulate(backend, x_layout):
    M, K, N, G = 96, 64, 64, 3
    offs = make_offs("uneven", M)[:G]
    x = mx.quantize(rand((M, K), 32, dtype=torch.bfloat16), layout=x_layout,
                    group_offs=offs if x_layout == "grouped_m" else None)
    go = rand((M, N), 33, dtype=torch.bfloat16)
    acc = torch.full((G, N, K), 0.5, device=DEV)
    out = grouped_wgrad(go, x, offs, out=acc, backend=backend)
    assert out is acc
    dw = fp32_wgrad(go.float(), mx.dequantize(x, torch.float32), offs)
    bound = fp32_wgrad(go.float().abs(), mx.dequantize(x, torch.float32).abs(), offs)
    # out = dW (rounded once: to bf16 on the dequant backend, as documented) + 0.5 in fp32. The result's rounding
    # is relative to dW, not to dW + 0.5 (which can cancel); the fp32 add's rounding is inside the bound's 0.5 term.
    assert_close_gemm(out - 0.5, dw, bound + 0.5, M)
    assert torch.equal(reference_grouped_wgrad(go, x, offs), grouped_wgrad(go, x, offs, backend="reference"))


# ------------------------------------------------------------------------------------------------
# errors (raised before any kernel runs)
# ------------------------------------------------------------------------------------------------
def test_errors():
    M, K, N, G = 64, 64, 32, 2
    offs = torch.tensor([30, 64], dtype=torch.int32, device=DEV)
    x = rand((M, K), 40, dtype=torch.bfloat16)
    a = mx.quantize(x, layout="grouped_m", group_offs=offs)
    cache = MXWeightCache(rand((G, N, K), 41))
    with pytest.raises(TypeError, match="grouped_mm_bf16"):
        grouped_mm(x, cache, offs)
    with pytest.raises(ValueError, match="K="):
        grouped_mm(mx.quantize(rand((M, 32), 1, dtype=torch.bfloat16)), cache, offs)
    with pytest.raises(ValueError, match="groups"):
        grouped_mm(a, cache, offs[:1])
    with pytest.raises(TypeError):
        grouped_mm(a, cache, offs.float())
    with pytest.raises(TypeError):
        grouped_mm(a, cache, [30, 64])
    with pytest.raises(TypeError):
        grouped_mm(a, "weights", offs)
    with pytest.raises(ValueError):
        grouped_mm(mx.quantize(x, axis=0), cache, offs)
    if DEV == "cpu":  # offset VALUES are checked on CPU only (on CUDA the check would sync the host)
        with pytest.raises(ValueError, match="other group offsets"):
            grouped_mm(a, cache, torch.tensor([31, 64], dtype=torch.int32))
        with pytest.raises(ValueError, match="non-decreasing"):
            grouped_mm(a.with_layout("row"), cache, torch.tensor([40, 30], dtype=torch.int32))
        with pytest.raises(ValueError, match="non-decreasing"):
            grouped_mm(a.with_layout("row"), cache, torch.tensor([30, 65], dtype=torch.int32))
    else:  # CUDA operands: offsets on another device are refused before any kernel runs
        with pytest.raises(ValueError, match="offs is on cpu"):
            grouped_mm(a, cache, torch.tensor([30, 64], dtype=torch.int32))
    with pytest.raises(ValueError):
        grouped_mm(a, cache, offs, backend="fast")
    with pytest.raises(ValueError):
        grouped_mm_bf16(x, torch.zeros(G, N, 48, device=DEV), offs)
    with pytest.raises(TypeError):
        grouped_mm_bf16(x.to(torch.int32), cache, offs)
    with pytest.raises(ValueError, match="rows"):
        grouped_wgrad(rand((M - 1, N), 1), x, offs)
    with pytest.raises(ValueError, match="out must be"):
        grouped_wgrad(rand((M, N), 1), x, offs, out=torch.zeros(G, N, K, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        grouped_wgrad(rand((M, N), 1), x, offs, backend="triton",
                      out=torch.zeros(G, K, N, device=DEV).transpose(1, 2))
    if INTERP:
        with pytest.raises(ValueError):
            triton_grouped_mm(a, cache.forward_weight(), offs, int_round=False)
    assert reference_grouped_mm(a, cache, offs).dtype == torch.float32
