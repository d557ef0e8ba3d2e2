"""The timed calls of one benchmark case: this library's dispatch/combine and their backward passes, the
reference path and the plain BF16 all-to-all baseline (torch's ``all_to_all_vdev_2d`` lives in
:mod:`mxcomm.bench.symm`).

Each ``*_case`` function builds everything a call needs OUTSIDE the timed region (send buffers, a
dispatch handle for combine and the backward ops, random expert outputs and gradients) and returns a
zero-argument callable that performs exactly the call being measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..ep import EPGroup
from .routing import BenchInputs, RoutingInfo


@dataclass(frozen=True)
class CaseCall:
    """A prepared case: ``fn`` (the timed call), ``transport`` (what carries the bytes), ``notes``."""

    fn: Callable[[], object]
    transport: str
    notes: tuple = ()


def random_rows(rows: int, hidden: int, device: torch.device, seed: int, rank: int) -> torch.Tensor:
    """Deterministic random bfloat16 ``[rows, hidden]`` (stand-in expert outputs) on ``device``."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 7_777_777 + rank * 131 + rows) % (2**63))
    return torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)


def ep_transport(group: EPGroup, world) -> str:
    if group.config.backend == "nvshmem":
        if group.path == "put":
            return ("nvshmem symmetric buffers, Triton kernels into a staging buffer, NVSHMEM put-with-signal "
                    "per (destination, expert) block")
        if group.path == "local":
            return ("nvshmem backend, one rank: Triton kernels write the outputs directly (no symmetric buffer on "
                    "the way)")
        if group.path == "pull":
            return ("nvshmem symmetric buffers, Triton kernels: dispatch receivers pull rows through peer pointers, "
                    "the other ops store into peers' buffers")
        return "nvshmem symmetric buffers, Triton kernels with peer stores"
    return a2a_transport(world)


def a2a_transport(world) -> str:
    t = f"torch.distributed all_to_all_single over {world.side_channel}"
    if world.side_channel == "gloo" and world.device.type == "cuda":
        t += " (GPU tensors staged through host memory)"
    return t


def ep_dispatch_case(group: EPGroup, inputs: BenchInputs, world) -> CaseCall:
    """``group.dispatch(x, topk_idx, topk_weights)`` (the whole Python call, output allocation included)."""
    x, idx, w = inputs.x, inputs.topk_idx, inputs.topk_weights
    return CaseCall(fn=lambda: group.dispatch(x, idx, w), transport=ep_transport(group, world))


def _dispatched(group: EPGroup, inputs: BenchInputs, world, seed: int) -> tuple:
    """One untimed dispatch: ``(handle, rows)``, ``rows`` random bfloat16 ``[R, H]`` in the dispatch output's
    layout (``R = handle.num_rows``; stand-in expert outputs or gradients of the dispatch output)."""
    res = group.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    handle = res.handle
    rows = random_rows(res.num_rows, group.config.hidden, inputs.x.device, seed, world.rank)
    return handle, rows


def ep_combine_case(group: EPGroup, inputs: BenchInputs, world, *, seed: int) -> CaseCall:
    """``group.combine(expert_out, handle)`` with the handle of one untimed dispatch and random expert rows
    ``expert_out`` bfloat16 ``[R, H]``.

    Quantized transport follows the config (MXFP8 when ``precision == "mxfp8"``).
    """
    handle, out = _dispatched(group, inputs, world, seed)
    return CaseCall(fn=lambda: group.combine(out, handle), transport=ep_transport(group, world))


def ep_combine_bwd_case(group: EPGroup, inputs: BenchInputs, world, *, seed: int) -> CaseCall:
    """``group.steps.combine_backward(grad_y, handle, saved)``: route-weighted gradients to the experts (the rows travel
    like dispatch's) plus the route-weight gradient from ``saved``.

    Built untimed: one dispatch, one ``combine_for_backward`` of random expert rows ``[R, H]`` (its
    ``CombineSaved``), ``grad_y`` random bfloat16 ``[T, H]``. Transport follows the config (MXFP8 with
    ``precision == "mxfp8"``); returns a ``CombineGrads`` (``grad_expert_out`` ``[R, H]``, ``grad_weights``
    float32 ``[T, k]``).
    """
    handle, out = _dispatched(group, inputs, world, seed)
    _, saved = group.steps.combine_for_backward(out, handle)
    grad_y = random_rows(inputs.x.shape[0], group.config.hidden, inputs.x.device, seed + 1, world.rank)
    return CaseCall(fn=lambda: group.steps.combine_backward(grad_y, handle, saved), transport=ep_transport(group, world))


def ep_dispatch_bwd_case(group: EPGroup, inputs: BenchInputs, world, *, seed: int) -> CaseCall:
    """``group.steps.dispatch_backward(grad_recv, handle)``: each row's gradient back to its origin, summed over k (the
    rows travel like combine's); ``grad_recv`` random bfloat16 ``[R, H]`` in the layout of one untimed dispatch.

    Transport follows the config (MXFP8 with ``precision == "mxfp8"``); returns bfloat16 ``[T, H]``.
    """
    handle, grad_recv = _dispatched(group, inputs, world, seed)
    return CaseCall(fn=lambda: group.steps.dispatch_backward(grad_recv, handle), transport=ep_transport(group, world))


def _a2a(world) -> Callable:
    """``all_to_all_single(out, inp, out_splits, in_splits)`` on the world group, staging through host
    memory when the group cannot take the tensors' device (gloo with GPU tensors)."""
    stage = world.side_channel == "gloo" and world.device.type == "cuda"

    def run(out, inp, out_splits, in_splits):
        if stage:
            out_h = torch.empty(out.shape, dtype=out.dtype)
            dist.all_to_all_single(out_h, inp.cpu(), out_splits, in_splits)
            out.copy_(out_h)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
        return out

    return run


def a2a_dispatch_case(inputs: BenchInputs, routing: RoutingInfo, world) -> CaseCall:
    """Plain BF16 ``all_to_all_single`` of the routed rows (one row per selection, send order by
    destination expert). The send buffer ``x[send_tok]`` is built once, outside the timed region."""
    dev = inputs.x.device
    send = inputs.x[routing.send_tok.to(dev)].contiguous()
    out = torch.empty(sum(routing.recv_splits), inputs.x.shape[1], dtype=torch.bfloat16, device=dev)
    run, rs, ss = _a2a(world), routing.recv_splits, routing.send_splits
    return CaseCall(fn=lambda: run(out, send, rs, ss), transport=a2a_transport(world),
                    notes=("send buffer permuted once outside the timed region; no output permute",))


def a2a_combine_case(inputs: BenchInputs, routing: RoutingInfo, world, *, seed: int) -> CaseCall:
    """The reverse BF16 ``all_to_all_single``: every received row goes back to its origin (no reduction)."""
    dev = inputs.x.device
    H = inputs.x.shape[1]
    send = random_rows(sum(routing.recv_splits), H, dev, seed, world.rank)
    out = torch.empty(sum(routing.send_splits), H, dtype=torch.bfloat16, device=dev)
    run, rs, ss = _a2a(world), routing.recv_splits, routing.send_splits
    return CaseCall(fn=lambda: run(out, send, ss, rs), transport=a2a_transport(world),
                    notes=("rows returned in receive order; no weighted reduction",))


def check_against_reference(group: EPGroup, ref: EPGroup, inputs: BenchInputs, *, seed: int, rank: int) -> dict:
    """One untimed dispatch + combine of ``group`` and of the reference ``ref`` (same precision) on the same
    inputs: ``dispatch_equal`` (offsets, counts, payload and scale bytes identical), ``combine_max_abs_diff``.

    ``group`` (and ``ref``, built from the same options) may run in the no-host-sync mode (worst-case output rows,
    e.g. for ``--cuda-graph``): then the rows up to the last group's end (``offs[-1]``) and the groups' scale
    tile-rows are compared (the rows past them are not written)."""
    a = group.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    ha = a.handle
    b = ref.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    hb = b.handle
    R = hb.num_rows
    n = int(b.offs[-1]) if b.offs.numel() else 0  # the rows the groups cover (== R with exact sizes)
    same = (ha.num_rows >= R and torch.equal(a.offs.cpu(), b.offs.cpu())
            and torch.equal(a.counts.cpu(), b.counts.cpu()))
    if same and group.config.precision == "mxfp8":
        # the scale tile-rows of the groups (the grouped matrix's rows past them are padding, written as zeros with
        # exact sizes and not written in the no-sync mode)
        offs = b.offs.to(torch.int64)
        ns = int(((offs - torch.cat([offs.new_zeros(1), offs[:-1]]) + 127) // 128 * 128).sum())
        same = (torch.equal(a.x.qdata[:n].view(torch.uint8), b.x.qdata[:n].view(torch.uint8))
                and a.x.scales.shape[0] >= ns and torch.equal(a.x.scales[:ns], b.x.scales[:ns]))
    elif same:
        same = torch.equal(a.x[:n].view(torch.int16), b.x[:n].view(torch.int16))
    if ha.num_rows < R:
        return dict(dispatch_equal=False, combine_max_abs_diff=None)
    out = random_rows(a.num_rows, group.config.hidden, inputs.x.device, seed + 1, rank)
    ya = group.combine(out, ha)
    yb = ref.combine(out[:R].contiguous(), hb)
    diff = float((ya.float() - yb.float()).abs().max()) if ya.numel() else 0.0
    return dict(dispatch_equal=bool(same), combine_max_abs_diff=diff)


__all__ = ["CaseCall", "random_rows", "ep_dispatch_case", "ep_combine_case", "ep_combine_bwd_case",
           "ep_dispatch_bwd_case", "a2a_dispatch_case", "a2a_combine_case", "check_against_reference", "ep_transport",
           "a2a_transport"]
