"""The plain-torch reference quantizer against the spec: worked examples, exhaustive scale-rule sweeps,
an independent float64 oracle for payloads, special values, and bad input."""
import math

import numpy as np
import pytest
import torch

from mxcomm.mx import dequantize, quantize, scale_bytes_from_amax, scale_value
from mxcomm.mx.scales import E4M3_MAX

FMAX32 = torch.finfo(torch.float32).max


def _block(fill, first=None):
    x = torch.full((1, 32), fill, dtype=torch.float32)
    if first is not None:
        x[0, 0] = first
    return x


# (block, floor (scale, first payload byte), rceil (scale, first payload byte)) — MXFP8.md worked examples.
WORKED = [
    ("all 0.0", _block(0.0), (0, 0x00), (0, 0x00)),
    ("all 448", _block(448.0), (127, 0x7E), (127, 0x7E)),
    ("all 480", _block(480.0), (127, 0x7E), (128, 0x77)),
    ("all 1.0", _block(1.0), (119, 0x78), (119, 0x78)),
    ("3.75 then small", _block(0.01, 3.75), (120, 0x7E), (121, 0x77)),
    ("one NaN, rest 1.0", _block(1.0, float("nan")), (255, 0x7F), (255, 0x7F)),
    ("all fp32 max", _block(FMAX32), (246, 0x7E), (247, 0x78)),
    ("all 2^-126", _block(2.0**-126), (0, 0x40), (0, 0x40)),
    ("1e-40 then 0", _block(0.0, 1e-40), (0, 0x09), (0, 0x09)),
]


@pytest.mark.parametrize("name,x,floor,rceil", WORKED, ids=[w[0] for w in WORKED])
def test_worked_examples(name, x, floor, rceil):
    for mode, (sb, pb) in (("floor", floor), ("rceil", rceil)):
        mx = quantize(x, mode=mode)
        assert int(mx.scales[0, 0]) == sb, (name, mode)
        assert int(mx.qdata.view(torch.uint8)[0, 0]) == pb, (name, mode)


def test_tie_rounds_to_even():
    # 1.0625 at scale 2^-8 (the block max 2^-8*448/2 keeps scale 2^-8... choose amax so scale = 2^-8):
    # payload 1.0625 lies halfway between e4m3 1.0 (0x38) and 1.125 (0x39): ties to even -> 0x38.
    x = torch.full((1, 32), 1.0625 * 2.0**-8, dtype=torch.float32)
    x[0, 1] = 448.0 * 2.0**-8  # amax = 448 * 2^-8 -> scale 2^-8 in both modes
    for mode in ("floor", "rceil"):
        mx = quantize(x, mode=mode)
        assert int(mx.scales[0, 0]) == 127 - 8
        assert int(mx.qdata.view(torch.uint8)[0, 0]) == 0x38


# ---------------------------------------------------------------- independent oracle (float64 / Python ints)

def _oracle_scale(amax32: float, mode: str) -> int:
    if not math.isfinite(amax32):
        return 255
    if mode == "floor":
        if amax32 == 0.0:
            return 0
        _, ex = math.frexp(amax32)
        return min(max(ex - 1 - 8 + 127, 0), 254)
    p = float(np.float32(amax32) * np.float32(1.0 / 448.0))  # the fp32 product, as hardware computes it
    if p == 0.0:
        return 0
    m, ex = math.frexp(p)
    c = ex - 1 if m == 0.5 else ex  # ceil(log2 p), exact
    return min(max(c, -127), 127) + 127


def _e4m3_table():
    allb = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    pos = [(v, b) for b, v in enumerate(allb) if np.isfinite(v) and v >= 0 and b < 0x80]
    pos.sort()
    return np.array([v for v, _ in pos]), np.array([b for _, b in pos])


E4M3_VALS, E4M3_BYTES = _e4m3_table()


def _oracle_e4m3(v: np.ndarray) -> np.ndarray:
    """RNE satfinite float64 -> e4m3 byte, by nearest table entry (ties -> even mantissa bit)."""
    a = np.minimum(np.abs(v), E4M3_MAX)
    hi = np.clip(np.searchsorted(E4M3_VALS, a, side="left"), 0, len(E4M3_VALS) - 1)
    lo = np.clip(hi - 1, 0, None)
    dlo, dhi = a - E4M3_VALS[lo], E4M3_VALS[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (E4M3_BYTES[hi] % 2 == 0))
    byte = np.where(pick_hi, E4M3_BYTES[hi], E4M3_BYTES[lo])
    return (byte | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_scale_rule_exhaustive_over_bf16_magnitudes(mode):
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # every finite non-negative bf16
    amax = bits.view(torch.bfloat16).to(torch.float32)
    got = scale_bytes_from_amax(amax, mode).tolist()
    want = [_oracle_scale(a, mode) for a in amax.tolist()]
    assert got == want


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_scale_rule_fp32_edges(mode):
    vals = [0.0, 1e-45, 1e-40, 2.0**-127, 2.0**-126, 448.0 * 2.0**-127, 448.0 * 2.0**-126, 1.75, 1.7500001, 1.9999999,
            448.0, 480.0, 512.0, FMAX32, float("inf"), float("nan")]
    x = torch.tensor(vals, dtype=torch.float32)
    x = torch.cat([x, torch.rand(4000) * 2.0 ** torch.randint(-140, 127, (4000,)).float()])
    got = scale_bytes_from_amax(x, mode).tolist()
    assert got == [_oracle_scale(a, mode) for a in x.tolist()]


def test_rceil_never_saturates_floor_may():
    amax = (torch.rand(20000) * 2.0 ** torch.randint(-100, 100, (20000,)).float()).clamp_min(1e-30)
    for mode in ("rceil", "floor"):
        scaled = amax / scale_value(scale_bytes_from_amax(amax, mode)).double().float()
        if mode == "rceil":
            assert bool((scaled <= E4M3_MAX).all())
        else:
            assert bool((scaled < 512).all()) and bool((scaled > E4M3_MAX).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_random_blocks_against_float64_oracle(dtype, mode):
    g = torch.Generator().manual_seed(1234)
    rows, k = 64, 256
    expo = torch.randint(-20 if dtype == torch.float16 else -60, 15 if dtype == torch.float16 else 60, (rows, k // 32, 1), generator=g)
    x = (torch.randn(rows, k // 32, 32, generator=g) * 2.0 ** expo.float()).reshape(rows, k).to(dtype)
    x[3, :32] = 0.0
    x[5, 40] = -0.0
    mx = quantize(x, mode=mode)
    xf = x.to(torch.float64).reshape(rows, k // 32, 32)
    amax = x.to(torch.float32).abs().reshape(rows, k // 32, 32).amax(-1)
    sb = np.array([[_oracle_scale(a, mode) for a in r] for r in amax.tolist()], dtype=np.int64)
    assert mx.scales.tolist() == sb.tolist()
    scale = np.ldexp(1.0, sb - 127)[..., None]
    want = _oracle_e4m3(xf.numpy() / scale)
    want = np.where((sb == 255)[..., None], 0x7F, want).reshape(rows, k)  # fp16 overflow -> Inf -> NaN block
    assert np.array_equal(mx.qdata.view(torch.uint8).numpy(), want)


def test_nan_and_inf_poison_only_their_block():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, 64] = float("inf")
    x[2, 127] = float("-inf")
    for mode in ("rceil", "floor"):
        mx = quantize(x, mode=mode)
        ref_clean = quantize(torch.where(torch.isfinite(x), x, torch.zeros_like(x)), mode=mode)
        bad = torch.zeros(4, 4, dtype=torch.bool)
        bad[0, 0] = bad[1, 2] = bad[2, 3] = True
        assert bool((mx.scales[bad] == 255).all())
        assert bool((mx.scales[~bad] == ref_clean.scales[~bad]).all())
        q = mx.qdata.view(torch.uint8).reshape(4, 4, 32)
        assert bool((q[bad] == 0x7F).all())
        assert torch.equal(q[~bad], ref_clean.qdata.view(torch.uint8).reshape(4, 4, 32)[~bad])
        d = mx.dequantize(torch.float32).reshape(4, 4, 32)
        assert bool(torch.isnan(d[bad]).all()) and bool(torch.isfinite(d[~bad]).all())


def test_dequantize_roundtrip_exact_for_representable_values():
    # values that are e4m3 numbers times a power of two per block survive exactly
    q = torch.randint(0, 0x7F, (8, 64), dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    q[:, ::32] = 448.0  # make every block's max 448 so the scale is exactly the chosen power of two
    x = q * 2.0 ** torch.randint(-20, 20, (8, 2, 1)).float().repeat_interleave(32, 1).reshape(8, 64)
    x = x * torch.where(torch.rand(8, 64) < 0.5, -1.0, 1.0)
    mx = quantize(x, mode="rceil")
    assert torch.equal(dequantize(mx, torch.float32), x)


def test_dequantize_error_bound():
    x = torch.randn(16, 512, dtype=torch.float32) * 3
    for mode in ("rceil", "floor"):
        d = dequantize(quantize(x, mode=mode), torch.float32)
        rel = ((d - x).norm() / x.norm()).item()
        assert rel < 0.04


def test_column_wise_is_row_wise_of_transpose():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    col = quantize(x, axis=0)
    row_t = quantize(x.t().contiguous(), axis=-1)
    assert col.axis == 0 and tuple(col.scales.shape) == (2, 96)
    assert torch.equal(col.qdata.view(torch.uint8), row_t.qdata.view(torch.uint8).t())
    assert torch.equal(col.scales, row_t.scales.t())
    assert torch.equal(col.dequantize(torch.float32), row_t.dequantize(torch.float32).t())


def test_higher_rank_and_empty():
    x = torch.randn(2, 3, 64)
    mx = quantize(x)
    assert tuple(mx.scales.shape) == (2, 3, 2)
    e = quantize(torch.zeros(0, 64, dtype=torch.bfloat16))
    assert tuple(e.qdata.shape) == (0, 64) and tuple(e.scales.shape) == (0, 2)


def test_bad_input():
    with pytest.raises(ValueError, match="100"):
        quantize(torch.randn(4, 100))
    with pytest.raises(TypeError, match="int32"):
        quantize(torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale mode"):
        quantize(torch.randn(4, 64), mode="nearest")
    with pytest.raises(ValueError, match="axis"):
        quantize(torch.randn(4, 64), axis=2)
    with pytest.raises(ValueError, match="group_offs"):
        quantize(torch.randn(4, 64), layout="grouped_m")


# ------------------------------------------------------------------------------------------------
# dequantize saturates: a finite MX value above the output dtype's largest finite value becomes +-that value
# ------------------------------------------------------------------------------------------------
BF16_MAX = torch.finfo(torch.bfloat16).max  # 3.3895314e38
F16_MAX = torch.finfo(torch.float16).max  # 65504


def _bits_around(v: float, dtype: torch.dtype, n: int) -> torch.Tensor:
    """The finite ``dtype`` values at or below ``v`` and their ``n - 1`` lower neighbours (``v`` itself is finite)."""
    ib = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    top = torch.tensor([v], dtype=dtype).view(ib).to(torch.int64)
    return (top - torch.arange(n)).to(ib).view(dtype)


def near_max_blocks(dtype: torch.dtype) -> torch.Tensor:
    """``[rows, 64]`` blocks of ``dtype`` at and near its largest finite value: all-max blocks, the top 16 finite
    values (each in its own block, both signs), 3.39e38 (bf16/fp32), and blocks mixing one near-max value with
    small ones."""
    fmax = torch.finfo(dtype).max
    top = _bits_around(fmax, dtype, 16).to(torch.float64)
    rows = [torch.full((64,), fmax, dtype=torch.float64), torch.full((64,), -fmax, dtype=torch.float64)]
    for v in top.tolist():
        r = torch.zeros(64, dtype=torch.float64)
        r[3], r[40] = v, -v
        rows.append(r)
    extra = [3.39e38, -3.39e38, 3.3895e38] if dtype != torch.float16 else [65500.0, -65504.0, 65472.0]
    for v in extra:
        r = torch.linspace(-3.0, 3.0, 64, dtype=torch.float64)  # small values in the same blocks
        r[7], r[33] = v, -v / 2
        rows.append(r)
    return torch.stack(rows).to(dtype)


def _exact(m) -> torch.Tensor:
    """float64 ``e4m3(q) * 2**(b-127)`` of a row-wise MXTensor (no overflow in float64); NaN blocks NaN."""
    q = m.qdata.to(torch.float64)
    b = m.scales.to(torch.float64)
    s = torch.where(b == 255, torch.full_like(b, float("nan")), torch.exp2(b - 127))
    return (q.view(q.shape[0], -1, 32) * s.unsqueeze(-1)).view(q.shape)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_saturates_to_output_max(in_dtype, out_dtype, mode):
    """quantize -> dequantize of finite inputs at/near the top of the range is finite: +-max(out_dtype) where the
    exact MX value exceeds it, the exact value (rounded to out_dtype) elsewhere."""
    x = near_max_blocks(in_dtype)
    m = quantize(x, mode=mode)
    exact = _exact(m)
    omax = torch.finfo(out_dtype).max
    want = torch.where(exact.abs() > omax, exact.sign() * omax, exact).to(out_dtype)
    got = dequantize(m, out_dtype)
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite values"
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if mode == "rceil" and in_dtype != torch.float16 and out_dtype != torch.float16:
        assert (exact.abs() > omax).any()  # the case exists: the rounded block max overflows the output dtype


def test_bf16_max_block_dequantizes_to_bf16_max():
    """The motivating value: 3.39e38 (rounds to bf16 max) gets scale 2**120 and payload 256 under rceil
    (256 * 2**120 = 2**128); bf16 and fp32 outputs saturate, the values beside it keep their exact values."""
    x = torch.tensor([[3.39e38] + [1e36] * 30 + [-3.39e38]], dtype=torch.bfloat16)
    m = quantize(x)
    assert m.scales.item() == 247 and m.qdata.view(torch.uint8)[0, 0].item() == 0x78
    y = dequantize(m, torch.bfloat16)
    assert y[0, 0].item() == BF16_MAX and y[0, -1].item() == -BF16_MAX
    assert y[0, 1].item() == float(m.qdata[0, 1].float()) * 2.0 ** 120
    assert dequantize(m, torch.float32)[0, 0].item() == FMAX32
    # in fp32, saturated to the bf16 max (what a bf16 consumer that sums in fp32 needs)
    assert dequantize(m, torch.float32, saturate_to=torch.bfloat16)[0, 0].item() == BF16_MAX
    w = torch.tensor([0.75, 0.25])
    v = dequantize(m, torch.float32, saturate_to=torch.bfloat16)
    assert torch.isfinite((w[0] * v + w[1] * v).to(torch.bfloat16)).all()  # a combine of the row stays finite


def test_dequantize_saturation_keeps_nan():
    """NaN stays NaN: a NaN/Inf input block (scale 0xFF), a 0xFF scale byte with a zero payload, 0x7F / 0xFF payload
    bytes under a finite scale; their neighbours are unaffected."""
    x = torch.ones(1, 128, dtype=torch.float32) * 3.0e38
    x[0, 5] = float("nan")
    x[0, 40] = float("inf")
    m = quantize(x)
    q = m.qdata.view(torch.uint8).clone()
    s = m.scales.clone()
    s[0, 2] = 255
    q[0, 64:96] = 0
    q[0, 100], q[0, 101] = 0x7F, 0xFF
    m2 = type(m)(qdata=q.view(torch.float8_e4m3fn), scales=s, axis=1)
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        y = dequantize(m2, dt).float()
        nan = torch.isnan(y[0])
        want = torch.zeros(128, dtype=torch.bool)
        want[0:96] = True
        want[100:102] = True
        assert torch.equal(nan, want), dt
        assert torch.isfinite(y[0, 96:100]).all() and torch.isfinite(y[0, 102:]).all()


def test_saturate_to_checks():
    m = quantize(torch.ones(1, 32))
    with pytest.raises(ValueError, match="saturate_to"):
        dequantize(m, torch.bfloat16, saturate_to=torch.float32)
