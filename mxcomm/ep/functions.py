"""The autograd Functions behind :meth:`EPGroup.dispatch <mxcomm.ep.group.EPGroup.dispatch>` and
:meth:`~mxcomm.ep.group.EPGroup.combine` (eager mode; under ``torch.compile`` the group routes to
:mod:`mxcomm.ep.compiled`). One small Function per step, each a collective in forward and backward.

Gradients:

* combine backward (``EPGroup.steps.combine_backward``): ``w[t,j] * grad_y[t]`` goes to the expert ranks in the
  dispatch layout (MXFP8 when ``grad_quantize``) -> gradient of ``expert_out``; ``grad_w[t,j] = <grad_y[t],
  out[t,j]>`` (the expert output as given, on the expert rank) -> gradient of ``topk_weights`` (0 for dropped slots). Only combine depends on the weights.
* dispatch backward (``EPGroup.steps.dispatch_backward``): each row's gradient returns to its origin (MXFP8 when
  ``grad_quantize``) and is summed over k -> gradient of ``x``.

MX values cross autograd as ONE value, an :class:`MXFP8Tensor` (logical dtype bfloat16, shape ``[R, H]``, holding
payload + GROUPED_M scales + offsets): the dispatch output with ``precision == "mxfp8"``, and - with
``grad_format="mx"`` - the gradient of ``expert_out``, so an MX-aware dgrad GEMM consumes it without dequantize ->
requantize. The gradient arriving at the dispatch output may be bfloat16 or an MXFP8Tensor (sent as it is).

Collectives: both backward passes communicate. Every rank must run backward through every dispatch/combine it ran
forward, in the same order. That holds when all ranks run the same model and each rank's loss is computed from its
combine output - also on a rank with zero tokens, whose ``y`` is empty ``[0, H]`` (any expression of it connects the
graph). A backward called without a gradient (``None``) is treated as zero, so the collective still runs.

Streams (``stream=``, :mod:`mxcomm.ep.streams`): ``Function.apply`` runs with the communication stream current, so
the autograd node records that stream and the engine runs the backward collective on it, making it wait for the
gradient's producer and the consumers wait for it (the engine's own stream rule for every op). The engine marks
the plain gradient tensors it moves between streams for the caching allocator but not the tensors inside an
:class:`MXFP8Tensor` gradient: the backward marks those itself (an MX gradient arriving on the communication stream;
an MX ``grad_format="mx"`` gradient leaving for the stream the forward was called from).

A call that autograd would not record (no input requires grad, or grad mode is off; no functorch transform or
forward-mode AD level active) runs the step without ``Function.apply``: the same result (``apply`` returns the
forward's output and records nothing then) for less host time.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd import forward_ad

from ..mx import MXTensor
from ..mx.subclass import MXFP8Tensor
from . import streams
from .handle import CombineSaved, Dispatched, EPHandle, replace_fields, with_weights


def _recorded(*tensors) -> bool:
    """True when ``Function.apply`` on these inputs would be recorded by autograd (grad mode on and one of them a
    tensor that requires grad) or may be transformed (a functorch transform or a forward-mode AD level is active)."""
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return forward_ad._current_level >= 0 or torch._C._functorch.maybe_current_level() is not None


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t.to(torch.bfloat16).contiguous()``: ``t`` itself when it already is (checked without a tensor op)."""
    return t if t.dtype == torch.bfloat16 and t.is_contiguous() else t.to(torch.bfloat16).contiguous()


class _Box:
    """Carries the non-tensor results of a forward out of ``Function.forward``."""

    result = None


class DispatchFn(torch.autograd.Function):
    """``x -> dispatch(x)`` (the routing is not differentiable); backward = ``steps.dispatch_backward``."""

    @staticmethod
    def forward(ctx, x, steps, topk_idx, topk_weights, grad_quantize, box: _Box, caller=None):
        res: Dispatched = steps.dispatch(x, topk_idx, topk_weights)
        box.result = res
        ctx.steps, ctx.handle, ctx.grad_quantize = steps, res.handle, grad_quantize
        ctx.caller = caller  # the caller's stream when called with stream= (this runs on the communication stream)
        ctx.set_materialize_grads(False)
        return res.x

    @staticmethod
    def backward(ctx, grad):
        h: EPHandle = ctx.handle
        if grad is None:  # output unused by the loss: still take part in the collective
            grad = torch.zeros(h.num_rows, h.config.hidden, dtype=torch.bfloat16, device=h.device)
        elif not isinstance(grad, MXFP8Tensor):
            grad = _bf16(grad)
        elif ctx.caller is not None:  # an MX gradient made on another stream: keep its inner tensors until read here
            streams.record(grad, torch.cuda.current_stream(grad.device))
        gx = ctx.steps.dispatch_backward(grad, h, quantize=ctx.grad_quantize)
        return gx, None, None, None, None, None, None


class CombineFn(torch.autograd.Function):
    """``(expert_out, topk_weights) -> combine``; backward = ``steps.combine_backward`` (gradient of both)."""

    @staticmethod
    def forward(ctx, expert_out, topk_weights, steps, handle: EPHandle, quantize, grad_quantize, grad_format,
                caller=None):
        # handle and weights were checked by the caller (EPGroup.combine); the steps check the rest
        h = with_weights(handle, topk_weights.detach())
        ctx.steps, ctx.handle, ctx.grad_quantize, ctx.grad_format = steps, h, grad_quantize, grad_format
        ctx.caller = caller  # the caller's stream when called with stream= (this runs on the communication stream)
        ctx.w_dtype = topk_weights.dtype
        ctx.set_materialize_grads(False)
        ctx.saved_kind = None
        q = steps._quantize(quantize)
        if ctx.needs_input_grad[1]:
            y, saved = steps.combine_checked(expert_out, h, q, keep_rows=True)
            rows = saved.rows
            if isinstance(rows, MXTensor):
                ctx.saved_kind = ("mx", rows.mode)
                ctx.save_for_backward(topk_weights, rows.qdata, rows.row_scales())
            else:
                ctx.saved_kind = ("dense", None)
                ctx.save_for_backward(topk_weights, rows)
        else:  # no route-weight gradient wanted: keep nothing but the weights
            y = steps.combine_checked(expert_out, h, q, keep_rows=False)
            ctx.save_for_backward(topk_weights)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        h: EPHandle = ctx.handle
        if grad_y is None:
            grad_y = torch.zeros(h.num_tokens, h.config.hidden, dtype=torch.bfloat16, device=h.device)
        w, *tensors = ctx.saved_tensors  # torch raises here if the weights were modified in place since forward
        saved = None
        if ctx.saved_kind is not None:
            if ctx.saved_kind[0] == "mx":
                saved = CombineSaved(rows=MXTensor(qdata=tensors[0], scales=tensors[1], axis=1, mode=ctx.saved_kind[1]))
            else:
                saved = CombineSaved(rows=tensors[0])
        h = with_weights(h, w.detach())
        grads = ctx.steps.combine_backward(_bf16(grad_y), h, saved, quantize=ctx.grad_quantize)
        g = grads.grad_expert_out
        if isinstance(g, MXTensor):
            g = MXFP8Tensor(g, dtype=torch.bfloat16) if ctx.grad_format == "mx" else g.dequantize(torch.bfloat16)
            if ctx.caller is not None and isinstance(g, MXFP8Tensor):  # most likely read on the caller's stream
                streams.record(g, ctx.caller)
        gw = None if grads.grad_weights is None else grads.grad_weights.to(ctx.w_dtype)
        return g, gw, None, None, None, None, None, None


def dispatch(steps, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             grad_quantize: Optional[bool], stream: Optional[torch.cuda.Stream] = None) -> Dispatched:
    """Eager differentiable dispatch (see :meth:`EPGroup.dispatch`; ``stream`` checked by the caller). With
    ``stream``: run on it (:mod:`mxcomm.ep.streams`), the result carries the event."""
    if stream is None:
        return _dispatch(steps, x, topk_idx, topk_weights, grad_quantize, None)
    caller = streams.begin(stream, (x, topk_idx, topk_weights))
    with torch.cuda.stream(stream):
        res = _dispatch(steps, x, topk_idx, topk_weights, grad_quantize, caller)
        event = streams.finish(stream, res, caller)
    return replace_fields(res, event=event)


def _dispatch(steps, x, topk_idx, topk_weights, grad_quantize, caller) -> Dispatched:
    # Weights that require grad go in detached: dispatch does not depend on them (its output needs a gradient
    # only when x does); the handle carries the attached tensor to combine.
    grad_w = isinstance(topk_weights, torch.Tensor) and topk_weights.requires_grad
    w_in = topk_weights.detach() if grad_w else topk_weights
    if _recorded(x):
        box = _Box()
        out = DispatchFn.apply(x, steps, topk_idx, w_in, grad_quantize, box, caller)
        res: Dispatched = box.result
        if out is not res.x:
            res = replace_fields(res, x=out)
    else:  # nothing to record: the step itself (what DispatchFn.forward runs)
        res = steps.dispatch(x, topk_idx, w_in)
    return replace_fields(res, handle=replace_fields(res.handle, topk_weights=topk_weights)) if grad_w else res


def combine(steps, expert_out: torch.Tensor, handle: EPHandle, w: torch.Tensor, quantize: Optional[bool],
            grad_quantize: Optional[bool], grad_format: str, stream: Optional[torch.cuda.Stream] = None):
    """Eager differentiable combine (see :meth:`EPGroup.combine`; arguments validated by the caller): the bfloat16
    ``[T, H]`` output, or with ``stream`` a :class:`~mxcomm.ep.streams.Combined` (output + event of the call on
    ``stream``)."""
    if stream is None:
        if not _recorded(expert_out, w):  # nothing to record: what CombineFn.forward runs
            # the handle's own weights (their version checked by the caller) need no new handle
            h = handle if w is handle.topk_weights and not w.requires_grad else with_weights(handle, w.detach())
            return steps.combine_checked(expert_out, h, steps._quantize(quantize), keep_rows=False)
        return CombineFn.apply(expert_out, w, steps, handle, quantize, grad_quantize, grad_format)
    caller = streams.begin(stream, (expert_out, w, handle))
    with torch.cuda.stream(stream):
        y = CombineFn.apply(expert_out, w, steps, handle, quantize, grad_quantize, grad_format, caller)
        event = streams.finish(stream, y, caller)
    return streams.Combined(y=y, event=event)


#: The same calls as graph breaks, for torch.compile of a group whose exact output sizes cannot be traced (the
#: eager calls skip the wrapper: it costs host time on every call).
dispatch_graph_break = torch.compiler.disable(dispatch)
combine_graph_break = torch.compiler.disable(combine)

__all__ = ["DispatchFn", "CombineFn", "dispatch", "combine", "dispatch_graph_break", "combine_graph_break"]
