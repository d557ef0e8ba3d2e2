"""Reference math of combine and of the backward passes of dispatch/combine (plain torch; the oracle in
:mod:`mxcomm.ep.reference.oracle` and the reference backend use it).

Notation: origin rank ``s``, its tokens ``t``, slots ``j`` in ``[0, k)``, ``dest(t, j)`` the destination rank of
slot ``j`` (-1 = dropped), ``row(t, j)`` its expert-major row there, ``w`` the route weights as fp32. ``Tq`` is the
transport rounding of an fp32 row (:func:`transport_round`): MXFP8 row-wise quantize (the config's scale mode) then
dequantize to fp32 saturated at the BF16 range, or a round trip through BF16. The ranks of token ``t`` "in order of
first appearance" ``d_1, d_2, ...`` are the valid ``dest(t, j)`` taken for ``j = 0, 1, ...``, each once.

* combine: one row per (token, rank). The expert rank ``d`` forms the partial
  ``P_d[t] = sum_j w[t,j] * out_d[row(t,j)]`` over the slots of ``t`` on ``d`` in fp32, ``j`` ascending (each
  product rounded to fp32, then the add; no fused multiply-add), rounds it once (``Tq``) and sends it; the origin
  sums ``y[t] = bf16(sum_i Tq(P_{d_i}[t]))`` in fp32 in order of first appearance. A token without a valid slot
  gives 0. One rank is the same formula (one partial per token). Saturation: a finite partial rounded to BF16 and
  a sum of finite partials that passes the BF16 range give +-BF16_MAX, not Inf (:func:`bf16_saturated`,
  :func:`sum_to_bf16`); Inf and NaN pass through.
* combine backward:
  ``grad_expert_out[row(t,j)] = T_q(w[t,j] * grad_y[t])``: the fp32 product rounded per slot (MXFP8 row-wise
  quantization, or a BF16 cast) in the dispatch layout on the expert rank (expert-major, padded, same rows as the
  dispatch output, MX scales grouped-along-M on ``offs``; padding rows zero).
  ``grad_w[t,j] = <grad_y[t], out_d[row(t,j)]>`` in fp32 with the expert output AS GIVEN to combine (the
  straight-through gradient of the forward: ``Tq`` counts as the identity), 0 for dropped slots. It is computed
  where the expert rows are: :class:`~mxcomm.ep.handle.CombineSaved` holds the expert output on the expert rank
  (nothing is kept at the origin), and ``grad_y`` is brought there.
* dispatch backward: the combine formula with every weight 1:
  ``G_d[t] = sum_j grad_recv_d[row(t,j)]`` (fp32, ``j`` ascending) on the expert rank,
  ``grad_x[t] = bf16(sum_i Tq(G_{d_i}[t]))`` at the origin; dropped slots add nothing, padding rows are never
  read. An MX ``grad_recv`` is decoded first (:func:`decode_rows`), so it is summed per (token, rank) and rounded
  again for transport.
"""
from __future__ import annotations

from typing import Union

import torch

from ...mx import MXTensor, quantize


# ------------------------------------------------------------------ reference math ----

def decode_rows(rows: Union[MXTensor, torch.Tensor]) -> torch.Tensor:
    """float32 values of expert-side rows: an :class:`MXTensor` (row-wise, any scale layout) dequantized with
    saturation at the BF16 range, a dense tensor cast."""
    if isinstance(rows, MXTensor):
        return rows.dequantize(torch.float32, saturate_to=torch.bfloat16)
    return rows.to(torch.float32)


BF16_MAX = torch.finfo(torch.bfloat16).max


def bf16_saturated(v: torch.Tensor, finite: Union[torch.Tensor, None] = None) -> torch.Tensor:
    """fp32 ``v`` -> bfloat16, the elements where ``finite`` holds (default: where ``v`` is finite) clamped to
    +-BF16_MAX first: a finite value that rounds past the BF16 range saturates instead of becoming Inf; Inf and NaN
    (outside ``finite``) are cast as they are."""
    keep = torch.isfinite(v) if finite is None else finite
    return torch.where(keep, v.clamp(-BF16_MAX, BF16_MAX), v).to(torch.bfloat16)


def transport_round(p: torch.Tensor, quantize_rows: bool, mode: str) -> torch.Tensor:
    """``Tq``: the float32 values of fp32 rows ``p [n, H]`` after transport, each row rounded on its own: MXFP8
    row-wise quantize (scale ``mode``) then dequantize saturated at the BF16 range when ``quantize_rows``, else a
    BF16 round trip (a finite value saturated at the BF16 range: :func:`bf16_saturated`)."""
    p = p.to(torch.float32)
    if quantize_rows:
        return quantize(p, mode=mode).dequantize(torch.float32, saturate_to=torch.bfloat16)
    return bf16_saturated(p).to(torch.float32)


def sum_to_bf16(acc: torch.Tensor, all_finite: torch.Tensor) -> torch.Tensor:
    """The origin's result: the fp32 sum ``acc`` of a token's rounded partials -> bfloat16, saturated at the BF16
    range where every partial summed there was finite (``all_finite``, elementwise): finite partials whose sum rounds
    or overflows past the range give +-BF16_MAX, a partial that is Inf or NaN passes through."""
    return bf16_saturated(acc, all_finite)


def route_weight_grad(grad_y: torch.Tensor, rows: Union[MXTensor, torch.Tensor], pos: torch.Tensor) -> torch.Tensor:
    """``out[t,j] = <grad_y[t], rows[pos[t,j]]>`` in fp32; 0 where ``pos == -1``.

    Args:
        grad_y: ``[T, H]``; rows: dense ``[n, H]`` or a row-wise :class:`MXTensor` (decoded with
            :func:`decode_rows`); pos: int ``[T, k]``.
    Returns:
        float32 ``[T, k]``.
    """
    vals = decode_rows(rows)
    n, H = vals.shape
    T, k = pos.shape
    pos = pos.to(torch.int64)
    valid = pos >= 0
    vals = torch.cat([vals, vals.new_zeros(1, H)])
    v = vals[torch.where(valid, pos, torch.full_like(pos, n)).reshape(-1)].view(T, k, H)
    dot = (v * grad_y.to(torch.float32).view(T, 1, H)).sum(-1)
    return torch.where(valid, dot, torch.zeros_like(dot))


__all__ = ["BF16_MAX", "bf16_saturated", "sum_to_bf16", "decode_rows", "transport_round", "route_weight_grad"]
