"""Triton kernels of the ``nvshmem`` EP backend: they quantize in registers and store straight into
peers' symmetric buffers through NVSHMEM peer pointers, then signal with release/acquire flags at
system scope. Every wait is bounded (``mxcomm.transport.flags.wait_flag_geq``). Buffers: see
:func:`mxcomm.ep.plan.buffer_regions` (the single source of their shapes) and docs/design.md.

* towards the experts: ``pull_head_kernel`` (the pull dispatch's id check, counts, counts publish and pack in one
  launch) and ``scan_and_wait_kernel`` (its slot table, and the wait for every rank's counts), ``pack_rows_kernel``
  (each token row once into the send copy), ``push_entries_kernel`` (one pull-list entry per (token, destination
  rank); on the pull path with the wait for every source's), ``pull_rows_kernel`` (each listed row read once, fanned
  out to its expert rows; the entries kept as the dispatch's table), ``dispatch_kernel`` (one rank, and the push/put
  paths), ``pull_weighted_kernel`` (combine backward: each gradient row read once per (token, rank), weighted and
  quantized per slot where it lands, the route-weight gradient formed there);
* towards the origins: ``combine_partials_kernel`` (one row per (token, rank): the weighted partial sum of the
  token's rows on this rank, rounded once) and ``combine_reduce_kernel`` (the sum of a token's partials);
* handshakes and layout: ``publish_kernel`` (counts + refusal word, "ready", route weights), ``wait_published_kernel``,
  ``wait_arrivals_kernel``, ``scale_rows_to_grouped_kernel``, ``copy_out_rows_kernel``, ``entries_table_kernel``,
  ``gather_route_grad_kernel``, ``first_refusal_kernel``.

Why two copies of ``comb_q`` (by combine epoch parity): the combine direction has no handshake before it writes into
its peers. Combine epoch ``e+1`` of rank A may start while rank B still reduces epoch ``e``; it writes the other
copy. It cannot lap B: A's epoch ``e+1`` began after A received B's epoch-``e`` partials, which B sent after it
finished reducing epoch ``e-1`` (stream order), the copy ``e+1`` uses. ``comb_w`` needs one copy: A publishes its
weights for ``e+1`` only after it received every rank's partials of ``e``, which each rank sent after reading A's
weights of ``e``. The dispatch direction needs no second receive buffer: every dispatch starts with the counts
exchange (combine backward with the "ready" handshake), and nobody writes before seeing all counts. The send copies
``send_q`` / ``send_w`` have two copies for the same reason as combine: a rank packs its rows before it has every
peer's counts, while a peer may still be reading the previous call's rows; the copy it writes was last read two
dispatch-direction epochs ago, and every peer finished that read before it published the counts of the epoch in
between. The pull list is tagged with the 64-bit epoch, so entries of earlier calls are skipped without clearing;
``comb_gw`` is written in combine backward after its "ready" handshake, which the origin joins only after it gathered
the previous call's.

Flags (``ep.flags`` ``[len(FLAG_ROWS), W]``, :data:`mxcomm.ep.plan.FLAG_ROWS`): entry ``[i, s]`` is written by rank
``s``; flags only grow (epochs or running totals), never reset. Arrival protocol: every program of a sending kernel,
after all its stores, adds 1 to ``flags[i, me]`` on every peer (release, sys). A receiver keeps the running total it
expects per (row, sender) on the device (``expect``) and waits for it. All ranks launch the same number of programs
in a call (it follows from the config).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..kernels.mx_device import (BF16_MAX, FP32_MAX, bf16_rne_int, block_amax, blocked_scale_offset,
                                 load_block_bytes, mx_decode_tile, mx_qdq_tile, mx_quantize_tile,
                                 mx_quantize_tile_amax, mx_saturate, store_block_bytes, to_fp32)
from ..transport.flags import deadline_after, last_to_arrive, signal_peer, wait_flag_geq
from .plan_kernels import (check_hist_block, counts_tile, place_slots, scan_keys, slot_tables,
                           table_or_origin_job)


@triton.jit
def publish_to(p, src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, row, W, me, epoch,
               BLOCK: tl.constexpr):
    """Copy my ``n_words`` int32 words into rank ``p``'s buffer at word ``dst_word0`` (and, when ``tail_word >= 0``,
    word ``src[n_words]`` to word ``tail_word`` there), then raise ``flags[row, me]`` there to ``epoch`` (release,
    sys). ``dst_peers`` / ``flags_peers``: int64 ``[W]`` peer base pointers (the destination buffer viewed as
    int32; the int64 ``flags``)."""
    offs = tl.arange(0, BLOCK)
    base = tl.load(dst_peers + p).to(tl.pointer_type(tl.int32))
    db = base + dst_word0
    c0 = 0
    while c0 < n_words:
        m = c0 + offs < n_words
        tl.store(db + c0 + offs, tl.load(src_ptr + c0 + offs, mask=m, other=0), mask=m)
        c0 += BLOCK
    if tail_word >= 0:
        tl.store(base + tail_word, tl.load(src_ptr + n_words))
    tl.debug_barrier()
    raise_flag(p, flags_peers, row, W, me, epoch)


@triton.jit
def raise_flag(p, flags_peers, row, W, me, epoch):
    """Raise ``flags[row, me]`` on rank ``p`` to ``epoch`` (release, sys; ``flags_peers``: int64 ``[W]`` base
    pointers of every rank's int64 ``flags``). Call after ``tl.debug_barrier()`` when several threads stored."""
    fb = tl.load(flags_peers + p).to(tl.pointer_type(tl.int64))
    signal_peer(fb + row * W + me, epoch)


@triton.jit
def publish_kernel(src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, flags_local, row, W, epoch_ptr,
                   err_ptr, timeout_ns, me, BLOCK: tl.constexpr, WAIT: tl.constexpr = True):
    """Program ``p``: :func:`publish_to` rank ``p`` with this epoch, then (``WAIT``) wait (bounded) until rank ``p``
    has published to me (``flags[row, p]`` here; without ``WAIT`` a later :func:`wait_published_kernel` does, so
    that work can run between the two). The counts exchange (my ``[E]`` counts into every ``counts[me]``, my refusal
    word into every refusal row), the "ready" handshake (``n_words = 0``) and combine's route weights (my ``[T, k]``
    into every ``comb_w[me]``).

    Args: src_ptr int32 words; dst_peers / flags_peers int64 ``[W]`` peer base pointers (the destination buffer
    viewed as int32); flags_local this rank's int64 ``flags``; epoch_ptr int64 scalar; err_ptr int64 error word.
    Grid: (W,).
    """
    p = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    publish_to(p, src_ptr, n_words, dst_peers, dst_word0, tail_word, flags_peers, row, W, me, epoch, BLOCK)
    if WAIT:
        wait_flag_geq(flags_local + row * W + p, epoch, deadline_after(timeout_ns), err_ptr, p)


@triton.jit
def wait_published_kernel(flags_local, row, W, epoch_ptr, err_ptr, timeout_ns):
    """Program ``p``: wait (bounded) until rank ``p`` has published this epoch to me (``flags[row, p] >= epoch``
    here), the wait :func:`publish_kernel` leaves out without ``WAIT``. Args as there. Grid: (W,)."""
    p = tl.program_id(0)
    wait_flag_geq(flags_local + row * W + p, tl.load(epoch_ptr), deadline_after(timeout_ns), err_ptr, p)


@triton.jit
def wait_arrivals_kernel(flags_row_ptr, expect_row_ptr, per_call, err_ptr, timeout_ns):
    """Program ``s``: add ``per_call`` (the sender's program count) to ``expect_row[s]``, then wait
    (bounded) until ``flags_row[s]`` reaches it. The running total lives on the device, so the program
    count may change between calls and CUDA graph replays stay correct. Grid: (W,)."""
    s = tl.program_id(0)
    expected = tl.load(expect_row_ptr + s) + per_call
    tl.store(expect_row_ptr + s, expected)
    wait_flag_geq(flags_row_ptr + s, expected, deadline_after(timeout_ns), err_ptr, s)


@triton.jit
def wait_every_source(flags_row_ptr, expect_row_ptr, per_call, W, err_ptr, timeout_ns):
    """One program: what :func:`wait_arrivals_kernel` does with one program per source - for every source ``s``,
    add ``per_call`` to ``expect_row[s]`` and wait (bounded) until ``flags_row[s]`` reaches it - one source after the
    other under one deadline. For the last program of a sending launch (its ticket), so that no wait kernel follows."""
    deadline = deadline_after(timeout_ns)
    s = 0
    while s < W:
        expected = tl.load(expect_row_ptr + s) + per_call
        tl.store(expect_row_ptr + s, expected)
        wait_flag_geq(flags_row_ptr + s, expected, deadline, err_ptr, s)
        s += 1


@triton.jit
def _arrive(flags_peers, p, row, me, W):
    """Add 1 to ``flags[row, me]`` on rank ``p`` (release, sys; ``flags_peers``: int64 ``[W]`` base pointers of the
    int64 ``flags`` on every rank). Call after ``tl.debug_barrier()`` when several threads stored the payload."""
    fb = tl.load(flags_peers + p).to(tl.pointer_type(tl.int64))
    tl.atomic_add(fb + row * W + me, 1, sem="release", scope="sys")


@triton.jit
def _arrive_all(flags_peers, row, me, W):
    """After this program's stores: add 1 to ``flags[row, me]`` on every rank (release, sys)."""
    tl.debug_barrier()
    p = 0
    while p < W:
        _arrive(flags_peers, p, row, me, W)
        p += 1


@triton.jit
def _store_slot(q, s, q_peers, s_peers, rk, row, c0, offs, cols, m, cm,
                H: tl.constexpr, C: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                OUT_DIRECT: tl.constexpr, HELD: tl.constexpr, INT_ROUND: tl.constexpr):
    """dispatch_kernel: one slot's stores of a row chunk - payload ``q`` at ``row`` of rank ``rk``'s ``recv_q`` (or of
    ``q_peers`` itself, ``OUT_DIRECT``), and (MX) its scales ``s`` at the same row of ``recv_s``, row-major; ``m`` /
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
def dispatch_kernel(x_ptr, T, dest_rank_ptr, dest_row_ptr, q_peers, s_peers, flags_peers, me, W, w_ptr,
                    offs_ptr, counts_ptr, n_rows_ptr, R_out, n_groups,
                    H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
                    MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, WEIGHTED: tl.constexpr,
                    ARRIVE: tl.constexpr = True, ZERO_PAD: tl.constexpr = False,
                    OUT_DIRECT: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False):
    """Read each BF16 token row once, quantize it in registers (MX) and store payload and scales
    straight into each destination rank's buffers at their final expert-major rows.

    Per token and row chunk: one load and (MX) one quantization, then one 1-D store per valid slot
    (a uniform branch per slot; the slot's routing and base pointers are scalar loads that hit L1).
    Scales go out row-major, ``H/32`` contiguous bytes at the payload's row: the receiver swizzles them
    into the grouped blocked layout afterwards (``scale_rows_to_grouped_kernel``). Storing each row's
    scales straight into the blocked layout (4 bytes every 512) cost ~50 % more time on one H200
    (``bench/bench_ep_kernels.py``, ``--scales row,blocked``).

    ``WEIGHTED`` (combine backward): slot ``j`` carries ``w[t, j] * x[t]`` (fp32 product), quantized per
    slot - the route weighting fused with the gradient quantization; ``w_ptr`` fp32 ``[T, K]``.

    Args:
        x_ptr: bf16 ``[T, H]`` contiguous.
        dest_rank_ptr / dest_row_ptr: int32 ``[T, K]``: destination rank (-1 = dropped) and row there.
        q_peers / s_peers / flags_peers: int64 ``[W]`` base pointers of ``recv_q`` (uint8 ``[*, H]`` MX,
            bf16 ``[*, H]`` otherwise) / ``recv_s`` (uint8 ``[*, H/32]``) / ``flags`` on every rank.
        ARRIVE: add 1 to ``flags[1, me]`` on every rank after the stores (False on the put path, whose
            puts signal; there every ``*_peers`` entry is this rank's staging buffer and the rows are
            send positions).
        ZERO_PAD (local path: ``q_peers`` holds the fresh ``[R_out, *]`` output's address): after its tokens, each
            program zeroes its share of the rows no token fills (:func:`_zero_unfilled_rows` with the plan's
            ``offs_ptr`` / ``counts_ptr`` / ``n_rows_ptr`` over ``n_groups`` groups) - in the same launch, where the
            persistent loop's uneven end leaves the memory system idle. Those four are unused otherwise.
        OUT_DIRECT (local path): ``q_peers`` IS that output (uint8 ``[R_out, H]`` MX, bf16 ``[R_out, H]``), not a
            table of addresses (one fewer host operation per call than writing its address into a table).
        SKIP_EMPTY: a token whose every slot is dropped is not read (the push path's rounds through a receive window,
            where most tokens have no slot in a given round); the stores are the same either way.
    Grid: any fixed number of programs (identical on every rank); persistent over tokens.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
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
                x = tl.load(x_ptr + t.to(tl.int64) * H + c0 + offs, mask=m, other=0.0)
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
                            _store_slot(q, s, q_peers, s_peers, rk, row, c0, offs, cols, m, cm, H, C, NB, CHUNK, MX,
                                        OUT_DIRECT, True, INT_ROUND)
                    else:
                        if not MX:
                            q = x
                        # no branch: a dropped slot's stores are masked off (its rank read as 0), so the stored
                        # registers are packed once per chunk, not once per slot
                        ok = rk >= 0
                        _store_slot(q, s, q_peers, s_peers, tl.maximum(rk, 0), row, c0, offs, cols, m & ok, cm & ok,
                                    H, C, NB, CHUNK, MX, OUT_DIRECT, False, INT_ROUND)
        t += G
    if ZERO_PAD:
        WORDS: tl.constexpr = H // 8 if MX else H // 4
        if OUT_DIRECT:
            out = q_peers.to(tl.pointer_type(tl.int64), bitcast=True)
        else:
            out = tl.load(q_peers).to(tl.pointer_type(tl.int64))
        _zero_unfilled_rows(out, offs_ptr, counts_ptr, n_rows_ptr, R_out, n_groups, pid, G, WORDS, 512)
    if ARRIVE:
        _arrive_all(flags_peers, 1, me, W)


@triton.jit
def pack_row(x_ptr, t, send_q_ptr, send_s_ptr, drow, copy0, H: tl.constexpr, CHUNK: tl.constexpr,
             MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, X_SLOT: tl.constexpr):
    """Token row ``t`` of ``x`` read once and (MX) quantized once into a send copy: its values at element
    ``copy0 + t * H`` of ``send_q``, its row-major scales (MX) at row ``drow`` of ``send_s``. Pointers as in
    :func:`pack_rows_kernel` (``x_ptr`` already the tensor's; ``X_SLOT``: it was read from memory, so its
    16-byte alignment is stated here)."""
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    for c0 in tl.static_range(0, H, CHUNK):
        m = (c0 + offs) < H
        xp = x_ptr + t.to(tl.int64) * H + c0 + offs
        if X_SLOT:  # an address read from memory carries no alignment: without the hint, one load per value
            xp = tl.max_contiguous(tl.multiple_of(xp, 16), 16)
        x = tl.load(xp, mask=m, other=0.0)
        dst = send_q_ptr + tl.multiple_of(copy0 + t.to(tl.int64) * H + c0, 16) + offs
        if MX:
            q2, s = mx_quantize_tile(tl.reshape(x, (NB, 32)), MODE, INT_ROUND, 1)
            tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), tl.reshape(q2, (CHUNK,)), mask=m)
            cols = c0 // 32 + bcols
            store_block_bytes(send_s_ptr + drow * C + cols, s, cols < C, INT_ROUND)
        else:
            tl.store(tl.max_contiguous(tl.multiple_of(dst, 16), 16), x, mask=m)


@triton.jit
def pack_rows_kernel(x_ptr, T, send_q_ptr, send_s_ptr, epoch_ptr, T_max, copy_elems,
                     H: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr,
                     INT_ROUND: tl.constexpr, X_SLOT: tl.constexpr = False):
    """Pull path, sender: every token row read once and (MX) quantized once into this rank's send copy
    ``par = epoch % 2``, row ``t`` (:func:`pack_row`); the receivers read the rows they need from there. (With the
    Triton plan the pull dispatch packs in :func:`pull_head_kernel`, combine backward in :func:`pack_ready_kernel`.)

    Args:
        x_ptr: bf16 ``[T, H]`` contiguous; with ``X_SLOT``, an int64 word holding that tensor's address (so a
            CUDA graph captured once replays with each call's ``x``), which must be 16-byte aligned.
        send_q_ptr: this rank's ``send_q`` (uint8 ``[2, T_max, 2H]``) as uint8 (MX: H-byte rows) or bf16 (H-value
            rows); row ``t`` of copy ``par`` starts at element ``par * copy_elems + t * H``.
        send_s_ptr: uint8 ``[2, T_max, H/32]`` row-major scales (MX only).
        epoch_ptr: int64 epoch of this call (already advanced).
    Grid: any; persistent over tokens.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    par = tl.load(epoch_ptr) % 2
    row0 = par * T_max
    copy0 = par * copy_elems
    if X_SLOT:
        x_ptr = tl.load(x_ptr).to(tl.pointer_type(tl.bfloat16))
    t = pid
    while t < T:
        pack_row(x_ptr, t, send_q_ptr, send_s_ptr, row0 + t, copy0, H, CHUNK, MX, MODE, INT_ROUND, X_SLOT)
        t += G


@triton.jit
def pack_weights(w_ptr, t, send_w_ptr, drow, K: tl.constexpr, K_POW2: tl.constexpr):
    """Token ``t``'s fp32 route weights (``w`` ``[T, K]``) into row ``drow`` of ``send_w`` (fp32 ``[., K]``)."""
    kk = tl.arange(0, K_POW2)
    wv = tl.load(w_ptr + t * K + kk, mask=kk < K, other=0.0)
    tl.store(send_w_ptr + drow * K + kk, wv, mask=kk < K)


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
def pull_head_kernel(idx_ptr, ids_ptr, hist_ptr, input_err_ptr, T, E, totals_ptr, counts_ptr, ticket_ptr,
                     counts_peers, flags_peers, row, W, me, epoch_ptr, x_slot, send_q_ptr, send_s_ptr, T_max,
                     copy_elems, K: tl.constexpr, K_POW2: tl.constexpr, TOK: tl.constexpr, KEYS: tl.constexpr,
                     PUB_BLOCK: tl.constexpr, H: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                     MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """Pull path, sender: the dispatch's steps up to the counts' publish, and the pack, in one launch, no program
    waiting for another.

    1. Every program checks and counts blocks ``pid, pid + G, ...`` of ``TOK`` tokens
       (:func:`~mxcomm.ep.plan_kernels.check_hist_block`: the checked int32 ids into ``ids`` ``[T, K]``, bad ids
       counted into the int64 ``input_err[0]``, each block's per-key counts into its row of ``hist`` int32
       ``[cdiv(T, TOK), E + 1]``) and adds each block's counts into ``totals`` (int32 ``[E + 1]``, zero before the
       launch).
    2. The last program to get there (:func:`~mxcomm.transport.flags.last_to_arrive` on the int32 ``ticket``)
       moves the totals into ``counts[:E]`` (this rank's counts per expert; ``totals`` back to zero) and the refusal
       word (``input_err`` as int32) into ``counts[E]``, advances the int64 dispatch epoch by one and publishes the
       ``E + 1`` words to every rank (``counts[me]`` and refusal word ``me`` of ``ep.counts``, ``flags[row, me]``
       raised to the new epoch; :func:`publish_to`).
    3. Every program packs tokens ``pid, pid + G, ...`` of ``x`` (its address in the int64 ``x_slot``) into send
       copy ``(epoch + 1) % 2`` (:func:`pack_row`), while the counts travel.

    ``hist`` is left as per-block counts: :func:`scan_and_wait_kernel` turns it into the plan's prefix table. Every
    program reads the epoch before its ticket and the last one stores the new epoch after taking it, so all use the
    same new epoch. The pack's copy is not being read (see this module's notes on ``send_q``). ``KEYS``: keys per
    step of the zeroing and the totals (a power of two). Args as in :func:`pack_rows_kernel` and
    :func:`publish_kernel` (``counts_peers``: int64 ``[W]`` base pointers of ``ep.counts``). Grid: any (at least 1);
    the blocks and the tokens are shared out over it.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    epoch = tl.load(epoch_ptr) + 1
    keys = tl.arange(0, KEYS)
    b = pid
    while b * TOK < T:
        check_hist_block(idx_ptr, ids_ptr, hist_ptr, input_err_ptr, b, T, E, K, K_POW2, TOK, True, KEYS)
        tl.debug_barrier()  # every thread's counts of the block in its row
        k0 = 0
        while k0 < E + 1:
            h = tl.load(hist_ptr + b * (E + 1) + k0 + keys, mask=k0 + keys < E + 1, other=0, volatile=True)
            tl.atomic_add(totals_ptr + k0 + keys, h, mask=(k0 + keys < E + 1) & (h != 0))
            k0 += KEYS
        b += G
    if last_to_arrive(ticket_ptr, G):
        k0 = 0
        while k0 < E + 1:
            m = k0 + keys < E + 1
            tot = tl.load(totals_ptr + k0 + keys, mask=m, other=0, volatile=True)
            tl.store(counts_ptr + k0 + keys, tot, mask=k0 + keys < E)
            tl.store(totals_ptr + k0 + keys, tl.zeros((KEYS,), tl.int32), mask=m)
            k0 += KEYS
        tl.store(counts_ptr + E, tl.load(input_err_ptr, volatile=True).to(tl.int32))
        tl.store(epoch_ptr, epoch)
        tl.debug_barrier()  # the counts and the refusal word before the threads that publish them read them
        p = 0
        while p < W:
            publish_to(p, counts_ptr, E, counts_peers, me * E, W * E + me, flags_peers, row, W, me, epoch, PUB_BLOCK)
            p += 1
    par = epoch % 2
    xp = tl.load(x_slot).to(tl.pointer_type(tl.bfloat16))
    t = pid
    while t < T:
        pack_row(xp, t, send_q_ptr, send_s_ptr, par * T_max + t, par * copy_elems, H, CHUNK, MX, MODE, INT_ROUND,
                 True)
        t += G


@triton.jit
def scan_and_wait_kernel(hist_ptr, counts_ptr, n_blocks, n_keys, ticket_ptr, flags_local, row, W, epoch_ptr, err_ptr,
                         timeout_ns, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pull path, after :func:`pull_head_kernel`: its per-block counts ``hist`` int32 ``[n_blocks, n_keys]`` become
    the plan's prefix table (:func:`~mxcomm.ep.plan_kernels.scan_keys`, one program per ``BLOCK_K`` keys; the totals,
    the head's ``counts[:E]`` again, into ``counts``), then the last program (the int32 ``ticket``, 0 between
    launches) waits (bounded, one deadline) for every rank's counts of this epoch, as :func:`wait_published_kernel`
    does: the plan's launch follows. Grid: ``cdiv(n_keys, BLOCK_K)``."""
    scan_keys(hist_ptr, counts_ptr, n_blocks, n_keys, tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K), BLOCK_B)
    if last_to_arrive(ticket_ptr, tl.num_programs(0)):
        deadline = deadline_after(timeout_ns)
        epoch = tl.load(epoch_ptr)
        p = 0
        while p < W:  # (one program: every rank in turn, under one deadline)
            wait_flag_geq(flags_local + row * W + p, epoch, deadline, err_ptr, p)
            p += 1


@triton.jit
def list_entries(dest_rank_ptr, dest_row_ptr, w_ptr, b, T, d, lst, me, T_max, ep, K: tl.constexpr, EW: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Tokens ``[b, b + BLOCK)`` (those below ``T``) of source ``me``: for each one with a slot going to rank ``d``,
    its pull-list entry ``[me, t]`` into ``lst`` (``d``'s pull list, int32 ``[W, T_max, EW]``), laid out as
    :func:`push_entries_kernel` says, tagged with the int64 epoch ``ep``. ``dest_rank`` / ``dest_row`` int32 ``[T,
    K]`` (the plan), ``w`` fp32 ``[T, K]``."""
    jj = tl.arange(0, EW)[None, :]
    slot = (jj >= 2) & (jj <= K + 1)  # entry word 2 + j holds slot j's row, word 2 + K + j its weight
    wslot = (jj >= K + 2) & (jj <= 2 * K + 1)
    head = tl.where(jj == 0, ep.to(tl.int32), (ep >> 32).to(tl.int32))  # the tag, in words 0-1
    t = b + tl.arange(0, BLOCK)[:, None]
    m2 = (t < T) & slot
    sidx = t.to(tl.int64) * K + (jj - 2)
    to_d = tl.load(dest_rank_ptr + sidx, mask=m2, other=-1) == d                     # [BLOCK, EW]
    rows = tl.load(dest_row_ptr + sidx, mask=m2 & to_d, other=-1)
    wts = tl.load(w_ptr + t.to(tl.int64) * K + (jj - 2 - K), mask=(t < T) & wslot, other=0.0)
    listed = tl.max(to_d.to(tl.int32), axis=1)[:, None] > 0                          # the token goes to d
    entry = lst + (me * T_max + t).to(tl.int64) * EW                                # entry [me, t] on d
    words = tl.where(jj < 2, head, tl.where(wslot, wts.to(tl.int32, bitcast=True), rows))
    tl.store(entry + jj, words, mask=listed & (jj < 2 * K + 2))


@triton.jit
def push_entries_kernel(dest_rank_ptr, dest_row_ptr, w_ptr, T, list_peers, flags_peers, epoch_ptr, me, W, T_max,
                        K: tl.constexpr, EW: tl.constexpr, BLOCK: tl.constexpr):
    """Sender: for each token ``t`` and each rank ``d`` that receives it, one pull-list entry ``[s, t]`` (``s = me``)
    on ``d``: ``[tag_lo, tag_hi, row_0, ..., row_{K-1}, w_0, ..., w_{K-1}, ...]`` (``EW`` words) with ``row_j =
    dest_row[t, j]`` for the slots going to ``d`` and -1 for the others, and the token's route weights (fp32 bits, every
    slot's: combine weights the receiver's partial sums with them); the tag is the 64-bit dispatch epoch (an entry can
    never be mistaken for one of another call, however many calls ago it was written). One entry per (token, rank):
    the receiver reads the row once, however many of its experts the token selected.

    Program ``(p, i)`` writes the entries of destination ``d = (me + i) % W`` for blocks ``p, p + P, ...`` of
    ``BLOCK`` tokens, then adds 1 to ``flags[1, me]`` on ``d`` (release, sys): each rank receives ``P`` arrivals
    from every source, one release per program (:func:`list_entries`; the pull path writes its entries in
    :func:`plan_entries_kernel` instead).

    Args:
        dest_rank_ptr / dest_row_ptr: int32 ``[T, K]`` (the plan; rank -1 = dropped slot); w_ptr: fp32 ``[T, K]``.
        list_peers / flags_peers: int64 ``[W]`` base pointers of ``pull_list`` (int32 ``[W, T_max, EW]``) /
            ``flags``. epoch_ptr: int64 dispatch epoch (already advanced for this call).
        EW: int32 words per entry (a power of two >= 2 K + 2).
    Grid: ``(P, W)``, ``P`` identical on every rank (receivers count their arrivals).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    d = (me + tl.program_id(1)) % W
    ep = tl.load(epoch_ptr)
    lst = tl.load(list_peers + d).to(tl.pointer_type(tl.int32))
    b = pid * BLOCK
    while b < T:
        list_entries(dest_rank_ptr, dest_row_ptr, w_ptr, b, T, d, lst, me, T_max, ep, K, EW, BLOCK)
        b += P * BLOCK
    tl.debug_barrier()
    _arrive(flags_peers, d, 1, me, W)  # flags[1, me] on d


# the plan's sizes, rank and strides are not specialized (see plan_kernel)
@triton.jit(do_not_specialize=["c_stride", "n_slots", "n_rows", "table_programs", "slot_programs", "n_refusal", "me",
                               "align", "W", "El", "T_max"])
def plan_entries_kernel(counts_ptr, c_stride, idx_ptr, pre_ptr, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr,
                        dest_rank_ptr, dest_row_ptr, send_pos_ptr, order_ptr, src_ptr, pos_ptr, status_ptr,
                        refusal_ptr, n_slots, n_rows, table_programs, slot_programs, n_refusal, me, align, W, El,
                        w_ptr, list_peers, flags_peers, epoch_ptr, T_max, ticket_ptr, flags_row_ptr, expect_row_ptr,
                        err_ptr, timeout_ns, W_POW2: tl.constexpr, EL_POW2: tl.constexpr, S: tl.constexpr,
                        S_POW2: tl.constexpr, BLOCK: tl.constexpr, STATUS: tl.constexpr, K: tl.constexpr,
                        EW: tl.constexpr):
    """Pull path: :func:`~mxcomm.ep.plan_kernels.plan_kernel`'s jobs (same arguments first, same outputs) and the
    pull-list entries in one launch. Each slot program, as soon as it has placed a block of ``S`` slots (``S // K``
    whole tokens), writes those tokens' entries into every destination's pull list (:func:`list_entries`: rows there,
    route weights from ``w`` fp32 ``[T, K]``, tagged with the int64 epoch). The last program of the launch
    (:func:`~mxcomm.transport.flags.last_to_arrive` at system scope on the int32 ``ticket``, 0 between launches: every
    program's entries in peers' memory are ordered before it) adds 1 to ``flags[1, me]`` on every rank (release, sys)
    and then waits (bounded, one deadline) until every source's ``flags[1, s]`` here reaches ``expect[1, s] + 1``
    (``flags_row`` / ``expect_row``: this rank's int64 ``[W]`` rows; ``expect`` advanced here). One arrival per
    (source, destination) and call, whatever the token counts. Grid: as ``plan_kernel``'s."""
    TOK: tl.constexpr = S // K
    pid = tl.program_id(0)
    c = counts_tile(counts_ptr, c_stride, W, El, W_POW2, EL_POW2)
    table_or_origin_job(c, pid, cnt_ptr, tab_ptr, recv_ptr, srp_ptr, ssp_ptr, status_ptr, refusal_ptr, src_ptr, pos_ptr,
                        n_rows, table_programs, slot_programs, n_refusal, me, align, W, El, W_POW2, EL_POW2, BLOCK,
                        STATUS)
    if (pid >= table_programs) & (pid < table_programs + slot_programs):
        dst_base, send_base, num_send = slot_tables(c, me, align, W_POW2, EL_POW2)
        ep = tl.load(epoch_ptr)
        T = n_slots // K
        b = pid - table_programs
        while b * S < n_slots:
            place_slots(dst_base, send_base, num_send, idx_ptr, pre_ptr, dest_rank_ptr, dest_row_ptr, send_pos_ptr,
                        order_ptr, b, n_slots, W * El, El, EL_POW2, S, S_POW2)
            tl.debug_barrier()  # the block's rows, stored by every thread, before the entries read them back
            i = 0
            while i < W:
                d = (me + i) % W
                lst = tl.load(list_peers + d).to(tl.pointer_type(tl.int32))
                list_entries(dest_rank_ptr, dest_row_ptr, w_ptr, b * TOK, T, d, lst, me, T_max, ep, K, EW, TOK)
                i += 1
            b += slot_programs
    if last_to_arrive(ticket_ptr, tl.num_programs(0), True):
        p = 0
        while p < W:
            _arrive(flags_peers, p, 1, me, W)  # flags[1, me] on p
            p += 1
        wait_every_source(flags_row_ptr, expect_row_ptr, 1, W, err_ptr, timeout_ns)


@triton.jit
def _entry_ok(e, tag_lo, tag_hi):
    """A pull-list entry belongs to this call: its words 0-1 hold the 64-bit epoch tag."""
    return (tl.load(e) == tag_lo) & (tl.load(e + 1) == tag_hi)


@triton.jit
def _keep_entry(e, ok, table_ptr, wtab_ptr, i, K: tl.constexpr, K_POW2: tl.constexpr):
    """Row ``i`` of the dispatch's table and of its weights: the ``K`` rows and the ``K`` route weights (fp32 bits,
    int32 here) of pull-list entry ``e`` when it belongs to this call (``ok``), else ``K`` times -1 and 0 (the token
    was not received)."""
    kk = tl.arange(0, K_POW2)
    rows = tl.load(e + 2 + kk, mask=ok & (kk < K), other=-1)
    tl.store(table_ptr + i.to(tl.int64) * K + kk, rows, mask=kk < K)
    wbits = tl.load(e + 2 + K + kk, mask=ok & (kk < K), other=0)
    tl.store(wtab_ptr + i.to(tl.int64) * K + kk, wbits, mask=kk < K)


@triton.jit
def entries_table_kernel(list_ptr, table_ptr, wtab_ptr, epoch_ptr, n_entries, K: tl.constexpr, K_POW2: tl.constexpr,
                         EW: tl.constexpr):
    """The dispatch's table from this rank's pull list (push and put paths; the pull path's gather writes it itself):
    int32 ``[n_entries, K]``, entry ``s * T_max + t`` = the rows here of source ``s``'s token ``t`` per slot (-1 for
    slots elsewhere; all -1 when the pull-list entry is of another call), and into ``wtab`` (int32 ``[n_entries, K]``,
    fp32 bits) that token's route weights (0 when not received). Grid: any; persistent."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    ep = tl.load(epoch_ptr)
    tag_lo = ep.to(tl.int32)
    tag_hi = (ep >> 32).to(tl.int32)
    i = pid
    while i < n_entries:
        e = list_ptr + i.to(tl.int64) * EW
        _keep_entry(e, _entry_ok(e, tag_lo, tag_hi), table_ptr, wtab_ptr, i, K, K_POW2)
        i += G


@triton.jit
def pull_rows_kernel(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, q_peers, s_peers,
                     list_ptr, table_ptr, wtab_ptr, epoch_ptr, T_max, W, copy_words,
                     ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                     C: tl.constexpr, C_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, EW: tl.constexpr,
                     MX: tl.constexpr):
    """Pull dispatch, receiver: every token listed in this rank's pull list for this epoch is read ONCE from
    its source's send copy (through the peer pointer) and stored at each of its expert-major rows here: the
    payload into the fresh output ``dst``, the scale row (MX) into ``dst_s`` (row-major at the payload row;
    ``scale_rows_to_grouped_kernel`` then builds the blocked matrix). The entry's rows are kept in the dispatch's
    table (combine answers one row per entry), the entry's route weights in the table's weights (combine weights its
    partial sums with them unless it is given other weights). Then the padding rows of every group are
    zeroed (rows past ``n_rows``, the worst-case tail of the no-sync mode, are left as they are).

    Args:
        dst_ptr: int64 view of the fresh ``[R_out, ROW_WORDS]`` output (row bytes / 8).
        dst_s_ptr: uint8 ``[>= n_rows, C]`` row-major scale rows (MX only).
        offs_ptr / counts_ptr: int32 ``[n_groups]`` group end offsets / real rows (the plan's); n_rows_ptr: int32
            scalar, ``offs[-1]``.
        q_peers / s_peers: int64 ``[W]`` base pointers of the sources' ``send_q`` (read as int64 rows of
            ``ROW_WORDS``; copy 1 starts ``copy_words`` words after copy 0) / ``send_s`` (uint8 rows of ``C``).
        list_ptr: this rank's ``pull_list``, int32 ``[W, T_max, EW]``; entry ``[s, t]`` belongs to this call
            when its words 0-1 hold the epoch (others are older: skipped); words 2.. are its K rows, then its K
            weights (see :func:`push_entries_kernel`).
        table_ptr / wtab_ptr: int32 ``[W * T_max, K]`` each, the dispatch's table and its weights (fp32 bits; see
            :func:`entries_table_kernel`).
        epoch_ptr: int64 dispatch epoch; the rows are in send copy ``par = epoch % 2`` (payload word
            ``par * copy_words + t * ROW_WORDS``, scale row ``par * T_max + t``).
    Grid: any; persistent over entries, then over groups.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    ep = tl.load(epoch_ptr)
    tag_lo = ep.to(tl.int32)
    tag_hi = (ep >> 32).to(tl.int32)
    row0 = (ep % 2) * T_max
    copy0 = (ep % 2) * copy_words
    scols = tl.arange(0, C_POW2)
    i = pid
    while i < W * T_max:
        e = list_ptr + i.to(tl.int64) * EW
        ok = _entry_ok(e, tag_lo, tag_hi)
        _keep_entry(e, ok, table_ptr, wtab_ptr, i, K, K_POW2)
        s = i // T_max
        srow = (row0 + i % T_max).to(tl.int64)
        sbase = (tl.load(q_peers + s, mask=ok, other=0).to(tl.pointer_type(tl.int64)) + copy0
                 + (i % T_max).to(tl.int64) * ROW_WORDS)
        for c0 in tl.static_range(0, ROW_WORDS, CHUNK):
            m = (c0 + offs) < ROW_WORDS
            # once over the link, 16 bytes a load (rows 16-byte aligned; an address read from the peer table
            # carries no alignment without the hint)
            v = tl.load(tl.max_contiguous(tl.multiple_of(sbase + c0 + offs, 16), 16), mask=m & ok, other=0)
            for j in tl.static_range(K):
                r = tl.load(e + 2 + j, mask=ok, other=-1)
                tl.store(dst_ptr + r.to(tl.int64) * ROW_WORDS + c0 + offs, v, mask=m & (r >= 0))
        if MX:
            sb = tl.load(s_peers + s, mask=ok, other=0).to(tl.pointer_type(tl.uint8)) + srow * C
            sv = tl.load(sb + scols, mask=(scols < C) & ok, other=0)
            for j in tl.static_range(K):
                r = tl.load(e + 2 + j, mask=ok, other=-1)
                tl.store(dst_s_ptr + r.to(tl.int64) * C + scols, sv, mask=(scols < C) & (r >= 0))
        i += G
    _zero_unfilled_rows(dst_ptr, offs_ptr, counts_ptr, n_rows_ptr, R_out, n_groups, pid, G, ROW_WORDS, CHUNK)


@triton.jit
def _table_entry(n, T_max, t_lo, W, ROUND: tl.constexpr):
    """The dispatch table's entry (``[W * T_max]``, source-major) of the ``n``-th entry a launch takes: ``n`` itself,
    or (``ROUND``: the put path's rounds) the ``n``-th of the entries of a round's tokens ``t_lo, t_lo + 1, ...`` of
    every source, token-major (token ``t_lo + n // W``, source ``n % W``)."""
    i = n
    if ROUND:
        i = (n % W) * T_max + t_lo + n // W
    return i


@triton.jit
def pull_weighted_kernel(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, g_peers, w_peers,
                         table_ptr, epoch_ptr, T_max, W, copy_elems, w_copy, out_ptr, gw_peers, flags_peers, me,
                         H: tl.constexpr, CHUNK: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                         MX: tl.constexpr, MODE: tl.constexpr, INT_ROUND: tl.constexpr, ZCHUNK: tl.constexpr,
                         ROUTE_GRAD: tl.constexpr = False, ARRIVE: tl.constexpr = True, ticket_ptr=None,
                         flags_row_ptr=None, expect_row_ptr=None, err_ptr=None, timeout_ns=0,
                         WAIT: tl.constexpr = False, TOKEN_RANGE: tl.constexpr = False, t_lo=0, t_n=0):
    """Combine backward, expert side: every (source ``s``, token ``t``) of the dispatch's table has its BF16 gradient
    row ``g[t]`` read ONCE from the source's send copy (through the peer pointer; on the put path a local copy that
    puts delivered), and for each of its slots ``j`` here the product ``w[t, j] * g[t]`` (fp32; ``w`` read with the
    row) is quantized (MX: the block maxima taken as ``|w| * max|g|``, exactly as ``dispatch_kernel``'s ``WEIGHTED``
    mode) or rounded to BF16 and stored at the slot's expert-major row: the route weighting fused with the gradient
    quantization where the rows land. With ``ROUTE_GRAD`` the route-weight gradient is formed here too, where the
    expert rows are: ``grad_w[t, j] = <g[t], out[row_j]>`` (fp32), stored into source ``s``'s ``gw`` at ``[t, j]``;
    then (``ARRIVE``) every program adds 1 to ``flags[4, me]`` on every rank. Finally the padding rows of every group
    are zeroed (rows past ``n_rows`` are left as they are).

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
        WAIT (with ``ROUTE_GRAD`` and ``ARRIVE``): the last program to finish (the int32 ``ticket``, 0 between
            launches) then waits for every rank's route-weight gradients to this rank (:func:`wait_every_source` on
            this rank's ``flags[4]`` / ``expect[4]`` rows, ``per_call`` = the grid; ``err_ptr`` the int64 error word).
        TOKEN_RANGE (the put path's rounds): only the entries of the tokens ``[t_lo, t_lo + t_n)`` of every source,
            whose gradient row ``t`` is row ``t - t_lo`` at ``g_peers[s]`` (the round's rows); weights, table and
            ``gw`` by the token itself.
    Grid: any fixed number of programs (identical on every rank with ``ARRIVE``); persistent over entries.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    GW: tl.constexpr = 8 if K_POW2 < 8 else K_POW2  # route-grad lanes: >= the 8 values a thread holds of a chunk
    gk = tl.arange(0, GW)
    par = tl.load(epoch_ptr) % 2
    if TOKEN_RANGE:
        n_entries = W * t_n
    else:
        n_entries = W * T_max
    n = pid
    while n < n_entries:
        i = _table_entry(n, T_max, t_lo, W, TOKEN_RANGE)
        e = table_ptr + i.to(tl.int64) * K
        if _listed_slots(e, K) != 0:
            s = i // T_max
            t = (i % T_max).to(tl.int64)
            if TOKEN_RANGE:
                g_row = t - t_lo
            else:
                g_row = t
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
        n += G
    if ROUTE_GRAD and ARRIVE:
        _arrive_all(flags_peers, 4, me, W)
    WORDS: tl.constexpr = H // 8 if MX else H // 4
    _zero_unfilled_rows(dst_ptr.to(tl.pointer_type(tl.int64), bitcast=True), offs_ptr, counts_ptr, n_rows_ptr, R_out,
                        n_groups, pid, G, WORDS, ZCHUNK)
    if WAIT:
        if last_to_arrive(ticket_ptr, G):
            wait_every_source(flags_row_ptr, expect_row_ptr, G, W, err_ptr, timeout_ns)


@triton.jit
def gather_route_grad_kernel(gw_ptr, dest_rank_ptr, out_ptr, n, rank_stride, BLOCK: tl.constexpr):
    """The route-weight gradient at the origin: ``out[t, j] = gw[dest_rank[t, j], t, j]`` (the value the slot's
    expert rank formed and wrote into row ``dest_rank`` of this rank's ``comb_gw``), 0 for a dropped slot.

    Args: gw_ptr fp32 ``[W, T_max, k]`` (``rank_stride = T_max * k``); dest_rank_ptr int32 ``[T, k]``; out_ptr fp32
    ``[T, k]``; n = ``T * k``. Grid: ``(cdiv(n, BLOCK),)``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    d = tl.load(dest_rank_ptr + i, mask=m, other=-1)
    v = tl.load(gw_ptr + tl.maximum(d, 0).to(tl.int64) * rank_stride + i, mask=m & (d >= 0), other=0.0)
    tl.store(out_ptr + i, v, mask=m)


@triton.jit
def first_refusal_kernel(words_ptr, W, out_ptr, W_POW2: tl.constexpr):
    """``out = 1 + the lowest rank whose refusal word is non-zero`` (0: none): the refusals of a dispatch's counts
    exchange, read at the call's host sync. Grid: (1,)."""
    r = tl.arange(0, W_POW2)
    w = tl.load(words_ptr + r, mask=r < W, other=0)
    first = tl.min(tl.where(w != 0, r, W_POW2), axis=0)
    tl.store(out_ptr, tl.where(first < W, first + 1, 0).to(tl.int64))


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
def _row_values(src_ptr, src_s_ptr, r, ok, c0, offs, cols, m, cm, H: tl.constexpr, NB: tl.constexpr,
                PASS: tl.constexpr, INT_ROUND: tl.constexpr):
    """fp32 ``[CHUNK]`` values of row ``r`` (columns ``c0 + offs``) of an expert-side ``[R, H]`` tensor: bf16, or
    (``PASS``) E4M3 payload with ROW scales at ``src_s_ptr`` decoded and saturated to bf16's range; 0 where ``ok``
    is false (a masked load)."""
    r64 = tl.maximum(r, 0).to(tl.int64)
    if PASS:
        q = tl.load(src_ptr + r64 * H + c0 + offs, mask=m & ok, other=0)
        sb = tl.load(src_s_ptr + r64 * (H // 32) + cols, mask=cm & ok, other=127)
        v = tl.reshape(mx_decode_tile(tl.reshape(q, (NB, 32)), sb, INT_ROUND, BF16_MAX), (NB * 32,))
    else:
        v = to_fp32(tl.load(src_ptr + r64 * H + c0 + offs, mask=m & ok, other=0.0), INT_ROUND)
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
def combine_partials_kernel(out_ptr, out_s_ptr, table_ptr, origin_pos_ptr, w_ptr, q_peers, s_peers, flags_peers,
                            me, W, T_max, epoch_ptr, nslot, err_ptr,
                            H: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr,
                            MX: tl.constexpr, PASS: tl.constexpr, WEIGHTED: tl.constexpr, MODE: tl.constexpr,
                            INT_ROUND: tl.constexpr, STAGED: tl.constexpr = False, ROWS: tl.constexpr = 2,
                            ticket_ptr=None, flags_row_ptr=None, expect_row_ptr=None, timeout_ns=0,
                            WAIT: tl.constexpr = False, t_lo=0, t_n=0):
    """Combine / dispatch backward, expert side: ONE row per (source, token). For every (source ``s``, token ``t``)
    this rank received (an entry of the dispatch's table), the partial sum of the token's rows here
    ``P = sum_j w[t, j] * out[row_j]`` in fp32, ``j`` ascending (each product rounded, then added: launch with
    ``enable_fp_fusion=False``), rounded once for transport (MX: quantized, payload + row scales; else BF16) and stored
    into the origin's combine buffer at the send position of the token's leading slot (its first slot on this rank);
    then every program adds 1 to ``flags[2, me]`` on every rank. A call that starts with the error word set (a wait
    of this call, such as the weights' exchange, or of an earlier one timed out) sends nothing and raises no flag: its
    weights may not have arrived, and the origins' bounded waits then fail instead of summing partials formed with
    other weights.

    Args:
        out_ptr: the expert rows ``[R, H]``: bf16, or (``PASS``) uint8 E4M3 payload with ``out_s_ptr`` uint8 ``[R,
            H/32]`` ROW scales (decoded, saturated to bf16's range, before the sum).
        table_ptr: int32 ``[W * T_max, K]``: entry ``s * T_max + t`` = the rows here of source ``s``'s token ``t``
            per slot, -1 for slots elsewhere (every row -1: not received).
        origin_pos_ptr: int32 ``[R]`` send position of each row's slot at its origin.
        w_ptr: fp32 ``[W * T_max, K]`` route weights by table entry (``WEIGHTED``; else every weight is 1: dispatch
            backward): the weights that came with the dispatch (the handle's), or ``comb_w`` after their exchange.
        err_ptr: int64 error word of this rank's waits (read once, at the start).
        q_peers / s_peers / flags_peers: int64 ``[W]`` base pointers of ``comb_q`` / ``comb_s`` / ``flags`` per rank.
        epoch_ptr: int64 combine epoch (its parity picks the copy), nslot: ``T_max * K`` slots per copy.
        STAGED (put path, one round): every ``*_peers`` entry is this rank's staging buffer; only the entries of the
            tokens ``[t_lo, t_lo + t_n)`` of every source are formed, the partial of source ``s``'s token ``t`` at
            row ``(t - t_lo) * W + s`` there (one put per entry moves it to the origin's slot,
            :func:`mxcomm.ep.put_path.partial_rows`), and no flag is raised.
        ROWS: rows loaded together per step of a chunk's sum, taken from the entry's listed slots in ascending order
            (a slot elsewhere adds nothing, so only listed rows are loaded: the registers of the loads in flight hold
            rows that exist, and more programs fit on an SM than with one load per slot of ``K``).
        WAIT (not STAGED): the last program to finish (the int32 ``ticket``, 0 between launches) then waits for every
            rank's partials to this rank (:func:`wait_every_source` on this rank's ``flags[2]`` / ``expect[2]`` rows,
            ``per_call`` = the grid): the origin's reduce follows with no wait kernel between.

    Destination layout (what the origin's :func:`combine_reduce_kernel` reads): slot ``pos`` of the copy starting at
    slot ``slot0``: MX payload at byte ``slot0 * 2H + pos * H``, scales at byte ``(slot0 + pos) * H/32``; BF16 at
    element ``(slot0 + pos) * H``.
    Grid: any fixed number of programs (identical on every rank: receivers count arrivals); persistent over entries.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NB: tl.constexpr = CHUNK // 32
    C: tl.constexpr = H // 32
    offs = tl.arange(0, CHUNK)
    bcols = tl.arange(0, NB)
    slot0 = (tl.load(epoch_ptr) % 2) * nslot
    if STAGED:
        slot0 = slot0 * 0
    failed = tl.load(err_ptr, volatile=True) != 0
    if STAGED:
        n_entries = tl.where(failed, 0, W * t_n)
    else:
        n_entries = tl.where(failed, 0, W * T_max)
    n = pid
    while n < n_entries:
        i = _table_entry(n, T_max, t_lo, W, STAGED)
        e = table_ptr + i.to(tl.int64) * K
        listed = _listed_slots(e, K)
        if listed != 0:
            lead = tl.load(e + _nth_slot(listed, 0, K))
            n_listed = _bit_count(listed, K)
            s = i // T_max
            if STAGED:
                pos = n.to(tl.int64)
            else:
                pos = tl.load(origin_pos_ptr + lead).to(tl.int64)
            if MX:  # MX rows are H bytes apart from the start of a copy (2H bytes a slot)
                qbase = tl.load(q_peers + s).to(tl.pointer_type(tl.uint8)) + slot0 * H
            else:
                qbase = tl.load(q_peers + s).to(tl.pointer_type(tl.bfloat16))
            sbase = tl.load(s_peers + s).to(tl.pointer_type(tl.uint8))
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
        n += G
    if not STAGED:
        if not failed:
            _arrive_all(flags_peers, 2, me, W)
    if WAIT:
        if last_to_arrive(ticket_ptr, G):
            wait_every_source(flags_row_ptr, expect_row_ptr, G, W, err_ptr, timeout_ns)


@triton.jit
def combine_reduce_kernel(comb_q_ptr, comb_s_ptr, send_pos_ptr, dest_rank_ptr, w_ptr, y_ptr, T, epoch_ptr, nslot,
                          dest_row_ptr, own_ptr, own_s_ptr,
                          H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr,
                          MX: tl.constexpr, INT_ROUND: tl.constexpr, OWN: tl.constexpr = False,
                          OWN_PASS: tl.constexpr = False, WEIGHTED: tl.constexpr = True, MODE: tl.constexpr = 0):
    """Combine / dispatch backward at the origin: ``y[t] = sum_i P_i`` in fp32, bf16 out, over the partials ``P_i``
    the token's ranks returned (one row per (token, rank), see :func:`combine_partials_kernel`), in the order of the
    ranks' first appearance among the token's slots (a token without a valid slot gives 0).

    The partial of the rank of slot ``j`` when ``j`` leads it (no earlier slot of the token goes to that rank): the row
    at ``send_pos[t, j]`` in this rank's ``comb_q`` (MX: decoded, saturated to bf16's range). With ``OWN`` (one rank,
    nothing travelled) the single partial is formed here exactly as the expert side would: ``P = sum_j w[t, j] *
    out[dest_row[t, j]]`` (fp32, ``j`` ascending, no FMA: launch with ``enable_fp_fusion=False``; ``WEIGHTED`` False:
    every weight 1), then rounded for transport in registers (MX: quantize + decode, :func:`mx_qdq_tile`; else the
    BF16 store rounds it).

    Args:
        comb_q_ptr / comb_s_ptr: this rank's ``comb_q`` (uint8; BF16 transport: viewed as bf16) / ``comb_s``; the copy
            is picked by the epoch's parity (``epoch_ptr``, ``nslot = T_max*K`` slots a copy). Unused with ``OWN``.
        send_pos_ptr / dest_rank_ptr: int32 ``[T, K]`` (the plan's; -1 = dropped); w_ptr: fp32 ``[T, K]``
            (``OWN`` with ``WEIGHTED`` only); y_ptr: bf16 ``[T, H]``.
        dest_row_ptr, own_ptr, own_s_ptr (``OWN``): the plan's rows, the expert rows ``[R, H]`` (bf16, or uint8 E4M3
            payload with ``OWN_PASS`` and their uint8 ``[R, H/32]`` row scales).
        P: the most partials a token can have, ``min(K, W)`` (``OWN``: ``K``, the slots summed in place). A static
            loop over them (not over the ``K`` slots) keeps the registers of the rows in flight to rows that exist.
        MX: the partials travel (or, with ``OWN``, are rounded) as MXFP8; MODE: the scale mode.
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
                for n in tl.static_range(P):
                    if OWN:  # slot n
                        ok = tl.load(dest_rank_ptr + t * K + n) >= 0
                        r = tl.load(dest_row_ptr + t * K + n)
                        v = _row_values(own_ptr, own_s_ptr, r, ok, c0, offs, cols, m, cm, H, NB, OWN_PASS, INT_ROUND)
                        if WEIGHTED:
                            v = tl.load(w_ptr + t * K + n, mask=ok, other=0.0) * v
                    else:  # partial n: the n-th leading slot j (-1: the token has fewer partials, adds +0)
                        j = _nth_slot(lead, n, K)
                        ok = j >= 0
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
                if OWN:  # the transport rounding of the one partial in registers, then the origin's sum (0 + P: -0 -> +0)
                    if MX:
                        acc = tl.reshape(mx_qdq_tile(tl.reshape(acc, (NB, 32)), MODE, INT_ROUND, 1, BF16_MAX), (CHUNK,))
                    elif INT_ROUND:
                        acc = to_fp32(bf16_rne_int(_bf16_saturated(acc)), INT_ROUND)
                    else:
                        acc = _bf16_saturated(acc).to(tl.bfloat16).to(tl.float32)
                    fin = tl.abs(acc) <= FP32_MAX
                    acc = tl.zeros((CHUNK,), tl.float32) + acc
                # a sum of finite partials saturates at the BF16 range; an Inf or NaN partial passes through
                acc = tl.where(fin, mx_saturate(acc, BF16_MAX), acc)
                if INT_ROUND:
                    tl.store(y_ptr + t.to(tl.int64) * H + c0 + offs, bf16_rne_int(acc), mask=m)
                else:
                    tl.store(y_ptr + t.to(tl.int64) * H + c0 + offs, acc.to(tl.bfloat16), mask=m)
        t += G


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
                tl.store(dst_ptr + r.to(tl.int64) * ROW_WORDS + c0 + offs, zero, mask=(c0 + offs) < ROW_WORDS)
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
