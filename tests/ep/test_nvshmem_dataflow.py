"""The nvshmem backend's plan helpers (CPU) and its kernels' data path under the Triton interpreter.

The interpreter tests run the real dispatch/combine kernels of the nvshmem backend in one process (world of 1,
loopback, through ``NvshmemBackend``; or kernels launched directly, several ranks simulated by pointer tables) over
plain CPU tensors standing in for the symmetric heap: peer pointers are the tensors' addresses, flags and bounded waits
run as on the GPU. Combine-direction results are checked against the plain-torch spec (``combine_spec``); the
combine direction across simulated ranks is in test_nvshmem_combine_ranks.py, the put path across ranks in
test_put_path_ranks.py; real-NVSHMEM runs are GPU tests (tests/ep/test_nvshmem_gpu.py).
"""

import contextlib
import dataclasses

import pytest
import torch
import triton

from heap_fakes import FakeBuf, FakeCtx
from rank_inputs import in_group_tile_rows
from mxcomm.ep import EPConfig, EPGroup
from mxcomm.ep.handle import with_weights
from mxcomm.ep.nvshmem.launch_config import LaunchConfig, _qdq_chunk
from mxcomm.ep.nvshmem.backend import row_origins
from mxcomm.ep.reference.oracle import oracle_dispatch
from mxcomm.ep.plan import FLAG_ROWS, build_plan, local_counts
from mxcomm.mx import round_up


def _routing(W, T, E, k, g, drop=0.1):
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    if T:
        idx[torch.rand(T, k, generator=g) < drop] = -1
    return idx


@pytest.mark.parametrize("W,E,k,align", [(1, 8, 2, 32), (2, 8, 3, 32), (4, 16, 4, 128), (4, 4, 4, 32)])
def test_row_origins_invert_the_send_side(W, E, k, align):
    g = torch.Generator().manual_seed(W * 100 + E)
    Ts = [int(torch.randint(0, 40, (1,), generator=g)) for _ in range(W)]
    Ts[0] = 0 if W > 1 else Ts[0]  # a rank with zero tokens
    idxs = [_routing(W, T, E, k, g) for T in Ts]
    counts = torch.stack([local_counts(i, E) for i in idxs])
    plans = [build_plan(counts, idxs[r], r, align) for r in range(W)]
    for r in range(W):
        R = int(plans[r].num_rows)
        o = row_origins(plans[r], R)
        seen = 0
        for row in range(R):
            s, p = int(o.src[row]), int(o.pos[row])
            if s < 0:
                continue
            seen += 1
            ps = plans[s]
            slot = int((ps.send_pos.reshape(-1) == p).nonzero()[0])
            assert int(ps.dest_rank.reshape(-1)[slot]) == r
            assert int(ps.dest_row.reshape(-1)[slot]) == row
        assert seen == int(plans[r].num_recv)



class LoopbackHeap:
    """World-of-1 stand-in for SymmetricHeap: CPU tensors, peer pointer = own address."""

    def __init__(self):
        self.ctx = FakeCtx(torch.device("cpu"))
        self.bufs = {}

    def alloc(self, name, shape, dtype):
        t = torch.zeros(shape, dtype=dtype)
        self.bufs[name] = FakeBuf(t, torch.tensor([t.data_ptr()], dtype=torch.int64))
        return self.bufs[name]

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self.bufs.values())


class LoopbackPuts:
    """In-process stand-in for ``mxcomm.ep.nvshmem.put_path.Puts`` (the CUDA put-with-signal kernels) seen from rank 0:
    a put to PE 0 copies each entry's bytes after the same range check as ``mx_put_signal`` and adds
    ``entries * chunks`` to the signal word; entries for other PEs (``world > 1``: ranks that never run) are
    range-checked and dropped. A wait records a timeout error word for a word still short (nothing runs
    concurrently here, so a short word would never fill)."""

    def __init__(self, world: int = 1):
        self.world = world
        self.calls = {"put": 0, "plain": 0, "wait": 0, "quiet": 0}

    def put(self, dst, src, batch, signals, signal_index, err, chunks):
        from mxcomm.transport.errors import error_word
        from mxcomm.transport.put_signal import BAD_ENTRY_CODE

        self.calls["put" if signals is not None else "plain"] += 1
        d, s_ = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for i in range(batch.n):
            pe, n = int(batch.pes[i]), int(batch.nbytes[i])
            do, so = int(batch.dst_offsets[i]), int(batch.src_offsets[i])
            if not 0 <= pe < self.world or min(n, do, so) < 0 or do + n > d.numel() or so + n > s_.numel():
                err[0] = max(int(err[0]), error_word(BAD_ENTRY_CODE, max(pe, 0)))
                continue
            if pe == 0:
                d[do:do + n] = s_[so:so + n].clone()
        if signals is not None:  # (None: plain puts, completed by the caller's quiet)
            signals[signal_index] += int((batch.pes == 0).sum()) * chunks

    def wait(self, signals, indices, epoch, per_epoch, err, timeout_ns):
        from mxcomm.transport.errors import TIMEOUT_CODE, error_word

        self.calls["wait"] += 1
        if int(err[0]):  # an earlier wait failed: the kernel gives up without recording
            return
        for i in indices.tolist():
            if int(signals[i]) < int(epoch.reshape(-1)[0]) * per_epoch:
                err[0] = max(int(err[0]), error_word(TIMEOUT_CODE, i))

    def quiet(self):
        self.calls["quiet"] += 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("W,E,k,mx", [(2, 8, 3, True), (3, 6, 4, True), (2, 4, 2, False), (3, 9, 3, False)])
def test_pull_list_reads_each_token_once_per_rank(W, E, k, mx):
    """The pull dispatch's entry exchange and gather, ranks simulated in one process (pointer tables to each
    rank's tensors): every sender writes one entry per (token, receiving rank) listing that token's rows there;
    each receiver's gather puts the sender's send-copy row (and scale row) at exactly those rows, zeroes the padding
    rows inside its groups, leaves the rows past ``n_rows`` (the worst-case tail of the no-sync mode) as they were,
    keeps each entry's rows as the dispatch's table (all -1 for a (source, token) not received) and the token's route
    weights the entry carries as the table's weights (0 for one not received), and ignores entries of an older epoch
    (pre-filled garbage with an old tag, some with the same low 32 bits as this epoch).
    Ranks with zero tokens, dropped slots, tokens with several experts on one rank; the odd epoch reads copy 1.
    ``pull_rows_at_kernel`` (the output and the table at a table's addresses) writes the same bytes."""
    from mxcomm.ep.nvshmem.kernels import pull_rows_at_kernel, pull_rows_kernel, push_entries_kernel
    from mxcomm.ep.plan import FLAG_ROWS, pull_entry_words

    g = torch.Generator().manual_seed(W * 10 + E + k)
    H, T_max, align, epoch = 64, 7, 4, 5
    C, B = H // 32, 1 if mx else 2
    Ts = [0] + [T_max - r for r in range(1, W)]  # rank 0 sends nothing; rank 1 a full buffer
    idxs = [_routing(W, T, E, k, g, drop=0.2) for T in Ts]
    counts = torch.stack([local_counts(i, E) for i in idxs])
    plans = [build_plan(counts, idxs[r], r, align) for r in range(W)]
    EW = pull_entry_words(k)
    send_q = [torch.randint(0, 256, (2, T_max, 2 * H), dtype=torch.uint8, generator=g) for _ in range(W)]
    copy_bytes = T_max * 2 * H  # copy 1 starts here; MX rows are H bytes apart from a copy's start
    send_s = [torch.randint(0, 256, (2, T_max, C), dtype=torch.uint8, generator=g) for _ in range(W)]
    ws = [torch.randn(T, k, generator=g) for T in Ts]  # the route weights each sender's entries carry
    lists = [torch.randint(-1, 50, (W, T_max, EW), dtype=torch.int32, generator=g) for _ in range(W)]
    for lst in lists:  # entries of earlier dispatches, garbage rows: must be skipped
        lst[:, :, 0], lst[:, :, 1] = epoch - 2, 0
        lst[:, 1::2, 0], lst[:, 1::2, 1] = epoch, 1  # written 2**32 calls ago: the same low word
    flags = [torch.zeros(len(FLAG_ROWS), W, dtype=torch.int64) for _ in range(W)]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ep = torch.tensor([epoch], dtype=torch.int64)
    for s in range(W):
        push_entries_kernel[(2, W)](plans[s].dest_rank, plans[s].dest_row, ws[s], Ts[s], ptrs(lists), ptrs(flags), ep,
                                  s, W, T_max, K=k, EW=EW, BLOCK=4)
    for d in range(W):
        assert flags[d][1].tolist() == [2] * W  # every sender's programs arrived
        p = plans[d]
        n_rows = int(p.num_rows)
        R = n_rows + 5  # worst-case-sized output: rows past n_rows are not written
        out = torch.randint(0, 256, (R, H * B), dtype=torch.uint8, generator=g)  # garbage everywhere
        recv_s = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
        out0, recv_s0 = out.clone(), recv_s.clone()
        table = torch.full((W * T_max, k), 77, dtype=torch.int32)
        wtab = torch.full((W * T_max, k), float("nan"))
        words = H * B // 8
        pull_rows_kernel[(3,)](out.view(torch.int64), recv_s, p.offs, p.expert_counts, p.num_rows, E // W, R,
                               ptrs(send_q), ptrs(send_s), lists[d], table, wtab.view(torch.int32), ep, T_max, W,
                               copy_bytes // 8,
                               ROW_WORDS=words, CHUNK=triton.next_power_of_2(words), C=C,
                               C_POW2=triton.next_power_of_2(C), K=k, K_POW2=triton.next_power_of_2(k), EW=EW, MX=mx)
        # the same inside a captured call: the output, the table (with its weights, one allocation) and the scale
        # rows at the addresses of an int64 table, the output's rows a value there; the same bytes everywhere. With
        # fewer rows than the plan's n_rows (the output a call guessed too small), nothing at all is written.
        for cap in (R, n_rows - 1):
            out_at, recv_s_at = out0.clone(), recv_s0.clone()
            pair = torch.full((2, W * T_max, k), 77, dtype=torch.int32)
            pair0 = pair.clone()
            addr = torch.tensor([0, 0, 0, out_at.data_ptr(), 0, 0, pair.data_ptr(), recv_s_at.data_ptr(), cap],
                                dtype=torch.int64)
            pull_rows_at_kernel[(2,)](addr, 3, 6, 7, 8, p.offs, p.expert_counts, p.num_rows, E // W,
                                      ptrs(send_q), ptrs(send_s), lists[d], ep, T_max, W, copy_bytes // 8,
                                      ROW_WORDS=words, CHUNK=triton.next_power_of_2(words), C=C,
                                      C_POW2=triton.next_power_of_2(C), K=k, K_POW2=triton.next_power_of_2(k), EW=EW,
                                      MX=mx)
            if cap >= n_rows:
                assert torch.equal(out_at, out) and torch.equal(recv_s_at, recv_s)
                assert torch.equal(pair[0], table) and torch.equal(pair[1], wtab.view(torch.int32))
            else:
                assert torch.equal(out_at, out0) and torch.equal(recv_s_at, recv_s0) and torch.equal(pair, pair0)
        want = torch.zeros(R, H * B, dtype=torch.uint8)
        want[n_rows:] = out0[n_rows:]  # the tail is left as it was
        want_table = torch.full((W * T_max, k), -1, dtype=torch.int32)
        want_w = torch.zeros(W * T_max, k)
        real = torch.zeros(R, dtype=torch.bool)
        for s in range(W):  # row dest_row[t, j] of every slot going to d holds token t of source s (copy 1)
            for t in range(Ts[s]):
                if (plans[s].dest_rank[t] == d).any():
                    want_w[s * T_max + t] = ws[s][t]
                for j in range(k):
                    if int(plans[s].dest_rank[t, j]) == d:
                        r = int(plans[s].dest_row[t, j])
                        want[r] = send_q[s].view(-1)[copy_bytes + t * H * B: copy_bytes + (t + 1) * H * B]
                        want_table[s * T_max + t, j] = r
                        real[r] = True
                        if mx:
                            assert torch.equal(recv_s[r], send_s[s][1, t])
        assert int(real.sum()) == int(p.num_recv)
        assert torch.equal(out, want)
        assert torch.equal(table, want_table)
        assert torch.equal(wtab, want_w)
        if mx:  # scale rows are written at the real rows only (the swizzle zeroes padding from the group counts)
            assert torch.equal(recv_s[~real], recv_s0[~real])
        # one entry per (source, token) received here, however many of d's experts the token picked
        for s in range(W):
            fresh = (lists[d][s, :, 0] == epoch) & (lists[d][s, :, 1] == 0)
            goes = (plans[s].dest_rank == d).any(dim=1) if Ts[s] else torch.zeros(0, dtype=torch.bool)
            assert fresh[: Ts[s]].tolist() == goes.tolist() and not fresh[Ts[s]:].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("T,absent", [(37, None), (5, 2), (0, None), (16, 0)])
def test_plan_entries_is_the_plan_and_the_entries_in_one_launch(T, absent):
    """``plan_entries_kernel`` (the pull path's plan launch) writes the same plan as ``plan_kernel`` (tables, status
    words, slots, row origins) and the same pull-list entries on every rank as ``push_entries_kernel`` (rows, route
    weights, tag); then its last program raises ``flags[1, me]`` by exactly one on every rank (one arrival per
    source and call, whatever the token count: none too) and waits for every source's: ``expect`` advances by one
    per source, and a source that never arrived is named in the error word; its ticket is back at 0. Three ranks
    simulated in one process (pointer tables), rank 1 under test, the other sources' arrivals set by hand."""
    from mxcomm.ep.nvshmem.kernels import plan_entries_kernel, push_entries_kernel
    from mxcomm.ep.plan import pull_entry_words
    from mxcomm.ep.nvshmem.plan_kernels import PlanJobs, check_and_count, triton_plan
    from mxcomm.transport.errors import TIMEOUT_CODE, error_word

    W, me, E, k, T_max, align, epoch = 3, 1, 12, 3, 40, 4, 6
    g = torch.Generator().manual_seed(T + 11)
    Ts = [13, T, 21]
    idxs = [_routing(W, t, E, k, g, drop=0.2) for t in Ts]
    counts = torch.stack([local_counts(i, E) for i in idxs]).to(torch.int32)
    w = torch.randn(T_max, k, generator=g)
    EW = pull_entry_words(k)
    R = 3 * T_max * k
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731

    def run(fused):
        pre = check_and_count(idxs[me], E, torch.zeros(1, dtype=torch.int64), check=False).slot_prefix
        status = torch.zeros(4, dtype=torch.int64)
        refusals = torch.tensor([0, 0, 5], dtype=torch.int32)
        lists = [torch.full((W, T_max, EW), -7, dtype=torch.int32) for _ in range(W)]
        flags = [torch.full((len(FLAG_ROWS), W), 4, dtype=torch.int64) for _ in range(W)]  # 4 earlier calls
        for s in range(W):  # the other sources' arrivals of this call on rank me, but the absent one's
            if s not in (me, absent):
                flags[me][1, s] = 5
        expect = torch.full((W,), 4, dtype=torch.int64)
        err, ticket, ep = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), torch.tensor([epoch])
        jobs = PlanJobs(kernel=plan_entries_kernel, extra=dict(
            w_ptr=w, list_peers=ptrs(lists), flags_peers=ptrs(flags), epoch_ptr=ep, T_max=T_max, ticket_ptr=ticket,
            flags_row_ptr=flags[me][1], expect_row_ptr=expect, err_ptr=err, timeout_ns=30_000_000, K=k, EW=EW))
        out = triton_plan(counts, idxs[me], me, align, R, prefix=pre, status=status, refusals=refusals,
                          jobs=jobs if fused else None)
        if not fused:
            p = out["plan"]
            push_entries_kernel[(2, W)](p.dest_rank, p.dest_row, w, T, ptrs(lists), ptrs(flags), ep, me, W, T_max,
                                        K=k, EW=EW, BLOCK=4)
        return out, status, lists, flags, expect, err, ticket

    want, got = run(False), run(True)
    for name in ("counts", "dest_rank", "dest_row", "send_pos", "send_order", "offs", "expert_counts", "num_rows",
                 "src_row_start", "src_send_pos", "recv_splits", "send_splits"):
        assert torch.equal(getattr(got[0]["plan"], name), getattr(want[0]["plan"], name)), name
    assert torch.equal(got[0]["origin_src"], want[0]["origin_src"]) and torch.equal(got[0]["origin_pos"],
                                                                                      want[0]["origin_pos"])
    assert torch.equal(got[1], want[1]) and int(got[1][3]) == 3  # status words: rows, the lowest refusing rank
    for d in range(W):
        assert torch.equal(got[2][d], want[2][d]), ("entries on", d)
        assert int(got[3][d][1, me]) == 5  # one arrival from me (push_entries_kernel: one per program)
    assert int(got[6]) == 0
    assert got[4].tolist() == [5] * W
    assert int(got[5]) == (0 if absent is None else error_word(TIMEOUT_CODE, absent))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("T,G,epoch,mx,absent", [(0, 1, 4, True, None), (5, 3, 4, True, None),
                                                 (37, 2, 7, True, None), (37, 64, 2, False, 2), (48, 5, 9, False, 0)])
def test_pull_head_does_what_its_steps_do(T, G, epoch, mx, absent):
    """The pull dispatch's two launches before its plan - ``pull_head_kernel`` (id check and counts; in its last
    program the counts, the refusal word, epoch += 1 and the publish to every rank; the pack) and
    ``scan_and_wait_kernel`` (the block table's scan; in its last program the bounded wait for every rank's counts)
    - leave exactly what the separate kernels leave (``check_and_count`` with the epoch, ``publish_kernel`` without
    its wait, ``pack_rows_kernel``, ``wait_published_kernel``): checked ids, block table, counts and refusal word, the
    counts and refusal word on every rank with its flag raised to the new epoch, the send copy of the new epoch's
    parity, the error word (a rank that never published: named); tickets and totals back at 0. Bad ids (out of
    range, repeats), NaN/Inf rows, more blocks than programs and more programs than tokens, no tokens; the scan
    in tiles smaller than the table (several row steps)."""
    from mxcomm.ep.nvshmem.kernels import (pack_rows_kernel, publish_kernel, pull_head_kernel, scan_and_wait_kernel,
                                           wait_published_kernel)
    from mxcomm.ep.nvshmem.plan_kernels import check_and_count, slot_blocks, tokens_per_block

    W, me, E, k, H, T_max = 3, 1, 16, 8, 64, 48
    g = torch.Generator().manual_seed(T * 7 + G)
    idx = _routing(W, T, E, k, g, drop=0.2)
    if T:
        idx[0, 1], idx[T - 1, 2] = E + 3, -5  # out of range
        idx[T // 2, 3] = idx[T // 2, 0] = 2  # a repeat
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    if T > 3:
        x[1, 5], x[2, :] = float("nan"), float("inf")
    n_blk = slot_blocks(T, k)
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    row = FLAG_ROWS.index("counts")

    def state():
        st = dict(ids=torch.full((T, k), 99, dtype=torch.int32),
                  hist=torch.full((n_blk + 1, E + 1), 55, dtype=torch.int32),
                  err=torch.tensor([3], dtype=torch.int64), counts=torch.full((E + 1,), 66, dtype=torch.int32),
                  epoch=torch.tensor([epoch], dtype=torch.int64), timeout=torch.zeros(1, dtype=torch.int64),
                  peers=[torch.full((W * E + W,), 44, dtype=torch.int32) for _ in range(W)],
                  flags=[torch.zeros(len(FLAG_ROWS), W, dtype=torch.int64) for _ in range(W)],
                  send_q=torch.full((2, T_max, 2 * H), 33, dtype=torch.uint8),
                  send_s=torch.full((2, T_max, H // 32), 22, dtype=torch.uint8),
                  x_slot=torch.tensor([x.data_ptr()], dtype=torch.int64), tickets=torch.zeros(2, dtype=torch.int32),
                  totals=torch.zeros(E + 1, dtype=torch.int32))
        for p in range(W):  # the other ranks' counts of this epoch arrived here, but the absent one's
            if p not in (me, absent):
                st["flags"][me][row, p] = epoch + 1
        return st

    q_of = lambda st: st["send_q"] if mx else st["send_q"].view(torch.bfloat16)  # noqa: E731
    copy_elems = T_max * 2 * H if mx else T_max * H
    timeout = 20_000_000
    want = state()
    check_and_count(idx, E, want["err"], check=True, prefix_buf=want["hist"], counts_out=want["counts"][:E],
                    ids_out=want["ids"])
    want["counts"][E:].copy_(want["err"])  # the refusal word and the new epoch, as the torch plan's path does
    want["epoch"].add_(1)
    publish_kernel[(W,)](want["counts"], E, ptrs(want["peers"]), me * E, W * E + me, ptrs(want["flags"]),
                         want["flags"][me], row, W, want["epoch"], want["err"], 10 ** 9, me, BLOCK=8, WAIT=False)
    if T:
        pack_rows_kernel[(3,)](want["x_slot"], T, q_of(want), want["send_s"], want["epoch"], T_max, copy_elems,
                               H=H, CHUNK=32, MX=mx, MODE=0, INT_ROUND=True)
    wait_published_kernel[(W,)](want["flags"][me], row, W, want["epoch"], want["timeout"], timeout)
    got = state()
    pull_head_kernel[(G,)](idx, got["ids"], got["hist"], got["err"], T, E, got["totals"], got["counts"],
                           got["tickets"][0:1], ptrs(got["peers"]), ptrs(got["flags"]), row, W, me, got["epoch"],
                           got["x_slot"], q_of(got), got["send_s"], T_max, copy_elems, K=k, K_POW2=k,
                           TOK=tokens_per_block(k), KEYS=8, PUB_BLOCK=8, H=H, CHUNK=32, MX=mx, MODE=0,
                           INT_ROUND=True)
    scan_and_wait_kernel[(3,)](got["hist"], got["counts"], n_blk, E + 1, got["tickets"][1:2], got["flags"][me], row,
                               W, got["epoch"], got["timeout"], timeout, BLOCK_B=2, BLOCK_K=8)
    assert got["tickets"].tolist() == [0, 0] and not got["totals"].any()
    assert int(got["epoch"]) == epoch + 1
    # the bad slots (at least three with tokens) counted on top of the word's earlier value
    assert int(got["err"]) == int(want["err"]) and (int(got["err"]) >= 3 + 3) == (T > 0)
    for name in ("ids", "hist", "counts", "send_q", "send_s", "timeout"):
        assert torch.equal(got[name], want[name]), name
    for p in range(W):
        assert torch.equal(got["peers"][p], want["peers"][p]), ("published", p)
        assert torch.equal(got["flags"][p], want["flags"][p]), ("flag", p)
    assert int(got["flags"][0][row, me]) == epoch + 1
    if absent is not None:  # (the reference names it too: compared above)
        from mxcomm.transport.errors import TIMEOUT_CODE, error_word

        assert int(got["timeout"]) == error_word(TIMEOUT_CODE, absent)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through combine)")
@pytest.mark.parametrize("E,k,mode,weighted,grid", [
    (8, 3, "quant", True, (3,)), (6, 4, "pass", False, (3, 2)), (4, 2, "bf16", True, (2, 3)),
    (5, 5, "quant", False, (3, 2)), (6, 3, "pass", True, (3,)), (4, 3, "bf16", False, (4, 2))])
def test_combine_reduce_reads_own_rows_on_one_rank(E, k, mode, weighted, grid):
    """One rank (``local_reduce_kernel``): the reduce forms the token's single partial from the expert output at its
    dispatch rows - bf16 rows, or MXFP8 rows (``PASS``) decoded - weighted (combine) or not (dispatch backward), in fp32
    ``j`` ascending, and rounds it in registers (MXFP8 quantize + decode, or BF16): bit-exact to the spec; padding rows
    hold NaN (never read), dropped slots carry NaN weights (never read). A NaN row poisons exactly its tokens; a token
    without a valid slot gives 0; a token count that does not fill the last program; ``k`` not a power of two; ``H =
    96`` (a masked chunk); a row's two chunks on one program or dealt out over the grid's second axis (2 programs, or 3:
    one without a chunk)."""
    from combine_spec import assert_bf16_same, combine as spec_combine
    from mxcomm.ep.nvshmem.kernels import local_reduce_kernel
    from mxcomm.mx import quantize

    g = torch.Generator().manual_seed(E * 10 + k + weighted)
    H, T, align = 96, 11, 32
    mx, passthrough = mode != "bf16", mode == "pass"
    idx = _routing(1, T, E, k, g, drop=0.2)
    idx[3] = -1  # a token without a valid slot
    plan = build_plan(local_counts(idx, E)[None], idx, 0, align)
    R = int(plan.num_rows)
    real = torch.zeros(R, dtype=torch.bool)
    real[plan.dest_row[plan.dest_row >= 0].long()] = True
    out = (torch.randn(R, H, generator=g) * 3).to(torch.bfloat16)
    out[~real] = float("nan")
    j0 = int(torch.nonzero(plan.dest_row[4] >= 0)[0])
    nan_row = int(plan.dest_row[4, j0])
    out[nan_row, 40] = float("nan")
    w = torch.rand(T, k, generator=g) * 2 - 0.5
    w[plan.dest_rank < 0] = float("nan")
    if passthrough:
        qt = quantize(out)
        own, own_s = qt.qdata.view(torch.uint8).contiguous(), qt.row_scales().contiguous()
        vals = qt.dequantize(torch.float32, saturate_to=torch.bfloat16)
    else:
        own, own_s = out, torch.zeros(1, dtype=torch.uint8)
        vals = out.float()
    y = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    local_reduce_kernel[grid](own, own_s, plan.dest_rank, plan.dest_row, w, y, T, H=H, K=k, CHUNK=64, MX=mx,
                              PASS=passthrough, WEIGHTED=weighted, MODE=0, INT_ROUND=True, enable_fp_fusion=False)
    want = spec_combine(plan.dest_rank, plan.dest_row, [vals], w if weighted else None, mx)
    assert_bf16_same(y, want)  # (the sign of a zero too: test_one_rank_reduce_gives_plus_zero)
    hit = (plan.dest_row == nan_row).any(1)
    assert torch.equal(y.isnan().any(1), hit) and hit.any()
    assert not y[3].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through combine)")
@pytest.mark.parametrize("mx", [True, False])
def test_one_rank_reduce_gives_plus_zero(mx):
    """The combine formula adds the token's rounded partials to a +0 accumulator: ``y = bf16(0 + Tq(P))``, so an element
    whose partial rounds to -0 comes out +0 (as on several ranks, where the origin sums decoded partials from +0, and in
    the reference backend). One rank (``local_reduce_kernel``) forms the single partial and rounds it in registers:
    MXFP8: ``-1e-3`` beside ``1000`` in one 32-block quantizes to -0; BF16: an fp32 product below bf16's smallest
    subnormal rounds to -0."""
    from combine_spec import combine as spec_combine
    from mxcomm.ep.nvshmem.kernels import local_reduce_kernel

    H, k = 32, 1
    idx = torch.tensor([[0], [0]])
    plan = build_plan(local_counts(idx, 1)[None], idx, 0, 32)
    out = torch.zeros(int(plan.num_rows), H, dtype=torch.bfloat16)
    out[:2, 0] = 1000.0
    out[:2, 1] = -1e-3 if mx else -(2.0 ** -133)  # bf16's smallest subnormal
    w = torch.tensor([[1.0], [0.25]])
    y = torch.full((2, H), 7.0, dtype=torch.bfloat16)
    local_reduce_kernel[(1,)](out, torch.zeros(1, dtype=torch.uint8), plan.dest_rank, plan.dest_row, w, y, 2, H=H,
                              K=k, CHUNK=32, MX=mx, PASS=False, WEIGHTED=True, MODE=0, INT_ROUND=True,
                              enable_fp_fusion=False)
    want = spec_combine(plan.dest_rank, plan.dest_row, [out.float()], w, mx)
    t = 0 if mx else 1
    assert want[t, 1] == 0 and not torch.signbit(want[t, 1])  # the formula: +0
    assert not torch.signbit(y[t, 1]), f"one-rank combine gives {y[t, 1].item()} where the formula gives +0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through combine)")
@pytest.mark.parametrize("mx,weighted", [(True, True), (False, True), (False, False)])
def test_one_rank_reduce_saturates_near_max(mx, weighted):
    """One rank (``local_reduce_kernel``): expert rows at BF16's largest value, one slot weighted by 1.003 or two slots
    summed: a partial that is finite in fp32 but past the BF16 range comes out +-BF16_MAX (BF16 transport saturates it;
    MXFP8 decodes saturated), one that overflows fp32 stays Inf; bit-exact to the spec."""
    from combine_spec import BF16_MAX, assert_bf16_same, combine as spec_combine
    from mxcomm.ep.nvshmem.kernels import local_reduce_kernel

    H, k, E = 64, 2, 4
    idx = torch.tensor([[0, -1], [1, 2], [3, -1], [2, 0]])
    T = idx.shape[0]
    plan = build_plan(local_counts(idx, E)[None], idx, 0, 32)
    out = torch.randn(int(plan.num_rows), H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out[:, :8], out[:, 8:16] = BF16_MAX, -BF16_MAX
    w = torch.full((T, k), 1.003)
    w[2, 0] = 0.5
    y = torch.empty(T, H, dtype=torch.bfloat16)
    local_reduce_kernel[(2,)](out, torch.zeros(1, dtype=torch.uint8), plan.dest_rank, plan.dest_row, w, y, T, H=H,
                              K=k, CHUNK=32, MX=mx, PASS=False, WEIGHTED=weighted, MODE=0, INT_ROUND=True,
                              enable_fp_fusion=False)
    want = spec_combine(plan.dest_rank, plan.dest_row, [out.float()], w if weighted else None, mx)
    assert_bf16_same(y, want)
    assert (y[:, :16].float().abs() == BF16_MAX).any()  # reaches the BF16 range, finite


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("E,k,align,tail,programs", [(8, 3, 32, 0, 3), (5, 2, 128, 40, 7), (4, 4, 32, 7, 2)])
def test_local_rows_kernel_zeroes_exactly_the_unfilled_rows(E, k, align, tail, programs):
    """The local path's ``local_rows_kernel``: every padding row of every group becomes zero, the ``tail`` rows past
    ``n_rows`` (a worst-case-sized output) are not written; every real row holds what the same sending loop stores
    there without the zeroing (``stage_rows_kernel`` through an address table, the rows as its positions). Empty
    groups, a group with every token, odd counts, fewer programs than groups."""
    from mxcomm.ep.nvshmem.kernels import local_rows_kernel, stage_rows_kernel

    g = torch.Generator().manual_seed(E + k + tail)
    T, H = 13, 64
    idx = _routing(1, T, E, k, g, drop=0.2)
    idx[:, 0] = 1  # expert 1 gets every token
    idx[idx == 0] = -1  # expert 0 gets none
    plan = build_plan(local_counts(idx, E)[None], idx, 0, align)
    R = int(plan.num_rows) + tail
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    garbage = torch.randint(1, 256, (R, H), dtype=torch.uint8, generator=g)  # no zero byte anywhere
    outs, scales = [], []
    for local in (False, True):
        out, s = garbage.clone(), torch.zeros(R, H // 32, dtype=torch.uint8)
        s_ptrs = torch.tensor([s.data_ptr()], dtype=torch.int64)
        consts = dict(H=H, K=k, CHUNK=H, MX=True, MODE=0, INT_ROUND=True)
        if local:
            local_rows_kernel[(programs,)](x, T, plan.dest_rank, plan.dest_row, out, s_ptrs, torch.zeros(1),
                                           plan.offs, plan.expert_counts, plan.num_rows, R, E, WEIGHTED=False,
                                           **consts)
        else:
            stage_rows_kernel[(programs,)](x, T, plan.dest_rank, plan.dest_row,
                                           torch.tensor([out.data_ptr()], dtype=torch.int64), s_ptrs, **consts)
        outs.append(out)
        scales.append(s)
    real = torch.zeros(R, dtype=torch.bool)
    real[plan.dest_row[plan.dest_row >= 0].long()] = True
    pad = ~real
    pad[int(plan.num_rows):] = False
    assert int(real.sum()) == int(plan.expert_counts.sum()) and int(pad.sum()) > 0
    plain, out = outs
    assert torch.equal(plain[~real], garbage[~real])  # without the zeroing those rows are not touched
    assert torch.equal(out[real], plain[real])
    assert torch.equal(scales[1], scales[0])
    assert not out[pad].any()
    assert torch.equal(out[int(plan.num_rows):], garbage[int(plan.num_rows):])  # the tail: as it was


_SCALE_CASES = [(4, 7, 32, 0), (3, 224, 128, 0), (5, 12, 32, 40), (1, 4, 32, 0)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("El,C,align,n_rows_cut,word,tail",
                         [c + (False, i % 2 == 0) for i, c in enumerate(_SCALE_CASES)]
                         + [c + (True, i % 2 == 1) for i, c in enumerate(_SCALE_CASES) if c[1] % 4 == 0])
def test_scale_rows_to_grouped_kernel_matches_to_grouped_m(El, C, align, n_rows_cut, word, tail):
    """The receiver's swizzle == mxcomm.mx.to_grouped_m of the real rows (each group's first ``count`` rows):
    empty groups and padding rows give zeros, rows past ``n_rows`` are ignored, every byte of the groups' tile-rows is
    written; the tile-rows past the last group are zeros with ``TAIL`` (exact sizes: the matrix's own padding) and
    not written without it (the worst-case tail of the no-sync mode).
    ``word``: the 4-byte-column variant (what the backend runs when ``C % 4 == 0``)."""
    import triton
    from mxcomm.ep.nvshmem.kernels import scale_rows_to_grouped_kernel
    from mxcomm.ep.nvshmem.kernels.layout import scale_rows_to_grouped_at_kernel
    from mxcomm.mx import grouped_m_rows, round_up, to_grouped_m

    g = torch.Generator().manual_seed(El * 1000 + C)
    n = torch.randint(0, 300, (El,), generator=g)
    n[0] = 0  # an empty group
    padded = (n + align - 1) // align * align
    offs = torch.cumsum(padded, 0).to(torch.int32)
    R = int(offs[-1]) + 64  # rows past the last group (worst-case-sized buffers)
    rows = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)  # garbage everywhere
    real = torch.zeros(R, dtype=torch.bool)
    starts = offs - padded.to(torch.int32)
    for e in range(El):
        real[int(starts[e]):int(starts[e]) + int(n[e])] = True
    n_rows = int(offs[-1]) - n_rows_cut
    want_rows = torch.where((real & (torch.arange(R) < n_rows))[:, None], rows, torch.zeros_like(rows))
    want = to_grouped_m(want_rows[: int(offs[-1])], offs)
    cp = round_up(C, 4)
    out_rows = grouped_m_rows(R, El)
    out = torch.full((out_rows, cp), 0xAB, dtype=torch.uint8)
    ncols = cp // 4 if word else cp
    cb = triton.next_power_of_2(ncols) if word else min(32, triton.next_power_of_2(cp))
    scale_rows_to_grouped_kernel[(out_rows // 128, triton.cdiv(ncols, cb))](
        rows.view(torch.int32) if word else rows, out.view(torch.int32) if word else out, offs,
        torch.tensor([n_rows], dtype=torch.int32), n.to(torch.int32), El, cp // 4, C=C, CB=cb,
        G_POW2=triton.next_power_of_2(El), WORD=word, TAIL=tail)
    in_groups = int(((offs - torch.cat([offs.new_zeros(1), offs[:-1]]) + 127) // 128 * 128).sum())
    assert in_groups < out_rows  # the case has tile-rows past the groups
    assert torch.equal(out[:in_groups], want[:in_groups])
    assert not want[in_groups:].any()
    if tail:
        assert not out[in_groups:].any()  # every byte written: zeros past the groups
    else:
        assert (out[in_groups:] == 0xAB).all()  # tile-rows past the groups: not written
    # inside a captured call (scale_rows_to_grouped_at_kernel): the rows, the matrix and the output's rows (its
    # capacity) at a table's addresses, the grid sized for R rows: the same bytes in the capacity's grouped_m_rows
    # rows, nothing past them, and nothing at all when the plan's n_rows exceeds the capacity
    for cap in (R, n_rows, n_rows - 1):
        out_at = torch.full_like(out, 0xAB)
        src, dst = (rows.view(torch.int32), out_at.view(torch.int32)) if word else (rows, out_at)
        addr = torch.tensor([src.data_ptr(), dst.data_ptr(), cap], dtype=torch.int64)
        scale_rows_to_grouped_at_kernel[(out_rows // 128, triton.cdiv(ncols, cb))](
            addr, 0, 1, 2, offs, torch.tensor([n_rows], dtype=torch.int32), n.to(torch.int32), El, cp // 4, C=C,
            CB=cb, G_POW2=triton.next_power_of_2(El), WORD=word, TAIL=tail)
        held = grouped_m_rows(cap, El) if cap >= n_rows else 0
        assert torch.equal(out_at[:held], out[:held]) and (out_at[held:] == 0xAB).all(), (cap, held)


def _loopback_backend(cfg, launch=None):
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    puts = LoopbackPuts() if cfg.transport == "put" else None
    if launch is not None:
        cfg = dataclasses.replace(cfg, launch=launch)
    be = NvshmemBackend(cfg, None, 0, 1, heap=LoopbackHeap(), puts=puts)
    assert be.put_mode == (cfg.transport == "put")
    assert be.path == {"auto": "local", "pull": "pull", "push": "push", "put": "put"}[cfg.transport]  # one rank
    assert be.memory_bytes == EPGroup.buffer_bytes(cfg, 1, put_path=be.put_mode)  # the report is what it allocates
    return be


_WEIGHTS_ROW = FLAG_ROWS.index("weights")  # the flag row the weights' exchange raises
_POISON_INT, _POISON_FLOAT = 0x5A, 0xFF  # bytes torch.empty fills its result with under _poisoned_empty


@contextlib.contextmanager
def _poisoned_empty():
    """Inside: ``torch.empty`` fills its result with garbage bytes (0x5A; 0xFF - NaN - for floating dtypes), so every
    output byte a kernel should write and does not shows, and every byte it must leave alone is known."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        if t.numel() and t.is_contiguous():
            byte = 1 if t.dtype == torch.bool else _POISON_FLOAT if t.dtype.is_floating_point else _POISON_INT
            t.view(-1).view(torch.uint8).fill_(byte)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _check_grad_rows(ge, plan, w, gy, mx, n):
    """Combine backward's rows at the expert rank: slot ``(t, j)``'s row holds ``w[t, j] * gy[t]`` (fp32 product)
    quantized per slot (payload + scales) or rounded to BF16; padding rows inside the groups zero; the rows past ``n``
    (the no-sync mode's worst-case tail) not written (still the poison of a fresh tensor)."""
    from combine_spec import assert_bf16_same
    from mxcomm.mx import quantize

    R = ge.shape[0]
    filled = torch.zeros(R, dtype=torch.bool)
    q = ge.qdata.view(torch.uint8) if mx else ge.view(torch.uint8)
    rs = ge.row_scales() if mx else None
    for t in range(plan.dest_row.shape[0]):
        for j in range(plan.dest_row.shape[1]):
            r = int(plan.dest_row[t, j])
            if r < 0:
                continue
            filled[r] = True
            prod = w[t, j] * gy[t].float()
            if mx:
                qq = quantize(prod[None])
                assert torch.equal(q[r], qq.qdata.view(torch.uint8)[0]), (t, j)
                assert torch.equal(rs[r], qq.scales.view(torch.uint8)[0]), (t, j)
            else:
                assert_bf16_same(ge[r], prod.to(torch.bfloat16), f"slot {t} {j}")
    pad = ~filled
    pad[n:] = False
    assert not q[pad].any() and (not mx or not rs[pad].any())
    assert (q[n:] == _POISON_INT).all()


def test_delivered_weights_are_the_dispatched_tensor_unchanged():
    """Combine uses the weights that came with a dispatch only for the tensor that dispatch was given, unchanged: an
    alias (``detach``, a full view) counts; a copy with the same values (an empty one too: empty tensors share the
    address 0), another layout, offset or dtype, or the same tensor after an in-place change (its version counter
    moved) does not."""
    from mxcomm.ep.nvshmem.state import DeliveredWeights

    w = torch.rand(6, 4)
    d = DeliveredWeights.of(torch.zeros(12, 4), w)
    assert d.sent(w) and d.sent(w.detach()) and d.sent(w[:]) and d.sent(w.view(6, 4))
    assert not d.sent(w.clone()) and not d.sent(w.t().contiguous().t()) and not d.sent(w.to(torch.float64))
    assert not d.sent(w[:3]) and not d.sent(w.view(4, 6)) and not d.sent(torch.rand(7, 4)[1:])
    w.add_(0)  # values unchanged, version moved: the tensor may have been written
    assert not d.sent(w)
    e = torch.empty(0, 4)
    d0 = DeliveredWeights.of(torch.zeros(12, 4), e)
    assert d0.sent(e.detach()) and not d0.sent(torch.empty(0, 4)) and e.data_ptr() == torch.empty(0, 4).data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("transport", ["auto", "pull", "push", "put"])
def test_loopback_end_to_end_matches_spec(transport, precision, exact):
    """One rank through ``NvshmemBackend`` (local, pull, push and put paths over the loopback heap and puts), exact
    and no-sync sizes, a sequence of calls with 7, 0, 5 and 8 tokens (both epoch parities of every copy; the last call
    sends every token's first slot to one expert): dispatch equals the oracle (payload and the groups' scale tiles;
    the no-sync tail is not written); combine (MXFP8 and BF16 transport of the partials; with the dispatch's weights,
    which the peer-pointer paths take from its entries, and with other weights, which every path exchanges) and
    dispatch backward (a dense gradient, and with MXFP8 the MX gradient combine backward made) equal the spec bit for
    bit (zeros' signs included), never reading a padding or tail row (NaN there) nor the weight of a dropped slot
    (NaN); combine backward's rows are the per-slot quantization of ``w * grad_y`` and its route-weight gradient the
    dot with the expert output (float64 reference, fp32 tolerance) when the forward kept
    ``CombineSaved(rows=expert_out)``, None without. Every fresh tensor starts as garbage (``_poisoned_empty``)."""
    from combine_spec import assert_bf16_same, combine as spec_combine, route_grad
    from mxcomm.ep.handle import CombineSaved

    E, k, T_max = 8, 3, 8
    H = 96 if precision == "mxfp8" else 64
    mx = precision == "mxfp8"
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T_max, precision=precision, backend="nvshmem",
                   num_sms=1, timeout_s=5.0, transport=transport, exact_sizes=exact)
    # few programs per kernel (the interpreter runs them one by one; uneven counts keep the persistent loops' ragged
    # ends), the default launch settings in test_exact_dispatch_scale_matrix_is_fully_written and the other tests; the
    # push path's partials load one listed row a step (the put path's two: a token's third slot takes a second step)
    be = _loopback_backend(cfg, LaunchConfig(dispatch_per_sm=3, partials_per_sm=3, route_grad_per_sm=2,
                                             partials_rows=1 if transport == "push" else 2))
    be.plan_impl = "triton" if exact else "torch"
    sz = True  # the sign of a zero too, on every path (test_one_rank_reduce_gives_plus_zero)
    g = torch.Generator().manual_seed(len(transport) * 100 + 10 * mx + exact)
    for T in (7, 0, 5, 8):
        x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
        idx = _routing(1, T, E, k, g, drop=0.2)
        if T:
            idx[-1] = -1  # a token without a valid slot
        if T == 8:  # every token's first slot to expert 2
            rest = idx[:, 1:]
            rest[rest == 2] = -1
            idx[:, 0] = 2
        w = torch.rand(T, k, generator=g) * 2 - 0.5
        w[idx < 0] = float("nan")  # never read
        with _poisoned_empty():
            res, h = be.dispatch(x, idx, w)
        want = oracle_dispatch(cfg, [x], [idx])[0][0]
        assert torch.equal(res.offs, want.offs) and torch.equal(res.counts, want.counts), T
        n = int(res.offs[-1])
        assert res.num_rows == h.num_rows == (n if exact else be.R_max), T
        got_q = res.x.qdata.view(torch.uint8) if mx else res.x.view(torch.uint8)
        want_q = want.x.qdata.view(torch.uint8) if mx else want.x.view(torch.uint8)
        assert torch.equal(got_q[:n], want_q[:n]), T
        assert (got_q[n:] == _POISON_INT).all(), T  # the no-sync tail: not written
        if mx:  # (the tile-rows past the groups: test_exact_dispatch_scale_matrix_is_fully_written)
            rows = in_group_tile_rows(res.offs)
            assert torch.equal(res.x.scales[:rows], want.x.scales[:rows]), T
        R = res.num_rows
        real = torch.zeros(R, dtype=torch.bool)
        real[h.plan.dest_row[h.plan.dest_row >= 0].long()] = True
        out = (torch.randn(R, H, generator=g) * 2).to(torch.bfloat16)
        out[~real] = float("nan")  # padding rows and the tail: never read
        dr, drow = h.plan.dest_rank, h.plan.dest_row
        w2 = torch.rand(T, k, generator=g).to(torch.bfloat16)  # other weights (combine's topk_weights=)
        flag_before = int(be.flags.local[_WEIGHTS_ROW, 0])
        for q in ([True, False] if mx and T != 8 else [mx]):
            with _poisoned_empty():
                if q == mx:
                    y, saved = be.combine_for_backward(out, h, q)
                    assert saved.rows is out
                else:
                    y = be.combine(out, h, q)
                flag = [int(be.flags.local[_WEIGHTS_ROW, 0])]  # what the weights' exchange raises, after each
                y2 = be.combine(out, with_weights(h, w2), q)
                flag.append(int(be.flags.local[_WEIGHTS_ROW, 0]))
                gx = be.dispatch_backward(out, h, q)
            published = [flag[0] != flag_before, flag[1] != flag[0]]
            flag_before = flag[1]
            # the peer-pointer paths exchange only other weights (the dispatch's came with its entries); the put path
            # every combine's; the local path none
            assert published == {"pull": [False, True], "push": [False, True], "auto": [False, False]}.get(
                transport, [True, True]), T
            assert_bf16_same(y, spec_combine(dr, drow, [out.float()], w, q), f"combine T={T} q={q}", sz)
            assert_bf16_same(y2, spec_combine(dr, drow, [out.float()], w2.float(), q), f"other w T={T} q={q}", sz)
            assert_bf16_same(gx, spec_combine(dr, drow, [out.float()], None, q), f"dispatch bwd T={T} q={q}", sz)
        if T == 5:  # the dispatch's weights changed in place since: what came with the rows is stale, combine exchanges
            w_before = w.clone()
            w.mul_(-2)
            with _poisoned_empty():
                y3 = be.combine(out, h, mx)
            assert_bf16_same(y3, spec_combine(dr, drow, [out.float()], w, mx), f"changed w T={T}", sz)
            w.copy_(w_before)
        gy = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)
        for keep in (True, False) if T in (0, 5) else (True,):
            with _poisoned_empty():
                cb = be.combine_backward(gy, h, CombineSaved(rows=out) if keep else None, mx)
            _check_grad_rows(cb.grad_expert_out, h.plan, w, gy, mx, n)
            if keep:
                want_gw = torch.where(dr >= 0, route_grad(drow, gy, out), 0).float()
                torch.testing.assert_close(cb.grad_weights, want_gw, rtol=1e-5, atol=1e-4)
                assert (cb.grad_weights[dr < 0] == 0).all()
            else:
                assert cb.grad_weights is None
        if mx:  # dispatch backward of an MX gradient: decoded, summed per (token, rank), rounded once
            gm = cb.grad_expert_out
            with _poisoned_empty():
                gx = be.dispatch_backward(gm, h, True)
            vals = gm.dequantize(torch.float32, saturate_to=torch.bfloat16)
            assert_bf16_same(gx, spec_combine(dr, drow, [vals], None, True), f"MX dispatch bwd T={T}", sz)
        # the launches that elect a last program left their tickets, the pull head its totals, at 0
        assert not be.tickets.any() and not be.count_totals.any(), be.tickets.tolist()
    assert int(be.err[0]) == 0
    if transport == "put":
        assert be.puts.calls["wait"] > 0 and be.puts.calls["quiet"] > 0
        assert be.puts.calls["plain"] > 0  # the row puts of combine and combine backward carry no signal


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU suite runs the pull path for real")
def test_pull_dispatch_keeps_no_autograd_history_of_the_weights():
    """The pull dispatch copies the route weights into a fixed buffer for its captured middle; weights that require
    grad (the low-level API takes them as they are) leave no autograd history there, and the combine that uses the
    weights the dispatch brought still gives the spec's result."""
    from combine_spec import assert_bf16_same, combine as spec_combine

    E, k, T, H = 8, 2, 5, 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, precision="bf16", backend="nvshmem",
                   num_sms=1, timeout_s=5.0, transport="pull")
    be = _loopback_backend(cfg)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = _routing(1, T, E, k, g, drop=0.0)
    w = torch.rand(T, k, generator=g).requires_grad_(True)
    res, h = be.dispatch(x, idx, w)
    assert not be.impl.w_in.requires_grad and be.impl.w_in.grad_fn is None
    out = torch.randn(res.num_rows, H, generator=g).to(torch.bfloat16)
    y = be.combine(out, h, False)
    assert_bf16_same(y, spec_combine(h.plan.dest_rank, h.plan.dest_row, [out.float()], w.detach(), False), "combine")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("transport", ["auto", "push", "put"])
def test_exact_dispatch_scale_matrix_is_fully_written(transport):
    """Exact sizes: the dispatch's grouped scale matrix has ``grouped_m_rows(R, El)`` rows, an upper bound, so it has
    tile-rows past the last group in exact mode too (here 4 groups of 32 rows use 4 tiles of 128 rows and 5 are
    allocated; with no token none is used and 4 are allocated). Like ``mxcomm.mx.to_grouped_m`` (the oracle, the
    reference backend) every byte must be written: zeros past the groups, not what the allocator left there."""
    E, k, H = 4, 2, 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, backend="nvshmem", num_sms=1,
                   timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    g = torch.Generator().manual_seed(9)
    for idx in (torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.zeros(0, k, dtype=torch.int64)):
        x = torch.randn(idx.shape[0], H, generator=g).to(torch.bfloat16)
        with _poisoned_empty():
            res, _ = be.dispatch(x, idx, torch.ones(idx.shape[0], k))
        want = oracle_dispatch(cfg, [x], [idx])[0][0]
        rows = in_group_tile_rows(res.offs)
        assert res.x.scales.shape == want.x.scales.shape and rows < want.x.scales.shape[0]
        assert torch.equal(res.x.scales[:rows], want.x.scales[:rows])
        assert torch.equal(res.x.scales[rows:], want.x.scales[rows:]), (
            f"{idx.shape[0]} tokens: the scale tile-rows past the groups are not written")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("plan_impl", ["torch", "triton"])
def test_no_sync_mode_drops_bad_ids_and_raises(plan_impl):
    """exact_sizes=False checks ids on the device: a bad id is dropped (nothing written out of bounds),
    the rest of the rows arrive, and the error is raised (here at once: the interpreter is synchronous)."""
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=8, backend="nvshmem", num_sms=1,
                   exact_sizes=False, timeout_s=5.0)
    be = NvshmemBackend(cfg, None, 0, 1, heap=LoopbackHeap())
    be.plan_impl = plan_impl
    assert be.device_side_checks
    x = torch.randn(3, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 7], [1, 1], [2, 3]])
    with pytest.raises(ValueError, match="outside"):
        be.dispatch(x, idx, torch.ones(3, 2))
    good = torch.tensor([[0, -1], [1, -1], [2, 3]])
    res, _ = be.dispatch(x, good, torch.ones(3, 2))
    want, _ = oracle_dispatch(cfg, [x], [good])
    n = int(res.offs[-1])
    assert res.num_rows == be.R_max > n
    assert torch.equal(res.x.qdata.view(torch.uint8)[:n], want[0].x.qdata.view(torch.uint8)[:n])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("transport", ["auto", "push"])
def test_exact_mode_bad_ids_raise_the_detailed_error(transport):
    """Exact sizes, one rank: an id out of range or listed twice raises check_expert_ids' detailed error before any
    output exists (the local path reads the device's id check at its one size sync, the push path at its own sync);
    the error word is cleared, so the next good call matches the oracle."""
    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=8, backend="nvshmem", num_sms=1,
                   timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_idx\[0, 1\] = 7 is not a valid expert id"):
        be.dispatch(x, torch.tensor([[0, 7], [1, 2], [2, 3]]), torch.ones(3, 2))
    with pytest.raises(ValueError, match="token 1 lists expert 2 more than once"):
        be.dispatch(x, torch.tensor([[0, 1], [2, 2], [2, 3]]), torch.ones(3, 2))
    good = torch.tensor([[0, -1], [1, 3], [2, 3]])
    res, _ = be.dispatch(x, good, torch.ones(3, 2))
    want, _ = oracle_dispatch(cfg, [x], [good])
    assert torch.equal(res.x.qdata.view(torch.uint8), want[0].x.qdata.view(torch.uint8))
    rows = in_group_tile_rows(res.offs)  # (past the groups: test_exact_dispatch_scale_matrix_is_fully_written)
    assert torch.equal(res.x.scales[:rows], want[0].x.scales[:rows])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU test_nvshmem_gpu.py runs it for real")
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_one_rank_dispatch_as_one_call_equals_the_staged_dispatch(precision):
    """One rank, exact sizes: a dispatch of at most ``LaunchConfig.call_graph_tokens`` tokens runs as one call whose
    tensors are found through an address table (``LocalPath._dispatch_call``: ids copied in, plan copied out, output
    rows and grouped scales written at the table's addresses). It gives what the staged dispatch
    (``call_graph_tokens=0``) and the oracle give - payload, scales (every byte, the rows past the groups included),
    offsets, counts, every plan tensor of the handle and the checked ids - on inputs with dropped slots, a token with
    none, every token on one expert, NaN / Inf rows, int32 and int64 ids, ids that are a non-contiguous view, one
    token, and every slot dropped; its output is the first ``R`` rows of a tensor of the rows its tokens could fill at
    most. Bad ids raise the detailed error, after which the next call is right."""
    from mxcomm.ep.plan import PLAN_TENSORS

    E, k, H = 8, 3, 96 if precision == "mxfp8" else 64
    mx = precision == "mxfp8"
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=16, precision=precision, backend="nvshmem",
                   num_sms=1, timeout_s=5.0)
    one = _loopback_backend(cfg, LaunchConfig(dispatch_per_sm=3))
    staged = _loopback_backend(cfg, LaunchConfig(dispatch_per_sm=3, call_graph_tokens=0))
    g = torch.Generator().manual_seed(11 + mx)
    cases = []
    for T in (9, 1, 16, 5, 3):
        x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
        idx = _routing(1, T, E, k, g, drop=0.2) if T != 3 else torch.full((T, k), -1)  # (3: every slot dropped)
        if T == 9:
            idx[-1] = -1  # a token without a valid slot
            x[2, 7], x[3, 40], x[4] = float("nan"), float("inf"), float("-inf")
        if T == 16:  # every token on expert 5
            idx[idx == 5] = -1
            idx[:, 0] = 5
        if T == 5:  # int32 ids, a non-contiguous view
            idx = torch.cat([idx, idx], dim=1).to(torch.int32)[:, ::2]
            assert not idx.is_contiguous()
        cases.append((x, idx))
    for x, idx in cases:
        T = x.shape[0]
        w = torch.rand(T, k, generator=g)
        with _poisoned_empty():
            got, gh = one.dispatch(x, idx, w)
        want, wh = staged.dispatch(x, idx, w)
        oracle = oracle_dispatch(cfg, [x], [idx])[0][0]
        R = got.num_rows
        assert R == want.num_rows == gh.num_rows == int(oracle.offs[-1]), T
        row_bytes = H if mx else 2 * H
        gq = got.x.qdata.view(torch.uint8) if mx else got.x.view(torch.uint8)
        assert gq.untyped_storage().nbytes() == round_up(T * k + E * (cfg.align - 1), cfg.align) * row_bytes
        assert (want.x.qdata if mx else want.x).untyped_storage().nbytes() == R * row_bytes  # the staged: exact
        wq = want.x.qdata.view(torch.uint8) if mx else want.x.view(torch.uint8)
        oq = oracle.x.qdata.view(torch.uint8) if mx else oracle.x.view(torch.uint8)
        assert gq.shape == wq.shape and torch.equal(gq, wq) and torch.equal(gq, oq), T
        if mx:
            assert got.x.scales.shape == want.x.scales.shape == oracle.x.scales.shape, T
            assert got.x.scales.is_contiguous()
            assert torch.equal(got.x.scales, want.x.scales) and torch.equal(got.x.scales, oracle.x.scales), T
        assert torch.equal(got.offs, oracle.offs) and torch.equal(got.counts, oracle.counts), T
        for n in PLAN_TENSORS:
            assert torch.equal(getattr(gh.plan, n), getattr(wh.plan, n)), (T, n)
        assert torch.equal(gh.topk_idx, wh.topk_idx), T
    x = cases[0][0]
    with pytest.raises(ValueError, match=r"topk_idx\[0, 1\] = 8 is not a valid expert id"):
        one.dispatch(x, torch.tensor([[0, 8, 1]] + [[1, 2, 3]] * 8), torch.ones(9, k))
    x, idx = cases[0]
    got, _ = one.dispatch(x, idx, torch.ones(9, k))
    want, _ = staged.dispatch(x, idx, torch.ones(9, k))
    as_bytes = (lambda t: t.qdata.view(torch.uint8)) if mx else (lambda t: t.view(torch.uint8))
    assert torch.equal(as_bytes(got.x), as_bytes(want.x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU test_nvshmem_gpu.py runs it for real")
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_one_rank_reduce_as_one_call_equals_the_launched_reduce(precision):
    """One rank: a combine or dispatch backward of at most ``LaunchConfig.reduce_call_tokens`` tokens runs its reduce
    as one call reading its six tensors' addresses from a table (``local_reduce_at_kernel``). Its output is the launched
    kernel's (``reduce_call_tokens=0``), byte for byte, for combine (weighted, with the handle's weights and with other
    weights), dispatch backward of a BF16 gradient and of the dispatch's own MXFP8 output (decoded), and for MXFP8 or
    BF16 transport - on inputs with dropped slots, a token with none, every token on one expert, NaN / Inf rows and one
    token. Rows that are not 16-byte aligned (a view one element in) and more tokens than the setting take the
    launched kernel."""
    from mxcomm.ep.nvshmem.kernels import local_reduce_at_kernel, local_reduce_kernel
    from mxcomm.kernels.launch import fast_kernel

    E, k, H = 8, 3, 96 if precision == "mxfp8" else 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=16, precision=precision, backend="nvshmem",
                   num_sms=1, timeout_s=5.0)
    one = _loopback_backend(cfg, LaunchConfig(dispatch_per_sm=3, reduce_call_tokens=9))
    launched = _loopback_backend(cfg, LaunchConfig(dispatch_per_sm=3, reduce_call_tokens=0))
    at, plain = fast_kernel(local_reduce_at_kernel), fast_kernel(local_reduce_kernel)
    g = torch.Generator().manual_seed(5 + (precision == "mxfp8"))
    for T in (9, 1, 5, 16):
        x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
        idx = _routing(1, T, E, k, g, drop=0.2)
        if T == 9:
            idx[-1] = -1  # a token without a valid slot
        if T == 5:  # every token on expert 5
            idx[idx == 5] = -1
            idx[:, 0] = 5
        w = torch.rand(T, k, generator=g) * 2 - 0.5
        res, h = one.dispatch(x, idx, w)
        lres, lh = launched.dispatch(x, idx, w)
        R = res.num_rows
        rows = (torch.randn(R, H, generator=g) * 2).to(torch.bfloat16)
        if R > 2:
            rows[1, 5], rows[2] = float("nan"), float("inf")
        base = torch.empty(R * H + 1, dtype=torch.bfloat16)
        skewed = base[1:].view(R, H)  # (one element in: not 16-byte aligned)
        skewed.copy_(rows)
        w2 = torch.rand(T, k, generator=g)
        mx = precision == "mxfp8"
        calls = [("combine", "combine", rows, None), ("combine, other weights", "combine", rows, w2),
                 ("dispatch backward", "dispatch_backward", rows, None),
                 ("combine, rows not aligned", "combine", skewed, None)]
        if mx:
            calls.append(("dispatch backward of MX rows", "dispatch_backward", None, None))
        for name, op, given, weights in calls:
            got_want = []
            for be, hh, mine in ((one, h, res), (launched, lh, lres)):
                n_at, n_plain = at.slow_launches + at.fast_launches, plain.slow_launches + plain.fast_launches
                hh = hh if weights is None else with_weights(hh, weights)
                with _poisoned_empty():
                    got_want.append(getattr(be, op)(mine.x if given is None else given, hh, mx))
                by_table = at.slow_launches + at.fast_launches - n_at
                assert by_table == int(be is one and T <= 9 and "aligned" not in name), (T, name, by_table)
                assert plain.slow_launches + plain.fast_launches - n_plain == 1 - by_table, (T, name)
            got, want = got_want
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU the nvshmem autograd tests run this path")
@pytest.mark.parametrize("transport", ["auto", "push", "put"])
def test_weighted_dispatch_edge_weights_and_rows_bit_exact(transport):
    """Combine backward's weighted dispatch takes each block's maximum of ``w * g`` as ``|w| * max|g|`` (no reduction
    per slot): bit-exact to the oracle with weights +-Inf, NaN, +-0, tiny (products in the fp32 subnormal range) and
    huge, on gradient rows holding Inf, NaN, zeros next to large values (inf * 0 = NaN in the block) and BF16
    subnormals (which the interpreter's plain bf16 cast flushed: this test found that in the weighted path)."""
    from mxcomm.ep.reference.oracle import oracle_combine_backward

    E, k, T, H = 4, 3, 8, 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, backend="nvshmem", num_sms=1,
                   timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[1, 2] = -1
    w = torch.rand(T, k, generator=g)
    w[0] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    w[2] = torch.tensor([0.0, -0.0, 1e-30])
    w[3] = torch.tensor([1e30, -3e-39, 2.5])
    w[4] = torch.tensor([float("inf"), 1e-38, -1e20])
    gy = torch.randn(T, H, generator=g) * 4
    gy[0, :32] = 0.0
    gy[0, 5] = 3.0  # block 0 of token 0: zeros next to a value (inf * 0 = NaN in that block)
    gy[3, 40] = float("inf")
    gy[4, 7] = float("nan")
    gy[4, 32:] = 0.0
    gy[5] = torch.randn(H, generator=g) * 1e-36
    gy[6, :32] = 1e-38
    gy = gy.to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    res, handle = be.dispatch(x, idx, w)
    wants, routes = oracle_dispatch(cfg, [x], [idx])
    out = torch.randn(res.num_rows, H, generator=g).to(torch.bfloat16)
    got = be.combine_backward(gy, handle, None, True)
    want = oracle_combine_backward(cfg, [gy], routes, [w], [out], wants, True)[0]
    rows = in_group_tile_rows(res.offs)  # (past the groups: test_exact_dispatch_scale_matrix_is_fully_written)
    assert torch.equal(got.grad_expert_out.scales[:rows], want.grad_expert_out.scales[:rows])
    assert torch.equal(got.grad_expert_out.qdata.view(torch.uint8), want.grad_expert_out.qdata.view(torch.uint8))


class TwoRankHeap(LoopbackHeap):
    """Rank 0 of a world of 2 whose rank 1 never runs: rank 1's buffers exist (so stores land) but
    nobody signals from it."""

    def __init__(self):
        super().__init__()
        self.ctx = FakeCtx(torch.device("cpu"), rank=0, world=2)
        self.peer_side = {}

    def alloc(self, name, shape, dtype):
        mine, theirs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.peer_side[name] = theirs
        self.bufs[name] = FakeBuf(mine, torch.tensor([mine.data_ptr(), theirs.data_ptr()], dtype=torch.int64))
        return self.bufs[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (host clock); on a GPU see tests/transport")
def test_peer_that_never_arrives_raises_naming_it():
    """Every wait of the EP kernels is bounded: rank 1 never publishes its counts nor sends rows, so
    rank 0's dispatch raises PeerTimeout naming rank 1 after about timeout_s instead of hanging."""
    import time

    from mxcomm.ep.nvshmem.backend import NvshmemBackend
    from mxcomm.transport import PeerTimeout

    cfg = EPConfig(num_experts=4, hidden=32, topk=2, max_tokens_per_rank=4, backend="nvshmem", num_sms=1,
                   timeout_s=0.5)
    be = NvshmemBackend(cfg, None, 0, 2, heap=TwoRankHeap())
    x = torch.randn(3, 32).to(torch.bfloat16)
    idx = torch.tensor([[0, 2], [1, 3], [2, -1]])
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        be.dispatch(x, idx, torch.ones(3, 2))
    assert ei.value.peer == 1
    assert time.monotonic() - t0 < 60


_AOT = '''
import re

from mxcomm.bench.tools.kernel_report import compile_sm90
from mxcomm.ep.nvshmem import kernels as nk

def compile(fn, types, fusion=True, **consts):
    # tensor arguments 16-byte aligned, as a launch specializes them (the layouts, and so the vector widths and the
    # trips through shared memory, follow from it)
    ptx = compile_sm90(fn, types, 4, fusion, **consts).asm["ptx"]
    assert ptx
    if not fusion:  # the partial sums: each product rounded, then added (launched with enable_fp_fusion=False)
        assert "fma." not in ptx, fn.__name__
    return ptx

i32, i64, u8 = "*i32", "*i64", "*u8"
disp = dict(x_ptr="*bf16", dest_rank_ptr=i32, dest_row_ptr=i32, send_pos_ptr=i32, q_peers=i64, s_peers=i64,
            flags_peers=i64, w_ptr="*fp32", offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32)
for mx in (True, False):
    # the push path (skip_empty: its rounds, where tokens without a slot in the window are not read) and the put path
    for kernel, extra in ((nk.push_rows_kernel, dict(SKIP_EMPTY=False)), (nk.push_rows_kernel, dict(SKIP_EMPTY=True)),
                          (nk.stage_rows_kernel, {})):
        ptx = compile(kernel, disp, H=7168, K=8, CHUNK=2048, MX=mx, MODE=0, INT_ROUND=False, **extra)
        # the payload stores (through _store_slot, to a pointer read from the peer table) stay 16-byte vectors:
        # without the alignment hints every peer store over NVLink would be a single byte
        assert "st.global.v4.b32" in ptx, (kernel.__name__, extra, mx)
# combine and dispatch backward, expert side: one partial per (token, rank), to the origins' comb_q or (put path) staged
part = dict(out_ptr="*bf16", out_s_ptr=u8, table_ptr=i32, origin_pos_ptr=i32, w_ptr="*fp32", q_peers=i64,
            s_peers=i64, flags_peers=i64, epoch_ptr=i64, err_ptr=i64)
for staged, mx, weighted in ((False, True, True), (False, False, False), (True, True, False), (True, False, True)):
    # the partial's payload store (MXFP8 bytes or BF16 values, through _store_partial to a pointer read from the peer
    # table) stays a 16-byte vector store where a thread holds 16 bytes of the chunk: MXFP8 needs a 2048-value chunk
    # at 4 warps (the backend's LaunchConfig.partials_chunk; at 1024 values a thread holds 8 bytes: checked below)
    kernel, by_world = (nk.stage_partials_kernel, {}) if staged else (nk.combine_partials_kernel, dict(P=4))
    ptx = compile(kernel, part, False, H=4096, K=8, CHUNK=2048 if mx else 1024, MX=mx, PASS=False, WEIGHTED=weighted,
                  MODE=0, INT_ROUND=False, **by_world)
    assert "st.global.v4.b32" in ptx, ("partials", staged, mx, weighted)
for rows in (1, 4):  # the launch setting's other values
    compile(nk.combine_partials_kernel, part, False, H=7168, K=8, P=8, CHUNK=1024, MX=True, PASS=False, WEIGHTED=True,
            MODE=0, INT_ROUND=False, ROWS=rows)
for pas, chunk in ((False, 1024), (True, 1024), (False, 2048), (True, 2048)):  # 2048: the backend's, 4 warps
    ptx = compile(nk.combine_partials_kernel, dict(part, out_ptr=u8) if pas else part, False, H=7168, K=8, P=4,
                  CHUNK=chunk, MX=True, PASS=pas, WEIGHTED=not pas, MODE=0, INT_ROUND=False)
    # MXFP8 payload stores: 8-byte vectors at 1024 values, 16-byte at 2048 (a masked tail at 7168 values)
    assert re.search(r"st[.]global[.]v2[.]b32" if chunk == 1024 else r"st[.]global[.]v4[.]b32", ptx), (pas, chunk)
    # the scale bytes are stored by the threads that hold them (store_block_bytes): no trip through shared memory
    # with two barriers per chunk (7 chunks at 1024 values: 14 barriers before)
    assert "st.global.u8" in ptx and ptx.count("bar.sync") <= 2, ("partials' scale stores", pas, chunk)
# as the peer-pointer paths launch it: the last program waits for every rank's partials (a ticket)
ptx = compile(nk.combine_partials_kernel, dict(part, ticket_ptr=i32, flags_row_ptr=i64, expect_row_ptr=i64,
              timeout_ns="i64"), False, H=7168, K=8, P=4, CHUNK=2048, MX=True, PASS=False, WEIGHTED=True, MODE=0,
              INT_ROUND=False, WAIT=True)
assert "st.global.v4.b32" in ptx and re.search(r"atom[.]global[.]gpu[.]acq_rel[.]add[.]u32", ptx), "partials' wait"
red = dict(comb_q_ptr=u8, comb_s_ptr=u8, send_pos_ptr=i32, dest_rank_ptr=i32, y_ptr="*bf16", epoch_ptr=i64)
own = dict(rows_ptr="*bf16", rows_s_ptr=u8, dest_rank_ptr=i32, dest_row_ptr=i32, w_ptr="*fp32", y_ptr="*bf16")
# partials from comb_q; one rank: the expert rows in place, bf16 (combine) or MX (dispatch backward of an MX gradient)
ptx = compile(nk.combine_reduce_kernel, red, False, H=4096, K=8, P=4, CHUNK=2048, MX=True, INT_ROUND=False)
assert ptx.count("bar.sync") <= 2, ("reduce", ptx.count("bar.sync"))
for pas, weighted in ((False, True), (True, False)):
    ptx = compile(nk.local_reduce_kernel, dict(own, rows_ptr=u8) if pas else own, False, H=4096, K=8, CHUNK=1024,
                  MX=True, PASS=pas, WEIGHTED=weighted, MODE=0, INT_ROUND=False)
    assert ptx.count("bar.sync") <= 2, ("one-rank reduce", pas, ptx.count("bar.sync"))
    # as one captured call, its tensors at a table's addresses: the rows loaded and y stored in the same vectors as
    # the launched kernel's (without the alignment hints, one access per value)
    at = compile(nk.local_reduce_at_kernel, dict(addr_ptr=i64), False, H=4096, K=8, CHUNK=1024, MX=True, PASS=pas,
                 WEIGHTED=weighted, MODE=0, INT_ROUND=False)
    for op in ("ld.global.v", "st.global.v"):
        assert at.count(op) == ptx.count(op) > 0, ("one-rank reduce at", pas, op, at.count(op), ptx.count(op))
    assert "ld.global.b16" not in at and "st.global.b16" not in at, ("one-rank reduce at", pas)
# the backend's MXFP8 reduce (whole rows, 4 warps): the partials' scale bytes loaded where the decode holds them
# (load_block_bytes) and 8 payload bytes a thread, the layout of the bf16 stores: no trip through shared memory (16
# barriers before: 2 per partial's scales, 8 for the stores)
ptx = compile(nk.combine_reduce_kernel, red, False, H=7168, K=8, P=4, CHUNK=8192, MX=True, INT_ROUND=False)
assert ptx.count("bar.sync") == 0 and "ld.global.v2.b32" in ptx, ("reduce", ptx.count("bar.sync"))
compile(nk.combine_reduce_kernel, dict(red, comb_q_ptr="*bf16"), False, H=4096, K=6, P=6, CHUNK=4096, MX=False,
        INT_ROUND=False)  # BF16 transport; k not a power of two
pub = dict(src_ptr=i32, dst_peers=i64, flags_peers=i64, flags_local=i64, epoch_ptr=i64, err_ptr=i64, timeout_ns="i64")
for wait in (True, False):
    compile(nk.publish_kernel, pub, BLOCK=1024, WAIT=wait)
compile(nk.wait_published_kernel, dict(flags_local=i64, epoch_ptr=i64, err_ptr=i64, timeout_ns="i64"))
compile(nk.wait_arrivals_kernel, dict(flags_row_ptr=i64, expect_row_ptr=i64, err_ptr=i64, timeout_ns="i64"))
compile(nk.first_refusal_kernel, dict(words_ptr=i32, out_ptr=i64), W_POW2=8)
compile(nk.entries_table_kernel, dict(list_ptr=i32, table_ptr=i32, wtab_ptr=i32, epoch_ptr=i64), K=8, K_POW2=8,
        EW=32)
compile(nk.gather_route_grad_kernel, dict(gw_ptr="*fp32", dest_rank_ptr=i32, out_ptr="*fp32"), BLOCK=1024)
sc = dict(offs_ptr=i32, n_rows_ptr=i32, counts_ptr=i32)
for tail in (False, True):  # no-sync tail left alone; exact sizes: the matrix's own padding tile-rows zeroed
    compile(nk.scale_rows_to_grouped_kernel, dict(sc, rows_ptr=u8, out_ptr=u8), C=228, CB=32, G_POW2=256, WORD=False,
            TAIL=tail)
    compile(nk.scale_rows_to_grouped_kernel, dict(sc, rows_ptr=i32, out_ptr=i32), C=224, CB=64, G_POW2=256, WORD=True,
            TAIL=tail)
compile(nk.copy_out_rows_kernel, dict(src_ptr=i64, dst_ptr=i64, n_rows_ptr=i32, row_src_ptr=i32), ROW_WORDS=896,
        CHUNK=512)
compile(nk.copy_out_rows_kernel, dict(src_ptr=u8, dst_ptr=u8, n_rows_ptr=i32, row_src_ptr=i32), ROW_WORDS=224,
        CHUNK=256)  # the put path's scale rows out of its receive window
for weighted in (False, True):  # local path: straight into the output; the unfilled rows zeroed by the same launch
    for mx in (True, False):
        ptx = compile(nk.local_rows_kernel, dict(disp, out_ptr=u8 if mx else "*bf16"), H=7168, K=8, CHUNK=4096, MX=mx,
                      MODE=0, INT_ROUND=False, WEIGHTED=weighted)
        assert "st.global.v4.b32" in ptx, ("local", weighted, mx)
        if weighted and mx:  # scales quantized per slot, stored where they are held (2 barriers a slot before)
            assert "st.global.u8" in ptx and ptx.count("bar.sync") == 0, ("weighted scales", ptx.count("bar.sync"))
for mx in (True, False):  # the one-rank dispatch as one captured call: x and the output at a table's addresses
    ptx = compile(nk.local_rows_at_kernel, dict(addr_ptr=i64, dest_rank_ptr=i32, dest_row_ptr=i32, s_peers=i64,
                  offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32), H=7168, K=8, CHUNK=8192, MX=mx, MODE=0,
                  INT_ROUND=False)
    # x read through the table in 16-byte loads (without the alignment hint, one load per value), stored as 16 bytes
    assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx, ("local rows at", mx)
    assert "st.global.v4.b32" in ptx, ("local rows at", mx)
compile(nk.scale_rows_to_grouped_at_kernel, dict(sc, rows_ptr=i32, addr_ptr=i64), C=224, CB=64, G_POW2=256, WORD=True,
        TAIL=True)
compile(nk.scale_rows_to_grouped_at_kernel, dict(sc, rows_ptr=u8, addr_ptr=i64), C=228, CB=32, G_POW2=256,
        WORD=False, TAIL=True)
compile(nk.copy_in_kernel, dict(addr_ptr=i64, dst_ptr=i32), BLOCK=1024)
compile(nk.copy_out_kernel, dict(src_ptr=i32, addr_ptr=i64), BLOCK=1024)
for mx in (True, False):
    ptx = compile(nk.pull_rows_kernel, dict(dst_ptr=i64, dst_s_ptr=u8, offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32,
                  q_peers=i64, s_peers=i64, list_ptr=i32, table_ptr=i32, wtab_ptr=i32, epoch_ptr=i64),
                  ROW_WORDS=896 if mx else 1792,
                  CHUNK=512, C=224, C_POW2=256, K=8, K_POW2=8, EW=16, MX=mx)
    # the rows read through the peer table in 16-byte loads, as they are stored (8-byte loads without the hint)
    assert "ld.global.v2.b64" in ptx, ("pull rows' loads", mx)
    ptx = compile(nk.pull_rows_at_kernel, dict(addr_ptr=i64, dst_s_ptr=u8, offs_ptr=i32, counts_ptr=i32,
                  n_rows_ptr=i32, q_peers=i64, s_peers=i64, list_ptr=i32, epoch_ptr=i64), ROW_WORDS=896 if mx else 1792,
                  CHUNK=512, C=224, C_POW2=256, K=8, K_POW2=8, EW=16, MX=mx)
    # through the table too: rows and padding zeros stored 16 bytes at a time (no 8-byte stores)
    assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx and "st.global.b64" not in ptx, ("pull at", mx)
for mx in (True, False):
    ptx = compile(nk.pack_rows_kernel, dict(x_slot=i64, send_q_ptr=u8 if mx else "*bf16", send_s_ptr=u8,
                  epoch_ptr=i64), H=7168, CHUNK=2048, MX=mx, MODE=0, INT_ROUND=False)
    assert "st.global.v4.b32" in ptx, ("pack", mx)
    # x by address: 16-byte loads (without the alignment hint, one load per value)
    assert "ld.global.v4.b32" in ptx and "ld.global.b16" not in ptx, ("pack's loads", mx)
    if mx:  # scale bytes stored where they are held (store_block_bytes): not 2 barriers per chunk (8 before)
        assert "st.global.u8" in ptx and ptx.count("bar.sync") == 0, "pack's scale stores"
# combine backward, pull path: the BF16 rows + weights packed (into this rank's own memory), then "ready" from the
# last program (a ticket at GPU scope, the signals' release at system scope); the receiver weights and quantizes
ptx = compile(nk.pack_ready_kernel, dict(g_ptr="*bf16", send_q_ptr="*bf16", epoch_ptr=i64, w_ptr="*fp32",
              send_w_ptr="*fp32", ticket_ptr=i32, flags_peers=i64), H=7168, CHUNK=2048, K=8, K_POW2=8)
assert "st.global.v4.b32" in ptx and re.search(r"atom[.]global[.]gpu[.]acq_rel[.]add[.]u32", ptx), "pack + ready"
assert re.search(r"atom[.]global[.]sys[.]release[.]exch", ptx), "ready's release"
# route-weight gradient on the pull path (arrivals), on the put path's rounds (its puts signal), none
weighted = dict(dst_ptr=u8, dst_s_ptr=u8, offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32, g_peers=i64, w_peers=i64,
                table_ptr=i32, epoch_ptr=i64, out_ptr="*bf16", gw_peers=i64, flags_peers=i64)
# as the peer-pointer paths launch it: the last program waits for every rank's route-weight gradients (a ticket)
ptx = compile(nk.pull_weighted_kernel, dict(weighted, ticket_ptr=i32, flags_row_ptr=i64, expect_row_ptr=i64,
              err_ptr=i64, timeout_ns="i64"), H=4096, CHUNK=2048, K=8, K_POW2=8, MX=True, MODE=0, INT_ROUND=False,
              ZCHUNK=512, ROUTE_GRAD=True, WAIT=True)
assert re.search(r"atom[.]global[.]gpu[.]acq_rel[.]add[.]u32", ptx), "pull weighted's wait"
for mx, route_grad, kernel in ((True, True, nk.pull_weighted_kernel), (False, True, nk.round_weighted_kernel),
                               (True, False, nk.pull_weighted_kernel), (False, False, nk.pull_weighted_kernel),
                               (True, True, nk.round_weighted_kernel)):
    ptx = compile(kernel, dict(weighted, dst_ptr=u8 if mx else "*bf16"), H=4096, CHUNK=2048 if mx else 1024, K=8,
                  K_POW2=8, MX=mx, MODE=0, INT_ROUND=False, ZCHUNK=512, ROUTE_GRAD=route_grad)
    assert "st.global.v4.b32" in ptx, ("pull weighted", mx, route_grad)
    # the gradient rows, through the peer table, in 16-byte loads (without the alignment hint, one load per value)
    assert "ld.global.b16" not in ptx, ("pull weighted's loads", mx, route_grad)
    if mx:  # scale bytes stored where they are held: not 2 barriers per (chunk, slot) (2 x 2 x 8 = 32 before)
        assert ptx.count("bar.sync") <= 8, ("pull weighted scale stores", route_grad, ptx.count("bar.sync"))
ent = dict(dest_rank_ptr=i32, dest_row_ptr=i32, w_ptr="*fp32", list_peers=i64, flags_peers=i64, epoch_ptr=i64)
for one in ({}, dict(me=1), dict(me=1, T_max=1, T=1)):  # a launch specializes ints equal to 1 as constants
    compile(nk.push_entries_kernel, ent, K=8, EW=32, BLOCK=64, **one)
# the pull path's plan with its entries and their wait (its last program: a ticket at system scope)
from mxcomm.ep.nvshmem import plan_kernels as pk
plan_ptrs = {n: "*i64" if n == "status_ptr" else i32 for n in pk.plan_kernel.arg_names if n.endswith("_ptr")}
ptx = compile(nk.plan_entries_kernel, dict(plan_ptrs, w_ptr="*fp32", list_peers=i64, flags_peers=i64, epoch_ptr=i64,
              ticket_ptr=i32, flags_row_ptr=i64, expect_row_ptr=i64, err_ptr=i64, timeout_ns="i64"), W_POW2=4,
              EL_POW2=64, S=128, S_POW2=128, BLOCK=128, STATUS=True, K=8, EW=32)
assert re.search(r"atom[.]global[.]sys[.]acq_rel[.]add[.]u32", ptx), "plan entries' ticket"
# the pull dispatch's head: the id check and counts, the scan and publish by the last program, the pack
head = dict(idx_ptr=i64, ids_ptr=i32, hist_ptr=i32, input_err_ptr=i64, totals_ptr=i32, counts_ptr=i32,
            ticket_ptr=i32, counts_peers=i64, flags_peers=i64, epoch_ptr=i64, x_slot=i64, send_q_ptr=u8, send_s_ptr=u8)
for mx in (True, False):
    ptx = compile(nk.pull_head_kernel, dict(head, send_q_ptr=u8 if mx else "*bf16"), K=8, K_POW2=8, TOK=16, KEYS=512,
                  PUB_BLOCK=1024, H=7168, CHUNK=8192, MX=mx, MODE=0, INT_ROUND=False)
    assert re.search(r"atom[.]global[.]gpu[.]acq_rel[.]add[.]u32", ptx), ("head's ticket", mx)
    # the pack's row loads and stores as pack_rows_kernel's: 16-byte vectors
    assert "st.global.v4.b32" in ptx and "ld.global.v4.b32" in ptx, ("head's pack", mx)
    # reads of counts other threads or programs added: volatile (not from a stale L1 line)
    assert "ld.volatile.global" in ptx, ("head's counts", mx)
ptx = compile(nk.scan_and_wait_kernel, dict(hist_ptr=i32, counts_ptr=i32, ticket_ptr=i32, flags_local=i64,
              epoch_ptr=i64, err_ptr=i64, timeout_ns="i64"), BLOCK_B=256, BLOCK_K=8)
assert re.search(r"atom[.]global[.]gpu[.]acq_rel[.]add[.]u32", ptx), "scan's ticket"
print("ok")
'''


def test_ep_kernels_compile_for_sm90_both_paths(tmp_path):
    """The EP kernels compile for sm_90 (a fresh process without the interpreter) in the variants both paths
    launch: peer-pointer stores with arrival flags, and the put path's staging writes (row-major scales, no
    flags, staged combine) plus the receiver's scale swizzle."""
    from _triton_mode import run_aot

    assert "ok" in run_aot(_AOT, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU see tests/transport (bounded signal waits)")
def test_put_path_peer_that_never_signals_raises_naming_it():
    """Put path: rank 1 never runs, so no count signal arrives from it; rank 0's dispatch raises PeerTimeout
    naming rank 1 (the signal wait records the source's index, the backend turns it into the error)."""
    from mxcomm.ep.nvshmem.backend import NvshmemBackend
    from mxcomm.transport import PeerTimeout

    cfg = EPConfig(num_experts=4, hidden=32, topk=2, max_tokens_per_rank=4, backend="nvshmem", num_sms=1,
                   timeout_s=0.5, transport="put")
    puts = LoopbackPuts(world=2)
    be = NvshmemBackend(cfg, None, 0, 2, heap=TwoRankHeap(), puts=puts)
    with pytest.raises(PeerTimeout) as ei:
        be.dispatch(torch.randn(3, 32).to(torch.bfloat16), torch.tensor([[0, 2], [1, 3], [2, -1]]), torch.ones(3, 2))
    assert ei.value.peer == 1
    assert puts.calls["wait"] >= 1


@pytest.mark.parametrize("H", [32, 96, 1024, 2880, 4096, 7168, 7200, 16384])
def test_qdq_chunk_wastes_least(H):
    """The per-slot quantizing kernels' chunk: a power of two in [512, 1024] (or next_pow2(H) when smaller) whose
    masked-off tail is the smallest such a chunk can leave."""
    c = _qdq_chunk(H)
    small = 1 << (H - 1).bit_length()
    allowed = [small] if small <= 512 else [x for x in (512, 1024) if x <= small]
    assert c in allowed
    assert -H % c == min(-H % x for x in allowed)
    if H % 1024 == 0:
        assert c == 1024


@pytest.mark.parametrize("field, value", [("partials_rows", 0), ("partials_per_sm", -1), ("dispatch_warps", 3),
                                          ("dispatch_warps", 64), ("qdq_chunk", 1000), ("reduce_mx_chunk", 16),
                                          ("partials_chunk", 48), ("reduce_warps", 2.0), ("push_per_sm", True),
                                          ("wait_warps", 0), ("wait_warps", 3), ("reduce_call_tokens", -1),
                                          ("call_graph_tokens", 1.0), ("peer_guess_pct", -1)])
def test_launch_config_refuses_settings_no_launch_can_take(field, value):
    """A zero rows-a-step would leave the partial sums' loop without progress (a kernel that never ends): every
    setting is checked when the config is made, with the field named."""
    with pytest.raises(ValueError, match=f"LaunchConfig.{field} "):
        LaunchConfig(**{field: value})
    LaunchConfig(partials_rows=1, dispatch_warps=32, qdq_chunk=32)  # the edges that are allowed
    LaunchConfig(call_graph_tokens=0, peer_call_tokens=0, reduce_call_tokens=0, peer_guess_pct=0)  # (0: never)


def test_put_path_launches_its_puts_within_the_sm_budget():
    """The put path's kernels (``csrc/put_signal.cu``) get ``LaunchConfig.put_per_sm * num_sms`` CUDA blocks at
    most: the :class:`~mxcomm.ep.nvshmem.put_path.Puts` the path builds carries that budget to every put launch."""
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    for sms, per_sm in ((1, 4), (24, 3)):
        cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=8, backend="nvshmem", num_sms=sms,
                       transport="put", launch=LaunchConfig(put_per_sm=per_sm))
        be = NvshmemBackend(cfg, None, 0, 1, heap=LoopbackHeap())
        assert be.impl.puts.blocks == sms * per_sm
    with pytest.raises(ValueError, match="put_per_sm"):
        LaunchConfig(put_per_sm=0)
