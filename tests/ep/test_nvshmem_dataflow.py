"""The nvshmem backend's plan helpers (CPU) and its kernels' data path under the Triton interpreter.

The interpreter test runs the real dispatch/combine kernels of the nvshmem backend in one process
(world of 1, loopback) over plain CPU tensors standing in for the symmetric heap: peer pointers are
the tensors' addresses, flags and bounded waits run as on the GPU. Multi-rank and real-NVSHMEM runs
are GPU tests (tests/ep/test_nvshmem_gpu.py).
"""

import pytest
import torch
import triton

from heap_fakes import FakeBuf, FakeCtx
from mxcomm.ep import EPConfig, EPGroup
from mxcomm.ep.nvshmem_backend import _qdq_chunk, row_origins
from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch
from mxcomm.ep.plan import build_plan, local_counts


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
    """In-process stand-in for ``mxcomm.ep.put_path.Puts`` (the CUDA put-with-signal kernels) seen from rank 0:
    a put to PE 0 copies each entry's bytes after the same range check as ``mx_put_signal`` and adds
    ``entries * chunks`` to the signal word; entries for other PEs (``world > 1``: ranks that never run) are
    range-checked and dropped. A wait records a timeout error word for a word still short (nothing runs
    concurrently here, so a short word would never fill)."""

    def __init__(self, world: int = 1):
        self.world = world
        self.calls = {"put": 0, "wait": 0, "quiet": 0}

    def put(self, dst, src, batch, signals, signal_index, err, chunks):
        from mxcomm.transport.errors import error_word
        from mxcomm.transport.put_signal import BAD_ENTRY_CODE

        self.calls["put"] += 1
        d, s_ = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for i in range(batch.n):
            pe, n = int(batch.pes[i]), int(batch.nbytes[i])
            do, so = int(batch.dst_offsets[i]), int(batch.src_offsets[i])
            if not 0 <= pe < self.world or min(n, do, so) < 0 or do + n > d.numel() or so + n > s_.numel():
                err[0] = max(int(err[0]), error_word(BAD_ENTRY_CODE, max(pe, 0)))
                continue
            if pe == 0:
                d[do:do + n] = s_[so:so + n].clone()
        signals[signal_index] += int((batch.pes == 0).sum()) * chunks

    def wait(self, signals, indices, epoch, per_epoch, err, timeout_ns):
        from mxcomm.transport.errors import TIMEOUT_CODE, error_word

        self.calls["wait"] += 1
        for i in indices.tolist():
            if int(signals[i]) < int(epoch.reshape(-1)[0]) * per_epoch:
                err[0] = max(int(err[0]), error_word(TIMEOUT_CODE, i))

    def quiet(self):
        self.calls["quiet"] += 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("W,E,k,mx", [(2, 8, 3, True), (3, 6, 4, True), (2, 4, 2, False)])
def test_pull_list_reads_each_token_once_per_rank(W, E, k, mx):
    """The pull dispatch's entry exchange and gather, ranks simulated in one process (pointer tables to each
    rank's tensors): every sender writes one entry per (token, receiving rank) listing that token's rows there;
    each receiver's gather puts the sender's send-copy row (and scale row) at exactly those rows, zeroes padding
    and the worst-case tail, and ignores entries of an older epoch (pre-filled garbage with an old tag, some with the
    same low 32 bits as this epoch). Ranks
    with zero tokens, dropped slots, tokens with several experts on one rank; the odd epoch reads copy 1."""
    import triton
    from mxcomm.ep.nvshmem_kernels import pull_rows_kernel, push_entries_kernel
    from mxcomm.ep.plan import pull_entry_words

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
    lists = [torch.randint(-1, 50, (W, T_max, EW), dtype=torch.int32, generator=g) for _ in range(W)]
    for lst in lists:  # entries of earlier dispatches, garbage rows: must be skipped
        lst[:, :, 0], lst[:, :, 1] = epoch - 2, 0
        lst[:, 1::2, 0], lst[:, 1::2, 1] = epoch, 1  # written 2**32 calls ago: the same low word
    flags = [torch.zeros(3, W, dtype=torch.int64) for _ in range(W)]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ep = torch.tensor([epoch], dtype=torch.int64)
    for s in range(W):
        push_entries_kernel[(2,)](plans[s].dest_rank, plans[s].dest_row, Ts[s], ptrs(lists), ptrs(flags), ep, s, W,
                                  T_max, K=k, EW=EW, BLOCK=4)
    for d in range(W):
        assert flags[d][1].tolist() == [2] * W  # every sender's programs arrived
        n_rows = int(plans[d].num_rows)
        R = n_rows + 5  # worst-case-sized output: rows past n_rows must come out zero
        o = row_origins(plans[d], R)
        out = torch.randint(0, 256, (R, H * B), dtype=torch.uint8, generator=g)  # garbage everywhere
        recv_s = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
        words = H * B // 8
        pull_rows_kernel[(3,)](out.view(torch.int64), recv_s, plans[d].num_rows, o.src, R, ptrs(send_q), ptrs(send_s),
                               lists[d], ep, T_max, W, copy_bytes // 8, ROW_WORDS=words, CHUNK=triton.next_power_of_2(words), C=C,
                               C_POW2=triton.next_power_of_2(C), K=k, EW=EW, MX=mx)
        want = torch.zeros(R, H * B, dtype=torch.uint8)
        real = torch.zeros(R, dtype=torch.bool)
        for s in range(W):  # row dest_row[t, j] of every slot going to d holds token t of source s (copy 1)
            for t in range(Ts[s]):
                for j in range(k):
                    if int(plans[s].dest_rank[t, j]) == d:
                        r = int(plans[s].dest_row[t, j])
                        want[r] = send_q[s].view(-1)[copy_bytes + t * H * B: copy_bytes + (t + 1) * H * B]
                        real[r] = True
                        if mx:
                            assert torch.equal(recv_s[r], send_s[s][1, t])
        assert int(real.sum()) == int(plans[d].num_recv)
        assert torch.equal(out, want)
        # one entry per (source, token) received here, however many of d's experts the token picked
        for s in range(W):
            fresh = (lists[d][s, :, 0] == epoch) & (lists[d][s, :, 1] == 0)
            goes = (plans[s].dest_rank == d).any(dim=1) if Ts[s] else torch.zeros(0, dtype=torch.bool)
            assert fresh[: Ts[s]].tolist() == goes.tolist() and not fresh[Ts[s]:].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through backward)")
@pytest.mark.parametrize("W,E,k,mx", [(2, 8, 3, True), (3, 6, 4, True), (2, 4, 2, False), (3, 6, 3, False)])
def test_pull_path_combine_backward_weights_where_rows_land(W, E, k, mx):
    """Combine backward on the pull path, ranks simulated in one process: each source packs its BF16 gradient rows
    and fp32 route weights once into its send copy (copy 1 of an odd epoch; copy 0 untouched), writes one pull-list
    entry per (token, receiving rank), and each receiver reads every listed row once and stores ``w[t, j] * g[t]``
    quantized (MX, row-major scale rows) or rounded to BF16 at each slot's row - bit-exact to the plain-torch
    quantization of the fp32 product, padding and tail rows zero. Weights 0, negative, tiny; rows with Inf/NaN;
    ranks with zero tokens; dropped slots."""
    from mxcomm.ep.nvshmem_kernels import pack_rows_kernel, pull_weighted_kernel, push_entries_kernel
    from mxcomm.ep.plan import pull_entry_words
    from mxcomm.mx import quantize

    g = torch.Generator().manual_seed(W * 31 + E + k)
    H, T_max, align, epoch = 64, 6, 4, 7
    C = H // 32
    Ts = [0] + [T_max - r + 1 for r in range(1, W)]
    idxs = [_routing(W, T, E, k, g, drop=0.2) for T in Ts]
    counts = torch.stack([local_counts(i, E) for i in idxs])
    plans = [build_plan(counts, idxs[r], r, align) for r in range(W)]
    EW = pull_entry_words(k)
    gs = [(torch.randn(T, H, generator=g) * 3).to(torch.bfloat16) for T in Ts]
    ws = [torch.randn(T, k, generator=g) for T in Ts]
    for T, gy, w in zip(Ts, gs, ws):
        if T:
            gy[0, 5], gy[-1, 40] = float("inf"), float("nan")
            w[0, 0], w[-1, -1] = 0.0, 1e-30
    send_q = [torch.randint(0, 256, (2, T_max, 2 * H), dtype=torch.uint8, generator=g) for _ in range(W)]
    send_s = [torch.zeros(1, dtype=torch.uint8) for _ in range(W)]
    send_w = [torch.randn(2, T_max, k, generator=g) for _ in range(W)]
    copy0 = [q[0].clone() for q in send_q]
    lists = [torch.randint(-1, 50, (W, T_max, EW), dtype=torch.int32, generator=g) for _ in range(W)]
    for lst in lists:  # entries of earlier calls: must be skipped
        lst[:, :, 0], lst[:, :, 1] = epoch - 1, 0
    flags = [torch.zeros(3, W, dtype=torch.int64) for _ in range(W)]
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ep = torch.tensor([epoch], dtype=torch.int64)
    for s in range(W):
        pack_rows_kernel[(2,)](gs[s], Ts[s], send_q[s].view(torch.bfloat16), send_s[s], ep, T_max, T_max * H, ws[s],
                               send_w[s], H=H, CHUNK=64, MX=False, MODE=0, INT_ROUND=True, K=k,
                               K_POW2=triton.next_power_of_2(k), WEIGHTS=True)
        assert torch.equal(send_q[s][0], copy0[s])  # the other copy is not written
        assert torch.equal(send_q[s][1].view(torch.bfloat16)[: Ts[s]].view(torch.int16), gs[s].view(torch.int16))
        assert torch.equal(send_w[s][1, : Ts[s]], ws[s])
        push_entries_kernel[(2,)](plans[s].dest_rank, plans[s].dest_row, Ts[s], ptrs(lists), ptrs(flags), ep, s, W,
                                  T_max, K=k, EW=EW, BLOCK=4)
    B = 1 if mx else 2
    for d in range(W):
        n_rows = int(plans[d].num_rows)
        R = n_rows + 5
        o = row_origins(plans[d], R)
        out = torch.randint(0, 256, (R, H * B), dtype=torch.uint8, generator=g)
        srows = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
        pull_weighted_kernel[(3,)](out if mx else out.view(torch.bfloat16), srows, plans[d].num_rows, o.src, R,
                                   ptrs(send_q), ptrs(send_w), lists[d], ep, T_max, W, T_max * H, H=H, CHUNK=32, K=k,
                                   EW=EW, MX=mx, MODE=0, INT_ROUND=True, ZCHUNK=4)
        want = torch.zeros(R, H * B, dtype=torch.uint8)
        real = torch.zeros(R, dtype=torch.bool)
        for s in range(W):
            for t in range(Ts[s]):
                for j in range(k):
                    if int(plans[s].dest_rank[t, j]) != d:
                        continue
                    r = int(plans[s].dest_row[t, j])
                    prod = ws[s][t, j] * gs[s][t].float()
                    real[r] = True
                    if mx:
                        q = quantize(prod[None], mode="rceil")
                        want[r] = q.qdata.view(torch.uint8)[0]
                        assert torch.equal(srows[r], q.scales.view(-1)), (s, t, j)
                    else:
                        want[r] = prod.to(torch.bfloat16).view(torch.uint8)
        assert int(real.sum()) == int(plans[d].num_recv)
        if mx:
            assert torch.equal(out, want)
        else:  # bit-exact, except that a NaN is any NaN (torch keeps the product's NaN payload, the kernel one NaN)
            o, wv = out.view(torch.bfloat16), want.view(torch.bfloat16)
            assert torch.equal(o.isnan(), wv.isnan())
            assert torch.equal(torch.where(o.isnan(), 0, o.view(torch.int16)), torch.where(wv.isnan(), 0, wv.view(torch.int16)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through combine)")
@pytest.mark.parametrize("E,k,mode", [(8, 3, "quant"), (6, 4, "pass"), (4, 2, "bf16"), (5, 5, "quant")])
def test_combine_reduce_reads_own_rows_on_one_rank(E, k, mode):
    """One rank (``OWN``): the reduce reads every slot's row straight from the expert output at its dispatch row -
    bf16 rows quantized in registers, MXFP8 rows (``OWN_PASS``) or bf16 as they are - and equals the oracle; the
    comb_q buffer it would otherwise read holds garbage. Dropped slots, a NaN row (poisons exactly its tokens),
    a token count that does not fill the last program, ``k`` not a power of two."""
    from mxcomm.ep.nvshmem_kernels import combine_reduce_kernel
    from mxcomm.mx import quantize

    g = torch.Generator().manual_seed(E * 10 + k)
    H, T, align = 96, 11, 32
    mx, passthrough = mode != "bf16", mode == "pass"
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=T, align=align)
    idx = _routing(1, T, E, k, g, drop=0.2)
    _, routes = oracle_dispatch(cfg, [torch.randn(T, H, generator=g).to(torch.bfloat16)], [idx])
    plan = build_plan(local_counts(idx, E)[None], idx, 0, align)
    out = (torch.randn(int(plan.num_rows), H, generator=g) * 3).to(torch.bfloat16)
    out[int(plan.dest_row[4, 0])] = float("nan") if int(plan.dest_row[4, 0]) >= 0 else 0.0
    w = torch.rand(T, k, generator=g)
    if passthrough:
        qt = quantize(out)
        own, own_s = qt.qdata.view(torch.uint8).contiguous(), qt.row_scales().contiguous()
    else:
        own, own_s = out, torch.zeros(1, dtype=torch.uint8)
    nslot = T * k
    comb_q = torch.randint(0, 256, (2, nslot, 2 * H), dtype=torch.uint8, generator=g)  # never read
    comb_s = torch.randint(0, 256, (2, nslot, H // 32), dtype=torch.uint8, generator=g)
    y = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    combine_reduce_kernel[(3,)](comb_q if mx else comb_q.view(torch.bfloat16), comb_s, plan.send_pos, w, y, T,
                                torch.tensor([1]), nslot, plan.dest_row, own, own_s, H=H, K=k, CHUNK=64, MX=mx,
                                INT_ROUND=True, OWN=True, OWN_PASS=passthrough, MODE=0)
    want = oracle_combine(cfg, [out], routes, [w], mx)[0]
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    assert torch.equal(torch.isnan(y), torch.isnan(want))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("E,k,align,tail,programs", [(8, 3, 32, 0, 3), (5, 2, 128, 40, 7), (4, 4, 32, 7, 2)])
def test_dispatch_kernel_zero_pad_zeroes_exactly_the_unfilled_rows(E, k, align, tail, programs):
    """The local path's ``dispatch_kernel(ZERO_PAD=True)``: every padding row of every group (and, worst-case sized,
    the ``tail`` rows past ``n_rows``) becomes zero; every real row holds what the same kernel without ``ZERO_PAD``
    stores there. Empty groups, a group with every token, odd counts, fewer programs than groups."""
    from mxcomm.ep.nvshmem_kernels import dispatch_kernel

    g = torch.Generator().manual_seed(E + k + tail)
    T, H = 13, 64
    idx = _routing(1, T, E, k, g, drop=0.2)
    idx[:, 0] = 1  # expert 1 gets every token
    idx[idx == 0] = -1  # expert 0 gets none
    plan = build_plan(local_counts(idx, E)[None], idx, 0, align)
    R = int(plan.num_rows) + tail
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    garbage = torch.randint(1, 256, (R, H), dtype=torch.uint8, generator=g)  # no zero byte anywhere
    outs, scales = {}, {}
    # (ZERO_PAD, OUT_DIRECT): the output through an address table, or passed itself (what the backend launches)
    for zero_pad, direct in ((False, False), (True, False), (True, True)):
        out, s = garbage.clone(), torch.zeros(R, H // 32, dtype=torch.uint8)
        ptrs = torch.tensor([out.data_ptr()], dtype=torch.int64)
        dispatch_kernel[(programs,)](
            x, T, plan.dest_rank, plan.dest_row, out if direct else ptrs, torch.tensor([s.data_ptr()], dtype=torch.int64),
            ptrs, 0, 1, torch.zeros(1), plan.offs, plan.expert_counts, plan.num_rows, R, E, H=H, K=k, CHUNK=H, MX=True,
            MODE=0, INT_ROUND=True, WEIGHTED=False, ARRIVE=False, ZERO_PAD=zero_pad, OUT_DIRECT=direct)
        outs[zero_pad, direct], scales[zero_pad, direct] = out, s
    real = torch.zeros(R, dtype=torch.bool)
    real[plan.dest_row[plan.dest_row >= 0].long()] = True
    assert int(real.sum()) == int(plan.expert_counts.sum()) and int((~real).sum()) > 0
    plain = outs[False, False]
    assert torch.equal(plain[~real], garbage[~real])  # without ZERO_PAD those rows are not touched
    for key in ((True, False), (True, True)):
        assert torch.equal(outs[key][real], plain[real]), key
        assert torch.equal(scales[key], scales[False, False]), key
        assert not outs[key][~real].any(), key


_SCALE_CASES = [(4, 7, 32, 0), (3, 224, 128, 0), (5, 12, 32, 40), (1, 4, 32, 0)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (the GPU suite covers it through dispatch)")
@pytest.mark.parametrize("El,C,align,n_rows_cut,word",
                         [c + (False,) for c in _SCALE_CASES] + [c + (True,) for c in _SCALE_CASES if c[1] % 4 == 0])
def test_scale_rows_to_grouped_kernel_matches_to_grouped_m(El, C, align, n_rows_cut, word):
    """The receiver's swizzle == mxcomm.mx.to_grouped_m of the real rows (each group's first ``count`` rows):
    empty groups and padding rows give zeros, rows past ``n_rows`` are ignored, every output byte is written.
    ``word``: the 4-byte-column variant (what the backend runs when ``C % 4 == 0``)."""
    import triton
    from mxcomm.ep.nvshmem_kernels import scale_rows_to_grouped_kernel
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
        G_POW2=triton.next_power_of_2(El), WORD=word)
    assert torch.equal(out[: want.shape[0]], want)
    assert not out[want.shape[0]:].any()  # rows past the groups: zeros (written, not left at 0xAB)


def _loopback_backend(cfg):
    from mxcomm.ep.nvshmem_backend import NvshmemBackend

    puts = LoopbackPuts() if cfg.transport == "put" else None
    be = NvshmemBackend(cfg, None, 0, 1, heap=LoopbackHeap(), puts=puts)
    assert be.put_mode == (cfg.transport == "put")
    assert be.path == {"auto": "local", "push": "push", "put": "put"}[cfg.transport]  # one rank
    assert be.memory_bytes == EPGroup.buffer_bytes(cfg, 1, put_path=be.put_mode)  # the report is what it allocates
    return be


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("transport", ["auto", "push", "put"])
@pytest.mark.parametrize("plan_impl", ["torch", "triton"])
@pytest.mark.parametrize("precision,align,H", [("mxfp8", 32, 64), ("mxfp8", 128, 96), ("bf16", 32, 64)])
def test_nvshmem_kernels_loopback_match_oracle(precision, align, H, plan_impl, transport):
    from mxcomm.ep.nvshmem_backend import handle_origins, row_origins

    E, k, T = 4, 2, 9
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=16, align=align, precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    be.plan_impl = plan_impl
    g = torch.Generator().manual_seed(7)
    for it in range(2):  # second call reuses the buffers (epochs, stale scale bytes)
        x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
        x[1, 3] = float("nan")
        idx = _routing(1, T, E, k, g, drop=0.2)
        idx[2] = torch.tensor([1, -1])
        w = torch.rand(T, k, generator=g)
        res, handle = be.dispatch(x, idx, w)
        wants, routes = oracle_dispatch(cfg, [x], [idx])
        want = wants[0]
        assert torch.equal(res.offs, want.offs) and torch.equal(res.counts, want.counts)
        # row origins: kept by the dispatch, or (local path) computed from the plan only when a later op needs them
        assert (handle.backend_state.origins is None) == (transport == "auto")
        o, o_ref = handle_origins(handle), row_origins(handle.plan, handle.num_rows)
        assert torch.equal(o.src, o_ref.src) and torch.equal(o.pos, o_ref.pos)
        if precision == "mxfp8":
            assert torch.equal(res.x.qdata.view(torch.uint8), want.x.qdata.view(torch.uint8))
            assert torch.equal(res.x.scales, want.x.scales)
        else:
            assert torch.equal(res.x.view(torch.int16), want.x.view(torch.int16))
        out = (torch.randn(res.num_rows, H, generator=g)).to(torch.bfloat16)
        for q in ([True, False] if precision == "mxfp8" else [False]):
            y = be.combine(out, handle, q)
            ref = oracle_combine(cfg, [out], routes, [w], q)[0]
            torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    if transport == "put":  # dispatch: counts + 2 data puts, 2 waits, 1 quiet; combine: 2 puts, 1 wait, 1 quiet
        nd, nc = 2, 2 * (2 if precision == "mxfp8" else 1)
        assert be.puts.calls == {"put": 3 * nd + 2 * nc, "wait": 2 * nd + nc, "quiet": nd + nc}


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("plan_impl", ["torch", "triton"])
def test_no_sync_mode_drops_bad_ids_and_raises(plan_impl):
    """exact_sizes=False checks ids on the device: a bad id is dropped (nothing written out of bounds),
    the rest of the rows arrive, and the error is raised (here at once: the interpreter is synchronous)."""
    from mxcomm.ep.nvshmem_backend import NvshmemBackend

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
    assert torch.equal(res.x.qdata.view(torch.uint8), want[0].x.qdata.view(torch.uint8))


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
    assert torch.equal(res.x.scales, want[0].x.scales)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU the nvshmem autograd tests run this path")
@pytest.mark.parametrize("transport", ["auto", "push", "put"])
@pytest.mark.parametrize("plan_impl", ["torch", "triton"])
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_nvshmem_backward_loopback_match_oracle(precision, plan_impl, transport):
    from mxcomm.ep.reference.oracle import oracle_combine_backward, oracle_dispatch_backward

    E, k, T, H = 4, 2, 7, 64
    q = precision == "mxfp8"
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    be.plan_impl = plan_impl
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = _routing(1, T, E, k, g, drop=0.2)
    w = torch.rand(T, k, generator=g)
    res, handle = be.dispatch(x, idx, w)
    wants, routes = oracle_dispatch(cfg, [x], [idx])
    out = torch.randn(res.num_rows, H, generator=g).to(torch.bfloat16)
    y, saved = be.combine_for_backward(out, handle, q)
    torch.testing.assert_close(y.float(), oracle_combine(cfg, [out], routes, [w], q)[0].float(), rtol=1e-2, atol=1e-2)
    gy = torch.randn(T, H, generator=g).to(torch.bfloat16)
    got = be.combine_backward(gy, handle, saved, q)
    want = oracle_combine_backward(cfg, [gy], routes, [w], [out], wants, q)[0]
    if q:
        assert torch.equal(got.grad_expert_out.qdata.view(torch.uint8), want.grad_expert_out.qdata.view(torch.uint8))
        assert torch.equal(got.grad_expert_out.scales, want.grad_expert_out.scales)
    else:
        assert torch.equal(got.grad_expert_out.view(torch.int16), want.grad_expert_out.view(torch.int16))
    torch.testing.assert_close(got.grad_weights, want.grad_weights, rtol=1e-3, atol=1e-3)
    grad_recv = torch.randn(res.num_rows, H, generator=g).to(torch.bfloat16)
    for gr in ([grad_recv, got.grad_expert_out] if q else [grad_recv]):
        gx = be.dispatch_backward(gr, handle, q)
        torch.testing.assert_close(gx.float(), oracle_dispatch_backward(cfg, [gr], routes, q)[0].float(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU the nvshmem autograd tests run this path")
@pytest.mark.parametrize("transport", ["auto", "push"])
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
    assert torch.equal(got.grad_expert_out.scales, want.grad_expert_out.scales)
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

    from mxcomm.ep.nvshmem_backend import NvshmemBackend
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
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxcomm.ep import nvshmem_kernels as nk

def compile(fn, types, **consts):
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert ptx
    return ptx

i32, i64, u8 = "*i32", "*i64", "*u8"
disp = dict(x_ptr="*bf16", dest_rank_ptr=i32, dest_row_ptr=i32, q_peers=i64, s_peers=i64, flags_peers=i64,
            w_ptr="*fp32", offs_ptr=i32, counts_ptr=i32, n_rows_ptr=i32)
for arrive in (True, False):  # peer-pointer path, put path
    for weighted in (False, True):
        for mx in (True, False):
            ptx = compile(nk.dispatch_kernel, disp, H=7168, K=8, CHUNK=2048, MX=mx, MODE=0, INT_ROUND=False,
                          WEIGHTED=weighted, ARRIVE=arrive, ZERO_PAD=False, OUT_DIRECT=False)
            # the payload stores (through _store_slot, to a pointer read from the peer table) stay 16-byte vectors:
            # without the alignment hints every peer store over NVLink would be a single byte
            assert "st.global.v4.b32" in ptx, (arrive, weighted, mx)
send = dict(out_ptr="*bf16", n_rows_ptr=i32, row_src_ptr=i32, row_pos_ptr=i32, q_peers=i64, s_peers=i64,
            flags_peers=i64, epoch_ptr=i64, in_scales_ptr=u8)
for staged in (False, True):
    for mx in (False, True):
        compile(nk.combine_send_kernel, send, H=256, BR=4, CHUNK=256, MX=mx, MODE=0, INT_ROUND=False, PASS=False,
                STAGED=staged)
compile(nk.combine_send_kernel, dict(send, out_ptr=u8), H=256, BR=4, CHUNK=256, MX=True, MODE=0, INT_ROUND=False,
        PASS=True, STAGED=True)
red = dict(comb_q_ptr=u8, comb_s_ptr=u8, send_pos_ptr=i32, w_ptr="*fp32", y_ptr="*bf16", epoch_ptr=i64,
           dest_row_ptr=i32, own_ptr="*bf16", own_s_ptr=u8)
for own, own_pass in ((False, False), (True, False), (True, True)):  # rows from comb_q; one rank: bf16 / MXFP8 rows
    compile(nk.combine_reduce_kernel, dict(red, own_ptr=u8) if own_pass else red, H=7168, K=8, CHUNK=4096, MX=True,
            INT_ROUND=False, OWN=own, OWN_PASS=own_pass, MODE=0)
for own in (False, True):  # BF16 transport
    compile(nk.combine_reduce_kernel, dict(red, comb_q_ptr="*bf16"), H=7168, K=8, CHUNK=4096, MX=False,
            INT_ROUND=False, OWN=own)
sc = dict(offs_ptr=i32, n_rows_ptr=i32, counts_ptr=i32)
compile(nk.scale_rows_to_grouped_kernel, dict(sc, rows_ptr=u8, out_ptr=u8), C=228, CB=32, G_POW2=256, WORD=False)
compile(nk.scale_rows_to_grouped_kernel, dict(sc, rows_ptr=i32, out_ptr=i32), C=224, CB=64, G_POW2=256, WORD=True)
compile(nk.copy_out_rows_kernel, dict(src_ptr=i64, dst_ptr=i64, n_rows_ptr=i32, row_src_ptr=i32), ROW_WORDS=896,
        CHUNK=512)
for weighted in (False, True):  # local path: straight into the output; the unfilled rows zeroed by the same launch
    for mx in (True, False):
        ptx = compile(nk.dispatch_kernel, dict(disp, q_peers=u8 if mx else "*bf16"), H=7168, K=8, CHUNK=4096, MX=mx,
                      MODE=0, INT_ROUND=False, WEIGHTED=weighted, ARRIVE=False, ZERO_PAD=True, OUT_DIRECT=True)
        assert "st.global.v4.b32" in ptx, ("local", weighted, mx)
for mx in (True, False):
    compile(nk.pull_rows_kernel, dict(dst_ptr=i64, dst_s_ptr=u8, n_rows_ptr=i32, row_src_ptr=i32, q_peers=i64,
            s_peers=i64, list_ptr=i32, epoch_ptr=i64), ROW_WORDS=896 if mx else 1792, CHUNK=512, C=224, C_POW2=256,
            K=8, EW=16, MX=mx)
for mx in (True, False):
    for slot in (True, False):  # x by address (the backend), x as a tensor (the kernel lab)
        ptx = compile(nk.pack_rows_kernel, dict(x_ptr=i64 if slot else "*bf16", send_q_ptr=u8 if mx else "*bf16",
                      send_s_ptr=u8, epoch_ptr=i64, w_ptr="*fp32", send_w_ptr="*fp32"), H=7168, CHUNK=2048, MX=mx,
                      MODE=0, INT_ROUND=False, X_SLOT=slot, K=1, K_POW2=1, WEIGHTS=False)
        assert "st.global.v4.b32" in ptx, ("pack", mx, slot)
# combine backward, pull path: the BF16 rows + weights packed; the receiver weights and quantizes per slot
compile(nk.pack_rows_kernel, dict(x_ptr="*bf16", send_q_ptr="*bf16", send_s_ptr=u8, epoch_ptr=i64, w_ptr="*fp32",
        send_w_ptr="*fp32"), H=7168, CHUNK=2048, MX=False, MODE=0, INT_ROUND=False, X_SLOT=False, K=8, K_POW2=8,
        WEIGHTS=True)
for mx in (True, False):
    ptx = compile(nk.pull_weighted_kernel, dict(dst_ptr=u8 if mx else "*bf16", dst_s_ptr=u8, n_rows_ptr=i32,
                  row_src_ptr=i32, g_peers=i64, w_peers=i64, list_ptr=i32, epoch_ptr=i64), H=7168, CHUNK=2048, K=8,
                  EW=16, MX=mx, MODE=0, INT_ROUND=False, ZCHUNK=512)
    assert "st.global.v4.b32" in ptx, ("pull weighted", mx)
compile(nk.push_entries_kernel, dict(dest_rank_ptr=i32, dest_row_ptr=i32, list_peers=i64, flags_peers=i64,
        epoch_ptr=i64), K=8, EW=16, BLOCK=64)
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
    from mxcomm.ep.nvshmem_backend import NvshmemBackend
    from mxcomm.transport import PeerTimeout

    cfg = EPConfig(num_experts=4, hidden=32, topk=2, max_tokens_per_rank=4, backend="nvshmem", num_sms=1,
                   timeout_s=0.5, transport="put")
    puts = LoopbackPuts(world=2)
    be = NvshmemBackend(cfg, None, 0, 2, heap=TwoRankHeap(), puts=puts)
    with pytest.raises(PeerTimeout) as ei:
        be.dispatch(torch.randn(3, 32).to(torch.bfloat16), torch.tensor([[0, 2], [1, 3], [2, -1]]), torch.ones(3, 2))
    assert ei.value.peer == 1
    assert puts.calls["wait"] >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs this path for real")
@pytest.mark.parametrize("transport", ["auto", "push"])
def test_dispatch_sequence_of_token_counts_matches_oracle(transport):
    """One backend, consecutive dispatches of 5, 0, 7 (every token to one expert) and 3 tokens: the pull path's
    send copies alternate by epoch and its row-token map holds stale entries from earlier calls; every output
    must still equal the oracle (payload, scales, offsets), including the empty call."""
    E, k, H = 4, 2, 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, backend="nvshmem", num_sms=1,
                   timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    g = torch.Generator().manual_seed(11)
    for T in (5, 0, 7, 3):
        x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
        if T == 7:
            idx = torch.tensor([[2, -1]] * T)  # all tokens to expert 2, second slot dropped
        else:
            idx = _routing(1, T, E, k, g, drop=0.2)
        res, _ = be.dispatch(x, idx, torch.rand(T, k, generator=g))
        want = oracle_dispatch(cfg, [x], [idx])[0][0]
        assert torch.equal(res.offs, want.offs) and torch.equal(res.counts, want.counts), T
        assert torch.equal(res.x.qdata.view(torch.uint8), want.x.qdata.view(torch.uint8)), T
        assert torch.equal(res.x.scales, want.x.scales), T


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; on a GPU, test_nvshmem_gpu.py runs combine for real")
@pytest.mark.parametrize("transport", ["auto", "push"])
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_combine_ignores_weights_of_dropped_slots(transport, precision):
    """A dropped slot adds nothing to combine, whatever its weight holds (NaN, Inf): the reduce masks the slot
    through its scalar weight (one-rank reduce reading the expert output, and the reduce of returned rows)."""
    E, k, T, H = 4, 3, 6, 64
    q = precision == "mxfp8"
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=8, precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=5.0, transport=transport)
    be = _loopback_backend(cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[0, -1, 2], [-1, -1, 1], [3, 0, -1], [-1, 2, 3], [1, -1, -1], [2, 3, 0]])
    w = torch.rand(T, k, generator=g)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e38])
    w[idx < 0] = bad.repeat(4)[:int((idx < 0).sum())]
    res, handle = be.dispatch(x, idx, w)
    _, routes = oracle_dispatch(cfg, [x], [idx])
    out = torch.randn(res.num_rows, H, generator=g).to(torch.bfloat16)
    y = be.combine(out, handle, q)
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), oracle_combine(cfg, [out], routes, [w], q)[0].float(), rtol=1e-2, atol=1e-2)
