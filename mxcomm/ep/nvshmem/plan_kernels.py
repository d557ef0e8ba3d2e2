"""The routing plan of :func:`mxcomm.ep.plan.build_plan` (plus the nvshmem backend's row origins) in Triton
kernels instead of ~60 small torch ops: the same int32 tensors, bit for bit (tested against ``build_plan`` and
``row_origins``). No host sync, so it can be captured in a CUDA graph like the rest of the no-sync mode.

The slots ``t*k + j`` are taken in blocks of whole tokens (``tokens_per_block(k)`` tokens, ~``_SLOT_BLOCK``
slots), through a table ``hist [blocks, E + 1]`` (key = expert id, ``E`` for a dropped slot):

1. :func:`check_and_count` (before the counts exchange), two kernels:
   a. :func:`slot_check_hist_kernel` (one program per block): the device-side id check (ids outside
      ``[-1, E)`` and repeats within a token dropped and counted into an error word; the nvshmem backend runs it
      in both size modes, and exact-size mode raises on what it found before sending), the checked int32 ids,
      and each key's count in the block (atomics into the block's own row: no contention);
   b. :func:`slot_scan_kernel` (one program per ``_SCAN_KEYS`` keys): per key, the counts become the count in
      the lower blocks, and the key's total is this rank's count for that expert.
   Their bodies are the device functions :func:`check_hist_block` and :func:`scan_keys`, which the nvshmem backend's
   pull dispatch runs in its own two launches, with its counts exchange and pack (``pull_head_kernel``,
   ``scan_and_wait_kernel``).
2. :func:`plan_kernel` (after the exchange, one launch): every program derives the per-expert and per-source tables
   from the exchanged counts matrix ``[W, E]``, held as a ``[W_src, W_dst, El]`` tile (cumulative sums along each
   axis); one program writes them (and the nvshmem backend's status words); one group places the slots, block by
   block (each slot's occurrence index among the slots of its key in ``(t, j)`` order: lower blocks + its rank in the
   block, a ``[BLOCK, BLOCK]`` comparison; hence its send position, destination rank/row, and ``send_order``); the
   other writes the row origins (for each expert-major receive row, its origin rank and position in that origin's
   send order; -1 for padding rows and rows past the last group). Deriving the tables in every program (a few
   thousand values) costs less than the launch and the wait a separate tables kernel would put between them.

:func:`triton_plan` runs 2 (and 1 without the check when it is not given step 1's table).

Sizes: the tables tile holds ``W_POW2^2 * El_POW2`` values; :func:`fits` says whether a config fits
(``MAX_TABLE``); callers use the torch plan otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ...kernels.launch import cdiv, fast_kernel, next_pow2
from ..plan import RoutingPlan

MAX_TABLE = 16384  # W_POW2 * W_POW2 * El_POW2: the counts tile every program of plan_kernel holds
# slot kernels: slots per block (rounded down to whole tokens), a [128, 128] comparison tile in slot_place_kernel;
# slot_scan_kernel's tile, blocks x keys (2K values: no spills)
_SLOT_BLOCK = 128
_SCAN_ROWS, _SCAN_KEYS = 256, 8
# plan_kernel: rows per block of the row-origin maps; most programs of each of its two groups (each loops over its
# blocks; every program first derives the tables from the counts)
_ORIGIN_ROWS = 128
_MAX_PROGRAMS = 512


def tokens_per_block(k: int) -> int:
    """Tokens per block of the slot kernels for top-``k`` (``_SLOT_BLOCK // pow2(k)``, at least 1)."""
    return max(1, _SLOT_BLOCK // next_pow2(k))


def slot_blocks(T: int, k: int) -> int:
    """Blocks of the slot kernels for ``T`` tokens (rows of their ``hist`` table)."""
    return cdiv(T, tokens_per_block(k))


@dataclass(frozen=True)
class ScanTile:
    """The tile of a scan of the block table (:func:`scan_keys`): ``blocks`` rows x ``keys`` keys, one program per
    ``keys`` keys."""

    blocks: int
    keys: int


def scan_tile(n_blocks: int, n_keys: int) -> ScanTile:
    """The scan tile for a table of ``n_blocks`` rows (``n_keys`` keys): all rows at once up to ``_SCAN_ROWS``."""
    return ScanTile(blocks=min(_SCAN_ROWS, next_pow2(max(1, n_blocks))), keys=_SCAN_KEYS)


def fits(world: int, num_experts: int) -> bool:
    """True when the tables of ``world`` ranks x ``num_experts`` experts fit the one-program kernel."""
    return next_pow2(world) ** 2 * next_pow2(num_experts // world) <= MAX_TABLE


@triton.jit
def check_hist_block(idx_ptr, out_ptr, hist_ptr, err_ptr, blk, T, E, K: tl.constexpr, K_POW2: tl.constexpr,
                     TOK: tl.constexpr, CHECK: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Block ``blk`` of ``TOK`` tokens: with ``CHECK``, ids outside ``[-1, E)`` and repeats of an id within a token
    (every occurrence after the first) become -1 and are counted into the int64 ``err[0]``; the checked ids go to
    ``out`` (int32 ``[T, K]``); then how many of the block's slots go to each key (expert id, ``E`` = dropped) into
    row ``blk`` of ``hist`` int32 ``[blocks, E + 1]`` (zeroed here, ``ZERO_BLOCK`` entries at a time, then one
    atomic add per slot).

    idx_ptr: ``[T, K]`` ids of any integer dtype (checked before narrowing to int32)."""
    row = hist_ptr + blk * (E + 1)
    offs = tl.arange(0, ZERO_BLOCK)
    zero = tl.zeros((ZERO_BLOCK,), tl.int32)
    k0 = 0
    while k0 < E + 1:  # (a while: the interpreter rejects range() over a runtime bound)
        tl.store(row + k0 + offs, zero, mask=k0 + offs < E + 1)
        k0 += ZERO_BLOCK
    t = blk * TOK + tl.arange(0, TOK)[:, None]
    j = tl.arange(0, K_POW2)[None, :]
    m = (t < T) & (j < K)
    idx = tl.load(idx_ptr + t * K + j, mask=m, other=-1)
    if CHECK:
        bad = (idx < -1) | (idx >= E)
        same = idx[:, :, None] == idx[:, None, :]                                    # [TOK, K, K]
        earlier = tl.arange(0, K_POW2)[None, None, :] < tl.arange(0, K_POW2)[None, :, None]
        rep = tl.sum((same & earlier & (idx[:, None, :] >= 0) & m[:, None, :]).to(tl.int32), axis=2) > 0
        bad = m & (bad | (rep & (idx >= 0)))
        idx = tl.where(bad, -1, idx)
        nbad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
        if nbad > 0:
            tl.atomic_add(err_ptr, nbad.to(tl.int64))
    idx = idx.to(tl.int32)
    tl.store(out_ptr + t * K + j, idx, mask=m)
    tl.debug_barrier()  # the zeros before the counts (other threads of the program add to them)
    tl.atomic_add(row + tl.where(idx < 0, E, idx), tl.full(idx.shape, 1, tl.int32), mask=m)


@triton.jit
def slot_check_hist_kernel(idx_ptr, out_ptr, hist_ptr, err_ptr, T, E, K: tl.constexpr, K_POW2: tl.constexpr,
                           TOK: tl.constexpr, CHECK: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """:func:`check_hist_block` for every block of ``TOK`` tokens, one program each (grid ``cdiv(T, TOK)``)."""
    check_hist_block(idx_ptr, out_ptr, hist_ptr, err_ptr, tl.program_id(0), T, E, K, K_POW2, TOK, CHECK, ZERO_BLOCK)


@triton.jit
def scan_keys(hist_ptr, counts_ptr, n_blocks, n_keys, k1, BLOCK_B: tl.constexpr):
    """For the keys ``k1`` (int32 ``[BLOCK_K]``, those ``>= n_keys`` ignored), in place over ``hist`` int32
    ``[n_blocks, n_keys]``: each entry becomes the sum of its column over the lower rows (exclusive prefix over
    blocks), ``BLOCK_B`` rows at a time; each column's total goes to ``counts[key]`` for ``key < n_keys - 1`` (the
    last key, dropped slots, is not stored). The loads are volatile (the rows may have been counted by other
    programs of the same launch)."""
    kk = k1[None, :]
    rows = tl.arange(0, BLOCK_B)[:, None]
    carry = tl.zeros(k1.shape, tl.int32)
    b = 0
    while b < n_blocks:
        m = (kk < n_keys) & (b + rows < n_blocks)
        ptr = hist_ptr + (b + rows) * n_keys + kk
        h = tl.load(ptr, mask=m, other=0, volatile=True)
        tl.store(ptr, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=m)
        carry += tl.sum(h, axis=0)
        b += BLOCK_B
    tl.store(counts_ptr + k1, carry, mask=k1 < n_keys - 1)


@triton.jit
def slot_scan_kernel(hist_ptr, counts_ptr, n_blocks, n_keys, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`scan_keys` over ``hist`` int32 ``[n_blocks, n_keys]`` (the per-block counts of
    :func:`check_hist_block`; each entry becomes the slots of its key in the lower blocks) and the per-key totals
    into ``counts`` (int32 ``[E]``: the slots sent to each expert). One program per ``BLOCK_K`` keys, grid
    ``cdiv(n_keys, BLOCK_K)``."""
    scan_keys(hist_ptr, counts_ptr, n_blocks, n_keys, tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K), BLOCK_B)


@triton.jit
def counts_tile(counts_ptr, c_stride, W, El, W_POW2: tl.constexpr, EL_POW2: tl.constexpr):
    """The counts matrix as a ``[W_src, W_dst, El]`` tile (zeros outside ``W x W x El``): ``c[s, d, l]`` = rows
    source ``s`` sends to local expert ``l`` of rank ``d`` (``counts[s, d * El + l]``, rows ``c_stride`` apart)."""
    s = tl.arange(0, W_POW2)[:, None, None]
    d = tl.arange(0, W_POW2)[None, :, None]
    lo = tl.arange(0, EL_POW2)[None, None, :]
    ok = (s < W) & (d < W) & (lo < El)
    return tl.load(counts_ptr + s * c_stride + d * El + lo, mask=ok, other=0)


@triton.jit
def _send_excl(c):
    """``[Ws, Wd, El]``: rows source ``s`` sends to experts before ``(d, l)`` in global expert order."""
    blk = tl.sum(c, axis=2)                                                          # [Ws, Wd]
    return (tl.cumsum(blk, axis=1) - blk)[:, :, None] + tl.cumsum(c, axis=2) - c


@triton.jit
def _send_tables(c, se, me, align, W_POW2: tl.constexpr):
    """Sender tables of rank ``me`` from the counts tile ``c`` ``[Ws, Wd, El]`` and its :func:`_send_excl` ``se``:
    ``(dst_base, send_base)``, each ``[Wd, El]`` - the first row of ``me``'s rows in each expert's group on its rank,
    and ``me``'s send position base per expert (rows ``me`` sends to experts before it in global order)."""
    mine = tl.arange(0, W_POW2)[:, None, None] == me                                # [Ws, 1, 1]
    lower = tl.arange(0, W_POW2)[:, None, None] < me
    n = tl.sum(c, axis=0)                                                            # [Wd, El] rows per expert
    p = (n + align - 1) // align * align                                             # padded group rows
    gstart = tl.cumsum(p, axis=1) - p                                                # group start on rank d
    return (gstart + tl.sum(tl.where(lower, c, 0), axis=0),                          # + rows of lower sources
            tl.sum(tl.where(mine, se, 0), axis=0))


@triton.jit
def _recv_tables(c, se, me, align, W_POW2: tl.constexpr):
    """Receiver tables of rank ``me`` from the counts tile ``c`` ``[Ws, Wd, El]`` and its :func:`_send_excl` ``se``:
    ``(offs, rows_me, c_me, srp, ssp)`` - group ends ``[El]`` (padded), rows per local expert ``[El]``, and per
    (source, local expert) ``[Ws, El]``: rows received, src_row_start, src_send_pos."""
    dsel = tl.arange(0, W_POW2)[None, :, None] == me                                # [1, Wd, 1]
    c_me = tl.sum(tl.where(dsel, c, 0), axis=1)                                      # [Ws, El]
    n_me = tl.sum(c_me, axis=0)                                                      # [El]
    p_me = (n_me + align - 1) // align * align
    offs = tl.cumsum(p_me, axis=0)
    srp = (offs - p_me)[None, :] + tl.cumsum(c_me, axis=0) - c_me
    return offs, n_me, c_me, srp, tl.sum(tl.where(dsel, se, 0), axis=1)


@triton.jit
def _groups_end(offs, El, EL_POW2: tl.constexpr):
    """``offs[El - 1]`` of the group ends ``offs`` ``[EL_POW2]``: where the last group ends (the plan's
    ``num_rows``)."""
    return tl.max(tl.where(tl.arange(0, EL_POW2) < El, offs, 0), axis=0)


@triton.jit
def _flat(t, N: tl.constexpr):
    """A 2-D tile as its ``N`` values in row-major order (what ``tl.gather`` indexes)."""
    return tl.reshape(t, (N,))


@triton.jit
def store_tables(c, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, status_ptr, refusal_ptr, n_refusal, me, align, W,
                  El, W_POW2: tl.constexpr, EL_POW2: tl.constexpr, STATUS: tl.constexpr):
    """Every table of the plan into its tensor (see :func:`plan_kernel`); with ``STATUS`` the status words too."""
    E = W * El
    se = _send_excl(c)
    dst_base, send_base = _send_tables(c, se, me, align, W_POW2)
    offs, n_me, c_me, srp, ssp = _recv_tables(c, se, me, align, W_POW2)
    w2 = tl.arange(0, W_POW2)[:, None]
    l2 = tl.arange(0, EL_POW2)[None, :]
    ok2 = (w2 < W) & (l2 < El)
    tl.store(tab_ptr + 0 * E + w2 * El + l2, dst_base, mask=ok2)
    tl.store(tab_ptr + 1 * E + w2 * El + l2, send_base, mask=ok2)
    tl.store(srp_ptr + w2 * El + l2, srp, mask=ok2)
    tl.store(ssp_ptr + w2 * El + l2, ssp, mask=ok2)
    s3 = tl.arange(0, W_POW2)[:, None, None]
    d3 = tl.arange(0, W_POW2)[None, :, None]
    l3 = tl.arange(0, EL_POW2)[None, None, :]
    tl.store(cnt_ptr + s3 * E + d3 * El + l3, c, mask=(s3 < W) & (d3 < W) & (l3 < El))
    l1 = tl.arange(0, EL_POW2)
    lm = l1 < El
    tl.store(recv_ptr + l1, offs, mask=lm)
    tl.store(recv_ptr + El + l1, n_me, mask=lm)
    w1 = tl.arange(0, W_POW2)
    wm = w1 < W
    recv_splits = tl.sum(c_me, axis=1)                                               # [Ws]
    send_splits = tl.sum(tl.sum(tl.where(s3 == me, c, 0), axis=0), axis=1)           # [Wd]
    tl.store(recv_ptr + 2 * El + w1, recv_splits, mask=wm)
    tl.store(recv_ptr + 2 * El + W + w1, send_splits, mask=wm)
    tail = recv_ptr + 2 * El + 2 * W
    num_rows = _groups_end(offs, El, EL_POW2)
    tl.store(tail + 0, num_rows)
    tl.store(tail + 1, tl.sum(recv_splits, axis=0))                                  # num_recv
    tl.store(tail + 2, tl.sum(send_splits, axis=0))                                  # num_send
    if STATUS:
        tl.store(status_ptr + 2, num_rows.to(tl.int64))
        if n_refusal > 0:
            ref = tl.load(refusal_ptr + w1, mask=w1 < n_refusal, other=0)
            first = tl.min(tl.where(ref != 0, w1, W_POW2), axis=0)
            tl.store(status_ptr + 3, tl.where(first < n_refusal, first + 1, 0).to(tl.int64))


@triton.jit
def place_slots(dst_base, send_base, num_send, idx_ptr, pre_ptr, dest_rank_ptr, dest_row_ptr, send_pos_ptr,
                 order_ptr, b, n_slots, E, El, EL_POW2: tl.constexpr, S: tl.constexpr, S_POW2: tl.constexpr):
    """Block ``b`` of ``S`` slots: each slot's occurrence index among the slots of its key in ``(t, j)`` order (its
    key's count in the lower blocks, ``pre``, + its rank in the block: a ``[S, S]`` comparison), hence its send
    position, destination rank and row, and its entry of ``send_order`` (dropped slots after the ``num_send`` sent
    ones). ``dst_base`` / ``send_base``: :func:`_send_tables`' tiles, flat (``d * EL_POW2 + l``)."""
    i = tl.arange(0, S_POW2)
    sl = b * S + i
    inb = (i < S) & (sl < n_slots)
    key = tl.load(idx_ptr + sl, mask=inb, other=-1)
    key = tl.where(key < 0, E, key)                                                  # E: a dropped slot
    same = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])               # [S_POW2, S_POW2]
    occ = tl.load(pre_ptr + b * (E + 1) + key, mask=inb, other=0) + tl.sum(same.to(tl.int32), axis=1)
    dropped = key == E
    kk = tl.where(inb & ~dropped, key, 0)
    at = kk // El * EL_POW2 + kk % El                                                # (rank, local expert) in a tile
    dst = tl.gather(dst_base, at, 0)
    snd = tl.gather(send_base, at, 0)
    order = tl.where(dropped, num_send, snd) + occ
    # (always inside [0, n_slots) when pre and the counts come from these ids; the mask keeps a warm-up run on other
    # ids from writing outside the order table)
    tl.store(order_ptr + order, sl, mask=inb & (order >= 0) & (order < n_slots))
    tl.store(dest_rank_ptr + sl, tl.where(dropped, -1, key // El), mask=inb)
    tl.store(dest_row_ptr + sl, tl.where(dropped, -1, dst + occ), mask=inb)
    tl.store(send_pos_ptr + sl, tl.where(dropped, -1, snd + occ), mask=inb)


@triton.jit
def _row_origins(offs, c_me, srp, ssp, src_ptr, pos_ptr, rb, n_rows, El, W,
                 W_POW2: tl.constexpr, EL_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[rb * BLOCK, (rb + 1) * BLOCK)`` of the row-origin maps: each receive row's origin rank and position
    in that origin's send order (-1 for padding rows and rows past the last group). ``offs``, ``c_me``, ``srp``,
    ``ssp``: :func:`_recv_tables`' (the last three flat, ``s * EL_POW2 + l``)."""
    r = rb * BLOCK + tl.arange(0, BLOCK)
    rin = r < n_rows
    # group of row r: how many group ends are <= r, by a binary search over the ascending ends (it counts up to
    # EL_POW2 - 1: a row past the last group then gets group El - 1 or El, and lies in none of its source blocks)
    ends = tl.where(tl.arange(0, EL_POW2) < El, offs, 2147483647)
    g = tl.zeros((BLOCK,), tl.int32)
    for i in tl.static_range(1, 31):
        if (EL_POW2 >> i) > 0:
            g += tl.where(tl.gather(ends, g + ((EL_POW2 >> i) - 1), 0) <= r, EL_POW2 >> i, 0)
    in_group = rin & (g < El)
    w1 = tl.arange(0, W_POW2)
    at = _flat(w1[None, :] * EL_POW2 + tl.minimum(g, El - 1)[:, None], BLOCK * W_POW2)  # [B, W] (source, group)
    start = tl.reshape(tl.gather(srp, at, 0), (BLOCK, W_POW2))
    cnt = tl.reshape(tl.gather(c_me, at, 0), (BLOCK, W_POW2))
    sp = tl.reshape(tl.gather(ssp, at, 0), (BLOCK, W_POW2))
    inside = (w1 < W)[None, :] & (r[:, None] >= start) & (r[:, None] < start + cnt)  # at most one source
    real = in_group & (tl.sum(inside.to(tl.int32), axis=1) > 0)
    s = tl.sum(tl.where(inside, w1[None, :], 0), axis=1)
    pos = tl.sum(tl.where(inside, sp + r[:, None] - start, 0), axis=1)
    tl.store(src_ptr + r, tl.where(real, s, -1), mask=rin)
    tl.store(pos_ptr + r, tl.where(real, pos, -1), mask=rin)


@triton.jit
def slot_tables(c, me, align, W_POW2: tl.constexpr, EL_POW2: tl.constexpr):
    """What the slot programs of rank ``me`` need from the counts tile ``c`` ``[Ws, Wd, El]``: ``(dst_base,
    send_base, num_send)`` - :func:`_send_tables`' two tiles flat (``d * EL_POW2 + l``) and the rows ``me`` sends."""
    N: tl.constexpr = W_POW2 * EL_POW2
    dst_base, send_base = _send_tables(c, _send_excl(c), me, align, W_POW2)
    num_send = tl.sum(tl.where(tl.arange(0, W_POW2)[:, None, None] == me, c, 0))
    return _flat(dst_base, N), _flat(send_base, N), num_send


@triton.jit
def origin_blocks(c, src_ptr, pos_ptr, rb, step, n_rows, me, align, W, El, W_POW2: tl.constexpr,
                  EL_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """The row-origin maps ``src`` / ``pos`` ``[n_rows]`` of rank ``me`` over blocks ``rb, rb + step, ...`` of
    ``BLOCK`` rows (-1 without a lookup for the blocks past the last group), from the counts tile ``c``."""
    N: tl.constexpr = W_POW2 * EL_POW2
    offs, n_me, c_me, srp, ssp = _recv_tables(c, _send_excl(c), me, align, W_POW2)
    c_me = _flat(c_me, N)
    srp = _flat(srp, N)
    ssp = _flat(ssp, N)
    real_rows = _groups_end(offs, El, EL_POW2)
    while rb * BLOCK < n_rows:
        if rb * BLOCK < real_rows:
            _row_origins(offs, c_me, srp, ssp, src_ptr, pos_ptr, rb, n_rows, El, W, W_POW2, EL_POW2, BLOCK)
        else:  # past the last group (the worst-case tail of the maps): no group to look up
            r = rb * BLOCK + tl.arange(0, BLOCK)
            tl.store(src_ptr + r, tl.full((BLOCK,), -1, tl.int32), mask=r < n_rows)
            tl.store(pos_ptr + r, tl.full((BLOCK,), -1, tl.int32), mask=r < n_rows)
        rb += step


# sizes, rank and strides are not specialized (equal to 1, multiples of 16): one compile per tile shape, not one per
# call size or rank
@triton.jit(do_not_specialize=["c_stride", "n_slots", "n_rows", "table_programs", "slot_programs", "n_refusal", "me",
                               "align", "W", "El"])
def plan_kernel(counts_ptr, c_stride, idx_ptr, pre_ptr, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr,
                dest_rank_ptr, dest_row_ptr, send_pos_ptr, order_ptr, src_ptr, pos_ptr, status_ptr, refusal_ptr,
                n_slots, n_rows, table_programs, slot_programs, n_refusal, me, align, W, El,
                W_POW2: tl.constexpr, EL_POW2: tl.constexpr, S: tl.constexpr, S_POW2: tl.constexpr,
                BLOCK: tl.constexpr, STATUS: tl.constexpr):
    """The routing plan of rank ``me`` after the counts exchange, in one launch. Every program loads the counts
    matrix ``[W, E]`` (int32, rows ``c_stride`` apart, ``E = W * El``) as a ``[W_src, W_dst, El]`` tile and derives
    the tables its job needs from it (cumulative sums along each axis; the same values in every program), so no
    program waits for another. Three groups of programs, by ``program_id``:

    * ``[0, table_programs)`` (0 or 1 program) writes the tables (int32): ``cnt [W, E]`` a copy of the counts;
      ``tab [2, E]`` per global expert the first row of this rank's rows in the expert's group on its rank, and this
      rank's send position base; ``recv [2 El + 2 W + 3]``: offs, expert_counts, recv_splits, send_splits, num_rows,
      num_recv, num_send; ``srp`` / ``ssp`` ``[W, El]`` src_row_start / src_send_pos (the fields of
      :func:`triton_plan`'s plan). With ``STATUS`` also the int64 status words of the nvshmem backend:
      ``status[2]`` = num_rows, and (``n_refusal`` > 0) ``status[3]`` = 1 + the lowest of the ``n_refusal`` ranks
      whose int32 word at ``refusal_ptr`` is non-zero (0: none);
    * the next ``slot_programs`` place the slots, over blocks of ``S`` slots (those of
      :func:`slot_check_hist_kernel`; ``pre`` its scanned table ``[blocks, E + 1]``, ``idx`` the checked ids
      ``[n_slots]``): ``dest_rank``, ``dest_row``, ``send_pos`` ``[n_slots]`` (-1 for a dropped slot) and
      ``order [n_slots]``;
    * the others write the row-origin maps ``src`` / ``pos`` ``[n_rows]`` over blocks of ``BLOCK`` rows (-1 without a
      lookup for the blocks past the last group: most of the worst-case ``n_rows``).

    Grid: ``table_programs + slot_programs + origin programs`` (at least 1); the last two groups loop over their
    blocks.
    """
    pid = tl.program_id(0)
    c = counts_tile(counts_ptr, c_stride, W, El, W_POW2, EL_POW2)
    table_or_origin_job(c, pid, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, status_ptr, refusal_ptr, src_ptr, pos_ptr,
                        n_rows, table_programs, slot_programs, n_refusal, me, align, W, El, W_POW2, EL_POW2, BLOCK,
                        STATUS)
    if (pid >= table_programs) & (pid < table_programs + slot_programs):
        dst_base, send_base, num_send = slot_tables(c, me, align, W_POW2, EL_POW2)
        b = pid - table_programs
        while b * S < n_slots:
            place_slots(dst_base, send_base, num_send, idx_ptr, pre_ptr, dest_rank_ptr, dest_row_ptr, send_pos_ptr,
                        order_ptr, b, n_slots, W * El, El, EL_POW2, S, S_POW2)
            b += slot_programs


@triton.jit
def table_or_origin_job(c, pid, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, status_ptr, refusal_ptr, src_ptr,
                        pos_ptr, n_rows, table_programs, slot_programs, n_refusal, me, align, W, El,
                        W_POW2: tl.constexpr, EL_POW2: tl.constexpr, BLOCK: tl.constexpr, STATUS: tl.constexpr):
    """Program ``pid`` of :func:`plan_kernel`'s grid outside its slot group: the tables (programs ``[0,
    table_programs)``: :func:`store_tables`) or the row origins (from ``table_programs + slot_programs`` on:
    :func:`origin_blocks`); nothing in a slot program. ``c``: the counts tile."""
    if pid < table_programs:
        store_tables(c, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, status_ptr, refusal_ptr, n_refusal, me, align,
                     W, El, W_POW2, EL_POW2, STATUS)
    elif pid >= table_programs + slot_programs:
        origin_blocks(c, src_ptr, pos_ptr, pid - table_programs - slot_programs,
                      tl.num_programs(0) - table_programs - slot_programs, n_rows, me, align, W, El, W_POW2, EL_POW2,
                      BLOCK)


@dataclass(frozen=True)
class CheckedIds:
    """What :func:`check_and_count` produces.

    ids: int32 ``[T, k]``, the routing with bad slots set to -1. counts: int32 ``[E]``, the slots this rank sends
    to each expert. slot_prefix: int32 ``[slot_blocks(T, k), E + 1]``, per block and key the slots of that key in
    the lower blocks (what :func:`triton_plan` reads as ``prefix``).
    """

    ids: torch.Tensor
    counts: torch.Tensor
    slot_prefix: torch.Tensor


def check_and_count(topk_idx: torch.Tensor, num_experts: int, err: torch.Tensor, *, check: bool,
                    prefix_buf: Optional[torch.Tensor] = None, counts_out: Optional[torch.Tensor] = None,
                    ids_out: Optional[torch.Tensor] = None) -> CheckedIds:
    """The routing with bad slots dropped (``check``; each dropped slot adds 1 to the int64 ``err[0]``), the rows
    this rank sends to each expert and the slot kernels' block table, in two kernels (the torch path:
    ``_sanitize`` + :func:`mxcomm.ep.plan.local_counts`).

    Args:
        topk_idx: ``[T, k]`` ids of any integer dtype. err: int64 ``[1]``.
        prefix_buf: int32 with at least ``slot_blocks(T, k) * (E + 1)`` values to hold ``slot_prefix`` (a fixed
            address a captured plan reads), else a fresh one. counts_out: int32 ``[E]`` to write the counts into.
        ids_out: int32 with ``T * k`` values to write the checked ids into (e.g. the head of :func:`plan_storage`),
            else a fresh ``[T, k]``.
    """
    T, k = topk_idx.shape
    E = num_experts
    dev = topk_idx.device
    idx = topk_idx.contiguous()
    ids = torch.empty(T, k, dtype=torch.int32, device=dev) if ids_out is None else ids_out.view(-1)[:T * k].view(T, k)
    nb = slot_blocks(T, k)
    n_hist = nb * (E + 1)
    if prefix_buf is None:
        prefix_buf = torch.empty(n_hist, dtype=torch.int32, device=dev)
    elif prefix_buf.numel() < n_hist:
        raise ValueError(f"prefix_buf holds {prefix_buf.numel()} values, {n_hist} needed for {T} tokens")
    pre = prefix_buf.view(-1)[:n_hist].view(nb, E + 1)
    counts = counts_out if counts_out is not None else torch.empty(E, dtype=torch.int32, device=dev)
    if T:
        fast_kernel(slot_check_hist_kernel)[(nb,)](idx, ids, pre, err, T, E, K=k, K_POW2=next_pow2(k),
                                                   TOK=tokens_per_block(k), CHECK=check,
                                                   ZERO_BLOCK=min(1024, next_pow2(E + 1)))
        tile = scan_tile(nb, E + 1)
        fast_kernel(slot_scan_kernel)[(cdiv(E + 1, tile.keys),)](
            pre, counts, nb, E + 1, BLOCK_B=tile.blocks, BLOCK_K=tile.keys)
    else:
        counts.zero_()
    return CheckedIds(ids=ids, counts=counts, slot_prefix=pre)


@dataclass(frozen=True)
class PlanLaunch:
    """How :func:`plan_kernel` is launched for a world: warps a program, rows per block of the row-origin maps."""

    warps: int
    origin_rows: int


@dataclass(frozen=True)
class PlanJobs:
    """A kernel that runs :func:`plan_kernel`'s jobs and jobs of its own in the same launch: ``kernel`` takes
    ``plan_kernel``'s arguments first (same names and order) and then ``extra`` (keyword arguments, constexprs
    included); its grid is ``plan_kernel``'s."""

    kernel: object
    extra: dict


def plan_launch(world: int, num_experts: int) -> PlanLaunch:
    """The launch of :func:`plan_kernel` for ``world`` ranks and ``num_experts`` experts (8 warps for counts tiles
    above 2048 values)."""
    tile = next_pow2(world) ** 2 * next_pow2(num_experts // world)
    return PlanLaunch(warps=4 if tile <= 2048 else 8, origin_rows=_ORIGIN_ROWS)


@dataclass(frozen=True)
class _Tables:
    """The int32 tables :func:`plan_kernel`'s table program writes (views of one buffer): ``cnt [W, E]``,
    ``tab [2, E]``, ``recv [2 El + 2 W + 3]``, ``srp`` / ``ssp`` ``[W, El]``."""

    cnt: torch.Tensor
    tab: torch.Tensor
    recv: torch.Tensor
    srp: torch.Tensor
    ssp: torch.Tensor

    @staticmethod
    def sizes(W: int, E: int) -> list:
        """Values of cnt, tab, recv, srp, ssp (in that order in the buffer)."""
        El = E // W
        return [W * E, 2 * E, 2 * El + 2 * W + 3, W * El, W * El]

    @staticmethod
    def numel(W: int, E: int) -> int:
        return sum(_Tables.sizes(W, E))

    @staticmethod
    def views(ints: torch.Tensor, W: int, E: int) -> "_Tables":
        """The tables as views of the first :meth:`numel` values of the int32 ``ints``."""
        sizes = _Tables.sizes(W, E)
        cnt, tab, recv, srp, ssp = torch.split(ints[:sum(sizes)], sizes)
        return _Tables(cnt=cnt, tab=tab, recv=recv, srp=srp, ssp=ssp)


def plan_numel(W: int, E: int, T: int, k: int, n_orig: int) -> int:
    """int32 values :func:`triton_plan` writes for ``T`` tokens, top-``k``, ``n_orig`` row-origin rows."""
    return _Tables.numel(W, E) + 4 * T * k + 2 * n_orig


def plan_storage(W: int, E: int, T: int, k: int, n_orig: int, device) -> torch.Tensor:
    """One fresh int32 buffer for a dispatch's checked ids (the first ``T * k`` values: ``check_and_count(...,
    ids_out=)``) and its plan (the rest: ``triton_plan(..., out=)``), so that every output of a captured middle shares
    one storage (one copy per replay, :class:`mxcomm.ep.nvshmem.plan_graph.OutputCopier`)."""
    return torch.empty(T * k + plan_numel(W, E, T, k, n_orig), dtype=torch.int32, device=device)


def triton_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int, n_rows: int,
                prefix: Optional[torch.Tensor] = None, origins: bool = True, status: Optional[torch.Tensor] = None,
                refusals: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                jobs: Optional[PlanJobs] = None) -> dict:
    """The plan with the Triton kernels: ``{"plan": RoutingPlan, "origin_src", "origin_pos"}`` (the row origins
    only with ``origins``; see :func:`plan_row_origins` for computing them later).

    Args:
        counts: int32 ``[W, E]`` (all ranks' counts; read, not kept). topk_idx: int32 ``[T, k]`` (ids in
            ``[-1, E)``, no repeats within a token; other integer dtypes are converted).
        rank, align: as :func:`build_plan`. n_rows: rows of the row-origin maps (``R_max`` of the backend).
        prefix: :attr:`CheckedIds.slot_prefix` of these ids (:func:`check_and_count`), else computed here.
        status: int64 ``[>= 4]`` status words to write ``status[2]`` (the row count) into, and ``status[3]`` from
            ``refusals`` (int32 ``[W]`` refusal words of the counts exchange): see :func:`plan_kernel`.
        out: int32 with at least :func:`plan_numel` values to hold the plan (else a fresh buffer).
        jobs: launch this kernel instead of ``plan_kernel`` (the same plan, and its own jobs besides).
    """
    W, E = counts.shape
    El = E // W
    T, k = topk_idx.shape
    dev = counts.device
    n = T * k
    idx = topk_idx.to(torch.int32)
    if n and prefix is None:
        prefix = check_and_count(idx, E, torch.zeros(1, dtype=torch.int64, device=dev), check=False).slot_prefix
    n_orig = n_rows if origins else 0
    numel = plan_numel(W, E, T, k, n_orig)
    if out is None:
        ints = torch.empty(numel, dtype=torch.int32, device=dev)
    elif out.numel() < numel:
        raise ValueError(f"out holds {out.numel()} values, {numel} needed for the plan")
    else:
        ints = out.view(-1)[:numel]
    t = _Tables.views(ints, W, E)
    rest = ints[_Tables.numel(W, E):]
    slots, osrc, opos = rest[:4 * n].view(4, n), rest[4 * n:4 * n + n_orig], rest[4 * n + n_orig:]
    _launch_plan(counts, rank, align, osrc, opos, tables=t, idx=idx, prefix=prefix, slots=slots,
                 n_blocks=slot_blocks(T, k) if n else 0, S=tokens_per_block(k) * k, status=status, refusals=refusals,
                 jobs=jobs)
    recv = t.recv
    plan = RoutingPlan(
        rank=rank, world_size=W, num_experts=E, num_local_experts=El, align=align, topk=k, num_tokens=T,
        counts=t.cnt.view(W, E),
        dest_rank=slots[0].view(T, k), dest_row=slots[1].view(T, k), send_pos=slots[2].view(T, k),
        send_order=slots[3],
        send_splits=recv[2 * El + W:2 * El + 2 * W], num_send=recv[2 * El + 2 * W + 2:2 * El + 2 * W + 3],
        recv_splits=recv[2 * El:2 * El + W], expert_counts=recv[El:2 * El], offs=recv[:El],
        src_row_start=t.srp.view(W, El), src_send_pos=t.ssp.view(W, El),
        num_rows=recv[2 * El + 2 * W:2 * El + 2 * W + 1], num_recv=recv[2 * El + 2 * W + 1:2 * El + 2 * W + 2],
    )
    out = {"plan": plan}
    if origins:
        out.update(origin_src=osrc, origin_pos=opos)
    return out


def _launch_plan(counts: torch.Tensor, rank: int, align: int, osrc: torch.Tensor, opos: torch.Tensor, *,
                 tables: Optional[_Tables] = None, idx: Optional[torch.Tensor] = None,
                 prefix: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None, n_blocks: int = 0,
                 S: int = 1, status: Optional[torch.Tensor] = None, refusals: Optional[torch.Tensor] = None,
                 jobs: Optional[PlanJobs] = None) -> None:
    """:func:`plan_kernel`: the tables into ``tables`` (none without); with ``slots`` (int32 ``[4, n]``: dest_rank,
    dest_row, send_pos, send_order) the ``n`` slots of ``idx`` over ``n_blocks`` blocks of ``S`` (``prefix``: their
    scanned table); the ``osrc.numel()`` rows of the row-origin maps ``osrc`` / ``opos``; ``status`` / ``refusals``
    (with tables only): the status words (see :func:`plan_kernel`); ``jobs``: the kernel to launch instead. An absent
    tensor argument is passed as ``osrc`` (never written)."""
    W, E = counts.shape
    El = E // W
    if counts.stride(1) != 1:
        counts = counts.contiguous()
    n_slots = 0 if slots is None else slots.shape[1]
    if slots is None:
        slots = osrc.new_empty(4, 0)
    n_orig = osrc.numel()
    how = plan_launch(W, E)
    table_programs = 0 if tables is None else 1
    slot_programs = min(n_blocks, _MAX_PROGRAMS) if n_slots else 0
    origin_programs = min(cdiv(n_orig, how.origin_rows), _MAX_PROGRAMS)
    t = tables if tables is not None else _Tables(cnt=osrc, tab=osrc, recv=osrc, srp=osrc, ssp=osrc)
    write_status = tables is not None and status is not None
    read_refusals = write_status and refusals is not None
    kernel = plan_kernel if jobs is None else jobs.kernel
    fast_kernel(kernel)[(max(1, table_programs + slot_programs + origin_programs),)](
        counts, counts.stride(0), osrc if idx is None else idx, osrc if prefix is None else prefix, t.cnt, t.tab,
        t.recv, t.srp, t.ssp, slots[0], slots[1], slots[2], slots[3], osrc, opos,
        status if write_status else osrc, refusals if read_refusals else osrc, n_slots, n_orig, table_programs,
        slot_programs, W if read_refusals else 0, rank, align, W, El,
        W_POW2=next_pow2(W), EL_POW2=next_pow2(El), S=S, S_POW2=next_pow2(S), BLOCK=how.origin_rows,
        STATUS=write_status, num_warps=how.warps, **({} if jobs is None else jobs.extra))


def plan_row_origins(plan: RoutingPlan, n_rows: int) -> dict:
    """``{"origin_src", "origin_pos"}`` int32 ``[n_rows]`` of ``plan`` (what :func:`triton_plan` returns with
    ``origins``), computed from the plan's counts matrix by :func:`plan_kernel` (its row-origin programs alone)."""
    ints = torch.empty(2 * n_rows, dtype=torch.int32, device=plan.counts.device)
    osrc, opos = ints[:n_rows], ints[n_rows:]
    if n_rows:
        _launch_plan(plan.counts, plan.rank, plan.align, osrc, opos)
    return {"origin_src": osrc, "origin_pos": opos}


__all__ = ["triton_plan", "plan_numel", "plan_storage", "plan_row_origins", "check_and_count", "CheckedIds", "fits",
           "tokens_per_block", "slot_blocks", "plan_kernel", "plan_launch", "PlanLaunch", "slot_check_hist_kernel",
           "slot_scan_kernel", "check_hist_block", "scan_keys", "scan_tile", "ScanTile", "counts_tile", "slot_tables",
           "place_slots", "origin_blocks", "store_tables", "table_or_origin_job", "PlanJobs", "MAX_TABLE"]
