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


def _flat_blocked_index(r, c, n_col_tiles):
    """MXFP8.md's flat index of scale (r, c) in a 128x4-blocked matrix with ``n_col_tiles`` tiles per tile-row."""
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _torch_blocked(s):
    """torch / cuBLAS blocked layout of ``s [R, C]``, element by element from the flat index formula."""
    R, C = s.shape
    Rp, Cp = round_up(R, 128), round_up(C, 4)
    out = torch.zeros(Rp * Cp, dtype=torch.uint8)
    for r in range(R):
        for c in range(C):
            out[_flat_blocked_index(r, c, Cp // 4)] = s[r, c]
    return out.view(Rp, Cp)


def _torch_grouped_m(s, sizes):
    """torch's 2d-3d (grouped along M) scale layout: group g's rows start at row sum_{h<g} round_up(n_h, 128) of
    one matrix with round_up(C, 4) columns, each group blocked on its own; allocation round_up(M + 127 G, 128)."""
    M, C = s.shape
    Cp = round_up(C, 4)
    rows = round_up(M + 127 * len(sizes), 128) if sizes else round_up(M, 128)
    out = torch.zeros(rows * Cp, dtype=torch.uint8)
    start, row0 = 0, 0
    for n in sizes:
        for r in range(n):
            for c in range(C):
                out[_flat_blocked_index(row0 + r, c, Cp // 4)] = s[start + r, c]
        start += n
        row0 += round_up(n, 128)
    return out.view(rows, Cp)


def _torch_grouped_k(s, sizes):
    """torch/FBGEMM's 2d-2d (grouped along K) scale layout (torchao ``torch_to_blocked_2d_K_groups``), loop by loop:
    group g (``n_g = K_g / 32`` scale columns, ``Cg = round_up(n_g, 4)``) is its own blocked matrix of
    ``Rp = round_up(R, 128)`` rows x ``Cg`` columns (tiles row-major within the group), stored from flat byte
    ``Rp * sum_{h<g} C_h``; allocation ``[Rp, round_up(K/32 + 3 G, 4)]``."""
    R, nb = s.shape
    Rp = round_up(R, 128)
    cols = round_up(nb + 3 * len(sizes), 4) if sizes else round_up(nb, 4)
    out = torch.zeros(Rp * cols, dtype=torch.uint8)
    base, kb0 = 0, 0
    for n in sizes:
        ng = n // 32
        cg = round_up(ng, 4)
        for r in range(R):
            for c in range(ng):
                tile = (r // 128) * (cg // 4) + c // 4
                out[base + tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = s[r, kb0 + c]
        base += Rp * cg
        kb0 += ng
    return out.view(Rp, cols)


@pytest.mark.parametrize("shape", [(5, 3), (128, 4), (129, 6), (256, 8), (300, 13)])
def test_blocked_matches_torch_flat_index(shape):
    s = torch.randint(1, 255, shape, dtype=torch.uint8)
    assert torch.equal(to_blocked(s), _torch_blocked(s))


@pytest.mark.parametrize("sizes", [[5, 0, 130, 1], [128, 128], [300, 7, 0, 64], [0]])
def test_grouped_m_matches_torch_flat_index(sizes):
    M, C = int(sum(sizes)), 6
    s = torch.randint(1, 255, (M, C), dtype=torch.uint8)
    assert torch.equal(to_grouped_m(s, _groups(sizes)), _torch_grouped_m(s, sizes))


@pytest.mark.parametrize("rows", [5, 128, 129, 256, 300])
@pytest.mark.parametrize("sizes", [
    [128, 128],              # 4 + 4 scale columns (multiples of 4)
    [64, 0, 96, 32 * 9],     # 2, 0, 3, 9 blocks: an empty group, widths not multiples of 4
    [0, 32, 32 * 5, 0],      # leading / trailing empty groups
    [32 * 7],                # one group
])
def test_grouped_k_matches_torch_layout(rows, sizes):
    """to_grouped_k against the loop-by-loop torch layout; blocks past the last group are dropped and come back 0."""
    offs = _groups(sizes)
    nb = int(sum(sizes)) // 32 + 2  # two K-blocks past offs[-1]
    s = torch.randint(1, 255, (rows, nb), dtype=torch.uint8)
    g = to_grouped_k(s, offs)
    want = _torch_grouped_k(s, sizes)
    assert g.shape == want.shape
    bad = int((g != want).sum())
    assert bad == 0, f"{bad} of {g.numel()} bytes differ"
    back = from_grouped_k(g, offs, rows, nb)
    assert torch.equal(back[:, : nb - 2], s[:, : nb - 2])
    assert int((back[:, nb - 2:] != 0).sum()) == 0


def test_grouped_k_differs_from_one_blocked_matrix_past_128_rows():
    """256 rows, two groups of 128 tokens (4 scale columns each): group 1 starts at byte 256 * 4, not at column 4 of
    one blocked matrix."""
    s = torch.randint(1, 255, (256, 8), dtype=torch.uint8)
    g = to_grouped_k(s, _groups([128, 128]))
    flat = g.reshape(-1)
    assert torch.equal(flat[: 256 * 4], to_blocked(s[:, :4]).reshape(-1))
    assert torch.equal(flat[256 * 4: 256 * 8], to_blocked(s[:, 4:]).reshape(-1))


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
