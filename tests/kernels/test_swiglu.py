"""Fused SwiGLU + MXFP8 quantize and the SwiGLU backward (mxcomm.kernels.swiglu) against plain torch.

Reference: ``h = (silu(gate.float()) * up.float()).to(bfloat16)`` then ``mxcomm.mx.quantize(h)``.
CPU (interpreter): numpy's exp is not torch's, so the quantize step is checked bit for bit against the
reference applied to the kernel's own bf16 ``h`` (``return_h=True``), and ``h`` against the torch reference to
within one bf16 ulp. GPU: the kernel uses libdevice expf and an IEEE division like torch's CUDA silu, and the
whole result is checked bit for bit against the reference computed on the GPU.
"""
import pytest
import torch

from _triton_mode import load_kernels, run_aot  # noqa: E402

load_kernels()

from mxcomm import mx  # noqa: E402
from mxcomm.kernels.swiglu import (  # noqa: E402
    SwigluConfig,
    default_swiglu_config,
    interpret_mode,
    swiglu_backward,
    swiglu_quantize,
    swiglu_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

INTERP = interpret_mode()
DEV = "cpu" if INTERP else "cuda"
INT_ROUNDS = [True] if INTERP else [True, False]


def _u8(t):
    return t.contiguous().view(torch.uint8).cpu()


def assert_same_mx(got, ref):
    assert got.qdata.shape == ref.qdata.shape and got.scales.shape == ref.scales.shape
    assert got.axis == ref.axis and got.layout == ref.layout and got.mode == ref.mode
    bad = (_u8(got.qdata) != _u8(ref.qdata)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} payload bytes differ, first at {bad[:5].tolist()}"
    bad = (got.scales.cpu() != ref.scales.view(torch.uint8).cpu()).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} scale bytes differ, first at {bad[:5].tolist()}"


def assert_within_one_ulp(got, want):
    """bf16 tensors equal, or neighbours (one ulp apart), with identical NaN positions."""
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    gi = got[~nan].view(torch.int16).to(torch.int32)
    wi = want[~nan].view(torch.int16).to(torch.int32)
    same_sign = (gi < 0) == (wi < 0)
    diff = torch.where(same_sign, (gi - wi).abs(), (gi & 0x7FFF) + (wi & 0x7FFF))
    assert int(diff.max()) <= 1 if diff.numel() else True, f"max bf16 ulp difference {int(diff.max())}"


def make_gu(M, N, dtype=torch.bfloat16, seed=0, scale=4.0, device=DEV, specials=False):
    g = torch.Generator(device=device).manual_seed(seed)
    gu = torch.randn(M, 2 * N, generator=g, device=device) * scale
    # spread the exponents so that blocks get different scales
    gu = gu * torch.exp2(torch.randint(-6, 7, (M, 2 * N // 32, 1), generator=g, device=device).float()).expand(
        M, 2 * N // 32, 32).reshape(M, 2 * N)
    if specials and M >= 4 and N >= 64:
        gu[0, 3] = float("nan")          # gate NaN -> h NaN -> NaN block
        gu[1, N + 40] = float("inf")     # up Inf -> h Inf (gate > 0) -> NaN block
        gu[2, :32] = -200.0              # silu(-200) = -0.0 -> all-zero block
        gu[2, N:N + 32] = 1.0
        gu[3, 32:64] = 3.0e4             # large h (|h| ~ 9e8): scale grows, no saturation
        gu[3, N + 32:N + 64] = 3.0e4
    return gu.to(dtype)


def torch_grad(gu, dh):
    """torch autograd of the reference (fp32 math), rounded to gu's dtype."""
    N = gu.shape[1] // 2
    x = gu.float().requires_grad_()
    h = torch.nn.functional.silu(x[:, :N]) * x[:, N:]
    h.backward(dh.float())
    return x.grad.to(gu.dtype)


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_row_layout(dtype, mode, int_round):
    gu = make_gu(37, 96, dtype, seed=1, specials=dtype != torch.float16)
    got, h = swiglu_quantize(gu, mode=mode, int_round=int_round, return_h=True)
    assert h.dtype == torch.bfloat16 and got.orig_dtype == torch.bfloat16 and got.qdata.shape == (37, 96)
    # the quantize step, bit for bit, on the kernel's own h
    assert_same_mx(got, mx.quantize(h, mode=mode))
    # h against the torch reference
    href = swiglu_reference(gu)
    if INTERP:
        assert_within_one_ulp(h, href)
    else:
        # bit for bit, except NaN payloads: the integer rounding (int_round) writes the quiet NaN 0x7FC0 with the
        # input's sign, torch's CUDA cast its own NaN; positions must match
        nan = torch.isnan(href)
        assert torch.equal(torch.isnan(h), nan)
        assert torch.equal(h.view(torch.int16)[~nan], href.view(torch.int16)[~nan])
        assert_same_mx(got, mx.quantize(href, mode=mode))
    # the payload decodes to h within MXFP8 precision
    deq = mx.dequantize(got, torch.float32)
    hf = h.float()
    fin = torch.isfinite(hf) & torch.isfinite(deq)
    amax = hf.abs().view(hf.shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(hf.shape)
    err = (deq - hf).abs()
    rel = 2 ** -4 if mode == "rceil" else 0.126  # floor: the block max may saturate (up to 12.5%)
    assert bool((err[fin] <= rel * hf.abs()[fin] + 2 ** -8 * amax[fin]).all())


@pytest.mark.parametrize("offs", [[0, 10, 10, 50], [64], [5, 30, 40]])
def test_forward_grouped_m_layout(offs):
    M = 64
    gu = make_gu(M, 64, seed=2)
    ends = torch.tensor(offs, dtype=torch.int32, device=DEV)
    got, h = swiglu_quantize(gu, layout="grouped_m", group_offs=ends, return_h=True)
    ref = mx.quantize(h, layout="grouped_m", group_offs=ends)
    assert_same_mx(got, ref)
    assert got.group_offs is not None and torch.equal(got.group_offs.cpu(), ends.cpu())
    # the row-layout payload is the same whatever the scale layout
    row = swiglu_quantize(gu)
    assert torch.equal(_u8(row.qdata), _u8(got.qdata))


def test_forward_matches_reference_end_to_end_cpu_rounding():
    """Inputs whose silu is exact in any correct exp (gate 0 and +-large): the whole pipeline bit-exact
    against plain torch, also on CPU."""
    M, N = 8, 64
    g = torch.Generator(device=DEV).manual_seed(3)
    gate = torch.where(torch.rand(M, N, generator=g, device=DEV) < 0.5, 0.0, 120.0)
    gate = torch.where(torch.rand(M, N, generator=g, device=DEV) < 0.3, -120.0, gate)
    up = torch.randn(M, N, generator=g, device=DEV) * 7
    gu = torch.cat([gate, up], 1).to(torch.bfloat16)
    got = swiglu_quantize(gu)
    assert_same_mx(got, mx.quantize(swiglu_reference(gu)))


def test_forward_empty_and_noncontiguous():
    gu = make_gu(16, 64, seed=4)
    big = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEV)
    big[:, :128] = gu
    view = big[:, :128]
    assert not view.is_contiguous()
    a, ha = swiglu_quantize(view, return_h=True)
    b, hb = swiglu_quantize(gu, return_h=True)
    assert_same_mx(a, b)
    e = swiglu_quantize(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV))
    assert e.qdata.shape == (0, 32) and e.scales.shape == (0, 1)


def test_explicit_config_same_result():
    gu = make_gu(40, 128, seed=5)
    a = swiglu_quantize(gu, config=SwigluConfig(block_rows=4, block_n=32))
    b = swiglu_quantize(gu, config=SwigluConfig(block_rows=64, block_n=128))
    assert_same_mx(a, b)
    with pytest.raises(ValueError):
        SwigluConfig(block_rows=3, block_n=32)
    with pytest.raises(ValueError):
        SwigluConfig(block_rows=4, block_n=16)


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_matches_autograd(dtype, int_round):
    M, N = 33, 96
    gu = make_gu(M, N, dtype, seed=6, scale=2.0)
    dh = (torch.randn(M, N, generator=torch.Generator(device=DEV).manual_seed(7), device=DEV)).to(torch.bfloat16)
    got = swiglu_backward(dh, gu, int_round=int_round)
    want = torch_grad(gu, dh)
    assert got.shape == gu.shape and got.dtype == gu.dtype
    if dtype == torch.bfloat16:
        assert_within_one_ulp(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # the up half is dh * silu(gate) and the gate half uses up: swap test of the layout
    N2 = gu.shape[1] // 2
    g32, u32 = gu[:, :N2].float(), gu[:, N2:].float()
    assert torch.allclose(got[:, N2:].float(), (dh.float() * torch.nn.functional.silu(g32)).to(dtype).float(),
                          rtol=2 ** -7, atol=1e-6)
    assert not torch.allclose(got[:, :N2].float(), got[:, N2:].float())
    del u32


def test_backward_edge_values():
    M, N = 4, 32
    gate = torch.tensor([0.0, -200.0, 200.0, float("nan")], device=DEV).view(4, 1).expand(4, N)
    up = torch.full((M, N), 2.0, device=DEV)
    gu = torch.cat([gate, up], 1).to(torch.bfloat16)
    dh = torch.ones(M, N, dtype=torch.bfloat16, device=DEV)
    got = swiglu_backward(dh, gu).float().cpu()
    # gate 0: d_gate = up * 0.5, d_up = 0; gate -200: both 0; gate 200: d_gate = up, d_up = 200
    assert torch.all(got[0, :N] == 1.0) and torch.all(got[0, N:] == 0.0)
    assert torch.all(got[1] == 0.0)
    assert torch.all(got[2, :N] == 2.0) and torch.all(got[2, N:] == 200.0)
    assert torch.isnan(got[3]).all()


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------
def test_errors():
    gu = make_gu(8, 64)
    with pytest.raises(TypeError):
        swiglu_quantize(gu.to(torch.int32))
    with pytest.raises(TypeError):
        swiglu_quantize(gu.cpu().numpy())
    with pytest.raises(ValueError):
        swiglu_quantize(gu[:, :96])  # N = 48, not a multiple of 32
    with pytest.raises(ValueError):
        swiglu_quantize(gu.view(8, 2, 64))
    with pytest.raises(ValueError):
        swiglu_quantize(gu, mode="nearest")
    with pytest.raises(ValueError):
        swiglu_quantize(gu, layout="blocked")
    with pytest.raises(ValueError):
        swiglu_quantize(gu, layout="grouped_m")  # no offsets
    with pytest.raises(TypeError):
        swiglu_quantize(gu, layout="grouped_m", group_offs=torch.tensor([8.0], device=DEV))
    with pytest.raises(ValueError):
        swiglu_backward(torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV), gu)
    with pytest.raises(TypeError):
        swiglu_backward(torch.zeros(8, 64, dtype=torch.int32, device=DEV), gu)
    if INTERP:
        with pytest.raises(ValueError):
            swiglu_quantize(gu, int_round=False)


def test_default_config_shapes():
    c = default_swiglu_config(100, 7168, torch.device("cpu"), interpret=False)
    assert c.block_n == 512 and c.block_rows * c.block_n == 4096
    c = default_swiglu_config(3, 96, torch.device("cpu"), interpret=True)
    assert c.block_n == 128 and c.block_rows == 4


# ------------------------------------------------------------------------------------------------
# compile for sm_90 (no GPU needed)
# ------------------------------------------------------------------------------------------------
_AOT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxcomm.kernels import swiglu as S

def ptx(fn, sig, consts, **opts):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n == "N"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, **opts)).asm["ptx"]

out = {}
fsig = {"gu_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i32", "h_ptr": "*bf16", "M": "i32", "N": "i32",
        "n_groups": "i32", "s_cols": "i32", "MODE": "constexpr", "INT_ROUND": "constexpr", "LIBDEVICE": "constexpr",
        "LAYOUT": "constexpr", "STORE_H": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
        "G_POW2": "constexpr"}
for lay in (0, 2):
    out[f"fwd-{lay}"] = ptx(S._swiglu_quant_kernel, fsig, dict(MODE=0, INT_ROUND=False, LIBDEVICE=True, LAYOUT=lay,
                            STORE_H=False, BLOCK_M=8, BLOCK_N=512, G_POW2=16), enable_reflect_ftz=False)
bsig = {"gu_ptr": "*bf16", "dh_ptr": "*bf16", "dgu_ptr": "*bf16", "M": "i32", "N": "i32", "INT_ROUND": "constexpr",
        "LIBDEVICE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
out["bwd"] = ptx(S._swiglu_bwd_kernel, bsig, dict(INT_ROUND=False, LIBDEVICE=True, BLOCK_M=8, BLOCK_N=512),
                 enable_reflect_ftz=False)
json.dump(out, sys.stdout)
'''


def test_kernels_compile_for_sm90(tmp_path):
    """The SwiGLU kernels compile for sm_90 (fresh process, no interpreter) with IEEE division (div.rn.f32),
    libdevice expf without flush-to-zero reflection (as torch's CUDA build), 16-byte loads and the satfinite
    E4M3 cast."""
    import json
    import re

    stdout = run_aot(_AOT, tmp_path)
    for name, p in json.loads(stdout).items():
        assert "div.rn.f32" in p, f"{name}: no IEEE division"
        # libdevice expf itself is built on ex2.approx.ftz (as in nvcc's expf); nothing else may flush
        assert not re.search(r"(?<!ex2\.approx)\.ftz\.f32", p), f"{name}: flush-to-zero fp32 arithmetic"
        assert "ld.global.v4.b32" in p, f"{name}: loads not vectorized to 16 bytes"
        if name.startswith("fwd"):
            assert "cvt.rn.satfinite.e4m3x2.f32" in p, name


# ------------------------------------------------------------------------------------------------
# GPU: larger shapes, bit-exact against the reference computed on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.fixture()
def gpu_kernels():
    if INTERP:
        pytest.fail("mxcomm.kernels was imported under TRITON_INTERPRET=1; run tests/kernels in a process without it")


@pytest.mark.gpu
@pytest.mark.parametrize("int_round", [True, False])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 1536), (8192, 7168), (3, 14336)])
def test_gpu_forward_bit_exact(shape, int_round, gpu_kernels):
    M, N = shape
    gu = make_gu(M, N, seed=M + N, device="cuda", specials=True)
    href = swiglu_reference(gu)
    got, h = swiglu_quantize(gu, int_round=int_round, return_h=True)
    # Bit-exact, except the payload of a NaN: torch's CUDA float->bf16 cast gives 0x7FFF, the integer
    # rounding path (written for the interpreter) the CPU's 0x7FC0; NaN positions must still agree.
    nan_h, nan_ref = torch.isnan(h), torch.isnan(href)
    assert torch.equal(nan_h, nan_ref), "NaN positions of h differ from the reference"
    assert M < 4 or int(nan_ref.sum()) >= 1, "the special values should produce at least one NaN"
    ndiff = int(((h.view(torch.int16) != href.view(torch.int16)) & ~nan_ref).sum())
    assert ndiff == 0, f"{ndiff} of {h.numel()} non-NaN bf16 h values differ from torch's silu(gate)*up on the GPU"
    assert_same_mx(got, mx.quantize(href))
    assert_same_mx(swiglu_quantize(gu, int_round=int_round), mx.quantize(href))  # without the debug store
    ends = torch.tensor([M // 3, M // 3, M - 1], dtype=torch.int32, device="cuda")
    assert_same_mx(swiglu_quantize(gu, layout="grouped_m", group_offs=ends, int_round=int_round),
                   mx.quantize(href, layout="grouped_m", group_offs=ends))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (777, 1536)])
def test_gpu_backward(shape, gpu_kernels):
    M, N = shape
    gu = make_gu(M, N, seed=9, device="cuda", scale=2.0)
    dh = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    got = swiglu_backward(dh, gu)
    assert_within_one_ulp(got, torch_grad(gu, dh))
