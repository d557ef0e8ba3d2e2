"""Single-process plain-torch MoE from the global weights: the oracle of :class:`mxcomm.nn.MoE`.

A loop over experts in float64 (or any dtype), no dispatch/combine, no grouped GEMMs:

    y[t] = sum_j w[t, j] * E_{idx[t, j]}(x[t]) + shared(x[t]),   E_e(a) = (silu(a W1_e^T) * (a W3_e^T)) W2_e^T

with the router of :class:`mxcomm.nn.Router` (same :class:`RouterConfig`) computed in the same dtype.
Differentiable (run ``backward`` through it for reference gradients).

``simulate=True`` applies the roundings the layer documents at the same points, in the forward only
(straight-through in the backward): BF16 path - the weights, ``gu``, ``h``, each expert output and ``y``
rounded to bf16;
MXFP8 path - additionally the dispatch (row-wise MXFP8 of ``x``), the weights (MXFP8 along the reduction
axis), ``h`` (MXFP8 after the bf16 rounding), and the combine (row-wise MXFP8 of each expert output row).
It isolates what an implementation adds on top of the format (accumulation order, fp32 vs float64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import mx
from .config import MoEConfig
from .router import load_balancing_loss


@dataclass(frozen=True)
class ReferenceOutput:
    """Result of :func:`moe_reference`: ``y [T, H]``, ``aux_loss`` (scalar or None), the routing used
    (``topk_idx`` int64 ``[T, k]``, ``topk_weights`` ``[T, k]``), all in the computation dtype."""

    y: torch.Tensor
    aux_loss: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _qdq(t: torch.Tensor, mode: str, axis: int = -1) -> torch.Tensor:
    """MXFP8 quantize -> dequantize along ``axis`` (rounded to fp32 first), back in t's dtype."""
    return mx.quantize(t.to(torch.float32), mode=mode, axis=axis).dequantize(torch.float32).to(t.dtype)


def reference_route(x: torch.Tensor, router_weight: torch.Tensor, config: MoEConfig,
                    topk_idx: Optional[torch.Tensor] = None):
    """``(topk_idx, topk_weights, scores, aux_loss)`` of the router in ``x``'s dtype. ``topk_idx`` given: use
    that selection (weights still gathered from this computation)."""
    rc = config.router
    logits = x @ router_weight.to(x.dtype).t()
    scores = torch.softmax(logits, dim=-1) if rc.score_func == "softmax" else torch.sigmoid(logits)
    if topk_idx is None:
        topk_idx = torch.topk(scores, config.topk, dim=-1).indices
    w = torch.gather(scores, 1, topk_idx.to(torch.int64))
    if rc.normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * rc.route_scale
    aux = None
    if rc.aux_loss_coef > 0:
        aux = rc.aux_loss_coef * load_balancing_loss(scores, topk_idx, rc.score_func).to(x.dtype)
    return topk_idx.to(torch.int64), w, scores, aux


def _swiglu_mlp(a, w13, w2, sim_bf16: bool, sim_mx: bool, mode: str):
    st = _StraightThrough.apply
    F_ = w13.shape[0] // 2
    if sim_mx:
        w13 = st(w13, lambda t: _qdq(t, mode, axis=-1))
        w2 = st(w2, lambda t: _qdq(t, mode, axis=-1))
    elif sim_bf16:  # the BF16 path casts the fp32 masters to bf16 for its GEMMs
        w13, w2 = st(w13, _bf16), st(w2, _bf16)
    gu = a @ w13.t()
    if sim_bf16:
        gu = st(gu, _bf16)
    h = F.silu(gu[:, :F_]) * gu[:, F_:]
    if sim_bf16:
        h = st(h, _bf16)
    if sim_mx:
        h = st(h, lambda t: _qdq(t, mode))
    out = h @ w2.t()
    return st(out, _bf16) if sim_bf16 else out


def moe_reference(
    x: torch.Tensor, config: MoEConfig, *, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    shared_w13: Optional[torch.Tensor] = None, shared_w2: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None, simulate: bool = False,
) -> ReferenceOutput:
    """Plain-torch MoE over all ``E`` experts (see the module docstring).

    Args:
        x: ``[T, H]`` (its dtype is the computation dtype, e.g. float64; requires_grad for gradients).
        config: the layer's :class:`MoEConfig` (router options, precision/scale mode for ``simulate``).
        router: ``[E, H]``. w13: ``[E, 2F, H]`` (gate rows, then up rows). w2: ``[E, H, F]``.
        shared_w13 / shared_w2: ``[2Fs, H]`` / ``[H, Fs]`` (or with a leading 1), when the layer has a shared
            expert.
        topk_idx: optional ``[T, k]`` selection to use instead of this function's own top-k (e.g. the layer's,
            so that a near-tie decided differently in fp32 cannot change the comparison).
        simulate: apply the layer's roundings (forward only, see the module docstring).
    Returns:
        :class:`ReferenceOutput`.
    """
    dt = x.dtype
    sim_mx = simulate and config.precision == "mxfp8"
    mode = config.scale_mode
    st = _StraightThrough.apply
    idx, w, _, aux = reference_route(x, router, config, topk_idx)
    xin = st(x, lambda t: _qdq(t, mode)) if sim_mx else x
    y = torch.zeros_like(x)
    for e in range(config.num_experts):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out = _swiglu_mlp(xin[tok], w13[e].to(dt), w2[e].to(dt), simulate, sim_mx, mode)
        if sim_mx:
            out = st(out, lambda t: _qdq(t, mode))
        y = y.index_add(0, tok, w[tok, slot].unsqueeze(1) * out)
    if simulate:
        y = st(y, _bf16)
    if shared_w13 is not None:
        s13 = shared_w13.reshape(-1, shared_w13.shape[-1]).to(dt)
        s2 = shared_w2.reshape(shared_w2.shape[-2], -1).to(dt)
        sh = _swiglu_mlp(xin if sim_mx else x, s13, s2, simulate, sim_mx, mode)
        y = y + sh
        if simulate:
            y = st(y, _bf16)
    return ReferenceOutput(y=y, aux_loss=aux, topk_idx=idx, topk_weights=w)


__all__ = ["moe_reference", "reference_route", "ReferenceOutput"]
