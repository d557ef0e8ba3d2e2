"""The nvshmem backend's combine direction with several ranks, simulated in one process under the Triton interpreter:
every rank's buffers are CPU tensors, peer pointer tables hold their addresses, and the kernels of each phase run
rank by rank (the dispatch's pull-list entries and tables, combine's partial sums on the expert ranks, the reduce at
the origins; the route-weight gradient of combine backward; the counts / weights publication). Results are checked
bit-exactly against the plain-torch math of ``combine_spec`` (one row per (token, rank)); a real multi-GPU run is in
tests/ep/test_nvshmem_gpu.py."""
import zlib

import pytest
import torch
import triton

from combine_spec import BF16_MAX, routings, assert_bf16_same, combine as spec_combine, partial as spec_partial, ptrs, \
    route_grad, token_ranks, tq
from mxcomm.ep.nvshmem.backend import row_origins
from mxcomm.ep.plan import FLAG_ROWS, build_plan, local_counts, pull_entry_words
from mxcomm.mx import quantize

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU tests run these kernels")

NF = len(FLAG_ROWS)
P2 = triton.next_power_of_2


class Ranks:
    """``W`` simulated ranks after a dispatch: routing, plans, row origins, and each rank's table and its route weights
    built the way the push and put paths build them (``push_entries_kernel`` on every source into the receivers' pull
    lists, pre-filled with entries of older calls, then ``entries_table_kernel`` on every receiver; the weights of
    ``dispatch_weights``, by source)."""

    def __init__(self, W, E, k, Ts, g, *, T_max=None, align=4, drop=0.2, hot=None, one_rank_token=True,
                 epoch=5):
        self.W, self.E, self.k, self.Ts = W, E, k, list(Ts)
        self.El = E // W
        self.T_max = T_max or max(max(Ts), 1)
        idxs = routings(Ts, E, k, g, drop, hot)  # hot: every token of every rank sends slot 0 to one expert
        self.all_on_one = None
        if one_rank_token and self.El >= k and hot is None:
            s = next(r for r in range(W) if Ts[r] >= 2)
            d = W - 1
            idxs[s][0] = d * self.El + torch.randperm(self.El, generator=g)[:k]  # every slot of a token on rank d
            idxs[s][1] = -1  # a token with no valid slot
            self.all_on_one = (s, 0, d)
        self.idxs = idxs
        counts = torch.stack([local_counts(i, E) for i in idxs])
        self.plans = [build_plan(counts, idxs[r], r, align) for r in range(W)]
        self.R = [int(p.num_rows) for p in self.plans]
        self.origins = [row_origins(p, R) for p, R in zip(self.plans, self.R)]
        self.epoch = epoch
        self.dispatch_weights = [torch.randn(T, k, generator=g) for T in Ts]
        self.tables, self.weight_tables = self._tables(g)

    def expected_table(self, d):
        t = torch.full((self.W * self.T_max, self.k), -1, dtype=torch.int32)
        for s, p in enumerate(self.plans):
            on_d = p.dest_rank == d
            t[s * self.T_max:s * self.T_max + self.Ts[s]] = torch.where(on_d, p.dest_row, -1)
        return t

    def _tables(self, g):
        from mxcomm.ep.nvshmem.kernels import entries_table_kernel, push_entries_kernel

        W, k, T_max, ep = self.W, self.k, self.T_max, torch.tensor([self.epoch])
        EW = pull_entry_words(k)
        lists = [torch.randint(-1, 50, (W, T_max, EW), dtype=torch.int32, generator=g) for _ in range(W)]
        for lst in lists:  # entries of older calls (one with the same low tag word): never kept
            lst[:, :, 0], lst[:, :, 1] = self.epoch - 2, 0
            lst[:, 1::2, 0], lst[:, 1::2, 1] = self.epoch, 1
        flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
        for s in range(W):
            p = self.plans[s]
            push_entries_kernel[(2, W)](p.dest_rank, p.dest_row, self.dispatch_weights[s], self.Ts[s], ptrs(lists),
                                      ptrs(flags), ep, s, W, T_max, K=k, EW=EW, BLOCK=4)
        tables, wtabs = [], []
        for d in range(W):
            assert flags[d][1].tolist() == [2] * W  # every source's push programs arrived
            table = torch.full((W * T_max, k), 77, dtype=torch.int32)
            wtab = torch.full((W * T_max, k), float("nan"))
            entries_table_kernel[(3,)](lists[d], table, wtab.view(torch.int32), ep, W * T_max, K=k, K_POW2=P2(k),
                                       EW=EW)
            want = self.expected_table(d)
            assert torch.equal(table, want), d
            want_w = torch.zeros(W * T_max, k)  # a received token's weights, every slot; 0 for the others
            for s_ in range(W):
                got_t = (want[s_ * T_max:s_ * T_max + self.Ts[s_]] >= 0).any(dim=1)
                want_w[s_ * T_max:s_ * T_max + self.Ts[s_]][got_t] = self.dispatch_weights[s_][got_t]
            assert torch.equal(wtab, want_w), d
            tables.append(table)
            wtabs.append(wtab)
        return tables, wtabs

    def lead_slot(self, s, t, d):
        """The token's first slot on rank ``d``."""
        return next(j for j in range(self.k) if int(self.plans[s].dest_rank[t, j]) == d)

    def combine_slot(self, s, t, d):
        """Where source ``s``'s ``comb_q`` holds its token ``t``'s partial from rank ``d``: slot ``t * W + d`` when
        ``W < k``, else the send position of the token's first slot on ``d``."""
        if self.W < self.k:
            return t * self.W + d
        return int(self.plans[s].send_pos[t, self.lead_slot(s, t, d)])


def _expert_rows(rk: Ranks, H, g, passthrough, poison):
    """Per rank: the kernel's input (bf16 ``[R, H]``, or MXFP8 payload + row scales) and its fp32 values. Padding rows
    hold NaN (they must never be read); with ``poison`` one real row of a rank holds a NaN and one of another an
    Inf. Returns (inputs, scales, values, poisoned (rank, row) set)."""
    ins, scs, vals, bad = [], [], [], set()
    real_rows = [sorted({int(r) for s in range(rk.W) for r in rk.plans[s].dest_row[rk.plans[s].dest_rank == d]})
                 for d in range(rk.W)]
    for d in range(rk.W):
        out = (torch.randn(rk.R[d], H, generator=g) * 3).to(torch.bfloat16)
        real = torch.zeros(rk.R[d], dtype=torch.bool)
        real[real_rows[d]] = True
        out[~real] = float("nan")
        if poison and real_rows[d] and d in (0, rk.W - 1):
            r = real_rows[d][len(real_rows[d]) // 2]
            out[r, 33 % H] = float("nan") if d == 0 else float("inf")
            bad.add((d, r))
        if passthrough:
            mxt = quantize(out)  # row-wise
            payload, sc = mxt.qdata.view(torch.uint8).contiguous(), mxt.scales.view(torch.uint8).contiguous()
            sc[~real] = 255  # padding rows decode to NaN
            ins.append(payload)
            scs.append(sc)
            vals.append(_decode(payload, sc))
        else:
            ins.append(out)
            scs.append(torch.zeros(1, dtype=torch.uint8))
            vals.append(out.float())
    return ins, scs, vals, bad


def _decode(payload, scales):
    from mxcomm.mx import MXTensor

    t = MXTensor(qdata=payload.view(torch.float8_e4m3fn), scales=scales, axis=1, orig_dtype=torch.bfloat16)
    return t.dequantize(torch.float32, saturate_to=torch.bfloat16)


def _weights(rk: Ranks, g):
    """Per source fp32 ``[T, k]``: positive, negative, zero; NaN / Inf on dropped slots (never read)."""
    ws = []
    for s, T in enumerate(rk.Ts):
        w = torch.rand(T, rk.k, generator=g) * 2 - 0.5
        if T:
            w[0, 0] = 0.0
            drop = rk.plans[s].dest_rank < 0
            w[drop] = torch.tensor([float("nan"), float("inf")]).repeat(rk.k * T)[: int(drop.sum())]
        ws.append(w)
    return ws


def _comb_w(rk: Ranks, ws, g):
    """Every rank's ``comb_w`` [W, T_max, k] with row ``s`` = source ``s``'s weights (what publish_kernel leaves
    there), NaN past each source's tokens (never read)."""
    bufs = []
    for _ in range(rk.W):
        b = torch.full((rk.W, rk.T_max, rk.k), float("nan"))
        for s, w in enumerate(ws):
            b[s, : rk.Ts[s]] = w
        bufs.append(b)
    return bufs


def _no_error() -> torch.Tensor:
    """A clear int64 error word (the partials kernel sends only when its rank's waits have not failed)."""
    return torch.zeros(1, dtype=torch.int64)


CASES = [  # W, E, k, H, tokens per rank, transport MX, weighted, MX input rows (PASS), hot expert
    pytest.param(2, 8, 3, 96, (0, 7), True, True, False, None, id="w2-mx-combine-h96"),
    pytest.param(2, 8, 3, 64, (5, 6), False, True, False, None, id="w2-bf16-combine"),
    pytest.param(3, 9, 3, 64, (4, 0, 6), True, False, False, None, id="w3-mx-dispatch-bwd"),
    pytest.param(3, 15, 5, 96, (6, 5, 0), False, False, False, None, id="w3-bf16-dispatch-bwd-k5-h96"),
    pytest.param(3, 6, 2, 64, (3, 6, 2), True, True, False, None, id="w3-mx-combine-el2"),
    pytest.param(4, 16, 4, 64, (3, 6, 0, 5), True, True, False, None, id="w4-mx-combine"),
    pytest.param(4, 16, 4, 64, (5, 2, 6, 0), True, False, True, None, id="w4-mx-pass-dispatch-bwd"),
    pytest.param(4, 8, 3, 96, (0, 4, 6, 3), False, True, False, None, id="w4-bf16-combine-h96-el2"),
    pytest.param(2, 4, 2, 64, (6, 5), True, True, False, 1, id="w2-mx-combine-hot"),
    pytest.param(3, 9, 3, 64, (4, 6, 5), False, False, False, 7, id="w3-bf16-dispatch-bwd-hot"),
]


@pytest.mark.parametrize("W,E,k,H,Ts,mx,weighted,passthrough,hot", CASES)
def test_combine_direction_partials_and_reduce_bit_exact(W, E, k, H, Ts, mx, weighted, passthrough, hot):
    """Combine (weighted) and dispatch backward (weights 1) across ``W`` ranks: ``combine_partials_kernel`` on every
    expert rank stores ONE row per (token, rank) - the partial sum of the token's rows there, rounded once (MXFP8 or
    BF16) - at the origin's ``comb_q`` slot of the token's leading slot, in the copy of the epoch's parity, and raises
    ``flags[2, me]`` once per program on every rank; ``combine_reduce_kernel`` at each origin sums the partials in the
    order of the ranks' first appearance. Bit-exact against the spec at the stored partials (payload and scale bytes)
    and at the result; the other copy, the non-leading slots and every padding row (NaN) are never touched or read; a
    NaN / Inf expert row poisons exactly the tokens with a slot on it; a token without a valid slot gives 0."""
    from mxcomm.ep.nvshmem.kernels import combine_partials_kernel, combine_reduce_kernel

    g = torch.Generator().manual_seed(zlib.crc32(repr((W, E, k, H, Ts, mx, weighted, passthrough, hot)).encode()))
    rk = Ranks(W, E, k, Ts, g, hot=None if hot is None else hot)
    T_max, nslot, C, epoch = rk.T_max, rk.T_max * min(W, k), H // 32, 3  # odd epoch: copy 1
    ins, scs, vals, bad = _expert_rows(rk, H, g, passthrough, poison=True)
    ws = _weights(rk, g) if weighted else [None] * W
    comb_w = _comb_w(rk, [w if w is not None else torch.zeros(T, k) for w, T in zip(ws, Ts)], g)
    comb_q = [torch.randint(0, 256, (2, nslot, 2 * H), dtype=torch.uint8, generator=g) for _ in range(W)]
    comb_s = [torch.randint(0, 256, (2, nslot, C), dtype=torch.uint8, generator=g) for _ in range(W)]
    before_q, before_s = [q.clone() for q in comb_q], [s.clone() for s in comb_s]
    flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
    ep = torch.tensor([epoch])
    G, chunk = 3, 64 if H % 64 else 32  # H = 96: a masked second chunk; H = 64: two chunks
    for d in range(W):
        combine_partials_kernel[(G,)](
            ins[d], scs[d], rk.tables[d], rk.origins[d].pos, comb_w[d], ptrs(comb_q), ptrs(comb_s), ptrs(flags), d, W,
            T_max, ep, nslot, _no_error(), H=H, K=k, P=min(k, W), CHUNK=chunk, MX=mx, PASS=passthrough,
            WEIGHTED=weighted, MODE=0, INT_ROUND=True, enable_fp_fusion=False)
    for d in range(W):  # every program of every sender raised the combine flag once
        assert flags[d][2].tolist() == [G] * W, d
        assert not flags[d][[0, 1, 3, 4, 5]].any(), d
    checked_rows = 0
    for s in range(W):
        p = rk.plans[s]
        assert torch.equal(comb_q[s][0], before_q[s][0]) and torch.equal(comb_s[s][0], before_s[s][0]), s
        written = torch.zeros(nslot, dtype=torch.bool)
        for t in range(Ts[s]):
            for d in token_ranks(p.dest_rank, t):
                pos = rk.combine_slot(s, t, d)
                written[pos] = True
                P = spec_partial(p.dest_rank, p.dest_row, vals, ws[s], t, d)[None]
                if mx:
                    qt = quantize(P)
                    got = comb_q[s][1].view(-1)[pos * H:(pos + 1) * H]
                    assert torch.equal(got, qt.qdata.view(torch.uint8)[0]), (s, t, d)
                    assert torch.equal(comb_s[s][1, pos], qt.scales.view(torch.uint8)[0]), (s, t, d)
                else:  # (a finite partial saturates at the BF16 range)
                    assert_bf16_same(comb_q[s][1].view(torch.bfloat16)[pos][:H], tq(P, False)[0].to(torch.bfloat16),
                                     f"partial {s} {t} {d}")
                checked_rows += 1
        if mx:  # the slots no partial went to: untouched (MX rows are H bytes apart from the copy's start)
            rows = comb_q[s][1].view(-1)[: nslot * H].view(nslot, H)
            was = before_q[s][1].view(-1)[: nslot * H].view(nslot, H)
            assert torch.equal(rows[~written], was[~written]), s
            assert torch.equal(comb_s[s][1][~written], before_s[s][1][~written]), s
        else:
            assert torch.equal(comb_q[s][1][~written], before_q[s][1][~written]), s
        if Ts[s] == 0:
            continue
        y = torch.full((Ts[s], H), 5.0, dtype=torch.bfloat16)
        combine_reduce_kernel[(2,)](
            comb_q[s] if mx else comb_q[s].view(torch.bfloat16), comb_s[s], p.send_pos, p.dest_rank, y, Ts[s], ep,
            nslot, W, H=H, K=k, P=min(k, W), CHUNK=chunk, MX=mx, INT_ROUND=True, enable_fp_fusion=False)
        want = spec_combine(p.dest_rank, p.dest_row, vals, ws[s], mx)
        assert_bf16_same(y, want, f"origin {s}")
        # poisoned rows reach exactly the tokens with a slot on them; a token without a valid slot gives 0
        hit = torch.tensor([any((int(p.dest_rank[t, j]), int(p.dest_row[t, j])) in bad for j in range(k))
                            for t in range(Ts[s])])
        assert torch.equal(~torch.isfinite(y.float()).all(1), hit), s
        for t in range(Ts[s]):
            if not (p.dest_rank[t] >= 0).any():
                assert not y[t].any(), (s, t)
    assert checked_rows == sum(int(((rk.expected_table(d) >= 0).any(1)).sum()) for d in range(W))
    assert bad, "no poisoned row: the case does not test poisoning"
    if rk.all_on_one is not None:  # that token's k slots travelled as one row
        s, t, d = rk.all_on_one
        assert len(token_ranks(rk.plans[s].dest_rank, t)) == 1


@pytest.mark.parametrize("W,mx,weighted", [(2, False, True), (3, False, False), (2, True, True)])
def test_near_max_rows_saturate_at_the_bf16_range(W, mx, weighted):
    """Expert rows at BF16's largest value: a partial above the BF16 range (a slot weighted by 1.003, or two slots
    summed) that is finite in fp32 is stored as +-BF16_MAX, not Inf (BF16 transport; MXFP8 decodes saturated), and
    the origin's sum of finite partials saturates at the BF16 range too; a partial that overflows fp32 passes through
    as Inf. Bit-exact to the spec at the stored partials and at the result, across simulated ranks."""
    from mxcomm.ep.nvshmem.kernels import combine_partials_kernel, combine_reduce_kernel

    E, k, H, Ts = 4 * W, 3, 64, [6] * W
    g = torch.Generator().manual_seed(77 + W + mx)
    rk = Ranks(W, E, k, Ts, g, drop=0.1)
    T_max, nslot, C, epoch = rk.T_max, rk.T_max * min(W, k), H // 32, 1
    outs = []
    for d in range(W):
        out = (torch.randn(rk.R[d], H, generator=g)).to(torch.bfloat16)
        out[:, :8] = BF16_MAX
        out[:, 8:12] = -BF16_MAX
        outs.append(out)
    vals = [o.float() for o in outs]
    ws = [torch.full((T, k), 1.003) if weighted else None for T in Ts]
    comb_w = _comb_w(rk, [w if w is not None else torch.zeros(T, k) for w, T in zip(ws, Ts)], g)
    comb_q = [torch.zeros(2, nslot, 2 * H, dtype=torch.uint8) for _ in range(W)]
    comb_s = [torch.zeros(2, nslot, C, dtype=torch.uint8) for _ in range(W)]
    flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
    ep = torch.tensor([epoch])
    for d in range(W):
        combine_partials_kernel[(2,)](
            outs[d], torch.zeros(1, dtype=torch.uint8), rk.tables[d], rk.origins[d].pos, comb_w[d], ptrs(comb_q),
            ptrs(comb_s), ptrs(flags), d, W, T_max, ep, nslot, _no_error(), H=H, K=k, P=min(k, W), CHUNK=32, MX=mx,
            PASS=False, WEIGHTED=weighted, MODE=0, INT_ROUND=True, enable_fp_fusion=False)
    saturated = 0
    for s in range(W):
        p = rk.plans[s]
        for t in range(Ts[s]):
            for d in token_ranks(p.dest_rank, t):
                P = spec_partial(p.dest_rank, p.dest_row, vals, ws[s], t, d)[None]
                if not mx:
                    pos = rk.combine_slot(s, t, d)
                    got = comb_q[s][1].view(torch.bfloat16)[pos][:H]
                    assert_bf16_same(got, tq(P, False)[0].to(torch.bfloat16), f"partial {s} {t} {d}")
                    saturated += int((got.float().abs() == BF16_MAX).sum())
        y = torch.empty(Ts[s], H, dtype=torch.bfloat16)
        combine_reduce_kernel[(2,)](
            comb_q[s] if mx else comb_q[s].view(torch.bfloat16), comb_s[s], p.send_pos, p.dest_rank, y, Ts[s], ep,
            nslot, W, H=H, K=k, P=min(k, W), CHUNK=32, MX=mx, INT_ROUND=True, enable_fp_fusion=False)
        want = spec_combine(p.dest_rank, p.dest_row, vals, ws[s], mx)
        assert_bf16_same(y, want, f"origin {s}")
        saturated += int((y.float().abs() == BF16_MAX).sum())  # near-max sums that stayed finite
    assert saturated  # the case reaches the BF16 range


@pytest.mark.parametrize("staged", [False, True])
def test_partials_send_nothing_after_a_failed_wait(staged):
    """A rank whose error word is set when its combine's partials start (a wait of the call - the weights' exchange -
    or of an earlier call timed out) writes no partial and raises no arrival flag, so that its peers' bounded waits
    fail instead of summing partials formed with weights that may not have arrived; with a clear word the same launch
    writes every listed token's partial and raises the flags (the control)."""
    from mxcomm.ep.nvshmem.kernels import combine_partials_kernel, stage_partials_kernel

    W, E, k, H, Ts = 3, 9, 3, 64, [5, 4, 6]
    g = torch.Generator().manual_seed(11 + staged)
    rk = Ranks(W, E, k, Ts, g)
    T_max, nslot, C = rk.T_max, rk.T_max * min(W, k), H // 32
    ins, scs, _, _ = _expert_rows(rk, H, g, False, poison=False)
    comb_w = _comb_w(rk, _weights(rk, g), g)
    ep = torch.tensor([2])
    for err in (torch.tensor([(1 << 32) | 2]), _no_error()):
        comb_q = [torch.zeros(2, nslot, 2 * H, dtype=torch.uint8) for _ in range(W)]
        comb_s = [torch.zeros(2, nslot, C, dtype=torch.uint8) for _ in range(W)]
        flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
        stage = torch.zeros(2 * nslot, 2 * H, dtype=torch.uint8)
        consts = dict(H=H, K=k, CHUNK=32, MX=False, PASS=False, WEIGHTED=True, MODE=0, INT_ROUND=True,
                      enable_fp_fusion=False)
        if staged:
            stage_partials_kernel[(2,)](ins[1], scs[1], rk.tables[1], comb_w[1], torch.full((W,), stage.data_ptr()),
                                        ptrs(comb_s), W, T_max, err, 0, T_max, **consts)
        else:
            combine_partials_kernel[(2,)](ins[1], scs[1], rk.tables[1], rk.origins[1].pos, comb_w[1], ptrs(comb_q),
                                          ptrs(comb_s), ptrs(flags), 1, W, T_max, ep, nslot, err, P=min(k, W),
                                          **consts)
        sent = int(stage.any(dim=1).sum()) if staged else sum(int(q.view(-1, 2 * H).any(dim=1).sum()) for q in comb_q)
        raised = [int(f[2, 1]) for f in flags]
        if int(err):
            assert sent == 0 and raised == [0] * W, (sent, raised)
        else:  # every (source, token) with a slot on rank 1 got its partial
            listed = int((rk.tables[1] >= 0).any(dim=1).sum())
            assert listed > 0 and sent == listed, (sent, listed)
            assert raised == ([0] * W if staged else [2] * W), raised


@pytest.mark.parametrize("W,E,k,H,Ts,mx,passthrough,tc", [
    (2, 8, 3, 64, (4, 6), True, False, None),
    (3, 6, 2, 96, (5, 0, 6), False, False, None),
    (3, 9, 3, 64, (6, 3, 4), True, True, None),
    (3, 6, 2, 64, (5, 0, 6), True, False, 4),  # rounds of 4, 2 tokens (the put path above W = k)
    (3, 9, 1, 96, (6, 3, 4), False, False, 1),
])
def test_staged_partials_with_row_puts_match_the_peer_pointer_result(W, E, k, H, Ts, mx, passthrough, tc):
    """The put path's combine direction across ranks: ``stage_partials_kernel`` writes each partial
    of the round's tokens ``[t0, t0 + n)`` into the expert rank's staging at its entry's index in the round and
    raises no flag; the entries of ``put_path.partial_rows`` (one per (token, rank), applied as byte copies) carry it
    to the origin's slot in the copy of the epoch's parity, and the reduce there gives the spec's result (weighted;
    unweighted with MX input rows). ``tc``: tokens per round (None: one round)."""
    from mxcomm.ep.nvshmem.kernels import combine_reduce_kernel, stage_partials_kernel
    from mxcomm.ep.nvshmem.put_path import partial_rows

    g = torch.Generator().manual_seed(W * 1000 + E * 10 + k + H)
    rk = Ranks(W, E, k, Ts, g)
    T_max, nslot, C, epoch = rk.T_max, rk.T_max * min(W, k), H // 32, 4  # even epoch: copy 0
    weighted = not passthrough
    ins, scs, vals, _ = _expert_rows(rk, H, g, passthrough, poison=False)
    ws = _weights(rk, g) if weighted else [None] * W
    comb_w = _comb_w(rk, [w if w is not None else torch.zeros(T, k) for w, T in zip(ws, Ts)], g)
    comb_q = [torch.randint(0, 256, (2, nslot, 2 * H), dtype=torch.uint8, generator=g) for _ in range(W)]
    comb_s = [torch.randint(0, 256, (2, nslot, C), dtype=torch.uint8, generator=g) for _ in range(W)]
    ep = torch.tensor([epoch])
    slot0 = (ep % 2) * nslot
    row_bytes = H if mx else 2 * H
    tc = tc or T_max
    for d in range(W):
        every = partial_rows(rk.tables[d], rk.origins[d].pos, d, T_max, slot0, 2 * H, row_bytes, C if mx else 0, tc)
        for t0 in range(0, T_max, tc):
            nt = min(tc, T_max - t0)
            stage_q = torch.randint(0, 256, (W * tc, 2 * H), dtype=torch.uint8, generator=g)
            stage_s = torch.randint(0, 256, (W * tc, C), dtype=torch.uint8, generator=g)
            sq, ss = torch.full((W,), stage_q.data_ptr()), torch.full((W,), stage_s.data_ptr())
            stage_partials_kernel[(2,)](
                ins[d], scs[d], rk.tables[d], comb_w[d], sq, ss, W, T_max, _no_error(), t0, nt, H=H, K=k, CHUNK=32,
                MX=mx, PASS=passthrough, WEIGHTED=weighted, MODE=0, INT_ROUND=True, enable_fp_fusion=False)
            b = every.entries(t0 * W, (t0 + nt) * W)
            for batch, src, dsts in ((b.payload, stage_q, comb_q), (b.scales, stage_s, comb_s)):
                sb = src.view(-1)
                for i in range(batch.n):
                    pe, n = int(batch.pes[i]), int(batch.nbytes[i])
                    do, so = int(batch.dst_offsets[i]), int(batch.src_offsets[i])
                    dsts[pe].view(-1)[do:do + n] = sb[so:so + n]
    for s in range(W):
        p = rk.plans[s]
        if Ts[s] == 0:
            continue
        y = torch.empty(Ts[s], H, dtype=torch.bfloat16)
        combine_reduce_kernel[(2,)](
            comb_q[s] if mx else comb_q[s].view(torch.bfloat16), comb_s[s], p.send_pos, p.dest_rank, y, Ts[s], ep,
            nslot, W, H=H, K=k, P=min(k, W), CHUNK=32, MX=mx, INT_ROUND=True, enable_fp_fusion=False)
        assert_bf16_same(y, spec_combine(p.dest_rank, p.dest_row, vals, ws[s], mx), f"origin {s}")


@pytest.mark.parametrize("W,E,k,H,Ts,mx,route_grad,copies,tc", [
    (2, 8, 3, 64, (0, 6), True, True, 2, None),
    (3, 6, 4, 64, (5, 0, 4), True, True, 1, None),
    (2, 4, 2, 96, (4, 5), False, True, 2, None),
    (3, 9, 3, 64, (3, 6, 2), False, False, 2, None),
    (4, 16, 3, 64, (2, 5, 0, 4), True, False, 1, None),
    (3, 6, 2, 64, (5, 0, 4), True, True, 1, 2),  # the put path's rounds: 2, 2, 1 tokens
    (4, 16, 2, 96, (2, 5, 0, 4), False, True, 1, 3),
])
def test_pull_weighted_rows_and_route_grad_from_the_table(W, E, k, H, Ts, mx, route_grad, copies, tc):
    """Combine backward on the expert ranks, ranks simulated in one process: each source's BF16 gradient rows and fp32
    route weights sit in its send copy (``copies=2``: the pull path, copy 1 of an odd epoch, weights read with their
    copy stride; ``copies=1``: the put path's received rows, one copy); ``pull_weighted_kernel`` (pull path) or
    ``round_weighted_kernel`` (put path) walks the receiver's table and stores ``w[t, j] * g[t]`` quantized per slot
    (MX: payload + row-major scale rows) or rounded to BF16 at each slot's row - bit-exact to plain torch -, zeroes the
    padding rows inside groups and leaves the rows past ``n_rows`` as they were. With ``ROUTE_GRAD`` it forms
    ``grad_w[t, j] = <g[t], out[row_j]>`` (fp32, within rounding of a float64 dot with the expert rows; padding rows
    hold NaN and are never read) into row ``me`` of the origin's ``comb_gw`` for exactly the slots on this rank, raising
    ``flags[4, me]`` once per program (pull path); ``gather_route_grad_kernel`` at the origin picks each slot's value
    from its rank's row (0 for a dropped slot). Gradient rows with Inf / NaN, weights 0 / tiny / negative, ranks with
    zero tokens, dropped slots. ``tc``: the put path's rounds, each launch the entries of ``tc`` tokens of every source,
    whose gradient rows are the round's (a ``[tc, H]`` buffer per source; None: one round of every token)."""
    from mxcomm.ep.nvshmem.kernels import (gather_route_grad_kernel, pack_ready_kernel, pull_weighted_kernel,
                                           round_weighted_kernel)

    g = torch.Generator().manual_seed(W * 31 + E + k + H + copies)
    rk = Ranks(W, E, k, Ts, g, epoch=7)
    T_max, C, epoch = rk.T_max, H // 32, 7
    gs = [(torch.randn(T, H, generator=g) * 3).to(torch.bfloat16) for T in Ts]
    ws = [torch.randn(T, k, generator=g) for T in Ts]
    for T, gy, w in zip(Ts, gs, ws):
        if T >= 3:
            gy[0, 5], gy[-1, 40 % H] = float("inf"), float("nan")
            w[0, 0], w[-1, -1], w[1, 1] = 0.0, 1e-30, -2.5
    # each source's send copies (bf16 rows [copies, T_max, H], fp32 weights [copies, T_max, k]), garbage elsewhere;
    # the pull path packs them (pack_ready_kernel: the epoch advanced to the odd one, rows as they are, weights beside
    # them into copy 1, copy 0 untouched, then "ready" raised on every rank), the put path's rows arrive by puts (here:
    # copied in)
    send_g = [torch.randn(copies, T_max, H, generator=g).to(torch.bfloat16) for _ in range(W)]
    send_w = [torch.full((copies, T_max, k), float("nan")) for _ in range(W)]
    for s in range(W):
        if copies == 1:
            send_g[s][0, : Ts[s]] = gs[s]
            send_w[s][0, : Ts[s]] = ws[s]
            continue
        g0 = send_g[s][0].clone()
        ep, ticket = torch.tensor([epoch - 1]), torch.zeros(1, dtype=torch.int32)
        ready = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
        pack_ready_kernel[(max(1, min(Ts[s], 2)),)](
            gs[s], Ts[s], send_g[s], ep, T_max, T_max * H, ws[s], send_w[s], ticket, ptrs(ready),
            FLAG_ROWS.index("counts"), W, s, H=H, CHUNK=32, K=k, K_POW2=P2(k))
        assert int(ep) == epoch and int(ticket) == 0
        assert all(int(r[FLAG_ROWS.index("counts"), s]) == epoch and int(r.sum()) == epoch for r in ready)  # "ready"
        assert torch.equal(send_g[s][0].view(torch.int16), g0.view(torch.int16))
        assert send_w[s][0].isnan().all()  # (NaN everywhere before)
        assert torch.equal(send_g[s][1, : Ts[s]].view(torch.int16), gs[s].view(torch.int16))
        assert torch.equal(send_w[s][1, : Ts[s]], ws[s])
    sentinel = 1234.5
    comb_gw = [torch.full((W, T_max, k), sentinel) for _ in range(W)]
    flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
    outs = []
    for d in range(W):
        out = (torch.randn(rk.R[d], H, generator=g)).to(torch.bfloat16)
        real = (rk.expected_table(d) >= 0)
        rows = rk.expected_table(d)[real].long()
        pad = torch.ones(rk.R[d], dtype=torch.bool)
        pad[rows] = False
        out[pad] = float("nan")
        outs.append(out)
    ep = torch.tensor([epoch])
    G, B = 3, 1 if mx else 2
    for d in range(W):
        p = rk.plans[d]
        n_rows = rk.R[d]
        R = n_rows + 5  # worst-case sized: the rows past n_rows are not written
        dst = torch.randint(0, 256, (R, H * B), dtype=torch.uint8, generator=g)
        before = dst.clone()
        srows = torch.randint(0, 256, (R, C), dtype=torch.uint8, generator=g)
        gw_peers = torch.tensor([comb_gw[s].data_ptr() + d * T_max * k * 4 for s in range(W)], dtype=torch.int64)
        args = (dst if mx else dst.view(torch.bfloat16), srows, p.offs, p.expert_counts, p.num_rows, rk.El, R)
        expert_rows = outs[d] if route_grad else torch.zeros(1, dtype=torch.bfloat16)
        consts = dict(H=H, CHUNK=32, K=k, K_POW2=P2(k), MX=mx, MODE=0, INT_ROUND=True, ZCHUNK=4,
                      ROUTE_GRAD=route_grad)
        if copies == 2:
            pull_weighted_kernel[(G,)](*args, ptrs(send_g), ptrs(send_w), rk.tables[d], ep, T_max, W, T_max * H,
                                       T_max * k, expert_rows, gw_peers, ptrs(flags), d, **consts)
        else:
            for t0 in range(0, T_max, tc or T_max):  # the round's rows of every source, garbage past them
                nt = min(tc or T_max, T_max - t0)
                rnd = [torch.randn(tc or T_max, H, generator=g).to(torch.bfloat16) for _ in range(W)]
                for s in range(W):
                    rnd[s][:nt] = send_g[s][0, t0:t0 + nt]
                round_weighted_kernel[(G,)](*args, ptrs(rnd), ptrs(send_w), rk.tables[d], T_max, W, expert_rows,
                                            gw_peers, t0, nt, **consts)
        want = torch.zeros(R, H * B, dtype=torch.uint8)
        want[n_rows:] = before[n_rows:]
        real = torch.zeros(R, dtype=torch.bool)
        for s in range(W):
            for t in range(Ts[s]):
                for j in range(k):
                    if int(rk.plans[s].dest_rank[t, j]) != d:
                        continue
                    r = int(rk.plans[s].dest_row[t, j])
                    prod = ws[s][t, j] * gs[s][t].float()
                    real[r] = True
                    if mx:
                        q = quantize(prod[None])
                        want[r] = q.qdata.view(torch.uint8)[0]
                        assert torch.equal(srows[r], q.scales.view(-1)), (d, s, t, j)
                    else:
                        want[r] = prod.to(torch.bfloat16).view(torch.uint8)
        assert int(real.sum()) == int(p.num_recv)
        if mx:
            assert torch.equal(dst, want), d
        else:
            assert_bf16_same(dst.view(torch.bfloat16), want.view(torch.bfloat16), f"rank {d}")
    for d in range(W):  # pull path: every program of every rank announced its route-weight gradients
        assert flags[d][4].tolist() == ([G] * W if route_grad and copies == 2 else [0] * W), d
        assert not flags[d][[0, 1, 2, 3, 5]].any()
    for s in range(W):
        p = rk.plans[s]
        if not route_grad:
            assert (comb_gw[s] == sentinel).all()
            continue
        for d in range(W):  # row d of the origin's comb_gw: the slots on rank d, nothing else
            on_d = p.dest_rank == d
            want = torch.where(on_d, route_grad_of(p.dest_row, gs[s], outs[d]), sentinel).float()
            got = comb_gw[s][d, : Ts[s]]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, equal_nan=True, msg=f"origin {s} rank {d}")
            assert (comb_gw[s][d, Ts[s]:] == sentinel).all()
        if Ts[s] == 0:
            continue
        gw = torch.full((Ts[s], k), 99.0)
        # persistent: 2 programs over the blocks of 4 slots (several blocks each)
        gather_route_grad_kernel[(2,)](comb_gw[s], p.dest_rank, gw, Ts[s] * k, T_max * k, BLOCK=4)
        want = torch.zeros(Ts[s], k, dtype=torch.float64)
        for d in range(W):
            want = torch.where(p.dest_rank == d, route_grad_of(p.dest_row, gs[s], outs[d]), want)
        torch.testing.assert_close(gw, want.float(), rtol=1e-5, atol=1e-4, equal_nan=True)
        assert (gw[p.dest_rank < 0] == 0).all()


def route_grad_of(dest_row, gy, out):
    """float64 ``[T, k]`` dots of ``gy`` with the rows ``dest_row`` of ``out`` (a slot whose row is not on this rank
    reads a wrong row here, and its value is masked by the caller)."""
    return route_grad(torch.where(dest_row < out.shape[0], dest_row, -1), gy, out)


@pytest.mark.parametrize("W,silent", [(3, None), (4, 2), (2, 0)])
def test_publish_without_wait_then_wait_published(W, silent):
    """``publish_kernel`` with ``WAIT=False`` (the pull dispatch packs between the publish and the wait): every rank
    but ``silent`` publishes its counts and refusal word and raises ``flags[0, r]`` everywhere, and returns without
    waiting (no error word, even before its peers have published). ``wait_published_kernel`` then returns at once
    on every rank when all published; when ``silent`` did not, every rank's wait times out naming it. Only the
    publishers' rows of the counts matrix are written."""
    from mxcomm.ep.nvshmem.kernels import publish_kernel, wait_published_kernel
    from mxcomm.transport.errors import TIMEOUT_CODE, error_word
    from mxcomm.transport.flags import timeout_ns

    E, epoch = 2 * W, 9
    g = torch.Generator().manual_seed(W * 7 + (silent or 0))
    counts = [torch.full((W * E + W,), -7, dtype=torch.int32) for _ in range(W)]
    flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
    errs = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    srcs = [torch.randint(0, 100, (E + 1,), generator=g, dtype=torch.int32) for _ in range(W)]
    ep = torch.tensor([epoch])
    row = FLAG_ROWS.index("counts")
    tmo = timeout_ns(0.05)
    pubs = [r for r in range(W) if r != silent]
    for r in pubs:
        publish_kernel[(W,)](srcs[r], E, ptrs(counts), r * E, W * E + r, ptrs(flags), flags[r], row, W, ep, errs[r],
                             tmo, r, BLOCK=4, WAIT=False)
        assert int(errs[r]) == 0, r
    for r in range(W):
        want = [epoch if s in pubs else 0 for s in range(W)]
        assert flags[r][row].tolist() == want, r
        for s in range(W):
            got = counts[r][s * E:(s + 1) * E], counts[r][W * E + s]
            if s in pubs:
                assert torch.equal(got[0], srcs[s][:E]) and int(got[1]) == int(srcs[s][E]), (r, s)
            else:
                assert (got[0] == -7).all() and int(got[1]) == -7, (r, s)
        wait_published_kernel[(W,)](flags[r], row, W, ep, errs[r], tmo)
        assert int(errs[r]) == (0 if silent is None else error_word(TIMEOUT_CODE, silent)), r


@pytest.mark.parametrize("W,refusing", [(3, ()), (3, (1, 2)), (4, (3,)), (2, (0,))])
def test_publish_counts_with_refusal_word_then_first_refusal(W, refusing):
    """``publish_kernel``, ranks run one after another in one process: rank ``r`` writes its ``E`` counts into row
    ``r`` of every rank's counts matrix and (the tail word) its refusal word into word ``W*E + r``, raises
    ``flags[0, r]`` to the epoch on every rank, then waits for every rank's flag (bounded): a rank run before its
    peers times out naming the first peer that had not published yet (the next rank), the last one waits for
    nobody. Nothing else of the buffers is written. ``first_refusal_kernel`` then gives 1 + the lowest refusing rank
    (0: none) on every rank. The route weights (``[T, k]`` words, no tail) and the "ready" handshake (no words)
    publish the same way on their own flag rows."""
    from mxcomm.ep.nvshmem.kernels import first_refusal_kernel, publish_kernel
    from mxcomm.transport.errors import TIMEOUT_CODE, error_word
    from mxcomm.transport.flags import timeout_ns

    E, T_max, k, epoch = 2 * W, 3, 2, 6
    g = torch.Generator().manual_seed(W * 10 + len(refusing))
    counts = [torch.full((W * E + W + 3,), -7, dtype=torch.int32) for _ in range(W)]  # 3 words past the region
    comb_w = [torch.full((W, T_max, k), -1.0) for _ in range(W)]
    flags = [torch.zeros(NF, W, dtype=torch.int64) for _ in range(W)]
    errs = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    srcs = [torch.cat([torch.randint(0, 100, (E,), generator=g, dtype=torch.int32),
                       torch.tensor([int(r in refusing) * (r + 5)], dtype=torch.int32)]) for r in range(W)]
    ws = [torch.randn(T_max, k, generator=g) for _ in range(W)]
    ep = torch.tensor([epoch])
    rows = {name: i for i, name in enumerate(FLAG_ROWS)}
    tmo = timeout_ns(0.05)
    views = [c.view(torch.int32) for c in comb_w]
    for row, pub in (("counts", lambda r: (srcs[r], E, ptrs(counts), r * E, W * E + r)),
                     ("weights", lambda r: (ws[r].view(torch.int32), T_max * k, ptrs(views), r * T_max * k, -1)),
                     ("counts", lambda r: (errs[r], 0, ptrs(counts), 0, -1))):  # the ready handshake, next epoch
        if pub(0)[1] == 0:
            ep = ep + 1
        for r in range(W):
            errs[r].zero_()
            src, n, dst, w0, tail = pub(r)
            publish_kernel[(W,)](src, n, dst, w0, tail, ptrs(flags), flags[r], rows[row], W, ep, errs[r], tmo, r,
                                 BLOCK=4)
        for r in range(W):
            want = 0 if r == W - 1 else error_word(TIMEOUT_CODE, r + 1)
            assert int(errs[r]) == want, (row, r, int(errs[r]))
            assert flags[r][rows[row]].tolist() == [int(ep)] * W, (row, r)
    flags_rows = [rows["counts"], rows["weights"]]
    for r in range(W):
        assert not flags[r][[i for i in range(NF) if i not in flags_rows]].any()
        want = torch.cat([torch.cat([s[:E] for s in srcs]), torch.cat([s[E:] for s in srcs]),
                          torch.full((3,), -7, dtype=torch.int32)])
        assert torch.equal(counts[r], want), r
        assert torch.equal(comb_w[r], torch.stack(ws)), r
        out = torch.full((1,), 99, dtype=torch.int64)
        first_refusal_kernel[(1,)](counts[r][W * E:W * E + W], W, out, W_POW2=P2(W))
        assert int(out) == (min(refusing) + 1 if refusing else 0), r
