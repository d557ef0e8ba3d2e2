"""CUDA-graph replay of the routing plan (``build_plan`` or the Triton plan, + the nvshmem backend's row maps).

Building the plan is ~100 small torch ops, or three Triton kernels after the counts exchange; launching them one by
one costs the host more than the GPU work (measured on the H200: ~2.4 ms of host time against ~0.8 ms of GPU work for
8192 tokens with the torch ops; ~40-60 µs of host time per Triton launch against ~2-9 µs of GPU time).
The plan depends only on the exchanged counts matrix (a symmetric buffer: fixed address) and the
(sanitised) ``topk_idx`` of this call, so it is captured once per token count ``T`` and replayed:
the call copies ``topk_idx`` into the graph's static input, replays, and clones ONE flat int32
buffer that holds every output; the :class:`~mxcomm.ep.plan.RoutingPlan` handed out is made of
views into that clone (so it stays valid after later replays).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .plan import PLAN_TENSORS, RoutingPlan, build_plan


@dataclass(frozen=True)
class PlanOutputs:
    """What one replay produces: the plan and the backend's extra int32 maps (name -> tensor)."""

    plan: RoutingPlan
    extra: dict


def compute_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int,
                 extra_fn: Callable[[RoutingPlan, torch.Tensor], dict]) -> PlanOutputs:
    """Eager path (also what the graph captures): plan + ``extra_fn(plan, topk_idx)``."""
    plan = build_plan(counts, topk_idx, rank, align)
    return PlanOutputs(plan=plan, extra=extra_fn(plan, topk_idx))


class PlanGraph:
    """A captured plan computation for a fixed ``[T, k]`` topk_idx shape and dtype.

    Args:
        counts_buf: the ``[W, E]`` int32 counts matrix (read at replay; fixed address).
        T, k, idx_dtype: shape/dtype of topk_idx.
        compute: ``(counts_buf, topk_idx) -> PlanOutputs``, what is captured (e.g. :func:`compute_plan` with
            rank, align and the extra maps bound; it must not keep ``counts_buf`` itself in its outputs).
        warmup: run ``compute`` once eagerly before capturing (lazy initialisation outside the capture). False
            when ``compute`` has side effects that must happen only at replays (a collective: its kernels
            must already have run eagerly for this shape, so nothing compiles during the capture).
    """

    def __init__(self, counts_buf: torch.Tensor, T: int, k: int, idx_dtype: torch.dtype,
                 compute: Callable[[torch.Tensor, torch.Tensor], PlanOutputs], warmup: bool = True):
        dev = counts_buf.device
        self.idx = torch.full((T, k), -1, dtype=idx_dtype, device=dev)

        def body() -> PlanOutputs:
            return compute(counts_buf, self.idx)

        if warmup:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                body()  # warm-up outside capture (allocator, cub temp storage)
            torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = body()
            names = [n for n in PLAN_TENSORS] + sorted(out.extra)
            shapes = [tuple((getattr(out.plan, n) if n in PLAN_TENSORS else out.extra[n]).shape) for n in names]
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            self.flat = torch.empty(sum(sizes), dtype=torch.int32, device=dev)  # from the graph's pool: kept
            self.layout = list(zip(names, shapes, sizes))
            self.sizes = sizes
            self.template = out.plan
            off = 0
            for n, shp, sz in self.layout:
                t = getattr(out.plan, n) if n in PLAN_TENSORS else out.extra[n]
                self.flat[off:off + sz].copy_(t.reshape(-1))
                off += sz

    def __call__(self, topk_idx: torch.Tensor) -> PlanOutputs:
        """Replay for this call's ``topk_idx`` (same shape/dtype); returns tensors owned by the caller."""
        self.idx.copy_(topk_idx)
        self.graph.replay()
        parts = self.flat.clone().split(self.sizes)  # one op for all views (each op costs the host microseconds)
        vals = {n: (p if len(shp) == 1 else p.view(shp)) for (n, shp, _), p in zip(self.layout, parts)}
        plan = replace(self.template, **{n: vals[n] for n in PLAN_TENSORS})
        return PlanOutputs(plan=plan, extra={n: v for n, v in vals.items() if n not in PLAN_TENSORS})


__all__ = ["PlanGraph", "PlanOutputs", "compute_plan"]
