"""The put path's block entries (mxcomm.ep.nvshmem.put_path) for several ranks, on CPU: staging buffers filled the
way the sending kernels fill them, every rank's entries applied as plain byte copies, and the receivers'
buffers compared with where the peer-pointer path stores each row (``dest_row`` / the origin's send
position). Byte copies here stand in for NVSHMEM; the real kernels run in the GPU tests."""
import pytest
import torch

from combine_spec import routings
from mxcomm.ep.plan import build_plan, local_counts, received_rows
from mxcomm.ep.nvshmem.state import row_origins
from mxcomm.ep.nvshmem.put_path import counts_batch, dispatch_blocks, partial_rows, row_batch, swap_batch, token_rows

RB, SB = 16, 2  # payload / scale bytes per row (small, distinct)


def _tag(a: int, b: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes that identify (a, b): little-endian a, b then a pattern."""
    v = torch.arange(nbytes, dtype=torch.int64) * 7 + a * 31 + b * 131 + 1
    return (v % 251).to(torch.uint8)


def _apply(batch, src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    for i in range(batch.n):
        pe, n = int(batch.pes[i]), int(batch.nbytes[i])
        do, so = int(batch.dst_offsets[i]), int(batch.src_offsets[i])
        assert n >= 0 and 0 <= do and do + n <= dsts[pe].numel() and 0 <= so and so + n <= src.numel()
        dsts[pe][do:do + n] = src[so:so + n]


def _plans(W, E, k, align, Ts, seed, drop=0.2, hot=None):
    g = torch.Generator().manual_seed(seed)
    idxs = routings(Ts, E, k, g, drop, hot)  # hot: every token of every rank sends slot 0 to one expert
    counts = torch.stack([local_counts(i, E) for i in idxs])
    return [build_plan(counts, idxs[r], r, align) for r in range(W)]


CASES = [  # W, E, k, align, tokens per rank
    (1, 4, 2, 32, (9,)),
    (2, 8, 3, 32, (0, 17)),
    (3, 6, 2, 128, (5, 40, 1)),
    (4, 16, 4, 32, (33, 0, 7, 64)),
    (4, 4, 4, 128, (20, 20, 3, 9)),
]


@pytest.mark.parametrize("W,E,k,align,Ts", CASES)
@pytest.mark.parametrize("hot", [None, 1])
def test_dispatch_blocks_land_every_slot_at_its_dest_row(W, E, k, align, Ts, hot):
    plans = _plans(W, E, k, align, Ts, seed=W * 10 + E, hot=hot)
    R = max(int(p.num_rows) for p in plans) + 3
    recv_q = [torch.zeros(R * RB, dtype=torch.uint8) for _ in range(W)]
    recv_s = [torch.zeros(R * SB, dtype=torch.uint8) for _ in range(W)]
    for s, p in enumerate(plans):
        nslot = max(p.send_pos.numel(), 1)
        stage_q, stage_s = torch.zeros(nslot * RB, dtype=torch.uint8), torch.zeros(nslot * SB, dtype=torch.uint8)
        for slot, pos in enumerate(p.send_pos.reshape(-1).tolist()):  # the dispatch kernel's staging writes
            if pos >= 0:
                stage_q[pos * RB:(pos + 1) * RB] = _tag(s, slot, RB)
                stage_s[pos * SB:(pos + 1) * SB] = _tag(s, slot, SB)
        b = dispatch_blocks(p, RB, SB)
        assert b.payload.n == E and b.scales.n == E
        assert int(b.payload.nbytes.sum()) == int(p.num_send) * RB  # bytes moved = rows sent
        _apply(b.payload, stage_q, recv_q)
        _apply(b.scales, stage_s, recv_s)
    filled = [torch.zeros(R, dtype=torch.bool) for _ in range(W)]
    for s, p in enumerate(plans):
        for slot in range(p.dest_rank.numel()):
            d, row = int(p.dest_rank.reshape(-1)[slot]), int(p.dest_row.reshape(-1)[slot])
            if d < 0:
                continue
            assert torch.equal(recv_q[d][row * RB:(row + 1) * RB], _tag(s, slot, RB)), (s, slot, d, row)
            assert torch.equal(recv_s[d][row * SB:(row + 1) * SB], _tag(s, slot, SB)), (s, slot, d, row)
            filled[d][row] = True
    for d in range(W):  # nothing else was written (padding rows and the tail stay zero)
        rest = recv_q[d].view(R, RB)[~filled[d]]
        assert int(rest.count_nonzero()) == 0


@pytest.mark.parametrize("W,E,k,align,Ts", CASES)
@pytest.mark.parametrize("hot", [None, 1])
@pytest.mark.parametrize("window", [1, 7, 32, 50])
def test_dispatch_blocks_through_a_window_in_rounds_land_like_one_round(W, E, k, align, Ts, hot, window):
    """The put path's dispatch in rounds: round ``r`` puts the part of every block whose destination rows fall in
    ``[r * window, (r + 1) * window)`` into a receive buffer of ``window`` rows; copied out at ``r * window`` after
    each round, every receiver ends with what one round into a buffer of every row gives. Each round keeps one entry
    per expert (the signal counts), and each row travels once."""
    plans = _plans(W, E, k, align, Ts, seed=W * 10 + E + window, hot=hot)
    R = max(int(p.num_rows) for p in plans)
    rounds = max(1, -(-R // window))
    whole = [torch.zeros(R * RB, dtype=torch.uint8) for _ in range(W)]
    got = [torch.zeros(rounds * window * RB, dtype=torch.uint8) for _ in range(W)]
    got_s = [torch.zeros(rounds * window * SB, dtype=torch.uint8) for _ in range(W)]
    staged = []
    for s, p in enumerate(plans):
        nslot = max(p.send_pos.numel(), 1)
        stage_q, stage_s = torch.zeros(nslot * RB, dtype=torch.uint8), torch.zeros(nslot * SB, dtype=torch.uint8)
        for slot, pos in enumerate(p.send_pos.reshape(-1).tolist()):
            if pos >= 0:
                stage_q[pos * RB:(pos + 1) * RB] = _tag(s, slot, RB)
                stage_s[pos * SB:(pos + 1) * SB] = _tag(s, slot, SB)
        staged.append((stage_q, stage_s))
        _apply(dispatch_blocks(p, RB, SB).payload, stage_q, whole)
    moved = 0
    for r in range(rounds):
        lo = r * window
        win_q = [torch.zeros(window * RB, dtype=torch.uint8) for _ in range(W)]
        win_s = [torch.zeros(window * SB, dtype=torch.uint8) for _ in range(W)]
        for s, p in enumerate(plans):
            b = dispatch_blocks(p, RB, SB, (lo, lo + window))
            assert b.payload.n == E and b.scales.n == E
            moved += int(b.payload.nbytes.sum())
            _apply(b.payload, staged[s][0], win_q)  # (range-checked against the window's size, empty entries too)
            _apply(b.scales, staged[s][1], win_s)
        for d in range(W):  # the receivers' copy-out of the window
            got[d][lo * RB:(lo + window) * RB] = win_q[d]
            got_s[d][lo * SB:(lo + window) * SB] = win_s[d]
    assert moved == sum(int(p.num_send) for p in plans) * RB  # every row once over all rounds
    for d in range(W):
        assert torch.equal(got[d][:R * RB], whole[d]), d
        assert int(got[d][R * RB:].count_nonzero()) == 0
    for s, p in enumerate(plans):  # and the scale bytes at their rows
        for slot in range(p.dest_rank.numel()):
            d, row = int(p.dest_rank.reshape(-1)[slot]), int(p.dest_row.reshape(-1)[slot])
            if d >= 0:
                assert torch.equal(got_s[d][row * SB:(row + 1) * SB], _tag(s, slot, SB)), (s, slot)


def test_received_rows_are_every_ranks_rows():
    plans = _plans(4, 16, 4, 32, (33, 0, 7, 64), seed=5)
    rows = received_rows(plans[0])
    assert rows.tolist() == [int(p.num_rows) for p in plans]
    assert all(torch.equal(received_rows(p), rows) for p in plans)  # the same on every rank


def _table(plans, d, T_max):
    """Receiver ``d``'s table as the dispatch leaves it: entry ``s * T_max + t`` = the rows on ``d`` of source ``s``'s
    token ``t`` per slot, -1 for slots elsewhere."""
    k = plans[0].dest_rank.shape[1]
    t = torch.full((len(plans) * T_max, k), -1, dtype=torch.int32)
    for s, p in enumerate(plans):
        T = p.dest_rank.shape[0]
        t[s * T_max:s * T_max + T] = torch.where(p.dest_rank == d, p.dest_row, -1)
    return t


@pytest.mark.parametrize("W,E,k,align,Ts", CASES)
@pytest.mark.parametrize("parity", [0, 1])
@pytest.mark.parametrize("hot", [None, 1])
@pytest.mark.parametrize("tc", [None, 2])
def test_partial_rows_return_one_row_per_token_and_rank_to_its_leading_slot(W, E, k, align, Ts, parity, hot, tc):
    """``partial_rows``: every (token, rank) partial the staged kernel formed lands once at the token's combine slot
    for that rank in its origin's copy (``t * W + rank`` when ``W < k``, else the send position of the token's leading
    slot on the rank), nothing else is written; ``tc``: in rounds of ``tc`` tokens of every source (the staging
    holds a round's ``W * tc`` rows, token-major; the put path's combine direction above ``W = k``), each round a
    slice of the entries built once."""
    plans = _plans(W, E, k, align, Ts, seed=W * 7 + E + 1, hot=hot)
    T_max = max(max(Ts), 1)
    nslot = T_max * min(W, k)  # (mxcomm.ep.plan.combine_slots)
    copy_bytes = 2 * RB  # comb_q stride per slot of a copy (2H in the backend; payload rows RB apart)
    comb_q = [torch.zeros(2 * nslot * copy_bytes, dtype=torch.uint8) for _ in range(W)]
    comb_s = [torch.zeros(2 * nslot * SB, dtype=torch.uint8) for _ in range(W)]
    slot0 = torch.tensor([parity * nslot])
    rounds = [(t0, min(tc or T_max, T_max - t0)) for t0 in range(0, T_max, tc or T_max)]
    for d, p in enumerate(plans):
        table = _table(plans, d, T_max)
        pos = row_origins(p, int(p.num_rows)).pos
        moved = 0
        every = partial_rows(table, pos, d, T_max, slot0, copy_bytes, RB, SB, tc)
        assert every.payload.n == every.scales.n == W * T_max
        for t0, nt in rounds:
            stage_q = torch.zeros(W * nt * RB, dtype=torch.uint8)
            stage_s = torch.zeros(W * nt * SB, dtype=torch.uint8)
            for i in range(W * nt):  # the staged partials kernel: the round's i-th entry (token-major) at row i
                e = (i % W) * T_max + t0 + i // W
                stage_q[i * RB:(i + 1) * RB] = _tag(d, e, RB)
                stage_s[i * SB:(i + 1) * SB] = _tag(d, e, SB)
            b = every.entries(t0 * W, (t0 + nt) * W)
            assert b.payload.n == W * nt and b.scales.n == W * nt
            moved += int(b.payload.nbytes.sum())
            assert int(b.scales.nbytes.sum()) * RB == int(b.payload.nbytes.sum()) * SB
            empty = b.payload.nbytes == 0
            assert (b.payload.pes[empty] == d).all()  # an entry without a slot here goes nowhere else
            _apply(b.payload, stage_q, comb_q)
            _apply(b.scales, stage_s, comb_s)
        assert moved == int((table >= 0).any(1).sum()) * RB  # bytes moved: one row per (token, rank)
    for s, p in enumerate(plans):
        base_q, base_s = parity * nslot * copy_bytes, parity * nslot * SB
        written = torch.zeros(nslot, dtype=torch.bool)
        for t in range(p.dest_rank.shape[0]):
            for j in range(k):
                d = int(p.dest_rank[t, j])
                if d < 0 or d in p.dest_rank[t, :j].tolist():
                    continue  # dropped, or not the token's leading slot on d
                pos = t * W + d if W < k else int(p.send_pos[t, j])
                want = _tag(d, s * T_max + t, RB)
                assert torch.equal(comb_q[s][base_q + pos * RB: base_q + (pos + 1) * RB], want), (s, t, j)
                assert torch.equal(comb_s[s][base_s + pos * SB: base_s + (pos + 1) * SB],
                                   _tag(d, s * T_max + t, SB)), (s, t, j)
                written[pos] = True
        copy = comb_q[s][base_q:base_q + nslot * copy_bytes]
        assert int(copy[:nslot * RB].view(nslot, RB)[~written].count_nonzero()) == 0  # nothing at other positions
        assert int(copy[nslot * RB:].count_nonzero()) == 0  # rows RB apart: the copy's second half unused
        other = comb_q[s][(1 - parity) * nslot * copy_bytes:(2 - parity) * nslot * copy_bytes]
        assert int(other.count_nonzero()) == 0  # the other epoch's copy is untouched


def test_counts_batch_carries_the_counts_row_and_the_refusal_word():
    b = counts_batch(3, 1, 4, "cpu")  # 3 ranks, 4 experts: counts int32 [12] then 3 refusal words
    assert b.pes.tolist() == [0, 1, 2, 0, 1, 2]
    assert b.dst_offsets.tolist() == b.src_offsets.tolist() == [16, 16, 16, 52, 52, 52]  # row 1; word 12 + 1
    assert b.nbytes.tolist() == [16, 0, 16, 4, 0, 4]  # nothing to copy to itself


def test_row_batch_counts_and_ready():
    b = row_batch(3, 1, 40, "cpu")
    assert b.pes.tolist() == [0, 1, 2]
    assert b.dst_offsets.tolist() == [40, 40, 40] and b.src_offsets.tolist() == [40, 40, 40]
    assert b.nbytes.tolist() == [40, 0, 40]  # nothing to copy to itself; it still signals
    assert row_batch(2, 0, 0, "cpu").nbytes.tolist() == [0, 0]


@pytest.mark.parametrize("W,stride", [(1, None), (3, None), (4, 40)])
def test_swap_batch_puts_each_ranks_share_into_its_row_there(W, stride):
    """``swap_batch``: rank ``r``'s staging row ``p`` lands in row ``r`` of rank ``p``'s buffer (itself included), rows
    ``stride`` bytes apart on both sides; bytes between rows are not written (the route-weight gradients going home,
    the pull-list entries of the put path)."""
    RBS = 24
    st = stride or RBS
    dsts = [torch.zeros(W * st, dtype=torch.uint8) for _ in range(W)]
    for r in range(W):
        stage = torch.zeros(W * st, dtype=torch.uint8)
        for p in range(W):
            stage[p * st:p * st + RBS] = _tag(r, p, RBS)
        b = swap_batch(W, r, RBS, "cpu", stride=stride)
        assert b.n == W and b.pes.tolist() == list(range(W)) and int(b.nbytes.sum()) == W * RBS
        _apply(b, stage, dsts)
    for p in range(W):
        for r in range(W):
            assert torch.equal(dsts[p][r * st:r * st + RBS], _tag(r, p, RBS)), (p, r)
            assert not dsts[p][r * st + RBS:(r + 1) * st].any()


@pytest.mark.parametrize("W,E,k,align,Ts", CASES)
@pytest.mark.parametrize("tc", [None, 1, 3])
def test_token_rows_put_one_row_per_token_and_rank(W, E, k, align, Ts, tc):
    """``token_rows`` (combine backward on the put path): rank ``s``'s row ``t`` lands in row ``s * T_max + t`` of
    every rank its token has a slot on (the route weights' layout), once however many of that rank's experts it
    picked; in rounds of ``tc`` tokens (the gradient rows' layout above ``W = k``), the round's rows at ``s * tc + t -
    t0`` of a ``[W * tc]``-row buffer; every other entry is empty (0 bytes, to this rank) and nothing else is
    written."""
    plans = _plans(W, E, k, align, Ts, seed=W * 13 + E)
    T_max = max(max(Ts), 1)
    rows_per_src = tc or T_max
    every = [token_rows(p, s, rows_per_src, RB) for s, p in enumerate(plans)]
    for t0 in range(0, T_max, rows_per_src):
        nt = min(rows_per_src, T_max - t0)
        dst = [torch.zeros(W * rows_per_src * RB, dtype=torch.uint8) for _ in range(W)]
        for s, p in enumerate(plans):
            T = Ts[s]
            src = torch.zeros(max(T, 1) * RB, dtype=torch.uint8)
            for t in range(T):
                src[t * RB:(t + 1) * RB] = _tag(s, t, RB)
            assert every[s].n == T * k
            rows = every[s].entries(t0 * k, (t0 + nt) * k)  # the round's tokens: a slice
            mine = range(t0, min(t0 + nt, T))
            pairs = {(t, int(d)) for t in mine for d in p.dest_rank[t].tolist() if d >= 0}
            assert rows.n == len(mine) * k and int((rows.nbytes > 0).sum()) == len(pairs)
            assert (rows.pes[rows.nbytes == 0] == s).all()
            _apply(rows, src, dst)
        for d in range(W):
            filled = torch.zeros(W * rows_per_src, dtype=torch.bool)
            for s, p in enumerate(plans):
                for t in range(t0, min(t0 + nt, Ts[s])):
                    if (p.dest_rank[t] == d).any():
                        i = s * rows_per_src + t - t0
                        filled[i] = True
                        assert torch.equal(dst[d][i * RB:(i + 1) * RB], _tag(s, t, RB)), (d, s, t)
            assert not dst[d].view(-1, RB)[~filled].any()
