"""Single-process oracle for dispatch/combine: every rank's expected outputs, no communication.

Written independently of :mod:`mxcomm.ep.plan` (plain loops over experts and source ranks) so
tests of any backend compare against something derived straight from the contract:

* Expert ``e`` lives on rank ``e // El``. On that rank, its group holds the rows of source
  rank 0 (in ``(t, j)`` row-major order of ``topk_idx == e``), then source 1, ..., then zero
  rows up to a multiple of ``align``. Groups follow in local expert order.
* mxfp8: the row is ``quantize(x_s)[t]`` (row-wise); padding rows have payload 0, scale 0.
* combine: ``y_s[t] = sum_j w_s[t,j] * T(out_r[row])`` in fp32, j ascending, dropped -> 0,
  where ``T`` is dequantize(quantize(.)) (row-wise, config scale mode) or the bf16 value.
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
from .backward import transport_values


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
    """Expected combine output of every rank: bfloat16 ``[T_s, H]``.

    Args:
        expert_outs: per rank, bfloat16 ``[R_r, H]`` in the expert-major layout.
        routes: from :func:`oracle_dispatch`.
        topk_weights: per rank, float ``[T_s, k]``.
        quantize_rows: MXFP8 transport (row-wise, config scale mode) or BF16.
    """
    if quantize_rows:
        vals = [quantize(o, mode=config.scale_mode).dequantize(torch.float32, saturate_to=torch.bfloat16) for o in expert_outs]
    else:
        vals = [o.to(torch.float32) for o in expert_outs]
    return routed_sum(config, routes, vals, topk_weights)


def routed_sum(config: EPConfig, routes: OracleRoutes, vals: Sequence[torch.Tensor],
               topk_weights: Optional[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """``y_s[t] = sum_j w_s[t, j] * vals[r][row]`` for every rank ``s``, over the slots ``(t, j)`` routed to
    row ``row`` of rank ``r`` (dropped slots add nothing), in fp32 slot by slot in ``j`` order; bf16 out.

    Args:
        vals: per rank, fp32 ``[R_r, H]`` rows in the expert-major layout.
        topk_weights: per rank, float ``[T_s, k]``; None: every weight 1 (dispatch backward).
    """
    H = config.hidden
    ys = []
    for s, d in enumerate(routes.dest):
        T = d.shape[0]
        w = None if topk_weights is None else topk_weights[s].to(torch.float32)
        dev = w.device if w is not None else (vals[0].device if vals else torch.device("cpu"))
        acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
        for j in range(config.topk):
            contrib = torch.zeros(T, H, dtype=torch.float32, device=dev)
            for t in range(T):
                r, row = int(d[t, j, 0]), int(d[t, j, 1])
                if r >= 0:
                    v = vals[r][row].to(dev)
                    contrib[t] = v if w is None else w[t, j] * v
            acc = acc + contrib
        ys.append(acc.to(torch.bfloat16))
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
        quantize_rows: MXFP8 transport (both ways) or BF16.
    Returns:
        per rank, :class:`CombineGrads` (``grad_weights`` float32 ``[T_r, k]`` computed in float64).
    """
    W = len(grad_ys)
    H, k = config.hidden, config.topk
    back = [transport_values(o, quantize_rows, config.scale_mode).to(torch.float64) for o in expert_outs]
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
                gw[t, j] = (gy[t].to(torch.float64).cpu() * back[r][row].cpu()).sum()
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
    """Expected dispatch backward (``grad_x``) of every rank: bfloat16 ``[T_s, H]``.

    Args:
        grad_recvs: per rank, bfloat16 ``[R_r, H]`` or :class:`MXTensor` (sent as it is).
        routes: :class:`mxcomm.ep.reference.oracle.OracleRoutes` of the dispatch.
        quantize_rows: MXFP8 transport of dense gradients.
    """
    vals = [transport_values(g, quantize_rows, config.scale_mode) for g in grad_recvs]
    return routed_sum(config, routes, vals, None)


__all__ = ["oracle_dispatch", "oracle_combine", "routed_sum", "OracleRoutes", "oracle_combine_backward",
           "oracle_dispatch_backward"]
