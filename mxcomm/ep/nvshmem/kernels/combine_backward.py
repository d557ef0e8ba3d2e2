"""Combine backward (the gradient of combine, towards the experts), one kernel per job and path:

* the sender (pull and push paths): ``pack_ready_kernel`` - the gradient rows and route weights packed into the send
  copy (:mod:`.pack`) and the "ready" handshake's publish, in one launch;
* the expert side - each BF16 gradient row read once per (token, rank), weighted and quantized per slot where it
  lands, the route-weight gradient formed there from the expert rows (:func:`_weighted_entry`) - as
  ``pull_weighted_kernel`` (pull and push paths, the rows read through peer pointers) and ``round_weighted_kernel``
  (the put path's rounds, rows that puts delivered);
* the origin: ``gather_route_grad_kernel`` (each slot's route-weight gradient from the row its expert rank wrote).

``comb_gw`` needs one copy: it is written after the call's "ready" handshake, which the origin joins only after it
gathered the previous call's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....kernels.mx_device import bf16_rne_int, block_amax, mx_quantize_tile_amax, store_block_bytes, to_fp32
from ....transport.flags import last_to_arrive
from .combine import _listed_slots, _round_entry
from .layout import _zero_unfilled_rows
from .pack import pack_row, pack_weights
from .signals import _arrive_all, raise_flag, wait_every_source


@triton.jit
def pack_ready_kernel(g_ptr, T, send_q_ptr, epoch_ptr, T_max, copy_elems, w_ptr, send_w_ptr, ticket_ptr,
                      flags_peers, row, W, me, H: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr,
                      K_POW2: tl.constexpr):
    """Combine backward, sender (pull and push paths): epoch += 1, the gradient rows packed and the "ready"
    handshake's publish in one launch. Every program packs tokens ``pid, pid + G, ...`` of the BF16 gradient ``g``
    ``[T, H]`` (:func:`pack_row`, as they are) and their fp32 route weights ``w`` ``[T, K]`` (:func:`pack_weights`)
    into send copy ``(epoch + 1) % 2`` (``send_q`` as bf16, ``send_w``; layouts as in :func:`pack_rows_kernel`);
    the last program (:func:`~mxcomm.transport.flags.last_to_arrive` at GPU scope on the int32 ``ticket``, 0 between
    launches: the rows are in this rank's own memory, and the release at system scope of each signal orders every
    program's rows before it, through the ticket) stores the new int64 epoch and raises
    ``flags[row, me]`` to it on every rank (:func:`raise_flag`). The wait for every rank's is
    :func:`wait_published_kernel`'s. Grid: any (at least 1)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    epoch = tl.load(epoch_ptr) + 1
    par = epoch % 2
    t = pid
    while t < T:
        pack_row(g_ptr, t, send_q_ptr, send_q_ptr, par * T_max + t, par * copy_elems, H, CHUNK, False, 0, False,
                 False)
        pack_weights(w_ptr, t, send_w_ptr, par * T_max + t, K, K_POW2)
        t += G
    if last_to_arrive(ticket_ptr, G):
        tl.store(epoch_ptr, epoch)
        p = 0
        while p < W:
            raise_flag(p, flags_peers, row, W, me, epoch)
            p += 1


@triton.jit
def _weighted_lanes(CHUNK: tl.constexpr, K_POW2: tl.constexpr):
    """``(offs, bcols, gk)`` of :func:`_weighted_entry`: ``arange(CHUNK)``, ``arange(CHUNK / 32)`` and the route-grad
    lanes ``arange(max(8, K_POW2))`` (at least the 8 values a thread holds of a chunk), made once per program."""
    GW: tl.constexpr = 8 if K_POW2 < 8 else K_POW2
    return tl.arange(0, CHUNK), tl.arange(0, CHUNK // 32), tl.arange(0, GW)


@triton.jit
def _weighted_entry(e, s, t, g_row, g_peers, w_peers, par, copy_elems, w_copy, dst_ptr, dst_s_ptr, out_ptr, gw_peers,
                    offs, bcols, gk, H: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                    MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, ROUTE_GRAD: tl.constexpr):
    """Combine backward's work for one table entry ``e`` (int32 ``[K]``: rows here per slot, -1 elsewhere) of source
    ``s``'s token ``t``: its BF16 gradient row (row ``g_row`` of copy ``par`` at ``g_peers[s]``) read once, and for
    each slot ``j`` here ``w[t, j] * g[t]`` (fp32; ``w`` from ``w_peers[s]``) quantized (MX: the block maxima taken
    as ``|w| * max|g|``, exactly as :func:`~mxcomm.ep.nvshmem.kernels.dispatch._send_rows`'s ``WEIGHTED``) or rounded
    to BF16 and stored at the slot's row of ``dst`` (MX scale rows into ``dst_s``); with ``ROUTE_GRAD`` also
    ``grad_w[t, j] = <g[t], out[row_j]>`` (fp32) into ``gw_peers[s]`` at ``[t, j]``. ``offs`` / ``bcols`` / ``gk``:
    the aranges of a chunk's values, its scale columns and the route-grad lanes (:func:`_weighted_lanes`)."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    GW: tl.constexpr = 8 if K_POW2 < 8 else K_POW2
    gbase = tl.load(g_peers + s).to(tl.pointer_type(tl.bfloat16)) + par * copy_elems + g_row * H
    wbase = tl.load(w_peers + s).to(tl.pointer_type(tl.float32)) + par * w_copy + t * K
    # per-thread partial dot products, column j for slot j: one block reduction per entry, not per slot
    gv = tl.zeros((CHUNK // GW, GW), tl.float32)
    for c0 in tl.static_range(0, H, CHUNK):
        m = (c0 + offs) < H
        cols = c0 // 32 + bcols
        cm = cols < C
        # once over the link; 16-byte aligned rows (symmetric buffer, H % 32 == 0): without the hint an
        # address read from the peer table carries no alignment, and every value is loaded alone
        x = tl.load(tl.max_contiguous(tl.multiple_of(gbase + c0 + offs, 16), 16), mask=m, other=0.0)
        xf = to_fp32(x, INT_ROUND)  # (the interpreter's plain bf16 cast flushes subnormals)
        if MX:
            ax = block_amax(tl.reshape(xf, (NB, 32)), 1, INT_ROUND)
        for j in tl.static_range(K):
            r = tl.load(e + j).to(tl.int64)
            if r >= 0:
                if ROUTE_GRAD:  # issued first: no store of this slot comes before it
                    o = to_fp32(tl.load(out_ptr + r * H + c0 + offs, mask=m, other=0.0), INT_ROUND)
                wv = tl.load(wbase + j)
                xw = wv * xf
                dst = dst_ptr + tl.multiple_of(r * H + c0, 16) + offs
                if MX:
                    q2, sc = mx_quantize_tile_amax(tl.reshape(xw, (NB, 32)), tl.abs(wv) * ax, MODE, INT_ROUND, 1)
                    tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), tl.reshape(q2, (CHUNK,)), mask=m)
                    store_block_bytes(dst_s_ptr + r * C + cols, sc, cm, INT_ROUND)
                elif INT_ROUND:  # the interpreter's bf16 cast truncates; round to nearest even
                    tl.store(dst, bf16_rne_int(xw), mask=m)
                else:
                    tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), xw.to(tl.bfloat16), mask=m)
                if ROUTE_GRAD:
                    part = tl.sum(tl.reshape(o * xf, (CHUNK // GW, GW)), axis=1)
                    gv = tl.where(gk[None, :] == j, gv + part[:, None], gv)
    if ROUTE_GRAD:
        gw = tl.sum(gv, axis=0)
        rows = tl.load(e + gk, mask=gk < K, other=-1)
        gwb = tl.load(gw_peers + s).to(tl.pointer_type(tl.float32)) + t * K
        tl.store(gwb + gk, gw, mask=(gk < K) & (rows >= 0))


@triton.jit
def pull_weighted_kernel(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, g_peers, w_peers,
                         table_ptr, epoch_ptr, T_max, W, copy_elems, w_copy, out_ptr, gw_peers, flags_peers, me,
                         H: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                         MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, ZCHUNK: tl.constexpr,
                         ROUTE_GRAD: tl.constexpr, ticket_ptr=None, flags_row_ptr=None, expect_row_ptr=None,
                         err_ptr=None, timeout_ns=0, WAIT: tl.constexpr = False):
    """Combine backward, expert side (pull and push paths): every (source ``s``, token ``t``) of the dispatch's table
    has its BF16 gradient row ``g[t]`` read ONCE from the source's send copy through the peer pointer and weighted and
    quantized per slot where it lands (:func:`_weighted_entry`: the route weighting fused with the gradient
    quantization), with ``ROUTE_GRAD`` the route-weight gradient formed there too, where the expert rows are, and
    stored into source ``s``'s ``gw``; then (``ROUTE_GRAD``) every program adds 1 to ``flags[4, me]`` on every rank.
    Finally the padding rows of every group are zeroed (rows past ``n_rows`` are left as they are).

    Args:
        dst_ptr: the fresh output ``[R_out, H]``: uint8 (MX payload) or bf16.
        dst_s_ptr: uint8 ``[>= n_rows, H/32]`` row-major scale rows (MX only; a fresh tensor).
        offs_ptr / counts_ptr / n_rows_ptr / n_groups: the plan's group end offsets, real rows, ``offs[-1]``, ``El``.
        g_peers / w_peers: int64 ``[W]`` addresses of each source's BF16 rows ``[T_max, H]`` (copy 1 starts
            ``copy_elems`` values after copy 0) and fp32 weights ``[T_max, K]`` (copy 1 ``w_copy`` values after copy
            0; both 0: one copy).
        table_ptr: int32 ``[W * T_max, K]``, the dispatch's table (rows here per slot, -1 elsewhere).
        epoch_ptr: int64 epoch of this call; the rows are in copy ``epoch % 2`` (``copy_elems = 0``: one copy).
        out_ptr: bf16 ``[R, H]`` the expert rows the forward combine was given (``ROUTE_GRAD``).
        gw_peers: int64 ``[W]`` addresses of each source's fp32 ``gw`` ``[T_max, K]`` (``ROUTE_GRAD``).
        CHUNK: row chunk (a power of two, a multiple of 32); ZCHUNK: int64 words per store of the zeroing loop.
        WAIT (with ``ROUTE_GRAD``): the last program to finish (the int32 ``ticket``, 0 between launches) then waits
            for every rank's route-weight gradients to this rank (:func:`wait_every_source` on this rank's
            ``flags[4]`` / ``expect[4]`` rows, ``per_call`` = the grid; ``err_ptr`` the int64 error word).
    Grid: any fixed number of programs (identical on every rank with ``ROUTE_GRAD``); persistent over entries.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs, bcols, gk = _weighted_lanes(CHUNK, K_POW2)
    par = tl.load(epoch_ptr) % 2
    n_entries = W * T_max
    n = pid
    while n < n_entries:
        e = table_ptr + n.to(tl.int64) * K
        if _listed_slots(e, K) != 0:
            s = n // T_max
            t = (n % T_max).to(tl.int64)
            _weighted_entry(e, s, t, t, g_peers, w_peers, par, copy_elems, w_copy, dst_ptr, dst_s_ptr, out_ptr,
                            gw_peers, offs, bcols, gk, H, CHUNK, K, K_POW2, MX, MODE, INT_ROUND, ROUTE_GRAD)
        n += G
    if ROUTE_GRAD:
        _arrive_all(flags_peers, 4, me, W)
    WORDS: tl.constexpr = H // 8 if MX else H // 4
    _zero_unfilled_rows(dst_ptr.to(tl.pointer_type(tl.int64), bitcast=True), offs_ptr, counts_ptr, n_rows_ptr, R_out,
                        n_groups, pid, G, WORDS, ZCHUNK)
    if WAIT:
        if last_to_arrive(ticket_ptr, G):
            wait_every_source(flags_row_ptr, expect_row_ptr, G, W, err_ptr, timeout_ns)


@triton.jit
def round_weighted_kernel(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, g_peers, w_peers,
                          table_ptr, T_max, W, out_ptr, gw_peers, t_lo, t_n, H: tl.constexpr, CHUNK: tl.constexpr,
                          K: tl.constexpr, K_POW2: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr,
                          INT_ROUND: tl.constexpr, ZCHUNK: tl.constexpr, ROUTE_GRAD: tl.constexpr):
    """Combine backward, expert side, one round of the put path: the entries of the tokens ``[t_lo, t_lo + t_n)``
    of every source (token-major), whose gradient row ``t`` NVSHMEM puts delivered as row ``t - t_lo`` at
    ``g_peers[s]`` (one copy); weights, table and ``gw`` by the token itself. Per entry as
    :func:`pull_weighted_kernel` (:func:`_weighted_entry`); no flag is raised (the route-weight gradients travel by
    puts that signal); the padding rows of every group are zeroed by every round's launch.

    Args: as :func:`pull_weighted_kernel` (``w_peers``: the received weights ``[T_max, K]`` of each source, one copy).
    Grid: any number of programs; persistent over the round's entries."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs, bcols, gk = _weighted_lanes(CHUNK, K_POW2)
    n_entries = W * t_n
    n = pid
    while n < n_entries:
        i = _round_entry(n, T_max, t_lo, W)
        e = table_ptr + i.to(tl.int64) * K
        if _listed_slots(e, K) != 0:
            s = i // T_max
            t = (i % T_max).to(tl.int64)
            _weighted_entry(e, s, t, t - t_lo, g_peers, w_peers, 0, 0, 0, dst_ptr, dst_s_ptr, out_ptr, gw_peers, offs,
                            bcols, gk, H, CHUNK, K, K_POW2, MX, MODE, INT_ROUND, ROUTE_GRAD)
        n += G
    WORDS: tl.constexpr = H // 8 if MX else H // 4
    _zero_unfilled_rows(dst_ptr.to(tl.pointer_type(tl.int64), bitcast=True), offs_ptr, counts_ptr, n_rows_ptr, R_out,
                        n_groups, pid, G, WORDS, ZCHUNK)


@triton.jit
def gather_route_grad_kernel(gw_ptr, dest_rank_ptr, out_ptr, n, rank_stride, BLOCK: tl.constexpr):
    """The route-weight gradient at the origin: ``out[t, j] = gw[dest_rank[t, j], t, j]`` (the value the slot's
    expert rank formed and wrote into row ``dest_rank`` of this rank's ``comb_gw``), 0 for a dropped slot.

    Args: gw_ptr fp32 ``[W, T_max, k]`` (``rank_stride = T_max * k``); dest_rank_ptr int32 ``[T, k]``; out_ptr fp32
    ``[T, k]``; n = ``T * k``. Grid: any (persistent over blocks of ``BLOCK`` slots: the grid follows the SM
    budget)."""
    b = tl.program_id(0)
    while b * BLOCK < n:
        i = b * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        d = tl.load(dest_rank_ptr + i, mask=m, other=-1)
        v = tl.load(gw_ptr + tl.maximum(d, 0).to(tl.int64) * rank_stride + i, mask=m & (d >= 0), other=0.0)
        tl.store(out_ptr + i, v, mask=m)
        b += tl.num_programs(0)
