"""In-process tests of EPConfig, the shared routing plan, sizes, input validation and the oracle
(no process group needed)."""
import random
from dataclasses import replace

import pytest
import torch

from mxcomm.ep import (EPConfig, EPGroup, LaunchConfig, build_plan, buffer_sizes, local_counts, max_recv_rows,
                       recv_rows)
from mxcomm.ep.ids import check_expert_ids
from mxcomm.ep.validate import dispatch_inputs as validate_dispatch_inputs
from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch
from mxcomm.ep.plan import call_output_rows, max_rows_per_source, send_tokens
from mxcomm.ep.reference import weighted_combine
from mxcomm.mx import round_up

BASE = EPConfig(num_experts=8, hidden=128, topk=2, max_tokens_per_rank=16)


# ------------------------------------------------------------------------------ config ----

def test_config_valid_and_num_local_experts():
    BASE.validate(4)
    assert BASE.num_local_experts(4) == 2
    replace(BASE, align=128, precision="bf16", scale_mode="floor", num_sms=8, exact_sizes=False).validate(8)


@pytest.mark.parametrize(
    "change, world, needle",
    [
        (dict(num_experts=6), 4, "multiple of the world size"),
        (dict(hidden=100), 1, "hidden (100) must be a multiple of 32"),
        (dict(align=64), 1, "align"),
        (dict(topk=9), 1, "topk (9) must not exceed"),
        (dict(topk=0), 1, "topk must be a positive int"),
        (dict(max_tokens_per_rank=0), 1, "max_tokens_per_rank"),
        (dict(num_experts=8.0), 1, "num_experts"),
        (dict(precision="fp8"), 1, "precision"),
        (dict(scale_mode="even"), 1, "scale_mode"),
        (dict(backend="mpi"), 1, "backend"),
        (dict(num_sms=0), 1, "num_sms"),
        (dict(timeout_s=0.0), 1, "timeout_s"),
        (dict(timeout_s=float("inf")), 1, "timeout_s"),
        (dict(exact_sizes=1), 1, "exact_sizes"),
        (dict(recv_window_rows=0), 2, "recv_window_rows"),
        (dict(recv_window_rows=True), 2, "recv_window_rows"),
        (dict(recv_window_rows=8.0), 2, "recv_window_rows"),
    ],
)
def test_config_validate_errors(change, world, needle):
    with pytest.raises(ValueError, match="invalid EPConfig") as ei:
        replace(BASE, **change).validate(world)
    assert needle in str(ei.value)


def test_config_validate_lists_every_problem_and_bad_world():
    with pytest.raises(ValueError) as ei:
        replace(BASE, hidden=33, align=16, precision="x").validate(2)
    msg = str(ei.value)
    assert "hidden" in msg and "align" in msg and "precision" in msg
    with pytest.raises(ValueError, match="world_size"):
        BASE.validate(0)


def test_fingerprint_distinguishes_every_field():
    assert BASE.fingerprint() == EPConfig(8, 128, 2, 16).fingerprint()
    assert dict(BASE.fingerprint())["topk"] == 2
    changes = dict(num_experts=16, hidden=256, topk=3, max_tokens_per_rank=17, align=128, precision="bf16",
                   scale_mode="floor", backend="nvshmem", num_sms=4, timeout_s=31.0, exact_sizes=False,
                   transport="put", recv_window_rows=64, launch=LaunchConfig(partials_per_sm=8))
    assert set(changes) == {n for n, _ in BASE.fingerprint()}
    base_codes = BASE.fingerprint_codes()
    for name, v in changes.items():
        other = replace(BASE, **{name: v})
        diff = [i for i, (a, b) in enumerate(zip(base_codes, other.fingerprint_codes())) if a != b]
        assert [BASE.fingerprint()[i][0] for i in diff] == [name]
    assert all(-(2**63) <= c < 2**63 for c in replace(BASE, timeout_s=1e300).fingerprint_codes())


def test_group_needs_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        EPGroup(BASE)
    with pytest.raises(TypeError, match="EPConfig"):
        EPGroup({"num_experts": 8})


# ------------------------------------------------------------------------------ sizes ----

@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_buffer_sizes_follow_documented_formula(world, precision):
    cfg = EPConfig(num_experts=32, hidden=7168, topk=8, max_tokens_per_rank=4096, align=128, precision=precision)
    El = 32 // world
    R = round_up(world * 4096 * min(8, El) + El * 127, 128)
    assert max_recv_rows(cfg, world) == R
    assert max_rows_per_source(cfg, world) == 4096 * min(8, El)
    b = buffer_sizes(cfg, world)
    scales = R * 224 if precision == "mxfp8" else 1  # scale rows at the payload rows
    push = buffer_sizes(replace(cfg, transport="push"), world)
    # one rank (transport "auto"): the local path writes the output directly, no receive buffer (its scale rows are
    # staged in recv_s); several ranks (the pull path): no receive buffer at all, nothing sized by the routing
    assert b.dispatch_payload == 0
    assert b.dispatch_scales == (scales if world == 1 else 0)
    # the push path receives through a window: the rows a balanced routing brings a rank (4096 * 8 plus each local
    # expert's padding), at most the worst case; a dispatch that brings more moves in rounds
    window = min(round_up(4096 * 8 + El * 127, 128), R)
    assert window < R or world == 1
    assert push.dispatch_payload == window * 7168 * (1 if precision == "mxfp8" else 2)
    assert push.dispatch_scales == (window * 224 if precision == "mxfp8" else 1)
    # the partials coming home (two copies of T*min(W, k) slots - one per (token, rank) - of 2H bytes + their scale
    # bytes), every source's published fp32 route weights and the route-weight gradients of combine backward ([W, T,
    # k] each). One rank (local path): combine reads the expert rows in place, nothing of this
    comb = 2 * 4096 * min(world, 8) * (7168 * 2 + 7168 // 32) + 2 * world * 4096 * 8 * 4
    assert b.combine_payload == (0 if world == 1 else comb)
    assert push.combine_payload == comb
    # every path with a pull list (all but local): two send copies of 2H bytes per token row (the pull dispatch's MXFP8
    # rows, combine backward's BF16 gradient rows) + their fp32 route weights, and the pull list (per source and token:
    # a 2-word epoch tag + 8 rows + 8 route weights, padded to 32 int32 words); the pull path adds the MXFP8 rows'
    # scale bytes
    send = 2 * 4096 * 2 * 7168 + 2 * 4096 * 8 * 4 + world * 4096 * 32 * 4
    pull = send + (2 * 4096 * 224 if precision == "mxfp8" else 1)
    assert b.pull_send == (0 if world == 1 else pull)
    assert push.pull_send == send
    assert b.counts == push.counts == (world * 32 + world) * 4  # the counts matrix, then one refusal word per rank
    assert b.flags == push.flags == 6 * world * 8  # counts, dispatch, combine, weights, route_grad, window
    assert b.total == EPGroup.buffer_bytes(cfg, world)
    assert b.total == b.dispatch_payload + b.dispatch_scales + b.combine_payload + b.counts + b.flags + b.pull_send
    assert push.total == EPGroup.buffer_bytes(replace(cfg, transport="push"), world)
    with pytest.raises(ValueError):
        buffer_sizes(replace(cfg, num_experts=33), world if world > 1 else 2)


def test_mxfp8_buffers_smaller_than_bf16():
    """The push path's receive buffer holds MXFP8 rows in about half the bytes (the pull path has none)."""
    cfg = EPConfig(num_experts=16, hidden=4096, topk=4, max_tokens_per_rank=1024, transport="push")
    mx, bf = buffer_sizes(cfg, 4), buffer_sizes(replace(cfg, precision="bf16"), 4)
    assert mx.dispatch_payload + mx.dispatch_scales < 0.55 * bf.dispatch_payload


def test_worst_case_routing_fits_bound():
    """Every rank sends every token to all of rank 0's experts: R stays within max_recv_rows."""
    for world, El, k, align in [(1, 4, 4, 32), (2, 2, 3, 128), (4, 3, 3, 32), (4, 1, 2, 128)]:
        E = El * world
        T = 5
        cfg = EPConfig(num_experts=E, hidden=32, topk=k, max_tokens_per_rank=T, align=align)
        idx = torch.full((T, k), -1, dtype=torch.int64)
        idx[:, :min(k, El)] = torch.arange(min(k, El))
        counts = torch.stack([local_counts(idx, E) for _ in range(world)])
        plan = build_plan(counts, idx, 0, align)
        R = int(plan.num_rows)
        bound = max_recv_rows(cfg, world)
        assert R <= bound < R + align * (El + 1)


def test_call_output_rows_bound_what_a_call_can_receive():
    """The storage of an exact-size dispatch run as one captured call: on one rank the rows the call's own tokens
    can fill (every token on all of k experts, each group padded) - never fewer than such a routing needs, at most
    ``E (align - 1)`` rows more than any routing of these tokens needs; on the pull path ``max_recv_rows`` while the
    ranks' tokens fit ``peer_call_tokens``; None on the push and put paths, without exact sizes, above the limits,
    and for no tokens."""
    for E, k, align, T in [(4, 4, 32, 5), (16, 3, 8, 13), (8, 2, 128, 1)]:
        cfg = EPConfig(num_experts=E, hidden=32, topk=k, max_tokens_per_rank=64, align=align)
        rows = call_output_rows(cfg, 1, T)
        for spread in (True, False):  # selections spread over every expert (most padding) or on the first k
            g = torch.Generator().manual_seed(T)
            idx = (torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k] if spread
                   else torch.arange(k).expand(T, k).clone())
            R = int(build_plan(local_counts(idx, E)[None], idx, 0, align).num_rows)
            assert R <= rows <= R + E * (align - 1) + align, (E, k, align, T, spread, R, rows)
        assert call_output_rows(cfg, 1, 0) is None
        assert call_output_rows(replace(cfg, exact_sizes=False), 1, T) is None
        assert call_output_rows(replace(cfg, launch=LaunchConfig(call_graph_tokens=T - 1)), 1, T) is None
        assert call_output_rows(cfg, 1, T, LaunchConfig(call_graph_tokens=T - 1)) is None  # the backend's settings
    cfg = EPConfig(num_experts=16, hidden=32, topk=4, max_tokens_per_rank=64)
    assert call_output_rows(cfg, 4, 7) == max_recv_rows(cfg, 4)  # 4 x 64 <= 1024
    assert call_output_rows(cfg, 4, 7, LaunchConfig(peer_call_tokens=255)) is None
    assert call_output_rows(replace(cfg, transport="push"), 4, 7) is None
    assert call_output_rows(replace(cfg, transport="put"), 4, 7) is None
    assert call_output_rows(replace(cfg, max_tokens_per_rank=512), 4, 7) is None  # 4 x 512 > 1024


# ------------------------------------------------------------------------------ plan ----

def _random_world(seed, world, El, k, align, drop_p=0.3):
    g = torch.Generator().manual_seed(seed)
    E = world * El
    idxs = []
    for s in range(world):
        T = int(torch.randint(0, 12, (1,), generator=g))
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
        idx = torch.where(torch.rand(T, k, generator=g) < drop_p, torch.full_like(idx, -1), idx)
        idxs.append(idx.to(torch.int32 if s % 2 else torch.int64))
    cfg = EPConfig(num_experts=E, hidden=32, topk=k, max_tokens_per_rank=16, align=align)
    counts = torch.stack([local_counts(i, E) for i in idxs])
    plans = [build_plan(counts, idxs[s], s, align) for s in range(world)]
    return cfg, idxs, counts, plans


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_oracle_routes(seed):
    rng = random.Random(seed)
    world, El = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3])
    k = rng.randint(1, min(4, world * El))
    align = rng.choice([32, 128])
    cfg, idxs, counts, plans = _random_world(seed, world, El, k, align)
    xs = [torch.zeros(i.shape[0], 32, dtype=torch.bfloat16) for i in idxs]
    expected, routes = oracle_dispatch(cfg, xs, idxs)
    for s, plan in enumerate(plans):
        for name in ("counts", "dest_rank", "dest_row", "send_pos", "send_order", "send_splits", "num_send",
                     "recv_splits", "expert_counts", "offs", "src_row_start", "src_send_pos", "num_rows", "num_recv"):
            t = getattr(plan, name)
            assert t.dtype == torch.int32 and t.is_contiguous(), name
        assert torch.equal(plan.dest_rank.long(), routes.dest[s][..., 0])
        assert torch.equal(plan.dest_row.long(), routes.dest[s][..., 1])
        assert torch.equal(plan.offs, expected[s].offs)
        assert torch.equal(plan.expert_counts, expected[s].counts)
        assert int(plan.num_rows) == expected[s].num_rows
        assert torch.equal(plan.counts[s], local_counts(idxs[s], cfg.num_experts))
        # send order: valid slots by (expert, t, j); send_pos is its inverse
        n_send = int(plan.num_send)
        order = plan.send_order.long()
        flat = idxs[s].reshape(-1).long()
        assert bool((flat[order[:n_send]] >= 0).all()) and bool((flat[order[n_send:]] < 0).all())
        keys = flat[order[:n_send]] * 10_000 + order[:n_send]
        assert bool((keys[1:] > keys[:-1]).all())
        valid = plan.send_pos.reshape(-1) >= 0
        assert torch.equal(order[plan.send_pos.reshape(-1)[valid].long()], torch.nonzero(valid).view(-1))
        assert torch.equal(send_tokens(plan, n_send), order[:n_send] // k)
        # send splits per destination rank, in send order
        dr = plan.dest_rank.reshape(-1).long()[order[:n_send]]
        assert torch.equal(plan.send_splits.long(), torch.bincount(dr, minlength=world)[:world])


@pytest.mark.parametrize("seed", range(8))
def test_recv_rows_match_senders(seed):
    """Receive order on rank r = for each source s, s's rows to r in s's send order."""
    rng = random.Random(100 + seed)
    world, El, k = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), 1
    k = rng.randint(1, min(3, world * El))
    cfg, idxs, counts, plans = _random_world(1000 + seed, world, El, k, rng.choice([32, 128]))
    for r, plan in enumerate(plans):
        n = int(plan.num_recv)
        rows = recv_rows(plan, n + 7)
        assert rows.dtype == torch.int32
        assert bool((rows[n:] == -1).all())
        rows = rows[:n].long()
        expect = []
        for s, ps in enumerate(plans):
            order = ps.send_order.long()[:int(ps.num_send)]
            dr, drow = ps.dest_rank.reshape(-1).long()[order], ps.dest_row.reshape(-1).long()[order]
            expect.append(drow[dr == r])
        assert torch.equal(rows, torch.cat(expect) if expect else rows)
        assert torch.equal(plan.recv_splits.long(), torch.tensor([int((e).numel()) for e in expect]))
        # rows are exactly the real (non-padding) rows of the expert-major buffer
        real = torch.zeros(int(plan.num_rows), dtype=torch.bool)
        start = 0
        for end, c in zip(plan.offs.tolist(), plan.expert_counts.tolist()):
            real[start:start + c] = True
            start = end
        assert torch.equal(torch.sort(rows).values, torch.nonzero(real).view(-1))
        # src_send_pos / src_row_start: block (s, e) starts where s sent its first row to e
        for s, ps in enumerate(plans):
            for le in range(El):
                e = r * El + le
                hits = torch.nonzero(idxs[s].reshape(-1).long() == e).view(-1)
                if hits.numel():
                    assert int(plan.src_send_pos[s, le]) == int(ps.send_pos.reshape(-1)[hits[0]])
                    assert int(plan.src_row_start[s, le]) == int(ps.dest_row.reshape(-1)[hits[0]])


def test_plan_empty_inputs():
    counts = torch.zeros(2, 4, dtype=torch.int32)
    plan = build_plan(counts, torch.zeros(0, 2, dtype=torch.int64), 1, 32)
    assert plan.dest_row.shape == (0, 2) and plan.send_order.shape == (0,)
    assert plan.offs.tolist() == [0, 0] and int(plan.num_rows) == 0
    assert recv_rows(plan, 3).tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match="multiple"):
        build_plan(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(0, 2), 0, 32)
    with pytest.raises(ValueError, match="rank"):
        build_plan(counts, torch.zeros(0, 2), 2, 32)


def test_layout_worked_example():
    """Hand-derived from the contract: W=2, E=4 (El=2), align 32.

    rank 0 topk_idx [[1, 2], [0, 1]], rank 1 [[1, -1], [3, 0]].
    Rank 0 holds experts 0, 1: expert 0 = [src0 (t1,j0), src1 (t1,j1)] -> rows 0, 1, pad to 32;
    expert 1 = [src0 (t0,j0), src0 (t1,j1), src1 (t0,j0)] -> rows 32, 33, 34, pad to 64.
    Rank 1 holds experts 2, 3: expert 2 = [src0 (t0,j1)] -> row 0; expert 3 = [src1 (t1,j0)] -> row 32.
    """
    idxs = [torch.tensor([[1, 2], [0, 1]]), torch.tensor([[1, -1], [3, 0]])]
    counts = torch.stack([local_counts(i, 4) for i in idxs])
    assert counts.tolist() == [[1, 2, 1, 0], [1, 1, 0, 1]]
    p0, p1 = (build_plan(counts, idxs[s], s, 32) for s in range(2))
    assert p0.dest_rank.tolist() == [[0, 1], [0, 0]]
    assert p0.dest_row.tolist() == [[32, 0], [0, 33]]
    assert p1.dest_rank.tolist() == [[0, -1], [1, 0]]
    assert p1.dest_row.tolist() == [[34, -1], [32, 1]]
    assert p0.offs.tolist() == [32, 64] and p0.expert_counts.tolist() == [2, 3]
    assert p1.offs.tolist() == [32, 64] and p1.expert_counts.tolist() == [1, 1]
    assert p0.send_pos.tolist() == [[1, 3], [0, 2]]  # send order: (t1,j0)->e0, (t0,j0)->e1, (t1,j1)->e1, (t0,j1)->e2
    assert p0.send_splits.tolist() == [3, 1] and p0.recv_splits.tolist() == [3, 2]
    assert recv_rows(p0, 5).tolist() == [0, 32, 33, 1, 34]


# ------------------------------------------------------------------------ validation ----

def test_check_expert_ids():
    check_expert_ids(torch.tensor([[0, 7], [-1, -1], [3, -1]]), 8)
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = 8"):
        check_expert_ids(torch.tensor([[0, 7], [8, 1]]), 8)
    with pytest.raises(ValueError, match=r"topk_idx\[0, 1\] = -3"):
        check_expert_ids(torch.tensor([[0, -3]], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="token 1 lists expert 5 more than once"):
        check_expert_ids(torch.tensor([[0, 1, 2], [5, -1, 5]]), 8)


def test_validate_dispatch_inputs():
    cfg = BASE
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 4)
    w = torch.ones(4, 2)
    validate_dispatch_inputs(cfg, x, idx, w)
    validate_dispatch_inputs(cfg, x[:0], idx[:0], w[:0])
    with pytest.raises(TypeError, match="bfloat16"):
        validate_dispatch_inputs(cfg, x.half(), idx, w)
    with pytest.raises(ValueError, match="capacity"):
        validate_dispatch_inputs(cfg, torch.zeros(17, 128, dtype=torch.bfloat16), idx, w)
    with pytest.raises(ValueError, match="device"):
        validate_dispatch_inputs(cfg, x, idx, w.to("meta"))
    # value checks can be left to a backend that checks on the device
    validate_dispatch_inputs(cfg, x, torch.tensor([[0, 99]] * 4), w, check_values=False)


# ---------------------------------------------------------------------------- oracle ----

def test_weighted_combine_matches_loop():
    g = torch.Generator().manual_seed(3)
    T, k, H, n = 9, 3, 64, 20
    rows = torch.randn(n, H, generator=g)
    pos = torch.randint(-1, n, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    y = weighted_combine(rows, pos, w)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            if pos[t, j] >= 0:
                ref[t] += w[t, j] * rows[pos[t, j]]
    assert torch.equal(y, ref)
    assert weighted_combine(rows[:0], torch.full((2, k), -1), w[:2]).abs().sum() == 0


def test_oracle_combine_dropped_and_padding():
    """Single rank: combine of dispatch rows equals the weighted sum of the tokens themselves (bf16 transport)."""
    cfg = EPConfig(num_experts=3, hidden=64, topk=2, max_tokens_per_rank=8, precision="bf16")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 1], [0, 1]])
    w = torch.rand(5, 2, generator=g)
    res, routes = oracle_dispatch(cfg, [x], [idx])
    out = res[0].x.clone()
    pad = torch.ones(out.shape[0], dtype=torch.bool)
    start = 0
    for end, c in zip(res[0].offs.tolist(), res[0].counts.tolist()):
        pad[start:start + c] = False
        start = end
    out[pad] = float("nan")
    y = oracle_combine(cfg, [out], routes, [w], quantize_rows=False)[0]
    wm = torch.where(idx >= 0, w, torch.zeros_like(w))
    ref = (wm[:, 0:1] * x.float() + wm[:, 1:2] * x.float()).to(torch.bfloat16)
    assert torch.equal(y, ref)
    assert bool((y[2] == 0).all())


def test_transport_values():
    replace(BASE, transport="put").validate(2)
    with pytest.raises(ValueError, match="transport must be one of"):
        replace(BASE, transport="nvlink").validate(2)


def test_put_path_rounds_keep_its_buffers_from_growing_with_the_world():
    """Above ``W = k`` the put path moves ``T_max * k // W`` tokens of every source per round in the combine
    direction and combine backward, so its staging and its ``recv_q`` stay ``T_max * k`` rows of ``2H`` bytes;
    only the small per-(source, token) tables (entries, weights) grow with ``W``."""
    from mxcomm.ep.plan import buffer_regions, put_round_tokens, recv_window_rows

    cfg = replace(BASE, transport="put", num_experts=64)
    T, k, H = cfg.max_tokens_per_rank, cfg.topk, cfg.hidden
    assert put_round_tokens(cfg, 1) == put_round_tokens(cfg, k) == T
    for W in (4, 8, 16, 32, 64):
        Tc = put_round_tokens(cfg, W)
        assert Tc == max(1, T * k // W) and W * Tc <= max(T * k, W)
        b = {r.name: r.nbytes for r in buffer_regions(cfg, W)}
        assert b["ep.stage_q"] == max(T * k, W * Tc) * 2 * H and b["ep.stage_s"] == max(T * k, W * Tc) * (H // 32)
        assert b["ep.recv_q"] == max(recv_window_rows(cfg, W, True), -(-W * Tc * 2 * H // H)) * H
        assert b["ep.recv_q"] <= max(recv_window_rows(cfg, W), max(T * k, W) * 2) * H
    assert put_round_tokens(replace(cfg, max_tokens_per_rank=3), 64) == 1  # at least one token a round


def test_put_path_buffers_are_counted_in_the_memory_report():
    from mxcomm.ep.plan import buffer_sizes, max_recv_rows, put_round_tokens, recv_window_rows, round_up

    auto, put = buffer_sizes(BASE, 2), buffer_sizes(replace(BASE, transport="put"), 2)
    R, H, T, k = max_recv_rows(BASE, 2), BASE.hidden, BASE.max_tokens_per_rank, BASE.topk
    EW = 8  # pull-list entry words: 2 tag words + k = 2 rows + 2 route weights, a power of two
    assert auto.put_staging == 0
    # stage rows and scales (the rows a dispatch sends, T * k, or one partial per (source, token), W * T: not the
    # worst-case received rows R), the staged pull-list entries per destination, the staged route-weight gradients
    # per origin, and combine backward's received route weights per source
    S = T * max(k, 2)
    assert S < R
    assert put.put_staging == S * 2 * H + S * (H // 32) + 2 * T * EW * 4 + 2 * T * k * 4 + 2 * T * k * 4
    send_s = 2 * T * (H // 32)  # the pull path's MXFP8 scale bytes: the put path does not pull
    copy = T * 2 * H + T * k * 4  # and one send copy (rows, weights) is enough there: combine backward's staging
    assert put.pull_send == auto.pull_send - send_s - copy
    # the put path receives into symmetric buffers (recv_q, recv_s) and stages; the pull path does neither. Its
    # receive window: a balanced routing's rows (T * k plus each local expert's padding, 4 * 31) or the rows of
    # combine backward's gradient rows (W * T rows of 2H bytes), whichever is more, at most the worst case R
    Wn = recv_window_rows(BASE, 2)
    assert Wn == max(round_up(T * k + 4 * 31, 32), 2 * T * 2 * H // H) < R
    assert auto.dispatch_payload == auto.dispatch_scales == 0 < put.dispatch_payload
    assert put.dispatch_payload == max(Wn, 2 * T * 2 * H // H) * H and put.dispatch_scales == Wn * (H // 32)
    assert put.total == (auto.total - send_s - copy + put.put_staging + put.dispatch_payload + put.dispatch_scales)
    # a smaller window (more rounds) shrinks the receive buffers (combine backward's gradient rows then move in
    # rounds of 40 * H // (2 * 2H) = 10 tokens a source, which fit it); a larger one stops at the worst case
    small = buffer_sizes(replace(BASE, transport="put", recv_window_rows=40), 2)
    assert small.dispatch_scales == 40 * (H // 32) and small.dispatch_payload == 40 * H
    assert put_round_tokens(replace(BASE, transport="put", recv_window_rows=40), 2) == 10
    assert recv_window_rows(replace(BASE, recv_window_rows=10**6), 2) == R
