"""Cases and rank workers for the EP backward / autograd tests (imported by spawned ranks).

Two kinds of checks, both in one spawn per world size (process start-up is the slow part):

* backward ops (:func:`backward_ops_worker`): ``EPGroup.combine_for_backward`` /
  ``combine_backward`` / ``dispatch_backward`` of the backend against the single-process oracle
  (:mod:`mxcomm.ep.reference.oracle`): expert-side gradients bit-exact (payload, grouped scales, BF16
  bytes), ``y`` and ``grad_x`` within fp32-reduction tolerance (and counted when exact: the reference
  backend must be exact), ``grad_w`` against a float64 dot with the expert output as given.
* MoE training (:func:`moe_worker`): a MoE block written with ``EPGroup.dispatch`` /
  ``EPGroup.combine`` and plain torch experts, ``loss.backward()``, against a single-process float64 MoE
  (plain loops over experts, no quantization). Returns signal/noise energies per quantity so the
  test computes the SQNR over the whole world; "exact" cases use small-integer data for which every
  transport and reduction is exact, and must match the float64 reference bit for bit.

Workers collect failures instead of raising, so all ranks stay in lockstep.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from ep_cases import (Case, _cmp_bytes, _expect, check_combine, check_dispatch, each_case, make_expert_outs,
                      make_inputs)
from mxcomm.ep import EPConfig, EPGroup
from mxcomm.ep.handle import CombineSaved
from mxcomm.ep.reference.oracle import oracle_combine_backward, oracle_dispatch_backward
from mxcomm.ep.handle import DispatchResult
from mxcomm.ep.reference.oracle import oracle_combine, oracle_dispatch
from mxcomm.mx import MXTensor, quantize
from mxcomm.mx.subclass import MXFP8Tensor

try:  # present in the spawned ranks (tests/ is on sys.path)
    from _dist import progress
except ImportError:  # pragma: no cover
    def progress(msg):
        pass


# ======================================================================= backward ops ====

def make_grads(case: Case, tokens, seed_offset: int = 0):
    """Per rank: grad_y bf16 [T, H] with mixed magnitudes."""
    g = torch.Generator().manual_seed(case.seed * 31 + 7 + seed_offset)
    out = []
    for T in tokens:
        mag = torch.exp2(torch.randint(-6, 6, (T, 1), generator=g).float())
        out.append((torch.randn(T, case.hidden, generator=g) * mag).to(torch.bfloat16))
    return out


def make_grad_recvs(case: Case, expected, as_mx: bool):
    """Per rank: gradient of the dispatch output, [R, H]; padding rows NaN (must be ignored).
    ``as_mx``: quantized row-wise with GROUPED_M scales on the dispatch offs."""
    outs = make_expert_outs(replace(case, seed=case.seed + 5003), expected)
    if not as_mx:
        return outs
    return [quantize(o, mode=case.scale_mode, layout="grouped_m", group_offs=e.offs) for o, e in zip(outs, expected)]


def _check_grad_w(tag, got, exp, fails):
    got = got.cpu()
    if got.dtype != torch.float32 or got.shape != exp.shape:
        fails.append(f"{tag}: grad_w {got.dtype} {tuple(got.shape)} != float32 {tuple(exp.shape)}")
        return
    if not torch.equal(torch.isnan(got), torch.isnan(exp)):
        fails.append(f"{tag}: grad_w NaN positions differ")
        return
    fin = ~torch.isnan(exp)
    err = (got[fin].double() - exp[fin].double()).abs()
    tol = 1e-5 * exp[fin].double().abs() + 1e-6 * float(exp[fin].double().abs().max()) if fin.any() else None
    if tol is not None and bool((err > tol).any()):
        fails.append(f"{tag}: grad_w differs, max abs err {float(err.max()):.3e}")


def run_backward_case(group: EPGroup, case: Case, rank: int, fails: list, exact: list) -> None:
    config = group.config
    dev = torch.device(case.device)
    xs, idxs, ws = make_inputs(case)
    expected, routes = oracle_dispatch(config, xs, idxs)
    res = group.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
    handle = res.handle
    tag = f"{case.name}[rank {rank}]"
    outs = make_expert_outs(case, expected)
    grad_ys = make_grads(case, case.tokens)
    for qmode in case.combine_modes:
        q = (config.precision == "mxfp8") if qmode is None else qmode
        qtag = f"{tag} quantize={qmode}"
        # forward combine that keeps the returned rows
        y, saved = group.steps.combine_for_backward(outs[rank].to(dev), handle, quantize=qmode)
        y_exp = oracle_combine(config, outs, routes, ws, quantize_rows=q)[rank]
        check_combine(f"{qtag} combine_for_backward", y, y_exp, fails, exact)
        rows = getattr(saved, "rows", None)
        if not isinstance(saved, CombineSaved) or not isinstance(rows, torch.Tensor) or isinstance(rows, MXTensor) \
                or rows.dtype != torch.bfloat16 or tuple(rows.shape) != (res.num_rows, config.hidden):
            fails.append(f"{qtag}: saved rows {type(saved).__name__} {type(rows).__name__} "
                         f"{getattr(rows, 'dtype', None)} {tuple(getattr(rows, 'shape', ()))}: "
                         "expected the expert output")
            continue
        if not torch.equal(rows.cpu().view(torch.int16), outs[rank].view(torch.int16)):
            fails.append(f"{qtag}: saved rows are not the expert output given to combine")
        # combine backward (with and without the route-weight gradient)
        gr = group.steps.combine_backward(grad_ys[rank].to(dev), handle, saved, quantize=qmode)
        exp_g = oracle_combine_backward(config, grad_ys, routes, ws, outs, expected, quantize_rows=q)[rank]
        cfg_q = replace(config, precision="mxfp8" if q else "bf16")
        check_dispatch(
            f"{qtag} grad_expert_out", DispatchResult(gr.grad_expert_out, res.offs, res.counts, res.num_rows),
            DispatchResult(exp_g.grad_expert_out, expected[rank].offs, expected[rank].counts, expected[rank].num_rows),
            cfg_q, fails,
        )
        _check_grad_w(qtag, gr.grad_weights, exp_g.grad_weights, fails)
        dropped = idxs[rank] < 0
        if dropped.any() and bool((gr.grad_weights.cpu()[dropped] != 0).any()):
            fails.append(f"{qtag}: dropped slots got a nonzero route-weight gradient")
        gr2 = group.steps.combine_backward(grad_ys[rank].to(dev), handle, None, quantize=qmode)
        if gr2.grad_weights is not None:
            fails.append(f"{qtag}: grad_weights without saved rows should be None")
        # dispatch backward: dense gradient (quantized or not) and an MX gradient sent as it is
        for as_mx in (False, True):
            grecv = make_grad_recvs(case, expected, as_mx)
            gx = group.steps.dispatch_backward(grecv[rank].to(dev) if not as_mx else _mx_to(grecv[rank], dev), handle,
                                         quantize=qmode)
            gx_exp = oracle_dispatch_backward(config, grecv, routes, quantize_rows=q)[rank]
            check_combine(f"{qtag} dispatch_backward(mx={as_mx})", gx, gx_exp, fails, exact)
            if as_mx:  # the same value wrapped as MXFP8Tensor must give the same bytes
                gx2 = group.steps.dispatch_backward(MXFP8Tensor(_mx_to(grecv[rank], dev)), handle, quantize=qmode)
                _cmp_bytes(f"{qtag} dispatch_backward(MXFP8Tensor)", gx2, gx, fails)


class _MXAwareConsumer(torch.autograd.Function):
    """Stands in for an MX-aware GEMM: reads the MXFP8Tensor's value, returns an MX gradient
    (quantized row-wise, GROUPED_M scales on the dispatch offs) as its dgrad would."""

    @staticmethod
    def forward(ctx, t, offs, mode):
        ctx.offs, ctx.mode = offs, mode
        return t.mx.dequantize(torch.float32)

    @staticmethod
    def backward(ctx, g):
        mx = quantize(g.to(torch.bfloat16), mode=ctx.mode, layout="grouped_m", group_offs=ctx.offs)
        return MXFP8Tensor(mx, dtype=torch.bfloat16), None, None


def check_mx_grad_through_autograd(group: EPGroup, case: Case, rank: int, fails: list) -> None:
    """An MX gradient arriving at the dispatch output travels as it is: grad_x equals the oracle's
    dispatch backward of that MX value."""
    config = group.config
    dev = torch.device(case.device)
    xs, idxs, ws = make_inputs(case)
    expected, routes = oracle_dispatch(config, xs, idxs)
    x = xs[rank].to(dev).requires_grad_()
    d = group.dispatch(x, idxs[rank].to(dev), ws[rank].to(dev))
    if not isinstance(d.x, MXFP8Tensor):
        fails.append(f"mx grad through autograd: dispatch output is {type(d.x).__name__}")
        return
    up = make_expert_outs(replace(case, seed=case.seed + 17), expected)
    up = [torch.nan_to_num(u) for u in up]  # upstream gradient of the consumer's output, per rank
    h = _MXAwareConsumer.apply(d.x, d.offs, config.scale_mode)
    (h * up[rank].to(dev).float()).sum().backward()
    grecv = [quantize(u, mode=config.scale_mode, layout="grouped_m", group_offs=e.offs) for u, e in zip(up, expected)]
    exp = oracle_dispatch_backward(config, grecv, routes, quantize_rows=True)[rank]
    _cmp_bytes(f"mx grad through autograd[rank {rank}]", x.grad, exp, fails)


def _mx_to(mx: MXTensor, dev) -> MXTensor:
    return MXTensor(
        qdata=mx.qdata.to(dev), scales=mx.scales.to(dev), axis=mx.axis, layout=mx.layout, mode=mx.mode,
        orig_dtype=mx.orig_dtype, group_offs=None if mx.group_offs is None else mx.group_offs.to(dev),
    )


def bad_backward_inputs(rank: int, world: int, fails: list) -> None:
    """Every rank makes the same bad backward calls (each must raise before communicating), then a
    good call must still work (no rank stuck half-way through a collective)."""
    case = Case("bad_backward", tuple(6 for _ in range(world)), 2 * world, 64, 2, seed=77)
    cfg = case.config()
    grp = EPGroup(cfg)
    xs, idxs, ws = make_inputs(case)
    res = grp.dispatch(xs[rank], idxs[rank], ws[rank])
    h = res.handle
    T, H, R = 6, 64, res.num_rows
    gy = torch.randn(T, H).to(torch.bfloat16)
    _expect(fails, "grad_y shape", ValueError, "shape", lambda: grp.steps.combine_backward(gy[:-1], h))
    _expect(fails, "grad_y dtype", TypeError, "bfloat16", lambda: grp.steps.combine_backward(gy.float(), h))
    _expect(fails, "grad_y type", TypeError, "tensor", lambda: grp.steps.combine_backward(gy.tolist(), h))
    _expect(fails, "handle type", TypeError, "EPHandle", lambda: grp.steps.combine_backward(gy, (1,)))
    _expect(fails, "saved type", TypeError, "CombineSaved", lambda: grp.steps.combine_backward(gy, h, gy))
    _expect(fails, "saved rows", ValueError, "saved.rows", lambda: grp.steps.combine_backward(
        gy, h, CombineSaved(rows=torch.zeros(3, 32, dtype=torch.bfloat16))))
    _expect(fails, "grad_recv rows", ValueError, "shape", lambda: grp.steps.dispatch_backward(
        torch.zeros(R + 1, H, dtype=torch.bfloat16), h))
    _expect(fails, "grad_recv device", ValueError, "dispatch ran on", lambda: grp.steps.dispatch_backward(
        torch.zeros(R, H, dtype=torch.bfloat16, device="meta"), h))
    colwise = quantize(torch.randn(R, H), axis=0)
    _expect(fails, "grad_recv column-wise MX", ValueError, "axis 1", lambda: grp.steps.dispatch_backward(colwise, h))
    other = EPGroup(replace(cfg, precision="bf16"))
    _expect(fails, "foreign handle", ValueError, "different config", lambda: other.steps.dispatch_backward(
        torch.zeros(R, H, dtype=torch.bfloat16), h))
    x = xs[rank].clone().requires_grad_()
    d = grp.dispatch(x, idxs[rank], ws[rank])
    o = d.dense(torch.bfloat16)
    _expect(fails, "autograd grad_format", ValueError, "grad_format", lambda: grp.combine(o, d.handle, grad_format="x"))
    _expect(fails, "autograd weights shape", ValueError, "topk_weights", lambda: grp.combine(
        o, d.handle, topk_weights=ws[rank][:, :1]))
    _expect(fails, "autograd MX expert_out", TypeError, "dense", lambda: grp.combine(d.x, d.handle))  # mxfp8 case
    _expect(fails, "autograd group", TypeError, "EPConfig", lambda: EPGroup("not a config"))
    # a good collective after all that
    y = grp.combine(o, d.handle)
    y.float().sum().backward()
    if x.grad is None or x.grad.shape != x.shape:
        fails.append("bad inputs: good autograd step after bad calls did not produce grad_x")


def backward_op_cases(world: int, seed: int = 0) -> list:
    """Backward-op cases for a world of ``world`` ranks (a subset of the forward matrix's shapes)."""
    W = world

    def T(*per):
        return tuple(per[i % len(per)] for i in range(W))

    s = 50000 + seed * 1000
    E = 4 * W
    return [
        Case("bw_random_mx", T(24, 17), E, 64, 2, seed=s + 1),
        Case("bw_random_bf16_a128", T(13, 30), E, 64, 2, align=128, precision="bf16", seed=s + 2),
        Case("bw_floor_a128_k3", T(20, 9), E, 96, 3, align=128, scale_mode="floor", seed=s + 3,
             combine_modes=(None,)),
        Case("bw_dropped_int32", T(24, 5), E, 64, 4, drop_p=0.4, idx_dtype=torch.int32, seed=s + 4),
        Case("bw_zero_tokens", T(0, 19), E, 64, 2, seed=s + 5, combine_modes=(None,)),
        Case("bw_empty_experts", T(18, 7), E, 64, 2, routing="subset", used_experts=2, seed=s + 6,
             combine_modes=(None,)),
        Case("bw_all_dropped", T(6, 3), E, 64, 2, drop_p=1.0, seed=s + 7, combine_modes=(None,)),
        Case("bw_not_exact_sizes", T(12, 4), E, 64, 2, exact_sizes=False, max_tokens=20, seed=s + 8,
             combine_modes=(None,)),
        Case("bw_nan_rows", T(16, 12), E, 128, 2, out_nan_rows=3, seed=s + 9, combine_modes=(None,)),
        Case("bw_bf16_weights", T(9, 14), E, 64, 2, w_dtype=torch.bfloat16, seed=s + 10, combine_modes=(None,)),
        Case("bw_topk_eq_E", T(5, 7), E, 32, E, seed=s + 11, combine_modes=(None,)),
    ]


def backward_edge_cases(world: int, seed: int = 0) -> list:
    """Edge cases of the per-(token, rank) sums for the backward ops: several slots of a token on one rank (k > 1
    with few ranks), every token to one expert, NaN / +Inf / -Inf in expert rows, odd token counts and hidden sizes,
    zero tokens on some ranks, dropped slots."""
    W = world

    def T(*per):
        return tuple(per[i % len(per)] for i in range(W))

    s = 90000 + seed * 1000
    E = 4 * W
    return [
        Case("bw_k4_same_rank", T(21, 9), E, 64, 4, seed=s + 1),
        Case("bw_k4_same_rank_bf16_floor", T(7, 16), E, 96, 4, precision="bf16", scale_mode="floor", seed=s + 2),
        Case("bw_one_expert", T(15, 6), E, 64, 3, routing="one_expert", hot_expert=E - 1, seed=s + 3),
        Case("bw_nan_inf_rows", T(17, 11), E, 128, 4, out_nan_rows=6, out_inf=True, nan_tokens=3, seed=s + 4),
        Case("bw_odd_sizes_a128", T(1, 13, 0), E, 160, 3, align=128, drop_p=0.3, seed=s + 5),
        Case("bw_subset_dropped", T(0, 19), E, 32, 4, routing="subset", used_experts=5, drop_p=0.5, seed=s + 6,
             exact_sizes=False, max_tokens=24),
    ]


def backward_ops_worker(rank: int, world: int, cases: list, with_errors: bool = False) -> dict:
    fails, exact = [], []
    groups = each_case(rank, world, cases, fails,
                       lambda group, case: run_backward_case(group, case, rank, fails, exact))
    mx_cases = [c for c in cases if c.precision == "mxfp8"]
    if mx_cases:
        progress("mx grad through autograd")
        try:
            check_mx_grad_through_autograd(groups[mx_cases[0].config()], mx_cases[0], rank, fails)
        except Exception as e:  # noqa: BLE001
            fails.append(f"mx grad through autograd[rank {rank}]: raised {type(e).__name__}: {e}")
    if with_errors:
        progress("bad backward inputs")
        bad_backward_inputs(rank, world, fails)
    return {"failures": fails, "cases": len(cases), "exact": sum(exact), "checks": len(exact),
            "backend": cases[0].backend if cases else None}


# ========================================================================= MoE training ====

@dataclass(frozen=True)
class MoECase:
    """One MoE training step for a world of ``len(tokens)`` ranks.

    expert: ``"swiglu"`` (W1, W3 [H, F], W2 [F, H]) or ``"linear"`` (A [H, H]).
    router: weights come from ``softmax(x @ Wr)`` gathered at ``topk_idx`` (gradient to x through the
        router too, and to Wr); else ``topk_weights`` is a leaf.
    exact: small-integer data for which every transport and sum is exact: compared bit for bit.
    """

    name: str
    tokens: tuple
    experts_per_rank: int
    hidden: int
    ffn: int
    topk: int
    precision: str = "mxfp8"
    scale_mode: str = "rceil"
    align: int = 32
    exact_sizes: bool = True
    drop_p: float = 0.0
    used_experts: int = 0       # > 0: only experts [0, used) get tokens (others empty)
    expert: str = "swiglu"
    router: bool = False
    exact: bool = False
    grad_format: str = "dense"
    combine_bf16: bool = False  # MXFP8 dispatch + its backward to the experts; BF16 combine + dispatch backward
    seed: int = 0
    device: str = "cpu"
    backend: str = "torch"
    transport: str = "auto"
    num_sms: Optional[int] = None  # the nvshmem backend's SM budget (None: the whole GPU)

    @property
    def num_experts(self) -> int:
        return self.experts_per_rank * len(self.tokens)

    def config(self) -> EPConfig:
        return EPConfig(
            num_experts=self.num_experts, hidden=self.hidden, topk=self.topk,
            max_tokens_per_rank=max(max(self.tokens), 1), align=self.align, precision=self.precision,
            scale_mode=self.scale_mode, exact_sizes=self.exact_sizes, backend=self.backend, timeout_s=60.0,
            transport=self.transport, num_sms=self.num_sms,
        )


def _signed_perm(n: int, g: torch.Generator) -> torch.Tensor:
    p = torch.zeros(n, n)
    p[torch.arange(n), torch.randperm(n, generator=g)] = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return p


def moe_inputs(case: MoECase) -> dict:
    """Global inputs (CPU, float64 where they are parameters): xs (bf16 values), idxs, ws, Gs
    (upstream gradients, bf16 values), expert params, router Wr."""
    g = torch.Generator().manual_seed(case.seed)
    E, H, Fd, k = case.num_experts, case.hidden, case.ffn, case.topk
    used = case.used_experts or E
    xs, idxs, ws, Gs = [], [], [], []
    for T in case.tokens:
        if case.exact:
            x = torch.randint(-1, 2, (T, H), generator=g).float()
        else:
            x = torch.randn(T, H, generator=g)
        xs.append(x.to(torch.bfloat16))
        idx = torch.argsort(torch.rand(T, used, generator=g), dim=1)[:, :k]
        if case.drop_p > 0:
            idx = torch.where(torch.rand(T, k, generator=g) < case.drop_p, torch.full_like(idx, -1), idx)
        idxs.append(idx)
        if case.exact:
            w = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (T, k), generator=g)]
            G = torch.randint(-1, 2, (T, H), generator=g).float()
        else:
            w = torch.rand(T, k, generator=g) * 0.9 + 0.1
            G = torch.randn(T, H, generator=g)
        ws.append(w)
        Gs.append(G.to(torch.bfloat16))
    if case.expert == "linear":
        if case.exact:
            params = [torch.stack([_signed_perm(H, g) + _signed_perm(H, g) for _ in range(E)])]
        else:
            params = [torch.randn(E, H, H, generator=g) / H ** 0.5]
    else:
        params = [
            torch.randn(E, H, Fd, generator=g) / H ** 0.5,
            torch.randn(E, H, Fd, generator=g) / H ** 0.5,
            torch.randn(E, Fd, H, generator=g) / Fd ** 0.5,
        ]
    Wr = torch.randn(H, E, generator=g) / H ** 0.5
    return {"xs": xs, "idxs": idxs, "ws": ws, "Gs": Gs, "params": [p.double() for p in params], "Wr": Wr.double()}


def expert_fn(kind: str, a: torch.Tensor, params: list) -> torch.Tensor:
    """One expert on rows ``a [n, H]``; ``params`` are that expert's tensors."""
    if kind == "linear":
        return a @ params[0]
    w1, w3, w2 = params
    return (F.silu(a @ w1) * (a @ w3)) @ w2


def route_weights(case: MoECase, x: torch.Tensor, idx: torch.Tensor, w_leaf, Wr) -> torch.Tensor:
    if not case.router:
        return w_leaf
    probs = torch.softmax(x.to(Wr.dtype) @ Wr, dim=-1)
    return torch.gather(probs, 1, idx.clamp(min=0).to(torch.int64))


class _Sim(torch.autograd.Function):
    """Identity-shaped op with separate forward / backward value maps (simulated transport)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _qdq(t: torch.Tensor, mode: str) -> torch.Tensor:
    """MXFP8 row-wise quantize -> dequantize of ``t`` (rounded to fp32 first), back in t's dtype."""
    return quantize(t.to(torch.float32), mode=mode).dequantize(torch.float32).to(t.dtype)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def moe_reference(case: MoECase, inp: dict, simulate: bool = False) -> dict:
    """Single-process float64 MoE: y_s[t] = sum_j w[t,j] * expert_{idx[t,j]}(x[t]); grads of
    loss = sum_s <y_s, G_s> w.r.t. x, w (or Wr), expert params.

    ``simulate``: apply the transport roundings of the distributed block at the same points:
    dispatch: MXFP8 quantize of x; the expert output rounded to bf16; combine: the partial sum of each
    (token, rank) ``sum_j w * out`` rounded once (MXFP8, or bf16 with BF16 transport); its backward:
    MXFP8 (or bf16) of each slot's ``w * grad_y``, and ``grad_w`` the dot with the bf16 expert output;
    dispatch backward: each slot's row gradient bf16, summed per (token, rank), rounded once (MXFP8 or
    bf16). What remains is fp32-vs-fp64 arithmetic and the bf16 rounding of y and grad_x.
    """
    mx = case.precision == "mxfp8"
    mode = case.scale_mode
    ident = (lambda t: t)
    if simulate:
        disp = (lambda t: _qdq(t, mode)) if mx else ident
        disp_b = (lambda g: _qdq(g, mode)) if mx and not case.combine_bf16 else _bf16  # per (token, rank)
        slot_g = _bf16                                                                  # per slot
        comb = (lambda t: _qdq(t, mode)) if mx and not case.combine_bf16 else _bf16     # per (token, rank)
        comb_b = (lambda g: _qdq(g, mode)) if mx else _bf16                             # per slot
        outr = _bf16
    else:
        disp = disp_b = slot_g = comb = comb_b = outr = ident
    W, El = len(case.tokens), case.experts_per_rank
    xs = [x.double().requires_grad_() for x in inp["xs"]]
    ws = [w.double().requires_grad_() for w in inp["ws"]]
    params = [p.clone().requires_grad_() for p in inp["params"]]
    Wr = inp["Wr"].clone().requires_grad_()
    ys = []
    loss = 0.0
    for s, x in enumerate(xs):
        idx = inp["idxs"][s]
        w = route_weights(case, x, idx, ws[s], Wr)
        y = torch.zeros_like(x)
        for d in range(W):  # one partial per (token, rank), in both directions
            xd = _Sim.apply(x, ident, disp_b)
            part = torch.zeros_like(x)
            for j in range(case.topk):
                for e in range(d * El, (d + 1) * El):
                    sel = torch.nonzero(idx[:, j] == e).view(-1)
                    if sel.numel() == 0:
                        continue
                    a = _Sim.apply(xd[sel], disp, slot_g)
                    out = expert_fn(case.expert, a, [p[e] for p in params])
                    out = _Sim.apply(out, outr, comb_b)
                    part = part.index_add(0, sel, w[sel, j:j + 1] * out)
            y = y + _Sim.apply(part, comb, ident)
        ys.append(y)
        loss = loss + (y * inp["Gs"][s].double()).sum()
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()

    def grad(t):  # a leaf the loss does not use (no tokens) has gradient zero
        return t.grad if t.grad is not None else torch.zeros_like(t)

    return {
        "ys": [y.detach() for y in ys], "gx": [grad(x) for x in xs], "gw": [grad(w) for w in ws],
        "gparams": [grad(p) for p in params], "gWr": grad(Wr),
    }


def moe_block(group: EPGroup, case: MoECase, x, idx, w, params):
    """The distributed MoE block: dispatch, plain-torch experts on the dense rows, combine."""
    El = case.experts_per_rank
    d = group.dispatch(x, idx, w, grad_quantize=False if case.combine_bf16 else None)
    h = d.dense(torch.float32)
    offs, counts = d.offs.tolist(), d.counts.tolist()
    pieces, start = [], 0
    for le in range(El):
        n = counts[le]
        pieces.append(expert_fn(case.expert, h[start:start + n], [p[le] for p in params]))
        pieces.append(h.new_zeros(offs[le] - start - n, case.hidden))
        start = offs[le]
    pieces.append(h.new_zeros(d.num_rows - start, case.hidden))
    expert_out = torch.cat(pieces).to(torch.bfloat16)
    y = group.combine(expert_out, d.handle, grad_format=case.grad_format,
                quantize=False if case.combine_bf16 else None)
    return y, isinstance(d.x, MXFP8Tensor)


def moe_step(group: EPGroup, case: MoECase, inp: dict, rank: int, compile_backend: Optional[str] = None) -> dict:
    """One training step of the block on this rank; returns its outputs and gradients (CPU).
    ``compile_backend``: run the block under ``torch.compile(backend=...)``."""
    dev = torch.device(case.device)
    El = case.experts_per_rank
    lo = rank * El
    x = inp["xs"][rank].to(dev).requires_grad_()
    idx = inp["idxs"][rank].to(dev)
    w_leaf = inp["ws"][rank].to(dev).float().requires_grad_()
    Wr = inp["Wr"].to(dev).float().requires_grad_()
    params = [p[lo:lo + El].to(dev).float().requires_grad_() for p in inp["params"]]

    def step(x, idx, w_leaf, Wr, params):
        return moe_block(group, case, x, idx, route_weights(case, x, idx, w_leaf, Wr), params)

    if compile_backend is not None:
        step = torch.compile(step, backend=compile_backend)
    y, is_mx = step(x, idx, w_leaf, Wr, params)
    loss = (y.float() * inp["Gs"][rank].to(dev).float()).sum()
    loss.backward()

    def grad(t):
        return None if t.grad is None else t.grad.detach().cpu()

    return {
        "y": y.detach().cpu(), "gx": grad(x), "gw": grad(w_leaf), "gWr": grad(Wr),
        "gparams": [grad(p) for p in params], "is_mx": is_mx,
    }


def _energy(got: torch.Tensor, ref: torch.Tensor) -> tuple:
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    return float((ref ** 2).sum()), float(((got - ref) ** 2).sum())


def run_moe_case(group: EPGroup, case: MoECase, rank: int, fails: list) -> dict:
    """One training step; metrics against the plain float64 MoE ("ref") and against the float64
    MoE with the transport roundings simulated ("sim")."""
    inp = moe_inputs(case)
    refs = {"ref": moe_reference(case, inp), "sim": moe_reference(case, inp, simulate=True)}
    got = moe_step(group, case, inp, rank)
    tag = f"{case.name}[rank {rank}]"
    El, lo = case.experts_per_rank, rank * case.experts_per_rank
    T = case.tokens[rank]
    metrics, gWr_ref = {}, {}
    for kind, ref in refs.items():
        pairs = {"y": (got["y"], ref["ys"][rank]), "grad_x": (got["gx"], ref["gx"][rank])}
        if not case.router:  # with a router, Wr's per-rank partial gradients are summed by the test
            pairs["grad_w"] = (got["gw"], ref["gw"][rank])
        for i, gp in enumerate(got["gparams"]):
            pairs[f"grad_expert_param{i}"] = (gp, ref["gparams"][i][lo:lo + El])
        for name, (a, b) in pairs.items():
            if a is None:
                fails.append(f"{tag}: {name} is None")
                continue
            if a.shape != b.shape:
                fails.append(f"{tag}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}")
                continue
            if case.exact and kind == "ref":
                bb = b.cpu().to(a.dtype)
                if not torch.equal(bb.double(), b.cpu()):
                    fails.append(f"{tag}: exact case's reference {name} is not representable in {a.dtype} (bad data)")
                elif not torch.equal(a.cpu(), bb):
                    diff = (a.cpu().double() - b.cpu()).abs()
                    fails.append(f"{tag}: exact case: {name} differs from the float64 reference (max {float(diff.max()):.3e})")
            metrics[(kind, name)] = _energy(a, b)
        gWr_ref[kind] = ref["gWr"].detach().cpu().numpy() if case.router else None
    # dtypes / edge cases
    if got["gx"] is not None and got["gx"].dtype != torch.bfloat16:
        fails.append(f"{tag}: grad_x dtype {got['gx'].dtype}")
    if case.precision == "mxfp8" and not got["is_mx"]:
        fails.append(f"{tag}: mxfp8 dispatch output is not an MXFP8Tensor")
    idx = inp["idxs"][rank]
    if not case.router and got["gw"] is not None and bool((got["gw"].cpu()[idx < 0] != 0).any()):
        fails.append(f"{tag}: dropped slots got a nonzero route-weight gradient")
    for le in range(El):
        e = lo + le
        if not any(bool((i == e).any()) for i in inp["idxs"]):
            for i, gp in enumerate(got["gparams"]):
                if bool((gp[le] != 0).any()):
                    fails.append(f"{tag}: empty expert {e} got a nonzero gradient for param {i}")
    if T == 0 and (got["gx"] is None or got["gx"].shape != (0, case.hidden)):
        fails.append(f"{tag}: zero-token rank grad_x {None if got['gx'] is None else tuple(got['gx'].shape)}")
    return {
        "metrics": metrics,
        "gWr": got["gWr"].detach().cpu().double().numpy() if case.router else None,
        "gWr_ref": gWr_ref,
    }


def moe_worker(rank: int, world: int, cases: list) -> dict:
    fails = []
    out = {}
    each_case(rank, world, cases, fails,
              lambda group, case: out.__setitem__(case.name, run_moe_case(group, case, rank, fails)))
    return {"failures": fails, "cases": out}


def moe_cases(world: int, seed: int = 0) -> list:
    W = world

    def T(*per):
        return tuple(per[i % len(per)] for i in range(W))

    s = 70000 + 1000 * seed
    return [
        MoECase("moe_swiglu_mx", T(48, 40), 2, 64, 64, 2, seed=s + 1),
        MoECase("moe_swiglu_mx_floor_a128_gradmx", T(40, 33), 2, 64, 32, 2, scale_mode="floor", align=128,
                grad_format="mx", seed=s + 2),
        MoECase("moe_swiglu_bf16", T(40, 24), 2, 64, 32, 2, precision="bf16", seed=s + 3),
        MoECase("moe_swiglu_mx_dispatch_bf16_combine", T(48, 40), 2, 64, 64, 2, combine_bf16=True, router=True,
                seed=s + 8),
        MoECase("moe_router_mx", T(40, 32), 2, 64, 32, 2, router=True, seed=s + 4),
        MoECase("moe_dropped_empty_zero_tokens", T(0, 36) if W > 1 else T(36), 3, 64, 32, 3, drop_p=0.3,
                used_experts=max(3, 3 * W - 2), exact_sizes=False, seed=s + 5),
        MoECase("moe_exact_bf16", T(16, 9, 0), 2, 32, 0, 2, precision="bf16", expert="linear", exact=True,
                drop_p=0.2, used_experts=max(2, 2 * W - 1), seed=s + 6),
        MoECase("moe_exact_mx", T(16, 0, 11), 2, 32, 0, 2, expert="linear", exact=True, drop_p=0.2,
                grad_format="mx", seed=s + 7),
    ]


# ======================================================================= torch.compile ====

def compile_worker(rank: int, world: int, backend: str = "aot_eager") -> dict:
    """The MoE block eager and under ``torch.compile`` (graph breaks at the communication calls):
    outputs and every gradient must be identical."""
    fails = []
    case = MoECase("compile", tuple(24 + 5 * r for r in range(world)), 2, 64, 32, 2, router=True, seed=4242)
    group = EPGroup(case.config())
    inp = moe_inputs(case)
    progress("eager")
    eager = moe_step(group, case, inp, rank)
    progress("compiled")
    compiled = moe_step(group, case, inp, rank, compile_backend=backend)
    for name in ("y", "gx", "gWr"):
        if not torch.equal(eager[name], compiled[name]):
            fails.append(f"compile[rank {rank}]: {name} differs from eager")
    for i, (a, b) in enumerate(zip(eager["gparams"], compiled["gparams"])):
        if not torch.equal(a, b):
            fails.append(f"compile[rank {rank}]: expert param {i} gradient differs from eager")
    return {"failures": fails}


# ====================================================================== world worker ====

def world_worker(rank: int, world: int, op_cases: list, moe: list, with_errors: bool) -> dict:
    """Backward-op cases, then MoE training cases, in one spawn."""
    a = backward_ops_worker(rank, world, op_cases, with_errors)
    b = moe_worker(rank, world, moe)
    return {"failures": a["failures"] + b["failures"], "ops": a, "moe": b["cases"]}


def matched_transport(case):
    """The nvshmem backend's backward sends what its buffers were sized for (MXFP8 for precision
    "mxfp8", BF16 for "bf16"; other combinations raise NotImplementedError, checked by
    :func:`check_mismatched_transport_refused`): keep only the matching quantize= modes."""
    ok = (None, True) if case.precision == "mxfp8" else (None, False)
    return replace(case, combine_modes=tuple(m for m in case.combine_modes if m in ok) or (None,))


def check_mismatched_transport_refused(group, case, rank: int, fails: list) -> None:
    """nvshmem: a combine backward asking for the other transport precision fails with a clear error."""
    dev = torch.device(case.device)
    xs, idxs, ws = make_inputs(case)
    res = group.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
    handle = res.handle
    gy = torch.zeros(handle.num_tokens, case.hidden, dtype=torch.bfloat16, device=dev)
    try:
        group.steps.combine_backward(gy, handle, None, quantize=case.precision != "mxfp8")
    except NotImplementedError as e:
        if "not supported" not in str(e):
            fails.append(f"mismatched transport[rank {rank}]: unclear message {e}")
    else:
        fails.append(f"mismatched transport[rank {rank}]: no error")


def gpu_world_worker(rank: int, world: int, backend: str = "torch", n_ops: Optional[int] = None,
                     transport: str = "auto", num_sms: Optional[int] = None) -> dict:
    """GPU variant: every case with CUDA tensors (``backend``: "torch" reference or "nvshmem"; ``transport``
    of the nvshmem backend: "auto" or "put"; ``num_sms``: its SM budget)."""
    from _dist import bind_rank_gpu

    dev = bind_rank_gpu(rank)
    ops = [replace(c, device=dev, backend=backend, transport=transport, num_sms=num_sms)
           for c in backward_op_cases(world, seed=3)][:n_ops]
    moe = [replace(c, device=dev, backend=backend, transport=transport, num_sms=num_sms) for c in moe_cases(world, seed=3)]
    if backend == "nvshmem":
        ops = [matched_transport(c) for c in ops]
    out = world_worker(rank, world, ops, moe, False)
    if backend == "nvshmem":
        from mxcomm import transport as tp

        check_mismatched_transport_refused(EPGroup(ops[0].config()), ops[0], rank, out["failures"])
        tp.finalize()
    return out


__all__ = [
    "MoECase", "moe_cases", "moe_inputs", "moe_reference", "moe_step", "backward_op_cases", "backward_edge_cases",
    "backward_ops_worker",
    "moe_worker", "world_worker", "gpu_world_worker", "make_grads", "matched_transport",
    "check_mismatched_transport_refused", "make_grad_recvs", "moe_block",
    "compile_worker",
]
