"""Scale layouts: row, blocked 128x4 (cuBLAS/CUTLASS SWIZZLE_32_4_4), grouped along M and K.

A *scale matrix* here always has the quantized (GEMM reduction, K) axis last:
``S[r, c]`` is the scale of rows ``r`` and K-block ``c``. For a column-wise
quantized tensor (axis 0) the scale matrix is the transpose of its row-layout
scales.

Blocked layout of an ``R x C`` scale matrix: pad to ``round_up(R, 128) x
round_up(C, 4)`` with zero bytes, cut into 128x4 tiles stored tile-row by tile-row
(512 bytes each); inside a tile, element ``(r, c)`` sits at
``(r % 32) * 16 + (r // 32) * 4 + c``. The result is returned as a 2D uint8 tensor of
shape ``[round_up(R,128), round_up(C,4)]`` whose row-major bytes are that order.

Grouped along M (MoE forward / dgrad): groups of rows given by int32 end offsets
``offs[G]``; group ``g``'s scale rows are placed at a 128-aligned row
``start_g = sum_{h<g} round_up(n_h, 128)`` of one blocked matrix with
``rows_alloc = grouped_m_rows(M, G)`` rows, so each group is swizzled on its own and
padded with zero bytes. No device-to-host sync: placement is computed on device.

Grouped along K (wgrad, 2d-2d; what ``torch._scaled_grouped_mm`` / FBGEMM read, as torchao's
``torch_to_blocked_2d_K_groups`` builds it): a scale matrix ``S [R, K/32]`` whose K (token) axis is cut into groups
by element end offsets ``offs[G]`` (each ``K_g`` a multiple of 32, ``n_g = K_g / 32`` scale columns). With
``Rp = round_up(R, 128)`` and ``C_g = round_up(n_g, 4)``, group ``g`` is its **own** blocked matrix
``to_blocked(S[:, group g's columns])`` of ``Rp x C_g`` bytes (rows padded to 128, its columns to 4, zero
padding, 128x4 tiles row-major within the group), stored contiguously from flat byte
``Rp * sum_{h<g} C_h``; the groups follow each other. Flat byte of ``S[r, c]`` (``c`` the ``j``-th column of
group ``g``)::

    Rp * sum_{h<g} C_h + ((r // 128) * (C_g // 4) + j // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + j % 4

The result is a 2D uint8 tensor ``[Rp, grouped_k_cols(K/32, G)]`` (an upper bound on ``sum_g C_g``, no host sync;
the tail is zero). For ``R <= 128`` this coincides with blocking one matrix whose groups start at 4-aligned columns;
for ``R > 128`` it does not (each group's tile-rows are ``C_g / 4`` tiles long, not the whole matrix's).
K-blocks at or past ``offs[-1]`` belong to no group and are not stored.
"""
from __future__ import annotations

import torch

TILE_ROWS = 128
TILE_COLS = 4


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def blocked_index(r: torch.Tensor, c: torch.Tensor, n_col_tiles: int) -> torch.Tensor:
    """Flat byte index of scale (r, c) in a blocked matrix with ``n_col_tiles`` 4-wide tiles per tile-row."""
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def blocked_shape(rows: int, cols: int) -> tuple[int, int]:
    return round_up(rows, TILE_ROWS), round_up(cols, TILE_COLS)


def _place_blocked(scales: torch.Tensor, row_of: torch.Tensor, out_rows: int) -> torch.Tensor:
    """Scatter ``scales[R, C]`` rows to blocked rows ``row_of[R]`` of an ``out_rows``-row blocked matrix."""
    R, C = scales.shape
    Rp, Cp = round_up(out_rows, TILE_ROWS), round_up(C, TILE_COLS)
    out = torch.zeros(Rp * Cp, dtype=torch.uint8, device=scales.device)
    if R and C:
        rr = row_of.to(torch.int64).view(R, 1).expand(R, C)
        cc = torch.arange(C, device=scales.device, dtype=torch.int64).view(1, C).expand(R, C)
        out[blocked_index(rr, cc, Cp // TILE_COLS).reshape(-1)] = scales.reshape(-1).to(torch.uint8)
    return out.view(Rp, Cp)


def _gather_blocked(blocked: torch.Tensor, row_of: torch.Tensor, cols: int) -> torch.Tensor:
    R = row_of.numel()
    Cp = blocked.shape[-1]
    flat = blocked.reshape(-1)
    rr = row_of.to(torch.int64).view(R, 1).expand(R, cols)
    cc = torch.arange(cols, device=blocked.device, dtype=torch.int64).view(1, cols).expand(R, cols)
    return flat[blocked_index(rr, cc, Cp // TILE_COLS).reshape(-1)].view(R, cols)


def _check_scale_matrix(scales: torch.Tensor) -> None:
    if scales.dim() != 2:
        raise ValueError(f"scale matrix must be 2D [rows, K/32], got shape {tuple(scales.shape)}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"scales must be uint8 or float8_e8m0fnu, got {scales.dtype}")


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Row-layout scale matrix ``[R, C]`` uint8 -> blocked ``[round_up(R,128), round_up(C,4)]`` uint8."""
    _check_scale_matrix(scales)
    scales = scales.view(torch.uint8)
    R = scales.shape[0]
    return _place_blocked(scales, torch.arange(R, device=scales.device), R)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: blocked ``[Rp, Cp]`` uint8 -> ``[rows, cols]`` uint8."""
    blocked = blocked.view(torch.uint8)
    Rp, Cp = blocked_shape(rows, cols)
    if tuple(blocked.shape) != (Rp, Cp):
        raise ValueError(f"blocked scales for [{rows}, {cols}] must have shape {(Rp, Cp)}, got {tuple(blocked.shape)}")
    return _gather_blocked(blocked, torch.arange(rows, device=blocked.device), cols)


def grouped_m_rows(m: int, groups: int) -> int:
    """Rows allocated for grouped-along-M blocked scales of ``m`` rows in ``groups`` groups (upper bound, no sync)."""
    return round_up(m + groups * (TILE_ROWS - 1), TILE_ROWS) if groups else round_up(m, TILE_ROWS)


def _check_offs(offs: torch.Tensor) -> None:
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"group offsets must be a 1D int32 tensor of end offsets, got {offs.dtype} {tuple(offs.shape)}")


def grouped_m_row_map(offs: torch.Tensor, m: int) -> torch.Tensor:
    """For each of ``m`` rows, its row in the grouped-along-M blocked matrix (int64 [m], on device).

    Rows at or past ``offs[-1]`` (not in any group) map to -1.
    """
    _check_offs(offs)
    offs = offs.to(torch.int64)
    dev = offs.device
    rows = torch.arange(m, device=dev, dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), offs[:-1]])
    sizes = offs - starts
    padded = (sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    pstart = torch.cumsum(padded, 0) - padded
    g = torch.searchsorted(offs, rows, right=True)
    valid = g < offs.numel()
    gc = torch.clamp(g, max=max(offs.numel() - 1, 0))
    if offs.numel() == 0:
        return torch.full((m,), -1, dtype=torch.int64, device=dev)
    out = pstart[gc] + rows - starts[gc]
    return torch.where(valid, out, torch.full_like(out, -1))


def to_grouped_m(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row-layout scales ``[M, C]`` with row groups ``offs[G]`` -> grouped-along-M blocked
    ``[grouped_m_rows(M, G), round_up(C, 4)]`` uint8 (zero padding, each group swizzled on its own)."""
    _check_scale_matrix(scales)
    scales = scales.view(torch.uint8)
    M = scales.shape[0]
    row_of = grouped_m_row_map(offs, M)
    keep = row_of >= 0
    return _place_blocked(scales[keep], row_of[keep], grouped_m_rows(M, offs.numel()))


def from_grouped_m(blocked: torch.Tensor, offs: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_grouped_m` for the rows inside groups; rows past ``offs[-1]`` come back as 0.
    No host sync and no data-dependent shapes (a clamped gather, then a select), so it can be captured
    in a CUDA graph."""
    row_of = grouped_m_row_map(offs, rows)
    if blocked.numel() == 0 or rows == 0:
        return torch.zeros(rows, cols, dtype=torch.uint8, device=blocked.device)
    got = _gather_blocked(blocked.view(torch.uint8), row_of.clamp(min=0), cols)
    return torch.where((row_of >= 0).view(rows, 1), got, torch.zeros_like(got))


def grouped_k_cols(k_blocks: int, groups: int) -> int:
    """Scale columns allocated for grouped-along-K scales of ``k_blocks`` 32-blocks in ``groups`` groups."""
    return round_up(k_blocks + groups * (TILE_COLS - 1), TILE_COLS) if groups else round_up(k_blocks, TILE_COLS)


def grouped_k_placement(offs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of the ``k // 32`` K-blocks goes in the grouped-along-K layout (int64 ``[k // 32]`` each, on device):
    ``(col0, j, width)`` = its group's first padded column ``sum_{h<g} C_h``, its column inside the group, and
    ``C_g``; all three are -1 for K-blocks past the last group."""
    _check_offs(offs)
    if k % 32:
        raise ValueError(f"grouped-along-K needs K a multiple of 32, got {k}")
    nb = k // 32
    dev = offs.device
    if offs.numel() == 0:
        none = torch.full((nb,), -1, dtype=torch.int64, device=dev)
        return none, none, none
    offs_b = offs.to(torch.int64) // 32
    blocks = torch.arange(nb, device=dev, dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), offs_b[:-1]])
    padded = (offs_b - starts + TILE_COLS - 1) // TILE_COLS * TILE_COLS
    pstart = torch.cumsum(padded, 0) - padded
    g = torch.searchsorted(offs_b, blocks, right=True)
    valid = g < offs.numel()
    gc = torch.clamp(g, max=offs.numel() - 1)
    neg = torch.full_like(blocks, -1)
    return (torch.where(valid, pstart[gc], neg), torch.where(valid, blocks - starts[gc], neg),
            torch.where(valid, padded[gc], neg))


def grouped_k_index(offs: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """Flat byte index of ``S[r, c]`` (int64 ``[rows, k_blocks]``) in the grouped-along-K layout (module doc);
    -1 for K-blocks past the last group."""
    col0, j, width = grouped_k_placement(offs, k_blocks * 32)
    rp = round_up(rows, TILE_ROWS)
    r = torch.arange(rows, device=offs.device, dtype=torch.int64).view(rows, 1)
    idx = rp * col0.view(1, -1) + blocked_index(r, j.view(1, -1), width.view(1, -1) // TILE_COLS)
    return torch.where((width >= 0).view(1, -1), idx, torch.full_like(idx, -1))


def to_grouped_k(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Scale matrix ``[R, K/32]`` (K = tokens, groups of K given by end offsets ``offs`` in elements, each a
    multiple of 32) -> grouped-along-K ``[round_up(R,128), grouped_k_cols(K/32, G)]`` uint8 (module doc: group g's
    own blocked matrix from flat byte ``round_up(R,128) * sum_{h<g} round_up(K_h/32, 4)``)."""
    _check_scale_matrix(scales)
    scales = scales.view(torch.uint8)
    R, nb = scales.shape
    rp, ncols = round_up(R, TILE_ROWS), grouped_k_cols(nb, offs.numel())
    out = torch.zeros(rp * ncols, dtype=torch.uint8, device=scales.device)
    idx = grouped_k_index(offs, R, nb)
    keep = idx >= 0
    out[idx[keep]] = scales[keep]
    return out.view(rp, ncols)


def from_grouped_k(blocked: torch.Tensor, offs: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """Inverse of :func:`to_grouped_k`: ``[rows, k_blocks]`` uint8; K-blocks past the last group come back as 0.
    No host sync (a clamped gather, then a select)."""
    idx = grouped_k_index(offs, rows, k_blocks)
    if blocked.numel() == 0 or rows == 0 or k_blocks == 0:
        return torch.zeros(rows, k_blocks, dtype=torch.uint8, device=blocked.device)
    got = blocked.view(torch.uint8).reshape(-1)[idx.clamp(min=0)]
    return torch.where(idx >= 0, got, torch.zeros_like(got))
