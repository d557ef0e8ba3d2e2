"""Scale layouts against a loop-by-loop construction of the 128x4 tile order, per-group independence, round trips."""
import pytest
import torch

from mxcomm.mx import (
    ScaleLayout,
    from_blocked,
    from_grouped_k,
    from_grouped_m,
    grouped_m_rows,
    quantize,
    round_up,
    to_blocked,
    to_grouped_k,
    to_grouped_m,
)


def _naive_blocked(s: torch.Tensor) -> torch.Tensor:
    """Pad to (128, 4) multiples, cut 128x4 tiles tile-row by tile-row, inside a tile (r%32)*16 + (r//32)*4 + c."""
    R, C = s.shape
    Rp, Cp = round_up(R, 128), round_up(C, 4)
    pad = torch.zeros(Rp, Cp, dtype=torch.uint8)
    pad[:R, :C] = s
    out = []
    for tr in range(Rp // 128):
        for tc in range(Cp // 4):
            tile = pad[tr * 128:(tr + 1) * 128, tc * 4:(tc + 1) * 4]
            flat = torch.zeros(512, dtype=torch.uint8)
            for r in range(128):
                for c in range(4):
                    flat[(r % 32) * 16 + (r // 32) * 4 + c] = tile[r, c]
            out.append(flat)
    return torch.cat(out).view(Rp, Cp)


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 7), (257, 224), (5, 3)])
def test_to_blocked_matches_tile_construction(shape):
    s = torch.randint(1, 255, shape, dtype=torch.uint8)
    b = to_blocked(s)
    assert torch.equal(b, _naive_blocked(s))
    assert torch.equal(from_blocked(b, *shape), s)


def test_blocked_padding_is_zero():
    s = torch.full((3, 5), 200, dtype=torch.uint8)
    b = to_blocked(s)
    assert b.shape == (128, 8)
    assert int((b != 0).sum()) == 15


def _groups(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("sizes", [[5, 0, 130, 1], [0, 0, 0], [128, 128], [1], [300, 7, 0, 64]])
def test_grouped_m_each_group_swizzled_on_its_own(sizes):
    offs = _groups(sizes)
    M, C = int(sum(sizes)), 7
    s = torch.randint(1, 255, (M, C), dtype=torch.uint8)
    g = to_grouped_m(s, offs)
    assert g.shape == (grouped_m_rows(M, len(sizes)), round_up(C, 4))
    flat = g.reshape(-1)
    pos, start = 0, 0
    for n in sizes:
        blk = to_blocked(s[start:start + n]) if n else torch.zeros(0, round_up(C, 4), dtype=torch.uint8)
        assert torch.equal(flat[pos:pos + blk.numel()], blk.reshape(-1))
        pos += blk.numel()
        start += n
    assert int((flat[pos:] != 0).sum()) == 0  # tail of the upper-bound allocation stays zero
    assert torch.equal(from_grouped_m(g, offs, M, C), s)


def test_grouped_k_each_group_in_own_columns():
    sizes = [64, 0, 96, 32 * 9]
    offs = _groups(sizes)
    K = int(sum(sizes))
    R = 130
    s = torch.randint(1, 255, (R, K // 32), dtype=torch.uint8)
    g = to_grouped_k(s, offs)
    mat = from_blocked(g, R, g.shape[1])
    col, kb = 0, 0
    for n in sizes:
        nb = n // 32
        assert torch.equal(mat[:, col:col + nb], s[:, kb:kb + nb])
        assert int((mat[:, col + nb:col + round_up(nb, 4)] != 0).sum()) == 0
        col += round_up(nb, 4)
        kb += nb
    assert torch.equal(from_grouped_k(g, offs, R, K // 32), s)


def test_mxtensor_layout_round_trip_and_dequantize():
    x = torch.randn(200, 96, dtype=torch.bfloat16)
    row = quantize(x)
    offs = _groups([50, 0, 150])
    for layout, go in (("blocked", None), ("grouped_m", offs)):
        mx = quantize(x, layout=layout, group_offs=go)
        assert mx.layout == ScaleLayout(layout)
        assert torch.equal(mx.row_scales(), row.scales)
        assert torch.equal(mx.dequantize(torch.float32), row.dequantize(torch.float32))
    col = quantize(x[:192], axis=0, layout="blocked")
    assert torch.equal(col.row_scales(), quantize(x[:192], axis=0).scales)
