"""The expert-major output's layout at the receiver: ``copy_out_rows_kernel`` (push and put dispatch: the received rows
out of this rank's symmetric buffer into a fresh tensor), ``scale_rows_to_grouped_kernel`` (the scale rows that
arrived row-major at their payload rows -> the grouped blocked matrix the grouped GEMM reads), and
``_zero_unfilled_rows``, the zeroing of a fresh output's padding rows, which the local path's dispatch
(:mod:`.dispatch`), the pull path's gather (:mod:`.pull`) and combine backward's rows (:mod:`.combine_backward`) share.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....kernels.mx_device import blocked_scale_offset


@triton.jit
def _real_row(r, n_rows, row_src_ptr):
    """True for a received row of the expert-major buffer: ``r < n_rows`` and origin ``row_src[r] >= 0``
    (padding rows and rows past ``n_rows`` are not; ``row_src`` is read only below ``n_rows``)."""
    inside = r < n_rows
    return inside & (tl.load(row_src_ptr + r, mask=inside, other=-1) >= 0)


@triton.jit
def copy_out_rows_kernel(src_ptr, dst_ptr, n_rows_ptr, row_src_ptr, R_out, row0, n_win,
                         ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr):
    """Push and put dispatch, receiver: the received rows out of this rank's symmetric buffer into a fresh tensor.

    Row ``r`` of ``dst`` with ``row0 <= r < min(n_rows, R_out, row0 + n_win)`` gets row ``r - row0`` of ``src`` (the
    receive window of rows ``[row0, row0 + n_win)``; the push path: ``row0 = 0``, every row) when it is a real row
    (``row_src[r] >= 0``), else zeros (padding rows). Rows past ``n_rows`` (the worst-case tail of the no-sync mode)
    are not written. Reads only real rows.

    Args:
        src_ptr / dst_ptr: ``[*, ROW_WORDS]`` rows of any one dtype (int64 words of payload rows, scale bytes).
        n_rows_ptr: int32 scalar; row_src_ptr: int32 ``[>= n_rows]`` origin rank, -1 = padding.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    n = tl.minimum(tl.load(n_rows_ptr), R_out)
    end = tl.minimum(n, row0 + n_win)
    r = row0 + pid
    while r < end:
        real = _real_row(r, n, row_src_ptr)
        base = r.to(tl.int64) * ROW_WORDS
        sbase = (r - row0).to(tl.int64) * ROW_WORDS
        for c0 in tl.static_range(0, ROW_WORDS, CHUNK):
            m = (c0 + offs) < ROW_WORDS
            v = tl.load(src_ptr + sbase + c0 + offs, mask=m & real, other=0)
            tl.store(dst_ptr + base + c0 + offs, v, mask=m)
        r += G


@triton.jit
def _zero_unfilled_rows(dst_ptr, offs_ptr, counts_ptr, n_rows_ptr, R_out, n_groups, pid, G,
                        ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr):
    """Program ``pid`` of ``G``'s share of zeroing the padding rows of a fresh expert-major output: the rows
    ``[start_g + count_g, end_g)`` at the end of groups ``pid, pid + G, ...`` (a group's real rows come first),
    without visiting the real rows. Rows past the last group (``n_rows``; the worst-case tail of the no-sync mode) are
    not written.

    Args:
        dst_ptr: int64 view of the ``[R_out, ROW_WORDS]`` output.
        offs_ptr / counts_ptr: int32 ``[n_groups]`` group END offsets and real rows per group (the plan's).
        n_rows_ptr: int32 scalar, ``offs[-1]`` (unused: the groups end there).
    """
    offs = tl.arange(0, CHUNK)
    zero = tl.zeros([CHUNK], dtype=tl.int64)
    g = pid
    while g < n_groups:
        end = tl.load(offs_ptr + g)
        r = tl.load(offs_ptr + g - 1, mask=g > 0, other=0) + tl.load(counts_ptr + g)
        stop = tl.minimum(end, R_out)
        while r < stop:
            for c0 in tl.static_range(0, ROW_WORDS, CHUNK):
                # 16 bytes a store (rows 16-byte aligned; the output's address may come from a table)
                d = tl.max_contiguous(tl.multiple_of(dst_ptr + r.to(tl.int64) * ROW_WORDS + c0 + offs, 16), 16)
                tl.store(d, zero, mask=(c0 + offs) < ROW_WORDS)
            r += 1
        g += G


@triton.jit
def scale_rows_to_grouped_kernel(rows_ptr, out_ptr, offs_ptr, n_rows_ptr, counts_ptr, n_groups, n_col_tiles,
                                 C: tl.constexpr, CB: tl.constexpr, G_POW2: tl.constexpr, WORD: tl.constexpr = False,
                                 TAIL: tl.constexpr = False):
    """Receiver: the scale rows that arrived row-major at their payload rows -> a fresh grouped-along-M
    blocked matrix (what the grouped GEMM reads), every byte written (zeros for padding).

    Tile-rows past the last group are written as zeros with ``TAIL`` (exact sizes: the matrix's own padding), and
    not at all without it (the worst-case tail of the no-sync mode).

    Program ``(i, cb)`` fills output tile-row ``i`` (blocked rows ``128 i .. 128 i + 127``) for block
    columns ``cb * CB .. cb * CB + CB - 1``. Each group (local expert) starts on a 128-row boundary of the
    blocked matrix, so a tile-row lies in one group ``g``: blocked row ``128 i + r`` is payload row
    ``start_g + 128 i + r - pstart_g``; it is copied when that row is real (among the group's first ``count_g``
    rows - a group's received rows come first, its padding last - and below ``n_rows``), else 0.

    Args:
        rows_ptr: uint8 ``[*, C]`` (``C = H/32``), row-major scales at payload rows.
        out_ptr: uint8 flat ``[tile_rows * 128 * n_col_tiles * 4]`` blocked matrix (``n_col_tiles`` 4-column
            tiles per tile-row).
        offs_ptr: int32 ``[n_groups]`` group END offsets in payload rows; n_rows_ptr: int32 scalar;
        counts_ptr: int32 ``[n_groups]`` received (real) rows per group.
        WORD (``C % 4 == 0``): ``rows_ptr`` / ``out_ptr`` are int32 views and a column is one 4-byte word (the 4
            scale bytes of a 128x4 tile row, contiguous in both layouts): ``C // 4`` word columns, 4x fewer
            memory operations.
    Grid: ``(tile_rows, cdiv(columns, CB))`` with columns = ``4 * n_col_tiles`` (bytes) or ``n_col_tiles`` (WORD).
    """
    _scale_rows_to_grouped(rows_ptr, out_ptr, offs_ptr, n_rows_ptr, counts_ptr, n_groups, n_col_tiles, C, CB,
                           G_POW2, WORD, TAIL)


@triton.jit
def scale_rows_to_grouped_at_kernel(addr_ptr, rows_slot, slot, cap_slot, offs_ptr, n_rows_ptr, counts_ptr, n_groups,
                                    n_col_tiles, C: tl.constexpr, CB: tl.constexpr, G_POW2: tl.constexpr,
                                    WORD: tl.constexpr = False, TAIL: tl.constexpr = False):
    """``scale_rows_to_grouped_kernel`` inside a captured call (:mod:`.call_io`), its tensors at the addresses in the
    int64 table ``addr``: the row-major scale rows at ``addr[rows_slot]``, the blocked matrix at ``addr[slot]`` (uint8,
    or int32 words with ``WORD``), sized for an output of ``addr[cap_slot]`` rows (its capacity, ``cap``): the
    programs of tile-rows at or past ``grouped_m_rows(cap, n_groups) / 128`` write nothing, and none does when the
    plan's ``n_rows`` exceeds ``cap`` (the caller then lays the scales out after its host sync). The rest as that
    kernel."""
    cap = tl.load(addr_ptr + cap_slot)
    tiles = (cap + n_groups * 127 + 127) // 128  # grouped_m_rows(cap, n_groups) // 128 (n_groups >= 1)
    if (tl.program_id(0) < tiles) & (tl.load(n_rows_ptr) <= cap):
        # (both 16-byte aligned: fresh tensors or a symmetric buffer; an address read from memory carries no
        # alignment without the hint)
        if WORD:
            rows_ptr = tl.multiple_of(tl.load(addr_ptr + rows_slot).to(tl.pointer_type(tl.int32)), 16)
            out_ptr = tl.multiple_of(tl.load(addr_ptr + slot).to(tl.pointer_type(tl.int32)), 16)
        else:
            rows_ptr = tl.multiple_of(tl.load(addr_ptr + rows_slot).to(tl.pointer_type(tl.uint8)), 16)
            out_ptr = tl.multiple_of(tl.load(addr_ptr + slot).to(tl.pointer_type(tl.uint8)), 16)
        _scale_rows_to_grouped(rows_ptr, out_ptr, offs_ptr, n_rows_ptr, counts_ptr, n_groups, n_col_tiles, C, CB,
                               G_POW2, WORD, TAIL)


@triton.jit
def _scale_rows_to_grouped(rows_ptr, out_ptr, offs_ptr, n_rows_ptr, counts_ptr, n_groups, n_col_tiles,
                           C: tl.constexpr, CB: tl.constexpr, G_POW2: tl.constexpr, WORD: tl.constexpr,
                           TAIL: tl.constexpr):
    """The body of ``scale_rows_to_grouped_kernel`` (its arguments; ``out_ptr`` a pointer)."""
    i = tl.program_id(0)
    cb = tl.program_id(1)
    g1 = tl.arange(0, G_POW2)
    gm = g1 < n_groups
    end = tl.load(offs_ptr + g1, mask=gm, other=0)
    start = tl.load(offs_ptr + g1 - 1, mask=gm & (g1 > 0), other=0)
    size = end - start
    cnt = tl.load(counts_ptr + g1, mask=gm, other=0)
    p128 = tl.where(gm, (size + 127) // 128 * 128, 0)
    pend = tl.cumsum(p128, axis=0)
    r0 = i * 128
    g = tl.sum((gm & (pend <= r0)).to(tl.int32), axis=0)  # groups that end at or before this tile-row
    sel = g1 == g
    gstart = tl.sum(tl.where(sel, start, 0), axis=0)
    gcount = tl.sum(tl.where(sel, cnt, 0), axis=0)
    gpstart = tl.sum(tl.where(sel, pend - p128, 0), axis=0)
    br = r0 + tl.arange(0, 128)
    prow = gstart + br - gpstart
    real = (g < n_groups) & (br - gpstart < gcount) & (prow < tl.load(n_rows_ptr))
    if TAIL:
        keep = g >= 0  # every tile-row
    else:
        keep = g < n_groups  # not the tile-rows past the last group
    cols = cb * CB + tl.arange(0, CB)
    if WORD:
        # A 128x4 tile is 128 words, word (r % 32) * 4 + r // 32 holding row r; the tiles of a tile-row follow
        # each other. So this program's output is ONE contiguous run of CB * 128 words: the [128, CB] block
        # viewed as [4, 32, CB] (r // 32, r % 32, column), transposed to [CB, 32, 4] in registers (coalesced
        # stores; scattering single words made every 32-byte sector take 8 partial writes).
        NW: tl.constexpr = C // 4
        v = tl.load(rows_ptr + prow.to(tl.int64)[:, None] * NW + cols[None, :],
                    mask=real[:, None] & (cols < NW)[None, :], other=0)
        vt = tl.reshape(tl.permute(tl.reshape(v, (4, 32, CB)), (2, 1, 0)), (CB * 128,))
        o = tl.arange(0, CB * 128)
        tl.store(out_ptr + (i * n_col_tiles + cb * CB).to(tl.int64) * 128 + o, vt,
                 mask=(cb * CB + o // 128 < n_col_tiles) & keep)
    else:
        v = tl.load(rows_ptr + prow.to(tl.int64)[:, None] * C + cols[None, :],
                    mask=real[:, None] & (cols < C)[None, :], other=0)
        tl.store(out_ptr + blocked_scale_offset(br.to(tl.int64)[:, None], cols[None, :], n_col_tiles), v,
                 mask=(cols < 4 * n_col_tiles)[None, :] & keep)
