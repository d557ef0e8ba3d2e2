"""The ``torch`` reference EP backend against the single-process oracle, in spawned gloo worlds (bit for bit), and
both against combine results worked out by hand.

Each world runs many cases in one spawn (process start-up is the slow part); every world is
time-bounded by ``run_world`` so a hang fails the test instead of blocking CI.
Soak iterations: ``MXCOMM_EP_SOAK_ITERS`` (default 200 on one rank; a fifth of that on two ranks).
"""
import os

import pytest
import torch

from _dist import run_world
from ep_cases import (
    bad_inputs_worker,
    config_mismatch_worker,
    random_cases,
    run_cases,
    soak_worker,
    standard_cases,
)
from mxcomm.ep import EPConfig, EPGroup
from mxcomm.ep.reference.oracle import (oracle_combine, oracle_combine_backward, oracle_dispatch,
                                        oracle_dispatch_backward)
from mxcomm.mx import MXTensor, quantize


def _assert_clean(results, min_cases=1):
    fails = [f for r in results for f in r["failures"]]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:40])
    for r in results:
        if "cases" in r:
            assert r["cases"] >= min_cases
            assert r["combine_checks"] > 0
            # the reference backend computes the oracle's formula with the same fp32 operations: bit for bit
            assert r["combine_exact"] == r["combine_checks"], r


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_matches_oracle(world):
    cases = standard_cases(world, seed=world) + random_cases(world, 6, seed=100 + world)
    results = run_world(world, run_cases, cases, timeout=150)
    _assert_clean(results, min_cases=len(cases))


def test_bad_inputs_raise_before_communicating():
    _assert_clean(run_world(2, bad_inputs_worker, timeout=90))


@pytest.mark.parametrize("world", [2, 4])
def test_config_mismatch_raises_on_every_rank(world):
    _assert_clean(run_world(world, config_mismatch_worker, timeout=90))


SOAK_ITERS = int(os.environ.get("MXCOMM_EP_SOAK_ITERS", "200"))


def test_soak_one_rank():
    """Random shapes/routings/configs, every row compared (row checksums locate a mismatch)."""
    results = run_world(1, soak_worker, SOAK_ITERS, 1234, timeout=60 + 2 * SOAK_ITERS)
    _assert_clean(results, min_cases=SOAK_ITERS)


def test_soak_two_ranks():
    iters = max(1, SOAK_ITERS // 5)
    results = run_world(2, soak_worker, iters, 4321, timeout=60 + 5 * iters)
    _assert_clean(results, min_cases=iters)


# ------------------------------------------------------- the combine math by hand ----
# Combine sends one row per (token, rank): the expert rank sums w[t,j] * out[row(t,j)] over the token's slots on it
# (fp32, j ascending, product then add), rounds that partial once for transport (MXFP8 row-wise or BF16), and the
# origin sums the rounded partials in fp32, the ranks in order of first appearance over j, BF16 result. The cases
# below are chosen so that every other reading of that sentence (per-slot rounding, rank-ascending sums, another j
# order, a fused multiply-add) gives a different number; the expected numbers are worked out by hand.

W1 = float.fromhex("0x1.00aca6p+0")  # an fp32 weight: W1 * (1 + 2^-7) rounds to fp32 visibly (no FMA, see below)


def hand_case():
    """Two ranks (experts 0, 1 on rank 0; 2, 3 on rank 1), k = 3, H = 64 (two MX blocks: columns 0 and 32).

    Rank 0, token 0: experts [2, 0, 3], weights [1, 0.5, 2^-8]: slots 0 and 2 on rank 1, slot 1 on rank 0 (ranks
    in order of first appearance: 1, 0). Token 1: experts [0, 1, -1], weights [1, W1, 0]: two slots on rank 0, one
    dropped. Rank 1 has no tokens. Expert output rows (zero outside columns 0 and 32):
    (t0, j0): [1, 3]; (t0, j1): [2^-7, 0]; (t0, j2): [1, 16]; (t1, j0): [-1, 0]; (t1, j1): [1 + 2^-7, 0].
    """
    cfg = EPConfig(num_experts=4, hidden=64, topk=3, max_tokens_per_rank=4)
    idxs = [torch.tensor([[2, 0, 3], [0, 1, -1]]), torch.zeros(0, 3, dtype=torch.int64)]
    ws = [torch.tensor([[1.0, 0.5, 2.0 ** -8], [1.0, W1, 0.0]]), torch.zeros(0, 3)]
    vals = {(0, 0): (1.0, 3.0), (0, 1): (2.0 ** -7, 0.0), (0, 2): (1.0, 16.0), (1, 0): (-1.0, 0.0),
            (1, 1): (1.0 + 2.0 ** -7, 0.0)}
    grad_y = torch.zeros(2, 64)
    grad_y[0, 0], grad_y[0, 32], grad_y[1, 0], grad_y[1, 32] = 1.0, 2.0, 4.0, -1.0
    return cfg, idxs, ws, vals, grad_y.to(torch.bfloat16)


def order_case():
    """Three ranks (El = 3), k = 5, one token on rank 0: experts [6, 0, 3, 7, 8], every weight 1: slots 0, 3, 4 on
    rank 2, slot 1 on rank 0, slot 2 on rank 1 (ranks in order of first appearance: 2, 0, 1). Column 0 pins the order
    of the partials: 2^25 (rank 2), -2^25 (rank 0), 1 (rank 1): (2^25 - 2^25) + 1 = 1, while rank-ascending order
    gives (-2^25 + 1) + 2^25 = 0 in fp32. Column 32 pins the j order inside rank 2's partial: 2^25, -2^25, 1 at
    slots 0, 3, 4: 1, while (2^25 + 1) - 2^25 = 0."""
    cfg = EPConfig(num_experts=9, hidden=64, topk=5, max_tokens_per_rank=2)
    idxs = [torch.tensor([[6, 0, 3, 7, 8]]), torch.zeros(0, 5, dtype=torch.int64), torch.zeros(0, 5, dtype=torch.int64)]
    ws = [torch.ones(1, 5), torch.zeros(0, 5), torch.zeros(0, 5)]
    b = 2.0 ** 25
    vals = {(0, 0): (b, b), (0, 1): (-b, 0.0), (0, 2): (1.0, 0.0), (0, 3): (0.0, -b), (0, 4): (0.0, 1.0)}
    return cfg, idxs, ws, vals, None


def hand_outs(cfg, idxs, vals):
    """Every rank's expert output for the hand cases (padding rows NaN: never read), and the oracle's dispatch."""
    xs = [torch.zeros(i.shape[0], cfg.hidden, dtype=torch.bfloat16) for i in idxs]
    expected, routes = oracle_dispatch(cfg, xs, idxs)
    outs = [torch.full((e.num_rows, cfg.hidden), float("nan")) for e in expected]
    for (t, j), (a, c) in vals.items():
        r, row = routes.dest[0][t, j].tolist()
        outs[r][row] = 0.0
        outs[r][row, 0], outs[r][row, 32] = a, c
    return xs, expected, routes, [o.to(torch.bfloat16) for o in outs]


def hand_expected(case: str, op: str, q: bool, mx_grad: bool = False) -> torch.Tensor:
    """The hand-computed rank-0 results (rank 0 holds the only tokens): ``op`` "combine" / "dispatch_backward"
    (``q``: MXFP8 transport; ``mx_grad``: the gradient given as MXFP8 rows) as float32 ``[T, 64]``."""
    y = torch.zeros(2 if case == "hand" else 1, 64)
    if case == "order":
        y[0, 0] = y[0, 32] = 1.0  # weights 1: combine and dispatch backward agree
        return y
    if op == "combine":
        # token 0: P_1 = 1*[1, 3] + 2^-8*[1, 16] = [1 + 2^-8, 3 + 2^-4], P_0 = 0.5*[2^-7, 0] = [2^-8, 0].
        #   BF16: bf16(1 + 2^-8) = 1 (a tie, to even), 3.0625 exact; y = bf16(1 + 2^-8) = 1, 3.0625.
        #   MXFP8 (rceil): block scale 2^-8: 257 -> e4m3 256 -> 1.0; block scale 2^-7: 392 -> 384 -> 3.0.
        #   (Rounding each row on its own would give y[0, 0] = bf16(1 + 2^-8 + 2^-8) = 1 + 2^-7.)
        y[0, 0], y[0, 32] = 1.0, (3.0 if q else 3.0625)
        # token 1: P_0 = -1 + fp32(W1 * (1 + 2^-7)) = 0.010467529296875 (a fused multiply-add would give
        #   0.0104374873...): BF16 0.010498046875 (FMA: 0.01043701171875); MXFP8: scale 2^-15, 343 -> 352 ->
        #   0.0107421875.
        y[1, 0] = 0.0107421875 if q else 0.010498046875
        return y
    # dispatch backward, every weight 1: token 0: G_1 = [2, 19], G_0 = [2^-7, 0]; grad_x = bf16(Tq(G_1) + Tq(G_0)):
    #   column 0: bf16(2 + 2^-7) = 2 (a tie, to even); column 32: BF16 19, MXFP8 scale 2^-4: 304 -> 320 (tie, to
    #   even) -> 20. Token 1: G_0 = -1 + (1 + 2^-7) = 2^-7; as MXFP8 rows 1 + 2^-7 decodes to 1 (258 -> 256): 0.
    y[0, 0], y[0, 32] = 2.0, (20.0 if q else 19.0)
    y[1, 0] = 0.0 if mx_grad else 2.0 ** -7
    return y


def hand_backward_expected(cfg, routes, expected, q: bool):
    """Combine backward of the hand case: rank 0's grad_w, and every rank's grad_expert_out rows as float32."""
    gw = torch.tensor([[7.0, 2.0 ** -7, 33.0], [-4.0, 4.0 * (1 + 2.0 ** -7), 0.0]])  # <grad_y[t], out row>
    w = {(0, 0): 1.0, (0, 1): 0.5, (0, 2): 2.0 ** -8, (1, 0): 1.0, (1, 1): W1}
    gys = {0: (1.0, 2.0), 1: (4.0, -1.0)}
    rows = [torch.zeros(e.num_rows, cfg.hidden) for e in expected]
    for (t, j), wt in w.items():
        r, row = routes.dest[0][t, j].tolist()
        a, c = gys[t]
        if (t, j) == (1, 1):  # W1 * [4, -1]: BF16 and MXFP8 (scales 2^-6, 2^-8: 256.7 -> 256) both give [4, -1]
            rows[r][row, 0], rows[r][row, 32] = 4.0, -1.0
        else:  # powers of two: exact
            rows[r][row, 0], rows[r][row, 32] = wt * a, wt * c
    return gw, rows


def _dense(g):
    return g.dequantize(torch.float32) if isinstance(g, MXTensor) else g.float()


@pytest.mark.parametrize("q", [True, False])
def test_oracle_combine_by_hand(q):
    for name, make in (("hand", hand_case), ("order", order_case)):
        cfg, idxs, ws, vals, _ = make()
        _, expected, routes, outs = hand_outs(cfg, idxs, vals)
        y = oracle_combine(cfg, outs, routes, ws, q)
        assert torch.equal(y[0].float(), hand_expected(name, "combine", q)), (name, y[0][:, [0, 32]])
        assert all(t.shape == (0, 64) for t in y[1:])
        grecv = outs if name == "order" else [torch.nan_to_num(o) for o in outs]
        gx = oracle_dispatch_backward(cfg, grecv, routes, q)
        assert torch.equal(gx[0].float(), hand_expected(name, "dispatch_backward", q)), (name, gx[0][:, [0, 32]])
        if name == "hand":
            mx = [quantize(o, mode=cfg.scale_mode, layout="grouped_m", group_offs=e.offs)
                  for o, e in zip(grecv, expected)]
            gx = oracle_dispatch_backward(cfg, mx, routes, q)
            assert torch.equal(gx[0].float(), hand_expected(name, "dispatch_backward", q, mx_grad=True))


@pytest.mark.parametrize("q", [True, False])
def test_oracle_combine_backward_by_hand(q):
    cfg, idxs, ws, vals, gy = hand_case()
    _, expected, routes, outs = hand_outs(cfg, idxs, vals)
    got = oracle_combine_backward(cfg, [gy, gy[:0]], routes, ws, outs, expected, q)
    gw, rows = hand_backward_expected(cfg, routes, expected, q)
    assert torch.equal(got[0].grad_weights, gw)
    assert got[1].grad_weights.shape == (0, 3)
    for r in range(2):
        assert isinstance(got[r].grad_expert_out, MXTensor) == q
        assert torch.equal(_dense(got[r].grad_expert_out), rows[r]), r


def hand_worker(rank: int, world: int) -> dict:
    """The hand cases through the reference backend (gloo), every transport, against the numbers worked out above."""
    fails = []
    cases = {2: [("hand", hand_case)], 3: [("order", order_case)]}[world]
    for name, make in cases:
        cfg, idxs, ws, vals, gy = make()
        group = EPGroup(cfg)
        xs, expected, routes, outs = hand_outs(cfg, idxs, vals)
        d = group.dispatch(xs[rank], idxs[rank], ws[rank])
        T = idxs[rank].shape[0]
        for q in (True, False):
            tag = f"{name}[rank {rank}] quantize={q}"
            y, saved = group.steps.combine_for_backward(outs[rank], d.handle, quantize=q)
            want = hand_expected(name, "combine", q)[:T]
            if y.dtype != torch.bfloat16 or not torch.equal(y.float(), want):
                fails.append(f"{tag}: combine {y[:, [0, 32]].tolist()} != {want[:, [0, 32]].tolist()}")
            grecv = outs[rank] if name == "order" else torch.nan_to_num(outs[rank])
            gx = group.steps.dispatch_backward(grecv, d.handle, quantize=q)
            want = hand_expected(name, "dispatch_backward", q)[:T]
            if not torch.equal(gx.float(), want):
                fails.append(f"{tag}: dispatch backward {gx[:, [0, 32]].tolist()} != {want[:, [0, 32]].tolist()}")
            if name != "hand":
                continue
            mx = quantize(grecv, mode=cfg.scale_mode, layout="grouped_m", group_offs=d.offs)
            gx = group.steps.dispatch_backward(mx, d.handle, quantize=q)
            want = hand_expected(name, "dispatch_backward", q, mx_grad=True)[:T]
            if not torch.equal(gx.float(), want):
                fails.append(f"{tag}: MX dispatch backward {gx[:, [0, 32]].tolist()} != {want[:, [0, 32]].tolist()}")
            g = group.steps.combine_backward(gy[:T], d.handle, saved, quantize=q)
            gw, rows = hand_backward_expected(cfg, routes, expected, q)
            if not torch.equal(g.grad_weights, gw[:T]):
                fails.append(f"{tag}: grad_w {g.grad_weights.tolist()} != {gw[:T].tolist()}")
            if isinstance(g.grad_expert_out, MXTensor) != q or not torch.equal(_dense(g.grad_expert_out), rows[rank]):
                fails.append(f"{tag}: grad_expert_out differs")
    return {"failures": fails}


@pytest.mark.parametrize("world", [2, 3])
def test_reference_combine_by_hand(world):
    results = run_world(world, hand_worker, timeout=120)
    fails = [f for r in results for f in r["failures"]]
    assert not fails, "\n".join(fails)
