"""CUDA-graph replay of the routing plan (``build_plan`` or the Triton plan, + the nvshmem backend's row maps).

Building the plan is ~100 small torch ops, or one Triton kernel after the counts exchange; launching them one by one
costs the host more than their GPU work (a launch's host time against these kernels' GPU time: docs/benchmarks.md,
``python -m mxcomm.bench.tools.host_costs``).
The plan depends only on the exchanged counts matrix (a symmetric buffer: fixed address) and the
(sanitised) ``topk_idx`` of this call, so it is captured once per token count ``T`` and replayed:
the call copies ``topk_idx`` into the graph's static input and replays (:meth:`PlanGraph.replay`); what it uses and
keeps (the :class:`~mxcomm.ep.plan.RoutingPlan` of a handle) are views into clones of the graph's outputs
(:meth:`PlanGraph.snapshot`), enqueued right after the replay, so they stay valid after later replays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from ..plan import PLAN_TENSORS, RoutingPlan, build_plan


@dataclass(frozen=True)
class PlanOutputs:
    """What one replay produces: the plan and the backend's extra int32 maps (name -> tensor)."""

    plan: RoutingPlan
    extra: dict

    def named(self) -> dict:
        """The plan's tensors and the extra maps by name (what :class:`OutputCopier` copies)."""
        return {**{n: getattr(self.plan, n) for n in PLAN_TENSORS}, **self.extra}

    @staticmethod
    def scalars_of(plan: RoutingPlan) -> dict:
        """The fields of ``plan`` that are not tensors (the same for every call of a token count)."""
        return {f.name: getattr(plan, f.name) for f in fields(RoutingPlan) if f.name not in PLAN_TENSORS}

    @staticmethod
    def from_named(vals: dict, scalars: dict) -> "PlanOutputs":
        """The inverse of :meth:`named`: ``vals`` (name -> tensor, e.g. the views :class:`OutputCopier` makes of a
        copy) and the plan's ``scalars`` (:meth:`scalars_of`)."""
        plan = RoutingPlan(**scalars, **{n: vals[n] for n in PLAN_TENSORS})
        return PlanOutputs(plan=plan, extra={n: v for n, v in vals.items() if n not in PLAN_TENSORS})

    @staticmethod
    def of_copy(copy: OutputsCopy, scalars: dict, now: tuple = ()) -> PlanOutputs:
        """The outputs read from ``copy``: the extra maps as views, the plan a :class:`CopiedPlan` of ``scalars``
        (the tensors named in ``now`` viewed here, the others at their first read)."""
        return PlanOutputs(plan=CopiedPlan(scalars, copy, now),
                           extra={n: copy.view(n) for n in copy.copier.extra_names})


class CopiedPlan(RoutingPlan):
    """A :class:`RoutingPlan` read from a copy of a captured plan's outputs (:class:`OutputsCopy`): the tensors
    named in ``now`` made views of the copy at once (those a call is known to read: made while the device still
    runs it, before the call's host sync), every other one at its first read, and kept. A one-rank dispatch and its
    combine read five of the fifteen, and a view costs the host a microsecond or two. Otherwise a ``RoutingPlan``
    (frozen; the same fields and values)."""

    def __init__(self, scalars: dict, copy: OutputsCopy, now: tuple = ()):
        d = self.__dict__
        d.update(scalars)
        d["_copy"] = copy
        for n in now:
            d[n] = copy.view(n)

    def __getattr__(self, name: str):
        # reached only for an attribute not set yet: a plan tensor at its first read
        copy = self.__dict__.get("_copy")
        if copy is None or name not in PLAN_TENSORS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        t = self.__dict__[name] = copy.view(name)
        return t


def compute_plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, align: int,
                 extra_fn: Callable[[RoutingPlan, torch.Tensor], dict]) -> PlanOutputs:
    """Eager path (also what the graph captures): plan + ``extra_fn(plan, topk_idx)``."""
    plan = build_plan(counts, topk_idx, rank, align)
    return PlanOutputs(plan=plan, extra=extra_fn(plan, topk_idx))


@dataclass(frozen=True)
class _Piece:
    """Where one output lives in a copy: in the main storage's clone (dtype, shape, stride, element offset) or
    (``main`` False) in the int32 aux buffer at ``offset`` with ``shape``."""

    name: str
    main: bool
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


class OutputCopier:
    """Cheap copies of a fixed set of named output tensors (a captured graph's, refreshed by every replay).

    The outputs that share the most common storage (the Triton plan allocates all its tables in one buffer) are
    copied with that whole storage in one clone and rebuilt as views of it (their dtypes, shapes and strides kept);
    the others go through one int32 buffer that :meth:`fill` writes (call it where the outputs are produced: inside
    the capture, so each replay refreshes it) - their values must fit int32 (plan tables and expert ids do), and
    they come back as contiguous int32.

    Args:
        named: name -> tensor, all on one device.
    """

    def __init__(self, named: dict):
        self.named = named
        by_storage: dict = {}
        for n, t in named.items():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(n)
        main = max(by_storage.values(), key=len)
        self.aux_names = [n for n in named if n not in main]
        dev = named[main[0]].device
        self.aux = torch.empty(sum(named[n].numel() for n in self.aux_names), dtype=torch.int32, device=dev)
        self._main = named[main[0]]
        self.main_bytes = None  # the main storage as bytes, made at the first copy (outside any capture)
        pieces, off = [], 0
        for n in self.aux_names:
            pieces.append(_Piece(n, False, torch.int32, tuple(named[n].shape), (), off))
            off += named[n].numel()
        for n in main:
            t = named[n]
            pieces.append(_Piece(n, True, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
        self.pieces = pieces
        self.by_name = {p.name: p for p in pieces}
        self.extra_names = tuple(n for n in named if n not in PLAN_TENSORS)  # the outputs that are not the plan's

    def fill(self) -> None:
        """Copy the outputs outside the main storage into the aux buffer (one copy each)."""
        off = 0
        for n in self.aux_names:
            t = self.named[n]
            self.aux[off:off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()

    def copy(self) -> dict:
        """name -> a copy of that output as of the last :meth:`fill` (aux) / now (main storage), owned by the
        caller (a clone of the main storage and one of the aux buffer if it is used, then views)."""
        return self.clone().views()

    def clone(self) -> OutputsCopy:
        """Clones of the main storage and of the aux buffer (if it is used), not yet viewed."""
        aux = self.aux.clone() if self.aux_names else self.aux  # (nothing to copy when every output is in main)
        return OutputsCopy(self, self.main_storage().clone(), aux)

    def main_storage(self) -> torch.Tensor:
        """The main storage as a flat uint8 tensor (made at the first use, outside any capture)."""
        if self.main_bytes is None:
            self.main_bytes = torch.empty(0, dtype=torch.uint8, device=self._main.device).set_(
                self._main.untyped_storage())
        return self.main_bytes


@dataclass(frozen=True, eq=False)
class OutputsCopy:
    """A copy of the outputs of ``copier``: ``main`` (uint8, laid out as the main storage) and ``aux`` (int32, as
    :meth:`OutputCopier.fill` lays it out), each output made a view of it by :meth:`view`."""

    copier: OutputCopier
    main: torch.Tensor
    aux: torch.Tensor
    typed: dict = field(default_factory=dict)  # dtype -> main viewed as it (made at its first use, shared)

    def view(self, name: str) -> torch.Tensor:
        """The output ``name`` (its dtype, shape and strides; aux outputs contiguous int32)."""
        p = self.copier.by_name[name]
        if not p.main:
            return self.aux[p.offset:p.offset + math.prod(p.shape)].view(p.shape)
        base = self.typed.get(p.dtype)
        if base is None:
            base = self.typed[p.dtype] = self.main.view(p.dtype)
        return base.as_strided(p.shape, p.stride, p.offset)

    def views(self) -> dict:
        """name -> :meth:`view` of every output."""
        return {p.name: self.view(p.name) for p in self.copier.pieces}


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

    :meth:`replay` runs it (its outputs stay in the graph's own memory, overwritten by the next replay),
    :meth:`snapshot` copies them into tensors the caller owns (:class:`OutputCopier`: one clone when the outputs
    share one storage, as the nvshmem backend's do; the graph itself copies only the outputs outside the plan's main
    buffer); calling the object does both.
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
        # captured on a side stream without ``torch.cuda.graph``'s entry work (a device synchronize, ``gc.collect()``
        # and ``empty_cache()``: tens of milliseconds in a large process, paid at every new token count); only this
        # stream's work is recorded, and the allocations it makes come from the graph's private pool
        cap = torch.cuda.Stream(dev)
        cap.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(cap):
            self.graph.capture_begin()
            try:
                out = body()
                # from the graph's pool: kept, refreshed by every replay
                self.copier = OutputCopier(out.named())
                self.copier.fill()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(cap)
        self.scalars = PlanOutputs.scalars_of(out.plan)

    def replay(self, topk_idx: torch.Tensor) -> None:
        """Run the graph for this call's ``topk_idx`` (same shape/dtype); :meth:`snapshot` copies its outputs."""
        self.idx.copy_(topk_idx)
        self.graph.replay()

    def snapshot(self) -> PlanOutputs:
        """Copies of the outputs of the last replay (enqueue before the next replay), owned by the caller."""
        return PlanOutputs.from_named(self.copier.copy(), self.scalars)

    def __call__(self, topk_idx: torch.Tensor) -> PlanOutputs:
        """:meth:`replay` then :meth:`snapshot`: tensors owned by the caller."""
        self.replay(topk_idx)
        return self.snapshot()


__all__ = ["PlanGraph", "PlanOutputs", "CopiedPlan", "OutputCopier", "OutputsCopy", "compute_plan"]
