"""Backward of dispatch/combine: the values the backends exchange, the reference math, and the
single-process oracle the tests compare every backend against.

Math (``T`` tokens, ``k`` = topk, ``H`` hidden; ``T(.)`` = the transport rounding: MXFP8 row-wise
quantize -> dequantize in the config's scale mode, or the identity on BF16 values):

* forward combine: ``y[t] = sum_j w[t,j] * back[t,j]`` with ``back[t,j] = T(expert_out[row(t,j)])``,
  the row as it ARRIVED at the origin.
* combine backward:
  ``grad_expert_out[row(t,j)] = T_q(w[t,j] * grad_y[t])`` (fp32 multiply, then MXFP8 row-wise
  quantization - or a BF16 cast - sent to the expert rank into the dispatch layout: expert-major,
  padded, same rows as the dispatch output, MX scales grouped-along-M on ``offs``; padding rows
  zero), and ``grad_w[t,j] = <grad_y[t], back[t,j]>`` (fp32), 0 for dropped slots.
  ``grad_w`` uses ``back`` (after transport rounding), so it is the exact gradient of the function
  the forward computed. The origin keeps ``back`` from the forward combine (:class:`CombineSaved`):
  ``n_send * H * 33/32`` bytes with MXFP8 transport (payload + row scales), ``n_send * H * 2``
  with BF16 transport, ``n_send <= T*k`` (the valid slots). The alternative (send ``grad_y`` to
  the expert ranks, dot there, return ``k`` scalars per token) would need ``expert_out`` kept on
  the expert side (``R * H * 2`` bytes, more than the MXFP8 copy) and an extra round trip.
* dispatch backward: ``grad_x[t] = sum_j T(grad_recv[row(t,j)])`` in fp32, ``j`` ascending
  (combine with all weights 1), BF16 result; dropped slots add 0; padding rows are never read.
  An MX ``grad_recv`` travels as it is (no requantization); a BF16 one is quantized row-wise when
  the transport is MXFP8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from ..mx import MXTensor, ScaleLayout, quantize
from .config import EPConfig
from .oracle import routed_sum


@dataclass(frozen=True)
class CombineSaved:
    """What the origin keeps from a forward combine for the route-weight gradient.

    Attributes:
        rows: the returned expert rows as they arrived, indexed by this rank's send position
            (``plan.send_pos``): :class:`MXTensor` ``[n, H]`` (float8_e4m3fn payload, uint8 scales in
            ROW layout ``[n, H/32]``) after MXFP8 transport, or bfloat16 ``[n, H]`` after BF16
            transport. ``n >= num_send``; rows past ``num_send`` are never read.
    """

    rows: Union[MXTensor, torch.Tensor]

    def nbytes(self) -> int:
        r = self.rows
        return r.nbytes() if isinstance(r, MXTensor) else r.numel() * r.element_size()


@dataclass(frozen=True)
class CombineGrads:
    """Result of a combine backward.

    Attributes:
        grad_expert_out: ``[R, H]`` in the dispatch output's expert-major layout (padding rows zero):
            :class:`MXTensor` (float8_e4m3fn payload, uint8 scales GROUPED_M on the dispatch ``offs``,
            axis 1, the config's scale mode, ``orig_dtype`` bfloat16) for MXFP8 transport, else bfloat16.
        grad_weights: float32 ``[T, k]`` route-weight gradient (0 for dropped slots), or None when no
            :class:`CombineSaved` was given.
    """

    grad_expert_out: Union[MXTensor, torch.Tensor]
    grad_weights: Optional[torch.Tensor]


# ------------------------------------------------------------------ reference math ----

def slot_grad_rows(grad_y: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``w[t,j] * grad_y[t]`` in fp32 for the flat slots ``slots = t*k + j``: float32 ``[n, H]``.

    Args:
        grad_y: ``[T, H]`` (any float dtype); topk_weights: ``[T, k]``; slots: int ``[n]``.
    """
    k = topk_weights.shape[1]
    s = slots.to(torch.int64)
    w = topk_weights.reshape(-1).to(torch.float32)[s]
    return w.view(-1, 1) * grad_y.to(torch.float32)[s // k]


def route_weight_grad(grad_y: torch.Tensor, rows: Union[MXTensor, torch.Tensor], send_pos: torch.Tensor) -> torch.Tensor:
    """``grad_w[t,j] = <grad_y[t], rows[send_pos[t,j]]>`` in fp32; 0 where ``send_pos == -1``.

    Args:
        grad_y: ``[T, H]``; rows: :class:`MXTensor` or dense ``[n, H]`` (see :class:`CombineSaved`);
        send_pos: int ``[T, k]``.
    Returns:
        float32 ``[T, k]``.
    """
    vals = rows.dequantize(torch.float32) if isinstance(rows, MXTensor) else rows.to(torch.float32)
    n, H = vals.shape
    T, k = send_pos.shape
    pos = send_pos.to(torch.int64)
    valid = pos >= 0
    vals = torch.cat([vals, vals.new_zeros(1, H)])
    v = vals[torch.where(valid, pos, torch.full_like(pos, n)).reshape(-1)].view(T, k, H)
    dot = (v * grad_y.to(torch.float32).view(T, 1, H)).sum(-1)
    return torch.where(valid, dot, torch.zeros_like(dot))


def transport_values(rows: Union[MXTensor, torch.Tensor], quantize_rows: bool, mode: str) -> torch.Tensor:
    """float32 values of ``rows`` after transport: an MXTensor as it is; a dense tensor quantized
    row-wise (``mode``) and dequantized when ``quantize_rows``, else its own values."""
    if isinstance(rows, MXTensor):
        return rows.dequantize(torch.float32)
    if quantize_rows:
        return quantize(rows, mode=mode).dequantize(torch.float32)
    return rows.to(torch.float32)


# ------------------------------------------------------------- single-process oracle ----
# Written from the contract with plain loops over the oracle's routes (mxcomm.ep.oracle), not from
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
        routes: :class:`mxcomm.ep.oracle.OracleRoutes` of the dispatch.
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
        routes: :class:`mxcomm.ep.oracle.OracleRoutes` of the dispatch.
        quantize_rows: MXFP8 transport of dense gradients.
    """
    vals = [transport_values(g, quantize_rows, config.scale_mode) for g in grad_recvs]
    return routed_sum(config, routes, vals, None)


__all__ = [
    "CombineSaved", "CombineGrads", "slot_grad_rows", "route_weight_grad", "transport_values",
    "oracle_combine_backward", "oracle_dispatch_backward",
]
