"""Single-process plain-torch MoE from the global weights: the oracle of :class:`mxcomm.nn.MoE`.

A loop over experts in float64 (or any dtype), no dispatch/combine, no grouped GEMMs:

    y[t] = sum_j w[t, j] * E_{idx[t, j]}(x[t]) + shared(x[t]),   E_e(a) = (silu(a W1_e^T) * (a W3_e^T)) W2_e^T

with the router of :class:`mxcomm.nn.Router` (same :class:`RouterConfig`) computed in the same dtype.
Differentiable (run ``backward`` through it for reference gradients).

``simulate=True`` applies the roundings the layer documents, at the same points, in the forward AND the
backward, so that what remains is only the implementation's own arithmetic (fp32 accumulation order vs
float64). Per precision:

============================  ==========================================  ==========================================
point                         forward                                     backward
============================  ==========================================  ==========================================
dispatch                      mxfp8: row-wise MXFP8 of x; bf16: none      each slot's row grad bf16; their sum per
                                                                          token rounded once: row MXFP8 / bf16
expert projection ``a W^T``   W: MXFP8 along K (mxfp8) / bf16; out bf16   grad_out bf16 (+ row MXFP8); grad_a =
                                                                          bf16(grad_out @ W_dgrad), W_dgrad MXFP8
                                                                          along N (mxfp8) / bf16; grad_W = grad_out^T a
SwiGLU                        h = bf16(silu(g) u); (mxfp8) row MXFP8 of h grad_gu rounded to bf16
combine                       the routed sum ``sum_j w * out`` per token  per slot ``w * grad_y``: (mxfp8) row MXFP8
                              rounded once: (mxfp8) row MXFP8 / bf16      / bf16
output ``y``                  bf16 (routed part, then with the shared)    grad_y bf16
============================  ==========================================  ==========================================

Combine and dispatch backward round one partial per (token, rank): ``ep_size`` ranks hold ``E / ep_size``
consecutive experts each (as :class:`mxcomm.ep.EPGroup` places them), so a token whose experts sit on several ranks
sums several rounded partials (``ep_size=1``: one partial per token). The layer's values depend on which experts
share a rank; the simulation follows the placement.

The shared expert sees ``x`` quantized like the dispatch (mxfp8) with no transport rounding of its gradient.
Not simulated: the final bf16 rounding of ``grad_x`` and the bf16 sum of the routed and shared ``x``
gradients (each under one bf16 ulp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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


def _ident(t: torch.Tensor) -> torch.Tensor:
    return t


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _qdq(t: torch.Tensor, mode: str, axis: int = -1) -> torch.Tensor:
    """MXFP8 quantize -> dequantize along ``axis`` (rounded to fp32 first), back in t's dtype."""
    sat = t.dtype if torch.finfo(t.dtype).max <= torch.finfo(torch.float32).max else None  # (a float64 reference: fp32's)
    return mx.quantize(t.to(torch.float32), mode=mode, axis=axis).dequantize(torch.float32, saturate_to=sat).to(t.dtype)


class _Sim(torch.autograd.Function):
    """Value map ``fwd`` in the forward, gradient map ``bwd`` in the backward (a simulated rounding)."""

    @staticmethod
    def forward(ctx, x, fwd: Callable, bwd: Callable):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


class _SimLinear(torch.autograd.Function):
    """``bf16(a @ wf(W)^T)``; backward ``grad_a = bf16(gq(g) @ wd(W))``, ``grad_W = bf16(g)^T @ a`` (the layer's
    grouped projection: MXFP8 or BF16 forward/dgrad operands, wgrad from the forward's input)."""

    @staticmethod
    def forward(ctx, a, w, wf: Callable, wd: Callable, gq: Callable):
        ctx.save_for_backward(a, w)
        ctx.wd, ctx.gq = wd, gq
        return _bf16(a @ wf(w).t())

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        g = _bf16(g)
        return _bf16(ctx.gq(g) @ ctx.wd(w)), g.t() @ a, None, None, None


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


@dataclass(frozen=True)
class _Rounding:
    """The value maps of one precision (see the module docstring's table); identities when not simulating."""

    simulate: bool
    disp_f: Callable = _ident
    disp_b: Callable = _ident  # the summed gradient of a token's slots
    row_b: Callable = _ident  # each slot's gradient row
    comb_f: Callable = _ident  # the routed sum of a token
    comb_b: Callable = _ident
    w_fwd: Callable = _ident
    w_dgrad: Callable = _ident
    g_q: Callable = _ident
    h_f: Callable = _ident

    @staticmethod
    def of(config: MoEConfig, simulate: bool) -> "_Rounding":
        if not simulate:
            return _Rounding(False)
        if config.precision == "bf16":
            return _Rounding(True, disp_b=_bf16, row_b=_bf16, comb_f=_bf16, comb_b=_bf16, w_fwd=_bf16, w_dgrad=_bf16,
                             h_f=_bf16)
        m = config.scale_mode

        def q(t):
            return _qdq(t, m)
        return _Rounding(
            True, disp_f=q, disp_b=q, row_b=_bf16, comb_f=q, comb_b=q,
            w_fwd=lambda w: _qdq(w, m, axis=-1), w_dgrad=lambda w: _qdq(w, m, axis=0), g_q=q,
            h_f=lambda h: q(_bf16(h)),
        )

    def linear(self, a, w):
        if not self.simulate:
            return a @ w.t()
        return _SimLinear.apply(a, w, self.w_fwd, self.w_dgrad, self.g_q)

    def sim(self, t, f, b):
        return _Sim.apply(t, f, b) if self.simulate else t


def _swiglu_mlp(a, w13, w2, r: _Rounding):
    F_ = w13.shape[0] // 2
    gu = r.sim(r.linear(a, w13), _ident, _bf16)
    h = F.silu(gu[:, :F_]) * gu[:, F_:]
    h = r.sim(h, r.h_f, _ident)
    return r.linear(h, w2)


def moe_reference(
    x: torch.Tensor, config: MoEConfig, *, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    shared_w13: Optional[torch.Tensor] = None, shared_w2: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None, simulate: bool = False, ep_size: int = 1,
) -> ReferenceOutput:
    """Plain-torch MoE over all ``E`` experts (see the module docstring).

    Args:
        x: ``[T, H]`` (its dtype is the computation dtype, e.g. float64; requires_grad for gradients).
        config: the layer's :class:`MoEConfig` (router options; precision and scale mode for ``simulate``).
        router: ``[E, H]``. w13: ``[E, 2F, H]`` (gate rows, then up rows). w2: ``[E, H, F]``.
        shared_w13 / shared_w2: ``[2Fs, H]`` / ``[H, Fs]`` (or with a leading 1), when the layer has a shared
            expert.
        topk_idx: optional ``[T, k]`` selection to use instead of this function's own top-k (e.g. the layer's,
            so that a near-tie decided differently in fp32 cannot change the comparison).
        simulate: apply the layer's roundings in forward and backward (see the module docstring).
        ep_size: the expert-parallel ranks whose per-(token, rank) partials ``simulate`` rounds (a divisor of E).
    Returns:
        :class:`ReferenceOutput`.
    """
    E = config.num_experts
    if ep_size < 1 or E % ep_size:
        raise ValueError(f"ep_size must be a positive divisor of num_experts={E}, got {ep_size}")
    dt = x.dtype
    r = _Rounding.of(config, simulate)
    idx, w, _, aux = reference_route(x, router, config, topk_idx)
    # per rank: the dispatch rounding of x; backward: that rank's slot gradients summed, rounded once
    xd = [r.sim(x, r.disp_f, r.disp_b) for _ in range(ep_size)]
    parts = [torch.zeros_like(x) for _ in range(ep_size)]
    for e in range(E):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        d = e // (E // ep_size)
        a = r.sim(xd[d][tok], _ident, r.row_b)
        out = _swiglu_mlp(a, w13[e].to(dt), w2[e].to(dt), r)
        out = r.sim(out, _ident, r.comb_b)
        parts[d] = parts[d].index_add(0, tok, w[tok, slot].unsqueeze(1) * out)
    y = sum(r.sim(p, r.comb_f, _ident) for p in parts)  # one rounded partial per (token, rank)
    y = r.sim(y, _bf16, _bf16)
    if shared_w13 is not None:
        s13 = shared_w13.reshape(-1, shared_w13.shape[-1]).to(dt)
        s2 = shared_w2.reshape(shared_w2.shape[-2], -1).to(dt)
        y = r.sim(y + _swiglu_mlp(r.sim(x, r.disp_f, _ident), s13, s2, r), _bf16, _bf16)
    return ReferenceOutput(y=y, aux_loss=aux, topk_idx=idx, topk_weights=w)


__all__ = ["moe_reference", "reference_route", "ReferenceOutput"]
