"""Reference math of the backward passes of dispatch/combine (plain torch; the oracle in
:mod:`mxcomm.ep.reference.oracle` and the reference backend use it).

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
  the forward computed. The origin keeps ``back`` from the forward combine (:class:`~mxcomm.ep.handle.CombineSaved`):
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

from typing import Union

import torch

from ...mx import MXTensor, quantize


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
    vals = rows.dequantize(torch.float32, saturate_to=torch.bfloat16) if isinstance(rows, MXTensor) else rows.to(torch.float32)
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
        return rows.dequantize(torch.float32, saturate_to=torch.bfloat16)
    if quantize_rows:
        return quantize(rows, mode=mode).dequantize(torch.float32, saturate_to=torch.bfloat16)
    return rows.to(torch.float32)


__all__ = ["slot_grad_rows", "route_weight_grad", "transport_values"]
