"""Autograd-aware dispatch/combine: train a MoE block with plain ``loss.backward()``.

    from mxcomm.ep.autograd import dispatch, combine

    d = dispatch(group, x, topk_idx, topk_weights)     # x: bf16 [T, H] (requires grad)
    h = d.dense()                                      # or hand d.x (MXFP8Tensor) to an MX-aware GEMM
    expert_out = experts(h, d.offs, d.counts)          # bf16 [R, H], same expert-major rows
    y = combine(group, expert_out, d.handle)           # bf16 [T, H]
    loss(y).backward()   # grads reach x, topk_weights (router) and the experts

Gradients:

* ``combine`` backward (:meth:`EPGroup.combine_backward`): ``w[t,j] * grad_y[t]`` goes to the expert
  ranks in the dispatch layout (MXFP8 when ``precision == "mxfp8"``) -> gradient of
  ``expert_out``; ``grad_w[t,j] = <grad_y[t], out[t,j] as received>`` -> gradient of
  ``topk_weights`` (0 for dropped slots). Only combine depends on the weights.
* ``dispatch`` backward (:meth:`EPGroup.dispatch_backward`): each row's gradient returns to its
  origin (MXFP8 when ``precision == "mxfp8"``) and is summed over k -> gradient of ``x``.

MX values cross autograd as ONE value, a :class:`mxcomm.mx.subclass.MXFP8Tensor` (logical dtype
bfloat16, shape ``[R, H]``, holding the :class:`MXTensor`: payload + GROUPED_M scales + offsets):
the dispatch output with ``precision == "mxfp8"``, and - with ``grad_format="mx"`` - the gradient
of ``expert_out``, so an MX-aware dgrad GEMM consumes it without dequantize -> requantize. The
gradient arriving at the dispatch output may be bfloat16 or an MXFP8Tensor (sent as it is).
``grad_format="dense"`` (default) hands plain torch code a bfloat16 gradient with the same values
(the transport is MXFP8 either way; only the hand-off differs).

Collectives: both backward passes communicate. Every rank must run backward through every
dispatch/combine it ran forward, in the same order. That holds when all ranks run the same model
and each rank's loss is computed from its combine output - also on a rank with zero tokens, whose
``y`` is empty ``[0, H]`` (any expression of it, e.g. ``y.float().square().sum()``, connects the
graph). If one rank's loss ignores ``y`` its peers wait in the backward collective until the
process group's timeout. If autograd calls a backward without a gradient (``None``), it is
treated as zero, so the collective still runs.

torch.compile: with ``EPConfig.exact_sizes=False`` (static worst-case row count), :func:`dispatch`
and :func:`combine` route to :mod:`mxcomm.ep.ops` when compiling: ``torch.library`` custom ops with
fake implementations, the group looked up by an int id, the handle flattened into its plan tensors,
the MXFP8Tensor built from the op's payload/scales in the graph - no graph break
(``fullgraph=True`` works; tested, identical to eager). With ``exact_sizes=True`` (default) they stay
``torch.compiler.disable``-d: a graph break at each communication call, the code around them
compiles, results and gradients identical to eager (tested). Not done for ``exact_sizes=True``:
exact output sizes would need unbacked symints.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor
from .backward_ref import CombineSaved
from .group import EPGroup
from .handle import EPHandle
from . import ops as _ops

GRAD_FORMATS = ("dense", "mx")


@dataclass(frozen=True)
class Dispatched:
    """Output of :func:`dispatch`.

    Attributes:
        x: ``[R, H]`` rows for this rank's local experts, expert-major, groups padded to
            ``align`` with zero rows: an :class:`MXFP8Tensor` (precision ``"mxfp8"``; payload
            float8_e4m3fn, scales GROUPED_M on ``offs``) or bfloat16. Differentiable w.r.t. the
            dispatch input; its gradient may be bfloat16 or an MXFP8Tensor.
        offs: int32 ``[El]`` END offsets of the local experts' padded groups.
        counts: int32 ``[El]`` real rows per local expert.
        num_rows: R.
        handle: :class:`EPHandle` for :func:`combine`; its ``topk_weights`` is the tensor given to
            :func:`dispatch` (still attached to the autograd graph).
    """

    x: torch.Tensor
    offs: torch.Tensor
    counts: torch.Tensor
    num_rows: int
    handle: EPHandle

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x`` as a dense ``dtype`` tensor (differentiable; dequantizes an MXFP8Tensor)."""
        if isinstance(self.x, MXFP8Tensor):
            return self.x.dequantize(dtype)
        return self.x.to(dtype)


class _Box:
    """Carries the non-tensor results of a forward out of ``Function.forward``."""

    result = None
    handle = None


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: EPGroup, topk_idx, topk_weights, grad_quantize, box: _Box):
        res, handle = group.dispatch(x, topk_idx, topk_weights)
        box.result, box.handle = res, handle
        ctx.group, ctx.handle, ctx.grad_quantize = group, handle, grad_quantize
        ctx.set_materialize_grads(False)
        if isinstance(res.x, MXTensor):
            return MXFP8Tensor(res.x, dtype=torch.bfloat16)
        return res.x

    @staticmethod
    def backward(ctx, grad):
        h: EPHandle = ctx.handle
        if grad is None:  # output unused by the loss: still take part in the collective
            grad = torch.zeros(h.num_rows, h.config.hidden, dtype=torch.bfloat16, device=h.device)
        elif not isinstance(grad, MXFP8Tensor):
            grad = grad.to(torch.bfloat16).contiguous()
        gx = ctx.group.dispatch_backward(grad, h, quantize=ctx.grad_quantize)
        return gx, None, None, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_weights, group: EPGroup, handle: EPHandle, quantize, grad_quantize, grad_format):
        h = replace(handle, topk_weights=topk_weights.detach())
        ctx.group, ctx.handle, ctx.grad_quantize, ctx.grad_format = group, h, grad_quantize, grad_format
        ctx.w_dtype = topk_weights.dtype
        ctx.set_materialize_grads(False)
        ctx.saved_kind = None
        if ctx.needs_input_grad[1]:
            y, saved = group.combine_for_backward(expert_out, h, quantize=quantize)
            rows = saved.rows
            if isinstance(rows, MXTensor):
                ctx.saved_kind = ("mx", rows.mode)
                ctx.save_for_backward(rows.qdata, rows.row_scales())
            else:
                ctx.saved_kind = ("dense", None)
                ctx.save_for_backward(rows)
        else:  # no route-weight gradient wanted: keep nothing
            y = group.combine(expert_out, h, quantize=quantize)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        h: EPHandle = ctx.handle
        if grad_y is None:
            grad_y = torch.zeros(h.num_tokens, h.config.hidden, dtype=torch.bfloat16, device=h.device)
        saved = None
        if ctx.saved_kind is not None:
            tensors = ctx.saved_tensors
            if ctx.saved_kind[0] == "mx":
                saved = CombineSaved(rows=MXTensor(qdata=tensors[0], scales=tensors[1], axis=1, mode=ctx.saved_kind[1]))
            else:
                saved = CombineSaved(rows=tensors[0])
        grads = ctx.group.combine_backward(
            grad_y.to(torch.bfloat16).contiguous(), h, saved, quantize=ctx.grad_quantize
        )
        g = grads.grad_expert_out
        if isinstance(g, MXTensor):
            g = MXFP8Tensor(g, dtype=torch.bfloat16) if ctx.grad_format == "mx" else g.dequantize(torch.bfloat16)
        gw = None if grads.grad_weights is None else grads.grad_weights.to(ctx.w_dtype)
        return g, gw, None, None, None, None, None


def dispatch(
    group: EPGroup, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
    grad_quantize: Optional[bool] = None,
) -> Dispatched:
    """Differentiable :meth:`EPGroup.dispatch`.

    Under ``torch.compile`` with ``group.config.exact_sizes=False`` this is
    :func:`mxcomm.ep.ops.dispatch_op` (custom ops, no graph break; returns an
    :class:`mxcomm.ep.ops.OpDispatched` with the same fields, whose ``handle`` is an ``OpHandle``);
    otherwise the eager implementation below (a graph break under torch.compile).

    Args:
        group: the :class:`EPGroup`.
        x: bfloat16 ``[T, H]`` (gradient flows back to it).
        topk_idx: int32/int64 ``[T, k]``, -1 = dropped slot (no gradient).
        topk_weights: float ``[T, k]``; not used by dispatch itself, kept (attached to the graph) in
            the handle so that :func:`combine` differentiates w.r.t. it.
        grad_quantize: MXFP8 transport of dense gradients in the backward (default:
            ``precision == "mxfp8"``).
    Returns:
        :class:`Dispatched`.
    Collective (forward and backward).
    """
    if isinstance(group, EPGroup) and not group.config.exact_sizes and torch.compiler.is_compiling():
        return _ops.dispatch_op(group, x, topk_idx, topk_weights, grad_quantize=grad_quantize)
    return _dispatch_eager(group, x, topk_idx, topk_weights, grad_quantize=grad_quantize)


@torch.compiler.disable
def _dispatch_eager(group, x, topk_idx, topk_weights, *, grad_quantize=None) -> Dispatched:
    if not isinstance(group, EPGroup):
        raise TypeError(f"group must be an EPGroup, got {type(group).__name__}")
    box = _Box()
    # The weights go in detached: dispatch does not depend on them (its output needs a gradient
    # only when x does); the handle below carries the attached tensor to combine.
    w_in = topk_weights.detach() if isinstance(topk_weights, torch.Tensor) else topk_weights
    out = _DispatchFn.apply(x, group, topk_idx, w_in, grad_quantize, box)
    res, handle = box.result, box.handle
    handle = replace(handle, topk_weights=topk_weights)
    return Dispatched(x=out, offs=res.offs, counts=res.counts, num_rows=res.num_rows, handle=handle)


def combine(
    group: EPGroup, expert_out: torch.Tensor, handle: EPHandle, *, topk_weights: Optional[torch.Tensor] = None,
    quantize: Optional[bool] = None, grad_quantize: Optional[bool] = None, grad_format: str = "dense",
) -> torch.Tensor:
    """Differentiable :meth:`EPGroup.combine`: ``y[t] = sum_j w[t,j] * out[row(t,j)]``.

    Args:
        group: the :class:`EPGroup` of the dispatch.
        expert_out: dense bfloat16 ``[R, H]`` in the dispatch output's layout (padding rows ignored;
            their gradient is zero).
        handle: ``Dispatched.handle``.
        topk_weights: float ``[T, k]`` weights to combine with (default: ``handle.topk_weights``,
            the tensor given to :func:`dispatch`). Its gradient is the route-weight gradient.
        quantize: MXFP8 transport of the returned rows (default: ``precision == "mxfp8"``).
        grad_quantize: MXFP8 transport of ``w * grad_y`` in the backward (default: precision).
        grad_format: ``"dense"``: ``expert_out`` gets a bfloat16 gradient; ``"mx"``: it gets an
            :class:`MXFP8Tensor` (GROUPED_M scales, ready for an MX dgrad GEMM) when the gradient
            travelled as MXFP8 (a bfloat16 one otherwise).
    Returns:
        bfloat16 ``[T, H]``.
    Memory: when ``topk_weights`` requires grad, the returned rows are kept for the backward
    (``n_send * H * 33/32`` bytes with MXFP8 transport, ``* 2`` with BF16; ``n_send <= T*k``).
    Collective (forward and backward).
    An ``OpHandle`` (from :func:`dispatch` under torch.compile) goes to :func:`mxcomm.ep.ops.combine_op`.
    """
    if isinstance(handle, _ops.OpHandle):
        return _ops.combine_op(
            group, expert_out, handle, topk_weights=topk_weights, quantize=quantize, grad_quantize=grad_quantize,
            grad_format=grad_format,
        )
    return _combine_eager(
        group, expert_out, handle, topk_weights=topk_weights, quantize=quantize, grad_quantize=grad_quantize,
        grad_format=grad_format,
    )


@torch.compiler.disable
def _combine_eager(group, expert_out, handle, *, topk_weights=None, quantize=None, grad_quantize=None,
                   grad_format="dense") -> torch.Tensor:
    if not isinstance(group, EPGroup):
        raise TypeError(f"group must be an EPGroup, got {type(group).__name__}")
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be the EPHandle of a dispatch, got {type(handle).__name__}")
    if grad_format not in GRAD_FORMATS:
        raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {grad_format!r}")
    if isinstance(expert_out, MXFP8Tensor):
        raise TypeError("expert_out must be a dense bfloat16 tensor (combine of an MX expert output is not supported)")
    w = handle.topk_weights if topk_weights is None else topk_weights
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"topk_weights must be a floating torch.Tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if tuple(w.shape) != tuple(handle.topk_idx.shape):
        raise ValueError(f"topk_weights must have shape {tuple(handle.topk_idx.shape)}, got {tuple(w.shape)}")
    if w.device != handle.device:
        raise ValueError(f"topk_weights is on {w.device} but dispatch ran on {handle.device}")
    return _CombineFn.apply(expert_out, w, group, handle, quantize, grad_quantize, grad_format)


__all__ = ["dispatch", "combine", "Dispatched", "GRAD_FORMATS"]
