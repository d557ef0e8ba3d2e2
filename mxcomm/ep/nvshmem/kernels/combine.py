"""The combine direction (towards the origins; dispatch backward moves the same way), one kernel per job and path over
shared device helpers:

* the expert side, one row per (token, rank) - the weighted partial sum of the token's rows on this rank, rounded
  once (:func:`_entry_partial`): ``combine_partials_kernel`` (pull and push paths: into the origins' ``comb_q``
  through peer pointers, then signalled) and ``stage_partials_kernel`` (the put path's rounds: into this rank's
  staging, whose puts signal);
* at the origin, the sum of a token's partials: ``combine_reduce_kernel`` (from ``comb_q``) and
  ``local_reduce_kernel`` (one rank: the one partial formed from the expert rows in place and rounded in registers);
* the scalar slot helpers (``_leading_slots``, ``_listed_slots``, ``_bit_count``, ``_nth_slot``, ``_round_entry``)
  and the row helpers (``_row_values``, ``_store_partial``, ``_bf16_saturated``, ``_origin_sum_store``), which
  :mod:`.combine_backward` uses too.

Why two copies of ``comb_q`` (by combine epoch parity): the combine direction has no handshake before it writes into
its peers. Combine epoch ``e+1`` of rank A may start while rank B still reduces epoch ``e``; it writes the other
copy. It cannot lap B: A's epoch ``e+1`` began after A received B's epoch-``e`` partials, which B sent after it
finished reducing epoch ``e-1`` (stream order), the copy ``e+1`` uses. ``comb_w`` needs one copy: A publishes its
weights for ``e+1`` only after it received every rank's partials of ``e``, which each rank sent after reading A's
weights of ``e``. (``comb_gw``: see :mod:`.combine_backward`; the send copies: :mod:`.pull`.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....kernels.mx_device import (BF16_MAX, FP32_MAX, bf16_rne_int, load_block_bytes, mx_decode_tile, mx_qdq_tile,
                                   mx_quantize_tile, mx_saturate, store_block_bytes, to_fp32)
from ....transport.flags import last_to_arrive
from .signals import _arrive_all, wait_every_source


@triton.jit
def _leading_slots(ranks_ptr, K: tl.constexpr):
    """Bit ``j`` set where slot ``j`` of a token (``K`` int32 destination ranks at ``ranks_ptr``, -1 = dropped) leads
    its rank: valid, and no earlier slot goes to the same rank. Scalar loads and compares only (no block reduction:
    the loads of the slots' rows that follow stay free to overlap)."""
    bits = tl.load(ranks_ptr) * 0
    for j in tl.static_range(K):
        d = tl.load(ranks_ptr + j)
        ok = d >= 0
        for i in tl.static_range(j):
            ok = ok & (tl.load(ranks_ptr + i) != d)
        bits = bits | (ok.to(tl.int32) << j)
    return bits


@triton.jit
def _listed_slots(e, K: tl.constexpr):
    """Bit ``j`` set where slot ``j`` of a table entry (``K`` int32 rows, -1 for a slot elsewhere) lists a row here.
    Scalar work."""
    bits = tl.load(e) * 0
    for j in tl.static_range(K):
        bits = bits | ((tl.load(e + j) >= 0).to(tl.int32) << j)
    return bits


@triton.jit
def _bit_count(bits, K: tl.constexpr):
    """The number of set bits among the low ``K`` of ``bits``. Scalar work."""
    n = bits * 0
    for j in tl.static_range(K):
        n += (bits >> j) & 1
    return n


@triton.jit
def _nth_slot(bits, n, K: tl.constexpr):
    """The index of the ``n``-th set bit (from 0, lowest first) of the ``K``-bit mask ``bits``; -1 when fewer are
    set. Scalar work."""
    sel = bits * 0 - 1
    cnt = bits * 0
    for j in tl.static_range(K):
        b = (bits >> j) & 1
        sel = tl.where((b != 0) & (cnt == n), j, sel)
        cnt += b
    return sel


@triton.jit
def _round_entry(n, T_max, t_lo, W):
    """The dispatch table's entry (``[W * T_max]``, source-major) of the ``n``-th entry of a put-path round: the
    entries of the round's tokens ``t_lo, t_lo + 1, ...`` of every source, token-major (token ``t_lo + n // W``,
    source ``n % W``)."""
    return (n % W) * T_max + t_lo + n // W


@triton.jit
def _row_values(src_ptr, src_s_ptr, r, ok, c0, offs, cols, m, cm, H: tl.constexpr, NB: tl.constexpr,
                PASS: tl.constexpr, INT_ROUND: tl.constexpr, ALIGNED: tl.constexpr = False):
    """fp32 ``[CHUNK]`` values of row ``r`` (columns ``c0 + offs``) of an expert-side ``[R, H]`` tensor: bf16, or
    (``PASS``) E4M3 payload with ROW scales at ``src_s_ptr`` decoded and saturated to bf16's range; 0 where ``ok``
    is false (a masked load). ``ALIGNED``: ``src_ptr`` is 16-byte aligned though the compiler cannot see it (read
    from memory)."""
    r64 = tl.maximum(r, 0).to(tl.int64)
    p = src_ptr + r64 * H + c0 + offs
    if ALIGNED:
        p = tl.max_contiguous(tl.multiple_of(p, 16), 16)
    if PASS:
        q = tl.load(p, mask=m & ok, other=0)
        sb = tl.load(src_s_ptr + r64 * (H // 32) + cols, mask=cm & ok, other=127)
        v = tl.reshape(mx_decode_tile(tl.reshape(q, (NB, 32)), sb, INT_ROUND, BF16_MAX), (NB * 32,))
    else:
        v = to_fp32(tl.load(p, mask=m & ok, other=0.0), INT_ROUND)
    return v


@triton.jit
def _store_partial(acc, qbase, sbase, slot, c0, offs, cols, m, cm, H: tl.constexpr, NB: tl.constexpr,
                   MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """Store the fp32 chunk ``acc`` (``[CHUNK]``) of a partial at combine slot ``slot`` (int64: copy start + send
    position): MX quantized (payload at byte ``2H * copy start + H * position``... given here as ``slot`` rows of
    ``H`` bytes from ``qbase``, which the caller offsets by the copy) with its row scales at ``sbase + slot * H/32``;
    else BF16 at element ``slot * H`` of ``qbase`` (bf16)."""
    if MX:
        q2, sc = mx_quantize_tile(tl.reshape(acc, (NB, 32)), MODE, INT_ROUND, 1)
        dst = qbase + tl.multiple_of(slot * H + c0, 16) + offs
        tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), tl.reshape(q2, (NB * 32,)), mask=m)
        store_block_bytes(sbase + slot * (H // 32) + cols, sc, cm, INT_ROUND)
    else:
        dst = qbase + tl.multiple_of(slot * H + c0, 16) + offs
        acc = _bf16_saturated(acc)
        if INT_ROUND:
            tl.store(dst, bf16_rne_int(acc), mask=m)
        else:
            tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), acc.to(tl.bfloat16), mask=m)


@triton.jit
def _bf16_saturated(v):
    """A finite fp32 tile clamped to +-BF16_MAX (its BF16 rounding then saturates instead of becoming Inf); Inf and
    NaN as they are (``mxcomm.ep.reference.backward.bf16_saturated``)."""
    return tl.where(tl.abs(v) <= FP32_MAX, mx_saturate(v, BF16_MAX), v)


@triton.jit
def _entry_partial(out_ptr, out_s_ptr, e, listed, n_listed, w_ptr, i, qbase, sbase, slot0, pos, offs, bcols,
                   H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, PASS: tl.constexpr,
                   WEIGHTED: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, ROWS: tl.constexpr):
    """The partial of one table entry ``e`` (int32 ``[K]`` rows here per slot; ``listed``: its listed slots' bits,
    ``n_listed`` of them): ``P = sum_j w[i, j] * out[row_j]`` in fp32, ``j`` ascending (each product rounded, then
    added: the kernel launches with ``enable_fp_fusion=False``; ``WEIGHTED`` False: every weight 1), per row chunk,
    rounded once for transport and stored at combine slot ``slot0 + pos`` of ``qbase`` / ``sbase``
    (:func:`_store_partial`).
    ``ROWS`` listed slots are loaded together per step of a chunk's sum, in ascending order: a slot elsewhere adds
    nothing, so only listed rows are loaded (the registers of the loads in flight hold rows that exist, and more
    programs fit on an SM than with one load per slot of ``K``). ``offs`` / ``bcols``: ``arange(CHUNK)`` and
    ``arange(CHUNK / 32)``, made once per program."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    if WEIGHTED:  # the source's weights of this token, fp32 [K]
        wbase = w_ptr + i.to(tl.int64) * K
    for c0 in tl.static_range(0, H, CHUNK):
        m = (c0 + offs) < H
        cols = c0 // 32 + bcols
        cm = cols < C
        acc = tl.zeros((CHUNK,), tl.float32)
        n0 = n_listed * 0
        while n0 < n_listed:  # ROWS listed slots a step, ascending (scalar table loads: L1 hits)
            for u in tl.static_range(ROWS):
                j = _nth_slot(listed, n0 + u, K)
                ok = j >= 0
                r = tl.load(e + tl.maximum(j, 0), mask=ok, other=-1)
                v = _row_values(out_ptr, out_s_ptr, r, ok, c0, offs, cols, m, cm, H, NB, PASS, INT_ROUND)
                if WEIGHTED:
                    wv = tl.load(wbase + j, mask=ok, other=0.0)
                    v = wv * v
                acc = acc + v  # past the last listed slot: +0 (acc is never -0: it starts at +0)
            n0 += ROWS
        _store_partial(acc, qbase, sbase, slot0 + pos, c0, offs, cols, m, cm, H, NB, MX, MODE, INT_ROUND)


@triton.jit
def _partial_bases(q_peers, s_peers, s, slot0, H: tl.constexpr, MX: tl.constexpr):
    """``(qbase, sbase)``: where the partials for rank ``s`` go - its entry of ``q_peers`` (uint8: MX rows are H
    bytes apart from the start of copy ``slot0``, 2H bytes a slot; else bf16) and of ``s_peers`` (uint8)."""
    if MX:
        qbase = tl.load(q_peers + s).to(tl.pointer_type(tl.uint8)) + slot0 * H
    else:
        qbase = tl.load(q_peers + s).to(tl.pointer_type(tl.bfloat16))
    sbase = tl.load(s_peers + s).to(tl.pointer_type(tl.uint8))
    return qbase, sbase


@triton.jit
def combine_partials_kernel(out_ptr, out_s_ptr, table_ptr, origin_pos_ptr, w_ptr, q_peers, s_peers, flags_peers,
                            me, W, T_max, epoch_ptr, nslot, err_ptr,
                            H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr,
                            MX: tl.constexpr, PASS: tl.constexpr, WEIGHTED: tl.constexpr, MODE: tl.constexpr,
                            INT_ROUND: tl.constexpr, ROWS: tl.constexpr = 2,
                            ticket_ptr=None, flags_row_ptr=None, expect_row_ptr=None, timeout_ns=0,
                            WAIT: tl.constexpr = False):
    """Combine / dispatch backward, expert side (pull and push paths): ONE row per (source, token). For every
    (source ``s``, token ``t``) this rank received (an entry of the dispatch's table), the partial sum of the token's
    rows here ``P = sum_j w[t, j] * out[row_j]`` in fp32, ``j`` ascending, rounded once for transport (MX: quantized,
    payload + row scales; else BF16; :func:`_entry_partial`) and stored through the peer pointer into the origin's
    combine buffer at the token's combine slot for this rank (:func:`mxcomm.ep.plan.combine_slots`: ``t * W + me`` when
    ``W < K``, else the send position of the token's leading slot, its first slot on this rank); then every program
    adds 1 to ``flags[2, me]`` on every rank. A call that starts with the error word set (a wait of this call, such as
    the weights' exchange, or of an earlier one timed out) sends nothing and raises no flag: its weights may not have
    arrived, and the origins' bounded waits then fail instead of summing partials formed with other weights.

    Args:
        out_ptr: the expert rows ``[R, H]``: bf16, or (``PASS``) uint8 E4M3 payload with ``out_s_ptr`` uint8 ``[R,
            H/32]`` ROW scales (decoded, saturated to bf16's range, before the sum).
        table_ptr: int32 ``[W * T_max, K]``: entry ``s * T_max + t`` = the rows here of source ``s``'s token ``t``
            per slot, -1 for slots elsewhere (every row -1: not received).
        origin_pos_ptr: int32 ``[R]`` send position of each row's slot at its origin (read when ``W >= K``).
        w_ptr: fp32 ``[W * T_max, K]`` route weights by table entry (``WEIGHTED``; else every weight is 1: dispatch
            backward): the weights that came with the dispatch (the handle's), or ``comb_w`` after their exchange.
        err_ptr: int64 error word of this rank's waits (read once, at the start).
        q_peers / s_peers / flags_peers: int64 ``[W]`` base pointers of ``comb_q`` / ``comb_s`` / ``flags`` per rank.
        epoch_ptr: int64 combine epoch (its parity picks the copy), nslot: ``T_max * min(W, K)`` slots per copy.
        P: ``min(K, W)``, the most partials a token can have (``P < K``: the slots are by (token, rank)).
        ROWS: rows loaded together per step of a chunk's sum (:func:`_entry_partial`).
        WAIT: the last program to finish (the int32 ``ticket``, 0 between launches) then waits for every rank's
            partials to this rank (:func:`wait_every_source` on this rank's ``flags[2]`` / ``expect[2]`` rows,
            ``per_call`` = the grid): the origin's reduce follows with no wait kernel between.

    Destination layout (what the origin's :func:`combine_reduce_kernel` reads): slot ``pos`` of the copy starting at
    slot ``slot0``: MX payload at byte ``slot0 * 2H + pos * H``, scales at byte ``(slot0 + pos) * H/32``; BF16 at
    element ``(slot0 + pos) * H``.
    Grid: any fixed number of programs (identical on every rank: receivers count arrivals); persistent over entries.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, CHUNK // 32)
    slot0 = (tl.load(epoch_ptr) % 2) * nslot
    failed = tl.load(err_ptr, volatile=True) != 0
    n_entries = tl.where(failed, 0, W * T_max)
    n = pid
    while n < n_entries:
        e = table_ptr + n.to(tl.int64) * K
        listed = _listed_slots(e, K)
        if listed != 0:
            lead = tl.load(e + _nth_slot(listed, 0, K))
            n_listed = _bit_count(listed, K)
            s = n // T_max
            if P < K:  # by (token, rank): token t's partial from this rank
                pos = (n % T_max).to(tl.int64) * W + me
            else:  # the send position of the token's leading slot here, at its origin
                pos = tl.load(origin_pos_ptr + lead).to(tl.int64)
            qbase, sbase = _partial_bases(q_peers, s_peers, s, slot0, H, MX)
            _entry_partial(out_ptr, out_s_ptr, e, listed, n_listed, w_ptr, n, qbase, sbase, slot0, pos, offs, bcols, H,
                           K, CHUNK, MX, PASS, WEIGHTED, MODE, INT_ROUND, ROWS)
        n += G
    if not failed:
        _arrive_all(flags_peers, 2, me, W)
    if WAIT:
        if last_to_arrive(ticket_ptr, G):
            wait_every_source(flags_row_ptr, expect_row_ptr, G, W, err_ptr, timeout_ns)


@triton.jit
def stage_partials_kernel(out_ptr, out_s_ptr, table_ptr, w_ptr, q_peers, s_peers, W, T_max, err_ptr, t_lo, t_n,
                          H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                          PASS: tl.constexpr, WEIGHTED: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr,
                          ROWS: tl.constexpr = 2):
    """Combine / dispatch backward, expert side, one round of the put path: the partial of every entry of the tokens
    ``[t_lo, t_lo + t_n)`` of every source (:func:`_entry_partial`, as :func:`combine_partials_kernel` forms it), the
    partial of source ``s``'s token ``t`` at row ``(t - t_lo) * W + s`` of this rank's staging buffer (one put per
    entry then moves it to the origin's slot, :func:`mxcomm.ep.nvshmem.put_path.partial_rows`); no flag is raised
    (the puts signal). A call that starts with the error word set stages nothing.

    Args: as :func:`combine_partials_kernel`; ``q_peers`` / ``s_peers``: int64 ``[W]`` whose every entry is the
    address of the staging payload ``stage_q`` (uint8, MX rows H bytes apart; bf16) / scale rows ``stage_s``.
    Grid: any number of programs; persistent over the round's entries."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, CHUNK // 32)
    failed = tl.load(err_ptr, volatile=True) != 0
    n_entries = tl.where(failed, 0, W * t_n)
    n = pid
    while n < n_entries:
        i = _round_entry(n, T_max, t_lo, W)
        e = table_ptr + i.to(tl.int64) * K
        listed = _listed_slots(e, K)
        if listed != 0:
            n_listed = _bit_count(listed, K)
            s = i // T_max
            qbase, sbase = _partial_bases(q_peers, s_peers, s, 0, H, MX)
            _entry_partial(out_ptr, out_s_ptr, e, listed, n_listed, w_ptr, i, qbase, sbase, 0, n.to(tl.int64), offs,
                           bcols, H, K, CHUNK, MX, PASS, WEIGHTED, MODE, INT_ROUND, ROWS)
        n += G


@triton.jit
def _origin_sum_store(acc, fin, y_ptr, t, c0, offs, m, H: tl.constexpr, INT_ROUND: tl.constexpr,
                      ALIGNED: tl.constexpr = False):
    """Store chunk ``c0`` of ``y[t]`` (bf16 ``[T, H]``) from the origin's fp32 sum ``acc``: a sum of finite partials
    (``fin``) saturates at the BF16 range; an Inf or NaN partial passes through. ``ALIGNED``: ``y_ptr`` is 16-byte
    aligned though the compiler cannot see it (read from memory)."""
    acc = tl.where(fin, mx_saturate(acc, BF16_MAX), acc)
    p = y_ptr + t.to(tl.int64) * H + c0 + offs
    if ALIGNED:
        p = tl.max_contiguous(tl.multiple_of(p, 16), 16)
    if INT_ROUND:
        tl.store(p, bf16_rne_int(acc), mask=m)
    else:
        tl.store(p, acc.to(tl.bfloat16), mask=m)


@triton.jit
def combine_reduce_kernel(comb_q_ptr, comb_s_ptr, send_pos_ptr, dest_rank_ptr, y_ptr, T, epoch_ptr, nslot, W,
                          H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                          INT_ROUND: tl.constexpr):
    """Combine / dispatch backward at the origin (several ranks): ``y[t] = sum_i P_i`` in fp32, bf16 out, over the
    partials ``P_i`` the token's ranks returned (one row per (token, rank), see :func:`combine_partials_kernel`), in
    the order of the ranks' first appearance among the token's slots (a token without a valid slot gives 0). The
    partial of the rank of slot ``j`` when ``j`` leads it (no earlier slot of the token goes to that rank): the row of
    the token's combine slot for that rank in this rank's ``comb_q`` (:func:`mxcomm.ep.plan.combine_slots`: ``t * W +
    dest_rank[t, j]`` when ``W < K``, i.e. ``P < K``, else ``send_pos[t, j]``; MX: decoded, saturated to bf16's range).

    Args:
        comb_q_ptr / comb_s_ptr: this rank's ``comb_q`` (uint8; BF16 transport: viewed as bf16) / ``comb_s``; the copy
            is picked by the epoch's parity (``epoch_ptr``, ``nslot = T_max * min(W, K)`` slots a copy).
        send_pos_ptr / dest_rank_ptr: int32 ``[T, K]`` (the plan's; -1 = dropped); y_ptr: bf16 ``[T, H]``; W: ranks.
        P: the most partials a token can have, ``min(K, W)``. A static loop over them (not over the ``K`` slots)
            keeps the registers of the rows in flight to rows that exist.
        MX: the partials travel as MXFP8.
    Grid: ``(programs over tokens, programs over each row's CHUNK-value chunks)``; any sizes (persistent over tokens;
    chunk ``c`` of a row belongs to the program with ``c % grid[1] == program_id(1)``).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hs = tl.program_id(1)  # the row's chunks are dealt out over the grid's second axis (few tokens: more programs)
    HS = tl.num_programs(1)
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    slot0 = (tl.load(epoch_ptr) % 2) * nslot
    t = pid
    while t < T:
        lead = _leading_slots(dest_rank_ptr + t * K, K)  # scalar work once a token: no reduction in the loops below
        for c0 in tl.static_range(0, H, CHUNK):
            if (c0 // CHUNK) % HS == hs:  # this program's share of the row's chunks
                m = (c0 + offs) < H
                cols = c0 // 32 + bcols
                cm = cols < C
                acc = tl.zeros((CHUNK,), tl.float32)
                fin = offs >= 0  # every partial summed here so far is finite
                for n in tl.static_range(P):  # partial n: the n-th leading slot j (-1: fewer partials, adds +0)
                    j = _nth_slot(lead, n, K)
                    ok = j >= 0
                    if P < K:  # by (token, rank)
                        p64 = t.to(tl.int64) * W + tl.maximum(tl.load(dest_rank_ptr + t * K + tl.maximum(j, 0)), 0)
                    else:
                        p64 = tl.maximum(tl.load(send_pos_ptr + t * K + tl.maximum(j, 0)), 0).to(tl.int64)
                    if MX:  # 8 payload bytes a thread: the layout of the 8 bf16 values a thread stores (16
                        # bytes a thread would be converted to it through shared memory, with barriers)
                        qp = comb_q_ptr + slot0 * (2 * H) + p64 * H + c0 + offs
                        q = tl.load(tl.max_contiguous(tl.multiple_of(qp, 8), 8), mask=m & ok, other=0)
                        sb = load_block_bytes(comb_s_ptr + (slot0 + p64) * C + cols, cm & ok, 127, INT_ROUND)
                        v = tl.reshape(mx_decode_tile(tl.reshape(q, (NB, 32)), sb, INT_ROUND, BF16_MAX), (CHUNK,))
                    else:
                        v = to_fp32(tl.load(comb_q_ptr + (slot0 + p64) * H + c0 + offs, mask=m & ok, other=0.0),
                                    INT_ROUND)
                    fin = fin & (tl.abs(v) <= FP32_MAX)
                    acc = acc + v
                _origin_sum_store(acc, fin, y_ptr, t, c0, offs, m, H, INT_ROUND)
        t += G


@triton.jit
def local_reduce_kernel(rows_ptr, rows_s_ptr, dest_rank_ptr, dest_row_ptr, w_ptr, y_ptr, T,
                        H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, PASS: tl.constexpr,
                        WEIGHTED: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """Combine / dispatch backward on one rank (nothing travels): the token's single partial formed here exactly as
    an expert rank would, ``P = sum_j w[t, j] * rows[dest_row[t, j]]`` (fp32, ``j`` ascending, no FMA: launch with
    ``enable_fp_fusion=False``; ``WEIGHTED`` False: every weight 1), rounded for transport in registers (MX: quantize
    + decode, :func:`mx_qdq_tile`; else BF16), then the origin's sum of it: ``y[t] = 0 + P`` (bf16; -0 becomes +0).

    Args:
        rows_ptr: the expert rows ``[R, H]``: bf16, or (``PASS``) uint8 E4M3 payload with ``rows_s_ptr`` uint8 ``[R,
            H/32]`` row scales (decoded, saturated to bf16's range, before the sum).
        dest_rank_ptr / dest_row_ptr: int32 ``[T, K]`` (the plan's; -1 = dropped). w_ptr: fp32 ``[T, K]``
            (``WEIGHTED`` only). y_ptr: bf16 ``[T, H]``.
        MX: the partial is rounded as MXFP8 (MODE: the scale mode), else as BF16.
    Grid: as :func:`combine_reduce_kernel`'s.
    """
    _local_reduce(rows_ptr, rows_s_ptr, dest_rank_ptr, dest_row_ptr, w_ptr, y_ptr, T, H, K, CHUNK, MX, PASS, WEIGHTED,
                  MODE, INT_ROUND, False)


@triton.jit
def local_reduce_at_kernel(addr_ptr, T, H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                           PASS: tl.constexpr, WEIGHTED: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """``local_reduce_kernel`` inside a captured call: its six tensors at the addresses of the int64 table ``addr``
    (:mod:`.call_io`), in its argument order - the rows (16-byte aligned), their row scales (``PASS``), ``dest_rank``,
    ``dest_row``, the weights (``WEIGHTED``) and ``y`` (16-byte aligned); an unused entry is not read."""
    if PASS:
        rows_ptr = tl.load(addr_ptr).to(tl.pointer_type(tl.uint8))
    else:
        rows_ptr = tl.load(addr_ptr).to(tl.pointer_type(tl.bfloat16))
    rows_s_ptr = tl.load(addr_ptr + 1).to(tl.pointer_type(tl.uint8))
    dest_rank_ptr = tl.load(addr_ptr + 2).to(tl.pointer_type(tl.int32))
    dest_row_ptr = tl.load(addr_ptr + 3).to(tl.pointer_type(tl.int32))
    w_ptr = tl.load(addr_ptr + 4).to(tl.pointer_type(tl.float32))
    y_ptr = tl.load(addr_ptr + 5).to(tl.pointer_type(tl.bfloat16))
    _local_reduce(rows_ptr, rows_s_ptr, dest_rank_ptr, dest_row_ptr, w_ptr, y_ptr, T, H, K, CHUNK, MX, PASS, WEIGHTED,
                  MODE, INT_ROUND, True)


@triton.jit
def _local_reduce(rows_ptr, rows_s_ptr, dest_rank_ptr, dest_row_ptr, w_ptr, y_ptr, T, H: tl.constexpr,
                  K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, PASS: tl.constexpr, WEIGHTED: tl.constexpr,
                  MODE: tl.constexpr, INT_ROUND: tl.constexpr, ALIGNED: tl.constexpr):
    """The body of ``local_reduce_kernel`` (its arguments; ``ALIGNED``: the rows and ``y`` were read from an address
    table, so their 16-byte alignment is stated here: :func:`_row_values`, :func:`_origin_sum_store`)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hs = tl.program_id(1)
    HS = tl.num_programs(1)
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    t = pid
    while t < T:
        for c0 in tl.static_range(0, H, CHUNK):
            if (c0 // CHUNK) % HS == hs:
                m = (c0 + offs) < H
                cols = c0 // 32 + bcols
                cm = cols < C
                acc = tl.zeros((CHUNK,), tl.float32)
                for n in tl.static_range(K):  # slot n
                    ok = tl.load(dest_rank_ptr + t * K + n) >= 0
                    r = tl.load(dest_row_ptr + t * K + n)
                    v = _row_values(rows_ptr, rows_s_ptr, r, ok, c0, offs, cols, m, cm, H, NB, PASS, INT_ROUND,
                                    ALIGNED)
                    if WEIGHTED:
                        v = tl.load(w_ptr + t * K + n, mask=ok, other=0.0) * v
                    acc = acc + v
                # the transport rounding of the one partial in registers, then the origin's sum (0 + P: -0 -> +0)
                if MX:
                    acc = tl.reshape(mx_qdq_tile(tl.reshape(acc, (NB, 32)), MODE, INT_ROUND, 1, BF16_MAX), (CHUNK,))
                elif INT_ROUND:
                    acc = to_fp32(bf16_rne_int(_bf16_saturated(acc)), INT_ROUND)
                else:
                    acc = _bf16_saturated(acc).to(tl.bfloat16).to(tl.float32)
                fin = tl.abs(acc) <= FP32_MAX
                acc = tl.zeros((CHUNK,), tl.float32) + acc
                _origin_sum_store(acc, fin, y_ptr, t, c0, offs, m, H, INT_ROUND, ALIGNED)
        t += G
