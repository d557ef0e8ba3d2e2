"""The pull dispatch (towards the experts): each token row is packed once into its rank's send copy, and each rank it
goes to reads it once from there, as listed in that rank's pull list; and the pull list, which every multi-rank path
writes (its entries carry the token's rows and route weights and become the dispatch's table).

* sender: ``pull_head_kernel`` (the pull dispatch's id check, counts, counts publish and pack in one launch) and
  ``scan_and_wait_kernel`` (its slot table, and the wait for every rank's counts), ``pack_rows_kernel`` (each token
  row once into the send copy), ``plan_entries_kernel`` (the routing plan and the pull-list entries in one launch,
  with the wait for every source's) and ``push_entries_kernel`` (one pull-list entry per (token, destination rank);
  the push and put paths), both through ``list_entries``;
* receiver: ``pull_rows_kernel`` (each listed row read once, fanned out to its expert rows; the entries kept as the
  dispatch's table) and ``entries_table_kernel`` (the dispatch's table from the pull list: the push and put paths),
  both through ``_entry_ok`` / ``_keep_entry``.

Buffer copies. The dispatch direction needs no second receive buffer: every dispatch starts with the counts
exchange (combine backward with the "ready" handshake), and nobody writes before seeing all counts. The send copies
``send_q`` / ``send_w`` have two copies (by epoch parity) for the same reason as combine's ``comb_q``
(:mod:`.combine`): a rank packs its rows before it has every peer's counts, while a peer may still be reading the
previous call's rows; the copy it writes was last read two dispatch-direction epochs ago, and every peer finished
that read before it published the counts of the epoch in between. The pull list is tagged with the 64-bit epoch, so
entries of earlier calls are skipped without clearing.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ....transport.flags import deadline_after, last_to_arrive, wait_flag_geq
from ..plan_kernels import check_hist_block, counts_tile, place_slots, scan_keys, slot_tables, table_or_origin_job
from .layout import _zero_unfilled_rows
from .pack import pack_row
from .signals import _arrive, publish_to, wait_every_source


@triton.jit
def pack_rows_kernel(x_slot, T, send_q_ptr, send_s_ptr, epoch_ptr, T_max, copy_elems,
                     H: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr,
                     INT_ROUND: tl.constexpr):
    """Pull path, sender: every token row read once and (MX) quantized once into this rank's send copy
    ``par = epoch % 2``, row ``t`` (:func:`pack_row`); the receivers read the rows they need from there. (With the
    Triton plan the pull dispatch packs in :func:`pull_head_kernel`, combine backward in :func:`pack_ready_kernel`.)

    Args:
        x_slot: int64 ``[1]``, the address of the bf16 rows ``[T, H]`` (contiguous, 16-byte aligned): read by the
            kernel, so that a CUDA graph captured once replays with each call's ``x``.
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
    x_ptr = tl.load(x_slot).to(tl.pointer_type(tl.bfloat16))
    t = pid
    while t < T:
        pack_row(x_ptr, t, send_q_ptr, send_s_ptr, row0 + t, copy0, H, CHUNK, MX, MODE, INT_ROUND, True)
        t += G


@triton.jit
def pull_head_kernel(idx_ptr, ids_ptr, hist_ptr, input_err_ptr, T, E, totals_ptr, counts_ptr, ticket_ptr,
                     counts_peers, flags_peers, row, W, me, epoch_ptr, x_slot, send_q_ptr, send_s_ptr, T_max,
                     copy_elems, K: tl.constexpr, K_POW2: tl.constexpr, TOK: tl.constexpr, KEYS: tl.constexpr,
                     PUB_BLOCK: tl.constexpr, H: tl.constexpr, CHUNK: tl.constexpr, MX: tl.constexpr,
                     MODE: tl.constexpr, INT_ROUND: tl.constexpr):
    """Pull path, sender: the dispatch's steps up to the counts' publish, and the pack, in one launch, no program
    waiting for another.

    1. Every program checks and counts blocks ``pid, pid + G, ...`` of ``TOK`` tokens
       (:func:`~mxcomm.ep.nvshmem.plan_kernels.check_hist_block`: the checked int32 ids into ``ids`` ``[T, K]``, bad ids
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
    the plan's prefix table (:func:`~mxcomm.ep.nvshmem.plan_kernels.scan_keys`, one program per ``BLOCK_K`` keys; the
    totals, the head's ``counts[:E]`` again, into ``counts``), then the last program (the int32 ``ticket``, 0 between
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
    """Pull path: :func:`~mxcomm.ep.nvshmem.plan_kernels.plan_kernel`'s jobs (same arguments first, same outputs) and
    the pull-list entries in one launch. Each slot program, as soon as it has placed a block of ``S`` slots (``S // K``
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
    _pull_rows(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, q_peers, s_peers, list_ptr,
               table_ptr, wtab_ptr, epoch_ptr, T_max, W, copy_words, ROW_WORDS, CHUNK, C, C_POW2, K, K_POW2, EW, MX)


@triton.jit
def pull_rows_at_kernel(addr_ptr, out_slot, table_slot, srows_slot, rows_slot, offs_ptr, counts_ptr, n_rows_ptr,
                        n_groups, q_peers, s_peers, list_ptr, epoch_ptr, T_max, W, copy_words,
                        ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                        C: tl.constexpr, C_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, EW: tl.constexpr,
                        MX: tl.constexpr):
    """``pull_rows_kernel`` inside a captured call (:mod:`.call_io`), its tensors at the addresses in the int64 table
    ``addr``: the fresh output at ``addr[out_slot]`` (``[R_out, ROW_WORDS]`` int64 words, ``R_out = addr[rows_slot]``
    rows: the output's capacity), the dispatch's table and its weights at ``addr[table_slot]`` (int32 ``[2, W * T_max,
    K]``: the table, then the weights' fp32 bits) and (MX) the row-major scale rows at ``addr[srows_slot]`` (uint8
    ``[R_out, C]``). When the plan's ``n_rows`` exceeds ``R_out`` nothing at all is written (the caller gathers the
    rows into an output of their size after its host sync). The rest as ``pull_rows_kernel``."""
    R_out = tl.load(addr_ptr + rows_slot)
    if tl.load(n_rows_ptr) <= R_out:
        dst_ptr = tl.load(addr_ptr + out_slot).to(tl.pointer_type(tl.int64))
        # (a fresh tensor, 16-byte aligned: an address read from memory carries no alignment without the hint)
        dst_s_ptr = tl.multiple_of(tl.load(addr_ptr + srows_slot).to(tl.pointer_type(tl.uint8)), 16)
        table_ptr = tl.load(addr_ptr + table_slot).to(tl.pointer_type(tl.int32))
        wtab_ptr = table_ptr + W * T_max * K
        _pull_rows(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, q_peers, s_peers, list_ptr,
                   table_ptr, wtab_ptr, epoch_ptr, T_max, W, copy_words, ROW_WORDS, CHUNK, C, C_POW2, K, K_POW2, EW,
                   MX)


@triton.jit
def _pull_rows(dst_ptr, dst_s_ptr, offs_ptr, counts_ptr, n_rows_ptr, n_groups, R_out, q_peers, s_peers,
               list_ptr, table_ptr, wtab_ptr, epoch_ptr, T_max, W, copy_words,
               ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr,
               C: tl.constexpr, C_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, EW: tl.constexpr,
               MX: tl.constexpr):
    """The body of ``pull_rows_kernel`` (its arguments; ``dst_ptr`` an int64 pointer, ``table_ptr`` / ``wtab_ptr``
    int32 pointers)."""
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
                # 16 bytes a store (the output's rows are 16-byte aligned; its address may come from a table)
                d = tl.max_contiguous(tl.multiple_of(dst_ptr + r.to(tl.int64) * ROW_WORDS + c0 + offs, 16), 16)
                tl.store(d, v, mask=m & (r >= 0))
        if MX:
            sb = tl.load(s_peers + s, mask=ok, other=0).to(tl.pointer_type(tl.uint8)) + srow * C
            sv = tl.load(sb + scols, mask=(scols < C) & ok, other=0)
            for j in tl.static_range(K):
                r = tl.load(e + 2 + j, mask=ok, other=-1)
                tl.store(dst_s_ptr + r.to(tl.int64) * C + scols, sv, mask=(scols < C) & (r >= 0))
        i += G
    _zero_unfilled_rows(dst_ptr, offs_ptr, counts_ptr, n_rows_ptr, R_out, n_groups, pid, G, ROW_WORDS, CHUNK)
