"""The timed calls of one benchmark case: this library's dispatch/combine, the reference path and the
plain BF16 all-to-all baseline (torch's ``all_to_all_vdev_2d`` lives in :mod:`mxcomm.bench.symm`).

Each ``*_case`` function builds everything a call needs OUTSIDE the timed region (send buffers,
a dispatch handle for combine, random expert outputs) and returns a zero-argument callable that
performs exactly the call being measured.
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


def ep_combine_case(group: EPGroup, inputs: BenchInputs, world, *, seed: int) -> CaseCall:
    """``group.combine(expert_out, handle)`` with the handle of one untimed dispatch and random expert rows.

    Quantized transport follows the config (MXFP8 when ``precision == "mxfp8"``).
    """
    res, handle = group.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    out = random_rows(res.num_rows, group.config.hidden, inputs.x.device, seed, world.rank)
    del res
    return CaseCall(fn=lambda: group.combine(out, handle), transport=ep_transport(group, world))


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
    inputs: ``dispatch_equal`` (offsets, counts, payload and scale bytes identical), ``combine_max_abs_diff``."""
    a, ha = group.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    b, hb = ref.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights)
    same = torch.equal(a.offs.cpu(), b.offs.cpu()) and torch.equal(a.counts.cpu(), b.counts.cpu())
    if same and group.config.precision == "mxfp8":
        same = (a.x.qdata.shape == b.x.qdata.shape
                and torch.equal(a.x.qdata.view(torch.uint8), b.x.qdata.view(torch.uint8))
                and torch.equal(a.x.scales, b.x.scales))
    elif same:
        same = a.x.shape == b.x.shape and torch.equal(a.x.view(torch.int16), b.x.view(torch.int16))
    if ha.num_rows != hb.num_rows:
        return dict(dispatch_equal=False, combine_max_abs_diff=None)
    out = random_rows(a.num_rows, group.config.hidden, inputs.x.device, seed + 1, rank)
    ya = group.combine(out, ha)
    yb = ref.combine(out, hb)
    diff = float((ya.float() - yb.float()).abs().max()) if ya.numel() else 0.0
    return dict(dispatch_equal=bool(same), combine_max_abs_diff=diff)


__all__ = ["CaseCall", "random_rows", "ep_dispatch_case", "ep_combine_case", "a2a_dispatch_case", "a2a_combine_case",
           "check_against_reference", "ep_transport", "a2a_transport"]
