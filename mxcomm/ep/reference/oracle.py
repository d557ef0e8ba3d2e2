"""Single-process oracle for dispatch/combine: every rank's expected outputs, no communication.

Written independently of :mod:`mxcomm.ep.plan` (plain loops over experts and source ranks) so
tests of any backend compare against something derived straight from the contract:

* Expert ``e`` lives on rank ``e // El``. On that rank, its group holds the rows of source
  rank 0 (in ``(t, j)`` row-major order of ``topk_idx == e``), then source 1, ..., then zero
  rows up to a multiple of ``align``. Groups follow in local expert order.
* mxfp8: the row is ``quantize(x_s)[t]`` (row-wise); padding rows have payload 0, scale 0.
* combine: one partial per (token, rank): ``P_d[t] = sum_j w_s[t,j] * out_d[row(t,j)]`` over the slots of ``t``
  on rank ``d`` (fp32, j ascending, product then add), rounded once for transport (``Tq``: row-wise MXFP8
  quantize -> dequantize in the config's scale mode, or a BF16 round trip), then
  ``y_s[t] = bf16(sum_i Tq(P_{d_i}[t]))`` in fp32 over the ranks in order of first appearance over ``j``;
  a token without a valid slot gives 0 (see :mod:`mxcomm.ep.reference.backward`).
* dispatch backward: the same with every weight 1; combine backward: per-slot ``w * grad_y`` rows rounded on
  their own, and ``grad_w`` the dot of ``grad_y`` with the expert output as given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...mx import MXTensor, ScaleLayout, quantize
from ...mx.layouts import round_up
from ..config import EPConfig
from ..handle import CombineGrads, DispatchResult
from ..plan import max_recv_rows
from .backward import decode_rows, sum_to_bf16, transport_round


@dataclass(frozen=True)
class OracleRoutes:
    """Where each source slot went: ``dest[s]`` is int64 ``[T_s, k, 2]`` = (rank, row), -1 if dropped."""

    dest: list


def oracle_dispatch(
    config: EPConfig, xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor]
) -> tuple[list[DispatchResult], OracleRoutes]:
    """Expected :class:`DispatchResult` of every rank.

    Args:
        config: the group config (``world = len(xs)``).
        xs: per rank, bfloat16 ``[T_s, H]``.
        topk_idxs: per rank, int ``[T_s, k]`` (-1 = dropped).
    Returns:
        (per-rank results, routes of every source slot).
    """
    W = len(xs)
    config.validate(W)
    E, H, k, A = config.num_experts, config.hidden, config.topk, config.align
    El = E // W
    mxfp8 = config.precision == "mxfp8"
    # Source rows as bytes: mxfp8 payload [T, H] + scales [T, H/32], or bf16 bytes [T, 2H].
    src_p, src_s = [], []
    for x in xs:
        if mxfp8:
            q = quantize(x, mode=config.scale_mode)
            src_p.append(q.qdata.view(torch.uint8))
            src_s.append(q.scales)
        else:
            src_p.append(x.contiguous().view(torch.uint8))
            src_s.append(None)
    dest = [torch.full((idx.shape[0], k, 2), -1, dtype=torch.int64) for idx in topk_idxs]
    results = []
    for r in range(W):
        p_rows, s_rows, counts, offs = [], [], [], []
        cur = 0
        for le in range(El):
            e = r * El + le
            n = 0
            for s in range(W):
                hits = torch.nonzero(topk_idxs[s].cpu().to(torch.int64) == e)  # row-major (t, j) order
                if hits.numel() == 0:
                    continue
                t = hits[:, 0]
                p_rows.append(src_p[s][t.to(src_p[s].device)])
                if mxfp8:
                    s_rows.append(src_s[s][t.to(src_s[s].device)])
                rows = cur + n + torch.arange(hits.shape[0])
                dest[s][t, hits[:, 1], 0] = r
                dest[s][t, hits[:, 1], 1] = rows
                n += hits.shape[0]
            pad = round_up(n, A) - n
            if pad:
                p_rows.append(torch.zeros(pad, src_p[0].shape[1], dtype=torch.uint8, device=src_p[0].device))
                if mxfp8:
                    s_rows.append(torch.zeros(pad, H // 32, dtype=torch.uint8, device=src_p[0].device))
            cur += n + pad
            counts.append(n)
            offs.append(cur)
        R = cur if config.exact_sizes else max_recv_rows(config, W)
        dev = src_p[0].device
        width = src_p[0].shape[1]
        payload = torch.zeros(R, width, dtype=torch.uint8, device=dev)
        if p_rows:
            payload[:cur] = torch.cat(p_rows)
        offs_t = torch.tensor(offs, dtype=torch.int32, device=dev)
        if mxfp8:
            scales = torch.zeros(R, H // 32, dtype=torch.uint8, device=dev)
            if s_rows:
                scales[:cur] = torch.cat(s_rows)
            x_out = MXTensor(
                qdata=payload.view(torch.float8_e4m3fn), scales=scales, axis=1, layout=ScaleLayout.ROW,
                mode=config.scale_mode, orig_dtype=torch.bfloat16,
            ).with_layout(ScaleLayout.GROUPED_M, offs_t)
        else:
            x_out = payload.view(torch.bfloat16)
        results.append(DispatchResult(
            x=x_out, offs=offs_t, counts=torch.tensor(counts, dtype=torch.int32, device=dev), num_rows=R,
        ))
    return results, OracleRoutes(dest=dest)


def oracle_combine(
    config: EPConfig,
    expert_outs: Sequence[torch.Tensor],
    routes: OracleRoutes,
    topk_weights: Sequence[torch.Tensor],
    quantize_rows: bool,
) -> list[torch.Tensor]:
    """Expected combine output of every rank: bfloat16 ``[T_s, H]`` (see :func:`routed_sum`).

    Args:
        expert_outs: per rank, bfloat16 ``[R_r, H]`` in the expert-major layout.
        routes: from :func:`oracle_dispatch`.
        topk_weights: per rank, float ``[T_s, k]``.
        quantize_rows: MXFP8 transport of the partial sums (row-wise, config scale mode) or BF16.
    """
    return routed_sum(config, routes, [o.to(torch.float32) for o in expert_outs], topk_weights, quantize_rows)


def routed_sum(config: EPConfig, routes: OracleRoutes, vals: Sequence[torch.Tensor],
               topk_weights: Optional[Sequence[torch.Tensor]], quantize_rows: bool) -> list[torch.Tensor]:
    """The combine formula for every rank ``s``: per token ``t`` and each rank ``d`` its valid slots go to (in
    order of first appearance over ``j``), the partial ``P_d[t] = sum_j w_s[t, j] * vals[d][row(t, j)]`` over the
    slots of ``t`` on ``d``, fp32, ``j`` ascending (product, then add); then
    ``y_s[t] = bf16(sum_d Tq(P_d[t]))`` in fp32 in that order (``Tq``:
    :func:`~mxcomm.ep.reference.backward.transport_round`; the final cast saturates a sum of finite partials:
    :func:`~mxcomm.ep.reference.backward.sum_to_bf16`). A token without a valid slot gives 0.

    Args:
        vals: per rank, fp32 ``[R_r, H]`` rows in the expert-major layout.
        topk_weights: per rank, float ``[T_s, k]``; None: every weight 1 (dispatch backward).
        quantize_rows: MXFP8 transport of the partials, else BF16.
    """
    H = config.hidden
    ys = []
    for s, d in enumerate(routes.dest):
        T = d.shape[0]
        dl = d.tolist()
        w = None if topk_weights is None else topk_weights[s].to(torch.float32)
        dev = w.device if w is not None else (vals[0].device if vals else torch.device("cpu"))
        parts, owner = [], []  # partial rows and their tokens, tokens ascending, ranks in order of first appearance
        for t in range(T):
            ranks = []
            for j in range(config.topk):
                r = dl[t][j][0]
                if r >= 0 and r not in ranks:
                    ranks.append(r)
            for r in ranks:
                acc = torch.zeros(H, dtype=torch.float32, device=dev)
                for j in range(config.topk):
                    if dl[t][j][0] == r:
                        v = vals[r][dl[t][j][1]].to(device=dev, dtype=torch.float32)
                        acc = acc + (v if w is None else w[t, j] * v)
                parts.append(acc)
                owner.append(t)
        y = torch.zeros(T, H, dtype=torch.float32, device=dev)
        fin = torch.ones(T, H, dtype=torch.bool, device=dev)
        if parts:
            sent = transport_round(torch.stack(parts), quantize_rows, config.scale_mode)  # each row on its own
            for i, t in enumerate(owner):
                y[t] = y[t] + sent[i]
                fin[t] = fin[t] & torch.isfinite(sent[i])
        ys.append(sum_to_bf16(y, fin))
    return ys


# ------------------------------------------------------------- single-process oracle ----
# Written from the contract with plain loops over the oracle's routes (mxcomm.ep.reference.oracle), not from
# the routing plan, so that it checks the plan as well.

def oracle_combine_backward(
    config: EPConfig,
    grad_ys: Sequence[torch.Tensor],
    routes,
    topk_weights: Sequence[torch.Tensor],
    expert_outs: Sequence[torch.Tensor],
    dispatch_results: Sequence,
    quantize_rows: bool,
) -> list[CombineGrads]:
    """Expected combine backward of every rank.

    Args:
        grad_ys: per rank, bfloat16 ``[T_s, H]``.
        routes: :class:`mxcomm.ep.reference.oracle.OracleRoutes` of the dispatch.
        topk_weights: per rank, float ``[T_s, k]``.
        expert_outs: per rank, bfloat16 ``[R_r, H]`` (the forward combine's input).
        dispatch_results: per rank, the oracle's DispatchResult (for ``num_rows`` and ``offs``).
        quantize_rows: MXFP8 transport of the per-slot gradient rows, else BF16.
    Returns:
        per rank, :class:`CombineGrads`: ``grad_expert_out`` the per-slot rows ``w[t,j] * grad_y[t]`` (fp32 product,
        then MXFP8 row-wise or a BF16 cast) at the slots' expert rows; ``grad_weights`` float32 ``[T_s, k]``, the
        dot of ``grad_y[t]`` with the expert output row as given, computed in float64 (0 for dropped slots).
    """
    W = len(grad_ys)
    H, k = config.hidden, config.topk
    outs = [o.to(torch.float64).cpu() for o in expert_outs]
    gbuf = [torch.zeros(d.num_rows, H, dtype=torch.float32, device=d.offs.device) for d in dispatch_results]
    gws = []
    for s in range(W):
        d = routes.dest[s]
        T = d.shape[0]
        gy = grad_ys[s].to(torch.float32)
        w = topk_weights[s].to(torch.float32)
        gw = torch.zeros(T, k, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                r, row = int(d[t, j, 0]), int(d[t, j, 1])
                if r < 0:
                    continue
                gbuf[r][row] = (w[t, j] * gy[t]).to(gbuf[r].device)
                gw[t, j] = (gy[t].to(torch.float64).cpu() * outs[r][row]).sum()
        gws.append(gw.to(torch.float32).to(gy.device))
    out = []
    for r in range(W):
        if quantize_rows:
            g = quantize(gbuf[r], mode=config.scale_mode)
            g = MXTensor(
                qdata=g.qdata, scales=g.scales, axis=1, layout=ScaleLayout.ROW, mode=config.scale_mode,
                orig_dtype=torch.bfloat16,
            ).with_layout(ScaleLayout.GROUPED_M, dispatch_results[r].offs)
        else:
            g = gbuf[r].to(torch.bfloat16)
        out.append(CombineGrads(grad_expert_out=g, grad_weights=gws[r]))
    return out


def oracle_dispatch_backward(
    config: EPConfig, grad_recvs: Sequence, routes, quantize_rows: bool
) -> list[torch.Tensor]:
    """Expected dispatch backward (``grad_x``) of every rank: bfloat16 ``[T_s, H]``: :func:`routed_sum` of the
    decoded gradient rows with every weight 1.

    Args:
        grad_recvs: per rank, bfloat16 ``[R_r, H]`` or a row-wise :class:`MXTensor` (decoded, saturated at the BF16
            range, then summed per (token, rank) like a dense gradient).
        routes: :class:`mxcomm.ep.reference.oracle.OracleRoutes` of the dispatch.
        quantize_rows: MXFP8 transport of the partial sums, else BF16.
    """
    return routed_sum(config, routes, [decode_rows(g) for g in grad_recvs], None, quantize_rows)


__all__ = ["oracle_dispatch", "oracle_combine", "routed_sum", "OracleRoutes", "oracle_combine_backward",
           "oracle_dispatch_backward"]
