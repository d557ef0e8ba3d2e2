"""The nvshmem backend's put-with-signal path with several ranks on CPU: one thread per rank, each running
the real ``NvshmemBackend`` (its Triton kernels under the interpreter, one kernel at a time) over its own
in-process "symmetric heap", with NVSHMEM's put-with-signal / signal wait / quiet replaced by byte copies
between the ranks' buffers and a condition variable. Everything else is the backend's own code: the count
exchange, the block entries, the signal counts per epoch, the combine copies by parity, the receiver's
scale swizzle. Dispatch and combine backward's rows are compared with the single-process oracle, combine and
dispatch backward with the plain-torch spec of one row per (token, rank) (tests/ep/combine_spec.py), all bit-exact.
The CUDA kernels themselves run in the GPU tests."""
import threading
import time

import pytest
import torch

from heap_fakes import FakeBuf, FakeCtx
from rank_inputs import in_group_tile_rows, rank_inputs, real_rows, refusal_clean_absent
from status_reads import status_reads
from mxcomm.ep import EPConfig
from mxcomm.ep.reference.oracle import oracle_combine_backward, oracle_dispatch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU tests run this path")


class RankHeap:
    """One rank's buffers (CPU tensors). Peer pointers are unused on the put path (all point to itself).
    ``alloc`` is collective like NVSHMEM's: it returns once every rank has allocated that buffer."""

    def __init__(self, rank: int, world: int, barrier: threading.Barrier):
        self.ctx = FakeCtx(torch.device("cpu"), rank, world)
        self.bufs = {}
        self.barrier = barrier

    def alloc(self, name, shape, dtype):
        t = torch.zeros(shape, dtype=dtype)
        self.bufs[name] = FakeBuf(t, torch.full((self.ctx.world,), t.data_ptr(), dtype=torch.int64))
        self.barrier.wait(timeout=60)
        return self.bufs[name]

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self.bufs.values())

    def locate(self, t: torch.Tensor) -> tuple[str, int]:
        """(buffer name, byte offset) of a tensor (or view) inside this heap."""
        p = t.data_ptr()
        for name, b in self.bufs.items():
            base = b.local.data_ptr()
            if base <= p < base + b.nbytes:
                return name, p - base
        raise AssertionError("a put/wait argument outside the symmetric heap")

    def flat(self, name: str) -> torch.Tensor:
        return self.bufs[name].local.reshape(-1).view(torch.uint8)


class ThreadWorld:
    """The ranks' heaps and the stand-in for NVSHMEM between them (one lock for all copies and signals)."""

    def __init__(self, world: int):
        barrier = threading.Barrier(world)
        self.heaps = [RankHeap(r, world, barrier) for r in range(world)]
        self.cv = threading.Condition()

    def puts(self, rank: int) -> "ThreadPuts":
        return ThreadPuts(self, rank)


class ThreadPuts:
    """``mxcomm.ep.nvshmem.put_path.Puts`` for rank ``rank`` of a :class:`ThreadWorld` (same arguments and semantics:
    range-checked entries, ``entries * chunks`` added to the destination's signal word, bounded waits that give up
    once the error word is set)."""

    def __init__(self, world: ThreadWorld, rank: int):
        self.w, self.rank = world, rank

    def put(self, dst, src, batch, signals, signal_index, err, chunks):
        from mxcomm.transport.errors import error_word
        from mxcomm.transport.put_signal import BAD_ENTRY_CODE

        heaps = self.w.heaps
        dname, doff = heaps[self.rank].locate(dst)
        sname, soff = heaps[self.rank].locate(signals) if signals is not None else (None, 0)
        cap = dst.numel() * dst.element_size()
        srcb = src.reshape(-1).view(torch.uint8)
        with self.w.cv:
            per_pe = {}
            for i in range(batch.n):
                pe, n = int(batch.pes[i]), int(batch.nbytes[i])
                do, so = int(batch.dst_offsets[i]), int(batch.src_offsets[i])
                if not 0 <= pe < len(heaps) or min(n, do, so) < 0 or do + n > cap or so + n > srcb.numel():
                    err[0] = max(int(err[0]), error_word(BAD_ENTRY_CODE, max(pe, 0)))
                    continue
                heaps[pe].flat(dname)[doff + do:doff + do + n] = srcb[so:so + n]
                per_pe[pe] = per_pe.get(pe, 0) + 1
            for pe, cnt in per_pe.items():
                if signals is None:  # plain puts (the caller's quiet and one signal put say they arrived)
                    break
                words = heaps[pe].bufs[sname].local.reshape(-1)
                words[soff // 8 + signal_index] += cnt * chunks
            self.w.cv.notify_all()

    def wait(self, signals, indices, epoch, per_epoch, err, timeout_ns):
        from mxcomm.transport.errors import TIMEOUT_CODE, error_word

        want = int(epoch.reshape(-1)[0]) * per_epoch
        deadline = time.monotonic() + timeout_ns * 1e-9
        with self.w.cv:
            while True:
                short = [i for i in indices.tolist() if int(signals[i]) < want]
                if not short or int(err[0]):  # (an earlier wait failed: give up, record nothing, as the kernel)
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    err[0] = max(int(err[0]), error_word(TIMEOUT_CODE, short[0]))
                    return
                self.w.cv.wait(left)

    def quiet(self):
        pass


@pytest.fixture
def one_kernel_at_a_time(monkeypatch):
    """The Triton interpreter patches module state while a kernel runs: serialise launches across threads."""
    from triton.runtime.interpreter import InterpretedFunction

    lock = threading.Lock()
    run = InterpretedFunction.run

    def locked(self, *a, **k):
        with lock:
            return run(self, *a, **k)

    monkeypatch.setattr(InterpretedFunction, "run", locked)


def _run_ranks(world: ThreadWorld, fn, W: int, timeout_s: float = 240.0) -> list:
    out, errs = [None] * W, [None] * W

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below with the rank
            import traceback

            errs[r] = f"rank {r}: {type(e).__name__}: {e}\n{traceback.format_exc()}"

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout_s} s"
    bad = [e for e in errs if e]
    assert not bad, "\n".join(bad)
    return out


@pytest.mark.parametrize("W,E,k,H,T,precision,align,exact,window,hot", [
    (2, 4, 2, 64, (9, 6), "mxfp8", 32, True, None, False),
    (3, 6, 3, 96, (5, 0, 11), "mxfp8", 128, True, 10**6, False),  # a window of every row: one round
    (2, 4, 2, 64, (7, 7), "bf16", 32, True, None, False),
    (3, 9, 3, 64, (6, 4, 0), "mxfp8", 32, False, None, False),
    # dispatch through a receive window of a few rows, in rounds; every token's first slot to expert 0 (one rank gets
    # every token of every rank)
    (2, 4, 2, 64, (9, 6), "mxfp8", 32, True, 13, True),
    (3, 9, 3, 64, (6, 4, 0), "mxfp8", 32, False, 20, True),
    (2, 4, 2, 64, (7, 7), "bf16", 32, True, 24, False),
    # more ranks than slots a token: the combine direction and combine backward in rounds of T_max * k // W tokens
    (3, 6, 2, 64, (9, 4, 7), "mxfp8", 32, True, None, False),
    (4, 8, 2, 64, (5, 7, 0, 6), "bf16", 32, False, None, False),
    (3, 6, 2, 64, (8, 5, 6), "mxfp8", 32, True, 16, True),
    (3, 6, 2, 64, (6, 4, 5), "mxfp8", 32, False, 12, True),  # no-sync: the worst case's dispatch rounds
])
def test_put_path_several_ranks_forward_and_backward_match_spec(one_kernel_at_a_time, W, E, k, H, T, precision,
                                                                 align, exact, window, hot):
    """Dispatch bit-exact to the oracle (payload, the groups' scale tiles, offs, counts); combine (MXFP8 and BF16
    transport of the partials) and dispatch backward (the dense expert output as gradient, and with MXFP8 the MX
    gradient combine backward made) bit-exact to the spec's one row per (token, rank) sums; combine backward's rows
    bit-exact to the oracle's, its route-weight gradient within fp32 rounding of a float64 dot with the expert rows.
    Padding and tail rows of the expert output hold NaN (never read); two rounds (epochs, copies, signal counts).
    ``window``: the dispatch's receive window (``EPConfig.recv_window_rows``), smaller than what a rank receives.
    With ``W > k`` the combine direction and combine backward move ``T_max * k // W`` tokens of every source per
    round (``put_round_tokens``)."""
    from combine_spec import assert_bf16_same, combine as spec_combine, route_grad
    from mxcomm.ep.nvshmem.backend import NvshmemBackend
    from mxcomm.ep.plan import max_recv_rows, recv_window_rows

    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=max(T), align=align, precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=60.0, transport="put", exact_sizes=exact,
                   recv_window_rows=window)
    if window is not None:  # (the default window is below the worst case in the other cases too)
        assert (recv_window_rows(cfg, W) < max_recv_rows(cfg, W)) == (window < 10**6)
    mx = precision == "mxfp8"
    world = ThreadWorld(W)
    calls = []  # two rounds: buffers, epochs and combine copies reused
    for it in range(2):
        xs, idxs, ws = rank_inputs(W, T, E, k, H, seed=100 * W + it + 10 * exact)
        if hot:
            for idx in idxs:
                idx[idx == 0] = -1
                idx[:, 0] = 0
        wants, routes = oracle_dispatch(cfg, xs, idxs)
        g = torch.Generator().manual_seed(7 + it)
        gys = [torch.randn(T[r], H, generator=g).to(torch.bfloat16) for r in range(W)]
        calls.append((xs, idxs, ws, wants, routes, gys))
    backends = [None] * W

    def expert_out(it, r, num_rows, want):
        """The expert output of rank ``r`` in round ``it``: NaN in every row no slot fills (padding, no-sync tail)."""
        g = torch.Generator().manual_seed(1000 * it + r)
        out = (torch.randn(num_rows, H, generator=g) * 2).to(torch.bfloat16)
        real = torch.zeros(num_rows, dtype=torch.bool)
        real[real_rows(want)] = True
        out[~real] = float("nan")
        return out

    def rank_fn(r):
        be = backends[r] = NvshmemBackend(cfg, None, r, W, heap=world.heaps[r], puts=world.puts(r))
        assert be.put_mode
        rounds = be.impl._token_rounds()
        tc = max(T) if W <= k else max(T) * k // W
        if window is not None:  # (a window the user sets bounds a round's gradient rows too)
            tc = min(tc, max(1, window * (H if mx else 2 * H) // (W * 2 * H)))
        assert be.impl.round_tokens == tc and [r.start for r in rounds] == list(range(0, max(T), tc)), rounds
        assert [t for r in rounds for t in r] == list(range(max(T))), rounds  # every token once
        res = []
        for it, (xs, idxs, ws, wants, _, gys) in enumerate(calls):
            with status_reads(be.status_words) as reads:
                d, h = be.dispatch(xs[r], idxs[r], ws[r])
            # an exact-size dispatch syncs with the host once, whatever its rounds (no-sync mode: never)
            assert reads["sync"] == (1 if exact else 0), (f"round {it} rank {r}", reads)
            out = expert_out(it, r, h.num_rows, wants[r])
            y, saved = be.combine_for_backward(out, h, mx)
            y_bf16 = be.combine(out, h, False)
            cb = be.combine_backward(gys[r], h, saved, mx)
            gx = be.dispatch_backward(out, h, mx)
            gx_mx = be.dispatch_backward(cb.grad_expert_out, h, True) if mx else None
            res.append((d, out, y, y_bf16, cb, gx, gx_mx, h.plan.dest_rank.clone(), h.plan.dest_row.clone()))
        return res

    got = _run_ranks(world, rank_fn, W)
    for it, (xs, idxs, ws, wants, routes, gys) in enumerate(calls):
        outs = [got[r][it][1] for r in range(W)]
        vals = [o.float() for o in outs]
        cbs = oracle_combine_backward(cfg, gys, routes, ws, [o[: wants[r].num_rows] for r, o in enumerate(outs)],
                                      wants, mx)
        mx_vals = [got[r][it][4].grad_expert_out.dequantize(torch.float32, saturate_to=torch.bfloat16)
                   for r in range(W)] if mx else None
        for r in range(W):
            d, _, y, y_bf16, cb, gx, gx_mx, dr, drow = got[r][it]
            tag = f"round {it} rank {r}"
            n = int(wants[r].offs[-1])  # the real rows (no-sync outputs have R_max rows, the tail not written)
            assert d.num_rows == (n if exact else backends[r].R_max), tag
            assert torch.equal(d.offs, wants[r].offs) and torch.equal(d.counts, wants[r].counts), tag
            rows = in_group_tile_rows(d.offs)  # (the tile-rows past the groups: see test_nvshmem_dataflow)
            if mx:
                assert torch.equal(d.x.qdata.view(torch.uint8)[:n], wants[r].x.qdata.view(torch.uint8)[:n]), tag
                assert torch.equal(d.x.scales[:rows], wants[r].x.scales[:rows]), tag
                assert torch.equal(cb.grad_expert_out.qdata.view(torch.uint8)[:n],
                                   cbs[r].grad_expert_out.qdata.view(torch.uint8)[:n]), tag
                assert torch.equal(cb.grad_expert_out.scales[:rows], cbs[r].grad_expert_out.scales[:rows]), tag
            else:
                assert torch.equal(d.x.view(torch.int16)[:n], wants[r].x.view(torch.int16)[:n]), tag
                assert torch.equal(cb.grad_expert_out.view(torch.int16)[:n],
                                   cbs[r].grad_expert_out.view(torch.int16)[:n]), tag
            assert_bf16_same(y, spec_combine(dr, drow, vals, ws[r], mx), f"{tag} combine")
            assert_bf16_same(y_bf16, spec_combine(dr, drow, vals, ws[r], False), f"{tag} combine bf16")
            assert_bf16_same(gx, spec_combine(dr, drow, vals, None, mx), f"{tag} dispatch backward")
            if mx:
                assert_bf16_same(gx_mx, spec_combine(dr, drow, mx_vals, None, True), f"{tag} MX dispatch backward")
            want_gw = torch.zeros(T[r], k, dtype=torch.float64)
            for p in range(W):
                want_gw = torch.where(dr == p, route_grad(torch.where(dr == p, drow, -1), gys[r], outs[p]), want_gw)
            torch.testing.assert_close(cb.grad_weights, want_gw.float(), rtol=1e-5, atol=1e-4, msg=tag)
    for be in backends:  # every wait was satisfied: no error word set
        assert int(be.err[0]) == 0
    if window is not None and window < 10**6:  # the dispatches went in rounds: handshakes between them
        from mxcomm.ep.plan import FLAG_ROWS

        assert all(int(be.impl._expect[FLAG_ROWS.index("window")]) > 0 for be in backends)


@pytest.mark.parametrize("window", [None, 8])
def test_put_path_refusal_then_clean_call_then_absent_peer(one_kernel_at_a_time, window):
    """Bad input and a missing peer on the put path (also in rounds), two ranks as threads: the rank whose ids hold an
    expert id out of range raises the detailed ValueError and the other a PeerTimeout saying that rank refused, both
    before any row is put (the refusal word travels with the counts); the next dispatch and combine on both ranks
    are exact (the group stays usable); then a rank that never enters the dispatch makes the other's bounded wait
    raise PeerTimeout naming it, within its timeout."""
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    W, T, E, k, H = 2, (6, 5), 4, 2, 64
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=6, precision="bf16", backend="nvshmem",
                   num_sms=1, timeout_s=2.0, transport="put", recv_window_rows=window)
    world = ThreadWorld(W)
    xs, idxs, ws = rank_inputs(W, T, E, k, H, seed=9)
    want = oracle_dispatch(cfg, xs, idxs)[0]

    def rank_fn(r):
        be = NvshmemBackend(cfg, None, r, W, heap=world.heaps[r], puts=world.puts(r))
        return refusal_clean_absent(be, r, xs, idxs, ws, want[r], cfg.timeout_s)

    out = _run_ranks(world, rank_fn, W)
    assert out[0] == [("PeerTimeout", 1, True), True, ("PeerTimeout", 1, True)], out
    assert out[1] == [("ValueError", True), True], out


def test_put_path_peer_gone_mid_backward_fails_after_one_timeout(one_kernel_at_a_time):
    """Three ranks of top-2 (combine backward in rounds, a dozen signal waits a call): rank 2 stops after the forward
    combine; the others' combine backward raises PeerTimeout naming it after about one ``timeout_s`` - the first wait
    that fails sets the error word and every later wait of the call gives up at once (``mx_wait_signals``, like the
    Triton waits), rather than each waiting out its own timeout."""
    from mxcomm.ep.nvshmem.backend import NvshmemBackend
    from mxcomm.transport.errors import PeerTimeout

    W, T, E, k, H, timeout = 3, (6, 5, 6), 6, 2, 64, 1.0
    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=6, precision="bf16", backend="nvshmem",
                   num_sms=1, timeout_s=timeout, transport="put")
    world = ThreadWorld(W)
    xs, idxs, ws = rank_inputs(W, T, E, k, H, seed=21)

    def rank_fn(r):
        be = NvshmemBackend(cfg, None, r, W, heap=world.heaps[r], puts=world.puts(r))
        assert len(be.impl._token_rounds()) == 2
        _, h = be.dispatch(xs[r], idxs[r], ws[r])
        out = torch.randn(h.num_rows, H).to(torch.bfloat16)
        _, saved = be.combine_for_backward(out, h, False)
        if r == 2:
            return None
        start = time.monotonic()
        try:
            be.combine_backward(torch.randn(T[r], H).to(torch.bfloat16), h, saved, False)
        except PeerTimeout as e:
            return e.peer, time.monotonic() - start
        return "combine backward completed without rank 2"

    out = _run_ranks(world, rank_fn, W)
    for r in (0, 1):
        peer, took = out[r]
        assert peer == 2 and took < 2.5 * timeout, out
