"""The EP steps as ``torch.library`` custom ops with static shapes: how :meth:`EPGroup.dispatch
<mxcomm.ep.group.EPGroup.dispatch>` / :meth:`~mxcomm.ep.group.EPGroup.combine` run under ``torch.compile`` (with
``EPConfig.exact_sizes=False``) without a graph break. Internal: users call the group's methods, which route here
when compiling; the ops also run eagerly (same values).

Why ``exact_sizes=False`` only: the fake implementations must give exact output shapes without running the op.
With ``exact_sizes=False`` the dispatch output has the static worst-case row count ``R = max_recv_rows(config, W)``
(:func:`mxcomm.ep.plan.max_recv_rows`); everything else is sized from ``T``, ``k``, ``W``, ``E``, ``H``. (Exact
sizes would need unbacked symints.)

Ops (namespace ``mxcomm_ep``; opaque to the compiler, each a collective; arguments are tensors, ints and strs):

* ``dispatch(x, topk_idx, topk_weights, gid) -> Tensor[]``: ``[payload, scales, *plan, *state]``.
  payload float8_e4m3fn ``[R, H]`` (mxfp8) or bfloat16 ``[R, H]``; scales uint8 GROUPED_M
  ``[grouped_m_rows(R, El), round_up(H/32, 4)]`` on ``offs`` (mxfp8) or uint8 ``[0]``; ``plan`` the
  :class:`RoutingPlan` tensors in :data:`PLAN_TENSORS` order; ``state`` the backend's handle state
  (``Backend.state_tensors``; none for the ``torch`` backend).
* ``dispatch_backward(grad, topk_idx, handle, gid, quantize) -> Tensor``: bfloat16 ``[T, H]``.
  An :class:`MXFP8Tensor` ``grad`` is routed (``register_torch_dispatch``) to
  ``dispatch_backward_mx(qdata, scales, group_offs, layout, mode, ...)`` (decoded, summed per (token, rank)).
* ``combine(expert_out, topk_weights, topk_idx, handle, gid, quantize) -> y``: bfloat16 ``[T, H]``. When the
  weights need a gradient the autograd Function keeps ``expert_out`` itself (the route-weight gradient is formed
  where those rows are); nothing else is kept.
* ``combine_backward(grad_y, topk_weights, topk_idx, handle, expert_out, gid, quantize, has_saved,
  grad_mx) -> (g_payload, g_scales, grad_w)``: gradient of ``expert_out`` in the dispatch layout:
  with ``grad_mx`` and MXFP8 transport float8 ``[R, H]`` + GROUPED_M scales, else bfloat16 ``[R, H]``
  (dequantized inside the op) + uint8 ``[0]``; grad_w float32 ``[T, k]`` (zeros when not ``has_saved``).
* ``dense(x, dtype) -> Tensor``: the dense value of a dispatch output (:mod:`mxcomm.ep.dense`).

Group registry: ops cannot take an :class:`EPGroup`, so :data:`~mxcomm.ep.registry.GROUPS` maps a small int id to
the group (weakly held; ids are never reused). Every group registers itself when it is built and keeps its id in
``EPGroup.op_id``, which the compiler reads as a constant attribute.

Handle: the :class:`EPHandle` a compiled dispatch returns holds the plan tensors (outputs of the dispatch op) and
the backend's state as flat tensors (``EPHandle.op_state``); each op rebuilds the backend's full handle from them
(the reference backend's host-side split sizes are recomputed there from ``plan.send_splits`` / ``recv_splits``: a
host sync inside an opaque op). A handle with ``op_state`` is always combined through the ops.

Autograd: ``torch.autograd.Function``s around the ops (dynamo traces them into the graph). The MX dispatch output
is ONE value, an :class:`MXFP8Tensor` built from the op's payload/scales inside the ``Function`` (logical dtype
bfloat16). Its gradient may be bfloat16 or an MXFP8Tensor (the ``dispatch_backward`` op is written so that
dynamo's speculation of the backward with an MXFP8Tensor gradient and the real bfloat16 gradient both trace). Not
supported under torch.compile: ``grad_format="mx"`` (an MXFP8Tensor *gradient* created in the backward graph does
not trace in torch 2.13: dynamo fails with "create_node using arg not from this SubgraphTracer"); it works in eager
mode, and combine raises NotImplementedError for it when compiling.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..mx import MXTensor, ScaleLayout
from ..mx.layouts import grouped_m_rows, round_up
from ..mx.scales import BLOCK
from ..mx.subclass import MXFP8Tensor
from .dense import dense, grouped_m_dequantize  # noqa: F401  (part of this module's ops, re-exported)
from .handle import CombineSaved, Dispatched, EPHandle
from .plan import PLAN_TENSORS, RoutingPlan, max_recv_rows
from .registry import GROUPS


def _meta(gid: int):
    g = GROUPS.get(gid)
    cfg = g.config
    W = g.world_size
    El = cfg.num_local_experts(W)
    return g, cfg, W, El, max_recv_rows(cfg, W)


def _handle_shapes(group, cfg, W: int, El: int, R: int, T) -> list:
    E, k = cfg.num_experts, cfg.topk
    plan = {
        "counts": (W, E), "dest_rank": (T, k), "dest_row": (T, k), "send_pos": (T, k), "send_order": (T * k,),
        "send_splits": (W,), "num_send": (1,), "recv_splits": (W,), "expert_counts": (El,), "offs": (El,),
        "src_row_start": (W, El), "src_send_pos": (W, El), "num_rows": (1,), "num_recv": (1,),
    }
    return [plan[n] for n in PLAN_TENSORS] + list(group.backend.state_shapes(T, R))


def _flatten_handle(group, h: EPHandle) -> list:
    out = [getattr(h.plan, n) for n in PLAN_TENSORS] + list(group.backend.state_tensors(h))
    # fresh, contiguous copies: op outputs must not alias each other (and backend buffers are reused)
    return [t.to(torch.int32).contiguous().clone() for t in out]


def _plan_of(group, tensors, T: int) -> RoutingPlan:
    cfg = group.config
    return RoutingPlan(
        rank=group.rank, world_size=group.world_size, num_experts=cfg.num_experts,
        num_local_experts=group.num_local_experts, align=cfg.align, topk=cfg.topk, num_tokens=T,
        **dict(zip(PLAN_TENSORS, list(tensors)[:len(PLAN_TENSORS)])),
    )


def _unflatten_handle(group, tensors, topk_idx, topk_weights) -> EPHandle:
    """The backend's full :class:`EPHandle` from the flat tensors an op received (inside an op: may sync)."""
    cfg = group.config
    tensors = list(tensors)
    T = topk_idx.shape[0]
    plan = _plan_of(group, tensors, T)
    return EPHandle(
        config=cfg, group_id=group.op_id, plan=plan, topk_idx=topk_idx, topk_weights=topk_weights,
        weights_version=topk_weights._version, num_tokens=T, num_rows=max_recv_rows(cfg, group.world_size),
        device=topk_idx.device, **group.backend.handle_fields(plan, tensors[len(PLAN_TENSORS):]),
    )


def op_tensors(h: EPHandle) -> list:
    """The flat tensors an op takes for ``h`` (a handle of a compiled dispatch)."""
    return [getattr(h.plan, n) for n in PLAN_TENSORS] + list(h.op_state)


def _empty_u8(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=like.device)


# ---------------------------------------------------------------------------- the ops ----

@torch.library.custom_op("mxcomm_ep::dispatch", mutates_args=())
def _dispatch_impl(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, gid: int) -> list[torch.Tensor]:
    group, cfg, W, El, R = _meta(gid)
    if cfg.exact_sizes:
        raise ValueError("mxcomm_ep::dispatch needs EPConfig.exact_sizes=False (static output shapes)")
    res = group.steps.dispatch(x, topk_idx, topk_weights)
    if res.num_rows != R:  # pragma: no cover - backend contract
        raise RuntimeError(f"dispatch returned {res.num_rows} rows, expected max_recv_rows = {R}")
    if isinstance(res.x, MXFP8Tensor):
        payload, scales = res.x.qdata.contiguous(), res.x.scales.contiguous()
    else:
        payload, scales = res.x.contiguous(), _empty_u8(x)
    # payload/scales are fresh tensors in both backends (the nvshmem backend copies out of its buffers)
    return [payload, scales] + _flatten_handle(group, res.handle)


@_dispatch_impl.register_fake
def _dispatch_fake(x, topk_idx, topk_weights, gid):
    g, cfg, W, El, R = _meta(gid)
    H, T = cfg.hidden, x.shape[0]
    if cfg.precision == "mxfp8":
        payload = x.new_empty(R, H, dtype=torch.float8_e4m3fn)
        scales = x.new_empty(grouped_m_rows(R, El), round_up(H // BLOCK, 4), dtype=torch.uint8)
    else:
        payload, scales = x.new_empty(R, H, dtype=torch.bfloat16), x.new_empty(0, dtype=torch.uint8)
    return [payload, scales] + [x.new_empty(s, dtype=torch.int32) for s in _handle_shapes(g, cfg, W, El, R, T)]


@torch.library.custom_op("mxcomm_ep::dispatch_backward", mutates_args=())
def _dispatch_backward_impl(
    grad: torch.Tensor, topk_idx: torch.Tensor, handle: list[torch.Tensor], gid: int, quantize: int
) -> torch.Tensor:
    group = GROUPS.get(gid)
    h = _unflatten_handle(group, handle, topk_idx, torch.zeros(topk_idx.shape, device=topk_idx.device))
    return group.steps.dispatch_backward(grad.to(torch.bfloat16).contiguous(), h, quantize=bool(quantize))


@_dispatch_backward_impl.register_fake
def _dispatch_backward_fake(grad, topk_idx, handle, gid, quantize):
    cfg = GROUPS.get(gid).config
    return grad.new_empty(topk_idx.shape[0], cfg.hidden, dtype=torch.bfloat16)


@torch.library.custom_op("mxcomm_ep::dispatch_backward_mx", mutates_args=())
def _dispatch_backward_mx_impl(
    qdata: torch.Tensor, scales: torch.Tensor, group_offs: Optional[torch.Tensor], layout: str, mode: str,
    topk_idx: torch.Tensor, handle: list[torch.Tensor], gid: int,
) -> torch.Tensor:
    group = GROUPS.get(gid)
    h = _unflatten_handle(group, handle, topk_idx, torch.zeros(topk_idx.shape, device=topk_idx.device))
    mx = MXTensor(qdata=qdata, scales=scales, axis=1, layout=ScaleLayout(layout), mode=mode,
                  orig_dtype=torch.bfloat16, group_offs=group_offs)
    return group.steps.dispatch_backward(mx, h)


@_dispatch_backward_mx_impl.register_fake
def _dispatch_backward_mx_fake(qdata, scales, group_offs, layout, mode, topk_idx, handle, gid):
    cfg = GROUPS.get(gid).config
    return qdata.new_empty(topk_idx.shape[0], cfg.hidden, dtype=torch.bfloat16)


@torch.library.register_torch_dispatch("mxcomm_ep::dispatch_backward", MXFP8Tensor)
def _dispatch_backward_of_mx(mode, func, types, args, kwargs):
    grad, topk_idx, handle, gid, _quantize = args
    if grad.axis != 1:
        raise ValueError(f"an MX gradient of a dispatch output must be row-wise (axis 1), got axis {grad.axis}")
    return torch.ops.mxcomm_ep.dispatch_backward_mx(
        grad.qdata, grad.scales, grad.group_offs, grad.scale_layout.value, grad.mode, topk_idx, handle, gid
    )


@torch.library.custom_op("mxcomm_ep::combine", mutates_args=())
def _combine_impl(
    expert_out: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor, handle: list[torch.Tensor],
    gid: int, quantize: int,
) -> torch.Tensor:
    group = GROUPS.get(gid)
    h = _unflatten_handle(group, handle, topk_idx, topk_weights)
    return group.steps.combine(expert_out, h, quantize=bool(quantize))


@_combine_impl.register_fake
def _combine_fake(expert_out, topk_weights, topk_idx, handle, gid, quantize):
    H = GROUPS.get(gid).config.hidden
    return expert_out.new_empty(topk_idx.shape[0], H, dtype=torch.bfloat16)


@torch.library.custom_op("mxcomm_ep::combine_backward", mutates_args=())
def _combine_backward_impl(
    grad_y: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor, handle: list[torch.Tensor],
    expert_out: torch.Tensor, gid: int, quantize: int, has_saved: int, grad_mx: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = GROUPS.get(gid)
    h = _unflatten_handle(group, handle, topk_idx, topk_weights)
    saved = CombineSaved(rows=expert_out) if has_saved else None
    grads = group.steps.combine_backward(grad_y.to(torch.bfloat16).contiguous(), h, saved, quantize=bool(quantize))
    g = grads.grad_expert_out
    if isinstance(g, MXTensor) and grad_mx:
        payload, scales = g.qdata.contiguous(), g.scales.contiguous()
    else:
        payload = g.dequantize(torch.bfloat16) if isinstance(g, MXTensor) else g.contiguous()
        scales = _empty_u8(grad_y)
    gw = grads.grad_weights
    if gw is None:
        gw = torch.zeros(topk_idx.shape, dtype=torch.float32, device=grad_y.device)
    return payload, scales, gw.to(torch.float32).contiguous()


@_combine_backward_impl.register_fake
def _combine_backward_fake(grad_y, topk_weights, topk_idx, handle, expert_out, gid, quantize, has_saved, grad_mx):
    _g, cfg, W, El, R = _meta(gid)
    H = cfg.hidden
    gw = grad_y.new_empty(tuple(topk_idx.shape), dtype=torch.float32)
    if quantize and grad_mx:
        return (grad_y.new_empty(R, H, dtype=torch.float8_e4m3fn),
                grad_y.new_empty(grouped_m_rows(R, El), round_up(H // BLOCK, 4), dtype=torch.uint8), gw)
    return grad_y.new_empty(R, H, dtype=torch.bfloat16), grad_y.new_empty(0, dtype=torch.uint8), gw


# ---------------------------------------------------------------------------- autograd ----

class _DispatchOpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, gid: int, grad_quantize: int, mx: bool, mode: str):
        outs = torch.ops.mxcomm_ep.dispatch(x, topk_idx, topk_weights, gid)
        payload, scales, handle = outs[0], outs[1], outs[2:]
        ctx.gid, ctx.grad_quantize, ctx.n_handle = gid, grad_quantize, len(handle)
        ctx.save_for_backward(topk_idx, *handle)
        ctx.mark_non_differentiable(*handle)
        if mx:
            offs = handle[PLAN_TENSORS.index("offs")]
            val = MXFP8Tensor(MXTensor(qdata=payload, scales=scales, axis=1, layout=ScaleLayout.GROUPED_M, mode=mode,
                                       orig_dtype=torch.bfloat16, group_offs=offs), dtype=torch.bfloat16)
        else:
            val = payload
        return (val, *handle)

    @staticmethod
    def backward(ctx, grad, *_):
        topk_idx, *handle = ctx.saved_tensors
        gx = torch.ops.mxcomm_ep.dispatch_backward(grad, topk_idx, handle, ctx.gid, ctx.grad_quantize)
        return gx, None, None, None, None, None, None


class _CombineOpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_weights, topk_idx, gid: int, quantize: int, grad_quantize: int, save: int,
                grad_mx: int, mode: str, *handle):
        y = torch.ops.mxcomm_ep.combine(expert_out, topk_weights, topk_idx, list(handle), gid, quantize)
        ctx.gid, ctx.grad_quantize, ctx.save, ctx.grad_mx, ctx.mode = gid, grad_quantize, save, grad_mx, mode
        ctx.w_dtype = topk_weights.dtype
        kept = expert_out if save else expert_out.new_empty(0, dtype=torch.bfloat16)  # the route-weight gradient's rows
        ctx.save_for_backward(topk_weights, topk_idx, kept, *handle)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        w, topk_idx, kept, *handle = ctx.saved_tensors
        payload, scales, gw = torch.ops.mxcomm_ep.combine_backward(
            grad_y, w, topk_idx, handle, kept, ctx.gid, ctx.grad_quantize, ctx.save, ctx.grad_mx
        )
        if ctx.grad_mx and ctx.grad_quantize:
            offs = handle[PLAN_TENSORS.index("offs")]
            g = MXFP8Tensor(MXTensor(qdata=payload, scales=scales, axis=1, layout=ScaleLayout.GROUPED_M,
                                     mode=ctx.mode, orig_dtype=torch.bfloat16, group_offs=offs), dtype=torch.bfloat16)
        else:
            g = payload
        gw = gw.to(ctx.w_dtype) if ctx.save else None
        return (g, gw) + (None,) * (7 + len(handle))


# ------------------------------------------------------------------------- entry points ----

def dispatch(group, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             grad_quantize: Optional[bool]) -> Dispatched:
    """Differentiable, traceable dispatch through the ops (``group.config.exact_sizes`` must be False); called by
    :meth:`EPGroup.dispatch` under torch.compile. The handle carries the plan and the backend state as op outputs
    (``EPHandle.op_state``)."""
    cfg = group.config
    if cfg.exact_sizes:
        raise ValueError("the compiled dispatch needs EPConfig.exact_sizes=False (static shapes)")
    gid = group.op_id
    gq = cfg.precision == "mxfp8" if grad_quantize is None else bool(grad_quantize)
    w_in = topk_weights.detach() if isinstance(topk_weights, torch.Tensor) else topk_weights
    outs = _DispatchOpFn.apply(x, topk_idx, w_in, gid, int(gq), cfg.precision == "mxfp8", cfg.scale_mode)
    val, tensors = outs[0], tuple(outs[1:])
    R = max_recv_rows(cfg, group.world_size)
    n = len(PLAN_TENSORS)
    plan = _plan_of(group, tensors[:n], x.shape[0])
    h = EPHandle(config=cfg, group_id=gid, plan=plan, topk_idx=topk_idx, topk_weights=topk_weights, weights_version=-1,
                 num_tokens=x.shape[0], num_rows=R, device=x.device, op_state=tensors[n:])
    return Dispatched(x=val, offs=plan.offs, counts=plan.expert_counts, num_rows=R, handle=h)


def combine(group, expert_out: torch.Tensor, handle: EPHandle, w: torch.Tensor, quantize: bool, grad_quantize: bool,
            grad_format: str) -> torch.Tensor:
    """Differentiable, traceable combine of a compiled dispatch's ``handle`` through the ops (arguments validated by
    the caller, :meth:`EPGroup.combine`). Returns bfloat16 ``[T, H]``."""
    if grad_format == "mx" and torch.compiler.is_compiling():
        raise NotImplementedError(
            "grad_format='mx' is not supported under torch.compile (an MXFP8Tensor gradient built in the "
            "backward graph does not trace); use grad_format='dense' or run combine eagerly"
        )
    cfg = group.config
    save = int(torch.is_grad_enabled() and w.requires_grad)
    return _CombineOpFn.apply(
        expert_out, w, handle.topk_idx, group.op_id, int(quantize), int(grad_quantize), save,
        int(grad_format == "mx"), cfg.scale_mode, *op_tensors(handle),
    )


__all__ = ["dispatch", "combine", "dense", "op_tensors", "grouped_m_dequantize", "PLAN_TENSORS"]
