"""Cases and rank workers for the EP reference-backend tests (imported by spawned ranks).

Every rank builds every rank's inputs from the case seed (deterministic), runs the oracle for
the whole world locally, runs the backend collectively, and compares its own outputs. Workers
collect failures instead of raising, so all ranks stay in lockstep and one bad case does not
hang the others; they return ``{"failures": [...], "cases": n, ...}``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Optional

import torch

from mxcomm.ep import EPConfig, EPGroup, LaunchConfig
from mxcomm.ep.handle import DispatchResult
from mxcomm.ep.plan import max_recv_rows
from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch
from mxcomm.ep.reference.backward import bf16_saturated, sum_to_bf16
from mxcomm.mx import MXTensor, ScaleLayout, quantize
from mxcomm.mx.subclass import MXFP8Tensor

try:  # present in the spawned ranks (tests/ is on sys.path)
    from _dist import progress
except ImportError:  # pragma: no cover
    def progress(msg):
        pass


@dataclass(frozen=True)
class Case:
    """One dispatch/combine scenario for a world of ``len(tokens)`` ranks."""

    name: str
    tokens: tuple            # T per rank
    num_experts: int
    hidden: int
    topk: int
    align: int = 32
    precision: str = "mxfp8"
    scale_mode: str = "rceil"
    exact_sizes: bool = True
    routing: str = "random"  # random | one_expert | subset
    hot_expert: int = 0      # for one_expert
    used_experts: int = 0    # for subset: only experts [0, used) receive rows
    drop_p: float = 0.0      # probability a slot is -1
    nan_tokens: int = 0      # tokens with one NaN/Inf element
    idx_dtype: torch.dtype = torch.int64
    w_dtype: torch.dtype = torch.float32
    out_nan_rows: int = 0    # real expert_out rows set to NaN in one block
    out_inf: bool = False    # out_nan_rows cycle NaN, +Inf, -Inf
    max_tokens: Optional[int] = None
    seed: int = 0
    combine_modes: tuple = (None, True, False)  # quantize= values to run combine with
    device: str = "cpu"
    backend: str = "torch"
    transport: str = "auto"
    num_sms: Optional[int] = None  # the nvshmem backend's SM budget (None: the whole GPU)
    misaligned_x: bool = False  # x passed as a view 2 bytes past a 16-byte boundary
    recv_window_rows: Optional[int] = None  # the push and put paths' dispatch receive window (None: the default)

    def config(self) -> EPConfig:
        return EPConfig(
            num_experts=self.num_experts, hidden=self.hidden, topk=self.topk,
            max_tokens_per_rank=self.max_tokens or max(max(self.tokens), 1), align=self.align,
            precision=self.precision, scale_mode=self.scale_mode, exact_sizes=self.exact_sizes,
            backend=self.backend, timeout_s=60.0, transport=self.transport, num_sms=self.num_sms,
            recv_window_rows=self.recv_window_rows,
        )


def _routing(case: Case, T: int, g: torch.Generator) -> torch.Tensor:
    E, k = case.num_experts, case.topk
    if case.routing == "random":
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k]
    elif case.routing == "subset":
        used = case.used_experts
        idx = torch.argsort(torch.rand(T, used, generator=g), dim=1)[:, :k]
        if used < k:
            raise ValueError("subset routing needs used_experts >= topk")
    elif case.routing == "one_expert":
        idx = torch.full((T, k), -1, dtype=torch.int64)
        idx[:, 0] = case.hot_expert
    else:
        raise ValueError(case.routing)
    if case.drop_p > 0:
        drop = torch.rand(T, k, generator=g) < case.drop_p
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    return idx.to(case.idx_dtype)


def make_inputs(case: Case):
    """Every rank's (x bf16 [T,H], topk_idx [T,k], topk_weights [T,k]) for ``case`` (CPU)."""
    g = torch.Generator().manual_seed(case.seed)
    xs, idxs, ws = [], [], []
    for T in case.tokens:
        H = case.hidden
        mag = torch.exp2(torch.randint(-12, 12, (T, 1), generator=g).float())
        x = torch.randn(T, H, generator=g) * mag
        if T >= 3:
            x[T // 3] = 0.0  # an all-zero token
        x = x.to(torch.bfloat16)
        bad_tokens = torch.randperm(T, generator=g)[:case.nan_tokens].tolist()  # distinct: one bad element each
        for i, t in enumerate(bad_tokens):
            c = int(torch.randint(0, H, (1,), generator=g))
            x[t, c] = float("nan") if i % 2 == 0 else float("inf")
        idxs.append(_routing(case, T, g))
        xs.append(x)
        ws.append(torch.rand(T, case.topk, generator=g).to(case.w_dtype))
    return xs, idxs, ws


def make_expert_outs(case: Case, expected):
    """Every rank's expert_out (bf16, expert-major); padding rows are NaN (must be ignored)."""
    outs = []
    for r, res in enumerate(expected):
        g = torch.Generator().manual_seed(case.seed * 7919 + r + 1)
        R = res.num_rows
        o = torch.randn(R, case.hidden, generator=g) * 4.0
        real = torch.zeros(R, dtype=torch.bool)
        offs = res.offs.tolist()
        counts = res.counts.tolist()
        start = 0
        for end, n in zip(offs, counts):
            real[start:start + n] = True
            start = end
        o[~real] = float("nan")
        real_rows = torch.nonzero(real).view(-1)
        for i in range(min(case.out_nan_rows, real_rows.numel())):
            row = int(real_rows[int(torch.randint(0, real_rows.numel(), (1,), generator=g))])
            col = int(torch.randint(0, case.hidden, (1,), generator=g))
            o[row, col] = (float("nan"), float("inf"), -float("inf"))[i % 3] if case.out_inf else float("nan")
        outs.append(o.to(torch.bfloat16))
    return outs


def row_checksums(u8: torch.Tensor) -> torch.Tensor:
    """Position-weighted byte sum of each row of a uint8 ``[R, B]`` tensor (int64 ``[R]``)."""
    w = torch.arange(1, u8.shape[1] + 1, dtype=torch.int64, device=u8.device)
    return (u8.to(torch.int64) * w).sum(1)


def _cmp_bytes(what: str, got: torch.Tensor, exp: torch.Tensor, fails: list) -> None:
    got, exp = got.cpu(), exp.cpu()
    if got.shape != exp.shape:
        fails.append(f"{what}: shape {tuple(got.shape)} != expected {tuple(exp.shape)}")
        return
    gu, eu = got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)
    if gu.dim() == 1:
        gu, eu = gu.view(-1, 1), eu.view(-1, 1)
    if not torch.equal(gu, eu):
        bad = torch.nonzero(row_checksums(gu) != row_checksums(eu)).view(-1)
        if bad.numel() == 0:
            bad = torch.nonzero((gu != eu).any(1)).view(-1)
        fails.append(f"{what}: {bad.numel()} rows differ, first rows {bad[:8].tolist()}")


def check_dispatch(tag: str, res, exp, config: EPConfig, fails: list) -> None:
    """Bit-exact comparison of a dispatch's :class:`Dispatched` (or a backend's DispatchResult) with the oracle's."""
    if res.num_rows != exp.num_rows:
        fails.append(f"{tag}: num_rows {res.num_rows} != {exp.num_rows}")
        return
    for name in ("offs", "counts"):
        t = getattr(res, name)
        if t.dtype != torch.int32 or not torch.equal(t.cpu(), getattr(exp, name)):
            fails.append(f"{tag}: {name} {t.dtype} {t.tolist()} != {getattr(exp, name).tolist()}")
    if config.exact_sizes and res.num_rows != int(res.offs[-1]):
        fails.append(f"{tag}: exact num_rows {res.num_rows} != offs[-1]")
    if res.num_rows % config.align:
        fails.append(f"{tag}: num_rows {res.num_rows} not a multiple of align {config.align}")
    if config.precision == "mxfp8":
        x = res.x.mx if isinstance(res.x, MXFP8Tensor) else res.x  # the public result carries the MX value as one
        if not isinstance(x, MXTensor):
            fails.append(f"{tag}: x is {type(res.x).__name__}, expected an MXFP8Tensor (or a backend's MXTensor)")
            return
        if x.layout != ScaleLayout.GROUPED_M or x.axis != 1 or x.mode != config.scale_mode:
            fails.append(f"{tag}: MXTensor layout/axis/mode {x.layout}/{x.axis}/{x.mode}")
        if x.qdata.dtype != torch.float8_e4m3fn or x.scales.dtype != torch.uint8:
            fails.append(f"{tag}: dtypes {x.qdata.dtype}/{x.scales.dtype}")
        if x.group_offs is None or not torch.equal(x.group_offs.cpu(), exp.offs):
            fails.append(f"{tag}: group_offs != offs")
        n, ns = written_rows(exp.offs, config)
        _cmp_bytes(f"{tag} payload", x.qdata[:n], exp.x.qdata[:n], fails)
        _cmp_bytes(f"{tag} grouped scales", x.scales[:ns], exp.x.scales[:ns], fails)
    else:
        if not isinstance(res.x, torch.Tensor) or res.x.dtype != torch.bfloat16:
            fails.append(f"{tag}: bf16 result has type {type(res.x).__name__} {getattr(res.x, 'dtype', None)}")
            return
        n, _ = written_rows(exp.offs, config)
        _cmp_bytes(f"{tag} bf16 payload", res.x[:n], exp.x[:n], fails)


def written_rows(offs: torch.Tensor, config: EPConfig) -> tuple:
    """``(payload rows, grouped scale rows)`` of a dispatch output that are defined: all of them with exact sizes;
    in the no-sync mode the rows up to ``offs[-1]`` and the scale tile-rows of the groups (rows past them are not
    written, docs/design.md)."""
    if config.exact_sizes:
        return None, None
    offs = offs.cpu().to(torch.int64)
    sizes = offs - torch.cat([offs.new_zeros(1), offs[:-1]])
    return int(offs[-1]), int(((sizes + 127) // 128 * 128).sum())


def check_nan_blocks(tag: str, res, config: EPConfig, fails: list) -> None:
    """Each received row's NaN/Inf element poisons only its own 32-block (one bad element per token)."""
    if config.precision == "mxfp8":
        mx = res.x.mx if isinstance(res.x, MXFP8Tensor) else res.x
        s = mx.row_scales().cpu()
        q = mx.qdata.view(torch.uint8).cpu()
        nan_blocks = (s == 255).sum(1)
        if bool((nan_blocks > 1).any()):
            fails.append(f"{tag}: a row has more than one NaN block")
        rows = torch.nonzero(nan_blocks == 1).view(-1)
        for r in rows.tolist():
            nan_bytes = int(((q[r] & 0x7F) == 0x7F).sum())
            b = int(torch.nonzero(s[r] == 255)[0])
            blk = q[r, b * 32:(b + 1) * 32]
            if nan_bytes != 32 or not bool(((blk & 0x7F) == 0x7F).all()):
                fails.append(f"{tag}: row {r}: {nan_bytes} NaN payload bytes (expected the 32 of block {b})")
                break
    else:
        x = res.x.float().cpu()
        if bool((((~torch.isfinite(x)).sum(1)) > 1).any()):
            fails.append(f"{tag}: a bf16 row has more than one non-finite element")


def check_combine(tag: str, y: torch.Tensor, y_exp: torch.Tensor, fails: list, exact: list) -> None:
    y = y.cpu()
    if y.dtype != torch.bfloat16 or y.shape != y_exp.shape:
        fails.append(f"{tag}: combine output {y.dtype} {tuple(y.shape)} != bf16 {tuple(y_exp.shape)}")
        return
    a, b = y.float(), y_exp.float()
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        fails.append(f"{tag}: NaN positions differ ({int(torch.isnan(a).sum())} vs {int(torch.isnan(b).sum())})")
        return
    fin = ~torch.isnan(b)
    # fp32 reduction tolerance: one bf16 rounding step of the value (2^-8 relative), plus a floor for sums that
    # cancel to (almost) zero, where a fused multiply-add on the GPU and the oracle's separately rounded products
    # leave residuals of the fp32 rounding error of the terms (seen: 2^-25 where the oracle gave 0): 2^-16 of the
    # largest output magnitude. A wrong row or weight errs by the order of the values themselves.
    err = (a[fin] - b[fin]).abs()
    scale = float(b[fin].abs().max()) if err.numel() else 0.0
    tol = b[fin].abs() * 2.0 ** -7 + scale * 2.0 ** -16 + 1e-30
    if err.numel() and bool((err > tol).any()):
        fails.append(f"{tag}: combine differs, max abs err {float(err.max()):.3e}")
    exact.append(bool(torch.equal(a[fin], b[fin])))


def run_case(group: EPGroup, case: Case, rank: int, fails: list, exact: list) -> None:
    """Dispatch + combine of one case on this rank, compared with the oracle."""
    config = group.config
    dev = torch.device(case.device)
    xs, idxs, ws = make_inputs(case)
    expected, routes = oracle_dispatch(config, xs, idxs)
    x = xs[rank].to(dev)
    if case.misaligned_x:  # a contiguous view whose address is 2 bytes past a 16-byte boundary
        x = torch.empty(x.numel() + 8, dtype=x.dtype, device=dev)[1:1 + x.numel()].view_as(x).copy_(x)
        assert x.data_ptr() % 16 == 2, x.data_ptr()
    res = group.dispatch(x, idxs[rank].to(dev), ws[rank].to(dev))
    handle = res.handle
    tag = f"{case.name}[rank {rank}]"
    check_dispatch(tag, res, expected[rank], config, fails)
    if case.nan_tokens:
        check_nan_blocks(tag, res, config, fails)
    outs = make_expert_outs(case, expected)
    for qmode in case.combine_modes:
        q = (config.precision == "mxfp8") if qmode is None else qmode
        y = group.combine(outs[rank].to(dev), handle, quantize=qmode)
        y_exp = oracle_combine(config, outs, routes, ws, quantize_rows=q)[rank]
        check_combine(f"{tag} combine(quantize={qmode})", y, y_exp, fails, exact)
    # other weights than the dispatch's, on every rank (the nvshmem pull path exchanges these; the dispatch's came
    # with its rows): -w / 2, exact in the weights' dtype
    ws2 = [w * -0.5 for w in ws]
    y = group.combine(outs[rank].to(dev), handle, topk_weights=ws2[rank].to(dev))
    y_exp = oracle_combine(config, outs, routes, ws2, quantize_rows=config.precision == "mxfp8")[rank]
    check_combine(f"{tag} combine(topk_weights=other)", y, y_exp, fails, exact)


def each_case(rank: int, world: int, cases: list, fails: list, run) -> dict:
    """Call ``run(group, case)`` for every case, one EPGroup per distinct config (built on first use, every
    rank in the same order). An exception becomes a failure line with its traceback, so the ranks stay in
    lockstep and the other cases still run. Returns the groups by config."""
    import traceback

    groups = {}
    for case in cases:
        assert len(case.tokens) == world, case.name
        progress(case.name)
        cfg = case.config()
        try:
            if cfg not in groups:
                groups[cfg] = EPGroup(cfg)
                auto = "local" if world == 1 else "pull"
                want = {"torch": "all_to_all"}.get(
                    cfg.backend, {"put": "put", "push": "push", "pull": "pull"}.get(cfg.transport, auto))
                if groups[cfg].path != want:  # one node: "auto" means the pull dispatch (one rank: local)
                    fails.append(f"{case.name}[rank {rank}]: group path {groups[cfg].path!r}, expected {want!r}")
            run(groups[cfg], case)
        except Exception as e:  # noqa: BLE001 - keep ranks in lockstep; report
            fails.append(f"{case.name}[rank {rank}]: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
    return groups


def run_cases(rank: int, world: int, cases: list) -> dict:
    """Worker: run every case (building one EPGroup per distinct config)."""
    fails, exact = [], []
    each_case(rank, world, cases, fails, lambda group, case: run_case(group, case, rank, fails, exact))
    return {"failures": fails, "cases": len(cases), "combine_exact": sum(exact), "combine_checks": len(exact)}


# ------------------------------------------------ rank-local reference (the fault soak) ----
# The oracle computes every rank's outputs with loops over experts and sources (the spec). A long soak needs only
# its own rank's outputs, per call: the same contract computed with a few vectorized torch ops (still written from
# the contract, not from mxcomm.ep.plan). test_faults_reference.py checks it bit-for-bit against the oracle over the
# standard and random case matrices, and the soak itself cross-checks it against the oracle every few calls.

@dataclass(frozen=True)
class RankRows:
    """One rank's receive layout: ``num_rows``, int32 ``offs`` / ``counts`` [El] (what make_expert_outs reads)."""

    num_rows: int
    offs: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class SoakRoutes:
    """Where every source slot goes, for the whole world (CPU).

    ``dest[s]``: int64 ``[T_s, k, 2]`` (rank, row), -1 if dropped (as :class:`OracleRoutes.dest`); ``rows[r]``: the
    :class:`RankRows` of rank ``r``; ``by_rank[r]``: (global token index, row) int64 of every row rank ``r`` receives,
    in row order; ``tok0[s]``: index of source ``s``'s first token in the concatenation of every rank's tokens."""

    dest: list
    rows: list
    by_rank: list
    tok0: list


def soak_routes(config: EPConfig, topk_idxs) -> SoakRoutes:
    """The receive layout of every rank from the ids of every rank (the oracle's contract, vectorized): expert ``e``
    on rank ``e // El``; its group holds source 0's slots in ``(t, j)`` row-major order, then source 1's, ...,
    padded with zero rows to a multiple of ``align``; groups in local expert order."""
    W = len(topk_idxs)
    config.validate(W)
    E, k, A = config.num_experts, config.topk, config.align
    El = E // W
    Ts = [int(i.shape[0]) for i in topk_idxs]
    tok0 = [0]
    for T in Ts:
        tok0.append(tok0[-1] + T)
    flat = torch.cat([i.reshape(-1).to(device="cpu", dtype=torch.int64) for i in topk_idxs])  # (s, t, j) order
    src = torch.repeat_interleave(torch.arange(W), torch.tensor([T * k for T in Ts], dtype=torch.int64))
    tok = torch.cat([torch.arange(T * k) // k + tok0[s] for s, T in enumerate(Ts)]) if flat.numel() else flat
    live = torch.nonzero(flat >= 0).view(-1)
    e = flat[live]
    order = torch.sort(e * W + src[live], stable=True).indices  # expert, then source, then (t, j)
    e_sorted = e[order]
    counts_e = torch.bincount(e, minlength=E)[:E]
    padded = (counts_e + (A - 1)) // A * A
    ends = padded.view(W, El).cumsum(1)
    group_start = (ends - padded.view(W, El)).reshape(E)
    first = torch.cumsum(counts_e, 0) - counts_e  # where each expert's slots start in the sorted order
    row_sorted = group_start[e_sorted] + torch.arange(e_sorted.numel()) - first[e_sorted]
    row = torch.empty_like(row_sorted)
    row[order] = row_sorted
    d_rank = torch.full_like(flat, -1)
    d_row = torch.full_like(flat, -1)
    d_rank[live] = e // El
    d_row[live] = row
    dest, at = [], 0
    for T in Ts:
        dest.append(torch.stack([d_rank[at:at + T * k], d_row[at:at + T * k]], dim=1).view(T, k, 2))
        at += T * k
    tok_sorted = tok[live][order]
    rank_ends = torch.cumsum(counts_e.view(W, El).sum(1), 0).tolist()
    rows, by_rank, lo = [], [], 0
    R_max = None if config.exact_sizes else max_recv_rows(config, W)
    for r in range(W):
        hi = rank_ends[r]
        by_rank.append((tok_sorted[lo:hi], row_sorted[lo:hi]))
        lo = hi
        offs = ends[r].to(torch.int32)
        rows.append(RankRows(num_rows=int(offs[-1]) if R_max is None else R_max, offs=offs,
                             counts=counts_e[r * El:(r + 1) * El].to(torch.int32)))
    return SoakRoutes(dest=dest, rows=rows, by_rank=by_rank, tok0=tok0)


def rank_dispatch_expected(config: EPConfig, xs, routes: SoakRoutes, rank: int) -> DispatchResult:
    """Rank ``rank``'s expected dispatch output (as ``oracle_dispatch(config, xs, ids)[0][rank]``, bit for bit),
    quantizing only the rows it receives (row-wise quantization: a row's bytes depend on that row only)."""
    H = config.hidden
    rows = routes.rows[rank]
    tok, row = routes.by_rank[rank]
    R = rows.num_rows
    mxfp8 = config.precision == "mxfp8"
    x_all = torch.cat([x.cpu() for x in xs]) if len(xs) > 1 else xs[0].cpu()
    got = x_all[tok]
    if mxfp8:
        payload = torch.zeros(R, H, dtype=torch.uint8)
        scales = torch.zeros(R, H // 32, dtype=torch.uint8)
        if tok.numel():
            q = quantize(got, mode=config.scale_mode)
            payload[row] = q.qdata.view(torch.uint8)
            scales[row] = q.scales
        x_out = MXTensor(
            qdata=payload.view(torch.float8_e4m3fn), scales=scales, axis=1, layout=ScaleLayout.ROW,
            mode=config.scale_mode, orig_dtype=torch.bfloat16,
        ).with_layout(ScaleLayout.GROUPED_M, rows.offs)
    else:
        payload = torch.zeros(R, 2 * H, dtype=torch.uint8)
        if tok.numel():
            payload[row] = got.contiguous().view(torch.uint8)
        x_out = payload.view(torch.bfloat16)
    return DispatchResult(x=x_out, offs=rows.offs, counts=rows.counts, num_rows=R)


def rank_combine_expected(config: EPConfig, expert_outs, routes: SoakRoutes, topk_weights, rank: int,
                          quantize_rows: bool) -> torch.Tensor:
    """Rank ``rank``'s expected combine output (as ``oracle_combine(...)[rank]``, bit for bit): per destination rank
    ``r`` the partial ``P_r[t] = sum_j w[t, j] * out_r[row(t, j)]`` over the slots of ``t`` on ``r`` (fp32, ``j``
    ascending; other slots add +0), each partial row rounded for transport (row-wise MXFP8 round trip or bf16), then
    ``y[t] = sum`` of the rounded partials in fp32 over the ranks in order of first appearance over ``j``."""
    d = routes.dest[rank]
    T, k = d.shape[0], d.shape[1]
    W = len(expert_outs)
    H = config.hidden
    dr, drow = d[..., 0], d[..., 1]
    w = topk_weights[rank].cpu().to(torch.float32)
    zero = torch.zeros((), dtype=torch.float32)
    parts = torch.zeros(W, T, H, dtype=torch.float32)
    for r, o in enumerate(expert_outs):
        o = o.cpu().to(torch.float32)
        acc = torch.zeros(T, H, dtype=torch.float32)
        for j in range(k):
            on = dr[:, j] == r
            v = o[torch.where(on, drow[:, j], torch.zeros_like(drow[:, j]))] if o.shape[0] else torch.zeros(T, H)
            acc = acc + torch.where(on.view(T, 1), w[:, j:j + 1] * v, zero)
        parts[r] = acc
    flat = parts.view(W * T, H)
    if quantize_rows:
        sent = quantize(flat, mode=config.scale_mode).dequantize(torch.float32, saturate_to=torch.bfloat16)
    else:
        sent = bf16_saturated(flat).to(torch.float32)
    sent = sent.view(W, T, H)
    y = torch.zeros(T, H, dtype=torch.float32)
    fin = torch.ones(T, H, dtype=torch.bool)
    tok = torch.arange(T)
    for j in range(k):
        first = dr[:, j] >= 0
        for jj in range(j):
            first &= dr[:, jj] != dr[:, j]
        v = sent[dr[:, j].clamp(min=0), tok]
        y = y + torch.where(first.view(T, 1), v, zero)
        fin &= ~first.view(T, 1) | torch.isfinite(v)
    return sum_to_bf16(y, fin)


# ---------------------------------------------------------------- case lists ----

def standard_cases(world: int, seed: int = 0) -> list:
    """The main matrix for a world of ``world`` ranks."""
    W = world
    cases = []

    def T(*per):  # tokens per rank, cycling the given pattern
        return tuple(per[i % len(per)] for i in range(W))

    s = seed * 1000
    E = 4 * W
    cases += [
        Case("random_mx_a32", T(24, 17), E, 64, 2, seed=s + 1),
        Case("random_bf16_a32", T(24, 17), E, 64, 2, precision="bf16", seed=s + 2),
        Case("random_mx_a128_floor", T(20, 9), E, 96, 3, align=128, scale_mode="floor", seed=s + 3),
        Case("random_bf16_a128", T(13, 30), E, 64, 2, align=128, precision="bf16", seed=s + 4),
        Case("dropped_slots", T(24, 5), E, 64, 4, drop_p=0.4, idx_dtype=torch.int32, seed=s + 5),
        Case("zero_tokens_some_ranks", T(0, 19), E, 64, 2, seed=s + 6),
        Case("zero_tokens_all_ranks", T(0), E, 64, 2, max_tokens=8, seed=s + 7),
        Case("all_to_one_expert", T(16, 11), E, 64, 2, routing="one_expert", hot_expert=E - 1, seed=s + 8),
        Case("empty_experts_subset", T(18, 7), E, 64, 2, routing="subset", used_experts=2, seed=s + 9),
        Case("all_dropped", T(6, 3), E, 64, 2, drop_p=1.0, seed=s + 10),
        Case("nan_inf_rows_mx", T(16, 12), E, 128, 2, nan_tokens=4, out_nan_rows=3, seed=s + 11),
        Case("nan_inf_rows_bf16", T(16, 12), E, 128, 2, precision="bf16", nan_tokens=4, out_nan_rows=3,
             seed=s + 12),
        Case("not_exact_sizes_mx", T(12, 4), E, 64, 2, exact_sizes=False, max_tokens=20, seed=s + 13),
        Case("not_exact_sizes_bf16_a128", T(12, 0), E, 64, 3, align=128, precision="bf16", exact_sizes=False,
             seed=s + 14),
        Case("one_local_expert_topk_gt_El", T(10, 6), W, 64, min(W, 3), seed=s + 15),
        Case("bf16_weights_int32_idx", T(9, 14), E, 64, 2, w_dtype=torch.bfloat16, idx_dtype=torch.int32,
             seed=s + 16),
        Case("hidden_7168", T(3, 2), E, 7168, 2, seed=s + 17, combine_modes=(None, False)),
        Case("hidden_4096_bf16", T(2, 3), E, 4096, 2, precision="bf16", seed=s + 18, combine_modes=(None, True)),
        Case("hidden_2048_a128", T(4, 1), E, 2048, 2, align=128, seed=s + 19, combine_modes=(None,)),
        Case("hidden_32", T(33, 8), E, 32, 2, seed=s + 20),
        Case("topk_1", T(40, 10), E, 64, 1, seed=s + 21),
        Case("topk_eq_E", T(5, 7), E, 32, E, seed=s + 22, combine_modes=(None, False)),
        Case("misaligned_x", T(9, 6), E, 64, 2, misaligned_x=True, seed=s + 23, combine_modes=(None,)),
    ]
    return cases


def random_cases(world: int, n: int, seed: int) -> list:
    """``n`` random shapes/routings for a world of ``world`` ranks (small sizes)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        El = rng.choice([1, 1, 2, 3, 4])
        E = El * world
        k = rng.randint(1, min(E, 4))
        tokens = tuple(rng.choice([0, 1, 2, 5, rng.randint(0, 40)]) for _ in range(world))
        out.append(Case(
            name=f"random{i}_E{E}_k{k}_T{'-'.join(map(str, tokens))}",
            tokens=tokens, num_experts=E, hidden=32 * rng.choice([1, 2, 3, 4, 5, 8]), topk=k,
            align=rng.choice([32, 128]), precision=rng.choice(["mxfp8", "mxfp8", "bf16"]),
            scale_mode=rng.choice(["rceil", "floor"]), exact_sizes=rng.random() < 0.7,
            routing=rng.choice(["random", "random", "subset", "one_expert"]) if E >= 2 * k else "random",
            hot_expert=rng.randrange(E), used_experts=max(k, E // 2), drop_p=rng.choice([0.0, 0.0, 0.2, 0.7]),
            nan_tokens=rng.choice([0, 0, 2]), idx_dtype=rng.choice([torch.int32, torch.int64]),
            max_tokens=max(tokens) + rng.randint(1, 8), seed=seed * 100003 + i,
            combine_modes=(rng.choice([None, True, False]),),
        ))
    return out


def soak_worker(rank: int, world: int, iters: int, seed: int) -> dict:
    """Worker: ``iters`` random cases, each on a fresh EPGroup (exercises the config check too)."""
    fails, exact = [], []
    for case in random_cases(world, iters, seed):
        progress(case.name)
        try:
            run_case(EPGroup(case.config()), case, rank, fails, exact)
        except Exception as e:  # noqa: BLE001
            fails.append(f"{case.name}[rank {rank}]: raised {type(e).__name__}: {e}")
    return {"failures": fails, "cases": iters, "combine_exact": sum(exact), "combine_checks": len(exact)}


# ---------------------------------------------------------------- error paths ----

def _expect(fails: list, what: str, exc: type, needle: str, fn) -> None:
    try:
        fn()
    except exc as e:
        if needle.lower() not in str(e).lower():
            fails.append(f"{what}: {exc.__name__} message {str(e)!r} lacks {needle!r}")
        return
    except Exception as e:  # noqa: BLE001
        fails.append(f"{what}: raised {type(e).__name__}: {e} (expected {exc.__name__})")
        return
    fails.append(f"{what}: did not raise {exc.__name__}")


def bad_inputs_worker(rank: int, world: int) -> dict:
    """Worker: every rank makes the same bad calls (each must raise before communicating), then a good
    dispatch/combine must still match the oracle (no rank left half-way through a collective)."""
    fails, exact = [], []
    case = Case("after_bad_inputs", tuple(8 for _ in range(world)), 2 * world, 64, 2, seed=99)
    cfg = case.config()
    grp = EPGroup(cfg)
    xs, idxs, ws = make_inputs(case)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    E = cfg.num_experts
    progress("bad dispatch inputs")
    _expect(fails, "x 1D", ValueError, "2D", lambda: grp.dispatch(x[0], idx, w))
    _expect(fails, "x wrong hidden", ValueError, "hidden", lambda: grp.dispatch(x[:, :32], idx, w))
    _expect(fails, "x float32", TypeError, "bfloat16", lambda: grp.dispatch(x.float(), idx, w))
    _expect(fails, "x not a tensor", TypeError, "tensor", lambda: grp.dispatch(x.tolist(), idx, w))
    big = torch.zeros(cfg.max_tokens_per_rank + 1, cfg.hidden, dtype=torch.bfloat16)
    bidx = torch.zeros(big.shape[0], cfg.topk, dtype=torch.int64)
    bidx[:, 1] = 1
    _expect(fails, "capacity", ValueError, "max_tokens_per_rank",
            lambda: grp.dispatch(big, bidx, torch.ones(big.shape[0], cfg.topk)))
    _expect(fails, "topk_idx shape", ValueError, "topk_idx", lambda: grp.dispatch(x, idx[:, :1], w))
    _expect(fails, "topk_idx dtype", TypeError, "int32 or int64", lambda: grp.dispatch(x, idx.float(), w))
    _expect(fails, "topk_idx int16", TypeError, "int32 or int64", lambda: grp.dispatch(x, idx.to(torch.int16), w))
    hi = idx.clone()
    hi[3, 1] = E
    _expect(fails, "expert id >= E", ValueError, f"topk_idx[3, 1] = {E}", lambda: grp.dispatch(x, hi, w))
    lo = idx.clone()
    lo[2, 0] = -2
    _expect(fails, "expert id < -1", ValueError, "topk_idx[2, 0] = -2", lambda: grp.dispatch(x, lo, w))
    dup = idx.clone()
    dup[1, 1] = dup[1, 0] if dup[1, 0] >= 0 else 0
    dup[1, 0] = dup[1, 1]
    _expect(fails, "duplicate expert", ValueError, "more than once", lambda: grp.dispatch(x, dup, w))
    _expect(fails, "weights shape", ValueError, "topk_weights", lambda: grp.dispatch(x, idx, w[:, :1]))
    _expect(fails, "weights int", TypeError, "topk_weights", lambda: grp.dispatch(x, idx, idx))
    _expect(fails, "wrong device", ValueError, "device", lambda: grp.dispatch(x, idx.to("meta"), w))
    progress("good dispatch after bad inputs")
    expected, routes = oracle_dispatch(cfg, xs, idxs)
    res = grp.dispatch(x, idx, w)
    handle = res.handle
    check_dispatch("after bad inputs", res, expected[rank], cfg, fails)
    outs = make_expert_outs(case, expected)
    o = outs[rank]
    progress("bad combine inputs")
    _expect(fails, "combine rows", ValueError, "shape", lambda: grp.combine(o[:-1], handle))
    _expect(fails, "combine hidden", ValueError, "shape", lambda: grp.combine(o[:, :32], handle))
    _expect(fails, "combine dtype", TypeError, "bfloat16", lambda: grp.combine(o.float(), handle))
    _expect(fails, "combine handle", TypeError, "EPHandle", lambda: grp.combine(o, (1, 2)))
    _expect(fails, "combine device", ValueError, "dispatch ran on", lambda: grp.combine(o.to("meta"), handle))
    other = EPGroup(replace(cfg, precision="bf16"))
    _expect(fails, "combine foreign handle", ValueError, "different config", lambda: other.combine(o, handle))
    progress("good combine after bad inputs")
    y = grp.combine(o, handle)
    check_combine("after bad inputs", y, oracle_combine(cfg, outs, routes, ws, True)[rank], fails, exact)
    return {"failures": fails}


def config_mismatch_worker(rank: int, world: int) -> dict:
    """Worker: configs differing across ranks must raise ValueError on every rank, naming field and ranks."""
    assert world > 1, "a config mismatch needs at least two ranks"
    fails = []
    base = EPConfig(num_experts=2 * world, hidden=64, topk=2, max_tokens_per_rank=8)
    progress("topk mismatch")
    cfg = replace(base, topk=3) if rank == world - 1 else base
    _expect(fails, "topk mismatch", ValueError, f"rank {world - 1}: 3", lambda: EPGroup(cfg))
    _expect(fails, "topk mismatch names field", ValueError, "'topk'", lambda: EPGroup(cfg))
    progress("precision + align mismatch")
    cfg = replace(base, precision="bf16", align=128) if rank == 0 else base
    _expect(fails, "precision mismatch", ValueError, "'precision' (rank 0: 'bf16'", lambda: EPGroup(cfg))
    _expect(fails, "align mismatch", ValueError, "'align'", lambda: EPGroup(cfg))
    progress("timeout mismatch")
    cfg = replace(base, timeout_s=5.0 + rank)
    _expect(fails, "timeout mismatch", ValueError, "timeout_s", lambda: EPGroup(cfg))
    progress("launch settings mismatch")  # receivers count their senders' programs: the settings must agree
    cfg = replace(base, launch=LaunchConfig(partials_per_sm=8 if rank == 1 else 32))
    _expect(fails, "launch mismatch", ValueError, "'launch' (rank 0: LaunchConfig(", lambda: EPGroup(cfg))
    progress("invalid for world")
    bad = replace(base, num_experts=world + 1)
    _expect(fails, "invalid config", ValueError, "invalid EPConfig", lambda: EPGroup(bad))
    bad = replace(base, launch={"partials_per_sm": 8})
    _expect(fails, "launch not a LaunchConfig", ValueError, "launch must be None or a LaunchConfig",
            lambda: EPGroup(bad))
    progress("agreeing config still works")
    EPGroup(base)
    return {"failures": fails}


def gpu_cases_worker(rank: int, world: int) -> dict:
    """Worker for GPU runs: the standard matrix with CUDA tensors (gloo stages through the host, NCCL not)."""
    from _dist import bind_rank_gpu

    dev = bind_rank_gpu(rank)
    cases = [replace(c, device=dev) for c in standard_cases(world, seed=5)]
    return run_cases(rank, world, cases)


def nvshmem_cases_worker(rank: int, world: int, n_random: int = 0, transport: str = "auto",
                         recv_window_rows: Optional[int] = None) -> dict:
    """Worker for the nvshmem backend: rank r on GPU ``r % device_count`` (on one GPU the ranks share
    it), the standard matrix plus ``n_random`` random cases, against the single-process oracle;
    ``transport="put"`` forces the put-with-signal path (``recv_window_rows``: the push and put receive window)."""
    from _dist import bind_rank_gpu

    dev = bind_rank_gpu(rank)
    cases = standard_cases(world, seed=7) + random_cases(world, n_random, seed=11)
    cases = [replace(c, device=dev, backend="nvshmem", transport=transport, recv_window_rows=recv_window_rows)
             for c in cases]
    out = run_cases(rank, world, cases)
    from mxcomm import transport as tp

    tp.finalize()
    return out


def nvshmem_soak_worker(rank: int, world: int, iters: int, seed: int = 5) -> dict:
    """nvshmem backend, ONE group reused for ``iters`` calls of random token counts and routings (every
    rank on GPU ``rank % device_count``): each dispatch's rows checksummed against the oracle, each
    combine checked, and the GPU memory allocated after the warm-up must not grow (plan graphs are an
    LRU of 8)."""
    from _dist import bind_rank_gpu

    dev = bind_rank_gpu(rank)
    rng = random.Random(seed)
    E, H, k, Tmax = 4 * world, 256, 3, 48
    base = Case("soak", tuple([Tmax] * world), E, H, k, max_tokens=Tmax, device=dev, backend="nvshmem")
    group = EPGroup(base.config())
    fails, mem = [], []
    for i in range(iters):
        case = replace(base, name=f"soak{i}", seed=seed * 1000003 + i, drop_p=rng.choice([0.0, 0.3]),
                       tokens=tuple(rng.choice([0, 1, 7, rng.randint(0, Tmax)]) for _ in range(world)),
                       routing=rng.choice(["random", "random", "subset", "one_expert"]),
                       hot_expert=rng.randrange(E), used_experts=k + 1)
        xs, idxs, ws = make_inputs(case)
        expected, routes = oracle_dispatch(group.config, xs, idxs)
        res = group.dispatch(xs[rank].cuda(), idxs[rank].cuda(), ws[rank].cuda())
        handle = res.handle
        got = row_checksums(res.x.qdata.view(torch.uint8)).cpu()
        want = row_checksums(expected[rank].x.qdata.view(torch.uint8))
        if not torch.equal(got, want) or not torch.equal(res.x.scales.cpu(), expected[rank].x.scales):
            fails.append(f"{case.name}[rank {rank}]: dispatch rows or scales differ from the oracle")
        if i % 10 == 0:
            outs = make_expert_outs(case, expected)
            y = group.combine(outs[rank].cuda(), handle)
            y_exp = oracle_combine(group.config, outs, routes, ws, quantize_rows=True)[rank]
            check_combine(f"{case.name} combine", y, y_exp, fails, [])
        if i == iters // 4 or i == iters - 1:
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
    if len(mem) == 2 and mem[1] > mem[0] + (64 << 20):
        fails.append(f"rank {rank}: GPU memory grew from {mem[0]} to {mem[1]} bytes over the soak")
    from mxcomm import transport as tp

    tp.finalize()
    return {"failures": fails, "cases": iters, "combine_checks": 1, "memory": mem}


def nvshmem_replay_worker(rank: int, world: int, transport: str = "auto") -> dict:
    """nvshmem backend, ONE group, one token count, so every dispatch after the second replays the captured call (or,
    ``transport="staged"`` on the pull path and on paths without one, the captured middle, whose output kernel reads
    the replay's own plan; ``transport="guessed"``: the pull path's call into an output sized from the call before,
    which the routing to one expert overflows): six dispatches with different routings (int64 ids, then
    int32 ids: a second graph) are each checked against the oracle; a dispatch with a bad id on a replay raises and
    the next good one is still exact; then combine with EVERY handle, the oldest first - each handle's plan must have
    survived the later replays (each twice, all of them enqueued behind a busy device before any is checked)."""
    from _dist import bind_rank_gpu

    dev = bind_rank_gpu(rank)
    E, H, k, T = 4 * world, 256, 3, 24
    # the pull dispatch staged around its host sync (its middle replayed alone), or as one call into an output sized
    # from the call before (guessed)
    launch = {"staged": LaunchConfig(peer_call_tokens=0, peer_guess_pct=0),
              "guessed": LaunchConfig(peer_call_tokens=0)}.get(transport)
    base = Case("replay", tuple([T] * world), E, H, k, device=dev, backend="nvshmem",
                transport="auto" if launch else transport, drop_p=0.2)
    cfg = base.config()
    group = EPGroup(replace(cfg, launch=launch) if launch else cfg)
    fails, kept = [], []
    for i, (routing, dt) in enumerate([("random", torch.int64), ("one_expert", torch.int64), ("subset", torch.int64),
                                       ("random", torch.int32), ("random", torch.int32), ("subset", torch.int32),
                                       ("random", torch.int32)]):
        case = replace(base, name=f"replay{i}", seed=31 + i, routing=routing, hot_expert=i % E, used_experts=k + 1,
                       idx_dtype=dt)
        xs, idxs, ws = make_inputs(case)
        expected, routes = oracle_dispatch(group.config, xs, idxs)
        if i == 4:  # a bad id on a replayed call: the detailed error, then the same group goes on
            bad = idxs[rank].clone()
            bad[T // 2, 0] = E
            _expect(fails, f"{case.name} bad id", ValueError, "topk_idx", lambda: group.dispatch(
                xs[rank].to(dev), bad.to(dev), ws[rank].to(dev)))
        res = group.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
        handle = res.handle
        check_dispatch(case.name, res, expected[rank], group.config, fails)
        if transport == "guessed" and rank == 1 and i >= 5:
            # the subset routing sends rank 1 nothing, so the next call's output holds no rows: the random routing
            # after it overflows it on a replay and is gathered after the sync into an output of its size
            rows = res.x.qdata if hasattr(res.x, "qdata") else res.x
            held = rows.untyped_storage().nbytes() // max(1, rows.stride(0) * rows.element_size())
            R = int(expected[rank].offs[-1])
            if (i == 5) != (R == 0) or (i == 6 and held != R):
                fails.append(f"{case.name}[rank 1]: {R} rows in an output holding {held} (want: none, then all)")
        kept.append((case, handle, expected, routes, ws))
    outs = [make_expert_outs(case, expected) for case, _, expected, _, _ in kept]
    mine = [o[rank].to(dev) for o in outs]
    # every combine enqueued behind a busy device, twice over, with no host sync: on one rank the reduce's captured
    # copies (CallGraphRing) are all still queued when taken, so the ring grows, then waits for the oldest
    torch.cuda._sleep(20_000_000)
    ys = [(rep, i, group.combine(mine[i], kept[i][1])) for rep in range(2) for i in range(len(kept))]
    for rep, i, y in ys:
        case, _, _, routes, ws = kept[i]
        y_exp = oracle_combine(group.config, outs[i], routes, ws, quantize_rows=True)[rank]
        check_combine(f"{case.name} combine {rep} (after later dispatches)", y, y_exp, fails, [])
    from mxcomm import transport as tp

    tp.finalize()
    return {"failures": fails, "cases": len(kept), "combine_checks": len(ys)}


__all__ = [
    "nvshmem_soak_worker", "nvshmem_replay_worker",
    "nvshmem_cases_worker", "each_case",
    "Case", "make_inputs", "make_expert_outs", "standard_cases", "random_cases", "run_cases", "soak_worker",
    "bad_inputs_worker", "config_mismatch_worker", "gpu_cases_worker", "check_dispatch", "row_checksums",
    "RankRows", "SoakRoutes", "soak_routes", "rank_dispatch_expected", "rank_combine_expected",
]
