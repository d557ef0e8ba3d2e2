"""Triton MXFP8 quantize/dequantize kernels vs the plain-torch reference (mxcomm.mx), bit for bit.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
mxcomm.kernels is imported) with integer E4M3 rounding. With a GPU the same small tests run on CUDA
with both rounding paths, and the ``gpu``-marked tests add larger shapes.
"""
import pytest
import torch

from _triton_mode import load_kernels, run_aot  # noqa: E402

load_kernels()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mxcomm import mx  # noqa: E402
from mxcomm.kernels import (  # noqa: E402
    QuantizeConfig,
    dequantize,
    interpret_mode,
    quantize_cols,
    quantize_rows,
)
from mxcomm.kernels import quantize as kq  # noqa: E402
from mxcomm.kernels.mx_device import (  # noqa: E402
    SCALE_MODE_IDS,
    blocked_scale_offset,
    e4m3_byte,
    e4m3_decode,
    mx_qdq_tile,
    mx_reciprocal,
    mx_scale_bytes,
    mx_scale_value,
)

# fp32 overflow to Inf inside the interpreter (e.g. dequantizing a block rounded up near fp32 max) is expected
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

INTERP = interpret_mode()
DEV = "cpu" if INTERP else "cuda"
if not INTERP and not torch.cuda.is_available():  # pragma: no cover - import-order problem, say so loudly
    raise RuntimeError("mxcomm.kernels was imported without TRITON_INTERPRET=1 on a machine without a GPU; "
                       "set TRITON_INTERPRET=1 before the first import of mxcomm.kernels (e.g. in conftest.py)")
INT_ROUNDS = [True] if INTERP else [True, False]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MODES = ["rceil", "floor"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _u8(t):
    return t.contiguous().view(torch.uint8)


def assert_same_mx(got: mx.MXTensor, ref: mx.MXTensor):
    assert got.qdata.dtype == torch.float8_e4m3fn and got.scales.dtype == torch.uint8
    assert got.qdata.shape == ref.qdata.shape
    assert got.scales.shape == ref.scales.shape, (got.scales.shape, ref.scales.shape)
    assert got.axis == ref.axis and got.layout == ref.layout and got.mode == ref.mode
    assert got.orig_dtype == ref.orig_dtype
    gq, rq = _u8(got.qdata).cpu(), _u8(ref.qdata).cpu()
    bad = (gq != rq).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} payload bytes differ, first at {bad[:5].tolist()}"
    gs, rs = got.scales.cpu(), ref.scales.view(torch.uint8).cpu()
    bad = (gs != rs).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} scale bytes differ, first at {bad[:5].tolist()}"


def assert_same_dense(got, want):
    """Same dtype, shape, NaN positions, and bits everywhere else."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    bad = got[~nan].view(ib) != want[~nan].view(ib)
    assert not bad.any(), f"{int(bad.sum())} values differ: {got[~nan][bad][:5].tolist()} vs {want[~nan][bad][:5].tolist()}"


def wide_random(shape, dtype, seed, specials=True, axis=1, device="cpu"):
    """Random values whose exponents vary over most of ``dtype``'s range, per 32-block along ``axis``
    and per element, with some special blocks (zeros, NaN, +-Inf, subnormals, exact 448, max) mixed in.
    Generated on ``device`` (fast for the large GPU shapes)."""
    if axis == 0:
        return wide_random(shape[::-1], dtype, seed, specials, device=device).t().contiguous()
    g = torch.Generator(device=device).manual_seed(seed)
    M, K = shape
    lo, hi = {torch.float16: (-22, 12), torch.bfloat16: (-130, 120), torch.float32: (-140, 120)}[dtype]
    kw = dict(generator=g, device=device)
    e_blk = torch.randint(lo, hi, (M, K // 32, 1), **kw).expand(M, K // 32, 32).reshape(M, K)
    e_el = torch.randint(-14, 3, (M, K), **kw)
    x = torch.randn(M, K, dtype=torch.float64, **kw) * torch.exp2((e_blk + e_el).double())
    fmax = torch.finfo(dtype).max
    x = x.clamp(-fmax, fmax)
    if specials and M * K >= 32 * 16:
        flat = x.view(-1)
        nblk = M * K // 32
        pick = torch.randperm(nblk, **kw)[:12].tolist()
        flat[pick[0] * 32: pick[0] * 32 + 32] = 0.0
        flat[pick[1] * 32 + 5] = float("nan")
        flat[pick[2] * 32 + 31] = float("inf")
        flat[pick[3] * 32] = -float("inf")
        flat[pick[4] * 32: pick[4] * 32 + 32] = 448.0
        flat[pick[5] * 32: pick[5] * 32 + 32] = -0.0
        flat[pick[6] * 32: pick[6] * 32 + 32] = torch.finfo(dtype).tiny * torch.rand(32, dtype=torch.float64, **kw)
        flat[pick[7] * 32: pick[7] * 32 + 32] = fmax
    return x.to(dtype)


def ties_block_values():
    """fp32 values at every E4M3 rounding tie (midpoints of neighbouring finite positives, both signs),
    the values one fp32 ulp either side, and the E4M3 values themselves."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0 .. 0x7E: +0 .. 448
    vals = codes.view(torch.float8_e4m3fn).to(torch.float64)
    mids = ((vals[1:] + vals[:-1]) / 2).to(torch.float32)  # exact in fp32
    mids = torch.cat([mids, torch.tensor([464.0, vals[1].item() / 2], dtype=torch.float32)])
    ulp_up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    ulp_dn = torch.nextafter(mids, torch.zeros_like(mids))
    v = torch.cat([mids, ulp_up, ulp_dn, vals.to(torch.float32)])
    return torch.cat([v, -v])


# ------------------------------------------------------------------------------------------------
# device-function test kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _elementwise_kernel(x_ptr, o_ptr, N, WHICH: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    if WHICH == 0:  # fp32 -> E4M3 byte
        y = e4m3_byte(tl.load(x_ptr + i, mask=m, other=0.0), INT_ROUND)
    elif WHICH == 1:  # amax -> scale byte
        y = mx_scale_bytes(tl.load(x_ptr + i, mask=m, other=0.0), MODE)
    elif WHICH == 2:  # byte -> fp32 reciprocal bits
        y = mx_reciprocal(tl.load(x_ptr + i, mask=m, other=0)).to(tl.int32, bitcast=True)
    elif WHICH == 3:  # byte -> fp32 scale value bits
        y = mx_scale_value(tl.load(x_ptr + i, mask=m, other=0)).to(tl.int32, bitcast=True)
    else:  # E4M3 byte -> fp32 bits
        y = e4m3_decode(tl.load(x_ptr + i, mask=m, other=0), INT_ROUND).to(tl.int32, bitcast=True)
    tl.store(o_ptr + i, y.to(tl.int32), mask=m)


def run_elementwise(x, which, mode="rceil", int_round=True):
    x = x.to(DEV).contiguous()
    out = torch.empty(x.numel(), dtype=torch.int32, device=DEV)
    BLOCK = 65536 if INTERP else 1024
    _elementwise_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), WHICH=which, MODE=SCALE_MODE_IDS[mode],
                                                         INT_ROUND=int_round, BLOCK=BLOCK)
    return out.cpu()


@triton.jit
def _blocked_offset_kernel(o_ptr, R, C, n_col_tiles, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, BR)[:, None]
    c = tl.arange(0, BC)[None, :]
    tl.store(o_ptr + r * C + c, blocked_scale_offset(r, c, n_col_tiles).to(tl.int32), mask=(r < R) & (c < C))


@triton.jit
def _qdq_kernel(x_ptr, o_ptr, M, K: tl.constexpr, NB: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr,
                OUT_MAX: tl.constexpr):
    r = tl.program_id(0)
    el = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = el < K
    v = mx_qdq_tile(tl.load(x_ptr + r * K + el, mask=m, other=0.0), MODE, INT_ROUND, 1, OUT_MAX)
    tl.store(o_ptr + r * K + el, v, mask=m)


def all_bf16_as_fp32():
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def random_fp32_bits(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ------------------------------------------------------------------------------------------------
# device functions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sat", [torch.float32, torch.bfloat16])
def test_qdq_tile_equals_dequantized_reference(dtype, mode, int_round, sat):
    """``mx_qdq_tile`` (the values a MXFP8 transport delivers, without the bytes; combine on one rank) equals the
    reference's quantize + dequantize bit for bit: wide exponent ranges, zero / NaN / Inf / subnormal / 448 / max
    blocks, blocks filled with the E4M3 tie values of the rounding tests, both scale modes; NaN exactly where the
    reference has NaN; saturated to the fp32 or the bf16 max as the reference's ``saturate_to`` does. (On CPU only
    the integer path runs; the hardware-cast path is checked on a GPU.)"""
    x = wide_random((64, 224), dtype, seed=3 + MODES.index(mode))
    ties = ties_block_values()
    x[:5].reshape(-1)[: ties.numel()] = ties.to(dtype)  # rows 0-4 (a view: x is contiguous)
    want = mx.quantize(x, mode=mode).dequantize(torch.float32, saturate_to=sat)
    out = torch.full(x.shape, 7.0, dtype=torch.float32, device=DEV)
    _qdq_kernel[(x.shape[0],)](x.to(DEV).contiguous(), out, x.shape[0], K=x.shape[1], NB=8,
                               MODE=SCALE_MODE_IDS[mode], INT_ROUND=int_round, OUT_MAX=torch.finfo(sat).max)
    got = out.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(want)
    assert torch.equal(got[fin].view(torch.int32), want[fin].view(torch.int32))


@pytest.mark.parametrize("int_round", INT_ROUNDS)
def test_e4m3_rounding_exhaustive(int_round):
    """Every bf16 bit pattern, 200k random fp32 patterns (incl. NaN/Inf/subnormal), every tie +-1 ulp,
    and dense values in the E4M3 subnormal range; vs torch's clamp + cast."""
    g = torch.Generator().manual_seed(1)
    dense_sub = (torch.rand(50000, generator=g) * 2 ** -5 - 2 ** -6).float()
    dense_norm = (torch.rand(50000, generator=g) * 900 - 450).float()
    v = torch.cat([all_bf16_as_fp32(), random_fp32_bits(200000, 2), ties_block_values(), dense_sub, dense_norm,
                   torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, -464.0, 2 ** -9, 2 ** -10, 2 ** -126, 1e-45])])
    got = run_elementwise(v, 0, int_round=int_round)
    ref = torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    nan = torch.isnan(v)
    bad = (got != ref) & ~nan
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. {v[bad][:5].tolist()} -> {got[bad][:5].tolist()} vs {ref[bad][:5].tolist()}"
    if int_round:  # the integer path gives torch's NaN byte, sign included
        assert torch.equal(got[nan], ref[nan])
    else:  # the hardware cast gives a NaN byte, its sign the hardware's (see e4m3_byte)
        assert ((got[nan] & 0x7F) == 0x7F).all(), f"NaN -> {got[nan].unique().tolist()}"


@pytest.mark.parametrize("mode", MODES)
def test_scale_bytes_exhaustive(mode):
    a = torch.cat([all_bf16_as_fp32().abs(), random_fp32_bits(100000, 3).abs(),
                   torch.tensor([0.0, 1e-40, 1e-45, 2 ** -126, 448.0, 480.0, 3.75, 3.4e38, float("inf"), float("nan")]),
                   # amax whose amax / 448 is an fp32 subnormal (rceil's "mantissa above 0x400000" rule), densely
                   torch.arange(0, 0x05800000, 4093, dtype=torch.int32).view(torch.float32)])
    got = run_elementwise(a, 1, mode=mode)
    ref = mx.scale_bytes_from_amax(a, mode).to(torch.int32)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} scale bytes differ"


def test_reciprocal_and_scale_value_all_bytes():
    b = torch.arange(256, dtype=torch.int32)
    assert torch.equal(run_elementwise(b, 2), mx.scale_reciprocal(b).view(torch.int32))
    assert torch.equal(run_elementwise(b, 3), mx.scale_value(b).view(torch.int32))


@pytest.mark.parametrize("int_round", INT_ROUNDS)
def test_e4m3_decode_all_bytes(int_round):
    b = torch.arange(256, dtype=torch.int32)
    got = run_elementwise(b, 4, int_round=int_round).view(torch.float32)
    ref = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_blocked_scale_offset_matches_layouts():
    R, C, BR, BC = 300, 13, 512, 16
    ct = mx.round_up(C, 4) // 4
    out = torch.empty(R * C, dtype=torch.int32, device=DEV)
    _blocked_offset_kernel[(1,)](out, R, C, ct, BR=BR, BC=BC)
    r = torch.arange(R).view(R, 1).expand(R, C)
    c = torch.arange(C).view(1, C).expand(R, C)
    assert torch.equal(out.cpu().view(R, C).long(), mx.blocked_index(r, c, ct))


# ------------------------------------------------------------------------------------------------
# quantize_rows / quantize_cols / dequantize vs the reference (small shapes, CPU interpreter or GPU)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("layout", ["row", "blocked"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_match_reference(dtype, mode, layout, int_round):
    x = wide_random((150, 352), dtype, seed=10 + DTYPES.index(dtype)).to(DEV)  # K/32 = 11: padded columns
    got = quantize_rows(x, mode=mode, layout=layout, int_round=int_round)
    assert_same_mx(got, mx.quantize(x, mode=mode, layout=layout))


@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("offs", [
    [0, 50, 50, 177, 190],   # leading empty group, empty middle group, rows past the last group
    [1, 2, 130, 130, 200],   # odd sizes, one group exactly 128
    [200],                   # one group
    [],                      # no groups: no scales at all
    [0, 0, 0],               # all empty
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_grouped_m(dtype, offs, int_round):
    x = wide_random((200, 96), dtype, seed=20).to(DEV)
    go = torch.tensor(offs, dtype=torch.int32, device=DEV)
    got = quantize_rows(x, layout="grouped_m", group_offs=go, int_round=int_round)
    ref = mx.quantize(x, layout="grouped_m", group_offs=go)
    assert_same_mx(got, ref)
    assert torch.equal(got.group_offs.cpu(), go.cpu())
    assert_same_dense(dequantize(got, torch.float32, int_round=int_round), mx.dequantize(ref, torch.float32))


@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("layout", ["row", "blocked", "grouped_k"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cols_match_reference(dtype, mode, layout, int_round):
    x = wide_random((192, 200), dtype, seed=30 + DTYPES.index(dtype), axis=0).to(DEV)  # M/32 = 6, K = 200
    offs = torch.tensor([32, 32, 96, 160], dtype=torch.int32, device=DEV) if layout == "grouped_k" else None
    got = quantize_cols(x, mode=mode, layout=layout, group_offs=offs, int_round=int_round)
    assert_same_mx(got, mx.quantize(x, mode=mode, axis=0, layout=layout, group_offs=offs))


@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("case", ["rows-row", "rows-blocked", "cols-row", "cols-blocked", "cols-grouped_k"])
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize_matches_reference(case, out_dtype, int_round):
    x = wide_random((160, 224), torch.float32, seed=40).to(DEV)
    kind, layout = case.split("-")
    if kind == "rows":
        ref = mx.quantize(x, layout=layout)
    else:
        offs = torch.tensor([64, 64, 160], dtype=torch.int32, device=DEV) if layout == "grouped_k" else None
        ref = mx.quantize(x, axis=0, layout=layout, group_offs=offs)
    assert_same_dense(dequantize(ref, out_dtype, int_round=int_round), mx.dequantize(ref, out_dtype))


def test_dequantize_default_dtype_and_nd():
    x = wide_random((64, 64), torch.float16, seed=41, specials=False).to(DEV)
    ref = mx.quantize(x.view(2, 32, 64))
    got = dequantize(ref, None)
    assert got.dtype == torch.float16 and got.shape == (2, 32, 64)
    assert_same_dense(got, mx.dequantize(ref, None))


@pytest.mark.parametrize("mode", MODES)
def test_spec_worked_examples(mode):
    """MXFP8.md worked examples (32-value blocks): scale byte and first payload byte, both modes."""
    f = {"floor": 0, "rceil": 1}[mode]
    one_nan = torch.ones(32)
    one_nan[7] = float("nan")
    small = torch.full((32,), 0.01)
    small[0] = 3.75
    tie = torch.full((32,), 1.0625)  # scale byte 119 (2**-8) in both modes; 1.0625 / 2**-8 = 272
    rows = [  # block, (floor byte, floor q0), (rceil byte, rceil q0)
        (torch.zeros(32), [(0, 0x00), (0, 0x00)]),
        (torch.full((32,), 448.0), [(127, 0x7E), (127, 0x7E)]),
        (torch.full((32,), 480.0), [(127, 0x7E), (128, 0x77)]),
        (torch.ones(32), [(119, 0x78), (119, 0x78)]),
        (small, [(120, 0x7E), (121, 0x77)]),
        (one_nan, [(255, 0x7F), (255, 0x7F)]),
        (torch.full((32,), 3.4e38), [(246, 0x7E), (247, 0x78)]),
        (torch.full((32,), 2.0 ** -126), [(0, 0x40), (0, 0x40)]),
        (torch.cat([torch.tensor([1e-40]), torch.zeros(31)]), [(0, 0x09), (0, 0x09)]),
    ]
    x = torch.stack([r[0] for r in rows]).float().to(DEV)
    got = quantize_rows(x, mode=mode)
    for i, (_, exp) in enumerate(rows):
        assert got.scales[i, 0].item() == exp[f][0], (i, got.scales[i, 0].item(), exp[f])
        assert _u8(got.qdata)[i, 0].item() == exp[f][1], (i, hex(_u8(got.qdata)[i, 0].item()), exp[f])
    assert (_u8(got.qdata)[5] == 0x7F).all()  # NaN block: all payload bytes NaN
    assert_same_mx(got, mx.quantize(x, mode=mode))
    # tie -> even at scale 2**-8: 272 is halfway between 256 (0x78) and 288 (0x79)
    t = quantize_rows(tie.view(1, 32).to(DEV), mode=mode)
    assert t.scales[0, 0].item() == 119 and _u8(t.qdata)[0, 0].item() == 0x78
    assert_same_mx(t, mx.quantize(tie.view(1, 32).to(DEV), mode=mode))


def test_special_blocks_stay_in_their_block():
    """NaN / +-Inf poison only their own block (rows and columns); neighbours keep finite scales."""
    for axis in (1, 0):
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
        bad = [(3, 40, float("nan")), (40, 100, float("inf")), (63, 127, -float("inf"))]
        for r, c, v in bad:
            x[r, c] = v
        x = x.to(DEV)
        got = quantize_rows(x) if axis == 1 else quantize_cols(x)
        ref = mx.quantize(x, axis=axis)
        assert_same_mx(got, ref)
        s = got.scales.cpu()
        q = _u8(got.qdata).cpu()
        for r, c, _ in bad:
            blk = (r, c // 32) if axis == 1 else (r // 32, c)
            assert s[blk].item() == 255
            vals = q[r, (c // 32) * 32:(c // 32) * 32 + 32] if axis == 1 else q[(r // 32) * 32:(r // 32) * 32 + 32, c]
            assert (vals == 0x7F).all()
        assert int((s == 255).sum()) == len(bad)


@pytest.mark.parametrize("mode", MODES)
def test_ties_and_subnormals_in_blocks(mode):
    """Every E4M3 tie (+-1 ulp) inside blocks whose scale is 1 (448 present), then scaled by 2**k; fp32
    subnormal blocks (1e-40, 2**-126 neighbours)."""
    v = ties_block_values()
    n = (v.numel() + 30) // 31 * 31
    v = torch.cat([v, torch.zeros(n - v.numel())]).view(-1, 31)
    blocks = torch.cat([torch.full((v.shape[0], 1), 448.0), v], dim=1)  # amax 448 -> scale 2**0 in both modes
    x = torch.cat([blocks * 2.0 ** k for k in (-120, -20, 0, 30)]).view(-1, 64)
    sub = torch.tensor([1e-40, -1e-40, 2 ** -126, 2 ** -127, 1e-45, 3e-39] + [0.0] * 26).view(1, 32)
    x = torch.cat([x, torch.cat([sub, sub * 0.5], dim=1)]).to(DEV)
    assert_same_mx(quantize_rows(x, mode=mode), mx.quantize(x, mode=mode))


def test_noncontiguous_nd_and_empty():
    base = wide_random((96, 160), torch.bfloat16, seed=50).to(DEV)
    xt = base.t()  # [160, 96], non-contiguous
    assert_same_mx(quantize_rows(xt), mx.quantize(xt))
    assert_same_mx(quantize_cols(xt), mx.quantize(xt, axis=0))
    x3 = base.view(3, 32, 160)
    assert_same_mx(quantize_rows(x3, mode="floor"), mx.quantize(x3, mode="floor"))
    e = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    for lay in ("row", "blocked"):
        assert_same_mx(quantize_rows(e, layout=lay), mx.quantize(e, layout=lay))
    offs = torch.tensor([0, 0], dtype=torch.int32, device=DEV)
    assert_same_mx(quantize_rows(e, layout="grouped_m", group_offs=offs), mx.quantize(e, layout="grouped_m", group_offs=offs))


def test_explicit_configs():
    """Non-default tiles (K not a multiple of block_k, rows not a multiple of block_rows) give the same bytes."""
    x = wide_random((70, 416), torch.bfloat16, seed=60).to(DEV)
    ref = mx.quantize(x, layout="blocked")
    for cfg in (QuantizeConfig(block_rows=64, block_k=32), QuantizeConfig(block_rows=16, block_k=128, num_warps=2),
                QuantizeConfig(block_rows=32, block_k=256, num_warps=8)):
        assert_same_mx(quantize_rows(x, layout="blocked", config=cfg), ref)
    xc = x[:64]
    refc = mx.quantize(xc, axis=0, layout="blocked")
    for cfg in (QuantizeConfig(block_rows=32, block_k=64), QuantizeConfig(block_rows=64, block_k=128)):
        assert_same_mx(quantize_cols(xc, layout="blocked", config=cfg), refc)


def test_default_int_round_choice():
    x = torch.ones(32, 32, device=DEV)
    assert kq._resolve_int_round(None, x.device) == (INTERP or x.device.type != "cuda")
    if INTERP:
        with pytest.raises(ValueError, match="int_round=False"):
            quantize_rows(x, int_round=False)


# ------------------------------------------------------------------------------------------------
# errors, raised before any kernel runs
# ------------------------------------------------------------------------------------------------
def test_errors():
    x = torch.randn(64, 64, device=DEV)
    with pytest.raises(ValueError, match="48"):
        quantize_rows(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="40"):
        quantize_cols(torch.randn(40, 64, device=DEV))
    with pytest.raises(TypeError, match="float64"):
        quantize_rows(x.double())
    with pytest.raises(TypeError, match="int32"):
        quantize_cols(x.to(torch.int32))
    with pytest.raises(TypeError):
        quantize_rows(x.numpy() if DEV == "cpu" else [1.0])
    with pytest.raises(ValueError, match="group_offs"):
        quantize_rows(x, layout="grouped_m")
    with pytest.raises(ValueError, match="group_offs"):
        quantize_cols(x, layout="grouped_k")
    with pytest.raises(TypeError, match="int32"):
        quantize_rows(x, layout="grouped_m", group_offs=torch.tensor([1.0, 2.0], device=DEV))
    with pytest.raises(ValueError, match="unknown scale layout"):
        quantize_rows(x, layout="swizzled")
    with pytest.raises(ValueError, match="not supported"):
        quantize_rows(x, layout="grouped_k", group_offs=torch.tensor([32], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="not supported"):
        quantize_cols(x, layout="grouped_m", group_offs=torch.tensor([32], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="2D"):
        quantize_rows(x.view(2, 32, 64), layout="blocked")
    with pytest.raises(ValueError, match="2D"):
        quantize_cols(x.view(2, 32, 64))
    with pytest.raises(ValueError, match="mode"):
        quantize_rows(x, mode="nearest")
    with pytest.raises(ValueError, match="block_k"):
        QuantizeConfig(block_rows=4, block_k=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_cols(x, config=QuantizeConfig(block_rows=16, block_k=64))
    with pytest.raises(TypeError, match="MXTensor"):
        dequantize(x)
    with pytest.raises(TypeError, match="dtype"):
        dequantize(mx.quantize(x), torch.int8)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(kq, "interpret_mode", lambda: False)
    x = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        quantize_rows(x)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        quantize_cols(x)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dequantize(mx.quantize(x))


# ------------------------------------------------------------------------------------------------
# GPU: larger shapes, both rounding paths, reference run on the GPU
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [(1000, 7168), (4096, 2048), (129, 4096), (300, 7168), (8192, 7168)]


@pytest.fixture(autouse=False)
def gpu_kernels():
    if INTERP:
        pytest.fail("mxcomm.kernels was imported under TRITON_INTERPRET=1 (set by an earlier import), so its "
                    "kernels run in the interpreter; run tests/kernels in a process without TRITON_INTERPRET")


@pytest.mark.gpu
@pytest.mark.parametrize("int_round", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_rows_large(shape, mode, int_round, gpu_kernels):
    for dtype in DTYPES:
        x = wide_random(shape, dtype, seed=shape[0] + shape[1], device="cuda")
        for layout in ("row", "blocked"):
            assert_same_mx(quantize_rows(x, mode=mode, layout=layout, int_round=int_round),
                           mx.quantize(x, mode=mode, layout=layout))


@pytest.mark.gpu
@pytest.mark.parametrize("int_round", [True, False])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_cols_large(shape, int_round, gpu_kernels):
    M = shape[0] // 32 * 32
    x = wide_random((M, shape[1]), torch.bfloat16, seed=7, axis=0, device="cuda")
    for mode in MODES:
        for layout in ("row", "blocked"):
            assert_same_mx(quantize_cols(x, mode=mode, layout=layout, int_round=int_round),
                           mx.quantize(x, mode=mode, axis=0, layout=layout))
    offs = torch.tensor([M // 4 // 32 * 32, M // 4 // 32 * 32, M], dtype=torch.int32, device="cuda")
    assert_same_mx(quantize_cols(x, layout="grouped_k", group_offs=offs, int_round=int_round),
                   mx.quantize(x, axis=0, layout="grouped_k", group_offs=offs))


@pytest.mark.gpu
@pytest.mark.parametrize("int_round", [True, False])
def test_gpu_grouped_m_large(int_round, gpu_kernels):
    g = torch.Generator().manual_seed(8)
    x = wide_random((3000, 7168), torch.bfloat16, seed=9, device="cuda")
    sizes = torch.randint(0, 200, (32,), generator=g)
    sizes[3] = 0
    sizes[10] = 128
    ends = torch.cumsum(sizes, 0).clamp(max=2900).to(torch.int32).cuda()
    got = quantize_rows(x, layout="grouped_m", group_offs=ends, int_round=int_round)
    ref = mx.quantize(x, layout="grouped_m", group_offs=ends)
    assert_same_mx(got, ref)
    for dt in DTYPES:
        assert_same_dense(dequantize(got, dt, int_round=int_round), mx.dequantize(ref, dt))


@pytest.mark.gpu
@pytest.mark.parametrize("int_round", [True, False])
def test_gpu_dequantize_roundtrip_large(int_round, gpu_kernels):
    x = wide_random((4096, 7168), torch.bfloat16, seed=11, device="cuda")
    for axis, fn in ((1, quantize_rows), (0, quantize_cols)):
        for layout in ("row", "blocked"):
            q = fn(x, layout=layout)
            assert_same_dense(dequantize(q, torch.bfloat16, int_round=int_round),
                              mx.dequantize(mx.quantize(x, axis=axis, layout=layout), torch.bfloat16))


@pytest.mark.skipif(not INTERP, reason="the bench smoke mode runs under the CPU interpreter")
def test_bench_smoke(tmp_path, monkeypatch):
    """bench/bench_quantize.py --smoke runs end to end, writes its JSON and finds every case bit-exact."""
    import importlib.util
    import json
    import pathlib

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_quantize.py"
    spec = importlib.util.spec_from_file_location("bench_quantize", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "q.json"
    bench.main(["--smoke", "--no-compile", "--shapes", "64x256", "--out", str(out)])
    recs = json.loads(out.read_text())["records"]
    quant = [r for r in recs if r["direction"] != "copy"]
    assert len(quant) == 4 and all("error" not in r and r["bit_exact"] and r["gbps"] > 0 for r in quant)


_AOT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxcomm.kernels import quantize as Q

def compile_(fn, sig, consts, num_warps=8):
    # pointers and K divisible by 16, as Triton specializes them at run time
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n == "K"}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

base = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i32", "M": "i32", "K": "i32",
        "n_groups": "i32", "s_rows": "i32", "s_cols": "i32", "MODE": "constexpr", "INT_ROUND": "constexpr",
        "LAYOUT": "constexpr"}
out = {}
for ir in (False, True):
    for lay in (0, 1, 2):
        sig = dict(base, BLOCK_M="constexpr", BLOCK_K="constexpr", G_POW2="constexpr")
        out[f"rows-{ir}-{lay}"] = compile_(Q._quantize_rows_kernel, sig, dict(MODE=0, INT_ROUND=ir, LAYOUT=lay,
                                           BLOCK_M=8, BLOCK_K=1024, G_POW2=16))
    sig = dict(base, BLOCK_R="constexpr", BLOCK_K="constexpr", G_POW2="constexpr")
    out[f"cols-{ir}"] = compile_(Q._quantize_cols_kernel, sig, dict(MODE=1, INT_ROUND=ir, LAYOUT=2, BLOCK_R=1,
                                 BLOCK_K=256, G_POW2=16))
dsig = {"q_ptr": "*u8", "s_ptr": "*u8", "offs_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "K": "i32",
        "n_groups": "i32", "s_cols": "i32", "INT_ROUND": "constexpr", "LAYOUT": "constexpr", "BF16_INT": "constexpr",
        "OUT_MAX": "constexpr", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "G_POW2": "constexpr"}
out["deq-rows"] = compile_(Q._dequantize_rows_kernel, dsig, dict(INT_ROUND=False, LAYOUT=1, BF16_INT=False,
                           OUT_MAX=3.3895313892515355e38, BLOCK_M=8, BLOCK_K=1024, G_POW2=4))
csig = {k: v for k, v in dsig.items() if k != "BLOCK_M"}
csig = dict(csig, BLOCK_R="constexpr")
out["deq-cols"] = compile_(Q._dequantize_cols_kernel, csig, dict(INT_ROUND=False, LAYOUT=2, BF16_INT=False,
                           OUT_MAX=3.3895313892515355e38, BLOCK_R=2, BLOCK_K=256, G_POW2=16), num_warps=4)
json.dump(out, sys.stdout)
'''


def test_kernels_compile_for_sm90(tmp_path):
    """Without a GPU: the kernels compile to PTX for sm_90 (fresh process, no interpreter), with 16-byte
    vector loads/stores, the satfinite RNE cast on the hardware path, and no flush-to-zero multiplies."""
    import json
    import re

    stdout = run_aot(_AOT, tmp_path)
    ptx = json.loads(stdout)
    for name, p in ptx.items():
        assert "ld.global.v4.b32" in p, f"{name}: global loads not vectorized to 16 bytes"
        assert not re.search(r"\bmul(\.rn)?\.ftz\.f32", p), f"{name}: flush-to-zero multiply"
        if name.startswith(("rows", "cols")):
            assert "st.global.v4.b32" in p, f"{name}: payload stores not vectorized to 16 bytes"
            hw = "-False" in name
            assert ("cvt.rn.satfinite.e4m3x2.f32" in p) == hw, name


def test_gpu_heuristics(monkeypatch):
    """Default GPU tiles (SM count faked at 132): K=7168 in 7 unmasked 1024-wide tiles, 4K elements per
    program for large M (the H200 sweep's best), fewer rows per program when M is small so the grid
    still covers the SMs."""
    monkeypatch.setattr(kq, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    big = kq.default_rows_config(131072, 7168, cuda, False)
    assert (big.block_rows, big.block_k, big.num_warps) == (4, 1024, 4)
    small = kq.default_rows_config(129, 4096, cuda, False)
    assert small.block_rows < 4 and triton.cdiv(129, small.block_rows) * 4 >= 4 * 132 // 2
    tiny_k = kq.default_rows_config(4096, 96, cuda, False)
    assert tiny_k.block_k == 128 and tiny_k.block_rows >= 1
    cols = kq.default_cols_config(131072, 7168, cuda, False)
    assert (cols.block_rows, cols.block_k, cols.num_warps) == (64, 256, 4)
    cols_small = kq.default_cols_config(64, 2048, cuda, False)
    assert cols_small.block_rows == 32


# ------------------------------------------------------------------------------------------------
# saturation: finite inputs near the top of the range stay finite through quantize -> dequantize
# ------------------------------------------------------------------------------------------------
def near_max_rows(dtype):
    """``[22, 64]`` rows at/near ``dtype``'s largest finite value: all +-max, the top 16 finite values (one per
    block with its negation), and 3.39e38 / 3.3895e38 (fp16: 65500, 65472) among small values of the same block."""
    fmax = torch.finfo(dtype).max
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    top = (torch.tensor([fmax], dtype=dtype).view(ib).long() - torch.arange(16)).to(ib).view(dtype).double()
    rows = [torch.full((64,), fmax, dtype=torch.float64), torch.full((64,), -fmax, dtype=torch.float64)]
    for v in top.tolist():
        r = torch.zeros(64, dtype=torch.float64)
        r[3], r[40] = v, -v
        rows.append(r)
    for v in ([3.39e38, -3.39e38, 3.3895e38, 3.0e38] if dtype != torch.float16 else [65500.0, -65504.0, 65472.0, 6e4]):
        r = torch.linspace(-3.0, 3.0, 64, dtype=torch.float64)
        r[7], r[33] = v, -v / 2
        rows.append(r)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("int_round", INT_ROUNDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_dequantize_kernels_saturate_like_reference(in_dtype, mode, int_round):
    """Row- and column-wise quantize + the dequantize kernels (every layout, every output dtype) on near-max
    inputs: bit for bit the reference, which saturates; finite everywhere."""
    x = near_max_rows(in_dtype).to(DEV)
    xc = x.t().contiguous()  # [64, 22]: the same values in 32x1 blocks
    offs = torch.tensor([32, 32, 64], dtype=torch.int32, device=DEV)
    cases = [(quantize_rows(x, mode=mode, layout=lay, int_round=int_round), mx.quantize(x, mode=mode, layout=lay))
             for lay in ("row", "blocked")]
    for lay in ("row", "blocked", "grouped_k"):
        go = offs if lay == "grouped_k" else None
        cases.append((quantize_cols(xc, mode=mode, layout=lay, group_offs=go, int_round=int_round),
                      mx.quantize(xc, mode=mode, axis=0, layout=lay, group_offs=go)))
    for got, ref in cases:
        assert_same_mx(got, ref)
        for dt in DTYPES:
            y = dequantize(got, dt, int_round=int_round)
            assert torch.isfinite(y).all(), (ref.layout, dt, int((~torch.isfinite(y)).sum()))
            assert_same_dense(y, mx.dequantize(ref, dt))
            if dt == in_dtype and mode == "rceil" and in_dtype != torch.float16:
                assert (y.abs() == torch.finfo(dt).max).any()  # the saturating case is in the data


@pytest.mark.parametrize("int_round", INT_ROUNDS)
def test_dequantize_kernels_keep_nan(int_round):
    """A NaN / Inf input block, a 0xFF scale byte over a zero payload and 0x7F / 0xFF payload bytes under a
    finite near-max scale decode to NaN in the kernels as in the reference; the saturated values beside them
    are finite."""
    x = torch.full((2, 128), 3.39e38, dtype=torch.float32)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    m = mx.quantize(x)
    q = _u8(m.qdata).clone()
    s = m.scales.clone()
    s[0, 2] = 255
    q[0, 64:96] = 0
    q[1, 100], q[1, 101] = 0x7F, 0xFF
    ref = mx.MXTensor(qdata=q.view(torch.float8_e4m3fn), scales=s, axis=1)
    dev = mx.MXTensor(qdata=ref.qdata.to(DEV), scales=ref.scales.to(DEV), axis=1)
    for dt in DTYPES:
        y = dequantize(dev, dt, int_round=int_round)
        assert_same_dense(y, mx.dequantize(ref, dt))
        nan = torch.isnan(y.cpu().float())
        assert nan[0, :32].all() and nan[0, 64:96].all() and nan[1, 32:64].all() and nan[1, 100:102].all()
        assert int(nan.sum()) == 32 * 3 + 2
