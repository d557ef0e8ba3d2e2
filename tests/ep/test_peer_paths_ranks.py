"""The nvshmem backend's peer-pointer paths (pull, and push) with several ranks on CPU: one process per rank, each
running the real ``NvshmemBackend`` (its Triton kernels under the interpreter) over a symmetric heap that is one
shared-memory file mapped at the same address in every process (``heap_fakes.SharedHeap``), so peer pointers are
plain addresses and the kernels' loads, stores, flags and bounded waits go between the processes as they go between
GPUs. Nothing is replaced but the heap: the counts exchange, the pack with the route weights, the plan, the pull list
and its wait, the gather, the combine without and with the weights' exchange, both backward passes, a refusal and an
absent peer. Dispatch and combine
backward's rows are compared with the single-process oracle, combine and dispatch backward with the plain-torch spec
of one row per (token, rank) (tests/ep/combine_spec.py), all bit-exact. The CUDA kernels themselves run in the GPU
tests."""
import dataclasses
import os
import time

import pytest
import torch

from _dist import run_world
from rank_inputs import in_group_tile_rows, rank_inputs, real_rows, refusal_clean_absent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU tests run this path")

_PER_RANK = 64 << 20  # bytes of heap per rank (sparse: only what the buffers use is touched)
_BASES = (0x3E0000000000, 0x2E0000000000, 0x1E0000000000)  # addresses tried for the mapping, the same in every rank


def _heap_file(tmp_path, world: int) -> str:
    """A zeroed shared-memory file of ``world`` heaps (``/dev/shm`` where there is one)."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = os.path.join(d, f"mxcomm-test-heap-{os.getpid()}-{world}-{id(tmp_path)}")
    with open(path, "wb") as f:
        f.truncate(world * _PER_RANK)
    return path


def _backend(rank, world, path, base, cfg):
    import torch.distributed as dist

    from heap_fakes import SharedHeap
    from mxcomm.ep.nvshmem.launch_config import LaunchConfig
    from mxcomm.ep.nvshmem.backend import NvshmemBackend

    heap = SharedHeap(path, base, rank, world, _PER_RANK)
    # a few programs per kernel (the interpreter runs them one by one), uneven counts; the config's other settings
    launch = dataclasses.replace(cfg.launch or LaunchConfig(), dispatch_per_sm=3, partials_per_sm=3,
                                 route_grad_per_sm=2)
    be = NvshmemBackend(dataclasses.replace(cfg, launch=launch), None, rank, world, heap=heap)
    assert be.path == cfg.transport, be.path
    dist.barrier()  # every rank's buffers exist before any rank writes into them
    return be


def _paths_worker(rank, world, path, base, cfg, rounds, seed, hot_rounds=()):
    """One round per entry of ``rounds`` (every rank's token count) of dispatch, combine (the dispatch's weights:
    nothing exchanged; other weights: exchanged), both backward passes on this rank, checked against the oracle and
    the spec; in the rounds of ``hot_rounds`` every rank routes to rank 0's experts only. Returns ("ok", the
    pull path's exact-size dispatches that brought more rows than their output held) (a failed check raises)."""
    from combine_spec import assert_bf16_same, combine as spec_combine, route_grad
    from mxcomm.ep.handle import with_weights
    from mxcomm.ep.plan import FLAG_ROWS
    from mxcomm.ep.reference.oracle import oracle_combine_backward, oracle_dispatch
    from status_reads import status_reads

    be = _backend(rank, world, path, base, cfg)
    E, k, H, mx, exact = cfg.num_experts, cfg.topk, cfg.hidden, cfg.precision == "mxfp8", cfg.exact_sizes
    wrow = FLAG_ROWS.index("weights")
    seen, overflows = {}, 0  # the pull path's output rows by token count; calls that brought more than it held
    for it, T in enumerate(rounds):  # buffers, epochs, copies and flags reused
        xs, idxs, ws = rank_inputs(world, T, E, k, H, seed + it, hot=be.El if it in hot_rounds else None)
        wants, routes = oracle_dispatch(cfg, xs, idxs)
        g = torch.Generator().manual_seed(seed + 100 + it)
        gys = [torch.randn(T[r], H, generator=g).to(torch.bfloat16) for r in range(world)]
        outs = []
        for r in range(world):  # every rank's expert output, NaN in the rows no slot fills
            go = torch.Generator().manual_seed(seed + 1000 * it + r)
            rows = wants[r].num_rows if exact else be.R_max
            o = (torch.randn(rows, H, generator=go) * 2).to(torch.bfloat16)
            real = torch.zeros(rows, dtype=torch.bool)
            real[real_rows(wants[r])] = True
            o[~real] = float("nan")
            outs.append(o)
        tag = f"round {it} rank {rank}"
        epoch0 = int(be.impl._window_epoch) if cfg.transport == "push" else 0
        with status_reads(be.status_words) as reads:
            d, h = be.dispatch(xs[rank], idxs[rank], ws[rank])
        # an exact-size dispatch syncs with the host once, on every path (the no-sync check starts a copy instead)
        assert reads["sync"] == (1 if exact else 0), (tag, reads)
        if cfg.transport == "pull" and T[rank] and exact:
            # the pull path's exact-size dispatch as one call: its output a view of storage sized for the worst case
            # (R_max rows) where that is small, else for the rows of the last call of the same token count plus
            # peer_guess_pct percent (the first call, and one that brings more, gathered after the sync into an
            # output of its own size, R rows); its scales likewise
            from mxcomm.mx import grouped_m_rows, round_up

            n = int(wants[rank].offs[-1])
            last, pct = seen.get(T[rank]), be.launch.peer_guess_pct
            if world * cfg.max_tokens_per_rank <= be.launch.peer_call_tokens:
                held = be.R_max
            elif last is not None and pct:
                held = min(be.R_max, round_up(last + -(-last * pct // 100), cfg.align))
                if n > held:  # more rows than the output held: gathered after the sync into one of n rows
                    overflows, held = overflows + 1, n
            else:
                held = n
            seen[T[rank]] = n
            rows = d.x.qdata if mx else d.x
            assert rows.untyped_storage().nbytes() == held * H * (1 if mx else 2), (tag, n, held)
            if mx:
                want = grouped_m_rows(held, be.El) * round_up(H // 32, 4)
                assert d.x.scales.untyped_storage().nbytes() == want, tag
        if cfg.transport == "push":  # a handshake between the rounds that carry rows, none after them (no-sync mode)
            need = max(1, -(-max(int(w.offs[-1]) for w in wants) // be.impl.window))
            assert int(be.impl._window_epoch) - epoch0 == need - 1, (tag, need, int(be.impl._window_epoch) - epoch0)
        n = int(wants[rank].offs[-1])
        assert d.num_rows == (n if exact else be.R_max), tag
        assert torch.equal(d.offs, wants[rank].offs) and torch.equal(d.counts, wants[rank].counts), tag
        if mx:
            assert torch.equal(d.x.qdata.view(torch.uint8)[:n], wants[rank].x.qdata.view(torch.uint8)[:n]), tag
            rows = in_group_tile_rows(d.offs)
            assert torch.equal(d.x.scales[:rows], wants[rank].x.scales[:rows]), tag
        else:
            assert torch.equal(d.x.view(torch.int16)[:n], wants[rank].x.view(torch.int16)[:n]), tag
        out = outs[rank]
        vals = [o.float() for o in outs]
        dr, drow = h.plan.dest_rank, h.plan.dest_row
        # combine with the dispatch's weights: they came with its entries, no exchange (the weights' flag this rank
        # raises on itself, like on every rank, stays where it was)
        flag0 = int(be.flags.local[wrow, rank])
        y, saved = be.combine_for_backward(out, h, mx)
        assert int(be.flags.local[wrow, rank]) == flag0, f"{tag}: the dispatch's weights were exchanged"
        assert_bf16_same(y, spec_combine(dr, drow, vals, ws[rank], mx), f"{tag} combine")
        # other weights on every rank: exchanged, and used
        ws2 = [w * -0.5 for w in ws]
        y2 = be.combine(out, with_weights(h, ws2[rank]), False)
        assert int(be.flags.local[wrow, rank]) > flag0, f"{tag}: other weights were not exchanged"
        assert_bf16_same(y2, spec_combine(dr, drow, vals, ws2[rank], False), f"{tag} combine, other weights")
        cb = be.combine_backward(gys[rank], h, saved, mx)
        gx = be.dispatch_backward(out, h, mx)
        assert_bf16_same(gx, spec_combine(dr, drow, vals, None, mx), f"{tag} dispatch backward")
        cbs = oracle_combine_backward(cfg, gys, routes, ws, [o[: wants[r].num_rows] for r, o in enumerate(outs)],
                                      wants, mx)
        if mx:
            assert torch.equal(cb.grad_expert_out.qdata.view(torch.uint8)[:n],
                               cbs[rank].grad_expert_out.qdata.view(torch.uint8)[:n]), tag
        else:
            assert torch.equal(cb.grad_expert_out.view(torch.int16)[:n],
                               cbs[rank].grad_expert_out.view(torch.int16)[:n]), tag
        want_gw = torch.zeros(T[rank], k, dtype=torch.float64)
        for p in range(world):
            want_gw = torch.where(dr == p, route_grad(torch.where(dr == p, drow, -1), gys[rank], outs[p]), want_gw)
        torch.testing.assert_close(cb.grad_weights, want_gw.float(), rtol=1e-5, atol=1e-4, msg=tag)
        # every launch that elects its last program left its ticket at 0, the head its totals at 0 (a ticket off by
        # one would elect no program in the next call)
        assert not be.tickets.any() and not be.count_totals.any(), f"{tag}: {be.tickets.tolist()}"
    assert int(be.err[0]) == 0
    if cfg.recv_window_rows is not None:  # the dispatches went in rounds: handshakes between them
        assert int(be.impl._window_epoch) > 0
    return "ok", overflows


def _fault_worker(rank, world, path, base, cfg, T, seed):
    """Three rounds on every rank (:func:`rank_inputs.refusal_clean_absent`): a refusal, a clean dispatch and
    combine, an absent peer. Returns what each round raised (or the check of the clean round)."""
    from mxcomm.ep.reference.oracle import oracle_dispatch

    be = _backend(rank, world, path, base, cfg)
    xs, idxs, ws = rank_inputs(world, T, cfg.num_experts, cfg.topk, cfg.hidden, seed)
    want = oracle_dispatch(cfg, xs, idxs)[0][rank]
    return refusal_clean_absent(be, rank, xs, idxs, ws, want, cfg.timeout_s)


def _dispatch_outcome(be, x, idx, w, timeout_s):
    """What ``be.dispatch(x, idx, w)`` did: "returned", or ("PeerTimeout", the peer it named, whether it raised within
    four timeouts)."""
    from mxcomm.transport.errors import PeerTimeout

    start = time.monotonic()
    try:
        be.dispatch(x, idx, w)
        return "returned"
    except PeerTimeout as e:
        return "PeerTimeout", e.peer, time.monotonic() - start < 4 * timeout_s


def _stalled_worker(rank, world, path, base, cfg, T, seed):
    """Rank 1 runs the pull dispatch's first launch (check, counts and their publish, pack) and stops there, before
    the launch that would write its pull-list entries; rank 0 starts its dispatch once rank 1's counts are out.
    Rank 0 returns what its dispatch raised, whether rank 1's counts had arrived and whether rank 1's entries had
    not."""
    import torch.distributed as dist

    from mxcomm.ep.plan import FLAG_ROWS

    be = _backend(rank, world, path, base, cfg)
    xs, idxs, ws = rank_inputs(world, T, cfg.num_experts, cfg.topk, cfg.hidden, seed)
    if rank == 1:
        be.impl.x_slot.fill_(xs[1].data_ptr())
        be.impl._head(idxs[1], be.plan_store(idxs[1]))  # (waits for nothing)
    dist.barrier()
    if rank == 1:
        return "stopped"
    raised = _dispatch_outcome(be, xs[0], idxs[0], ws[0], cfg.timeout_s)
    flags = be.flags.local
    epoch = int(be.d_epoch)
    clean = not be.tickets.any() and not be.count_totals.any()  # the failed call left its tickets and totals at 0
    return (raised, int(flags[FLAG_ROWS.index("counts"), 1]) == epoch,
            int(flags[1, 1]) < int(be.expect[1, 1]), clean)


def _push_stalled_worker(rank, world, path, base, cfg, T, seed):
    """Push path: rank 1 takes part in the dispatch's counts exchange (id check, counts and refusal word, epoch) and
    stops there, before it sends any row; rank 0's dispatch passes the exchange and its one host sync, sends its rows
    and then waits for rank 1's. Rank 0 returns what its dispatch raised and whether rank 1's counts had arrived."""
    from mxcomm.ep.plan import FLAG_ROWS

    be = _backend(rank, world, path, base, cfg)
    xs, idxs, ws = rank_inputs(world, T, cfg.num_experts, cfg.topk, cfg.hidden, seed)
    if rank == 1:
        be.checked_ids(idxs[1], refusal_word=True)
        be.d_epoch.add_(1)
        be.impl.exchange(be.counts_in)  # (waits, bounded, for rank 0's counts)
        return "stopped"
    raised = _dispatch_outcome(be, xs[0], idxs[0], ws[0], cfg.timeout_s)
    return raised, int(be.flags.local[FLAG_ROWS.index("counts"), 1]) == int(be.d_epoch)


def _mismatch_worker(rank, world, path, base, cfg, T, seed):
    """Rank 0 combines with other weights (it exchanges), the others with the dispatch's (they do not): every rank's
    combine must fail with a PeerTimeout, none may return partial sums formed with weights it was not given."""
    from mxcomm.ep.handle import with_weights
    from mxcomm.transport.errors import PeerTimeout

    be = _backend(rank, world, path, base, cfg)
    xs, idxs, ws = rank_inputs(world, T, cfg.num_experts, cfg.topk, cfg.hidden, seed)
    d, h = be.dispatch(xs[rank], idxs[rank], ws[rank])
    out = torch.randn(d.num_rows, cfg.hidden).to(torch.bfloat16)
    hw = with_weights(h, ws[rank] * 2) if rank == 0 else h
    try:
        be.combine(out, hw, False)
    except PeerTimeout as e:
        return e.rank, e.peer
    return None


@pytest.mark.parametrize("W,E,k,H,T,precision,exact,transport,window", [
    (2, 4, 2, 64, (9, 6), "mxfp8", True, "pull", None),
    (3, 6, 3, 96, (5, 0, 7), "mxfp8", False, "pull", None),
    (2, 4, 3, 64, (7, 8), "bf16", True, "pull", None),
    (3, 6, 2, 64, (4, 6, 0), "mxfp8", True, "push", None),
    # the push dispatch through a receive window of a few rows, in rounds
    (3, 6, 2, 64, (4, 6, 0), "mxfp8", True, "push", 11),
    (2, 4, 3, 64, (7, 8), "bf16", False, "push", 16),
    (3, 6, 2, 64, (6, 2, 5), "mxfp8", False, "push", 8),  # no-sync: the worst case's rounds, most of them empty
])
def test_peer_paths_several_ranks_match_spec(tmp_path, W, E, k, H, T, precision, exact, transport, window):
    """The pull and push paths across processes. Dispatch bit-exact to the oracle (payload, the groups' scale tiles,
    offs, counts); combine with the dispatch's weights (they came with its entries: the weights' flag does not move)
    and with other weights on every rank (exchanged) bit-exact to the spec's one row per (token, rank) sums; dispatch
    backward likewise; combine backward's rows bit-exact to the oracle's, its route-weight gradient within fp32
    rounding of a float64 dot. Two rounds (epochs, send copies, combine copies); a rank with no tokens; no wait
    fails. ``window``: the push dispatch's receive window (``EPConfig.recv_window_rows``), below what ranks receive."""
    from mxcomm.ep import EPConfig

    cfg = EPConfig(num_experts=E, hidden=H, topk=k, max_tokens_per_rank=max(T), precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=60.0, transport=transport, exact_sizes=exact,
                   recv_window_rows=window)
    out = _run_mapped(tmp_path, W, _paths_worker, cfg, [T, T], 31 * W + E, timeout=600)
    assert out == [("ok", 0)] * W


@pytest.mark.parametrize("precision,k,T", [("mxfp8", 2, (9, 6)), ("bf16", 3, (7, 8))])
def test_pull_path_staged_dispatch_matches_spec(tmp_path, precision, k, T):
    """The pull path's exact-size dispatch without the one call (``LaunchConfig.peer_call_tokens=0``: the output
    kernels launched after the host sync, the middle alone captured), checked as the matrix above checks it."""
    from mxcomm.ep import EPConfig
    from mxcomm.ep.nvshmem.launch_config import LaunchConfig

    cfg = EPConfig(num_experts=4, hidden=64, topk=k, max_tokens_per_rank=max(T), precision=precision,
                   backend="nvshmem", num_sms=1, timeout_s=60.0, transport="pull", exact_sizes=True,
                   launch=LaunchConfig(peer_call_tokens=0, peer_guess_pct=0))
    out = _run_mapped(tmp_path, 2, _paths_worker, cfg, [T, T], 57, timeout=600)
    assert out == [("ok", 0)] * 2


def test_pull_path_output_sized_from_the_call_before(tmp_path):
    """The pull path's exact-size dispatch above ``LaunchConfig.peer_call_tokens``: the first call of a token count
    staged (gathered after the sync, output of its own size), the next ones as one call into an output holding the
    rows of the call before plus ``peer_guess_pct`` percent; when every rank routes to rank 0's experts, rank 0's
    rows overflow that output and are gathered after the sync instead, and the call after it fits again. Each call
    checked as the matrix above checks it (the worker asserts every output's storage)."""
    from mxcomm.ep import EPConfig
    from mxcomm.ep.nvshmem.launch_config import LaunchConfig

    T = (40, 37)
    cfg = EPConfig(num_experts=8, hidden=64, topk=3, max_tokens_per_rank=max(T), precision="mxfp8",
                   backend="nvshmem", num_sms=1, timeout_s=60.0, transport="pull", exact_sizes=True,
                   launch=LaunchConfig(peer_call_tokens=0))
    out = _run_mapped(tmp_path, 2, _paths_worker, cfg, [T, T, T], 91, (1,), timeout=600)
    assert out == [("ok", 1), ("ok", 1)], out  # rank 0 in the hot round, rank 1 (which it left empty) after it


def test_pull_path_token_counts_vary_from_call_to_call(tmp_path):
    """Seven calls on one group of three ranks with every rank's token count drawn anew each time (0 to
    ``max_tokens_per_rank``; one call with no tokens anywhere, one with a single token on one rank): each call's
    dispatch, combines and backward passes exact as above - the epochs, send copies, combine copies and the fixed
    weights buffer carry nothing over from a call of another size."""
    from mxcomm.ep import EPConfig

    W, T_max = 3, 9
    g = torch.Generator().manual_seed(1234)
    rounds = [tuple(int(t) for t in torch.randint(0, T_max + 1, (W,), generator=g)) for _ in range(5)]
    rounds[2:2] = [(0, 0, 0), (0, 1, 0)]
    cfg = EPConfig(num_experts=6, hidden=64, topk=3, max_tokens_per_rank=T_max, precision="mxfp8", backend="nvshmem",
                   num_sms=1, timeout_s=60.0, transport="pull", exact_sizes=True)
    out = _run_mapped(tmp_path, W, _paths_worker, cfg, rounds, 77, timeout=600)
    assert [o[0] for o in out] == ["ok"] * W


def test_combine_weights_decided_unlike_fails_on_every_rank(tmp_path):
    """The ranks must agree on whether combine's weights are the dispatch's: when rank 0 exchanges other weights and
    rank 1 uses the ones that came with the dispatch, rank 0's wait for rank 1's weights fails, it sends no partial
    sums, and rank 1's wait for them fails too: both raise PeerTimeout naming the other, neither returns."""
    from mxcomm.ep import EPConfig

    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=6, precision="bf16", backend="nvshmem",
                   num_sms=1, timeout_s=3.0, transport="pull")
    out = _run_mapped(tmp_path, 2, _mismatch_worker, cfg, (6, 5), 5, timeout=300)
    assert out == [(0, 1), (1, 0)], out


@pytest.mark.parametrize("transport,window,peer_call", [("pull", None, 1024), ("pull", None, 0), ("push", None, 1024),
                                                       ("push", 8, 1024)])
def test_refusal_then_clean_call_then_absent_peer(tmp_path, transport, window, peer_call):
    """Bad input and a missing peer on the pull and push paths (the push path also in rounds) across processes: a
    rank whose ids hold an expert id out of range raises the detailed ValueError and its peer a PeerTimeout saying that
    rank refused, both before any row is gathered or sent; the next dispatch and combine on both ranks are exact (the
    group stays usable); then a rank that never enters the dispatch makes the other's bounded wait raise PeerTimeout
    naming it, within its timeout. ``peer_call``: ``LaunchConfig.peer_call_tokens`` (0: the pull dispatch staged
    around its host sync; else as one call)."""
    from mxcomm.ep import EPConfig
    from mxcomm.ep.nvshmem.launch_config import LaunchConfig

    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=6, precision="bf16", backend="nvshmem",
                   num_sms=1, timeout_s=3.0, transport=transport, recv_window_rows=window,
                   launch=LaunchConfig(peer_call_tokens=peer_call))
    out = _run_mapped(tmp_path, 2, _fault_worker, cfg, (6, 5), 9, timeout=300)
    assert out[0] == [("PeerTimeout", 1, True), True, ("PeerTimeout", 1, True)], out
    assert out[1] == [("ValueError", True), True], out


def test_peer_that_stops_before_its_entries_is_named(tmp_path):
    """A rank that publishes its counts and then stops (it never writes its pull-list entries): the other rank's
    dispatch passes the counts wait and raises PeerTimeout naming it from the wait for every source's entries, the
    one at the end of the plan's launch, within its timeout."""
    from mxcomm.ep import EPConfig

    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=6, precision="mxfp8", backend="nvshmem",
                   num_sms=1, timeout_s=3.0, transport="pull")
    out = _run_mapped(tmp_path, 2, _stalled_worker, cfg, (6, 5), 13, timeout=300)
    assert out == [(("PeerTimeout", 1, True), True, True, True), "stopped"], out


def test_push_peer_that_stops_before_its_rows_is_named(tmp_path):
    """Push path: a rank that takes part in the counts exchange and then stops (it never sends its rows). The other
    rank's dispatch passes its one host sync (the sizes and rounds) and its wait for the missing rows fails within its
    timeout; the error is raised naming the peer - on CPU by the dispatch itself (the interpreter's no-sync check
    reads at once), on a GPU by the next call that finds the error word, the next dispatch's sync or
    ``check_errors()``, as for combine."""
    from mxcomm.ep import EPConfig

    cfg = EPConfig(num_experts=4, hidden=64, topk=2, max_tokens_per_rank=6, precision="mxfp8", backend="nvshmem",
                   num_sms=1, timeout_s=3.0, transport="push")
    out = _run_mapped(tmp_path, 2, _push_stalled_worker, cfg, (6, 5), 17, timeout=300)
    assert out == [(("PeerTimeout", 1, True), True), "stopped"], out


def _mapped_entry(rank, world, fn, path, bases, *args):
    """In a rank process: the first of ``bases`` every rank could map (agreed over the process group), then
    ``fn(rank, world, path, base, *args)``."""
    import torch.distributed as dist

    from heap_fakes import SharedHeap

    ok = torch.tensor([SharedHeap.free(b, world * _PER_RANK) for b in bases], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    free = [b for b, f in zip(bases, ok.tolist()) if f]
    if not free:
        raise RuntimeError(f"no address of {[hex(b) for b in bases]} is free in every rank's process")
    return fn(rank, world, path, free[0], *args)


def _run_mapped(tmp_path, world, fn, *args, timeout):
    """``fn(rank, world, path, base, *args)`` in ``world`` rank processes over one shared heap file (made, and
    removed afterwards, here); their results by rank."""
    path = _heap_file(tmp_path, world)
    try:
        return run_world(world, _mapped_entry, fn, path, _BASES, *args, timeout=timeout,
                         env={"TRITON_INTERPRET": "1"})
    finally:
        os.unlink(path)
