"""Route-weight gradient kernel (mxcomm.kernels.route_grad) against the plain-torch reference
(mxcomm.ep.reference.backward.route_weight_grad): MXFP8 and BF16 rows, dropped slots, a NaN row, odd k, T = 0.
CPU: Triton interpreter, small sizes; GPU: large sizes. fp32 sums in another order: compared to a
tolerance scaled by the sum of |terms|; exact where every product and sum is exact (small integers)."""
import pytest
import torch

from _triton_mode import load_kernels  # noqa: E402

load_kernels()

from mxcomm import mx  # noqa: E402
from mxcomm.ep.reference.backward import route_weight_grad as reference  # noqa: E402
from mxcomm.kernels.quantize import interpret_mode  # noqa: E402
from mxcomm.kernels.route_grad import route_weight_grad  # noqa: E402

INTERP = interpret_mode()
DEV = "cpu" if INTERP else "cuda"


def _case(T, k, H, n, seed, mxrows, integers=False, nan_row=None, drop_p=0.25, device=DEV):
    g = torch.Generator().manual_seed(seed)
    if integers:
        gy = torch.randint(-4, 5, (T, H), generator=g).float()
        vals = torch.randint(-8, 9, (n, H), generator=g).float()
    else:
        gy = torch.randn(T, H, generator=g)
        vals = torch.randn(n, H, generator=g) * torch.exp2(torch.randint(-4, 5, (n, 1), generator=g).float())
    if nan_row is not None and n:
        vals[nan_row, 5] = float("nan")
    rows = mx.quantize(vals.to(torch.bfloat16)) if mxrows else vals.to(torch.bfloat16)
    pos = torch.randint(0, max(n, 1), (T, k), generator=g, dtype=torch.int32)
    pos[torch.rand(T, k, generator=g) < drop_p] = -1
    if n == 0:
        pos.fill_(-1)
    gy = gy.to(torch.bfloat16)
    if mxrows:
        rows = mx.MXTensor(qdata=rows.qdata.to(device), scales=rows.scales.to(device), axis=1,
                           layout=rows.layout, mode=rows.mode, orig_dtype=rows.orig_dtype)
    else:
        rows = rows.to(device)
    return gy.to(device), rows, pos.to(device)


def _check(got, want, gy, rows, pos, exact):
    assert got.shape == want.shape and got.dtype == torch.float32
    got, want = got.cpu(), want.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.all(got[pos.cpu() < 0] == 0)
    ok = ~torch.isnan(want)
    if exact:
        assert torch.equal(got[ok], want[ok])
        return
    vals = rows.dequantize(torch.float32) if isinstance(rows, mx.MXTensor) else rows.float()
    vals = torch.cat([vals, vals.new_zeros(1, vals.shape[1])]).cpu()
    p = pos.cpu().long()
    mag = (vals[torch.where(p >= 0, p, vals.shape[0] - 1)].abs() * gy.cpu().float().abs()[:, None, :]).sum(-1)
    tol = 1e-5 * mag[ok] + 1e-30
    assert torch.all((got[ok] - want[ok]).abs() <= tol), float(((got[ok] - want[ok]).abs() / tol).max())


@pytest.mark.parametrize("mxrows", [True, False])
@pytest.mark.parametrize("T,k,H,n", [(7, 3, 96, 20), (5, 8, 256, 40), (0, 2, 64, 4), (4, 1, 32, 0)])
def test_route_weight_grad_matches_reference(mxrows, T, k, H, n):
    gy, rows, pos = _case(T, k, H, n, seed=T * 31 + k + H, mxrows=mxrows, nan_row=1 if n > 1 else None)
    _check(route_weight_grad(gy, rows, pos), reference(gy, rows, pos), gy, rows, pos, exact=False)


@pytest.mark.parametrize("mxrows", [True, False])
def test_route_weight_grad_exact_on_small_integers(mxrows):
    gy, rows, pos = _case(9, 4, 128, 30, seed=3, mxrows=mxrows, integers=True)
    _check(route_weight_grad(gy, rows, pos), reference(gy, rows, pos), gy, rows, pos, exact=True)


def test_route_weight_grad_rejects_blocked_scales():
    gy, rows, pos = _case(3, 2, 64, 5, seed=1, mxrows=True)
    blocked = mx.quantize(torch.randn(5, 64).to(torch.bfloat16), layout=mx.ScaleLayout.BLOCKED)
    with pytest.raises(ValueError, match="ROW scales"):
        route_weight_grad(gy, blocked, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("mxrows", [True, False])
def test_gpu_route_weight_grad_large(mxrows):
    if INTERP:
        pytest.fail("mxcomm.kernels was imported under TRITON_INTERPRET=1; run tests/kernels in a process without it")
    gy, rows, pos = _case(4096, 8, 7168, 32768, seed=9, mxrows=mxrows, nan_row=17, device="cuda")
    _check(route_weight_grad(gy, rows, pos), reference(gy, rows, pos), gy, rows, pos, exact=False)


def test_mx_rows_near_bf16_max_decode_saturated():
    """Rows at the top of the bf16 range (rceil rounds their block max to 2**128): each row decodes to the
    values the forward combine summed, saturated to the bf16 max, so grad_w is finite; a one-hot grad_y picks
    the saturated value times a power of two (exact)."""
    bmax = torch.finfo(torch.bfloat16).max
    vals = torch.linspace(-2.0, 2.0, 4 * 64).view(4, 64)
    vals[0, 3], vals[1, 3], vals[2, 3], vals[3, 3] = bmax, -3.39e38, 3.0e38, 1.0
    vals[0, 40] = -bmax
    rows = mx.quantize(vals.to(torch.bfloat16))
    rows = mx.MXTensor(qdata=rows.qdata.to(DEV), scales=rows.scales.to(DEV), axis=1)
    T, k = 3, 2
    pos = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int32)
    gy = torch.zeros(T, 64)
    gy[:, 3] = 2.0 ** -10
    gy[2, 40] = 2.0 ** -12
    got = route_weight_grad(gy.to(torch.bfloat16).to(DEV), rows, pos.to(DEV)).cpu()
    assert torch.isfinite(got).all(), got
    v = rows.dequantize(torch.float32, saturate_to=torch.bfloat16).cpu()
    assert v[0, 3].item() == bmax and v[1, 3].item() == -bmax
    want = torch.zeros(T, k)
    for t in range(T):
        for j in range(k):
            p = int(pos[t, j])
            if p >= 0:
                want[t, j] = (v[p] * gy[t]).sum()
    assert torch.equal(got, want)
