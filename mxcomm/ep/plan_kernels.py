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
2. :func:`plan_tables_kernel` (one program): every per-expert and per-source table from the exchanged counts
   matrix ``[W, E]``, held as a ``[W_src, W_dst, El]`` tile (cumulative sums along each axis).
3. :func:`slot_place_kernel` (one program per block): each slot's occurrence index among the slots of its key
   in ``(t, j)`` order (lower blocks + its rank in the block: a ``[BLOCK, BLOCK]`` comparison), hence its send
   position, destination rank/row, and ``send_order``.
4. :func:`row_origins_kernel`: for each expert-major receive row, its origin rank and position in that
   origin's send order (-1 for padding rows and rows past the last group).

:func:`triton_plan` runs 2-4 (and 1 without the check when it is not given step 1's table).

Sizes: the tables tile holds ``W_POW2^2 * El_POW2`` values; :func:`fits` says whether a config fits
(``MAX_TABLE``); callers use the torch plan otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..kernels.launch import cdiv, fast_kernel, next_pow2
from .plan import RoutingPlan

MAX_TABLE = 16384  # W_POW2 * W_POW2 * El_POW2 held by the one-program tables kernel
# slot kernels (H200, T=8192, k=8, E=256: 512 blocks; 64-256 within 10%): slots per block (rounded down to whole
# tokens), a [128, 128] comparison tile in slot_place_kernel; slot_scan_kernel's tile, blocks x keys (2K values:
# no spills)
_SLOT_BLOCK = 128
_SCAN_ROWS, _SCAN_KEYS = 256, 8


def tokens_per_block(k: int) -> int:
    """Tokens per block of the slot kernels for top-``k`` (``_SLOT_BLOCK // pow2(k)``, at least 1)."""
    return max(1, _SLOT_BLOCK // next_pow2(k))


def slot_blocks(T: int, k: int) -> int:
    """Blocks of the slot kernels for ``T`` tokens (rows of their ``hist`` table)."""
    return cdiv(T, tokens_per_block(k))


def fits(world: int, num_experts: int) -> bool:
    """True when the tables of ``world`` ranks x ``num_experts`` experts fit the one-program kernel."""
    return next_pow2(world) ** 2 * next_pow2(num_experts // world) <= MAX_TABLE


@triton.jit
def plan_tables_kernel(counts_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, me, align, W, El,
                       W_POW2: tl.constexpr, EL_POW2: tl.constexpr):
    """Per-expert and per-source tables of the plan from ``counts [W, E]`` (int32, E = W * El).

    Writes (int32): ``tab [2, E]``: row base of this rank's rows in the expert's group on its rank, and
    this rank's send position base (per global expert);
    ``recv [El + 2W + 4]``: offs [El], expert_counts [El] ... see :func:`triton_plan`;
    ``srp [W, El]`` src_row_start; ``ssp [W, El]`` src_send_pos.
    """
    s = tl.arange(0, W_POW2)[:, None, None]   # source rank
    d = tl.arange(0, W_POW2)[None, :, None]   # destination rank
    lo = tl.arange(0, EL_POW2)[None, None, :]  # local expert on d
    E = W * El
    ok = (s < W) & (d < W) & (lo < El)
    c = tl.load(counts_ptr + s * E + d * El + lo, mask=ok, other=0)                 # [Ws, Wd, El]
    n = tl.sum(c, axis=0)                                                            # [Wd, El] rows per expert
    p = (n + align - 1) // align * align                                             # padded group rows
    gstart = tl.cumsum(p, axis=1) - p                                                # group start on rank d
    src_excl = tl.cumsum(c, axis=0) - c                                              # rows of lower sources
    # send_excl[s, d, l]: rows s sends to experts before (d, l) in global expert order
    blk = tl.sum(c, axis=2)                                                          # [Ws, Wd]
    blk_excl = tl.cumsum(blk, axis=1) - blk
    send_excl = blk_excl[:, :, None] + tl.cumsum(c, axis=2) - c
    mine = s == me                                                                   # [Ws, 1, 1]
    my_src_excl = tl.sum(tl.where(mine, src_excl, 0), axis=0)                        # [Wd, El]
    my_send_excl = tl.sum(tl.where(mine, send_excl, 0), axis=0)
    d2 = tl.arange(0, W_POW2)[:, None]
    l2 = tl.arange(0, EL_POW2)[None, :]
    ok2 = (d2 < W) & (l2 < El)
    e2 = d2 * El + l2
    tl.store(tab_ptr + 0 * E + e2, gstart + my_src_excl, mask=ok2)
    tl.store(tab_ptr + 1 * E + e2, my_send_excl, mask=ok2)
    # receive side: my local experts (d == me)
    dme = d2 == me                                                                   # [Wd, 1]
    p_me = tl.sum(tl.where(dme, p, 0), axis=0)                                       # [El]
    n_me = tl.sum(tl.where(dme, n, 0), axis=0)
    offs = tl.cumsum(p_me, axis=0)
    l1 = tl.arange(0, EL_POW2)
    lm = l1 < El
    tl.store(recv_ptr + l1, offs, mask=lm)
    tl.store(recv_ptr + El + l1, n_me, mask=lm)
    dsel = d == me                                                                   # [1, Wd, 1]
    c_to_me = tl.sum(tl.where(dsel, c, 0), axis=1)                                   # [Ws, El]
    srcx_me = tl.sum(tl.where(dsel, src_excl, 0), axis=1)
    sendx_me = tl.sum(tl.where(dsel, send_excl, 0), axis=1)
    s2 = tl.arange(0, W_POW2)[:, None]
    oks = (s2 < W) & (l2 < El)
    tl.store(srp_ptr + s2 * El + l2, (offs - p_me)[None, :] + srcx_me, mask=oks)
    tl.store(ssp_ptr + s2 * El + l2, sendx_me, mask=oks)
    w1 = tl.arange(0, W_POW2)
    wm = w1 < W
    recv_splits = tl.sum(c_to_me, axis=1)                                            # [Ws]
    send_splits = tl.sum(tl.sum(tl.where(mine, c, 0), axis=0), axis=1)               # [Wd]
    tl.store(recv_ptr + 2 * El + w1, recv_splits, mask=wm)
    tl.store(recv_ptr + 2 * El + W + w1, send_splits, mask=wm)
    tail = recv_ptr + 2 * El + 2 * W
    tl.store(tail + 0, tl.sum(tl.where(lm, p_me, 0), axis=0))  # num_rows (= offs[-1])
    tl.store(tail + 1, tl.sum(recv_splits, axis=0))             # num_recv
    tl.store(tail + 2, tl.sum(send_splits, axis=0))             # num_send


@triton.jit
def _block_slots(idx_ptr, n_slots, E, S: tl.constexpr, S_POW2: tl.constexpr):
    """The slots of program ``b``'s block ``[b*S, (b+1)*S)``: ``(sl, inb, key)``, each ``[S_POW2]``;
    key: the (checked) expert id, ``E`` for a dropped slot (id < 0)."""
    i = tl.arange(0, S_POW2)
    sl = tl.program_id(0) * S + i
    inb = (i < S) & (sl < n_slots)
    key = tl.load(idx_ptr + sl, mask=inb, other=-1)
    return sl, inb, tl.where(key < 0, E, key)


@triton.jit
def slot_check_hist_kernel(idx_ptr, out_ptr, hist_ptr, err_ptr, T, E, K: tl.constexpr, K_POW2: tl.constexpr,
                           TOK: tl.constexpr, CHECK: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Per block of ``TOK`` tokens (one program each, grid ``cdiv(T, TOK)``): with ``CHECK``, ids outside
    ``[-1, E)`` and repeats of an id within a token (every occurrence after the first) become -1 and are counted
    into the int64 ``err[0]``; the checked ids go to ``out`` (int32 ``[T, K]``); then how many of the block's
    slots go to each key (expert id, ``E`` = dropped) into its row of ``hist`` int32 ``[blocks, E + 1]`` (zeroed
    here, ``ZERO_BLOCK`` entries at a time, then one atomic add per slot into this program's own row).

    idx_ptr: ``[T, K]`` ids of any integer dtype (checked before narrowing to int32)."""
    row = hist_ptr + tl.program_id(0) * (E + 1)
    offs = tl.arange(0, ZERO_BLOCK)
    zero = tl.zeros((ZERO_BLOCK,), tl.int32)
    k0 = 0
    while k0 < E + 1:  # (a while: the interpreter rejects range() over a runtime bound)
        tl.store(row + k0 + offs, zero, mask=k0 + offs < E + 1)
        k0 += ZERO_BLOCK
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
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
def slot_scan_kernel(hist_ptr, counts_ptr, n_blocks, n_keys, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """In place over ``hist`` int32 ``[n_blocks, n_keys]``: each entry becomes the sum of its column over
    the lower rows (exclusive prefix over blocks, per key); each column's total goes to ``counts[key]`` for
    ``key < n_keys - 1`` (int32 ``[E]``: the slots sent to each expert; the last key, dropped slots, is not
    stored). One program per ``BLOCK_K`` keys, grid ``cdiv(n_keys, BLOCK_K)``; a loop over the blocks,
    ``BLOCK_B`` rows at a time."""
    k1 = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kk = k1[None, :]
    rows = tl.arange(0, BLOCK_B)[:, None]
    carry = tl.zeros((BLOCK_K,), tl.int32)
    b = 0
    while b < n_blocks:
        m = (kk < n_keys) & (b + rows < n_blocks)
        ptr = hist_ptr + (b + rows) * n_keys + kk
        h = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=m)
        carry += tl.sum(h, axis=0)
        b += BLOCK_B
    tl.store(counts_ptr + k1, carry, mask=k1 < n_keys - 1)


@triton.jit
def slot_place_kernel(idx_ptr, pre_ptr, tab_ptr, recv_ptr, dest_rank_ptr, dest_row_ptr, send_pos_ptr, order_ptr,
                      n_slots, E, El, W, S: tl.constexpr, S_POW2: tl.constexpr):
    """Per block of ``S`` slots (``TOK * k``: the blocks of :func:`slot_check_hist_kernel`; grid its grid): each
    slot's occurrence index among the slots of its key in ``(t, j)`` order = its key's count in the lower blocks
    (``pre`` int32 ``[num_blocks, E + 1]``, :func:`slot_scan_kernel`) + its rank in the block; from it and the
    tables: send position, destination rank and row (int32 ``[T*k]`` each, -1 for a dropped slot) and its entry of
    ``send_order`` (dropped slots after the ``num_send`` sent ones). idx_ptr: the checked int32 ids ``[T*k]``."""
    sl, inb, key = _block_slots(idx_ptr, n_slots, E, S, S_POW2)
    i = tl.arange(0, S_POW2)
    same = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])               # [S_POW2, S_POW2]
    rank = tl.sum(same.to(tl.int32), axis=1)                                         # same key, earlier
    occ = tl.load(pre_ptr + tl.program_id(0) * (E + 1) + key, mask=inb, other=0) + rank
    dropped = key == E
    ok = inb & ~dropped
    dst_base = tl.load(tab_ptr + 0 * E + key, mask=ok, other=0)
    send_base = tl.load(tab_ptr + 1 * E + key, mask=ok, other=0)
    num_send = tl.load(recv_ptr + 2 * El + 2 * W + 2)
    order = tl.where(dropped, num_send, send_base) + occ
    # (always inside [0, n_slots) when pre and the tables come from these ids; the mask keeps a warm-up run on other
    # ids from writing outside the order table)
    tl.store(order_ptr + order, sl, mask=inb & (order >= 0) & (order < n_slots))
    tl.store(dest_rank_ptr + sl, tl.where(dropped, -1, key // El), mask=inb)
    tl.store(dest_row_ptr + sl, tl.where(dropped, -1, dst_base + occ), mask=inb)
    tl.store(send_pos_ptr + sl, tl.where(dropped, -1, send_base + occ), mask=inb)


@triton.jit
def row_origins_kernel(recv_ptr, srp_ptr, ssp_ptr, counts_ptr, src_ptr, pos_ptr, n_rows, me, E, El, W,
                       BLOCK: tl.constexpr, EL_POW2: tl.constexpr, W_POW2: tl.constexpr):
    """For each receive row ``r < n_rows``: origin rank and position in its send order (-1 = padding or
    past the last group). One program per ``BLOCK`` rows; groups and source blocks found by comparison."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rin = r < n_rows
    l1 = tl.arange(0, EL_POW2)
    offs = tl.load(recv_ptr + l1, mask=l1 < El, other=2147483647)                    # [El] group ends
    g = tl.sum((offs[None, :] <= r[:, None]).to(tl.int32), axis=1)                   # group of row r
    in_group = rin & (g < El)
    gc = tl.minimum(g, El - 1)
    w1 = tl.arange(0, W_POW2)
    wm = (w1 < W)[None, :]
    start = tl.load(srp_ptr + w1[None, :] * El + gc[:, None], mask=wm, other=0)      # [B, W] block starts
    cnt = tl.load(counts_ptr + w1[None, :] * E + me * El + gc[:, None], mask=wm, other=0)
    inside = wm & (r[:, None] >= start) & (r[:, None] < start + cnt)                  # at most one source
    real = in_group & (tl.sum(inside.to(tl.int32), axis=1) > 0)
    s = tl.sum(tl.where(inside, w1[None, :], 0), axis=1)
    sp = tl.load(ssp_ptr + w1[None, :] * El + gc[:, None], mask=wm, other=0)
    pos = tl.sum(tl.where(inside, sp + r[:, None] - start, 0), axis=1)
    tl.store(src_ptr + r, tl.where(real, s, -1), mask=rin)
    tl.store(pos_ptr + r, tl.where(real, pos, -1), mask=rin)


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
                    prefix_buf: Optional[torch.Tensor] = None, counts_out: Optional[torch.Tensor] = None) -> CheckedIds:
    """The routing with bad slots dropped (``check``; each dropped slot adds 1 to the int64 ``err[0]``), the rows
    this rank sends to each expert and the slot kernels' block table, in two kernels (the torch path:
    ``_sanitize`` + :func:`mxcomm.ep.plan.local_counts`).

    Args:
        topk_idx: ``[T, k]`` ids of any integer dtype. err: int64 ``[1]``.
        prefix_buf: int32 with at least ``slot_blocks(T, k) * (E + 1)`` values to hold ``slot_prefix`` (a fixed
            address a captured plan reads), else a fresh one. counts_out: int32 ``[E]`` to write the counts into.
    """
    T, k = topk_idx.shape
    E = num_experts
    dev = topk_idx.device
    idx = topk_idx.contiguous()
    ids = torch.empty(T, k, dtype=torch.int32, device=dev)
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
        fast_kernel(slot_scan_kernel)[(cdiv(E + 1, _SCAN_KEYS),)](
            pre, counts, nb, E + 1, BLOCK_B=min(_SCAN_ROWS, next_pow2(nb)), BLOCK_K=_SCAN_KEYS)
    else:
        counts.zero_()
    return CheckedIds(ids=ids, counts=counts, slot_prefix=pre)


def triton_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int, n_rows: int,
                prefix: Optional[torch.Tensor] = None, origins: bool = True) -> dict:
    """The plan with the Triton kernels: ``{"plan": RoutingPlan, "origin_src", "origin_pos"}`` (the row origins
    only with ``origins``; see :func:`plan_row_origins` for computing them later).

    Args:
        counts: int32 ``[W, E]`` (all ranks' counts; read, not kept). topk_idx: int32 ``[T, k]`` (ids in
            ``[-1, E)``, no repeats within a token; other integer dtypes are converted).
        rank, align: as :func:`build_plan`. n_rows: rows of the row-origin maps (``R_max`` of the backend).
        prefix: :attr:`CheckedIds.slot_prefix` of these ids (:func:`check_and_count`), else computed here.
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
    ints = torch.empty(2 * E + 2 * El + 2 * W + 3 + 2 * W * El + 4 * n + 2 * n_orig + W * E,
                       dtype=torch.int32, device=dev)
    tab, rest = ints[:2 * E], ints[2 * E:]
    recv, rest = rest[:2 * El + 2 * W + 3], rest[2 * El + 2 * W + 3:]
    srp, ssp, rest = rest[:W * El], rest[W * El:2 * W * El], rest[2 * W * El:]
    slots, rest = rest[:4 * n].view(4, n), rest[4 * n:]
    osrc, opos, cnt = rest[:n_orig], rest[n_orig:2 * n_orig], rest[2 * n_orig:]
    cnt.copy_(counts.reshape(-1))
    fast_kernel(plan_tables_kernel)[(1,)](cnt, tab, recv, srp, ssp, rank, align, W, El, W_POW2=next_pow2(W),
                                          EL_POW2=next_pow2(El))
    if n:
        tok = tokens_per_block(k)
        fast_kernel(slot_place_kernel)[(slot_blocks(T, k),)](idx, prefix, tab, recv, slots[0], slots[1], slots[2],
                                                             slots[3], n, E, El, W, S=tok * k,
                                                             S_POW2=next_pow2(tok * k))
    if n_orig:
        _row_origins(recv, srp, ssp, cnt, osrc, opos, rank, E, El, W)
    plan = RoutingPlan(
        rank=rank, world_size=W, num_experts=E, num_local_experts=El, align=align, topk=k, num_tokens=T,
        counts=cnt.view(W, E),
        dest_rank=slots[0].view(T, k), dest_row=slots[1].view(T, k), send_pos=slots[2].view(T, k),
        send_order=slots[3],
        send_splits=recv[2 * El + W:2 * El + 2 * W], num_send=recv[2 * El + 2 * W + 2:2 * El + 2 * W + 3],
        recv_splits=recv[2 * El:2 * El + W], expert_counts=recv[El:2 * El], offs=recv[:El],
        src_row_start=srp.view(W, El), src_send_pos=ssp.view(W, El),
        num_rows=recv[2 * El + 2 * W:2 * El + 2 * W + 1], num_recv=recv[2 * El + 2 * W + 1:2 * El + 2 * W + 2],
    )
    out = {"plan": plan}
    if origins:
        out.update(origin_src=osrc, origin_pos=opos)
    return out


def _row_origins(offs, srp, ssp, counts, osrc, opos, rank, E, El, W) -> None:
    rb = 128
    fast_kernel(row_origins_kernel)[(cdiv(osrc.numel(), rb),)](
        offs, srp, ssp, counts, osrc, opos, osrc.numel(), rank, E, El, W, BLOCK=rb, EL_POW2=next_pow2(El),
        W_POW2=next_pow2(W))


def plan_row_origins(plan: RoutingPlan, n_rows: int) -> dict:
    """``{"origin_src", "origin_pos"}`` int32 ``[n_rows]`` of ``plan`` (what :func:`triton_plan` returns with
    ``origins``), computed from the plan alone by :func:`row_origins_kernel`."""
    W, E, El = plan.world_size, plan.num_experts, plan.num_local_experts
    ints = torch.empty(2 * n_rows, dtype=torch.int32, device=plan.offs.device)
    osrc, opos = ints[:n_rows], ints[n_rows:]
    if n_rows:
        _row_origins(plan.offs.contiguous(), plan.src_row_start.contiguous(), plan.src_send_pos.contiguous(),
                     plan.counts.contiguous(), osrc, opos, plan.rank, E, El, W)
    return {"origin_src": osrc, "origin_pos": opos}


__all__ = ["triton_plan", "plan_row_origins", "check_and_count", "CheckedIds", "fits", "tokens_per_block", "slot_blocks",
           "plan_tables_kernel", "slot_check_hist_kernel", "slot_scan_kernel", "slot_place_kernel", "row_origins_kernel",
           "MAX_TABLE"]
