"""MXWeight (one orientation) and MXWeightCache (forward + dgrad from the fp32 master, staleness)."""
import pytest
import torch

from gemm_cases import DEV, master_updates, rand

from mxcomm import mx
from mxcomm.gemm import MXWeight, MXWeightCache, StaleWeightCacheError
from mxcomm.gemm.weights import blocked3d_to_rows, rows_to_blocked3d
from mxcomm.mx import ScaleLayout


def _u8(t):
    return t.contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_orientations_match_reference_quantize(mode):
    G, N, K = 3, 64, 96
    w = rand((G, N, K), 0)
    fwd = MXWeight.from_dense(w, mode=mode)
    assert fwd.shape == (G, N, K) and fwd.qdata.is_contiguous()
    for g in range(G):
        ref = mx.quantize(w[g], mode=mode)  # blocks along K
        assert torch.equal(_u8(fwd.qdata[g]), _u8(ref.qdata)) and torch.equal(fwd.scales[g].cpu(), ref.scales.cpu())
    dg = MXWeight.from_dense(w, transpose=True, mode=mode)
    assert dg.shape == (G, K, N) and dg.qdata.is_contiguous()
    for g in range(G):
        ref = mx.quantize(w[g], mode=mode, axis=0)  # 32x1 blocks along N of [N, K]
        assert torch.equal(_u8(dg.qdata[g]), _u8(ref.qdata.t()))
        assert torch.equal(dg.scales[g].cpu(), ref.scales.t().cpu())  # [K, N/32]
    # the two orientations really hold different numbers (not a transpose of each other)
    assert not torch.equal(fwd.dequantize(torch.float32), dg.dequantize(torch.float32).transpose(1, 2))


def test_blocked_layout_per_expert():
    G, N, K = 2, 160, 96  # N not a multiple of 128, K/32 = 3 not a multiple of 4: padding on both axes
    w = rand((G, N, K), 1)
    row = MXWeight.from_dense(w)
    blk = MXWeight.from_dense(w, layout="blocked")
    assert blk.scales.shape == (G, 256 * 4)
    for g in range(G):
        assert torch.equal(blk.scales[g].view(256, 4).cpu(), mx.to_blocked(row.scales[g]).cpu())
    assert torch.equal(blocked3d_to_rows(blk.scales, N, K // 32), row.scales)
    assert torch.equal(rows_to_blocked3d(row.scales), blk.scales)
    assert torch.equal(blk.row_scales(), row.scales) and torch.equal(row.blocked_scales(), blk.scales)
    assert torch.equal(blk.dequantize(torch.float32), row.dequantize(torch.float32))


def test_keep_bf16_copy_equals_dequantize():
    w = rand((2, 32, 64), 2)
    m = MXWeight.from_dense(w, keep_bf16=True)
    assert m.dense is not None and m.dense.dtype == torch.bfloat16
    assert torch.equal(m.dense, mx.dequantize(m.as_mxtensor(), torch.bfloat16))


def test_weight_validation():
    with pytest.raises(ValueError):
        MXWeight.from_dense(torch.zeros(2, 48, 64, device=DEV), transpose=True)
    with pytest.raises(ValueError):
        MXWeight.from_dense(torch.zeros(2, 64, 48, device=DEV))
    assert MXWeight.from_dense(torch.zeros(2, 48, 64, device=DEV)).shape == (2, 48, 64)
    with pytest.raises(TypeError):
        MXWeight.from_dense(torch.zeros(48, 64, device=DEV))
    good = MXWeight.from_dense(torch.ones(2, 32, 64, device=DEV))
    with pytest.raises(ValueError):
        MXWeight(qdata=good.qdata, scales=good.scales[:, :, :1])
    with pytest.raises(TypeError):
        MXWeight(qdata=good.qdata.view(torch.uint8), scales=good.scales)


def test_cache_memory_is_two_times_33_over_32():
    G, N, K = 4, 128, 256
    c = MXWeightCache(rand((G, N, K), 3))
    assert c.scale_layout == ScaleLayout.ROW  # no native GEMM here
    assert c.nbytes() == 2 * G * N * K * 33 // 32
    c2 = MXWeightCache(rand((G, N, K), 3), keep_bf16=True)
    assert c2.nbytes() == 2 * G * N * K * 33 // 32 + 2 * 2 * G * N * K
    c3 = MXWeightCache(rand((G, N, K), 3), build_dgrad=False)
    assert c3.nbytes() == G * N * K * 33 // 32
    with pytest.raises(RuntimeError):
        c3.dgrad_weight()


def test_cache_contents_follow_master():
    p = torch.nn.Parameter(rand((2, 64, 64), 4))
    c = MXWeightCache(p)
    assert torch.equal(_u8(c.forward_weight().qdata), _u8(MXWeight.from_dense(p).qdata))
    assert torch.equal(_u8(c.dgrad_weight().qdata), _u8(MXWeight.from_dense(p, transpose=True).qdata))
    with torch.no_grad():
        p.mul_(3.0)
    c.refresh()
    assert c.generation == 2
    assert torch.equal(_u8(c.forward_weight().qdata), _u8(MXWeight.from_dense(p).qdata))
    assert torch.equal(_u8(c.dgrad_weight().qdata), _u8(MXWeight.from_dense(p, transpose=True).qdata))


@pytest.mark.parametrize("name, update", master_updates(), ids=[n for n, _ in master_updates()])
def test_stale_cache_raises(name, update):
    p = torch.nn.Parameter(rand((2, 32, 64), 5))
    c = MXWeightCache(p)
    assert not c.is_stale()
    c.forward_weight()
    update(p)
    assert c.is_stale()
    with pytest.raises(StaleWeightCacheError, match="refresh"):
        c.forward_weight()
    with pytest.raises(StaleWeightCacheError):
        c.dgrad_weight()
    c.refresh()
    assert not c.is_stale()
    assert torch.equal(_u8(c.forward_weight().qdata), _u8(MXWeight.from_dense(p).qdata))


def test_auto_refresh():
    p = torch.nn.Parameter(rand((2, 32, 64), 6))
    c = MXWeightCache(p, auto_refresh=True)
    with torch.no_grad():
        p.add_(1.0)
    fw = c.forward_weight()
    assert c.generation == 2 and torch.equal(_u8(fw.qdata), _u8(MXWeight.from_dense(p).qdata))


def test_backward_generation_check_never_refreshes():
    p = torch.nn.Parameter(rand((2, 32, 64), 7))
    c = MXWeightCache(p, auto_refresh=True)
    gen = c.generation
    c.dgrad_weight(expected_generation=gen)
    with torch.no_grad():
        p.add_(1.0)
    with pytest.raises(StaleWeightCacheError, match="between forward and backward"):
        c.dgrad_weight(expected_generation=gen)
    c.refresh()
    with pytest.raises(StaleWeightCacheError, match="between forward and backward"):
        c.dgrad_weight(expected_generation=gen)


def test_writes_the_version_counter_misses_and_the_remedies():
    """Fused AdamW and writes through .data do not bump the version counter (documented limitation); the
    cache offers attach_optimizer (refresh after every step) and mark_stale for them."""
    p = torch.nn.Parameter(rand((2, 32, 64), 8))
    c = MXWeightCache(p)
    with torch.no_grad():
        p.data.add_(1.0)
    assert not c.is_stale()  # invisible to the version counter
    c.mark_stale()
    with pytest.raises(StaleWeightCacheError):
        c.forward_weight()
    c.refresh()
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    handle = c.attach_optimizer(opt)
    p.grad = torch.ones_like(p)
    gen = c.generation
    opt.step()
    assert c.generation == gen + 1 and not c.is_stale()
    assert torch.equal(_u8(c.forward_weight().qdata), _u8(MXWeight.from_dense(p).qdata))
    handle.remove()
    opt.step()
    assert c.generation == gen + 1


def test_cache_validation():
    with pytest.raises(TypeError):
        MXWeightCache(torch.zeros(32, 64, device=DEV))
    with pytest.raises(ValueError):
        MXWeightCache(torch.zeros(2, 32, 40, device=DEV))
    with pytest.raises(TypeError):
        MXWeightCache(torch.zeros(2, 32, 64, dtype=torch.int32, device=DEV))
    assert "generation=1" in repr(MXWeightCache(torch.zeros(2, 32, 64, device=DEV)))
