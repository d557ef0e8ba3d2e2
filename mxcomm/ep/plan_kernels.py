"""The routing plan of :func:`mxcomm.ep.plan.build_plan` (plus the nvshmem backend's row origins) in five
Triton kernels instead of ~60 small torch ops: the same int32 tensors, bit for bit (tested against
``build_plan`` and ``row_origins``). No host sync, so it can be
captured in a CUDA graph like the rest of the no-sync mode.

0. :func:`check_count_kernel`: the device-side id check (bad ids and repeats dropped; the nvshmem backend
   runs it in both size modes, and exact-size mode raises on what it found before sending) fused with this
   rank's per-expert counts (one kernel instead of ~20 torch ops).
1. :func:`plan_tables_kernel` (one program): every per-expert and per-source table from the counts
   matrix ``[W, E]``, held as a ``[W_src, W_dst, El]`` tile (cumulative sums along each axis).
2. The slots ``t*k + j``, in blocks of ``_SLOT_BLOCK``, through a table ``hist [blocks, E + 1]`` (key =
   expert id, ``E`` for a dropped slot); each slot is read twice, plus a ``[BLOCK, BLOCK]`` comparison
   per block:
   a. :func:`slot_hist_kernel` (one program per block): each key's count in the block;
   b. :func:`slot_scan_kernel` (one program per ``_SCAN_KEYS`` keys): per key, the counts become the
      count in the lower blocks;
   c. :func:`slot_place_kernel` (one program per block): each slot's occurrence index among the slots
      of its key in ``(t, j)`` order (lower blocks + its rank in the block), hence its send position,
      destination rank/row, and ``send_order``.
3. :func:`row_origins_kernel`: for each expert-major receive row, its origin rank and position in that
   origin's send order (-1 for padding rows and rows past the last group).

Sizes: the tables tile holds ``W_POW2^2 * El_POW2`` values; :func:`fits` says whether a config fits
(``MAX_TABLE``); callers use the torch plan otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import RoutingPlan

MAX_TABLE = 16384  # W_POW2 * W_POW2 * El_POW2 held by the one-program tables kernel
# slot kernels (H200, T=8192, k=8, E=256: 512 blocks; 64-256 within 10%): slots per block, a [128, 128]
# comparison tile in slot_place_kernel; slot_scan_kernel's tile, blocks x keys (2K values: no spills)
_SLOT_BLOCK = 128
_SCAN_ROWS, _SCAN_KEYS = 256, 8



def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def fits(world: int, num_experts: int) -> bool:
    """True when the tables of ``world`` ranks x ``num_experts`` experts fit the one-program kernel."""
    return _pow2(world) ** 2 * _pow2(num_experts // world) <= MAX_TABLE


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
def _block_slots(idx_ptr, n_slots, E, BLOCK: tl.constexpr):
    """The slots of program ``b``'s block ``[b*BLOCK, (b+1)*BLOCK)``: ``(sl, inb, key)``, each ``[BLOCK]``;
    key: the expert id, ``E`` for a dropped slot (id < 0)."""
    sl = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = sl < n_slots
    key = tl.load(idx_ptr + sl, mask=inb, other=-1)
    return sl, inb, tl.where(key < 0, E, key)


@triton.jit
def slot_hist_kernel(idx_ptr, hist_ptr, n_slots, E, BLOCK: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Per block of ``BLOCK`` slots (one program each, grid ``cdiv(T*k, BLOCK)``): how many of its slots
    go to each key (expert id, ``E`` = dropped) into its row of ``hist`` int32 ``[num_blocks, E + 1]``.
    idx_ptr: int32 ``[T*k]``. The row is zeroed (``ZERO_BLOCK`` entries at a time), then each slot adds 1
    to its key's entry (atomics: only the counts matter here, not the order)."""
    row = hist_ptr + tl.program_id(0) * (E + 1)
    offs = tl.arange(0, ZERO_BLOCK)
    zero = tl.zeros((ZERO_BLOCK,), tl.int32)
    k0 = 0
    while k0 < E + 1:  # (a while: the interpreter rejects range() over a runtime bound)
        tl.store(row + k0 + offs, zero, mask=k0 + offs < E + 1)
        k0 += ZERO_BLOCK
    tl.debug_barrier()  # the zeros before the counts (other threads of the program add to them)
    sl, inb, key = _block_slots(idx_ptr, n_slots, E, BLOCK)
    tl.atomic_add(row + key, tl.full((BLOCK,), 1, tl.int32), mask=inb)


@triton.jit
def slot_scan_kernel(hist_ptr, n_blocks, n_keys, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """In place over ``hist`` int32 ``[n_blocks, n_keys]``: each entry becomes the sum of its column over
    the lower rows (exclusive prefix over blocks, per key). One program per ``BLOCK_K`` keys, grid
    ``cdiv(n_keys, BLOCK_K)``; a loop over the blocks, ``BLOCK_B`` rows at a time."""
    kk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
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


@triton.jit
def slot_place_kernel(idx_ptr, pre_ptr, tab_ptr, recv_ptr, dest_rank_ptr, dest_row_ptr, send_pos_ptr, order_ptr, n_slots, E, El, W, BLOCK: tl.constexpr):
    """Per block of ``BLOCK`` slots (grid ``cdiv(T*k, BLOCK)``): each slot's occurrence index among the
    slots of its key in ``(t, j)`` order = its key's count in the lower blocks (``pre`` int32
    ``[num_blocks, E + 1]``, :func:`slot_scan_kernel`) + its rank in the block; from it and the tables:
    send position, destination rank and row (int32 ``[T*k]`` each, -1 for a dropped slot) and its entry of ``send_order`` (dropped slots after the ``num_send`` sent ones)."""
    sl, inb, key = _block_slots(idx_ptr, n_slots, E, BLOCK)
    i = tl.arange(0, BLOCK)
    same = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])               # [BLOCK, BLOCK]
    rank = tl.sum(same.to(tl.int32), axis=1)                                         # same key, earlier
    occ = tl.load(pre_ptr + tl.program_id(0) * (E + 1) + key, mask=inb, other=0) + rank
    dropped = key == E
    ok = inb & ~dropped
    dst_base = tl.load(tab_ptr + 0 * E + key, mask=ok, other=0)
    send_base = tl.load(tab_ptr + 1 * E + key, mask=ok, other=0)
    num_send = tl.load(recv_ptr + 2 * El + 2 * W + 2)
    tl.store(order_ptr + tl.where(dropped, num_send, send_base) + occ, sl, mask=inb)
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


@triton.jit
def check_count_kernel(idx_ptr, out_ptr, counts_ptr, err_ptr, T, E,
                       K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, CHECK: tl.constexpr):
    """Per ``BLOCK_T`` tokens: with ``CHECK``, ids outside ``[-1, E)`` and repeats of an id within a token
    (every occurrence after the first) become -1 in ``out`` and are counted into ``err``; then each
    kept id adds 1 to ``counts[id]`` (int32, zeroed by the caller). idx/out: int32 ``[T, K]``."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    j = tl.arange(0, K_POW2)[None, :]
    m = (t < T) & (j < K)
    idx = tl.load(idx_ptr + t * K + j, mask=m, other=-1)
    if CHECK:
        bad = (idx < -1) | (idx >= E)
        same = idx[:, :, None] == idx[:, None, :]                                    # [B, K, K]
        earlier = tl.arange(0, K_POW2)[None, None, :] < tl.arange(0, K_POW2)[None, :, None]
        rep = tl.sum((same & earlier & (idx[:, None, :] >= 0) & m[:, None, :]).to(tl.int32), axis=2) > 0
        bad = m & (bad | (rep & (idx >= 0)))
        idx = tl.where(bad, -1, idx)
        nbad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
        if nbad > 0:
            tl.atomic_add(err_ptr, nbad.to(tl.int64))
        tl.store(out_ptr + t * K + j, idx, mask=m)
    tl.atomic_add(counts_ptr + tl.maximum(idx, 0), tl.full(idx.shape, 1, tl.int32), mask=m & (idx >= 0))


def check_and_count(topk_idx: torch.Tensor, num_experts: int, err: torch.Tensor, *, check: bool):
    """``(idx int32 [T, k], counts int32 [E])``: the routing with bad slots dropped (``check``; each
    dropped slot adds 1 to the int64 ``err[0]``) and the rows this rank sends to each expert, in one
    kernel (the torch path: ``_sanitize`` + :func:`mxcomm.ep.plan.local_counts`)."""
    T, k = topk_idx.shape
    idx = topk_idx.to(torch.int32).contiguous()
    out = torch.empty_like(idx) if check else idx
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    if T:
        kp = _pow2(k)
        bt = max(1, min(128, 4096 // (kp * kp)))
        check_count_kernel[(triton.cdiv(T, bt),)](idx, out, counts, err, T, num_experts,
                                                  K=k, K_POW2=kp, BLOCK_T=bt, CHECK=check)
    return out, counts


def triton_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int, n_rows: int) -> dict:
    """The plan with the Triton kernels: ``{"plan": RoutingPlan, "origin_src", "origin_pos"}``.

    Args:
        counts: int32 ``[W, E]`` (all ranks' counts; read, not kept). topk_idx: int32/int64 ``[T, k]``
            (ids in ``[-1, E)``, no repeats within a token). rank, align: as :func:`build_plan`.
        n_rows: rows of the row-origin maps (``R_max`` of the backend).
    """
    W, E = counts.shape
    El = E // W
    T, k = topk_idx.shape
    dev = counts.device
    n = T * k
    nb = triton.cdiv(n, _SLOT_BLOCK)
    ints = torch.empty(2 * E + 2 * El + 2 * W + 3 + 2 * W * El + 4 * n + 2 * n_rows + W * E + nb * (E + 1),
                       dtype=torch.int32, device=dev)
    tab, rest = ints[:2 * E], ints[2 * E:]
    recv, rest = rest[:2 * El + 2 * W + 3], rest[2 * El + 2 * W + 3:]
    srp, ssp, rest = rest[:W * El], rest[W * El:2 * W * El], rest[2 * W * El:]
    slots, rest = rest[:4 * n].view(4, n), rest[4 * n:]
    osrc, opos, rest = rest[:n_rows], rest[n_rows:2 * n_rows], rest[2 * n_rows:]
    cnt, hist = rest[:W * E], rest[W * E:]
    cnt.copy_(counts.reshape(-1))
    plan_tables_kernel[(1,)](cnt, tab, recv, srp, ssp, rank, align, W, El, W_POW2=_pow2(W), EL_POW2=_pow2(El))
    idx = topk_idx.reshape(-1).to(torch.int32)
    if n:
        slot_hist_kernel[(nb,)](idx, hist, n, E, BLOCK=_SLOT_BLOCK, ZERO_BLOCK=min(1024, _pow2(E + 1)))
        slot_scan_kernel[(triton.cdiv(E + 1, _SCAN_KEYS),)](hist, nb, E + 1, BLOCK_B=min(_SCAN_ROWS, _pow2(nb)),
                                                           BLOCK_K=_SCAN_KEYS)
        slot_place_kernel[(nb,)](idx, hist, tab, recv, slots[0], slots[1], slots[2], slots[3], n, E, El, W,
                                 BLOCK=_SLOT_BLOCK)
    if n_rows:
        rb = 128
        row_origins_kernel[(triton.cdiv(n_rows, rb),)](recv, srp, ssp, cnt, osrc, opos, n_rows, rank, E, El, W,
                                                        BLOCK=rb, EL_POW2=_pow2(El), W_POW2=_pow2(W))
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
    return {"plan": plan, "origin_src": osrc, "origin_pos": opos}


__all__ = ["triton_plan", "check_and_count", "check_count_kernel", "fits", "plan_tables_kernel", "slot_hist_kernel",
           "slot_scan_kernel", "slot_place_kernel", "row_origins_kernel", "MAX_TABLE"]
