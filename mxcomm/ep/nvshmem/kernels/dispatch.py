"""The sending dispatch kernels, one per path over one loop (:func:`_send_rows`): each BF16 token row is read once,
quantized in registers (MX) and stored straight at every slot's final row - ``local_rows_kernel`` (one rank: into the
output itself, padding zeroed in the same launch; also combine backward's weighted rows), ``push_rows_kernel``
(through NVSHMEM peer pointers into the destinations' receive windows, then signalling their arrival,
:mod:`.signals`) and ``stage_rows_kernel`` (the put path: into this rank's staging buffer, whose puts signal).
``_store_slot``: one slot's stores of a row chunk.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....kernels.mx_device import (bf16_rne_int, block_amax, mx_quantize_tile, mx_quantize_tile_amax, store_block_bytes,
                                   to_fp32)
from .layout import _zero_unfilled_rows
from .signals import _arrive_all


@triton.jit
def _store_slot(q, s, q_peers, s_peers, rk, row, c0, offs, cols, m, cm,
                H: tl.constexpr, C: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                OUT_DIRECT: tl.constexpr, HELD: tl.constexpr, INT_ROUND: tl.constexpr):
    """:func:`_send_rows`: one slot's stores of a row chunk - payload ``q`` at ``row`` of rank ``rk``'s ``recv_q`` (or
    of ``q_peers`` itself, ``OUT_DIRECT``), and (MX) its scales ``s`` at the same row of ``recv_s``, row-major; ``m`` /
    ``cm`` mask values / scale columns. ``HELD``: the scales are stored by the threads that hold them
    (:func:`store_block_bytes`; for scales quantized per slot, which a vector store would first move through shared
    memory for every slot); else as one vector store."""
    if OUT_DIRECT:
        qbase = q_peers
    elif MX:
        qbase = tl.load(q_peers + rk).to(tl.pointer_type(tl.uint8))
    else:
        qbase = tl.load(q_peers + rk).to(tl.pointer_type(tl.bfloat16))
    # 16-byte aligned contiguous row pieces (buffers 16-byte aligned, H % 32 == 0). Without these hints every peer
    # store over NVLink is a single byte. They survive this helper (Triton 3.6): tests/ep/test_nvshmem_dataflow.py
    # checks the sm_90 compile for 16-byte stores.
    dst = qbase + tl.multiple_of(row * H + c0, 16) + offs
    tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), q, mask=m)
    if MX:
        sbase = tl.load(s_peers + rk).to(tl.pointer_type(tl.uint8))
        sp = sbase + row * C + cols
        if HELD:
            store_block_bytes(sp, s, cm, INT_ROUND)
        else:
            if C % 16 == 0 and (NB % 16 == 0 or CHUNK >= H):  # 16 aligned, contiguous bytes
                sp = tl.max_contiguous(tl.multiple_of(sp, 16), 16)
            tl.store(sp, s, mask=cm)


@triton.jit
def _send_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, w_ptr, q_dst, s_peers, pid, G,
               H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr,
               INT_ROUND: tl.constexpr, WEIGHTED: tl.constexpr, OUT_DIRECT: tl.constexpr, SKIP_EMPTY: tl.constexpr,
               X_SLOT: tl.constexpr = False):
    """The sending kernels' loop: program ``pid`` of ``G`` reads token rows ``pid, pid + G, ...`` of the BF16 ``x``
    ``[T, H]`` once per row chunk, quantizes each chunk once (MX) and stores it per valid slot ``j`` at row
    ``dest_row[t, j]`` of rank ``dest_rank[t, j]`` (-1 = dropped; int32 ``[T, K]`` both) through :func:`_store_slot`:
    into ``q_dst`` itself (``OUT_DIRECT``: the output ``[*, H]``, uint8 MX / bf16) or into the buffer whose address
    entry ``rk`` of ``q_dst`` (int64 ``[W]``) holds; the scale rows through ``s_peers`` likewise (int64 ``[W]``).

    A uniform branch per slot; the slot's routing and base pointers are scalar loads that hit L1. Scales go out
    row-major, ``H/32`` contiguous bytes at the payload's row (the receiver swizzles them into the grouped blocked
    layout afterwards, ``scale_rows_to_grouped_kernel``; storing each row's scales straight into the blocked layout,
    4 bytes every 512, was the slower of the two in the kernel lab: ``bench/bench_ep_kernels.py --scales
    row,blocked`` times both).

    ``WEIGHTED`` (combine backward): slot ``j`` carries ``w[t, j] * x[t]`` (fp32 product; ``w_ptr`` fp32 ``[T, K]``),
    quantized per slot: the route weighting fused with the gradient quantization. ``SKIP_EMPTY``: a token whose every
    slot is dropped is not read (the stores are the same either way). ``X_SLOT``: ``x_ptr`` was read from memory
    (an address table), so its 16-byte alignment is stated here (without the hint, one load per value)."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    t = pid
    while t < T:  # persistent loop (a while: the interpreter rejects range(program_id, ...))
        if SKIP_EMPTY:
            live = tl.load(dest_rank_ptr + t * K) >= 0
            for j in tl.static_range(1, K):
                live = live | (tl.load(dest_rank_ptr + t * K + j) >= 0)
        else:
            live = True
        if live:
            for c0 in tl.static_range(0, H, CHUNK):
                m = (c0 + offs) < H
                cols = c0 // 32 + bcols
                cm = cols < C
                xp = x_ptr + t.to(tl.int64) * H + c0 + offs
                if X_SLOT:
                    xp = tl.max_contiguous(tl.multiple_of(xp, 16), 16)
                x = tl.load(xp, mask=m, other=0.0)
                if MX and not WEIGHTED:
                    q2, s = mx_quantize_tile(tl.reshape(x, (NB, 32)), MODE, INT_ROUND, 1)
                    q = tl.reshape(q2, (CHUNK,))
                if WEIGHTED:
                    xf = to_fp32(x, INT_ROUND)  # (the interpreter's plain bf16 cast flushes subnormals)
                    if MX:  # the chunk's block maxima, once for all slots (see below)
                        ax = block_amax(tl.reshape(xf, (NB, 32)), 1, INT_ROUND)
                if not MX:
                    s = cols  # no scales: a placeholder for _store_slot's unused argument
                for j in tl.static_range(K):
                    rk = tl.load(dest_rank_ptr + t * K + j)
                    row = tl.load(dest_row_ptr + t * K + j).to(tl.int64)  # both loads issued before the branch
                    if WEIGHTED:
                        if rk >= 0:  # dropped slots store nothing (and quantize nothing)
                            wv = tl.load(w_ptr + t * K + j)
                            xw = wv * xf
                            if MX:
                                # block maxima of w * x without a reduction per slot: |w| * max|x|. Equal for
                                # finite w (rounding a product is monotone in its magnitude); for w = +-Inf or NaN
                                # both are Inf or NaN, which give the same scale byte (255) and payload (0x7F)
                                q2, s = mx_quantize_tile_amax(tl.reshape(xw, (NB, 32)), tl.abs(wv) * ax, MODE,
                                                              INT_ROUND, 1)
                                q = tl.reshape(q2, (CHUNK,))
                            elif INT_ROUND:  # the interpreter's bf16 cast truncates; round to nearest even
                                q = bf16_rne_int(xw)
                            else:
                                q = xw.to(tl.bfloat16)
                            _store_slot(q, s, q_dst, s_peers, rk, row, c0, offs, cols, m, cm, H, C, NB, CHUNK, MX,
                                        OUT_DIRECT, True, INT_ROUND)
                    else:
                        if not MX:
                            q = x
                        # no branch: a dropped slot's stores are masked off (its rank read as 0), so the stored
                        # registers are packed once per chunk, not once per slot
                        ok = rk >= 0
                        _store_slot(q, s, q_dst, s_peers, tl.maximum(rk, 0), row, c0, offs, cols, m & ok, cm & ok,
                                    H, C, NB, CHUNK, MX, OUT_DIRECT, False, INT_ROUND)
        t += G


@triton.jit
def local_rows_kernel(x_ptr, T, dest_rank_ptr, dest_row_ptr, out_ptr, s_peers, w_ptr, offs_ptr, counts_ptr,
                      n_rows_ptr, R_out, n_groups, H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
                      MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, WEIGHTED: tl.constexpr):
    """One rank: each BF16 token row read once, quantized once (MX) and stored at every valid slot's expert-major row
    of the fresh output (the dispatch; ``WEIGHTED``: combine backward's rows ``w[t, j] * g[t]``, quantized per slot),
    its scale rows into the rank's ``recv_s``; then each program zeroes its share of the rows no token fills (the
    groups' padding), in the same launch, where the persistent loop's uneven end leaves the memory system idle.

    Args:
        x_ptr: bf16 ``[T, H]`` contiguous. dest_rank_ptr / dest_row_ptr: int32 ``[T, K]`` (the plan's: rank 0 or -1
            = dropped; the row). out_ptr: the output ``[R_out, H]``: uint8 (MX payload) or bf16.
        s_peers: int64 ``[1]``: the address of ``recv_s`` (uint8 ``[>= R_out, H/32]``, row-major scale rows; MX).
        w_ptr: fp32 ``[T, K]`` route weights (``WEIGHTED``; else unused).
        offs_ptr / counts_ptr / n_rows_ptr / n_groups: the plan's group end offsets, real rows per group, rows in
            use and ``El`` (:func:`_zero_unfilled_rows`).
    Grid: any number of programs; persistent over tokens."""
    _local_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, out_ptr, s_peers, w_ptr, offs_ptr, counts_ptr, n_rows_ptr,
                R_out, n_groups, H, K, CHUNK, MX, MODE, INT_ROUND, WEIGHTED, False)


@triton.jit
def local_rows_at_kernel(addr_ptr, T, dest_rank_ptr, dest_row_ptr, s_peers, offs_ptr, counts_ptr, n_rows_ptr, R_out,
                         n_groups, H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                         MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """``local_rows_kernel``'s dispatch (not weighted) inside a captured call: ``x`` and the output at the addresses
    of the int64 table ``addr`` (``addr[0]``: bf16 ``[T, H]`` contiguous, 16-byte aligned; ``addr[2]``: the fresh
    output ``[R_out, H]`` uint8 (MX) / bf16; :mod:`.call_io`), the rest as ``local_rows_kernel``."""
    x_ptr = tl.load(addr_ptr).to(tl.pointer_type(tl.bfloat16))
    if MX:
        out_ptr = tl.load(addr_ptr + 2).to(tl.pointer_type(tl.uint8))
    else:
        out_ptr = tl.load(addr_ptr + 2).to(tl.pointer_type(tl.bfloat16))
    _local_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, out_ptr, s_peers, x_ptr, offs_ptr, counts_ptr, n_rows_ptr,
                R_out, n_groups, H, K, CHUNK, MX, MODE, INT_ROUND, False, True)


@triton.jit
def _local_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, out_ptr, s_peers, w_ptr, offs_ptr, counts_ptr, n_rows_ptr,
                R_out, n_groups, H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                MODE: tl.constexpr, INT_ROUND: tl.constexpr, WEIGHTED: tl.constexpr, X_SLOT: tl.constexpr):
    """The body of ``local_rows_kernel`` (its arguments; ``out_ptr`` a pointer; ``X_SLOT``: ``x_ptr`` read from an
    address table, :func:`_send_rows`)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    _send_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, w_ptr, out_ptr, s_peers, pid, G, H, K, CHUNK, MX, MODE,
               INT_ROUND, WEIGHTED, True, False, X_SLOT)
    WORDS: tl.constexpr = H // 8 if MX else H // 4
    _zero_unfilled_rows(out_ptr.to(tl.pointer_type(tl.int64), bitcast=True), offs_ptr, counts_ptr, n_rows_ptr, R_out,
                        n_groups, pid, G, WORDS, 512)


@triton.jit
def push_rows_kernel(x_ptr, T, dest_rank_ptr, dest_row_ptr, q_peers, s_peers, flags_peers, me, W,
                     H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr,
                     INT_ROUND: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """The push path: each BF16 token row read once, quantized once (MX) and stored through NVSHMEM peer pointers
    into every valid slot's row of its destination's receive window (payload into ``recv_q``, scale rows into
    ``recv_s``); then every program adds 1 to ``flags[1, me]`` on every rank (:func:`_arrive_all`).

    Args:
        x_ptr: bf16 ``[T, H]`` contiguous. dest_rank_ptr / dest_row_ptr: int32 ``[T, K]``: destination rank (-1 =
            dropped, or outside this round's window) and row in its window.
        q_peers / s_peers / flags_peers: int64 ``[W]`` base pointers of ``recv_q`` (uint8 ``[*, H]`` MX, bf16
            ``[*, H]`` otherwise) / ``recv_s`` (uint8 ``[*, H/32]``) / ``flags`` on every rank.
        SKIP_EMPTY: a token with no slot in the round is not read (rounds through a receive window, where most
            tokens have none).
    Grid: any fixed number of programs (identical on every rank: receivers count arrivals); persistent over tokens.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    _send_rows(x_ptr, T, dest_rank_ptr, dest_row_ptr, x_ptr, q_peers, s_peers, pid, G, H, K, CHUNK, MX, MODE,
               INT_ROUND, False, False, SKIP_EMPTY)
    _arrive_all(flags_peers, 1, me, W)


@triton.jit
def stage_rows_kernel(x_ptr, T, dest_rank_ptr, send_pos_ptr, q_peers, s_peers, H: tl.constexpr, K: tl.constexpr,
                      CHUNK: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """The put path: each BF16 token row read once, quantized once (MX) and stored into this rank's staging buffer at
    every valid slot's send position (NVSHMEM puts then move each (destination, expert) block and signal; nothing is
    signalled here).

    Args:
        x_ptr: bf16 ``[T, H]`` contiguous. dest_rank_ptr / send_pos_ptr: int32 ``[T, K]``: destination rank (-1 =
            dropped) and send position. q_peers / s_peers: int64 ``[W]`` whose every entry is the address of the
            staging payload ``stage_q`` (uint8 ``[*, H]`` MX, bf16 otherwise) / scale rows ``stage_s``.
    Grid: any number of programs; persistent over tokens."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    _send_rows(x_ptr, T, dest_rank_ptr, send_pos_ptr, x_ptr, q_peers, s_peers, pid, G, H, K, CHUNK, MX, MODE,
               INT_ROUND, False, False, False)
